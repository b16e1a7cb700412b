//! Part 7: the inbox consumer as users run it: the shipped `billing` binary,
//! one process with its default flags (ordered, `--concurrency 16`, its
//! in-process relay for `invoice.created`), against a plain JetStream
//! consumer that only acks.
//!
//! **Throughput from a backlog.** Each mode gets a fresh stream (subjects
//! `subscription.>,invoice.>`, as billing's relay would create it) and, for
//! billing, a fresh database. `--inbox-events` `subscription.created` events
//! (one subscription each) are published to JetStream first; then the
//! consumer starts, and the clock runs from the moment it is ready (billing:
//! its `billing ready` line, after its migrations and its durable consumer
//! exist) until every event is handled (billing: the last invoice's
//! `created_at`, once `count(*)` of `invoices`, polled every 250 ms, reaches
//! the events; ack-only: every ack confirmed).
//! Modes, in the same round, their order rotated: the ack-only consumer (the
//! ceiling), then billing with each `--inbox-batches` value (`--batch 1` is
//! its default: one transaction per delivery), and each `--inbox-no-relay`
//! value with `--no-relay` too (none by default: a diagnostic of what
//! billing's own relay costs). Only `DATABASE_URL`, `NATS_URL`, `--stream`,
//! `--metrics-addr` and `--batch` (above 1) are set.
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
//! **Latency through relay and consumer.** An upstream database with the
//! outbox tables, one `outbox-relay` process (default flags) publishing into
//! the stream, and billing consuming it into its own database. One warm-up
//! event must be invoiced before the clock starts. Then 8 writers commit one
//! `subscription.created` per transaction at `--inbox-rate` per second for
//! `--inbox-latency-secs`, each noting the wall-clock time its COMMIT
//! returned; latency = the invoice's `created_at` (`clock_timestamp()` when
//! billing inserted it, inside its transaction, just before its commit) −
//! that commit time. Same machine, same clock. Modes: billing with each
//! `--inbox-latency-batches` value.
//!
//! Where the time goes: CPU (in cores, averaged over the drain) of the
//! consumer process, of the PostgreSQL backends connected to billing's
//! database, of nats-server (when this harness started it) and of the whole
//! machine (`/proc`; in the latency runs also the relay, the upstream
//! database's backends and this process); billing's own Prometheus counters;
//! and, for the backlog, the transactions committed in billing's database per
//! event (`pg_stat_database`, read once billing has exited, the harness's own
//! polls subtracted; billing's relay and lease count too). Each latency run
//! also splits its latency where the event enters the stream, as an ordered
//! consumer of the harness sees it (wall clock on arrival).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
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
use crate::harness::{BoxError, Db, Env, RelayProc, Result, publish_all, samples, scrape_metrics};
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
    /// `--batch`, and whether billing runs its in-process relay (the default).
    Billing(u16, bool),
    /// The library in process, a no-op handler, deliveries per transaction.
    Library(u16),
}

