//! The relay's metrics, recorded through the `metrics` facade (install any
//! recorder; the `outbox-relay` binary serves them in Prometheus text format
//! on `/metrics`, histograms with buckets).
//!
//! Names follow the Prometheus conventions: counters end `_total`, units are
//! suffixes in plural base units (`_seconds`, `_rows`), gauges carry no
//! `_total`, and every name starts `outbox_`.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `outbox_relay_published_total` | counter | `event_type` |
//! | `outbox_relay_duplicates_acked_total` | counter | `event_type` |
//! | `outbox_relay_publish_failures_total` | counter | `reason` |
//! | `outbox_relay_capped_rows_total` | counter | (rows that reached the attempt cap) |
//! | `outbox_relay_pruned_rows_total` | counter | (published rows deleted by retention) |
//! | `outbox_relay_batch_rows` | histogram | (rows claimed per batch) |
//! | `outbox_relay_batch_phase_seconds` | histogram | `phase`: `horizon`, `claim`, `due_claim`, `publish`, `mark` |
//! | `outbox_relay_publish_latency_seconds` | histogram | (publish → PubAck) |
//! | `outbox_relay_commit_to_ack_seconds` | histogram | (row `created_at` → PubAck; immediate rows only) |
//! | `outbox_relay_backlog_rows` | gauge | (unpublished rows under the cap; a scheduled row once due) |
//! | `outbox_relay_past_cap_rows` | gauge | (unpublished rows at or past the cap) |
//! | `outbox_relay_oldest_unpublished_age_seconds` | gauge | (since insert; a scheduled row's since its due time) |
//! | `outbox_relay_scheduled_rows` | gauge | (scheduled rows not due yet) |
//! | `outbox_relay_scheduled_next_due_timestamp_seconds` | gauge | (Unix time the earliest of them is due; 0 when none) |
//! | `outbox_relay_scheduled_lateness_seconds` | histogram | (a scheduled row's due time → PubAck, by the database's clock at the take) |
//! | `outbox_relay_database_up` | gauge | 1 while the relay's last database round trip succeeded, else 0 |
//! | `outbox_relay_broker_up` | gauge | 1 while NATS is connected and publishes are acked, else 0 |
//! | `outbox_relay_horizon_held_seconds` | gauge | how long the settled horizon has waited for transactions still running (0 when it moves); a relay logs who holds it once this passes 30 s |
//! | `outbox_relay_stream_up` | gauge | 1 while the relay's stream exists (as last read), 0 while it is gone |
//! | `outbox_relay_wal_up` | gauge | `--source wal`: 1 while this relay leads and reads its slot, else 0 |
//! | `outbox_relay_wal_lag_bytes` | gauge | WAL between the server's position and the slot's confirmed one |
//! | `outbox_relay_wal_lag_seconds` | gauge | age of the oldest commit read from the slot and not yet confirmed (0 when caught up) |
//! | `outbox_relay_wal_slot_lost_total` | counter | slots found dropped or invalidated and made again (their rows went through the polling path) |
//! | `outbox_relay_wal_stranded_total` | counter | rows the WAL source had read and confirmed that were still fresh afterwards (a row made fresh again by plain SQL, or a fault of the relay): they went through the polling path; see the runbook |
//! | `outbox_relay_wal_slot_at_risk` | gauge | 1 while the slot's WAL is being reserved past `max_slot_wal_keep_size` (`wal_status` `unreserved`) or it is lost, else 0 |
//! | `outbox_relay_audit_checked_total` | counter | (published rows whose message the audit read back) |
//! | `outbox_relay_audit_republished_total` | counter | (rows whose message the stream lost, made unpublished again; once per row) |
//! | `outbox_relay_audit_lag_seconds` | gauge | (age of the oldest audit mark: rows published after it wait for their check; at least the duplicate window plus its margin) |
//!
//! The table-wide gauges (backlog, past cap, oldest age, scheduled) are reported by one
//! relay, the owner of shard 0, every `stats_interval`; the `_up` gauges by
//! every relay, as its state changes and every `stats_interval`.

use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::store::Stats;

