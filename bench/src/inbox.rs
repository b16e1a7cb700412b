//! Part 7: the inbox consumer as users run it: the shipped `billing` binary,
//! one process with its default flags (ordered, `--concurrency 16`,
//! `--batch 64`, its in-process relay for `invoice.created`), against a plain
//! JetStream consumer that only acks and a consumer written by hand that runs
//! billing's SQL without the inbox library ([`handwritten`]).
//!
//! **Throughput from a backlog.** Each mode gets a fresh stream (subjects
//! `subscription.>,invoice.>`, as billing's relay would create it) and, but
//! for ack-only, a fresh database. `--inbox-events` `subscription.created`
//! events (one subscription each) are published to JetStream first; then the
//! consumer starts, and the clock runs from the moment it is ready (billing:
//! its `billing ready` line, after its migrations and its durable consumer
//! exist) until every event is handled (billing and the hand-written
//! consumer: the last invoice's `created_at`, once `count(*)` of `invoices`,
//! polled every 250 ms, reaches the events; ack-only: every ack confirmed).
//! Modes, in the same round, their order rotated: the ack-only consumer (the
//! ceiling), billing with its default flags, billing with each
//! `--inbox-batches` value, the hand-written consumer with its relay, and
//! each `--inbox-no-relay` value with `--no-relay` too (none by default: a
//! diagnostic of what billing's own relay costs; the hand-written consumer
//! then runs without its relay too). Only `DATABASE_URL`, `NATS_URL`,
//! `--stream`, `--metrics-addr` and `--batch` are set.
//!
//! A footnote mode, `--inbox-library` values: the `inbox-consumer` library
//! itself, in this process, with a handler that does nothing (decode the
//! payload, return): trace → metrics → dedupe → router, `run` for batch 1
//! and `run_batched` above, concurrency 16 and room for two batches per slot
//! as billing sets it. It is what the inbox costs on its own, without
//! billing's handler (an advisory lock, an invoice row and an outbox event
//! per delivery) and billing's relay; the end is the last inbox row's
//! `handled_at` (its transaction's start).
//!
//! The ack-only consumer is a durable pull consumer written here with
//! async-nats: the same filter subjects as billing, explicit acks,
//! `max_ack_pending` 10,000, pulls of 1,000, and each message acked with
//! `double_ack` (as the inbox runtime acks: confirmed by the server), up to
//! 1,024 acks in flight. No database.
//!
//! **Latency through the shipped services.** `subscriptions` (default flags
//! but `--no-relay` and a free loopback port) writes into an upstream
//! database, one `outbox-relay` process (default flags but `--source`, each
//! of `--inbox-sources`: the polling default and `wal`) publishes its outbox
//! into the stream, and billing (default flags; `--inbox-latency-batches`
//! adds `--batch` values) consumes it into its own database, on the same
//! PostgreSQL server. One warm-up request must be invoiced before the clock
//! starts. Then [`WRITERS`] keep-alive HTTP connections send `POST
//! /v1/subscriptions` on a schedule paced at each `--inbox-rate` per second
//! for `--inbox-latency-secs`. Every source, rate and `--batch` is a mode of
//! its own, the modes interleaved round by round. Latency runs from commit
//! to commit, both from PostgreSQL's `track_commit_timestamp` (a server of
//! its own with it on is started for these runs when the harness's server
//! does not keep them): the writer's transaction (its `subscriptions` row's
//! `xmin`, never updated; the outbox row is marked by the relay) to
//! billing's (its invoice row's `xmin`). Neither the writer's own
//! transaction nor any client's clock counts. It is split per event where
//! the event was stored in the stream (the message's timestamp, from the
//! server's clock on this machine), when it reached an ordered consumer of
//! the harness waiting for it (wall clock), and where billing's transaction
//! began (its inbox row's `handled_at`). The relay's and billing's
//! histograms (`/metrics`, read before and after) tell the relay's claims,
//! publishes and marks, and billing's handling time.
//!
//! Where the time goes: CPU (in cores, averaged over the drain) of the
//! consumer process, of the PostgreSQL backends connected to its database,
//! of nats-server (when this harness started it) and of the whole machine
//! (`/proc`; in the latency runs also the relay, `subscriptions`, the
//! upstream database's backends and this process); billing's own Prometheus
//! counters; and, for the backlog, the transactions committed in the
//! consumer's database per event (`pg_stat_database`, read once it has
//! exited, the harness's own polls subtracted; a relay and billing's lease
//! count too).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::pull::{self, OrderedConfig};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::stream::{self, Config};
use futures::StreamExt;
use outbox_pg::{Envelope, Outbox};
use outbox_publisher::DEFAULT_DUPLICATE_WINDOW;
use outbox_testkit::Program;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::mpsc;
use uuid::Uuid;

use inbox_consumer::{
    Consumer, ConsumerConfig, DedupeLayer, Handler, HandlerError, HandlerService, MetricsLayer,
    Router, TraceLayer,
};
use sqlx::postgres::PgPoolOptions;
use tower::ServiceBuilder;

use crate::Args;
use crate::handwritten;
use crate::harness::{
    BoxError, Db, Env, RelayProc, Result, drop_slots, publish_all, samples, scrape_metrics,
    stop_noting,
};
use crate::scheduled::Source;
use crate::stats::{Spread, num, percentile};

/// The stream's subjects, as billing's relay would create it.
const STREAM_SUBJECTS: [&str; 2] = ["subscription.>", "invoice.>"];
/// What billing's consumer is filtered to; the ack-only consumer too.
const FILTERS: [&str; 2] = ["subscription.cancelled", "subscription.created"];
/// How often the invoices are counted. A count scans the table, so polling
/// fast would load the database under test; the end of a drain is taken
/// from the last invoice's `created_at` instead, so this does not limit the
/// timing's resolution.
const POLL: Duration = Duration::from_millis(250);
/// A drain that handles nothing for this long has failed.
const STALL: Duration = Duration::from_secs(60);
/// Concurrent writer connections sharing the paced schedule.
const WRITERS: usize = 8;
/// Clock ticks per second of `/proc` CPU times (`USER_HZ`, 100 on Linux).
const CLK_TCK: f64 = 100.0;
/// The ack-only consumer: messages per pull, acks in flight, unacked allowed.
const ACK_ONLY_PULL: usize = 1_000;
const ACK_ONLY_IN_FLIGHT: usize = 1_024;
const ACK_ONLY_MAX_ACK_PENDING: i64 = 10_000;

/// One way of consuming the backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    AckOnly,
    /// `--batch` (`None`: not given, billing's default flags), and whether
    /// billing runs its in-process relay (the default).
    Billing(Option<u16>, bool),
    /// The hand-written consumer of billing's SQL, and whether it runs a relay.
    HandWritten(bool),
    /// The library in process, a no-op handler, deliveries per transaction.
    Library(u16),
}

impl Mode {
    fn name(self) -> String {
        match self {
            Self::AckOnly => "ack-only JetStream consumer (no database)".to_owned(),
            Self::Billing(None, true) => "billing, default flags".to_owned(),
            Self::Billing(None, false) => "billing --no-relay".to_owned(),
            Self::Billing(Some(b), true) => format!("billing --batch {b}"),
            Self::Billing(Some(b), false) => format!("billing --batch {b} --no-relay"),
            Self::HandWritten(true) => format!(
                "hand-written consumer of billing's SQL, batch {}, {} at once, with a relay",
                handwritten::BATCH,
                handwritten::WORKERS
            ),
            Self::HandWritten(false) => format!(
                "hand-written consumer of billing's SQL, batch {}, {} at once, no relay",
                handwritten::BATCH,
                handwritten::WORKERS
            ),
            Self::Library(b) => format!("inbox-consumer, no-op handler, batch {b}"),
        }
    }
}

/// CPU in cores, averaged over a measurement.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    consumer: f64,
    pg: f64,
    nats: f64,
    machine: f64,
}

/// One drain of the backlog.
#[derive(Debug, Clone, Copy, Default)]
struct Drained {
    rate: f64,
    /// Seconds from ready to the first handled event.
    first: f64,
    cpu: Cpu,
    /// Billing's counters at the end.
    scraped: Option<Scraped>,
    /// Transactions committed in billing's database per event.
    commits_per_event: Option<f64>,
}

/// One latency mode: the relay's source, the paced rate, billing's `--batch`.
#[derive(Debug, Clone, Copy)]
struct LatencyMode {
    source: Source,
    rate: usize,
    batch: Option<u16>,
}

