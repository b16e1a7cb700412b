//! Part 4: the relay's memory while it drains a large backlog.
//!
//! `--rss-rows` rows (written by the database in one statement), one
//! `outbox-relay` process with default flags, once per source (`--source
//! poll`, then `--source wal`) in each of `--rounds` rounds, their order
//! rotated from round to round; each drain on a fresh database and stream.
//! `VmRSS` is read from `/proc/<pid>/status` at every poll of the drain,
//! `VmHWM` (the kernel's own peak) at the end. With `--source wal` the relay
//! is started first and reads its slot while the rows are written (the same
//! one statement). Beside the memory, each drain's rate and the CPU seconds
//! per 100,000 rows by process, so that a bound on memory is seen not to
//! cost the drain.

use std::time::Duration;

use crate::Args;
use crate::cpu::{Use, Who};
use crate::harness::{
    Db, Env, POLL, Result, drain, drop_slots, insert_series, pad, repeat_if_killed, stop_all,
    wal_drain,
};
use crate::stats::{Spread, num};

/// The relay's sources, in the order of the first round.
const SOURCES: [&str; 2] = ["poll", "wal"];

/// A field of `/proc/<pid>/status` in KiB.
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// One drain's memory, rate and CPU.
#[derive(Debug)]
struct Run {
    /// `VmRSS` when the first row was in the stream, MiB.
    first: f64,
    /// The highest `VmRSS` sampled, MiB, and how many samples.
    max: f64,
    samples: usize,
    /// `VmHWM` at the end, MiB.
    hwm: f64,
    rate: f64,
    cpu: Use,
    wall: Duration,
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let rows = args.rss_rows;
    let rounds = args.rounds.max(1);
    println!(
        "\n## Relay memory draining {rows} rows, 1 outbox-relay process, --source {}, {rounds} rounds",
        SOURCES.join(" and ")
    );
    let mut runs: Vec<Vec<Run>> = SOURCES.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..SOURCES.len()).collect();
        order.rotate_left(round % SOURCES.len());
        for i in order {
            let source = SOURCES[i];
            let run = repeat_if_killed(env, || async {
                let db = env.database("rss").await?;
                let stream = env.stream_name();
                let result = measure(env, args, &db, &stream, source).await;
                env.delete_stream(&stream).await;
                drop_slots(&db).await?;
                env.drop_database(db).await?;
                result
            })
            .await?;
            println!(
                "round {round}: --source {source:<4} VmHWM {:.1} MiB, max VmRSS {:.1} MiB \
                 ({} samples), first {:.1} MiB, {} rows/s, relay {:.2} CPU-s per 100k rows",
                run.hwm,
                run.max,
                run.samples,
                run.first,
                num(run.rate, 0),
                run.cpu.of(Who::Relay) * 100_000.0 / rows.max(1) as f64
            );
            runs[i].push(run);
        }
    }
    let out = report(args, rounds, &runs);
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// The part's tables: memory and rate per source, CPU per source and process.
fn report(args: &Args, rounds: usize, runs: &[Vec<Run>]) -> String {
    let rows = args.rss_rows;
    let mut out = format!(
        "### Relay memory ({} rows, 1 process, {rounds} rounds, sources interleaved)\n\n\
         | source | VmHWM at the end, MiB | VmRSS max, MiB | VmRSS at the first row published, MiB | rows/s | samples ({POLL:?} apart) |\n\
         |---|---:|---:|---:|---:|---:|\n",
        num(rows as f64, 0),
    );
    for (source, runs) in SOURCES.iter().zip(runs) {
        let of = |f: &dyn Fn(&Run) -> f64| Spread::of(&runs.iter().map(f).collect::<Vec<_>>());
        out.push_str(&format!(
            "| `--source {source}` | {} | {} | {} | {} | {} |\n",
            of(&|r| r.hwm).show(1),
            of(&|r| r.max).show(1),
            of(&|r| r.first).show(1),
            of(&|r| r.rate),
            of(&|r| r.samples as f64),
        ));
    }
    let lines: Vec<(String, Vec<(Use, Duration)>)> = SOURCES
        .iter()
        .zip(runs)
        .map(|(source, runs)| {
            (
                format!("`--source {source}`"),
                runs.iter().map(|r| (r.cpu.clone(), r.wall)).collect(),
            )
        })
        .collect();
    out.push_str(&format!(
        "\nCPU seconds per 100,000 rows while each drain ran, by process (median of the rounds; \
         from /proc):\n\n{}",
        crate::cpu::per_events_table("source", &lines, rows)
    ));
    out
}

/// Drains `--rss-rows` in `db` with one relay of `source`.
async fn measure(env: &Env, args: &Args, db: &Db, stream: &str, source: &str) -> Result<Run> {
    let rows = args.rss_rows;
    let write = insert_series(&db.pool, rows, args.subjects, pad()?);
    let mut pid = None;
    let (mut first, mut max, mut samples) = (None, 0_u64, 0_usize);
    let each = |relays: &[crate::harness::RelayProc], messages: u64| {
        if pid.is_none() {
            pid = relays.first().and_then(|r| r.pid());
        }
        if let Some(kib) = pid.and_then(|p| status_kib(p, "VmRSS")) {
            if messages > 0 {
                first.get_or_insert(kib);
            }
            max = max.max(kib);
            samples += 1;
        }
        Ok(())
    };
    let run = if source == "wal" {
        wal_drain(env, db, stream, rows, write, each).await?
    } else {
        write.await?;
        drain(env, db, stream, rows, 1, each).await?
    };
    let hwm = pid.and_then(|p| status_kib(p, "VmHWM"));
    let out = Run {
        first: mib(first.unwrap_or(0)),
        max: mib(max),
        samples,
        hwm: mib(hwm.unwrap_or(0)),
        rate: run.rate(rows),
        cpu: run.cpu.clone(),
        wall: run.elapsed,
    };
    stop_all(env, run.relays).await;
    if hwm.is_none() || samples == 0 {
        return Err("could not read the relay's /proc/<pid>/status".into());
    }
    Ok(out)
}
