//! `outbox-bench`: the relay measured side by side in one run, on one
//! machine, against real PostgreSQL and nats-server processes (started here
//! unless `DATABASE_URL` / `NATS_URL` are set). The relay is the shipped
//! `outbox-relay` binary, run as processes with its default flags. Absolute
//! numbers drift with the machine; the ratios within a run are the result.
//! Every figure is the median of `--rounds` rounds with its range (never the
//! best run); modes of one part run side by side in each round, their order
//! rotated, each on a fresh database and stream.
//!
//! ```text
//! cargo build --release -p outbox-bench
//! cargo build --release -p outbox-publisher --features cli --bins
//! target/release/outbox-bench                         # every relay part, 5 rounds
//! target/release/outbox-bench --events 5000 --drain-rows 20000 --rss-rows 0 --rounds 1
//! ```
//!
//! Parts (`--parts`, comma-separated):
//!
//! 1. `raw-vs-relay` ([`raw_vs_relay`]): raw JetStream publishing, a simple
//!    batched relay and `outbox-relay` with 1, 2 and 4 processes, and where a
//!    batch spends its time.
//! 2. `drain` ([`drain`]): a sustained drain with the vacuum horizon free and
//!    pinned by an open snapshot, rate per window.
//! 3. `latency` ([`latency`]): commit → broker at a paced 1,000 events/s.
//! 4. `rss` ([`rss`]): the relay's memory draining a million rows.
//! 5. `writers` ([`writers`]): writer commits/s with the NOTIFY trigger on
//!    and off.
//! 6. `consumer` ([`consumer`], not run by default): the `billing` binary,
//!    ordered replicas against unordered ones; needs
//!    `cargo build --release -p example-billing` too.
//! 7. `inbox` ([`inbox`], not run by default): `billing` as users run it,
//!    one process, with its default flags and `--batch` values, against an
//!    ack-only JetStream consumer and a hand-written consumer of billing's
//!    SQL draining the same backlog; then the latency of requests to
//!    `subscriptions` through `outbox-relay` and billing at a paced rate.
//!    Needs `cargo build --release -p example-billing -p
//!    example-subscriptions` too.
//! 8. `replicas` ([`replicas`], not run by default): one `outbox-relay`
//!    process draining the same backlog into an R1 stream on one
//!    nats-server and into an R3 stream on a 3-node cluster it starts.
//! 9. `audit` ([`audit`], not run by default): one `outbox-relay` process
//!    draining a backlog while its audit reads back the rows it published
//!    before, against the same drain with the audit off.
//! 10. `hot` ([`hot`], not run by default): one `outbox-relay` process
//!     draining a backlog of one envelope subject (one entity) against the
//!     same number of events spread over `--subjects`.
//! 11. `scheduled` ([`scheduled`], not run by default): one `outbox-relay`
//!     process draining immediate rows from a table with and without a
//!     million rows scheduled a day ahead, the relay's statements under
//!     `EXPLAIN` on both; then the due lane publishing a burst of rows due at
//!     the same second.
//! 12. `catch-up` ([`catch_up`], not run by default): one `outbox-relay`
//!     process restarted on a backlog written while it was stopped, polling
//!     against `--source wal` (which catches up from its slot).

mod audit;
mod catch_up;
mod consumer;
mod cpu;
mod drain;
mod handwritten;
mod harness;
mod hot;
mod inbox;
mod latency;
mod raw_vs_relay;
mod replicas;
mod rss;
mod scheduled;
mod stats;
mod writers;

use std::time::Duration;

use clap::{Parser, ValueEnum};
use outbox_testkit::{nats, postgres};

use crate::harness::{Env, Result};

/// A part of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    RawVsRelay,
    Drain,
    Latency,
    Rss,
    Writers,
    Consumer,
    Inbox,
    Replicas,
    Audit,
    Hot,
    Scheduled,
    CatchUp,
}