impl LatencyMode {
    fn name(self) -> String {
        format!(
            "{}, {} events/s, outbox-relay --source {}",
            Mode::Billing(self.batch, true).name(),
            num(self.rate as f64, 0),
            source_flag(self.source)
        )
    }
}

fn source_flag(source: Source) -> &'static str {
    match source {
        Source::Poll => "poll",
        Source::Wal => "wal",
    }
}

/// One paced latency run through `subscriptions`, `outbox-relay` and billing.
/// Pairs are p50 and p99, in ms; every time is on the PostgreSQL server's
/// clock (commit timestamps) or the nats-server's (the stream's stored
/// timestamp), both this machine's.
#[derive(Debug, Clone, Copy)]
struct Latency {
    /// The writer's commit → billing's commit: p50, p99, max.
    total: (f64, f64, f64),
    /// The writer's commit → the event stored in the stream (the relay's
    /// wake-up, claim, publish and PubAck).
    to_stream: (f64, f64),
    /// Stored → at a consumer waiting for it (the observer).
    observed: (f64, f64),
    /// At the observer → billing's transaction start (its inbox row's
    /// `handled_at`): the delivery to billing's runtime beyond the
    /// observer's, waiting for a slot or a batch, and `BEGIN`.
    to_tx: (f64, f64),
    /// Billing's transaction start → its commit.
    tx: (f64, f64),
    relay: Phases,
    billing: Phases,
    /// Deliveries per billing transaction (inbox rows per `handled_at`).
    per_transaction: f64,
    /// Events invoiced per second, from the first write to the last invoice.
    handled_rate: f64,
    written_rate: f64,
    /// Billing, its database's backends, nats-server, the machine.
    cpu: Cpu,
    /// The upstream side: `consumer` is the relay, `pg` the upstream
    /// database's backends, `nats` this process (the HTTP clients, the observer).
    upstream: Cpu,
    /// The `subscriptions` service, cores.
    service: f64,
}

/// This run's copies of the binaries.
#[derive(Debug)]
struct Bins {
    billing: PathBuf,
    subscriptions: PathBuf,
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let (bin, built) = copy_bin(env, "billing", "example-billing")?;
    let latency_modes = latency_modes(args);
    let nats_pid = child_named("nats-server");
    let modes = drain_modes(args);
    println!(
        "\n## Inbox consumer: {} events from a backlog, then {:?} events/s for {} s through outbox-relay ({:?})\nbilling: {built}",
        args.inbox_events, args.inbox_rates, args.inbox_latency_secs, args.inbox_sources
    );

    // Per mode, per round: `None` if the mode failed in that round (noted).
    let mut drains: Vec<Vec<Option<Drained>>> = vec![Vec::new(); modes.len()];
    let mut latencies: Vec<Vec<Option<Latency>>> = vec![Vec::new(); latency_modes.len()];
    let bins = if latency_modes.is_empty() || args.inbox_latency_secs == 0 {
        None
    } else {
        Some(Bins {
            billing: bin.clone(),
            subscriptions: copy_bin(env, "subscriptions", "example-subscriptions")?.0,
        })
    };
    // The latency runs need commit timestamps: a server of their own when
    // this one does not keep them.
    let committed = match &bins {
        Some(_) => Some(CommitClock::start(env).await?),
        None => None,
    };
    for round in 0..args.rounds {
        if args.inbox_events > 0 {
            drain_round(env, args, (&bin, nats_pid), round, &modes, &mut drains).await;
        }
        if let (Some(bins), Some(clock)) = (&bins, &committed) {
            let mut order: Vec<usize> = (0..latency_modes.len()).collect();
            order.rotate_left(round % latency_modes.len());
            for i in order {
                let mode = latency_modes[i];
                match latency(&clock.env, args, bins, mode, nats_pid).await {
                    Ok(l) => {
                        println!("round {round}: latency, {}: {}", mode.name(), l.line());
                        latencies[i].push(Some(l));
                    }
                    Err(e) => {
                        env.note(format!("round {round}, latency, {}: {e}", mode.name()));
                        latencies[i].push(None);
                    }
                }
            }
        }
    }
    if let Some(clock) = committed {
        for note in clock.env.notes() {
            env.note(note);
        }
        clock.stop().await;
    }

    let mut out = format!("Inbox part: billing {built}.\n\n");
    if args.inbox_events > 0 {
        out.push_str(&throughput_table(args, &modes, &drains));
    }
    if bins.is_some() {
        out.push_str(&latency_table(args, &latency_modes, &latencies));
    }
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// The backlog modes `args` ask for, in their order.
fn drain_modes(args: &Args) -> Vec<Mode> {
    let mut modes = vec![Mode::AckOnly, Mode::Billing(None, true)];
    modes.extend(
        args.inbox_batches
            .iter()
            .map(|&b| Mode::Billing(Some(b), true)),
    );
    if !args.inbox_no_handwritten {
        modes.push(Mode::HandWritten(true));
    }
    modes.extend(
        args.inbox_no_relay
            .iter()
            .map(|&b| Mode::Billing(Some(b), false)),
    );
    if !args.inbox_no_handwritten && !args.inbox_no_relay.is_empty() {
        modes.push(Mode::HandWritten(false));
    }
    modes.extend(args.inbox_library.iter().map(|&b| Mode::Library(b)));
    modes
}

/// The latency modes `args` ask for: every source, rate and `--batch`.
fn latency_modes(args: &Args) -> Vec<LatencyMode> {
    let batches: Vec<Option<u16>> = std::iter::once(None)
        .chain(args.inbox_latency_batches.iter().map(|&b| Some(b)))
        .collect();
    let mut modes = Vec::new();
    for &source in &args.inbox_sources {
        for &rate in args.inbox_rates.iter().filter(|&&r| r > 0) {
            for &batch in &batches {
                modes.push(LatencyMode {
                    source,
                    rate,
                    batch,
                });
            }
        }
    }
    modes
}

/// One round of the backlog drains, the modes' order rotated by `round`.
async fn drain_round(
    env: &Env,
    args: &Args,
    (bin, nats_pid): (&Path, Option<u32>),
    round: usize,
    modes: &[Mode],
    drains: &mut [Vec<Option<Drained>>],
) {
    let mut order: Vec<usize> = (0..modes.len()).collect();
    order.rotate_left(round % modes.len());
    for i in order {
        let mode = modes[i];
        let result = match mode {
            Mode::AckOnly => ack_only(env, args.inbox_events, nats_pid).await,
            Mode::Billing(batch, relay) => {
                billing_drain(env, bin, batch, relay, args.inbox_events, nats_pid).await
            }
            Mode::HandWritten(relay) => {
                handwritten_drain(env, relay, args.inbox_events, nats_pid).await
            }
            Mode::Library(batch) => library_drain(env, batch, args.inbox_events, nats_pid).await,
        };
        match result {
            Ok(d) => {
                println!(
                    "round {round}: {:<44} {:>8} events/s, first after {:.2} s, cores: consumer {:.2} pg {:.2} nats {:.2} machine {:.2}{}",
                    mode.name(),
                    num(d.rate, 0),
                    d.first,
                    d.cpu.consumer,
                    d.cpu.pg,
                    d.cpu.nats,
                    d.cpu.machine,
                    d.commits_per_event
                        .map(|c| format!(", {c:.3} tx/event"))
                        .unwrap_or_default()
                );
                drains[i].push(Some(d));
            }
            Err(e) => {
                env.note(format!("round {round}, {}: {e}", mode.name()));
                drains[i].push(None);
            }
        }
    }
}

/// The PostgreSQL server of the latency runs, which keeps commit timestamps
/// (`track_commit_timestamp`): the harness's own if it does, else one
/// started here with it on (and stopped at the end).
struct CommitClock {
    env: Env,
    server: Option<outbox_testkit::PgServer>,
}

impl CommitClock {
    async fn start(env: &Env) -> Result<Self> {
        let on: String = sqlx::query_scalar("show track_commit_timestamp")
            .fetch_one(&env.admin)
            .await?;
        if on == "on" {
            return Ok(Self {
                env: Env::new(&env.admin_url, &env.nats_url).await?,
                server: None,
            });
        }
        let server = tokio::task::spawn_blocking(|| {
            outbox_testkit::PgServer::start_with(&["track_commit_timestamp=on"])
        })
        .await??;
        println!(
            "latency runs: a PostgreSQL server with track_commit_timestamp=on at {}",
            server.url("postgres")
        );
        Ok(Self {
            env: Env::new(&server.url("postgres"), &env.nats_url).await?,
            server: Some(server),
        })
    }

