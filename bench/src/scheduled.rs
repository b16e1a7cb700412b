//! Part 11: scheduled events, beside the immediate path and through the due
//! lane.
//!
//! 1. **Immediate path with future rows.** One `outbox-relay` process with
//!    its default flags drains `--scheduled-events` immediate events
//!    (`--subjects` entities, ~325 B messages) from a table that holds no
//!    scheduled row, and from one that holds `--scheduled-rows` rows
//!    scheduled a day ahead (same entities and payloads, written in plain SQL
//!    by one `insert … select generate_series` setting `due_at`), polling and
//!    with `--source wal`. Each mode gets a fresh database copied from one of
//!    two templates made once per run (migrated and vacuumed, with or without
//!    the future rows: `create database … template … strategy file_copy`),
//!    so every round starts from the same settled table at the cost of a file
//!    copy rather than a million inserts. The modes run side by side in every
//!    round, their order rotated. Polling: the immediate rows are written
//!    (one statement) and vacuumed, and the clock runs from the relay's start
//!    until the stream holds every event; WAL: the relay is started first and
//!    reads its slot, the rows are written and committed (not vacuumed), and
//!    the clock runs from the commit. The figure is the rate with future rows
//!    over the rate without, per round and source (goal ≈ 1.0), with the CPU
//!    seconds per 100,000 events of each process.
//!
//!    Before the rounds, one database from each template gets the immediate
//!    rows, and the relay's idle-time statements are run under
//!    `EXPLAIN (ANALYZE, BUFFERS)` as the relay would run them (JIT off;
//!    custom and generic plans of the prepared statement): the claim of one
//!    worker's 32 shards, the backlog gauges (`stats.sql`, every 5 s on one
//!    relay), the due lane's next-due probe and its claim (rolled back).
//! 2. **Due lane.** `--due-events` rows scheduled for the same instant
//!    (`--due-lead` ahead, whole second), written in plain SQL while one
//!    `outbox-relay` process (polling, and with `--source wal`) runs, then
//!    vacuumed. From the due time until every row is published: events/s
//!    (rows / (last `published_at` − due time)), and each row's lateness
//!    (`published_at − due_at`, the database's clock) at p50, p99 and max,
//!    with the CPU seconds per 100,000 events of each process.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use clap::ValueEnum;
use outbox_pg::Envelope;
use sqlx::PgConnection;

use crate::Args;
use crate::cpu::{Sample, Use, per_events_table};
use crate::harness::{
    Db, Env, Phases, RelayProc, Result, SUBJECTS, Template, drain, drop_slots, enqueue_events,
    envelopes, insert_events, insert_scheduled, pad, repeat_if_killed, stop_all, vacuum,
    wait_for_messages, wait_marked, wal_drain,
};
use crate::stats::{Spread, num, ratios};

/// Where the relay finds immediate rows (its `--source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Source {
    Poll,
    Wal,
}

impl Source {
    fn flag(self) -> &'static str {
        match self {
            Self::Poll => "poll",
            Self::Wal => "wal",
        }
    }
}

/// One mode of the immediate-path comparison.
#[derive(Debug, Clone, Copy)]
struct Mode {
    source: Source,
    /// Whether the table holds the future rows.
    future: bool,
}

impl Mode {
    fn name(self, rows: usize) -> String {
        format!(
            "--source {}, {}",
            self.source.flag(),
            if self.future {
                format!("{} future rows", num(rows as f64, 0))
            } else {
                "no future rows".into()
            }
        )
    }
}

/// One drain or due burst: its rate, the relay's phases, and the CPU used.
#[derive(Debug, Clone)]
struct Run {
    rate: f64,
    phases: Phases,
    cpu: Use,
    wall: Duration,
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    if args.scheduled_events > 0 && !args.scheduled_sources.is_empty() {
        immediate(env, args, summary).await?;
    }
    if args.due_events > 0 && !args.scheduled_sources.is_empty() {
        due(env, args, summary).await?;
    }
    Ok(())
}

