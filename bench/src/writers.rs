//! Part 5: what the NOTIFY trigger costs writers.
//!
//! `--writers` connections, each looping `begin; insert one event
//! (Outbox::enqueue); commit` for `--writer-secs`, with the migration's
//! `outbox_events_notify` trigger in place, and dropped, with no relay
//! running (the write path alone); then with the trigger in place and one
//! `outbox-relay` publishing beside the writers, polling, and reading the
//! WAL (`--source wal`: what logical decoding and the relay cost the writers
//! on the same machine). Rounds rotate the order.

use std::time::{Duration, Instant};

use outbox_pg::{Envelope, Outbox};
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::sync::Barrier;

use crate::Args;
use crate::harness::{BoxError, Db, Env, RelayProc, Result, SUBJECTS, drop_slots};
use crate::stats::{Spread, num, ratios};

const MODES: [&str; 4] = [
    "NOTIFY trigger on (default)",
    "NOTIFY trigger off",
    "trigger on, outbox-relay (poll) running",
    "trigger on, outbox-relay --source wal running",
];

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    println!(
        "\n## Writers: {} connections, one event per transaction, {} s",
        args.writers, args.writer_secs
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..MODES.len()).collect();
        order.rotate_left(round % MODES.len());
        for i in order {
            let relay = match i {
                2 => Some("poll"),
                3 => Some("wal"),
                _ => None,
            };
            let rate = one(env, args, i != 1, relay).await?;
            println!(
                "round {round}: {:<46} {:>8} commits/s",
                MODES[i],
                num(rate, 0)
            );
            rates[i].push(rate);
        }
    }
    let mut out = format!(
        "### Writers ({} connections, one event per transaction, {} s, {} rounds)\n\n\
         | writers with | commits/s, median (range) |\n|---|---:|\n",
        args.writers, args.writer_secs, args.rounds
    );
    for (i, mode) in MODES.iter().enumerate() {
        out.push_str(&format!("| {mode} | {} |\n", Spread::of(&rates[i])));
    }
    out.push_str(&format!(
        "\nPer round, to the trigger on with no relay: trigger off {}; a polling relay running {}; a WAL relay running {}\n",
        Spread::of(&ratios(&rates[1], &rates[0])).show(2),
        Spread::of(&ratios(&rates[2], &rates[0])).show(2),
        Spread::of(&ratios(&rates[3], &rates[0])).show(2),
    ));
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// One measurement; `relay`: the `--source` of a relay running beside.
async fn one(env: &Env, args: &Args, notify: bool, relay: Option<&str>) -> Result<f64> {
    let db = env.database("writers").await?;
    if !notify {
        sqlx::query("drop trigger outbox_events_notify on outbox_events")
            .execute(&db.pool)
            .await?;
    }
    let stream = env.stream_name();
    let mut running = None;
    if let Some(source) = relay {
        let mut r = RelayProc::start_with_args(
            env,
            &format!("{stream}_{source}"),
            &db.url,
            &stream,
            SUBJECTS,
            &["--source", source],
        )
        .await?;
        let marker = if source == "wal" {
            "reading the WAL"
        } else {
            "outbox relay started"
        };
        if let Err(e) = r.wait_logged(marker).await {
            r.stop(env).await;
            return Err(e);
        }
        running = Some(r);
    }
    let rate = write(args, &db).await;
    if let Some(r) = running {
        r.stop(env).await;
        env.delete_stream(&stream).await;
        drop_slots(&db).await?;
    }
    env.drop_database(db).await?;
    rate
}

/// `--writers` connections committing one event each per transaction for
/// `--writer-secs`: commits per second.
async fn write(args: &Args, db: &Db) -> Result<f64> {
    let duration = Duration::from_secs(args.writer_secs);
    let barrier = std::sync::Arc::new(Barrier::new(args.writers + 1));
    let mut tasks = Vec::with_capacity(args.writers);
    for w in 0..args.writers {
        let mut conn = PgConnection::connect(&db.url).await?;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let deadline = Instant::now() + duration;
            let mut commits = 0_u64;
            while Instant::now() < deadline {
                let event = Envelope::new(
                    "bench.created",
                    "bench",
                    format!("entity_{w}_{}", commits % 64),
                    json!({"n": commits, "plan": "pro", "amount_cents": 1234, "customer_id": "cust_123456"}),
                )?;
                let mut tx = conn.begin().await?;
                Outbox::unvalidated().enqueue(&mut tx, &event).await?;
                tx.commit().await?;
                commits += 1;
            }
            conn.close().await?;
            Ok::<_, BoxError>(commits)
        }));
    }
    barrier.wait().await;
    let started = Instant::now();
    let mut commits = 0;
    for task in tasks {
        commits += task.await??;
    }
    let elapsed = started.elapsed();
    Ok(commits as f64 / elapsed.as_secs_f64())
}