    async fn stop(self) {
        self.env.admin.close().await;
        if let Some(server) = self.server {
            let _ = tokio::task::spawn_blocking(move || drop(server)).await;
        }
    }
}

fn throughput_table(args: &Args, modes: &[Mode], drains: &[Vec<Option<Drained>>]) -> String {
    let ok = |i: usize| -> Vec<Drained> { drains[i].iter().flatten().copied().collect() };
    let spread = |i: usize, f: fn(&Drained) -> f64| -> Spread {
        Spread::of(&ok(i).iter().map(f).collect::<Vec<_>>())
    };
    let ceiling = modes.iter().position(|&m| m == Mode::AckOnly);
    let mut out = format!(
        "### Inbox consumer: throughput from a backlog ({} events, {} rounds)\n\n\
         | consumer | events/s, median (range) | / ack-only, per round | first handled after, s | CPU, cores: consumer | PostgreSQL backends | nats-server | machine | transactions per event |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        num(args.inbox_events as f64, 0),
        args.rounds
    );
    for (i, mode) in modes.iter().enumerate() {
        let runs = ok(i);
        if runs.is_empty() {
            out.push_str(&format!(
                "| {} | failed in every round (see notes) | | | | | | | |\n",
                mode.name()
            ));
            continue;
        }
        let ratio = match ceiling {
            Some(c) if c != i => {
                let per_round: Vec<f64> = drains[i]
                    .iter()
                    .zip(&drains[c])
                    .filter_map(|(a, b)| Some(a.as_ref()?.rate / b.as_ref()?.rate))
                    .collect();
                if per_round.is_empty() {
                    "–".to_owned()
                } else {
                    Spread::of(&per_round).show(2)
                }
            }
            _ => "1.00".to_owned(),
        };
        let commits: Vec<f64> = runs.iter().filter_map(|d| d.commits_per_event).collect();
        let failed = drains[i].iter().filter(|d| d.is_none()).count();
        out.push_str(&format!(
            "| {}{} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            mode.name(),
            if failed > 0 {
                format!(" ({failed} rounds failed, see notes)")
            } else {
                String::new()
            },
            spread(i, |d| d.rate),
            ratio,
            spread(i, |d| d.first).show(2),
            spread(i, |d| d.cpu.consumer).show(2),
            spread(i, |d| d.cpu.pg).show(2),
            spread(i, |d| d.cpu.nats).show(2),
            spread(i, |d| d.cpu.machine).show(2),
            if commits.is_empty() {
                "–".to_owned()
            } else {
                Spread::of(&commits).show(3)
            },
        ));
    }
    out.push_str(&cpu_per_event_table(modes, drains));
    // Billing's own counters, summed over the rounds.
    let mut counters = String::new();
    for (i, mode) in modes.iter().enumerate() {
        let scraped: Vec<Scraped> = ok(i).iter().filter_map(|d| d.scraped).collect();
        if scraped.is_empty() {
            continue;
        }
        let sum = |f: fn(&Scraped) -> f64| -> f64 { scraped.iter().map(f).sum() };
        let count = sum(|s| s.handler_count);
        counters.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            mode.name(),
            num(sum(|s| s.handled), 0),
            num(sum(|s| s.duplicates), 0),
            num(sum(|s| s.failed), 0),
            if count > 0.0 {
                num(sum(|s| s.handler_seconds) / count * 1e3, 1)
            } else {
                "–".to_owned()
            },
            num(sum(|s| s.published), 0),
        ));
    }
    if !counters.is_empty() {
        out.push_str(
            "\nBilling's counters, summed over the rounds (`/metrics`; handling = `inbox_handler_duration_seconds`, from a delivery's start to its commit):\n\n\
             | billing | handled | duplicates | failed | mean handling per delivery, ms | invoice.created published by its relay |\n\
             |---|---:|---:|---:|---:|---:|\n",
        );
        out.push_str(&counters);
    }
    out.push('\n');
    out
}

/// CPU per event by process, and each mode against the hand-written
/// consumer with a relay, per round (the median of the rounds' ratios).
fn cpu_per_event_table(modes: &[Mode], drains: &[Vec<Option<Drained>>]) -> String {
    let micros = |d: &Drained, cores: f64| cores / d.rate.max(1e-9) * 1e6;
    let consumer = |d: &Drained| micros(d, d.cpu.consumer);
    let all = |d: &Drained| micros(d, d.cpu.consumer + d.cpu.pg + d.cpu.nats);
    let reference = modes.iter().position(|&m| m == Mode::HandWritten(true));
    let mut out = String::from(
        "\nCPU per event, µs (cores ÷ events/s), and against the hand-written consumer with a relay in the same round \
         (median of the per-round ratios, range):\n\n\
         | consumer | consumer process | PostgreSQL backends | nats-server | the three | throughput / hand-written | consumer CPU per event / hand-written | the three / hand-written |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, mode) in modes.iter().enumerate() {
        let runs: Vec<Drained> = drains[i].iter().flatten().copied().collect();
        if runs.is_empty() {
            continue;
        }
        let spread = |f: &dyn Fn(&Drained) -> f64| -> String {
            Spread::of(&runs.iter().map(f).collect::<Vec<_>>()).show(1)
        };
        let against = |f: &dyn Fn(&Drained) -> f64| -> String {
            let Some(r) = reference.filter(|&r| r != i) else {
                return "–".to_owned();
            };
            let per_round: Vec<f64> = drains[i]
                .iter()
                .zip(&drains[r])
                .filter_map(|(a, b)| Some(f(a.as_ref()?) / f(b.as_ref()?)))
                .collect();
            if per_round.is_empty() {
                "–".to_owned()
            } else {
                Spread::of(&per_round).show(2)
            }
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            mode.name(),
            spread(&consumer),
            spread(&|d| micros(d, d.cpu.pg)),
            spread(&|d| micros(d, d.cpu.nats)),
            spread(&all),
            against(&|d| d.rate),
            against(&consumer),
            against(&all),
        ));
    }
    out
}

fn latency_table(args: &Args, modes: &[LatencyMode], latencies: &[Vec<Option<Latency>>]) -> String {
    let mut out = format!(
        "### Inbox consumer: latency through subscriptions, outbox-relay and billing ({} s per run, {} rounds)\n\n\
         From the writer's commit (its `subscriptions` row's commit timestamp) to billing's commit (its invoice row's), \
         both from PostgreSQL's `track_commit_timestamp`.\n\n\
         | mode | p50, ms | p99, ms | max, ms | requests/s answered | invoiced, events/s |\n\
         |---|---:|---:|---:|---:|---:|\n",
        args.inbox_latency_secs, args.rounds
    );
    let mut split = String::from(
        "\nWhere the time goes, p50 / p99 per event, ms (stored: the stream message's timestamp; \
         observer: a consumer of the harness waiting for it; billing's transaction start: its inbox row's `handled_at`):\n\n\
         | mode | writer's commit → stored in the stream (relay) | stored → at a waiting observer | \
         → billing's transaction start | → billing's commit |\n\
         |---|---:|---:|---:|---:|\n",
    );
    let mut phases = String::from(
        "\nThe relays' and billing's histograms over the run (means):\n\n\
         | mode | outbox-relay: claims per event | claim, ms | publish → PubAck, ms | mark, ms | rows per batch | \
         billing: handling per delivery, ms | deliveries per transaction | billing's relay: claims per event |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut cpu = String::from(
        "\nCPU during the latency runs, cores:\n\n\
         | mode | billing | its database's backends | nats-server | outbox-relay | subscriptions | upstream database's backends | the harness (HTTP clients, observer) | machine |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, mode) in modes.iter().enumerate() {
        let runs: Vec<Latency> = latencies[i].iter().flatten().copied().collect();
        let name = mode.name();
        if runs.is_empty() {
            out.push_str(&format!(
                "| {name} | failed in every round (see notes) | | | | |\n"
            ));
            continue;
        }
        let pick = |f: fn(&Latency) -> f64| -> Spread {
            Spread::of(&runs.iter().map(f).collect::<Vec<_>>())
        };
        let pair = |a: fn(&Latency) -> f64, b: fn(&Latency) -> f64| -> String {
            format!("{} / {}", pick(a).show(1), pick(b).show(1))
        };
        let failed = latencies[i].iter().filter(|l| l.is_none()).count();
        out.push_str(&format!(
            "| {name}{} | {} | {} | {} | {} | {} |\n",
            if failed > 0 {
                format!(" ({failed} rounds failed, see notes)")
            } else {
                String::new()
            },
            pick(|l| l.total.0).show(1),
            pick(|l| l.total.1).show(1),
            pick(|l| l.total.2).show(1),
            pick(|l| l.written_rate).show(0),
            pick(|l| l.handled_rate).show(0),
        ));
        split.push_str(&format!(
            "| {name} | {} | {} | {} | {} |\n",
            pair(|l| l.to_stream.0, |l| l.to_stream.1),
            pair(|l| l.observed.0, |l| l.observed.1),
            pair(|l| l.to_tx.0, |l| l.to_tx.1),
            pair(|l| l.tx.0, |l| l.tx.1),
        ));
        phases.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            pick(|l| l.relay.claims).show(2),
            pick(|l| l.relay.claim_ms).show(2),
            pick(|l| l.relay.publish_ms).show(2),
            pick(|l| l.relay.mark_ms).show(2),
            pick(|l| l.relay.rows).show(1),
            pick(|l| l.billing.handler_ms).show(1),
            pick(|l| l.per_transaction).show(2),
            pick(|l| l.billing.claims).show(2),
        ));
        cpu.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            pick(|l| l.cpu.consumer).show(2),
            pick(|l| l.cpu.pg).show(2),
            pick(|l| l.cpu.nats).show(2),
            pick(|l| l.upstream.consumer).show(2),
            pick(|l| l.service).show(2),
            pick(|l| l.upstream.pg).show(2),
            pick(|l| l.upstream.nats).show(2),
            pick(|l| l.cpu.machine).show(2),
        ));
    }
    out.push_str(&split);
    out.push_str(&phases);
    out.push_str(&cpu);
    out.push('\n');
    out
}

