//! The outbox's schema as a relay needs it, and the inbox's as a consumer
//! needs it, checked at start: a missing table,
//! column or trigger, or a sequence setting that would break the settled
//! horizon, is a configuration error naming what to run, never an outage to
//! retry.

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::error::{Error, ErrorKind, Result};

/// Shards an outbox's rows are spread over: `outbox_events.shard` is
/// `hashtextextended(subject, 0) & 63` (migration `20260101000005`), so one
/// subject's rows share a shard. Relays own shards; `outboxctl` counts them.
pub const SHARDS: usize = 64;

/// How long [`check_outbox_layout_at_start`] and [`check_inbox_layout_at_start`]
/// wait for a schema that is not there yet (a component started beside the
/// service that migrates) before they refuse.
pub const SCHEMA_WAIT: Duration = Duration::from_secs(20);

/// The columns of `outbox_events` a relay reads or writes.
const COLUMNS: &[&str] = &[
    "id",
    "event_type",
    "source",
    "subject",
    "time",
    "data",
    "created_at",
    "published_at",
    "attempts",
    "next_attempt_at",
    "last_error",
    "traceparent",
    "tracestate",
    "seq",
    "shard",
    "skipped_at",
    "published_stream",
    "published_seq",
    "due_at",
    "released_at",
    "cancelled_at",
    "cancelled_by",
];

/// The triggers of `outbox_events`: the seq every row gets at insert, the
/// wake-up the relays listen for, and the scheduled rows' due time and
/// wake-up.
const TRIGGERS: &[&str] = &[
    "outbox_events_assign_seq",
    "outbox_events_notify",
    "outbox_events_schedule",
    "outbox_events_notify_due",
];

const MIGRATE: &str = "run the outbox migrations as the schema owner (outbox_pg::migrate, or the \
                       files of outbox-pg/migrations/ in order), with the search_path the \
                       services use";

/// Checks that the outbox the pool's `search_path` leads to is complete, as a
/// relay needs it, and that `outbox_events_seq` hands out values in commit
/// order's terms: one at a time (`CACHE 1`: a session caching a block would
/// take values below those other sessions already committed, behind the
/// relays' cursors), never cycling, rising.
///
/// # Errors
/// [`ErrorKind::Schema`] naming each missing table, column or trigger and
/// what to run; [`ErrorKind::Config`] naming a sequence setting and the
/// `ALTER SEQUENCE` that fixes it; [`ErrorKind::Database`] if the catalogs
/// cannot be read.
pub async fn check_outbox_layout(pool: &PgPool) -> Result<()> {
    let columns: Vec<String> = COLUMNS.iter().map(|&c| c.to_owned()).collect();
    let triggers: Vec<String> = TRIGGERS.iter().map(|&t| t.to_owned()).collect();
    let found = sqlx::query_file!("queries/outbox_layout.sql", &columns, &triggers)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("reading the outbox's schema", e))?;
    if !found.table {
        return Err(Error::new(
            ErrorKind::Schema,
            format!("table outbox_events not found through the search_path: {MIGRATE}"),
        ));
    }
    let mut missing = Vec::new();
    if !found.missing_columns.is_empty() {
        missing.push(format!(
            "column(s) {} of outbox_events",
            found.missing_columns.join(", ")
        ));
    }
    if !found.missing_triggers.is_empty() {
        missing.push(format!(
            "trigger(s) {} on outbox_events (missing or disabled)",
            found.missing_triggers.join(", ")
        ));
    }
    if !found.sequence {
        missing.push("sequence outbox_events_seq".to_owned());
    }
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorKind::Schema,
            format!(
                "the outbox schema is not complete: {} missing; {MIGRATE}",
                missing.join("; ")
            ),
        ));
    }
    sequence_settings(found.seq_cache, found.seq_cycle, found.seq_increment)
}

/// The verdict on `outbox_events_seq`'s settings.
fn sequence_settings(
    cache: Option<i64>,
    cycle: Option<bool>,
    increment: Option<i64>,
) -> Result<()> {
    let mut wrong = Vec::new();
    let mut fix = Vec::new();
    if cache.is_some_and(|c| c != 1) {
        wrong.push(format!(
            "CACHE {} (a session caching values takes some below those others already \
             committed, behind the relays' cursors)",
            cache.unwrap_or_default()
        ));
        fix.push("cache 1");
    }
    if cycle == Some(true) {
        wrong.push("CYCLE (values would start again from the bottom)".to_owned());
        fix.push("no cycle");
    }
    if increment.is_some_and(|i| i < 1) {
        wrong.push(format!(
            "INCREMENT {} (values must rise)",
            increment.unwrap_or_default()
        ));
        fix.push("increment 1");
    }
    if wrong.is_empty() {
        return Ok(());
    }
    Err(config(format!(
        "sequence outbox_events_seq is set {}: the relay refuses it; run `alter sequence \
         outbox_events_seq {}` as its owner",
        wrong.join(", "),
        fix.join(" ")
    )))
}