/// Part 1: the immediate path with and without the future rows.
async fn immediate(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    println!(
        "\n## Scheduled rows beside the immediate path: {} immediate events, with and without {} rows due in a day, 1 outbox-relay process",
        args.scheduled_events, args.scheduled_rows
    );
    let events = envelopes(args.scheduled_events, args.subjects, pad()?)?;
    let (without, with) = templates(env, args).await?;
    let result = async {
        let probes = probe(env, [&without, &with], &events).await?;
        let modes: Vec<Mode> = args
            .scheduled_sources
            .iter()
            .flat_map(|&source| [false, true].map(|future| Mode { source, future }))
            .collect();
        let runs = immediate_rounds(env, args, &events, &modes, [&without, &with]).await?;
        Ok::<_, crate::harness::BoxError>(format!(
            "{}\n{}",
            immediate_report(args, &modes, &runs),
            probes
        ))
    }
    .await;
    env.drop_template(without).await?;
    env.drop_template(with).await?;
    let out = result?;
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// The two templates: migrated and vacuumed, without scheduled rows and with
/// `--scheduled-rows` of them due in a day.
async fn templates(env: &Env, args: &Args) -> Result<(Template, Template)> {
    let empty = env.database("tpl_none").await?;
    vacuum(&empty.pool).await?;
    let empty = env.freeze(empty).await?;
    let full = match env.database("tpl_future").await {
        Ok(db) => db,
        Err(e) => {
            env.drop_template(empty).await?;
            return Err(e);
        }
    };
    let started = Instant::now();
    let written = async {
        let due: DateTime<Utc> = sqlx::query_scalar("select now() + interval '1 day'")
            .fetch_one(&full.pool)
            .await?;
        insert_scheduled(
            &full.pool,
            args.scheduled_rows,
            args.subjects,
            pad()?,
            Some(due),
        )
        .await
    }
    .await;
    if let Err(e) = written {
        env.drop_database(full).await?;
        env.drop_template(empty).await?;
        return Err(e);
    }
    println!(
        "{} rows scheduled a day ahead (one insert … select generate_series, then vacuum analyze) in {:.1} s",
        num(args.scheduled_rows as f64, 0),
        started.elapsed().as_secs_f64()
    );
    let full = env.freeze(full).await?;
    Ok((empty, full))
}

async fn immediate_rounds(
    env: &Env,
    args: &Args,
    events: &[Envelope],
    modes: &[Mode],
    templates: [&Template; 2],
) -> Result<Vec<Vec<Run>>> {
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); modes.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..modes.len()).collect();
        order.rotate_left(round % modes.len());
        for i in order {
            let mode = modes[i];
            let template = templates[usize::from(mode.future)];
            let run =
                repeat_if_killed(env, || immediate_once(env, args, events, template, mode)).await?;
            println!(
                "round {round}: {:<42} {:>9} events/s",
                mode.name(args.scheduled_rows),
                num(run.rate, 0)
            );
            runs[i].push(run);
        }
    }
    Ok(runs)
}

/// One drain of `events` by one relay, on a copy of `template`.
async fn immediate_once(
    env: &Env,
    args: &Args,
    events: &[Envelope],
    template: &Template,
    mode: Mode,
) -> Result<Run> {
    let label = match (mode.source, mode.future) {
        (Source::Poll, false) => "sched_poll_none",
        (Source::Poll, true) => "sched_poll_future",
        (Source::Wal, false) => "sched_wal_none",
        (Source::Wal, true) => "sched_wal_future",
    };
    let db = env.database_from(template, label).await?;
    let stream = env.stream_name();
    let result = async {
        let n = events.len();
        let drained = match mode.source {
            Source::Poll => {
                insert_events(&db.pool, events).await?;
                drain(env, &db, &stream, n, 1, |_, _| Ok(())).await?
            }
            Source::Wal => {
                let write = enqueue_events(&db.pool, events);
                wal_drain(env, &db, &stream, n, write, |_, _| Ok(())).await?
            }
        };
        let run = Run {
            rate: drained.rate(n),
            phases: drained.phases.clone(),
            cpu: drained.cpu.clone(),
            wall: drained.elapsed,
        };
        stop_all(env, drained.relays).await;
        let waiting: i64 = sqlx::query_scalar(
            "select count(*) from outbox_events
              where due_at is not null and published_at is null and released_at is null",
        )
        .fetch_one(&db.pool)
        .await?;
        let expected = if mode.future { args.scheduled_rows } else { 0 };
        if waiting != i64::try_from(expected)? {
            env.note(format!(
                "{label}: {waiting} scheduled rows still waiting after the drain, {expected} expected"
            ));
        }
        Ok(run)
    }
    .await;
    env.delete_stream(&stream).await;
    drop_slots(&db).await?;
    env.drop_database(db).await?;
    result
}