impl Latency {
    /// One round's line.
    fn line(&self) -> String {
        format!(
            "commit → commit p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; to the stream {:.1}/{:.1}, observer {:.1}/{:.1}, \
             to billing's tx {:.1}/{:.1}, in it {:.1}/{:.1}; relay: {:.2} claims/event, claim {:.2} ms, publish {:.2} ms, \
             mark {:.2} ms, {:.1} rows/batch; billing handling {:.1} ms, {:.2} deliveries/transaction, its relay {:.2} claims/event \
             (written at {}, invoiced at {} events/s; cores: billing {:.2} pg {:.2} nats {:.2} relay {:.2} upstream pg {:.2} \
             subscriptions {:.2} harness {:.2} machine {:.2})",
            self.total.0,
            self.total.1,
            self.total.2,
            self.to_stream.0,
            self.to_stream.1,
            self.observed.0,
            self.observed.1,
            self.to_tx.0,
            self.to_tx.1,
            self.tx.0,
            self.tx.1,
            self.relay.claims,
            self.relay.claim_ms,
            self.relay.publish_ms,
            self.relay.mark_ms,
            self.relay.rows,
            self.billing.handler_ms,
            self.per_transaction,
            self.billing.claims,
            num(self.written_rate, 0),
            num(self.handled_rate, 0),
            self.cpu.consumer,
            self.cpu.pg,
            self.cpu.nats,
            self.upstream.consumer,
            self.upstream.pg,
            self.service,
            self.upstream.nats,
            self.cpu.machine
        )
    }
}

/// This run's copy of `name` (a rebuild during the run cannot change it
/// between modes), and when it was built.
fn copy_bin(env: &Env, name: &str, package: &str) -> Result<(PathBuf, String)> {
    let built = env.bin_dir.join(name);
    if !built.is_file() {
        return Err(format!(
            "{} is missing: cargo build --release -p {package}",
            built.display()
        )
        .into());
    }
    let when = std::fs::metadata(&built)?.modified()?;
    let when = chrono::DateTime::<chrono::Utc>::from(when).format("%Y-%m-%d %H:%M:%S UTC");
    let copy = env.logs.join(name);
    std::fs::copy(&built, &copy)?;
    Ok((copy, format!("{} (built {when})", built.display())))
}

/// `subscription.created` for a subscription of its own, as billing reads it.
fn subscription(tag: &str, i: usize) -> Result<Envelope> {
    let id = format!("sub_{tag}_{i:07}");
    Ok(Envelope::new(
        "subscription.created",
        "subscriptions",
        &id,
        json!({"subscription_id": id, "customer_id": "cus_1", "plan": "pro", "amount_cents": 1234}),
    )?)
}

async fn create_stream(env: &Env, name: &str) -> Result<stream::Stream> {
    Ok(env
        .js
        .create_stream(Config {
            name: name.into(),
            subjects: STREAM_SUBJECTS.iter().map(|s| (*s).into()).collect(),
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            ..Default::default()
        })
        .await?)
}

/// Creates `stream` and publishes `events` events into it.
async fn backlog(env: &Env, stream: &str, events: usize) -> Result<stream::Stream> {
    let js_stream = create_stream(env, stream).await?;
    let envelopes: Vec<Envelope> = (0..events)
        .map(|i| subscription("backlog", i))
        .collect::<Result<_>>()?;
    publish_all(&env.js, &envelopes).await?;
    let held = env.stream_messages(stream).await?;
    if held != events as u64 {
        return Err(format!("{stream} holds {held} messages for {events} published").into());
    }
    Ok(js_stream)
}

async fn ack_only(env: &Env, events: usize, nats_pid: Option<u32>) -> Result<Drained> {
    let stream = env.stream_name();
    let result = ack_only_on(env, &stream, events, nats_pid).await;
    env.delete_stream(&stream).await;
    result
}

async fn ack_only_on(
    env: &Env,
    stream: &str,
    events: usize,
    nats_pid: Option<u32>,
) -> Result<Drained> {
    let js_stream = backlog(env, stream, events).await?;
    let mut consumer = js_stream
        .create_consumer(pull::Config {
            durable_name: Some("ack-only".into()),
            filter_subjects: FILTERS.iter().map(|s| (*s).to_owned()).collect(),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: ACK_ONLY_MAX_ACK_PENDING,
            ..Default::default()
        })
        .await?;
    let started = Instant::now();
    let cpu0 = CpuMark::take(Some(std::process::id()), None, nats_pid);
    let messages = consumer
        .stream()
        .max_messages_per_batch(ACK_ONLY_PULL)
        .messages()
        .await?;
    let mut acks = messages
        .take(events)
        .map(|message| async move {
            message?.double_ack().await?;
            Ok::<_, BoxError>(())
        })
        .buffer_unordered(ACK_ONLY_IN_FLIGHT);
    let mut first = None;
    let mut acked = 0;
    let drain = async {
        while let Some(ack) = acks.next().await {
            ack?;
            first.get_or_insert_with(|| started.elapsed().as_secs_f64());
            acked += 1;
        }
        Ok::<_, BoxError>(())
    };
    match tokio::time::timeout(Duration::from_secs(600), drain).await {
        Ok(result) => result?,
        Err(_) => return Err(format!("{acked} of {events} acked after 600 s").into()),
    }
    let elapsed = started.elapsed();
    let cpu = CpuMark::take(Some(std::process::id()), None, nats_pid).since(&cpu0);
    drop(acks);
    let info = consumer.info().await?;
    if acked != events || info.num_ack_pending != 0 || info.num_pending != 0 {
        return Err(format!(
            "{acked} of {events} acked; the server counts {} unacked, {} pending",
            info.num_ack_pending, info.num_pending
        )
        .into());
    }
    Ok(Drained {
        rate: events as f64 / elapsed.as_secs_f64(),
        first: first.unwrap_or_default(),
        cpu,
        scraped: None,
        commits_per_event: None,
    })
}

/// A handler that decodes the payload and does nothing else.
#[derive(Debug, Clone)]
struct Noop;

impl Handler for Noop {
    type Message = serde_json::Value;