impl Mode {
    fn name(self) -> String {
        match self {
            Self::AckOnly => "ack-only JetStream consumer (no database)".to_owned(),
            Self::Billing(1, true) => "billing --batch 1 (default)".to_owned(),
            Self::Billing(b, true) => format!("billing --batch {b}"),
            Self::Billing(b, false) => format!("billing --batch {b} --no-relay"),
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

/// One paced latency run.
#[derive(Debug, Clone, Copy)]
struct Latency {
    p50: f64,
    p99: f64,
    max: f64,
    /// p50 and p99, ms: commit → the event in the stream (an observer's
    /// ordered consumer), and from there → the invoice.
    to_stream: (f64, f64),
    from_stream: (f64, f64),
    /// Events invoiced per second, from the first write to the last invoice.
    handled_rate: f64,
    written_rate: f64,
    /// Billing, its database's backends, nats-server, the machine.
    cpu: Cpu,
    /// The upstream side: `consumer` is the relay, `pg` the upstream
    /// database's backends, `nats` this process (the writers and the observer).
    upstream: Cpu,
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let (bin, built) = billing_bin(env)?;
    let nats_pid = child_named("nats-server");
    let mut modes = vec![Mode::AckOnly];
    modes.extend(args.inbox_batches.iter().map(|&b| Mode::Billing(b, true)));
    modes.extend(args.inbox_no_relay.iter().map(|&b| Mode::Billing(b, false)));
    modes.extend(args.inbox_library.iter().map(|&b| Mode::Library(b)));
    println!(
        "\n## Inbox consumer: {} events from a backlog, then {} events/s for {} s through outbox-relay\nbilling: {built}",
        args.inbox_events, args.inbox_rate, args.inbox_latency_secs
    );

    // Per mode, per round: `None` if the mode failed in that round (noted).
    let mut drains: Vec<Vec<Option<Drained>>> = vec![Vec::new(); modes.len()];
    let mut latencies: Vec<Vec<Option<Latency>>> =
        vec![Vec::new(); args.inbox_latency_batches.len()];
    for round in 0..args.rounds {
        if args.inbox_events > 0 {
            let mut order: Vec<usize> = (0..modes.len()).collect();
            order.rotate_left(round % modes.len());
            for i in order {
                let mode = modes[i];
                let result = match mode {
                    Mode::AckOnly => ack_only(env, args.inbox_events, nats_pid).await,
                    Mode::Billing(batch, relay) => {
                        billing_drain(env, &bin, batch, relay, args.inbox_events, nats_pid).await
                    }
                    Mode::Library(batch) => {
                        library_drain(env, batch, args.inbox_events, nats_pid).await
                    }
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
        if args.inbox_rate > 0 && args.inbox_latency_secs > 0 {
            let mut order: Vec<usize> = (0..args.inbox_latency_batches.len()).collect();
            let n = order.len().max(1);
            order.rotate_left(round % n);
            for i in order {
                let batch = args.inbox_latency_batches[i];
                match latency(env, args, &bin, batch, nats_pid).await {
                    Ok(l) => {
                        println!(
                            "round {round}: latency, {:<28} p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; to the stream p50 {:.1} p99 {:.1}, from it p50 {:.1} p99 {:.1} (written at {}, invoiced at {} events/s; cores: billing {:.2} pg {:.2} nats {:.2} relay {:.2} upstream pg {:.2} harness {:.2} machine {:.2})",
                            Mode::Billing(batch, true).name(),
                            l.p50,
                            l.p99,
                            l.max,
                            l.to_stream.0,
                            l.to_stream.1,
                            l.from_stream.0,
                            l.from_stream.1,
                            num(l.written_rate, 0),
                            num(l.handled_rate, 0),
                            l.cpu.consumer,
                            l.cpu.pg,
                            l.cpu.nats,
                            l.upstream.consumer,
                            l.upstream.pg,
                            l.upstream.nats,
                            l.cpu.machine
                        );
                        latencies[i].push(Some(l));
                    }
                    Err(e) => {
                        env.note(format!(
                            "round {round}, latency with {}: {e}",
                            Mode::Billing(batch, true).name()
                        ));
                        latencies[i].push(None);
                    }
                }
            }
        }
    }

    let mut out = format!("Inbox part: billing {built}.\n\n");
    if args.inbox_events > 0 {
        out.push_str(&throughput_table(args, &modes, &drains));
    }
    if args.inbox_rate > 0 && args.inbox_latency_secs > 0 {
        out.push_str(&latency_table(args, &latencies));
    }
    println!("\n{out}");
    summary.push(out);
    Ok(())
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

fn latency_table(args: &Args, latencies: &[Vec<Option<Latency>>]) -> String {
    let mut out = format!(
        "### Inbox consumer: commit → invoice latency ({} events/s for {} s through 1 outbox-relay process, {} rounds)\n\n\
         | billing | p50, ms | p99, ms | max, ms | commit → stream p50 / p99, ms | stream → invoice p50 / p99, ms | written, events/s | invoiced, events/s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        num(args.inbox_rate as f64, 0),
        args.inbox_latency_secs,
        args.rounds
    );
    let mut cpu = String::from(
        "\nCPU during the latency runs, cores (median, range):\n\n\
         | billing | billing | its database's backends | nats-server | outbox-relay | upstream database's backends | the harness (writers, observer) | machine |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, &batch) in args.inbox_latency_batches.iter().enumerate() {
        let runs: Vec<Latency> = latencies[i].iter().flatten().copied().collect();
        let name = Mode::Billing(batch, true).name();
        if runs.is_empty() {
            out.push_str(&format!(
                "| {name} | failed in every round (see notes) | | | | | | |\n"
            ));
            continue;
        }
        let pick = |f: fn(&Latency) -> f64| -> Spread {
            Spread::of(&runs.iter().map(f).collect::<Vec<_>>())
        };
        let failed = latencies[i].iter().filter(|l| l.is_none()).count();
        out.push_str(&format!(
            "| {name}{} | {} | {} | {} | {} / {} | {} / {} | {} | {} |\n",
            if failed > 0 {
                format!(" ({failed} rounds failed, see notes)")
            } else {
                String::new()
            },
            pick(|l| l.p50).show(1),
            pick(|l| l.p99).show(1),
            pick(|l| l.max).show(1),
            pick(|l| l.to_stream.0).show(1),
            pick(|l| l.to_stream.1).show(1),
            pick(|l| l.from_stream.0).show(1),
            pick(|l| l.from_stream.1).show(1),
            pick(|l| l.written_rate),
            pick(|l| l.handled_rate),
        ));
        cpu.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} |\n",
            pick(|l| l.cpu.consumer).show(2),
            pick(|l| l.cpu.pg).show(2),
            pick(|l| l.cpu.nats).show(2),
            pick(|l| l.upstream.consumer).show(2),
            pick(|l| l.upstream.pg).show(2),
            pick(|l| l.upstream.nats).show(2),
            pick(|l| l.cpu.machine).show(2),
        ));
    }
    out.push_str(&cpu);
    out.push('\n');
    out
}

/// This run's copy of `billing` (a rebuild during the run cannot change it
/// between modes), and when it was built.
fn billing_bin(env: &Env) -> Result<(PathBuf, String)> {
    let built = env.bin_dir.join("billing");
    if !built.is_file() {
        return Err(format!(
            "{} is missing: cargo build --release -p example-billing",
            built.display()
        )
        .into());
    }
    let when = std::fs::metadata(&built)?.modified()?;
    let when = chrono::DateTime::<chrono::Utc>::from(when).format("%Y-%m-%d %H:%M:%S UTC");
    let copy = env.logs.join("billing");
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
    let consumer = Consumer::new(env.js.clone(), pool.clone(), config).await?;
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

async fn billing_drain(
    env: &Env,
    bin: &Path,
    batch: u16,
    relay: bool,
    events: usize,
    nats_pid: Option<u32>,
) -> Result<Drained> {
    let db = env.database(&format!("inbox_b{batch}")).await?;
    let stream = env.stream_name();
    let result = billing_drain_on(env, bin, (batch, relay), events, nats_pid, &db, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn billing_drain_on(
    env: &Env,
    bin: &Path,
    (batch, relay): (u16, bool),
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
    bin: &Path,
    batch: u16,
    nats_pid: Option<u32>,
) -> Result<Latency> {
    let upstream = env.database("inbox_upstream").await?;
    let own = match env.database(&format!("inbox_lat_b{batch}")).await {
        Ok(db) => db,
        Err(e) => {
            env.drop_database(upstream).await?;
            return Err(e);
        }
    };
    let stream = env.stream_name();
    let result = latency_on(env, args, bin, batch, nats_pid, &upstream, &own, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(own).await?;
    env.drop_database(upstream).await?;
    result
}

#[allow(clippy::too_many_arguments)]
async fn latency_on(
    env: &Env,
    args: &Args,
    bin: &Path,
    batch: u16,
    nats_pid: Option<u32>,
    upstream: &Db,
    own: &Db,
    stream: &str,
) -> Result<Latency> {
    create_stream(env, stream).await?;
    let relay = RelayProc::start_with_subjects(
        env,
        &format!("{stream}_relay0"),
        &upstream.url,
        stream,
        &STREAM_SUBJECTS.join(","),
    )
    .await?;
    let mut billing = match BillingProc::start(
        env,
        bin,
        &format!("{stream}_billing"),
        &own.url,
        stream,
        batch,
        true,
    )
    .await
    {
        Ok(billing) => billing,
        Err(e) => {
            relay.stop(env).await;
            return Err(e);
        }
    };
    let mut relay = relay;
    let result = paced(
        env,
        args,
        nats_pid,
        (upstream, own, stream),
        &mut billing,
        &mut relay,
    )
    .await;
    billing.stop(env).await;
    let alive = relay.check_alive("while billing consumed");
    relay.stop(env).await;
    alive?;
    result
}

/// Wall-clock microseconds since the epoch.
fn wall_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

async fn paced(
    env: &Env,
    args: &Args,
    nats_pid: Option<u32>,
    (upstream, own, stream): (&Db, &Db, &str),
    billing: &mut BillingProc,
    relay: &mut RelayProc,
) -> Result<Latency> {
    // An observer: when each event reached the stream (wall clock).
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
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel::<(Uuid, i64)>();
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            let at = wall_micros();
            let id = serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|v| v["id"].as_str().and_then(|s| Uuid::parse_str(s).ok()));
            if let Some(id) = id
                && arrived_tx.send((id, at)).is_err()
            {
                return;
            }
        }
    });
    let result = paced_observed(
        env,
        args,
        nats_pid,
        (upstream, own),
        billing,
        relay,
        &mut arrived,
    )
    .await;
    reader.abort();
    result
}

async fn paced_observed(
    env: &Env,
    args: &Args,
    nats_pid: Option<u32>,
    (upstream, own): (&Db, &Db),
    billing: &mut BillingProc,
    relay: &mut RelayProc,
    arrived: &mut mpsc::UnboundedReceiver<(Uuid, i64)>,
) -> Result<Latency> {
    // Warm-up: one event invoiced before the clock starts.
    let warm = subscription("warm", 0)?;
    let mut tx = upstream.pool.begin().await?;
    Outbox::unvalidated().enqueue(&mut tx, &warm).await?;
    tx.commit().await?;
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

    let total = args.inbox_rate * args.inbox_latency_secs as usize;
    let interval = Duration::from_secs_f64(1.0 / args.inbox_rate as f64);
    let next = Arc::new(AtomicUsize::new(0));
    let pid = billing.pid();
    let cpu0 = CpuMark::take(pid, Some(&own.name), nats_pid);
    let (relay_pid, me) = (relay.pid(), Some(std::process::id()));
    let upstream0 = CpuMark::take(relay_pid, Some(&upstream.name), me);
    let started = Instant::now();
    let started_wall = wall_micros();
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let pool = upstream.pool.clone();
            let next = next.clone();
            tokio::spawn(async move {
                let mut committed = Vec::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        return Ok::<_, BoxError>(committed);
                    }
                    tokio::time::sleep_until((started + interval.mul_f64(n as f64)).into()).await;
                    let e = subscription("paced", n)?;
                    let mut tx = pool.begin().await?;
                    Outbox::unvalidated().enqueue(&mut tx, &e).await?;
                    tx.commit().await?;
                    committed.push((*e.id().as_uuid(), wall_micros()));
                }
            })
        })
        .collect();
    let mut commits: HashMap<Uuid, i64> = HashMap::with_capacity(total);
    for writer in writers {
        commits.extend(writer.await??);
    }
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

