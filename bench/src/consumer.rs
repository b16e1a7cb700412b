//! The price of per-subject order across consumer replicas, measured on the
//! shipped `billing` binary as processes, with its default flags.
//!
//! Each round starts fresh replicas on a fresh database and stream, waits for
//! `billing ready` from each, publishes `subscription.created` events (one
//! subscription each) straight to JetStream, and times the invoices committed
//! from the first 5 % to the last (start-up and leader election excluded).
//! Modes, in the same round: two replicas ordered (the default: one leads, one
//! stands by), two replicas `--unordered` (both consume), one replica
//! (ordered). Rounds alternate the modes' order.

use std::path::Path;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::Config};
use outbox_pg::Envelope;
use outbox_testkit::{Program, create_database};
use serde_json::json;
use sqlx::PgPool;

use crate::Args;
use crate::harness::{Env, Result, publish_all};
use crate::stats::{Spread, num, ratios};

/// One way of running billing.
#[derive(Debug, Clone, Copy)]
struct Mode {
    name: &'static str,
    replicas: usize,
    unordered: bool,
}

const MODES: [Mode; 3] = [
    Mode {
        name: "2 replicas, ordered (default)",
        replicas: 2,
        unordered: false,
    },
    Mode {
        name: "2 replicas, --unordered",
        replicas: 2,
        unordered: true,
    },
    Mode {
        name: "1 replica",
        replicas: 1,
        unordered: false,
    },
];

/// Billing as processes: ordered replicas against unordered ones and one alone.
pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    println!(
        "\n## Consumer order: billing as processes, {} events per mode",
        args.consumer_events
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..MODES.len()).collect();
        order.rotate_left(round % MODES.len());
        for i in order {
            let mode = MODES[i];
            let rate = billing_rate(
                &env.admin,
                &env.admin_url,
                &env.nats_url,
                &env.bin_dir,
                mode,
                round,
                args.consumer_events,
            )
            .await?;
            println!(
                "round {round}: billing, {:<30} {:>8} events/s",
                mode.name,
                num(rate, 0)
            );
            rates[i].push(rate);
        }
    }
    let mut out = format!(
        "### Consumer order ({} events, {} rounds)\n\n\
         | billing | events/s, median (range) |\n|---|---:|\n",
        num(args.consumer_events as f64, 0),
        args.rounds
    );
    for (i, mode) in MODES.iter().enumerate() {
        out.push_str(&format!("| {} | {} |\n", mode.name, Spread::of(&rates[i])));
    }
    out.push('\n');
    for (label, of, to) in [
        ("2 ordered / 2 unordered", 0, 1),
        ("2 ordered / 1 replica", 0, 2),
    ] {
        out.push_str(&format!(
            "{label}, per round: {}\n",
            Spread::of(&ratios(&rates[of], &rates[to])).show(2)
        ));
    }
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// Events per second billing handled (invoice committed) in `mode`.
async fn billing_rate(
    admin: &PgPool,
    admin_url: &str,
    nats_url: &str,
    bin_dir: &Path,
    mode: Mode,
    round: usize,
    events: usize,
) -> Result<f64> {
    let name = format!(
        "bench_billing_{round}_{}",
        mode.replicas * 2 + usize::from(mode.unordered)
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "drop database if exists {name} with (force)"
    )))
    .execute(admin)
    .await?;
    let url = create_database(admin_url, &name).await?;
    let js = jetstream::new(async_nats::connect(nats_url).await?);
    let _ = js.delete_stream("OUTBOX").await;
    js.create_stream(Config {
        name: "OUTBOX".into(),
        subjects: vec!["subscription.>".into(), "invoice.>".into()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await?;

    let logs = std::env::temp_dir().join("outbox-bench");
    std::fs::create_dir_all(&logs)?;
    let mut replicas = Vec::new();
    for i in 0..mode.replicas {
        let mut program = Program::new(&format!("{name}_{i}"), bin_dir.join("billing"), &logs)
            .env("DATABASE_URL", &url)
            .env("NATS_URL", nats_url)
            .ready_when("billing ready");
        if mode.unordered {
            program = program.arg("--unordered");
        }
        program.start().await?;
        replicas.push(program);
    }

    let batch: Vec<Envelope<serde_json::Value>> = (0..events)
        .map(|i| {
            let subscription = format!("sub_{round}_{i:07}");
            Envelope::new(
                "subscription.created",
                "subscriptions",
                &subscription,
                json!({"subscription_id": subscription, "customer_id": "cus_1", "plan": "pro", "amount_cents": 1234}),
            )
        })
        .collect::<Result<_, _>>()?;
    let pool = PgPool::connect(&url).await?;
    publish_all(&js, &batch).await?;
    // Steady state: from the first 5 % of the invoices to the last.
    let warm = events / 20;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut started = None;
    loop {
        let invoiced: i64 = sqlx::query_scalar("select count(*) from invoices")
            .fetch_one(&pool)
            .await?;
        let invoiced = usize::try_from(invoiced).unwrap_or(0);
        if started.is_none() && invoiced >= warm {
            started = Some((Instant::now(), invoiced));
        }
        if invoiced >= events {
            break;
        }
        if Instant::now() > deadline {
            return Err(
                format!("{}: {invoiced} of {events} invoices after 600 s", mode.name).into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (started, at_start) = started.ok_or("no invoice counted")?;
    let elapsed = started.elapsed();
    for replica in &mut replicas {
        replica.terminate().await;
    }
    pool.close().await;
    Ok((events - at_start) as f64 / elapsed.as_secs_f64())
}