    async fn handle(
        &self,
        _event: Envelope<serde_json::Value>,
        _tx: &mut sqlx::PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

async fn library_drain(
    env: &Env,
    batch: u16,
    events: usize,
    nats_pid: Option<u32>,
) -> Result<Drained> {
    let db = env.database(&format!("inbox_lib{batch}")).await?;
    let stream = env.stream_name();
    let result = library_drain_on(env, batch, events, nats_pid, &db, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn library_drain_on(
    env: &Env,
    batch: u16,
    events: usize,
    nats_pid: Option<u32>,
    db: &Db,
    stream: &str,
) -> Result<Drained> {
    backlog(env, stream, events).await?;
    let router = Router::new().route(FILTERS[1], HandlerService::new(Noop));
    let batch = usize::from(batch.max(1));
    let concurrency = 16;
    let buffered = (concurrency * batch * 2).max(256);
    let config = ConsumerConfig::for_router(stream, "inbox-bench", &router)
        .concurrency(concurrency)
        .max_batch(batch)
        .max_buffered(buffered)
        .max_ack_pending(i64::try_from(buffered * 2).unwrap_or(i64::MAX).max(1_000));
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(concurrency + 4).unwrap_or(20))
        .connect(&db.url)
        .await?;
    let consumer = Consumer::new(pool.clone(), env.js.clone(), config).await?;
    let service = ServiceBuilder::new()
        .layer(TraceLayer::new())
        .layer(MetricsLayer::new())
        .layer(DedupeLayer::new(pool.clone()))
        .service(router);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stopped = async {
        let _ = stopped.await;
    };
    let started = Instant::now();
    let started_at = wall_micros() as f64;
    let cpu0 = CpuMark::take(Some(std::process::id()), Some(&db.name), nats_pid);
    let run = if batch > 1 {
        tokio::spawn(consumer.run_batched(service, stopped))
    } else {
        tokio::spawn(consumer.run(service, stopped))
    };
    let mut first = None;
    loop {
        let count: i64 = sqlx::query_scalar("select count(*) from inbox_events")
            .fetch_one(&db.pool)
            .await?;
        if count > 0 {
            first.get_or_insert_with(|| started.elapsed().as_secs_f64());
        }
        if usize::try_from(count).unwrap_or(0) >= events {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(format!("{count} of {events} handled after 600 s").into());
        }
        tokio::time::sleep(POLL).await;
    }
    let last: f64 =
        sqlx::query_scalar("select extract(epoch from max(handled_at))::float8 from inbox_events")
            .fetch_one(&db.pool)
            .await?;
    let cpu = CpuMark::take(Some(std::process::id()), Some(&db.name), nats_pid).since(&cpu0);
    let _ = stop.send(());
    run.await??;
    pool.close().await;
    Ok(Drained {
        rate: events as f64 / (last - started_at / 1e6).max(1e-3),
        first: first.unwrap_or_default(),
        cpu,
        scraped: None,
        commits_per_event: None,
    })
}

async fn handwritten_drain(
    env: &Env,
    relay: bool,
    events: usize,
    nats_pid: Option<u32>,
) -> Result<Drained> {
    let db = env.database("inbox_hand").await?;
    let stream = env.stream_name();
    let result = handwritten_drain_on(env, relay, events, nats_pid, &db, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn handwritten_drain_on(
    env: &Env,
    relay: bool,
    events: usize,
    nats_pid: Option<u32>,
    db: &Db,
    stream: &str,
) -> Result<Drained> {
    let js_stream = backlog(env, stream, events).await?;
    sqlx::raw_sql(handwritten::CREATE_INVOICES)
        .execute(&db.pool)
        .await?;
    // As billing's pool: a connection per slot, and 4 more (its relay's).
    let pool = handwritten::pool_options()
        .max_connections(u32::try_from(handwritten::WORKERS + 4).unwrap_or(20))
        .connect(&db.url)
        .await?;
    let schemas = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../schemas/events"));
    let outbox = Outbox::new(outbox_pg::SchemaRegistry::from_dir(schemas)?);
    let nats = async_nats::connect(&env.nats_url).await?;
    let commits0 = xact_commit(&env.admin, &db.name).await?;
    let stop = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let started_at = wall_micros() as f64;
    let cpu0 = CpuMark::take(Some(std::process::id()), Some(&db.name), nats_pid);
    let run = tokio::spawn(handwritten::run(
        js_stream,
        nats,
        stream.to_owned(),
        &STREAM_SUBJECTS,
        &FILTERS,
        pool.clone(),
        outbox,
        relay,
        stop.clone(),
    ));
    let mut first = None;
    let mut polls = 0;
    let waited = async {
        loop {
            let count: i64 = sqlx::query_scalar("select count(*) from invoices")
                .fetch_one(&db.pool)
                .await?;
            polls += 1;
            if count > 0 {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64());
            }
            if usize::try_from(count).unwrap_or(0) >= events {
                return Ok::<_, BoxError>(());
            }
            if run.is_finished() {
                return Err("the hand-written consumer stopped".into());
            }
            if started.elapsed() > Duration::from_secs(600) {
                return Err(format!("{count} of {events} invoiced after 600 s").into());
            }
            tokio::time::sleep(POLL).await;
        }
    }
    .await;
    let last: f64 =
        sqlx::query_scalar("select extract(epoch from max(created_at))::float8 from invoices")
            .fetch_one(&db.pool)
            .await?;
    let cpu = CpuMark::take(Some(std::process::id()), Some(&db.name), nats_pid).since(&cpu0);
    stop.cancel();
    let ended = run.await;
    waited?;
    ended??;
    pool.close().await;
    let commits = xact_commit(&env.admin, &db.name).await? - commits0 - polls as i64;
    check_invoices(&db.pool, events).await?;
    Ok(Drained {
        rate: events as f64 / (last - started_at / 1e6).max(1e-3),
        first: first.unwrap_or_default(),
        cpu,
        scraped: None,
        commits_per_event: Some(commits as f64 / events as f64),
    })
}

async fn billing_drain(
    env: &Env,
    bin: &Path,
    batch: Option<u16>,
    relay: bool,
    events: usize,
    nats_pid: Option<u32>,
) -> Result<Drained> {
    let db = env
        .database(&format!("inbox_b{}", batch.unwrap_or(0)))
        .await?;
    let stream = env.stream_name();
    let result = billing_drain_on(env, bin, (batch, relay), events, nats_pid, &db, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn billing_drain_on(
    env: &Env,
    bin: &Path,
    (batch, relay): (Option<u16>, bool),
    events: usize,
    nats_pid: Option<u32>,
    db: &Db,
    stream: &str,
) -> Result<Drained> {
    backlog(env, stream, events).await?;
    let commits0 = xact_commit(&env.admin, &db.name).await?;
    let mut billing = BillingProc::start(
        env,
        bin,
        &format!("{stream}_billing"),
        &db.url,
        stream,
        batch,
        relay,
    )
    .await?;
    let started = Instant::now();
    let started_at = wall_micros() as f64;
    let pid = billing.pid();
    let cpu0 = CpuMark::take(pid, Some(&db.name), nats_pid);
    let waited = wait_invoices(&db.pool, events, started, STALL, &mut billing).await;
    // The drain ended with the last invoice, not with the poll that saw it.
    let last: f64 =
        sqlx::query_scalar("select extract(epoch from max(created_at))::float8 from invoices")
            .fetch_one(&db.pool)
            .await?;
    let elapsed = Duration::from_secs_f64((last - started_at / 1e6).max(1e-3));
    let cpu = CpuMark::take(pid, Some(&db.name), nats_pid).since(&cpu0);
    let scraped = billing.scrape().await;
    billing.stop(env).await;
    let (first, polls) = waited?;
    let scraped = scraped?;
    let commits = xact_commit(&env.admin, &db.name).await? - commits0 - polls as i64;
    check_invoices(&db.pool, events).await?;
    Ok(Drained {
        rate: events as f64 / elapsed.as_secs_f64(),
        first,
        cpu,
        scraped: Some(scraped),
        commits_per_event: Some(commits as f64 / events as f64),
    })
}

/// Polls the invoices until there are `n`; returns the seconds to the first
/// one and the polls made. Fails if billing dies or nothing is invoiced for
/// `stall`.
async fn wait_invoices(
    pool: &PgPool,
    n: usize,
    started: Instant,
    stall: Duration,
    billing: &mut BillingProc,
) -> Result<(f64, usize)> {
    let mut first = None;
    let mut polls = 0;
    let mut last = (0, Instant::now());
    loop {
        let count: i64 = sqlx::query_scalar("select count(*) from invoices")
            .fetch_one(pool)
            .await?;
        polls += 1;
        let count = usize::try_from(count).unwrap_or(0);
        if count > 0 && first.is_none() {
            first = Some(started.elapsed().as_secs_f64());
        }
        if count >= n {
            return Ok((first.unwrap_or_default(), polls));
        }
        if count > last.0 {
            last = (count, Instant::now());
        } else if last.1.elapsed() > stall {
            return Err(format!(
                "{count} of {n} invoices, none for {stall:?}; billing's log: {}",
                billing.log.display()
            )
            .into());
        }
        if billing.program.died() {
            return Err(format!(
                "billing exited at {count} of {n} invoices; its log ({}):\n{}",
                billing.log.display(),
                log_tail(&billing.log)
            )
            .into());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Exactly `n` invoices, one per subscription.
async fn check_invoices(pool: &PgPool, n: usize) -> Result<()> {
    let (rows, subscriptions): (i64, i64) =
        sqlx::query_as("select count(*), count(distinct subscription_id) from invoices")
            .fetch_one(pool)
            .await?;
    if rows != n as i64 || subscriptions != n as i64 {
        return Err(
            format!("{rows} invoices for {subscriptions} subscriptions after {n} events").into(),
        );
    }
    Ok(())
}

/// Transactions committed in `database` so far.
async fn xact_commit(admin: &PgPool, database: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar("select xact_commit from pg_stat_database where datname = $1")
            .bind(database)
            .fetch_one(admin)
            .await?,
    )
}

async fn latency(
    env: &Env,
    args: &Args,
    bins: &Bins,
    mode: LatencyMode,
    nats_pid: Option<u32>,
) -> Result<Latency> {
    let upstream = env.database("inbox_upstream").await?;
    let own = match env.database("inbox_lat").await {
        Ok(db) => db,
        Err(e) => {
            env.drop_database(upstream).await?;
            return Err(e);
        }
    };
    let stream = env.stream_name();
    let result = latency_on(env, args, bins, mode, nats_pid, &upstream, &own, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(own).await?;
    drop_slots(&upstream).await?;
    env.drop_database(upstream).await?;
    result
}

#[allow(clippy::too_many_arguments)]
async fn latency_on(
    env: &Env,
    args: &Args,
    bins: &Bins,
    mode: LatencyMode,
    nats_pid: Option<u32>,
    upstream: &Db,
    own: &Db,
    stream: &str,
) -> Result<Latency> {
    create_stream(env, stream).await?;
    let mut subscriptions = SubscriptionsProc::start(
        env,
        &bins.subscriptions,
        &format!("{stream}_subscriptions"),
        &upstream.url,
    )
    .await?;
    let relay = match start_relay(env, mode.source, upstream, stream).await {
        Ok(relay) => relay,
        Err(e) => {
            subscriptions.stop(env).await;
            return Err(e);
        }
    };
    let mut billing = match BillingProc::start(
        env,
        &bins.billing,
        &format!("{stream}_billing"),
        &own.url,
        stream,
        mode.batch,
        true,
    )
    .await
    {
        Ok(billing) => billing,
        Err(e) => {
            relay.stop(env).await;
            subscriptions.stop(env).await;
            return Err(e);
        }
    };
    let mut relay = relay;
    let result = paced(
        env,
        (args, mode.rate),
        nats_pid,
        (upstream, own, stream),
        (&mut subscriptions, &mut billing, &mut relay),
    )
    .await;
    billing.stop(env).await;
    let alive = relay.check_alive("while billing consumed");
    relay.stop(env).await;
    subscriptions.stop(env).await;
    alive?;
    result
}

/// One `outbox-relay` with default flags but `--source`, publishing
/// `upstream`'s outbox into `stream`; a WAL relay once it reads the WAL.
async fn start_relay(env: &Env, source: Source, upstream: &Db, stream: &str) -> Result<RelayProc> {
    let name = format!("{stream}_relay_{}", source_flag(source));
    let subjects = STREAM_SUBJECTS.join(",");
    match source {
        Source::Poll => {
            RelayProc::start_with_subjects(env, &name, &upstream.url, stream, &subjects).await
        }
        Source::Wal => {
            let mut relay = RelayProc::start_with_args(
                env,
                &name,
                &upstream.url,
                stream,
                &subjects,
                &["--source", "wal"],
            )
            .await?;
            if let Err(e) = relay.wait_logged("reading the WAL").await {
                relay.stop(env).await;
                return Err(e);
            }
            Ok(relay)
        }
    }
}

/// Wall-clock microseconds since the epoch.
fn wall_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// When an event reached the stream (its stored timestamp) and the observer.
#[derive(Debug, Clone, Copy)]
struct Seen {
    stored: i64,
    observed: i64,
}

async fn paced(
    env: &Env,
    (args, rate): (&Args, usize),
    nats_pid: Option<u32>,
    (upstream, own, stream): (&Db, &Db, &str),
    procs: (&mut SubscriptionsProc, &mut BillingProc, &mut RelayProc),
) -> Result<Latency> {
    // An observer: when each event was stored in the stream (the server's
    // timestamp) and when it reached a consumer waiting for it (wall clock).
    let observer = env
        .js
        .get_stream(stream)
        .await?
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::New,
            filter_subject: "subscription.created".into(),
            ..Default::default()
        })
        .await?;
    let mut messages = observer.messages().await?;
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel::<(Uuid, Seen)>();
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            let observed = wall_micros();
            let stored = message.info().map_or(observed, |info| {
                i64::try_from(info.published.unix_timestamp_nanos() / 1_000).unwrap_or(observed)
            });
            let id = serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|v| v["id"].as_str().and_then(|s| Uuid::parse_str(s).ok()));
            if let Some(id) = id
                && arrived_tx.send((id, Seen { stored, observed })).is_err()
            {
                return;
            }
        }
    });
    let result = paced_observed(
        env,
        (args, rate),
        nats_pid,
        (upstream, own),
        procs,
        &mut arrived,
    )
    .await;
    reader.abort();
    result
}

/// The request body of one new subscription.
const NEW_SUBSCRIPTION: &str = r#"{"customer_id":"cus_1","plan":"pro","amount_cents":1234}"#;

/// Sends one `POST /v1/subscriptions`; returns the event's id.
async fn create_subscription(http: &mut Http) -> Result<Uuid> {
    let (status, body) = http.post("/v1/subscriptions", NEW_SUBSCRIPTION).await?;
    if status != 201 {
        return Err(format!(
            "POST /v1/subscriptions answered {status}: {}",
            String::from_utf8_lossy(&body)
        )
        .into());
    }
    let written: serde_json::Value = serde_json::from_slice(&body)?;
    written["event_id"]
        .as_str()
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or_else(|| format!("no event_id in {}", String::from_utf8_lossy(&body)).into())
}

async fn paced_observed(
    env: &Env,
    (args, rate): (&Args, usize),
    nats_pid: Option<u32>,
    (upstream, own): (&Db, &Db),
    (subscriptions, billing, relay): (&mut SubscriptionsProc, &mut BillingProc, &mut RelayProc),
    arrived: &mut mpsc::UnboundedReceiver<(Uuid, Seen)>,
) -> Result<Latency> {
    // Warm-up: one event invoiced before the clock starts.
    let mut http = Http::connect(subscriptions.addr).await?;
    create_subscription(&mut http).await?;
    drop(http);
    wait_invoices(
        &own.pool,
        1,
        Instant::now(),
        Duration::from_secs(30),
        billing,
    )
    .await
    .map_err(|e| format!("the warm-up event: {e}"))?;
    relay.check_alive("before the warm-up event was invoiced")?;

    let total = rate * args.inbox_latency_secs as usize;
    let relay_before = scrape_metrics(relay.metrics(), "outbox-relay").await?;
    let billing_before = scrape_metrics(billing.metrics, "billing").await?;
    let pid = billing.pid();
    let cpu0 = CpuMark::take(pid, Some(&own.name), nats_pid);
    let (relay_pid, me) = (relay.pid(), Some(std::process::id()));
    let upstream0 = CpuMark::take(relay_pid, Some(&upstream.name), me);
    let subscriptions_pid = subscriptions.pid();
    let service0 = CpuMark::take(subscriptions_pid, None, None);
    let started = Instant::now();
    let started_wall = wall_micros();
    let answers = write_paced(subscriptions.addr, rate, total).await?;
    let written_rate = total as f64 / started.elapsed().as_secs_f64();
    wait_invoices(
        &own.pool,
        total + 1,
        started,
        Duration::from_secs(30),
        billing,
    )
    .await
    .map_err(|e| format!("after the paced writes: {e}"))?;
    let cpu = CpuMark::take(pid, Some(&own.name), nats_pid).since(&cpu0);
    let upstream_cpu = CpuMark::take(relay_pid, Some(&upstream.name), me).since(&upstream0);
    let service_cpu = CpuMark::take(subscriptions_pid, None, None).since(&service0);
    let relay_phases = Phases::between(
        &relay_before,
        &scrape_metrics(relay.metrics(), "outbox-relay").await?,
        total,
    );
    let billing_phases = Phases::between(
        &billing_before,
        &scrape_metrics(billing.metrics, "billing").await?,
        total,
    );
    let reached = observed(env, arrived, &answers).await;
    let (mut split, last, transactions) = split_times(upstream, own, &answers, &reached).await?;
    if split.total.len() != total {
        return Err(format!("{} of {total} paced events invoiced", split.total.len()).into());
    }
    let handled_rate = total as f64 / ((last - started_wall) as f64 / 1e6);
    let p = |v: &mut Vec<f64>| (percentile(v, 50.0), percentile(v, 99.0));
    Ok(Latency {
        total: (
            percentile(&mut split.total, 50.0),
            percentile(&mut split.total, 99.0),
            percentile(&mut split.total, 100.0),
        ),
        to_stream: p(&mut split.to_stream),
        observed: p(&mut split.observed),
        to_tx: p(&mut split.to_tx),
        tx: p(&mut split.tx),
        relay: relay_phases,
        billing: billing_phases,
        per_transaction: total as f64 / transactions.max(1) as f64,
        handled_rate,
        written_rate,
        cpu,
        upstream: upstream_cpu,
        service: service_cpu.consumer,
    })
}

/// Sends `total` `POST /v1/subscriptions` over [`WRITERS`] keep-alive
/// connections on a schedule paced at `rate` per second; returns the events
/// written, each with when its answer arrived.
async fn write_paced(addr: SocketAddr, rate: usize, total: usize) -> Result<HashMap<Uuid, i64>> {
    let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let next = Arc::new(AtomicUsize::new(0));
    let mut conns = Vec::with_capacity(WRITERS);
    for _ in 0..WRITERS {
        conns.push(Http::connect(addr).await?);
    }
    let started = Instant::now();
    let writers: Vec<_> = conns
        .into_iter()
        .map(|mut http| {
            let next = next.clone();
            tokio::spawn(async move {
                let mut answered = Vec::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        return Ok::<_, BoxError>(answered);
                    }
                    tokio::time::sleep_until((started + interval.mul_f64(n as f64)).into()).await;
                    let event = create_subscription(&mut http).await?;
                    answered.push((event, wall_micros()));
                }
            })
        })
        .collect();
    let mut answers: HashMap<Uuid, i64> = HashMap::with_capacity(total);
    for writer in writers {
        answers.extend(writer.await??);
    }
    Ok(answers)
}

/// What the observer saw of the paced events (waiting at most 5 s more).
async fn observed(
    env: &Env,
    arrived: &mut mpsc::UnboundedReceiver<(Uuid, Seen)>,
    answers: &HashMap<Uuid, i64>,
) -> HashMap<Uuid, Seen> {
    let total = answers.len();
    let mut reached: HashMap<Uuid, Seen> = HashMap::with_capacity(total);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while reached.len() < total {
        match tokio::time::timeout_at(deadline, arrived.recv()).await {
            Ok(Some((id, seen))) => {
                if answers.contains_key(&id) {
                    reached.insert(id, seen);
                }
            }
            _ => break,
        }
    }
    if reached.len() != total {
        env.note(format!(
            "the observer saw {} of {total} paced events reach the stream",
            reached.len()
        ));
    }
    reached
}

/// Per event of `answers`: the writer's commit (its `subscriptions` row's
/// commit timestamp, upstream), the stream and the observer (`reached`),
/// billing's transaction start (its inbox row's `handled_at`) and commit
/// (its invoice row's commit timestamp). Returns the split, the last
/// billing commit (µs since the epoch) and how many transactions billing
/// spent on them.
async fn split_times(
    upstream: &Db,
    own: &Db,
    answers: &HashMap<Uuid, i64>,
    reached: &HashMap<Uuid, Seen>,
) -> Result<(Split, i64, usize)> {
    // A row's xmin is the transaction that wrote it: the subscription's
    // row is never updated (the outbox row is: the relay marks it).
    let written: Vec<(String, i64)> = sqlx::query_as(
        "select id, (extract(epoch from pg_xact_commit_timestamp(xmin)) * 1000000)::int8 \
           from subscriptions",
    )
    .fetch_all(&upstream.pool)
    .await?;
    let written: HashMap<String, i64> = written.into_iter().collect();
    let rows: Vec<(Uuid, String, i64, i64)> = sqlx::query_as(
        "select i.event_id, i.subscription_id, (extract(epoch from e.handled_at) * 1000000)::int8, \
                (extract(epoch from pg_xact_commit_timestamp(i.xmin)) * 1000000)::int8 \
           from invoices i join inbox_events e on e.event_id = i.event_id",
    )
    .fetch_all(&own.pool)
    .await?;
    let mut split = Split::default();
    let mut last = 0;
    let mut transactions = std::collections::HashSet::new();
    let ms = |from: i64, to: i64| (to - from) as f64 / 1e3;
    for (id, subscription, handled_at, committed) in rows {
        let Some(&written) = written.get(&subscription) else {
            continue;
        };
        if !answers.contains_key(&id) {
            continue;
        }
        last = last.max(committed);
        split.total.push(ms(written, committed));
        split.tx.push(ms(handled_at, committed));
        transactions.insert(handled_at);
        if let Some(seen) = reached.get(&id) {
            split.to_stream.push(ms(written, seen.stored));
            split.observed.push(ms(seen.stored, seen.observed));
            split.to_tx.push(ms(seen.observed, handled_at));
        }
    }
    Ok((split, last, transactions.len()))
}

/// Per-event times of one latency run, ms.
#[derive(Debug, Default)]
struct Split {
    total: Vec<f64>,
    to_stream: Vec<f64>,
    observed: Vec<f64>,
    to_tx: Vec<f64>,
    tx: Vec<f64>,
}

/// A relay's (or billing's) histograms over a run: means in ms, counts per event.
#[derive(Debug, Clone, Copy, Default)]
struct Phases {
    /// Claims (batches, empty ones included) per event.
    claims: f64,
    claim_ms: f64,
    /// Publish to PubAck, per message.
    publish_ms: f64,
    mark_ms: f64,
    /// Rows per non-empty batch.
    rows: f64,
    /// Billing: `inbox_handler_duration_seconds` per delivery (its batch's
    /// transaction, from the call to the commit).
    handler_ms: f64,
}

impl Phases {
    fn between(before: &str, after: &str, events: usize) -> Self {
        let get = |text: &str, name: &str, label: &str| -> f64 {
            samples(text)
                .filter(|(n, l, _)| *n == name && l.contains(label))
                .map(|(_, _, v)| v)
                .sum()
        };
        let delta = |name: &str, label: &str| get(after, name, label) - get(before, name, label);
        let mean = |name: &str, label: &str| {
            let count = delta(&format!("{name}_count"), label);
            if count > 0.0 {
                delta(&format!("{name}_sum"), label) / count
            } else {
                0.0
            }
        };
        let phase = |p: &str| {
            mean(
                "outbox_relay_batch_phase_seconds",
                &format!("phase=\"{p}\""),
            ) * 1e3
        };
        Self {
            claims: delta("outbox_relay_batch_phase_seconds_count", "phase=\"claim\"")
                / events.max(1) as f64,
            claim_ms: phase("claim"),
            publish_ms: mean("outbox_relay_publish_latency_seconds", "") * 1e3,
            mark_ms: phase("mark"),
            rows: mean("outbox_relay_batch_rows", ""),
            handler_ms: mean("inbox_handler_duration_seconds", "") * 1e3,
        }
    }
}

/// One keep-alive HTTP/1.1 connection to the service, for its JSON API.
struct Http {
    conn: tokio::io::BufReader<tokio::net::TcpStream>,
    host: String,
}

impl Http {
    async fn connect(addr: SocketAddr) -> Result<Self> {
        let conn = tokio::net::TcpStream::connect(addr).await?;
        conn.set_nodelay(true)?;
        Ok(Self {
            conn: tokio::io::BufReader::new(conn),
            host: addr.to_string(),
        })
    }

