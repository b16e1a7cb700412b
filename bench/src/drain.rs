//! Part 2: a sustained drain with the vacuum horizon free, and pinned.
//!
//! `--drain-rows` rows, one `outbox-relay` process with default flags. In the
//! pinned mode a separate session runs `begin isolation level repeatable read;
//! select count(*) from outbox_events` before the relay starts and keeps that
//! transaction open until the drain ends, so no row version the relay leaves
//! behind can be vacuumed. The rate per `--window` (from the first published
//! row) shows whether the cost of a claim grows with the rows published.

use sqlx::{Connection, PgConnection};

use crate::Args;
use crate::harness::{
    Db, Env, Result, TAIL, drain, insert_series, pad, repeat_if_killed, stop_all, window_rates,
};
use crate::stats::{Spread, num, ratios};

const MODES: [&str; 2] = ["horizon free", "horizon pinned"];

/// One mode's results in one round.
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    bulk: f64,
    first: f64,
    last: f64,
    slowest: f64,
    tail: f64,
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    println!(
        "\n## Sustained drain: {} rows, 1 outbox-relay process, horizon free vs pinned",
        args.drain_rows
    );
    let pad = pad()?;
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); MODES.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..MODES.len()).collect();
        order.rotate_left(round % MODES.len());
        for i in order {
            let run = repeat_if_killed(env, || one(env, args, pad, i == 1)).await?;
            println!(
                "round {round}: {:<15} {:>9} rows/s ({} to {:.0} %)  per {:?}: first {}, last {}, slowest {}; last {:.0} % in {:.2} s",
                MODES[i],
                num(run.rate, 0),
                num(run.bulk, 0),
                (1.0 - TAIL) * 100.0,
                args.window,
                num(run.first, 0),
                num(run.last, 0),
                num(run.slowest, 0),
                TAIL * 100.0,
                run.tail
            );
            runs[i].push(run);
        }
    }

    let pick = |i: usize, f: fn(&Run) -> f64| -> Vec<f64> { runs[i].iter().map(f).collect() };
    let mut out = format!(
        "### Sustained drain ({} rows, 1 process, {} rounds)\n\n\
         | horizon | rows/s, median (range) | rows/s until {b:.0} % published | first {w:?} window | last full window | slowest window | last / first | last {t:.0} % took, s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        num(args.drain_rows as f64, 0),
        args.rounds,
        w = args.window,
        t = TAIL * 100.0,
        b = (1.0 - TAIL) * 100.0
    );
    for (i, mode) in MODES.iter().enumerate() {
        out.push_str(&format!(
            "| {mode} | {} | {} | {} | {} | {} | {} | {} |\n",
            Spread::of(&pick(i, |r| r.rate)),
            Spread::of(&pick(i, |r| r.bulk)),
            Spread::of(&pick(i, |r| r.first)),
            Spread::of(&pick(i, |r| r.last)),
            Spread::of(&pick(i, |r| r.slowest)),
            Spread::of(&ratios(&pick(i, |r| r.last), &pick(i, |r| r.first))).show(2),
            Spread::of(&pick(i, |r| r.tail)).show(2),
        ));
    }
    let pinned_free = Spread::of(&ratios(&pick(1, |r| r.rate), &pick(0, |r| r.rate)));
    let pinned_free_bulk = Spread::of(&ratios(&pick(1, |r| r.bulk), &pick(0, |r| r.bulk)));
    out.push_str(&format!(
        "\npinned / free, per round: {} whole drain (goal ≥ 0.90), {} until {:.0} % published\n",
        pinned_free.show(2),
        pinned_free_bulk.show(2),
        (1.0 - TAIL) * 100.0
    ));
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

async fn one(env: &Env, args: &Args, pad: usize, pinned: bool) -> Result<Run> {
    let db = env.database("drain").await?;
    let stream = env.stream_name();
    let result = one_on(env, args, pad, pinned, &db, &stream).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn one_on(
    env: &Env,
    args: &Args,
    pad: usize,
    pinned: bool,
    db: &Db,
    stream: &str,
) -> Result<Run> {
    insert_series(&db.pool, args.drain_rows, args.subjects, pad).await?;
    let mut pin = None;
    if pinned {
        let mut conn = PgConnection::connect(&db.url).await?;
        sqlx::raw_sql("begin isolation level repeatable read; select count(*) from outbox_events")
            .execute(&mut conn)
            .await?;
        pin = Some(conn);
    }
    let run = drain(env, db, stream, args.drain_rows, 1, |_, _| Ok(())).await;
    if let Some(mut conn) = pin {
        // Still the same transaction: its snapshot held the horizon throughout.
        let open: bool = sqlx::query_scalar("select now() < statement_timestamp()")
            .fetch_one(&mut conn)
            .await?;
        if !open {
            env.note("the pinning transaction was not open at the end of the drain".into());
        }
        sqlx::raw_sql("rollback").execute(&mut conn).await?;
        conn.close().await?;
    }
    let run = run?;
    let dead: i64 = sqlx::query_scalar(
        "select n_dead_tup from pg_stat_user_tables where relname = 'outbox_events'",
    )
    .fetch_one(&db.pool)
    .await?;
    println!("  dead tuples at the end: {}", num(dead as f64, 0));
    let rates = window_rates(&run.samples, args.window);
    let shown: Vec<String> = rates.iter().map(|r| num(*r, 0)).collect();
    println!("  rows/s per {:?} window: {}", args.window, shown.join(" "));
    let rate = run.rate(args.drain_rows);
    let tail = run.tail(args.drain_rows);
    let bulk = run.bulk_rate(args.drain_rows);
    stop_all(env, run.relays).await;
    Ok(Run {
        rate,
        bulk,
        first: rates.first().copied().unwrap_or(0.0),
        last: rates.last().copied().unwrap_or(0.0),
        slowest: rates.iter().copied().reduce(f64::min).unwrap_or(0.0),
        tail,
    })
}