#[derive(Debug, Parser)]
#[command(
    name = "outbox-bench",
    about = "The outbox relay measured against real servers"
)]
pub(crate) struct Args {
    /// Parts to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "raw-vs-relay,drain,latency,rss,writers"
    )]
    parts: Vec<Part>,
    /// Rounds of every part.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Events for relay vs raw.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) events: usize,
    /// Distinct envelope subjects (entities) the events are spread over.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) subjects: usize,
    /// `outbox-relay` process counts to compare in relay vs raw.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub(crate) replicas: Vec<usize>,
    /// Backlog for the sustained drain (0 skips it).
    #[arg(long, default_value_t = 300_000)]
    pub(crate) drain_rows: usize,
    /// Window for drain rates.
    #[arg(long, default_value = "2s", value_parser = parse_secs)]
    pub(crate) window: Duration,
    /// Paced write rate for the latency part, events per second.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) rate: usize,
    /// How long the latency part writes, in seconds.
    #[arg(long, default_value_t = 10)]
    pub(crate) latency_secs: u64,
    /// Backlog the relay's memory is watched draining (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) rss_rows: usize,
    /// Concurrent writers in the writer part.
    #[arg(long, default_value_t = 16)]
    pub(crate) writers: usize,
    /// How long each writer mode runs, in seconds.
    #[arg(long, default_value_t = 10)]
    pub(crate) writer_secs: u64,
    /// Events per mode of the consumer-order comparison.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) consumer_events: usize,
    /// Backlog per mode of the inbox part's throughput comparison (0 skips it).
    #[arg(long, default_value_t = 20_000)]
    pub(crate) inbox_events: usize,
    /// `billing --batch` values the inbox part drains the backlog with,
    /// beside billing with its default flags (always run).
    #[arg(long, value_delimiter = ',', default_value = "64,1", value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub(crate) inbox_batches: Vec<u16>,
    /// Leave out the hand-written consumer of billing's SQL (async-nats and
    /// sqlx, no inbox-consumer crate) that the inbox part drains beside billing.
    #[arg(long)]
    pub(crate) inbox_no_handwritten: bool,
    /// `billing --batch` values also drained with `--no-relay` (none by
    /// default): what billing's own relay for `invoice.created` costs.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub(crate) inbox_no_relay: Vec<u16>,
    /// Deliveries per transaction of the `inbox-consumer` library run in
    /// process with a no-op handler (a footnote: the inbox's own cost);
    /// none by default.
    #[arg(long, value_delimiter = ',')]
    pub(crate) inbox_library: Vec<u16>,
    /// Paced write rates of the inbox part's latency runs, events per second,
    /// comma-separated (0 alone skips them).
    #[arg(long = "inbox-rate", value_delimiter = ',', default_value = "200,500")]
    pub(crate) inbox_rates: Vec<usize>,
    /// The `outbox-relay --source` values of the inbox part's latency runs
    /// (the relay between `subscriptions` and billing), comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "poll,wal")]
    pub(crate) inbox_sources: Vec<scheduled::Source>,
    /// How long each inbox latency run writes, in seconds.
    #[arg(long, default_value_t = 10)]
    pub(crate) inbox_latency_secs: u64,
    /// `billing --batch` values of the inbox part's latency runs, beside
    /// billing with its default flags (always run); none by default.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub(crate) inbox_latency_batches: Vec<u16>,
    /// Backlog of the stream-replicas part, drained into R1 and into R3.
    #[arg(long, default_value_t = 50_000)]
    pub(crate) replica_events: usize,
    /// Backlog of the audit part: published first, then audited while a
    /// second backlog of as many events is drained.
    #[arg(long, default_value_t = 50_000)]
    pub(crate) audit_events: usize,
    /// Backlog of the hot-entity part, of one subject and spread.
    #[arg(long, default_value_t = 30_000)]
    pub(crate) hot_events: usize,
    /// Immediate events drained in the scheduled part, with and without the
    /// future rows (0 skips that half).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) scheduled_events: usize,
    /// Rows scheduled a day ahead in the scheduled part's table.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) scheduled_rows: usize,
    /// Rows due at the same second in the scheduled part's due-lane burst
    /// (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) due_events: usize,
    /// How far ahead the burst is scheduled (whole seconds): time to write
    /// and vacuum it before it falls due.
    #[arg(long, default_value = "10s", value_parser = parse_secs)]
    pub(crate) due_lead: Duration,
    /// `--batch-size` of the relay in the due-lane burst (its default when
    /// unset): the due claim reads up to this many rows per shard.
    #[arg(long)]
    pub(crate) due_batch_size: Option<usize>,
    /// The relay's sources the scheduled part runs, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "poll,wal")]
    pub(crate) scheduled_sources: Vec<scheduled::Source>,
    /// Backlog written while the relay is stopped in the catch-up part.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) catch_up_events: usize,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    s.trim_end_matches('s')
        .parse::<f64>()
        .map(Duration::from_secs_f64)
        .map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let command: Vec<String> = std::env::args().collect();
    let pg = postgres().await?;
    let broker = nats()?;
    let env = Env::new(pg.url(), broker.url()).await?;
    let version: String = sqlx::query_scalar("show server_version")
        .fetch_one(&env.admin)
        .await?;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "{}\nPostgreSQL {version}, nats-server at {}, {cores} cores\nrelay: {}, copied with its logs to {}",
        command.join(" "),
        env.nats_url,
        env.relay_built(),
        env.logs.display()
    );

    let mut summary = Vec::new();
    let runs = |part| args.parts.contains(&part);
    if runs(Part::RawVsRelay) && args.events > 0 {
        raw_vs_relay::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Drain) && args.drain_rows > 0 {
        drain::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Latency) && args.rate > 0 && args.latency_secs > 0 {
        latency::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Rss) && args.rss_rows > 0 {
        rss::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Writers) && args.writers > 0 {
        writers::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Consumer) && args.consumer_events > 0 {
        consumer::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Inbox) {
        inbox::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Replicas) && args.replica_events > 0 {
        replicas::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Audit) && args.audit_events > 0 {
        audit::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Hot) && args.hot_events > 0 {
        hot::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::Scheduled) {
        scheduled::run(&env, &args, &mut summary).await?;
    }
    if runs(Part::CatchUp) && args.catch_up_events > 0 {
        catch_up::run(&env, &args, &mut summary).await?;
    }

    println!(
        "\n# Summary\n\n`{}` — PostgreSQL {version}, {cores} cores, medians of {} rounds (range); relay {}\n",
        command.join(" "),
        args.rounds,
        env.relay_built()
    );
    for section in &summary {
        println!("{section}");
    }
    let notes = env.notes();
    if notes.is_empty() {
        println!("Relay logs: no warning or error lines, every relay exited 0.");
    } else {
        println!("Notes:\n");
        for note in notes {
            println!("- {note}");
        }
    }
    Ok(())
}