    /// `POST path` with a JSON `body`; the status and the body answered.
    async fn post(&mut self, path: &str, body: &str) -> Result<(u16, Vec<u8>)> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.host,
            body.len()
        );
        self.conn.get_mut().write_all(request.as_bytes()).await?;
        let mut line = String::new();
        self.conn.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("not an HTTP status line: {line:?}"))?;
        let mut length = 0;
        loop {
            line.clear();
            if self.conn.read_line(&mut line).await? == 0 || line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse()?;
            }
        }
        let mut body = vec![0; length];
        self.conn.read_exact(&mut body).await?;
        Ok((status, body))
    }
}

/// The `subscriptions` service: default flags but `--no-relay` (one
/// `outbox-relay` process publishes its outbox) and a free loopback port.
#[derive(Debug)]
struct SubscriptionsProc {
    program: Program,
    addr: SocketAddr,
    log: PathBuf,
}

impl SubscriptionsProc {
    async fn start(env: &Env, bin: &Path, name: &str, db_url: &str) -> Result<Self> {
        let mut program = Program::new(name, bin.to_path_buf(), &env.logs)
            .env("DATABASE_URL", db_url)
            .args(["--no-relay", "--listen", "127.0.0.1:0"])
            .ready_when("listening on http://");
        let line = program.start().await?.unwrap_or_default();
        let addr = line
            .rsplit_once("http://")
            .and_then(|(_, a)| a.trim().parse().ok())
            .ok_or_else(|| format!("{name}: no address in {line:?}"))?;
        Ok(Self {
            log: env.logs.join(format!("{name}.log")),
            program,
            addr,
        })
    }