/// Milliseconds a phase took per batch, over all rounds.
fn phase_ms(p: &Phases, phase: &str) -> String {
    match (p.seconds.get(phase), p.batches.get(phase)) {
        (Some(s), Some(&b)) if b > 0.0 => format!("{:.1}", s / b * 1e3),
        _ => "–".into(),
    }
}

fn immediate_report(args: &Args, modes: &[Mode], runs: &[Vec<Run>]) -> String {
    let mut out = format!(
        "### Immediate path with future rows ({} immediate events, {} subjects, {} rows scheduled a day ahead, 1 outbox-relay process, {} rounds)\n\n\
         | relay, table | events/s, median (range) | with / without future rows, per round | claim ms/batch | claims over 100 ms, per drain | mark ms/batch | rows/batch |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        num(args.scheduled_events as f64, 0),
        num(args.subjects as f64, 0),
        num(args.scheduled_rows as f64, 0),
        args.rounds
    );
    let rates: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| r.iter().map(|run| run.rate).collect())
        .collect();
    for (i, mode) in modes.iter().enumerate() {
        let mut phases = Phases::default();
        for run in &runs[i] {
            phases.add(&run.phases);
        }
        // Modes come in pairs per source: without, then with.
        let base = i - usize::from(mode.future);
        let ratio = if mode.future {
            Spread::of(&ratios(&rates[i], &rates[base])).show(2)
        } else {
            "1.00".into()
        };
        let rows = phases
            .per_batch()
            .map_or("–".into(), |(_, r)| format!("{r:.0}"));
        out.push_str(&format!(
            "| {} | {} | {ratio} | {} | {:.1} | {} | {rows} |\n",
            mode.name(args.scheduled_rows),
            Spread::of(&rates[i]),
            phase_ms(&phases, "claim"),
            phases.over_100ms("claim") / runs[i].len().max(1) as f64,
            phase_ms(&phases, "mark"),
        ));
    }
    let lines: Vec<(String, Vec<(Use, Duration)>)> = modes
        .iter()
        .zip(runs)
        .map(|(m, r)| {
            let name = m.name(args.scheduled_rows);
            (
                name,
                r.iter().map(|run| (run.cpu.clone(), run.wall)).collect(),
            )
        })
        .collect();
    out.push_str(&format!(
        "\nCPU seconds per 100,000 events while the relay drained, by process (median of the rounds; from /proc):\n\n{}",
        per_events_table("relay, table", &lines, args.scheduled_events)
    ));
    out
}

/// A statement of the relay run under `EXPLAIN`, with its arguments as SQL
/// literals.
struct Statement {
    name: &'static str,
    sql: &'static str,
    args: String,
}

/// One plan's figures: planning and execution ms (medians of the
/// repetitions), and shared buffers hit or read (the last repetition).
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    planning: f64,
    execution: f64,
    buffers: i64,
}

/// Repetitions of each `EXPLAIN ANALYZE`.
const EXPLAINS: usize = 5;
/// The plans each statement is run with.
const PLANS: [(&str, &str); 2] = [
    ("custom", "force_custom_plan"),
    ("generic", "force_generic_plan"),
];

fn statements() -> Vec<Statement> {
    let list = |range: std::ops::Range<i32>, f: &dyn Fn(i32) -> String| -> String {
        let items: Vec<String> = range.map(f).collect();
        format!("'{{{}}}'", items.join(","))
    };
    // One worker's half of the 64 shards, each read 32 rows deep from a
    // cursor at 0 (as a relay starting on a backlog); the retry lane read as
    // deep as a batch; the byte budget and largest message as defaults.
    let claim = format!(
        "{}, {}, {}, 20, 8388608, 1048576, 1000, 9223372036854775807",
        list(0..32, &|s| s.to_string()),
        list(0..32, &|_| "0".into()),
        list(0..32, &|_| "32".into()),
    );
    let all = list(0..64, &|s| s.to_string());
    vec![
        Statement {
            name: "claim.sql (32 shards)",
            sql: include_str!("../../outbox-publisher/queries/claim.sql"),
            args: claim,
        },
        Statement {
            name: "stats.sql (gauges)",
            sql: include_str!("../../outbox-publisher/queries/stats.sql"),
            args: "20".into(),
        },
        Statement {
            name: "due_next.sql (64 shards)",
            sql: include_str!("../../outbox-publisher/queries/due_next.sql"),
            args: format!("{all}, 20"),
        },
        Statement {
            name: "due_claim.sql (64 shards)",
            sql: include_str!("../../outbox-publisher/queries/due_claim.sql"),
            args: format!("{all}, 20, 1000, 8388608, 1048576, 64"),
        },
    ]
}