pub(crate) const PUBLISHED: &str = "outbox_relay_published_total";
pub(crate) const AUDIT_CHECKED: &str = "outbox_relay_audit_checked_total";
pub(crate) const AUDIT_REPUBLISHED: &str = "outbox_relay_audit_republished_total";
pub(crate) const AUDIT_LAG: &str = "outbox_relay_audit_lag_seconds";
pub(crate) const DUPLICATES: &str = "outbox_relay_duplicates_acked_total";
pub(crate) const FAILURES: &str = "outbox_relay_publish_failures_total";
pub(crate) const CAPPED: &str = "outbox_relay_capped_rows_total";
pub(crate) const PRUNED: &str = "outbox_relay_pruned_rows_total";
/// The histogram of rows per batch (its buckets are not seconds).
pub const BATCH_ROWS: &str = "outbox_relay_batch_rows";
pub(crate) const BATCH_PHASE: &str = "outbox_relay_batch_phase_seconds";
pub(crate) const PUBLISH_LATENCY: &str = "outbox_relay_publish_latency_seconds";
pub(crate) const COMMIT_TO_ACK: &str = "outbox_relay_commit_to_ack_seconds";
pub(crate) const BACKLOG: &str = "outbox_relay_backlog_rows";
pub(crate) const PAST_CAP: &str = "outbox_relay_past_cap_rows";
pub(crate) const OLDEST_AGE: &str = "outbox_relay_oldest_unpublished_age_seconds";
pub(crate) const SCHEDULED: &str = "outbox_relay_scheduled_rows";
pub(crate) const NEXT_DUE: &str = "outbox_relay_scheduled_next_due_timestamp_seconds";
pub(crate) const LATENESS: &str = "outbox_relay_scheduled_lateness_seconds";
pub(crate) const DATABASE_UP: &str = "outbox_relay_database_up";
pub(crate) const BROKER_UP: &str = "outbox_relay_broker_up";
pub(crate) const HORIZON_HELD: &str = "outbox_relay_horizon_held_seconds";
pub(crate) const STREAM_UP: &str = "outbox_relay_stream_up";
pub(crate) const WAL_UP: &str = "outbox_relay_wal_up";
pub(crate) const WAL_LAG_BYTES: &str = "outbox_relay_wal_lag_bytes";
pub(crate) const WAL_LAG_SECONDS: &str = "outbox_relay_wal_lag_seconds";
pub(crate) const WAL_SLOT_LOST_TOTAL: &str = "outbox_relay_wal_slot_lost_total";
pub(crate) const WAL_STRANDED_TOTAL: &str = "outbox_relay_wal_stranded_total";
pub(crate) const WAL_SLOT_AT_RISK: &str = "outbox_relay_wal_slot_at_risk";
pub(crate) const CLIENT_CLOSED: &str = "outbox_relay_nats_client_closed_total";

/// Every metric name the relay records.
pub const NAMES: &[&str] = &[
    PUBLISHED,
    DUPLICATES,
    FAILURES,
    CAPPED,
    PRUNED,
    BATCH_ROWS,
    BATCH_PHASE,
    PUBLISH_LATENCY,
    COMMIT_TO_ACK,
    BACKLOG,
    PAST_CAP,
    OLDEST_AGE,
    SCHEDULED,
    NEXT_DUE,
    LATENESS,
    DATABASE_UP,
    BROKER_UP,
    HORIZON_HELD,
    STREAM_UP,
    WAL_UP,
    WAL_LAG_BYTES,
    WAL_LAG_SECONDS,
    WAL_SLOT_LOST_TOTAL,
    WAL_STRANDED_TOTAL,
    WAL_SLOT_AT_RISK,
    CLIENT_CLOSED,
    AUDIT_CHECKED,
    AUDIT_REPUBLISHED,
    AUDIT_LAG,
];

/// Registers descriptions and units with the installed recorder. Call once
/// after installing it; recording works without this.
pub fn describe() {
    describe_publishing();
    describe_table();
    describe_health();
    describe_wal();
}

/// What was published, and how fast.
fn describe_publishing() {
    describe_counter!(
        PUBLISHED,
        "Events acknowledged by JetStream and marked published"
    );
    describe_counter!(
        DUPLICATES,
        "PubAcks flagged duplicate (a republish the stream dropped)"
    );
    describe_counter!(FAILURES, "Failed publishes, by reason");
    describe_counter!(
        CAPPED,
        "Rows that reached the attempt cap and are left alone"
    );
    describe_counter!(PRUNED, "Published rows deleted by retention");
    describe_histogram!(BATCH_ROWS, Unit::Count, "Rows claimed per batch");
    describe_histogram!(
        BATCH_PHASE,
        Unit::Seconds,
        "Time a batch spends per phase: horizon tick, claim, publish, mark"
    );
    describe_histogram!(PUBLISH_LATENCY, Unit::Seconds, "Publish to PubAck");
    describe_histogram!(COMMIT_TO_ACK, Unit::Seconds, "Row created_at to PubAck");
}

