//! `outbox-bench`: throughput measured side by side in one run, on one machine,
//! against real PostgreSQL and nats-server processes (started here unless
//! `DATABASE_URL` / `NATS_URL` are set). Absolute numbers drift with the
//! machine; the ratios are the result.
//!
//! ```text
//! cargo run --release -p outbox-bench -- --events 50000 --subjects 1000 --drain-rows 300000
//! ```
//!
//! 1. **raw**: the same envelopes published straight to JetStream, pipelined,
//!    every PubAck awaited (the ceiling for any relay).
//! 2. **relay**: the same number of events committed to `outbox_events`, then
//!    drained by the relay to JetStream.
//! 3. **sustained drain**: a large backlog claimed and marked with a sink that
//!    acks at once, so only the database work is measured, reported per time
//!    window: the claim's cost must not grow as marked rows leave dead tuples.
//! 4. **consumer order**: the `billing` binary as processes, two replicas
//!    ordered (its default) against two `--unordered` and one alone
//!    ([`consumer`]); needs `cargo build --release -p example-billing` too.

mod consumer;

use std::error::Error;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream::Config};
use clap::Parser;
use futures::StreamExt;
use outbox_core::{Envelope, Outbox};
use outbox_publisher::{
    OutgoingMessage, PublishAck, PublishFailure, Relay, RelayConfig, Sink, StreamSpec,
};
use outbox_testkit::{nats, postgres};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
struct Args {
    /// Events for the raw vs relay comparison.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Distinct envelope subjects (entities) the events are spread over.
    #[arg(long, default_value_t = 1_000)]
    subjects: usize,
    /// Relay batch size.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Relay worker loops to compare (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    workers: Vec<usize>,
    /// Backlog for the sustained drain (0 skips it).
    #[arg(long, default_value_t = 300_000)]
    drain_rows: usize,
    /// Window length for the sustained drain report.
    #[arg(long, default_value = "2s", value_parser = parse_secs)]
    window: Duration,
    /// Events per round of the consumer-order comparison (0 skips it).
    #[arg(long, default_value_t = 20_000)]
    consumer_events: usize,
    /// Rounds of the consumer-order comparison.
    #[arg(long, default_value_t = 3)]
    consumer_rounds: usize,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    s.trim_end_matches('s')
        .parse::<f64>()
        .map(Duration::from_secs_f64)
        .map_err(|e| e.to_string())
}

/// Acks at once: isolates the database side of the relay.
#[derive(Debug)]
struct NullSink;

