//! Part 4: the relay's memory while it drains a large backlog.
//!
//! `--rss-rows` rows (written by the database in one statement), one
//! `outbox-relay` process with default flags; `VmRSS` from
//! `/proc/<pid>/status` at every poll of the drain, `VmHWM` at the end.
//! Run once per source, not per round: it is a bound, not a rate. With
//! `--source wal` the relay is started first and reads its slot while the
//! rows are written (the same one statement).

use crate::Args;
use crate::harness::{
    Db, Env, POLL, Result, TAIL, drain, drop_slots, insert_series, pad, repeat_if_killed, stop_all,
    wal_drain, window_rates,
};
use crate::stats::num;

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

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let rows = args.rss_rows;
    for source in ["poll", "wal"] {
        println!(
            "\n## Relay memory draining {rows} rows, 1 outbox-relay --source {source} process"
        );
        let out = repeat_if_killed(env, || async {
            let db = env.database("rss").await?;
            let stream = env.stream_name();
            let result = measure(env, args, &db, &stream, source).await;
            env.delete_stream(&stream).await;
            drop_slots(&db).await?;
            env.drop_database(db).await?;
            result
        })
        .await?;
        println!("\n{out}");
        summary.push(out);
    }
    Ok(())
}

/// Drains `--rss-rows` in `db` and returns the report.
async fn measure(env: &Env, args: &Args, db: &Db, stream: &str, source: &str) -> Result<String> {
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
    let hwm = pid.and_then(|p| status_kib(p, "VmHWM")).unwrap_or(0);
    let rate = run.rate(rows);
    let tail = run.tail(rows);
    let bulk = run.bulk_rate(rows);
    let windows = window_rates(&run.samples, args.window);
    stop_all(env, run.relays).await;
    if pid.is_none() || samples == 0 {
        return Err("could not read the relay's /proc/<pid>/status".into());
    }
    let out = format!(
        "### Relay memory ({} rows, 1 process, `--source {source}`, one run)\n\n\
         | | |\n|---|---:|\n\
         | VmRSS when the first row was published | {} |\n| VmRSS, max of {} samples ({:?} apart) | {} |\n\
         | VmHWM at the end | {} |\n| drain rate | {} rows/s |\n\
         | rate until {:.0} % published | {} rows/s |\n\
         | per {:?} window: first / last full | {} / {} rows/s |\n\
         | last {:.0} % of the rows took | {:.2} s |\n",
        num(rows as f64, 0),
        mib(first.unwrap_or(0)),
        samples,
        POLL,
        mib(max),
        mib(hwm),
        num(rate, 0),
        (1.0 - TAIL) * 100.0,
        num(bulk, 0),
        args.window,
        num(windows.first().copied().unwrap_or(0.0), 0),
        num(windows.last().copied().unwrap_or(0.0), 0),
        TAIL * 100.0,
        tail,
    );
    Ok(out)
}