/// Before the rounds: each template's copy with the immediate rows written,
/// its relation sizes and the relay's statements under `EXPLAIN`.
async fn probe(env: &Env, templates: [&Template; 2], events: &[Envelope]) -> Result<String> {
    let mut figures = Vec::new();
    let mut warmups = Vec::new();
    let mut sizes = Vec::new();
    for (template, label) in templates.into_iter().zip(["without", "with"]) {
        let db = env.database_from(template, "sched_probe").await?;
        let result = async {
            insert_events(&db.pool, events).await?;
            let mut conn = db.pool.acquire().await?;
            let f = explain_all(&mut conn, label).await?;
            let w = plan_cache(&mut conn).await?;
            Ok::<_, crate::harness::BoxError>((f, w, relation_sizes(&db).await?))
        }
        .await;
        env.drop_database(db).await?;
        let (f, w, s) = result?;
        figures.push(f);
        warmups.push(w);
        sizes.push(s);
    }
    Ok(probe_report(&figures, &warmups, &sizes))
}

/// Every statement under `EXPLAIN (ANALYZE, BUFFERS)`, custom and generic,
/// in one transaction rolled back (the due claim writes); the text plans
/// are printed.
async fn explain_all(conn: &mut PgConnection, label: &str) -> Result<Vec<[Figures; 2]>> {
    sqlx::raw_sql("set jit = off; begin")
        .execute(&mut *conn)
        .await?;
    let mut out = Vec::new();
    for statement in statements() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "prepare bench_probe as {}",
            statement.sql
        )))
        .execute(&mut *conn)
        .await?;
        let mut both = [Figures::default(); 2];
        for (k, (plan, setting)) in PLANS.iter().enumerate() {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "set plan_cache_mode = {setting}"
            )))
            .execute(&mut *conn)
            .await?;
            both[k] = explain(conn, &statement.args).await?;
            let text: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "explain (analyze, buffers) execute bench_probe({})",
                statement.args
            )))
            .persistent(false)
            .fetch_all(&mut *conn)
            .await?;
            println!(
                "\n{} ({plan} plan), {label} future rows:\n{}",
                statement.name,
                text.join("\n")
            );
        }
        sqlx::raw_sql("deallocate bench_probe")
            .execute(&mut *conn)
            .await?;
        out.push(both);
    }
    sqlx::raw_sql("rollback; reset plan_cache_mode")
        .execute(&mut *conn)
        .await?;
    Ok(out)
}

/// Executions of the claim, prepared once as a relay's connection prepares
/// it, with the plan cache's own choice of plan: ms of each (planning
/// included).
const WARMUP: usize = 10;

async fn plan_cache(conn: &mut PgConnection) -> Result<Vec<f64>> {
    let Some(claim) = statements().into_iter().next() else {
        return Ok(Vec::new());
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "set jit = off; reset plan_cache_mode; prepare bench_warmup as {}",
        claim.sql
    )))
    .execute(&mut *conn)
    .await?;
    let mut out = Vec::new();
    for _ in 0..WARMUP {
        let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "explain (analyze, format json) execute bench_warmup({})",
            claim.args
        )))
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let top = &plan[0];
        out.push(
            top["Planning Time"].as_f64().unwrap_or(0.0)
                + top["Execution Time"].as_f64().unwrap_or(0.0),
        );
    }
    sqlx::raw_sql("deallocate bench_warmup")
        .execute(&mut *conn)
        .await?;
    Ok(out)
}