/// The table's backlog.
fn describe_table() {
    describe_gauge!(
        BACKLOG,
        Unit::Count,
        "Unpublished rows under the attempt cap"
    );
    describe_gauge!(
        PAST_CAP,
        Unit::Count,
        "Unpublished rows at or past the attempt cap"
    );
    describe_gauge!(
        OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest unpublished row (a scheduled row's: since its due time)"
    );
    describe_gauge!(
        SCHEDULED,
        Unit::Count,
        "Scheduled rows not due yet (not in the backlog)"
    );
    describe_gauge!(
        NEXT_DUE,
        Unit::Seconds,
        "When the earliest scheduled row falls due (Unix time; 0 when none)"
    );
    describe_histogram!(
        LATENESS,
        Unit::Seconds,
        "Scheduled rows: due time to PubAck, by the database's clock at the take"
    );
}

/// Reachability, the audit, the horizon.
fn describe_health() {
    describe_gauge!(
        DATABASE_UP,
        "1 while the relay's last database round trip succeeded, else 0"
    );
    describe_counter!(
        AUDIT_CHECKED,
        "Published rows whose message the audit read back from the stream"
    );
    describe_counter!(
        AUDIT_REPUBLISHED,
        "Rows whose acknowledged message the stream lost, made unpublished again to be republished"
    );
    describe_gauge!(
        AUDIT_LAG,
        Unit::Seconds,
        "Age of the oldest audit mark (rows published since wait for their check)"
    );
    describe_gauge!(
        HORIZON_HELD,
        Unit::Seconds,
        "How long the settled horizon has waited for transactions still running"
    );
    describe_gauge!(
        BROKER_UP,
        "1 while the relay is connected to NATS and its publishes are acked, else 0"
    );
    describe_gauge!(
        STREAM_UP,
        "1 while the relay's stream exists (as last read), 0 while it is gone"
    );
    describe_counter!(
        CLIENT_CLOSED,
        "NATS clients found closed under the relay (the run ends; a new client is needed)"
    );
}

/// The WAL source.
fn describe_wal() {
    describe_gauge!(
        WAL_UP,
        "1 while this relay leads its WAL source and reads the slot, else 0"
    );
    describe_gauge!(
        WAL_LAG_BYTES,
        Unit::Bytes,
        "WAL between the server's position and the slot's confirmed one"
    );
    describe_gauge!(
        WAL_LAG_SECONDS,
        Unit::Seconds,
        "Age of the oldest commit read from the slot and not yet confirmed"
    );
    describe_counter!(
        WAL_SLOT_LOST_TOTAL,
        "Replication slots found dropped or invalidated and made again"
    );
    describe_counter!(
        WAL_STRANDED_TOTAL,
        "Rows the WAL source had read and confirmed that were still fresh afterwards (published through the polling path)"
    );
    describe_gauge!(
        WAL_SLOT_AT_RISK,
        "1 while the slot's WAL is unreserved or lost, else 0"
    );
}

/// The metrics of one chain's published rows: the histograms are looked up
/// once and recorded per row, the counters added to once per run of rows of
/// one event type (a chain is one subject's rows, mostly of few types), and
/// on drop, rather than looked up per row.
pub(crate) struct Published {
    latency: metrics::Histogram,
    since_commit: metrics::Histogram,
    event_type: String,
    published: u64,
    duplicates: u64,
}

impl Published {
    pub(crate) fn new() -> Self {
        Self {
            latency: histogram!(PUBLISH_LATENCY),
            since_commit: histogram!(COMMIT_TO_ACK),
            event_type: String::new(),
            published: 0,
            duplicates: 0,
        }
    }

    /// One row acked `latency` after its publish and `since_commit` after
    /// its row was written (`None`: not recorded, for a scheduled row).
    pub(crate) fn record(
        &mut self,
        event_type: &str,
        duplicate: bool,
        latency: Duration,
        since_commit: Option<Duration>,
    ) {
        if event_type != self.event_type {
            self.flush();
            event_type.clone_into(&mut self.event_type);
        }
        self.published += 1;
        self.duplicates += u64::from(duplicate);
        self.latency.record(latency);
        if let Some(since_commit) = since_commit {
            self.since_commit.record(since_commit);
        }
    }

    fn flush(&mut self) {
        if self.published > 0 {
            counter!(PUBLISHED, "event_type" => self.event_type.clone()).increment(self.published);
        }
        if self.duplicates > 0 {
            counter!(DUPLICATES, "event_type" => self.event_type.clone())
                .increment(self.duplicates);
        }
        self.published = 0;
        self.duplicates = 0;
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Counts one failed publish, `reason` its [`FailureKind`](crate::FailureKind)'s label.
pub(crate) fn failed(reason: &'static str) {
    counter!(FAILURES, "reason" => reason).increment(1);
}

/// Registers the audit's metrics at zero, so they are exported before the
/// first finding.
pub(crate) fn register_audit() {
    counter!(AUDIT_CHECKED).increment(0);
    counter!(AUDIT_REPUBLISHED).increment(0);
    gauge!(AUDIT_LAG).set(0.0);
}

/// Counts one row the audit checked.
pub(crate) fn audit_checked() {
    counter!(AUDIT_CHECKED).increment(1);
}

/// Counts one row the audit made unpublished again (its message was lost).
pub(crate) fn audit_republished() {
    counter!(AUDIT_REPUBLISHED).increment(1);
}

/// Sets `outbox_relay_audit_lag_seconds`.
pub(crate) fn audit_lag(seconds: f64) {
    gauge!(AUDIT_LAG).set(seconds);
}

pub(crate) fn capped(n: usize) {
    counter!(CAPPED).increment(n as u64);
}

pub(crate) fn pruned(n: u64) {
    counter!(PRUNED).increment(n);
}

pub(crate) fn batch(size: usize) {
    histogram!(BATCH_ROWS).record(size as f64);
}

/// Time a batch spent in `phase` (`horizon`, `claim`, `publish`, `mark`).
pub(crate) fn phase(phase: &'static str, took: Duration) {
    histogram!(BATCH_PHASE, "phase" => phase).record(took);
}

pub(crate) fn stats(stats: &Stats) {
    gauge!(BACKLOG).set(stats.backlog as f64);
    gauge!(PAST_CAP).set(stats.past_cap as f64);
    gauge!(OLDEST_AGE).set(stats.oldest_age_secs);
    gauge!(NEXT_DUE).set(stats.next_due.unwrap_or(0.0));
}

/// Sets `outbox_relay_scheduled_rows`.
pub(crate) fn scheduled(rows: i64) {
    gauge!(SCHEDULED).set(rows as f64);
}

/// Records how late a scheduled row was published.
pub(crate) fn lateness(seconds: f64) {
    histogram!(LATENESS).record(seconds);
}

/// Sets `outbox_relay_database_up`.
pub(crate) fn horizon_held(held: Duration) {
    gauge!(HORIZON_HELD).set(held.as_secs_f64());
}

pub(crate) fn database_up(up: bool) {
    gauge!(DATABASE_UP).set(if up { 1.0 } else { 0.0 });
}

/// Sets `outbox_relay_broker_up`.
pub(crate) fn broker_up(up: bool) {
    gauge!(BROKER_UP).set(if up { 1.0 } else { 0.0 });
}

/// Sets `outbox_relay_stream_up`.
pub(crate) fn stream_up(up: bool) {
    gauge!(STREAM_UP).set(if up { 1.0 } else { 0.0 });
}

/// Registers the WAL source's series at their resting values, so they are
/// exported (and alerted on) from its start.
pub(crate) fn wal_registered() {
    counter!(WAL_SLOT_LOST_TOTAL).increment(0);
    counter!(WAL_STRANDED_TOTAL).increment(0);
    gauge!(WAL_UP).set(0.0);
    gauge!(WAL_LAG_SECONDS).set(0.0);
    gauge!(WAL_LAG_BYTES).set(0.0);
    gauge!(WAL_SLOT_AT_RISK).set(0.0);
}

/// Sets `outbox_relay_wal_up`.
pub(crate) fn wal_up(up: bool) {
    gauge!(WAL_UP).set(if up { 1.0 } else { 0.0 });
}

/// Sets the slot's lag gauges and whether its WAL is at risk.
pub(crate) fn wal_slot(lag_bytes: Option<i64>, at_risk: bool) {
    if let Some(bytes) = lag_bytes {
        gauge!(WAL_LAG_BYTES).set(bytes.max(0) as f64);
    }
    gauge!(WAL_SLOT_AT_RISK).set(if at_risk { 1.0 } else { 0.0 });
}

/// Sets `outbox_relay_wal_lag_seconds`.
pub(crate) fn wal_lag(lag: Duration) {
    gauge!(WAL_LAG_SECONDS).set(lag.as_secs_f64());
}

/// Counts a slot found lost and made again.
pub(crate) fn wal_slot_lost() {
    counter!(WAL_SLOT_LOST_TOTAL).increment(1);
}

/// Counts a NATS client found closed under the relay.
pub(crate) fn client_closed() {
    counter!(CLIENT_CLOSED).increment(1);
}

/// Counts rows found left behind by the WAL source.
pub(crate) fn wal_stranded(rows: usize) {
    counter!(WAL_STRANDED_TOTAL).increment(u64::try_from(rows).unwrap_or(u64::MAX));
}