    /// Our child whose command line names its port 0 (the only one).
    fn pid(&self) -> Option<u32> {
        children()
            .into_iter()
            .find_map(|(pid, comm, _)| (comm == "subscriptions").then_some(pid))
    }

    async fn stop(mut self, env: &Env) {
        stop_noting(env, &mut self.program, &self.log, ONE_REPLICA).await;
    }
}

/// The warning a benchmark's one-replica stream draws, expected.
const ONE_REPLICA: &str = "durability: the stream has 1 replica";

/// One `billing` process: default flags but for `--stream`, `--metrics-addr`
/// and, above 1, `--batch`.
#[derive(Debug)]
struct BillingProc {
    program: Program,
    metrics: SocketAddr,
    log: PathBuf,
}

impl BillingProc {
    async fn start(
        env: &Env,
        bin: &Path,
        name: &str,
        db_url: &str,
        stream: &str,
        batch: Option<u16>,
        relay: bool,
    ) -> Result<Self> {
        let metrics = SocketAddr::from(([127, 0, 0, 1], outbox_testkit::free_port()?));
        let mut program = Program::new(name, bin.to_path_buf(), &env.logs)
            .env("DATABASE_URL", db_url)
            .env("NATS_URL", &env.nats_url)
            .args(["--stream", stream, "--metrics-addr", &metrics.to_string()])
            .ready_when("billing ready");
        if let Some(batch) = batch {
            program = program.args(["--batch".to_owned(), batch.to_string()]);
        }
        if !relay {
            program = program.arg("--no-relay");
        }
        program.start().await?;
        Ok(Self {
            log: env.logs.join(format!("{name}.log")),
            program,
            metrics,
        })
    }