impl Sink for NullSink {
    async fn publish(&self, _message: OutgoingMessage) -> Result<PublishAck, PublishFailure> {
        Ok(PublishAck {
            stream: "null".into(),
            sequence: 0,
            duplicate: false,
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let pg = postgres().await?;
    let admin_url = pg.url().to_owned();
    let broker = nats()?;
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&admin_url)
        .await?;
    outbox_core::migrate(&pool).await?;
    let client = async_nats::connect(broker.url()).await?;
    let js = jetstream::new(client.clone());
    println!(
        "events={} subjects={} batch={} (machine: {} cores)",
        args.events,
        args.subjects,
        args.batch_size,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    let events = make_events(args.events, args.subjects)?;
    let raw = raw_jetstream(&js, &events).await?;
    println!("raw JetStream publish : {:>9.0} events/s", raw);
    for &workers in &args.workers {
        let relay = relay_drain(&pool, client.clone(), &events, args.batch_size, workers).await?;
        println!(
            "outbox relay, {workers} worker(s): {:>9.0} events/s   relay / raw {:.2}",
            relay,
            relay / raw
        );
    }

    if args.consumer_events > 0 {
        consumer_order(&pool, &admin_url, broker.url(), &args).await?;
    }

    if args.drain_rows > 0 {
        let mut summary = Vec::new();
        for vacuum in [None, Some(50_000)] {
            let rates = sustained_drain(
                &pool,
                args.drain_rows,
                args.subjects,
                args.batch_size,
                args.window,
                vacuum,
            )
            .await?;
            summary.push((vacuum, flatness(&rates)));
        }
        for (vacuum, ratios) in summary {
            if let Some((late, slowest)) = ratios {
                println!(
                    "relay vacuum {:<3}: last window / first {:.2}, slowest / first {:.2}",
                    if vacuum.is_some() { "on" } else { "off" },
                    late,
                    slowest
                );
            }
        }
    }
    Ok(())
}

/// Billing as processes: ordered replicas against unordered ones and one alone.
async fn consumer_order(
    admin: &PgPool,
    admin_url: &str,
    nats_url: &str,
    args: &Args,
) -> Result<(), Box<dyn Error>> {
    let bin_dir = std::env::current_exe()?
        .parent()
        .map(std::path::Path::to_path_buf)
        .ok_or("no directory for this executable")?;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); consumer::MODES.len()];
    for round in 0..args.consumer_rounds {
        let mut order: Vec<usize> = (0..consumer::MODES.len()).collect();
        order.rotate_left(round % consumer::MODES.len());
        for i in order {
            let mode = consumer::MODES[i];
            let rate = consumer::billing_rate(
                admin,
                admin_url,
                nats_url,
                &bin_dir,
                mode,
                round,
                args.consumer_events,
            )
            .await?;
            println!(
                "round {round}: billing, {:<30} {rate:>8.0} events/s",
                mode.name
            );
            rates[i].push(rate);
        }
    }
    let ratios = |of: usize, to: usize| -> Vec<f64> {
        rates[of]
            .iter()
            .zip(&rates[to])
            .map(|(a, b)| a / b)
            .collect()
    };
    for (i, mode) in consumer::MODES.iter().enumerate() {
        let (median, low, high) = consumer::summary(rates[i].clone());
        println!(
            "billing, {:<30} median {median:>8.0} events/s (range {low:.0} to {high:.0})",
            mode.name
        );
    }
    for (label, of, to) in [
        ("2 ordered / 2 unordered", 0, 1),
        ("2 ordered / 1 replica", 0, 2),
    ] {
        let (median, low, high) = consumer::summary(ratios(of, to));
        println!("{label:<26} median {median:.2} (range {low:.2} to {high:.2})");
    }
    Ok(())
}

fn make_events(
    n: usize,
    subjects: usize,
) -> Result<Vec<Envelope<serde_json::Value>>, Box<dyn Error>> {
    (0..n)
        .map(|i| {
            Envelope::new(
                "bench.created",
                "bench",
                format!("entity_{}", i % subjects),
                json!({"n": i, "plan": "pro", "amount_cents": 1234, "customer_id": "cust_123456"}),
            )
            .map_err(Into::into)
        })
        .collect()
}

async fn fresh_stream(js: &jetstream::Context, name: &str) -> Result<(), Box<dyn Error>> {
    let _ = js.delete_stream(name).await;
    js.create_stream(Config {
        name: name.into(),
        subjects: vec!["bench.>".into()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Publishes every envelope with `Nats-Msg-Id`, up to 1,024 acks in flight.
async fn raw_jetstream(
    js: &jetstream::Context,
    events: &[Envelope<serde_json::Value>],
) -> Result<f64, Box<dyn Error>> {
    fresh_stream(js, "BENCH").await?;
    let elapsed = publish_all(js, events).await?;
    Ok(events.len() as f64 / elapsed.as_secs_f64())
}

/// Publishes each envelope on its event type with `Nats-Msg-Id`, up to 1,024
/// acks in flight, every PubAck awaited; returns how long that took.
pub(crate) async fn publish_all(
    js: &jetstream::Context,
    events: &[Envelope<serde_json::Value>],
) -> Result<Duration, Box<dyn Error>> {
    let bodies: Vec<(String, String, bytes::Bytes)> = events
        .iter()
        .map(|e| {
            Ok((
                e.event_type().as_str().to_owned(),
                e.id().to_string(),
                e.to_json()?.into(),
            ))
        })
        .collect::<Result<_, outbox_core::Error>>()?;
    let started = Instant::now();
    let acks = futures::stream::iter(bodies)
        .map(|(subject, id, body)| async move {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            js.publish_with_headers(subject, headers, body).await?.await
        })
        .buffer_unordered(1_024)
        .collect::<Vec<_>>()
        .await;
    let elapsed = started.elapsed();
    for ack in acks {
        ack?;
    }
    Ok(elapsed)
}

async fn relay_drain(
    pool: &PgPool,
    client: async_nats::Client,
    events: &[Envelope<serde_json::Value>],
    batch_size: usize,
    workers: usize,
) -> Result<f64, Box<dyn Error>> {
    sqlx::query("truncate outbox_events").execute(pool).await?;
    for chunk in events.chunks(1_000) {
        let mut tx = pool.begin().await?;
        Outbox::unvalidated().enqueue_all(&mut tx, chunk).await?;
        tx.commit().await?;
    }
    sqlx::query("vacuum analyze outbox_events")
        .execute(pool)
        .await?;
    let js = jetstream::new(client.clone());
    fresh_stream(&js, "BENCH").await?;
    let relay = Relay::jetstream(
        pool.clone(),
        client,
        &StreamSpec::new("BENCH", vec![]),
        RelayConfig::default()
            .batch_size(batch_size)
            .workers(workers),
    )
    .await?;
    let started = Instant::now();
    let report = relay.drain().await?;
    let elapsed = started.elapsed();
    if report.published != events.len() {
        return Err(format!("relay published {} of {}", report.published, events.len()).into());
    }
    Ok(events.len() as f64 / elapsed.as_secs_f64())
}

async fn sustained_drain(
    pool: &PgPool,
    rows: usize,
    subjects: usize,
    batch_size: usize,
    window: Duration,
    vacuum_every: Option<u64>,
) -> Result<Vec<f64>, Box<dyn Error>> {
    sqlx::query("truncate outbox_events").execute(pool).await?;
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, created_at)
         select gen_random_uuid(), 'bench.created', 'bench', 'entity_' || (i % $2), now(),
                jsonb_build_object('n', i), now() + i * interval '1 microsecond'
           from generate_series(1, $1) i",
    )
    .bind(i64::try_from(rows)?)
    .bind(i64::try_from(subjects)?)
    .execute(pool)
    .await?;
    sqlx::query("vacuum analyze outbox_events")
        .execute(pool)
        .await?;
    let config = RelayConfig::default()
        .batch_size(batch_size)
        .listen(false)
        .retention(None)
        .vacuum_every(vacuum_every);
    let relay = Relay::new(pool.clone(), NullSink, config)?;
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    };
    let handle = tokio::spawn(running);

    println!(
        "sustained drain of {rows} rows (database side only), relay vacuum {}:",
        vacuum_every.map_or("off".to_string(), |n| format!("every {n} rows"))
    );
    let started = Instant::now();
    let mut left = rows as i64;
    let mut rates = Vec::new();
    while left > 0 {
        tokio::time::sleep(window).await;
        let now_left: i64 =
            sqlx::query_scalar("select count(*) from outbox_events where published_at is null")
                .fetch_one(pool)
                .await?;
        let dead: i64 = sqlx::query_scalar(
            "select n_dead_tup from pg_stat_user_tables where relname = 'outbox_events'",
        )
        .fetch_one(pool)
        .await?;
        let rate = (left - now_left) as f64 / window.as_secs_f64();
        println!(
            "  t={:>5.1}s  {:>8.0} rows/s  dead tuples {:>8}",
            started.elapsed().as_secs_f64(),
            rate,
            dead
        );
        if now_left > 0 {
            rates.push(rate);
        }
        left = now_left;
    }
    shutdown.cancel();
    handle.await??;
    let total = started.elapsed();
    println!(
        "  drained {rows} rows in {:.1}s: {:.0} rows/s",
        total.as_secs_f64(),
        rows as f64 / total.as_secs_f64()
    );
    Ok(rates)
}

/// Late full window over first, and slowest over first.
fn flatness(rates: &[f64]) -> Option<(f64, f64)> {
    let (first, rest) = rates.split_first()?;
    let late = rest.last()?;
    let slowest = rates.iter().cloned().fold(f64::MAX, f64::min);
    Some((late / first, slowest / first))
}
