//! Part 3: commit → broker latency at a paced write rate.
//!
//! One `outbox-relay` process with default flags, polling, and again with
//! `--source wal` (reading its slot before the clock starts), side by side
//! in every round, their order rotated. A JetStream ordered
//! consumer (`DeliverPolicy::New`) is subscribed before anything is written;
//! one warm-up event must arrive before the clock starts. Then writers commit
//! one event per transaction at `--rate` per second for `--latency-secs`,
//! each noting the instant its COMMIT returned; the consumer notes the
//! instant each event arrived. Latency = arrival − commit, on this process's
//! monotonic clock. Beside it, the relay's claim statements per event (from
//! its `/metrics`): what waking on each commit costs the database.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use outbox_pg::{Envelope, Outbox};
use serde_json::json;
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::Args;
use crate::harness::{
    Db, Env, RelayProc, Result, SUBJECTS, drop_slots, repeat_if_killed, stop_all,
};
use crate::stats::{Spread, num, percentile};

/// Concurrent writer connections sharing the paced schedule.
const WRITERS: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Run {
    p50: f64,
    p99: f64,
    max: f64,
    written_rate: f64,
    /// The relay's claim statements per event published (its
    /// `outbox_relay_batch_phase_seconds_count{phase="claim"}`): at a paced
    /// rate, what waking up on each commit costs.
    claims_per_event: f64,
}

/// The relay's sources measured, by their `--source` flag.
const SOURCES: [&str; 2] = ["poll", "wal"];

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    println!(
        "\n## Commit → broker latency: {} events/s for {} s, 1 outbox-relay process",
        args.rate, args.latency_secs
    );
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); SOURCES.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..SOURCES.len()).collect();
        order.rotate_left(round % SOURCES.len());
        for i in order {
            let run = repeat_if_killed(env, || one(env, args, SOURCES[i])).await?;
            println!(
                "round {round}: --source {:<4} p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (written at {} events/s), {:.2} claims per event",
                SOURCES[i],
                run.p50,
                run.p99,
                run.max,
                num(run.written_rate, 0),
                run.claims_per_event
            );
            runs[i].push(run);
        }
    }
    let pick = |i: usize, f: fn(&Run) -> f64| -> String {
        let values: Vec<f64> = runs[i].iter().map(f).collect();
        Spread::of(&values).show(1)
    };
    let written = |i: usize| -> String {
        let values: Vec<f64> = runs[i].iter().map(|r| r.written_rate).collect();
        Spread::of(&values).to_string()
    };
    let pick2 = |i: usize| -> String {
        let values: Vec<f64> = runs[i].iter().map(|r| r.claims_per_event).collect();
        Spread::of(&values).show(2)
    };
    let out = format!(
        "### Commit → broker latency ({} events/s for {} s, {} rounds)\n\n\
         | median (range) | `--source poll` (default) | `--source wal` |\n|---|---:|---:|\n\
         | p50, ms | {} | {} |\n| p99, ms | {} | {} |\n| max, ms | {} | {} |\n\
         | written, events/s | {} | {} |\n| claims per event | {} | {} |\n",
        num(args.rate as f64, 0),
        args.latency_secs,
        args.rounds,
        pick(0, |r| r.p50),
        pick(1, |r| r.p50),
        pick(0, |r| r.p99),
        pick(1, |r| r.p99),
        pick(0, |r| r.max),
        pick(1, |r| r.max),
        written(0),
        written(1),
        pick2(0),
        pick2(1),
    );
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

fn event(n: usize) -> Result<Envelope> {
    Ok(Envelope::new(
        "bench.created",
        "bench",
        format!("entity_{}", n % 1_000),
        json!({"n": n, "plan": "pro", "amount_cents": 1234, "customer_id": "cust_123456"}),
    )?)
}

async fn one(env: &Env, args: &Args, source: &str) -> Result<Run> {
    let db = env.database("latency").await?;
    let stream = env.stream_name();
    let result = one_on(env, args, &db, &stream, source).await;
    env.delete_stream(&stream).await;
    drop_slots(&db).await?;
    env.drop_database(db).await?;
    result
}

async fn one_on(env: &Env, args: &Args, db: &Db, stream: &str, source: &str) -> Result<Run> {
    let mut relay = RelayProc::start_with_args(
        env,
        &format!("{stream}_relay0"),
        &db.url,
        stream,
        SUBJECTS,
        &["--source", source],
    )
    .await?;
    if source == "wal"
        && let Err(e) = relay.wait_logged("reading the WAL").await
    {
        relay.stop(env).await;
        return Err(e);
    }
    let mut relays = vec![relay];

    // The relay creates the stream; subscribe once it exists.
    let deadline = Instant::now() + Duration::from_secs(30);
    let js_stream = loop {
        if let Ok(s) = env.js.get_stream(stream).await {
            break s;
        }
        if Instant::now() > deadline {
            stop_all(env, relays).await;
            return Err(format!("{stream} not created within 30 s").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let consumer = js_stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::New,
            filter_subject: SUBJECTS.into(),
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel::<(Uuid, Instant)>();
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            let at = Instant::now();
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

    // Warm-up: one event through before the clock starts.
    let warm = event(0)?;
    let mut tx = db.pool.begin().await?;
    Outbox::unvalidated().enqueue(&mut tx, &warm).await?;
    tx.commit().await?;
    let ready = tokio::time::timeout(Duration::from_secs(30), arrived.recv()).await;
    if !matches!(ready, Ok(Some((id, _))) if id == *warm.id().as_uuid()) {
        reader.abort();
        let alive = relays[0].check_alive("before the warm-up event arrived");
        stop_all(env, relays).await;
        alive?;
        return Err("the warm-up event did not arrive within 30 s".into());
    }

    let total = args.rate * args.latency_secs as usize;
    let interval = Duration::from_secs_f64(1.0 / args.rate as f64);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let pool = db.pool.clone();
            let next = next.clone();
            tokio::spawn(async move {
                let mut committed = Vec::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        return Ok::<_, crate::harness::BoxError>(committed);
                    }
                    tokio::time::sleep_until((started + interval * n as u32).into()).await;
                    let e = event(n)?;
                    let mut tx = pool.begin().await?;
                    Outbox::unvalidated().enqueue(&mut tx, &e).await?;
                    tx.commit().await?;
                    committed.push((*e.id().as_uuid(), Instant::now()));
                }
            })
        })
        .collect();
    let mut commits = HashMap::with_capacity(total);
    for writer in writers {
        commits.extend(writer.await??);
    }
    let written_rate = total as f64 / started.elapsed().as_secs_f64();

    let mut latencies = Vec::with_capacity(total);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while latencies.len() < total {
        match tokio::time::timeout_at(deadline, arrived.recv()).await {
            Ok(Some((id, at))) => {
                if let Some(committed) = commits.get(&id) {
                    latencies.push(at.saturating_duration_since(*committed).as_secs_f64() * 1e3);
                }
            }
            _ => break,
        }
    }
    reader.abort();
    let alive = relays[0].check_alive("while the writers wrote");
    let phases = relays[0].phases().await;
    stop_all(env, relays).await;
    alive?;
    let phases = phases?;
    let claims = phases.batches.get("claim").copied().unwrap_or(0.0);
    if latencies.len() < total {
        return Err(format!("{} of {total} events arrived within 30 s", latencies.len()).into());
    }
    Ok(Run {
        p50: percentile(&mut latencies, 50.0),
        p99: percentile(&mut latencies, 99.0),
        max: percentile(&mut latencies, 100.0),
        written_rate,
        claims_per_event: claims / phases.published.max(1.0),
    })
}