/// [`EXPLAINS`] runs of the prepared statement with `args`.
async fn explain(conn: &mut PgConnection, args: &str) -> Result<Figures> {
    let mut planning = Vec::new();
    let mut execution = Vec::new();
    let mut buffers = 0;
    for _ in 0..EXPLAINS {
        let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "explain (analyze, buffers, format json) execute bench_probe({args})"
        )))
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let top = &plan[0];
        planning.push(top["Planning Time"].as_f64().unwrap_or(0.0));
        execution.push(top["Execution Time"].as_f64().unwrap_or(0.0));
        let root = &top["Plan"];
        buffers = root["Shared Hit Blocks"].as_i64().unwrap_or(0)
            + root["Shared Read Blocks"].as_i64().unwrap_or(0);
    }
    Ok(Figures {
        planning: Spread::of(&planning).median,
        execution: Spread::of(&execution).median,
        buffers,
    })
}

/// The table's and its indexes' sizes, MiB.
async fn relation_sizes(db: &Db) -> Result<Vec<(String, f64)>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "select 'outbox_events (table)', pg_relation_size('outbox_events')
         union all
         select * from (select c.relname::text, pg_relation_size(c.oid)
                          from pg_index i join pg_class c on c.oid = i.indexrelid
                         where i.indrelid = 'outbox_events'::regclass
                         order by c.relname) s",
    )
    .fetch_all(&db.pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(name, bytes)| (name, bytes as f64 / (1024.0 * 1024.0)))
        .collect())
}

fn probe_report(
    figures: &[Vec<[Figures; 2]>],
    warmups: &[Vec<f64>],
    sizes: &[Vec<(String, f64)>],
) -> String {
    let mut out = format!(
        "The relay's statements on a copy of each table with the immediate rows written, before a relay ran \
         (`EXPLAIN (ANALYZE, BUFFERS)` of the prepared statement, JIT off; planning + execution ms, median of {EXPLAINS}; \
         shared buffers hit or read):\n\n\
         | statement | plan | without future rows, ms | buffers | with future rows, ms | buffers |\n\
         |---|---|---:|---:|---:|---:|\n"
    );
    let (Some(without), Some(with)) = (figures.first(), figures.get(1)) else {
        return out;
    };
    for (s, statement) in statements().iter().enumerate() {
        for (k, (plan, _)) in PLANS.iter().enumerate() {
            let (a, b) = (without[s][k], with[s][k]);
            out.push_str(&format!(
                "| {} | {plan} | {:.2} + {:.2} | {} | {:.2} + {:.2} | {} |\n",
                statement.name,
                a.planning,
                a.execution,
                num(a.buffers as f64, 0),
                b.planning,
                b.execution,
                num(b.buffers as f64, 0)
            ));
        }
    }
    out.push_str(&format!(
        "\nThe claim prepared once and executed {WARMUP} times with the plan cache's own choice \
         (`plan_cache_mode = auto`, as on each of the relay's connections), planning + execution ms of each:\n\n"
    ));
    for (label, w) in ["without future rows", "with future rows"]
        .iter()
        .zip(warmups)
    {
        let each: Vec<String> = w.iter().map(|ms| format!("{ms:.1}")).collect();
        out.push_str(&format!("- {label}: {}\n", each.join(", ")));
    }
    out.push_str(
        "\nSizes, MiB (immediate rows written, none published):\n\n\
         | relation | without future rows | with future rows |\n|---|---:|---:|\n",
    );
    if let (Some(a), Some(b)) = (sizes.first(), sizes.get(1)) {
        for ((name, x), (_, y)) in a.iter().zip(b) {
            out.push_str(&format!("| {name} | {x:.1} | {y:.1} |\n"));
        }
    }
    out
}

