//! Part 12: a relay restarted on a backlog written while it was down.
//!
//! `--catch-up-events` rows over `--subjects` subjects. Per round and source
//! (the polling relay, `outbox-relay --source wal`), on a fresh database and
//! stream: one `outbox-relay` process with default flags starts on the empty
//! table (the WAL relay makes its slot and records its backfill) and is
//! stopped; the rows are written; the relay starts again and the clock runs
//! from its start until every row is in the stream and marked. The WAL relay
//! must catch up from its slot, not backfill through the polling path: a
//! round where it backfilled is noted. The two sources alternate their order
//! round by round; the result is the median of the per-round ratios, and CPU
//! seconds per 100,000 events by process.

use std::time::{Duration, Instant};

use crate::Args;
use crate::cpu::{Use, per_events_table};
use crate::harness::{
    Db, Env, RelayProc, Result, SUBJECTS, drop_slots, finish_drain, insert_series, pad,
    repeat_if_killed, stop_all,
};
use crate::stats::{Spread, num, ratios};

/// The sources compared, with the flags that pick them.
const SOURCES: [(&str, &[&str]); 2] = [
    ("outbox-relay (polling)", &[]),
    ("outbox-relay --source wal", &["--source", "wal"]),
];

/// What the WAL relay logs when it catches up from its slot.
const CATCHING_UP: &str = "catching up from its confirmed position";
/// What a relay logs once it is ready to publish.
const STARTED: [&str; 2] = ["outbox relay started", "reading the WAL"];

/// One source's restart in one round.
#[derive(Debug, Clone)]
struct Run {
    rate: f64,
    cpu: Use,
    wall: Duration,
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let rows = args.catch_up_events;
    println!(
        "\n## Catch-up: {rows} rows written while the relay was stopped, then the relay restarted"
    );
    let pad = pad()?;
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); SOURCES.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..SOURCES.len()).collect();
        order.rotate_left(round % SOURCES.len());
        for i in order {
            let run = repeat_if_killed(env, || one(env, args, pad, i)).await?;
            println!(
                "round {round}: {:<26} {:>9} events/s, {:.2} CPU-s per 100k (relay {:.2}, postgres {:.2}, nats-server {:.2})",
                SOURCES[i].0,
                num(run.rate, 0),
                run.cpu.total() * 100_000.0 / rows as f64,
                run.cpu.of(crate::cpu::Who::Relay) * 100_000.0 / rows as f64,
                run.cpu.of(crate::cpu::Who::Database) * 100_000.0 / rows as f64,
                run.cpu.of(crate::cpu::Who::Broker) * 100_000.0 / rows as f64,
            );
            runs[i].push(run);
        }
    }
    let rates = |i: usize| -> Vec<f64> { runs[i].iter().map(|r| r.rate).collect() };
    let mut out = format!(
        "### Catch-up ({} rows written while the relay was stopped, {} subjects, {} rounds)\n\n\
         | relay restarted | events/s, median (range) | ÷ polling, per round |\n|---|---:|---:|\n",
        num(rows as f64, 0),
        num(args.subjects as f64, 0),
        args.rounds
    );
    for (i, (name, _)) in SOURCES.iter().enumerate() {
        out.push_str(&format!(
            "| {name} | {} | {} |\n",
            Spread::of(&rates(i)),
            Spread::of(&ratios(&rates(i), &rates(0))).show(2)
        ));
    }
    let lines: Vec<(String, Vec<(Use, Duration)>)> = SOURCES
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            (
                (*name).to_owned(),
                runs[i].iter().map(|r| (r.cpu.clone(), r.wall)).collect(),
            )
        })
        .collect();
    out.push_str("\nCPU seconds per 100,000 events, by process (median):\n\n");
    out.push_str(&per_events_table("relay restarted", &lines, rows));
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

async fn one(env: &Env, args: &Args, pad: usize, source: usize) -> Result<Run> {
    let db = env.database("catchup").await?;
    let stream = env.stream_name();
    let result = one_on(env, args, pad, source, &db, &stream).await;
    env.delete_stream(&stream).await;
    drop_slots(&db).await?;
    env.drop_database(db).await?;
    result
}

async fn one_on(
    env: &Env,
    args: &Args,
    pad: usize,
    source: usize,
    db: &Db,
    stream: &str,
) -> Result<Run> {
    let (name, flags) = SOURCES[source];
    // First start on the empty table, then stopped.
    let first_name = format!("{stream}_first");
    let mut first =
        RelayProc::start_with_args(env, &first_name, &db.url, stream, SUBJECTS, flags).await?;
    let ready = first.wait_logged(STARTED[source]).await;
    first.stop(env).await;
    ready?;
    insert_series(&db.pool, args.catch_up_events, args.subjects, pad).await?;
    let started = Instant::now();
    let again = format!("{stream}_again");
    let relay = RelayProc::start_with_args(env, &again, &db.url, stream, SUBJECTS, flags).await?;
    let drained = finish_drain(
        env,
        db,
        stream,
        args.catch_up_events,
        started,
        vec![relay],
        |_, _| Ok(()),
    )
    .await?;
    let log = std::fs::read_to_string(env.logs.join(format!("{again}.log"))).unwrap_or_default();
    if source == 1 && !log.contains(CATCHING_UP) {
        env.note(format!("{name} did not catch up from its slot in {stream}"));
    }
    let rate = drained.rate(args.catch_up_events);
    let (cpu, wall) = (drained.cpu.clone(), drained.elapsed);
    stop_all(env, drained.relays).await;
    Ok(Run { rate, cpu, wall })
}
