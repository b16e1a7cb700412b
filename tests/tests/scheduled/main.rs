//! Scheduled events end to end, through the shipped `outbox-relay` binary run
//! as an operator runs it, through a kill -9 and a broker outage; once with
//! the polling source and once with `--source wal` (the two tests take turns,
//! each on a database and a nats-server of its own).
//!
//! The run, from T0 (the times are in `plan`):
//! - Two relays with the default flags (but for the database, the broker, the
//!   stream and the source) on one database and one JetStream stream.
//! - 8 writer tasks schedule 10,000 events (`Outbox::schedule`, `Due::At`, 5
//!   per transaction) due over T0+6 s..T0+66 s, 300 of them together at
//!   T0+20 s, and 1,000 more in transactions that roll back.
//! - 1,000 of the events are cancelled, each 2–6 s before its time (the
//!   answer must be Cancelled); 200 others are cancelled within ±50 ms of
//!   their time (Cancelled, never in the stream; or AlreadyPublished, in the
//!   stream: never both, never neither).
//! - At T0+20 s, relay-1 (polling: half the shards; WAL: the leader) is
//!   killed -9 as soon as it holds rows of the burst in hand, and restarted
//!   2 s after the survivor holds every shard.
//! - At T0+34 s, nats-server is stopped (SIGTERM) for 10 s and started again
//!   on its port and store, so the stream survives.
//!
//! Once every row is published or cancelled: the stream holds each
//! non-cancelled committed event once (by `Nats-Msg-Id` and envelope id) and
//! nothing else; no row was published before its due time
//! (`published_at >= due_at`, by the database's clock); and the 99th
//! percentile of lateness (`published_at - due_at`) is at most 1 s for every
//! row not due in the outage window (from 1 s before the broker stopped to 5 s
//! after it was back), the killed relay's rows included. Reported apart
//! (`report`): the rows relay-1 had taken (released before it died, in its
//! shards), which the shard's next owner publishes; the rows due from 1 s
//! before the kill to 1 s after the survivor held every shard; and those of
//! the outage window.
//!
//! A summary line gives the counts, the race outcomes and the lateness
//! percentiles (`cargo test … -- --nocapture` shows it).

#[path = "../support/mod.rs"]
mod support;

mod plan;
mod report;
mod scenario;

use scenario::Source;

/// The two runs take turns: each measures lateness against a bound, and side
/// by side on 2 cores (8 writers, 2 relays, a server each) they measured the
/// other's load.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_relays_publish_each_scheduled_event_once_on_time_through_a_kill_9_and_a_broker_outage()
 {
    let _turn = ONE_AT_A_TIME.lock().await;
    scenario::run(Source::Poll).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_relays_publish_each_scheduled_event_once_on_time_through_a_kill_9_and_a_broker_outage()
{
    let _turn = ONE_AT_A_TIME.lock().await;
    scenario::run(Source::Wal).await;
}