/// The due lane's figures of one burst.
#[derive(Debug, Clone)]
struct DueRun {
    run: Run,
    /// Seconds from the due time until the last row was published.
    all_after: f64,
    /// Seconds from the due time until the first row was marked.
    first_after: f64,
    /// Seconds from the due time until the stream held the first message,
    /// and half of them (read every 50 ms).
    first_seen: f64,
    half_seen: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

/// Part 2: a burst of rows due at the same instant.
async fn due(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    println!(
        "\n## Due lane: {} rows due at the same second, 1 outbox-relay process",
        args.due_events
    );
    let sources = &args.scheduled_sources;
    let mut runs: Vec<Vec<DueRun>> = vec![Vec::new(); sources.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..sources.len()).collect();
        order.rotate_left(round % sources.len());
        for i in order {
            let run = repeat_if_killed(env, || due_once(env, args, sources[i])).await?;
            println!(
                "round {round}: --source {:<4} {:>9} events/s from the due time, first message after {:.2} s, all marked after {:.2} s, lateness p50 {:.2} s, p99 {:.2} s, max {:.2} s",
                sources[i].flag(),
                num(run.run.rate, 0),
                run.first_seen,
                run.all_after,
                run.p50,
                run.p99,
                run.max
            );
            runs[i].push(run);
        }
    }
    let out = due_report(args, &runs);
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// One burst on a fresh database and stream.
async fn due_once(env: &Env, args: &Args, source: Source) -> Result<DueRun> {
    let db = env.database("due").await?;
    let stream = env.stream_name();
    let result = async {
        let batch = args.due_batch_size.map(|n| n.to_string());
        let mut flags = vec!["--source", source.flag()];
        if let Some(n) = &batch {
            flags.extend(["--batch-size", n.as_str()]);
        }
        let mut relay = RelayProc::start_with_args(
            env,
            &format!("{stream}_due"),
            &db.url,
            &stream,
            SUBJECTS,
            &flags,
        )
        .await?;
        let ready = match source {
            Source::Poll => wait_stream(env, &stream, &mut relay).await,
            Source::Wal => relay.wait_logged("reading the WAL").await,
        };
        let mut relays = vec![relay];
        let run = match ready {
            Ok(()) => due_burst(env, args, &db, &stream, &mut relays).await,
            Err(e) => Err(e),
        };
        stop_all(env, relays).await;
        run
    }
    .await;
    env.delete_stream(&stream).await;
    drop_slots(&db).await?;
    env.drop_database(db).await?;
    result
}

/// Waits (at most 60 s) until `relay` has created `stream`.
async fn wait_stream(env: &Env, stream: &str, relay: &mut RelayProc) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.js.get_stream(stream).await.is_err() {
        relay.check_alive("before it created its stream")?;
        if Instant::now() > deadline {
            return Err(format!("{} made no stream {stream} within 60 s", relay.name()).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Schedules the rows, waits for their due time, and measures until every
/// one is published and marked.
async fn due_burst(
    env: &Env,
    args: &Args,
    db: &Db,
    stream: &str,
    relays: &mut [RelayProc],
) -> Result<DueRun> {
    let n = args.due_events;
    let due: DateTime<Utc> =
        sqlx::query_scalar("select date_trunc('second', now()) + make_interval(secs => $1)")
            .bind(args.due_lead.as_secs_f64().ceil())
            .fetch_one(&db.pool)
            .await?;
    insert_scheduled(&db.pool, n, args.subjects, pad()?, Some(due)).await?;
    let left: f64 = sqlx::query_scalar("select extract(epoch from $1 - clock_timestamp())::float8")
        .bind(due)
        .fetch_one(&db.pool)
        .await?;
    if left < 0.2 {
        return Err(format!(
            "the rows were written and vacuumed {:.1} s before their due time: raise --due-lead",
            left
        )
        .into());
    }
    if env.stream_messages(stream).await? > 0 {
        return Err("messages in the stream before the due time".into());
    }
    tokio::time::sleep(Duration::from_secs_f64(left)).await;
    let cpu_from = Sample::now();
    let started = Instant::now();
    let samples = wait_for_messages(env, stream, n, started, relays, |_, _| Ok(())).await?;
    wait_marked(&db.pool).await?;
    let cpu = Sample::now().since(&cpu_from);
    let wall = started.elapsed();
    let mut phases = Phases::default();
    for relay in relays.iter() {
        phases.add(&relay.phases().await?);
    }
    let seen = |count: u64| {
        samples
            .iter()
            .find(|&&(_, m)| m >= count)
            .map_or(wall.as_secs_f64(), |&(t, _)| t)
    };
    let mut out = lateness(
        env,
        db,
        n,
        Run {
            rate: 0.0,
            phases,
            cpu,
            wall,
        },
    )
    .await?;
    out.first_seen = seen(1);
    out.half_seen = seen(u64::try_from(n.div_ceil(2))?);
    Ok(out)
}

/// The burst's figures from the table (the database's clock).
async fn lateness(env: &Env, db: &Db, n: usize, run: Run) -> Result<DueRun> {
    let (published, early, all_after, first_after, p50, p99, max): (
        i64,
        i64,
        f64,
        f64,
        f64,
        f64,
        f64,
    ) = sqlx::query_as(
        "select count(published_at),
                count(*) filter (where published_at < due_at or released_at < due_at),
                extract(epoch from max(published_at) - min(due_at))::float8,
                extract(epoch from min(published_at) - min(due_at))::float8,
                extract(epoch from percentile_disc(0.5) within group (order by published_at - due_at))::float8,
                extract(epoch from percentile_disc(0.99) within group (order by published_at - due_at))::float8,
                extract(epoch from max(published_at - due_at))::float8
           from outbox_events where due_at is not null",
    )
    .fetch_one(&db.pool)
    .await?;
    if published != i64::try_from(n)? {
        return Err(format!("{published} of {n} scheduled rows published").into());
    }
    if early > 0 {
        env.note(format!(
            "{early} scheduled rows taken or published before their due time"
        ));
    }
    Ok(DueRun {
        run: Run {
            rate: n as f64 / all_after,
            ..run
        },
        all_after,
        first_after,
        first_seen: 0.0,
        half_seen: 0.0,
        p50,
        p99,
        max,
    })
}

fn due_report(args: &Args, runs: &[Vec<DueRun>]) -> String {
    let mut out = format!(
        "### Due lane ({} rows due at the same second, {} subjects, 1 outbox-relay process, {} rounds)\n\n\
         Seconds from the due time, median (range); events/s = rows / (last `published_at` − due time):\n\n\
         | relay | events/s | first message in the stream | half in the stream | first row marked | all marked | lateness p50 | p99 | max |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        num(args.due_events as f64, 0),
        num(args.subjects as f64, 0),
        args.rounds
    );
    let relay = |source: Source| match args.due_batch_size {
        Some(n) => format!("--source {} --batch-size {n}", source.flag()),
        None => format!("--source {}", source.flag()),
    };
    for (&source, r) in args.scheduled_sources.iter().zip(runs) {
        let pick = |f: fn(&DueRun) -> f64, decimals| {
            let values: Vec<f64> = r.iter().map(f).collect();
            Spread::of(&values).show(decimals)
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            relay(source),
            pick(|d| d.run.rate, 0),
            pick(|d| d.first_seen, 2),
            pick(|d| d.half_seen, 2),
            pick(|d| d.first_after, 2),
            pick(|d| d.all_after, 2),
            pick(|d| d.p50, 2),
            pick(|d| d.p99, 2),
            pick(|d| d.max, 2),
        ));
    }
    out.push_str(&due_batches(args, runs, &relay));
    let lines: Vec<(String, Vec<(Use, Duration)>)> = args
        .scheduled_sources
        .iter()
        .zip(runs)
        .map(|(&s, r)| {
            let runs = r.iter().map(|d| (d.run.cpu.clone(), d.run.wall)).collect();
            (relay(s), runs)
        })
        .collect();
    out.push_str(&format!(
        "\nCPU seconds per 100,000 events from the due time until every row was marked, by process (median of the rounds; from /proc):\n\n{}",
        per_events_table("relay", &lines, args.due_events)
    ));
    out
}

/// The due lane's batches: how many, and what each phase took.
fn due_batches(args: &Args, runs: &[Vec<DueRun>], relay: &dyn Fn(Source) -> String) -> String {
    let mut out = String::new();
    out.push_str(
        "\nThe due lane's batches (sums over the rounds, from the relay's \
         `outbox_relay_batch_phase_seconds`; publish and mark are the due lane's, \
         no immediate row was written):\n\n\
         | relay | due claims per burst | ms per due claim | ms per publish | ms per mark | rows published per due claim |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for (&source, r) in args.scheduled_sources.iter().zip(runs) {
        let mut phases = Phases::default();
        for run in r {
            phases.add(&run.run.phases);
        }
        let claims = phases.batches.get("due_claim").copied().unwrap_or(0.0);
        let per = |x: f64| {
            if claims > 0.0 {
                format!("{:.0}", x / claims)
            } else {
                "–".into()
            }
        };
        out.push_str(&format!(
            "| {} | {:.1} | {} | {} | {} | {} |\n",
            relay(source),
            claims / r.len().max(1) as f64,
            phase_ms(&phases, "due_claim"),
            phase_ms(&phases, "publish"),
            phase_ms(&phases, "mark"),
            per(phases.published),
        ));
    }
    out
}