    let rows: Vec<(Uuid, i64)> = sqlx::query_as(
        "select event_id, (extract(epoch from created_at) * 1000000)::int8 from invoices",
    )
    .fetch_all(&own.pool)
    .await?;
    let mut latencies: Vec<f64> = rows
        .iter()
        .filter_map(|(id, at)| Some((at - commits.get(id)?) as f64 / 1e3))
        .collect();
    if latencies.len() != total {
        return Err(format!("{} of {total} paced events invoiced", latencies.len()).into());
    }
    let last = rows.iter().map(|&(_, at)| at).max().unwrap_or(started_wall);
    let handled_rate = total as f64 / ((last - started_wall) as f64 / 1e6);

    // Split at the stream: commit → stream (relay) and stream → invoice (billing).
    let mut reached = HashMap::with_capacity(total);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while reached.len() < total {
        match tokio::time::timeout_at(deadline, arrived.recv()).await {
            Ok(Some((id, at))) => {
                if commits.contains_key(&id) {
                    reached.insert(id, at);
                }
            }
            _ => break,
        }
    }
    let mut to_stream: Vec<f64> = commits
        .iter()
        .filter_map(|(id, c)| Some((reached.get(id)? - c) as f64 / 1e3))
        .collect();
    let mut from_stream: Vec<f64> = rows
        .iter()
        .filter_map(|(id, at)| Some((at - reached.get(id)?) as f64 / 1e3))
        .collect();
    if to_stream.len() != total {
        env.note(format!(
            "the observer saw {} of {total} paced events reach the stream",
            to_stream.len()
        ));
    }
    Ok(Latency {
        p50: percentile(&mut latencies, 50.0),
        p99: percentile(&mut latencies, 99.0),
        max: percentile(&mut latencies, 100.0),
        to_stream: (
            percentile(&mut to_stream, 50.0),
            percentile(&mut to_stream, 99.0),
        ),
        from_stream: (
            percentile(&mut from_stream, 50.0),
            percentile(&mut from_stream, 99.0),
        ),
        handled_rate,
        written_rate,
        cpu,
        upstream: upstream_cpu,
    })
}

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
        batch: u16,
        relay: bool,
    ) -> Result<Self> {
        let metrics = SocketAddr::from((
            [127, 0, 0, 1],
            TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
        ));
        let mut program = Program::new(name, bin.to_path_buf(), &env.logs)
            .env("DATABASE_URL", db_url)
            .env("NATS_URL", &env.nats_url)
            .args(["--stream", stream, "--metrics-addr", &metrics.to_string()])
            .ready_when("billing ready");
        if batch > 1 {
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
        let code = self.program.terminate().await;
        if code != Some(0) {
            env.note(format!("{} exited with {code:?}", self.program.name));
        }
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let flagged: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        if let Some(first) = flagged.first() {
            env.note(format!(
                "{}: {} warning/error lines in {}, first: {first}",
                self.program.name,
                flagged.len(),
                self.log.display()
            ));
        }
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
                "outbox_published_total" => &mut out.published,
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
            outbox_published_total{event_type=\"invoice.created\"} 19000\n";
        let s = Scraped::parse(text);
        assert_eq!(s.handled, 20_000.0);
        assert_eq!(s.handler_seconds, 40.0);
        assert_eq!(s.handler_count, 20_000.0);
        assert_eq!(s.published, 19_000.0);
        assert_eq!(s.failed, 0.0);
    }
}