    /// Our child whose command line names its metrics address.
    fn pid(&self) -> Option<u32> {
        let needle = self.metrics.to_string();
        children().into_iter().find_map(|(pid, _, cmdline)| {
            String::from_utf8_lossy(&cmdline)
                .contains(&needle)
                .then_some(pid)
        })
    }

    async fn scrape(&self) -> Result<Scraped> {
        let body = scrape_metrics(self.metrics, "billing").await?;
        Ok(Scraped::parse(&body))
    }

    /// SIGTERM; notes a failed exit and every warning or error in its log.
    async fn stop(mut self, env: &Env) {
        stop_noting(env, &mut self.program, &self.log, ONE_REPLICA).await;
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Billing's counters (summed over their labels).
#[derive(Debug, Clone, Copy, Default)]
struct Scraped {
    handled: f64,
    duplicates: f64,
    failed: f64,
    handler_seconds: f64,
    handler_count: f64,
    /// `invoice.created` published by billing's own relay.
    published: f64,
}

impl Scraped {
    fn parse(text: &str) -> Self {
        let mut out = Self::default();
        for (name, _, value) in samples(text) {
            let slot = match name {
                "inbox_handled_total" => &mut out.handled,
                "inbox_duplicates_total" => &mut out.duplicates,
                "inbox_failed_total" => &mut out.failed,
                "inbox_handler_duration_seconds_sum" => &mut out.handler_seconds,
                "inbox_handler_duration_seconds_count" => &mut out.handler_count,
                "outbox_relay_published_total" => &mut out.published,
                _ => continue,
            };
            *slot += value;
        }
        out
    }
}

/// This process's children: pid, `comm`, command line.
fn children() -> Vec<(u32, String, Vec<u8>)> {
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (head, rest) = stat.rsplit_once(')')?;
            let ppid = rest.split_whitespace().nth(1)?.parse::<u32>().ok()?;
            if ppid != me {
                return None;
            }
            let comm = head.split_once('(')?.1.to_owned();
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            Some((pid, comm, cmdline))
        })
        .collect()
}

/// The child of this process named `comm` (nats-server, when the harness
/// started it).
fn child_named(comm: &str) -> Option<u32> {
    children()
        .into_iter()
        .find_map(|(pid, c, _)| (c == comm).then_some(pid))
}

/// User + system CPU ticks of `pid`.
fn ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // After the command: state is field 3, utime 14 and stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Busy ticks of the whole machine, all cores.
fn machine_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    Some(v.iter().take(8).sum::<u64>() - v.get(3)? - v.get(4)?)
}

/// PostgreSQL backends connected to `database` (their process titles name it).
fn backends(database: &str) -> HashMap<u32, u64> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    let needle = format!(" {database} ");
    dir.flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            (cmdline.starts_with("postgres: ") && cmdline.contains(&needle)).then_some(())?;
            Some((pid, ticks(pid)?))
        })
        .collect()
}

/// CPU ticks at one instant.
#[derive(Debug)]
struct CpuMark {
    at: Instant,
    machine: u64,
    consumer: u64,
    backends: HashMap<u32, u64>,
    nats: u64,
}

impl CpuMark {
    fn take(consumer: Option<u32>, database: Option<&str>, nats: Option<u32>) -> Self {
        Self {
            at: Instant::now(),
            machine: machine_ticks().unwrap_or(0),
            consumer: consumer.and_then(ticks).unwrap_or(0),
            backends: database.map(backends).unwrap_or_default(),
            nats: nats.and_then(ticks).unwrap_or(0),
        }
    }

    /// Cores busy on average from `start` to this mark. A backend seen only
    /// now counts from zero; one gone by now is lost.
    fn since(&self, start: &Self) -> Cpu {
        let secs = self.at.duration_since(start.at).as_secs_f64().max(1e-9);
        let cores = |ticks: u64| ticks as f64 / CLK_TCK / secs;
        let pg: u64 = self
            .backends
            .iter()
            .map(|(pid, t)| t.saturating_sub(start.backends.get(pid).copied().unwrap_or(0)))
            .sum();
        Cpu {
            consumer: cores(self.consumer.saturating_sub(start.consumer)),
            pg: cores(pg),
            nats: cores(self.nats.saturating_sub(start.nats)),
            machine: cores(self.machine.saturating_sub(start.machine)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn billing_counters_from_prometheus_text() {
        let text = "# TYPE inbox_handled_total counter\n\
            inbox_handled_total{consumer=\"billing\",event_type=\"subscription.created\"} 20000\n\
            # TYPE inbox_handler_duration_seconds histogram\n\
            inbox_handler_duration_seconds_bucket{consumer=\"billing\",event_type=\"subscription.created\",le=\"0.005\"} 19000\n\
            inbox_handler_duration_seconds_sum{consumer=\"billing\",event_type=\"subscription.created\"} 40\n\
            inbox_handler_duration_seconds_count{consumer=\"billing\",event_type=\"subscription.created\"} 20000\n\
            outbox_relay_published_total{event_type=\"invoice.created\"} 19000\n";
        let s = Scraped::parse(text);
        assert_eq!(s.handled, 20_000.0);
        assert_eq!(s.handler_seconds, 40.0);
        assert_eq!(s.handler_count, 20_000.0);
        assert_eq!(s.published, 19_000.0);
        assert_eq!(s.failed, 0.0);
    }
}