/// The columns of the inbox tables the consumer runtime reads or writes.
const INBOX: &[(&str, &[&str])] = &[
    (
        "inbox_events",
        &[
            "consumer",
            "event_id",
            "event_type",
            "subject",
            "event_time",
            "handled_at",
            "sequence",
        ],
    ),
    (
        "inbox_dead_letters",
        &[
            "consumer",
            "stream",
            "stream_sequence",
            "subject",
            "event_id",
            "delivery_count",
            "reason",
            "error",
            "headers",
            "payload",
            "created_at",
        ],
    ),
    (
        "inbox_consumers",
        &[
            "consumer",
            "stream",
            "filter_subjects",
            "ack_floor",
            "created_at",
            "updated_at",
            "stopped_at",
            "owner",
        ],
    ),
];

/// The table an ordered consumer's leadership is recorded in.
const LEASES: (&str, &[&str]) = (
    "inbox_leases",
    &[
        "consumer",
        "epoch",
        "holder",
        "acquired_at",
        "released",
        "checkpoint_seq",
        "checkpoint_pending",
    ],
);

/// Checks that the inbox the pool's `search_path` leads to has the tables and
/// columns the consumer runtime uses (`inbox_leases` too when `ordered`).
///
/// # Errors
/// [`ErrorKind::Schema`] naming each missing table or column and what to
/// run; [`ErrorKind::Database`] if the catalogs cannot be read.
pub async fn check_inbox_layout(pool: &PgPool, ordered: bool) -> Result<()> {
    let mut tables = Vec::new();
    let mut columns = Vec::new();
    for (table, cols) in INBOX.iter().chain(ordered.then_some(&LEASES)) {
        for col in *cols {
            tables.push((*table).to_owned());
            columns.push((*col).to_owned());
        }
    }
    let missing: Vec<String> =
        sqlx::query_file_scalar!("queries/missing_columns.sql", &tables, &columns)
            .fetch_one(pool)
            .await
            .map_err(|e| Error::database("reading the inbox's schema", e))?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Schema,
        format!(
            "the inbox schema is not complete where the search_path leads: {} missing; {MIGRATE}",
            missing.join(", ")
        ),
    ))
}

/// [`check_outbox_layout`] at a relay's start-up, where the database may not
/// answer yet and the migrations may still be running: each try bounded by
/// `timeout`, a schema not there yet tried again for [`SCHEMA_WAIT`]
/// (`waiting` is called once, with the reason, when the wait begins). A check
/// that cannot run passes with the reason, for the caller to log.
///
/// # Errors
/// [`ErrorKind::Schema`] once [`SCHEMA_WAIT`] has passed; [`ErrorKind::Config`]
/// at once, as [`check_outbox_layout`].
pub async fn check_outbox_layout_at_start(
    pool: &PgPool,
    timeout: Duration,
    waiting: impl FnOnce(&Error),
) -> Result<Option<String>> {
    at_start(timeout, waiting, || check_outbox_layout(pool)).await
}

/// [`check_inbox_layout`] at a consumer's start-up, as
/// [`check_outbox_layout_at_start`] does for the relay.
///
/// # Errors
/// [`ErrorKind::Schema`] once [`SCHEMA_WAIT`] has passed.
pub async fn check_inbox_layout_at_start(
    pool: &PgPool,
    ordered: bool,
    timeout: Duration,
    waiting: impl FnOnce(&Error),
) -> Result<Option<String>> {
    at_start(timeout, waiting, || check_inbox_layout(pool, ordered)).await
}

/// Runs `check` until it passes, refuses for good, or cannot run.
async fn at_start<F, Fut>(
    timeout: Duration,
    waiting: impl FnOnce(&Error),
    mut check: F,
) -> Result<Option<String>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let started = Instant::now();
    let mut waiting = Some(waiting);
    loop {
        match tokio::time::timeout(timeout, check()).await {
            Ok(Ok(())) => return Ok(None),
            Ok(Err(e)) if e.kind() == ErrorKind::Schema && started.elapsed() < SCHEMA_WAIT => {
                if let Some(say) = waiting.take() {
                    say(&e);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(Err(e)) if matches!(e.kind(), ErrorKind::Schema | ErrorKind::Config) => {
                return Err(e);
            }
            Ok(Err(e)) => return Ok(Some(e.to_string())),
            Err(_) => {
                return Ok(Some(format!(
                    "the database did not answer within {}",
                    crate::HumanDuration(timeout)
                )));
            }
        }
    }
}

fn config(message: String) -> Error {
    Error::new(ErrorKind::Config, message)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code

    use super::sequence_settings;

    #[test]
    fn the_sequence_must_hand_out_one_value_at_a_time_rising_without_cycling() {
        sequence_settings(Some(1), Some(false), Some(1)).unwrap();
        sequence_settings(Some(1), Some(false), Some(5)).unwrap();
        for (cache, cycle, increment, named, fix) in [
            (20, false, 1, "CACHE 20", "cache 1"),
            (1, true, 1, "CYCLE", "no cycle"),
            (1, false, -1, "INCREMENT -1", "increment 1"),
        ] {
            let err = sequence_settings(Some(cache), Some(cycle), Some(increment)).unwrap_err();
            let message = err.to_string();
            assert!(message.contains(named), "{message}");
            assert!(
                message.contains(&format!("alter sequence outbox_events_seq {fix}")),
                "{message}"
            );
        }
    }
}
