//! Part 1: the relay against a raw publisher and a simple batched relay.
//!
//! The same events, [`MESSAGE_BYTES`](crate::harness::MESSAGE_BYTES) each,
//! over `--subjects` entities. Modes, side by side in every round (order
//! rotated), each on a fresh database and stream:
//!
//! - **raw**: the envelopes published straight to JetStream, pipelined (1,024
//!   acks in flight), every PubAck awaited: the ceiling for any relay.
//! - **simple relay**: the loop most outboxes start with, in this process:
//!   `begin; select … where published_at is null order by created_at limit 500
//!   for update skip locked`, publish all pipelined and await every ack,
//!   `update … set published_at = now() where id = any($1); commit`.
//! - **outbox-relay × N**: the shipped binary as N processes with default
//!   flags.
//! - **outbox-relay --source wal**: the shipped binary, one process, default
//!   flags but the source, reading the rows from its replication slot.
//!
//! Rows are written (one statement) and vacuumed before the polling relays
//! start, and the clock runs from their start until the stream holds every
//! event. The WAL relay is started first and reads its slot (rows written
//! before the slot go through the polling path, which this would measure
//! again); the rows are written then, in the same one statement, and the
//! clock runs from its commit.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use chrono::{DateTime, Utc};
use outbox_pg::{Envelope, EventId};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::Args;
use crate::cpu::{Sample, Use, Who};
use crate::harness::{
    Db, Env, Phases, Result, TAIL, bulk_rate, drain, drop_slots, envelopes, insert_events, pad,
    publish_all, repeat_if_killed, stop_all, tail_secs, wait_for_messages, wait_marked, wal_drain,
};
use crate::stats::{Spread, num, ratios};

#[derive(Debug, Clone, Copy)]
enum Mode {
    Raw,
    Simple,
    Relay(usize),
    Wal,
}

impl Mode {
    fn name(self) -> String {
        match self {
            Self::Raw => "raw JetStream publish".into(),
            Self::Simple => "simple batched relay (500, skip locked)".into(),
            Self::Relay(1) => "outbox-relay, 1 process".into(),
            Self::Relay(n) => format!("outbox-relay, {n} processes"),
            Self::Wal => "outbox-relay --source wal, 1 process".into(),
        }
    }
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let events = envelopes(args.events, args.subjects, pad()?)?;
    let bytes: usize = events
        .iter()
        .map(|e| e.to_json().map(|j| j.len()))
        .sum::<Result<_, _>>()?;
    println!(
        "\n## Relay vs raw: {} events over {} subjects, {} bytes per message on average",
        args.events,
        args.subjects,
        bytes / events.len().max(1)
    );
    let mut modes = vec![Mode::Raw, Mode::Simple];
    modes.extend(args.replicas.iter().map(|&n| Mode::Relay(n)));
    modes.push(Mode::Wal);
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut bulks: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut tails: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut phases: Vec<Phases> = vec![Phases::default(); modes.len()];
    let mut cpus: Vec<Vec<(Use, Duration)>> = vec![Vec::new(); modes.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..modes.len()).collect();
        order.rotate_left(round % modes.len());
        for i in order {
            let run = match modes[i] {
                Mode::Raw => raw(env, &events).await?,
                Mode::Simple => simple(env, &events).await?,
                Mode::Relay(n) => repeat_if_killed(env, || relays(env, &events, n)).await?,
                Mode::Wal => repeat_if_killed(env, || wal(env, &events)).await?,
            };
            println!(
                "round {round}: {:<42} {:>9} events/s{}",
                modes[i].name(),
                num(run.rate, 0),
                run.tail
                    .map(|t| format!(
                        " ({} to {:.0} %, the last {:.0} % in {t:.2} s)",
                        num(run.bulk, 0),
                        (1.0 - TAIL) * 100.0,
                        TAIL * 100.0
                    ))
                    .unwrap_or_default()
            );
            rates[i].push(run.rate);
            bulks[i].push(run.bulk);
            tails[i].extend(run.tail);
            phases[i].add(&run.phases);
            cpus[i].push((run.cpu, run.wall));
        }
    }

    let mut out = format!(
        "### Relay vs raw ({} events, {} subjects, ~{} B messages, {} rounds)\n\n\
         | path | events/s, median (range) | ratio to raw, median (range) | events/s until {:.0} % published | last {:.0} % took, s |\n\
         |---|---:|---:|---:|---:|\n",
        num(args.events as f64, 0),
        num(args.subjects as f64, 0),
        bytes / events.len().max(1),
        args.rounds,
        (1.0 - TAIL) * 100.0,
        TAIL * 100.0
    );
    for (i, mode) in modes.iter().enumerate() {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            mode.name(),
            Spread::of(&rates[i]),
            Spread::of(&ratios(&rates[i], &rates[0])).show(2),
            Spread::of(&bulks[i]),
            if tails[i].is_empty() {
                "–".into()
            } else {
                Spread::of(&tails[i]).show(2)
            }
        ));
    }
    out.push_str(
        "\nWhere a batch spends its time (share of the phase sums over all rounds; \
         outbox-relay from `outbox_relay_batch_phase_seconds_sum`, the simple relay timed in-process):\n\n\
         | relay | horizon | claim | publish | mark | batches | rows/batch | ms/batch |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, mode) in modes.iter().enumerate().skip(1) {
        let p = &phases[i];
        let share = |phase| {
            p.share(phase)
                .map_or("–".into(), |s| format!("{:.0} %", s * 100.0))
        };
        let (per, rows) = p.per_batch().unwrap_or((Duration::ZERO, 0.0));
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.1} |\n",
            mode.name(),
            share("horizon"),
            share("claim"),
            share("publish"),
            share("mark"),
            num(p.batches.get("claim").copied().unwrap_or(0.0), 0),
            rows,
            per.as_secs_f64() * 1e3
        ));
    }
    out.push_str(&cpu_table(&modes, &cpus, args.events));
    out.push_str(&replica_table(&modes, &rates, &cpus, args.events));
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// Where the cores went: CPU seconds per 100,000 events by kind of process
/// (medians over the rounds), and how full the machine was.
fn cpu_table(modes: &[Mode], cpus: &[Vec<(Use, Duration)>], events: usize) -> String {
    let lines: Vec<(String, Vec<(Use, Duration)>)> = modes
        .iter()
        .zip(cpus)
        .map(|(mode, runs)| (mode.name(), runs.clone()))
        .collect();
    format!(
        "\nCPU seconds per 100,000 events while each path ran, by process (median of the \
         rounds; from /proc, {} cores; the raw publisher and the simple relay run in the bench \
         process):\n\n{}",
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        crate::cpu::per_events_table("path", &lines, events)
    )
}

/// Replicas against one process, round by round: the ratio of their
/// events/s and of their CPU seconds per event, by kind of process (median
/// of the per-round ratios, with the range). Empty unless one process and
/// more were both run.
fn replica_table(
    modes: &[Mode],
    rates: &[Vec<f64>],
    cpus: &[Vec<(Use, Duration)>],
    events: usize,
) -> String {
    let Some(one) = modes.iter().position(|m| matches!(m, Mode::Relay(1))) else {
        return String::new();
    };
    let per = 100_000.0 / events.max(1) as f64;
    let kinds = [Who::Relay, Who::Database, Who::Broker];
    let mut out = format!(
        "\nReplicas against one process, round by round: events/s of N processes over 1 process's \
         (median of the per-round ratios, range); CPU seconds per 100,000 events as N processes' \
         median vs 1 process's median, ×the per-round ratio (median, range):\n\n\
         | processes | events/s, to 1 process | {} | all, CPU-s / 100k |\n|---|---:|{}---:|\n",
        kinds
            .map(|w| format!("{}, CPU-s / 100k", w.name()))
            .join(" | "),
        "---:|".repeat(kinds.len()),
    );
    for (i, mode) in modes.iter().enumerate() {
        let Mode::Relay(n) = *mode else { continue };
        if n == 1 {
            continue;
        }
        let cell = |f: &dyn Fn(&Use) -> f64| {
            let of = |runs: &[(Use, Duration)]| -> Vec<f64> {
                runs.iter().map(|(u, _)| f(u) * per).collect()
            };
            let (mine, base) = (of(&cpus[i]), of(&cpus[one]));
            format!(
                "{:.2} vs {:.2}, ×{}",
                Spread::of(&mine).median,
                Spread::of(&base).median,
                Spread::of(&ratios(&mine, &base)).show(2)
            )
        };
        let by_kind: Vec<String> = kinds.iter().map(|&w| cell(&|u| u.of(w))).collect();
        out.push_str(&format!(
            "| {n} | {} | {} | {} |\n",
            Spread::of(&ratios(&rates[i], &rates[one])).show(2),
            by_kind.join(" | "),
            cell(&|u| u.total()),
        ));
    }
    out
}

/// One mode's result in one round.
#[derive(Debug)]
struct Run {
    rate: f64,
    /// The rate until all but the tail was published.
    bulk: f64,
    /// Seconds the last events took (none for raw: one pipelined burst).
    tail: Option<f64>,
    phases: Phases,
    /// CPU time by kind of process while it ran, and how long that was.
    cpu: Use,
    wall: Duration,
}

async fn raw(env: &Env, events: &[Envelope]) -> Result<Run> {
    let stream = env.stream_name();
    env.create_stream(&stream).await?;
    let cpu_from = Sample::now();
    let elapsed = publish_all(&env.js, events).await?;
    let cpu = Sample::now().since(&cpu_from);
    let stored = env.stream_messages(&stream).await?;
    env.delete_stream(&stream).await;
    if stored != events.len() as u64 {
        return Err(format!("raw: {stored} messages stored of {}", events.len()).into());
    }
    Ok(Run {
        rate: events.len() as f64 / elapsed.as_secs_f64(),
        bulk: events.len() as f64 / elapsed.as_secs_f64(),
        tail: None,
        phases: Phases::default(),
        cpu,
        wall: elapsed,
    })
}

async fn relays(env: &Env, events: &[Envelope], replicas: usize) -> Result<Run> {
    let db = env.database("relay").await?;
    let stream = env.stream_name();
    let result = relays_on(env, &db, &stream, events, replicas).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn relays_on(
    env: &Env,
    db: &Db,
    stream: &str,
    events: &[Envelope],
    replicas: usize,
) -> Result<Run> {
    insert_events(&db.pool, events).await?;
    let run = drain(env, db, stream, events.len(), replicas, |_, _| Ok(())).await?;
    let result = Run {
        rate: run.rate(events.len()),
        bulk: run.bulk_rate(events.len()),
        tail: Some(run.tail(events.len())),
        phases: run.phases,
        cpu: run.cpu,
        wall: run.elapsed,
    };
    stop_all(env, run.relays).await;
    Ok(result)
}

async fn wal(env: &Env, events: &[Envelope]) -> Result<Run> {
    let db = env.database("wal").await?;
    let stream = env.stream_name();
    let result = async {
        let drained = wal_drain(
            env,
            &db,
            &stream,
            events.len(),
            insert_events(&db.pool, events),
            |_, _| Ok(()),
        )
        .await?;
        let result = Run {
            rate: drained.rate(events.len()),
            bulk: drained.bulk_rate(events.len()),
            tail: Some(drained.tail(events.len())),
            phases: drained.phases.clone(),
            cpu: drained.cpu.clone(),
            wall: drained.elapsed,
        };
        stop_all(env, drained.relays).await;
        Ok(result)
    }
    .await;
    env.delete_stream(&stream).await;
    drop_slots(&db).await?;
    env.drop_database(db).await?;
    result
}

async fn simple(env: &Env, events: &[Envelope]) -> Result<Run> {
    let db = env.database("simple").await?;
    let stream = env.stream_name();
    let result = simple_on(env, &db, &stream, events).await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}

async fn simple_on(env: &Env, db: &Db, stream: &str, events: &[Envelope]) -> Result<Run> {
    insert_events(&db.pool, events).await?;
    env.create_stream(stream).await?;
    let conn = PgConnection::connect(&db.url).await?;
    let cpu_from = Sample::now();
    let started = Instant::now();
    let task = tokio::spawn(simple_relay(conn, env.js.clone()));
    let waited = wait_for_messages(env, stream, events.len(), started, &mut [], |_, _| {
        if task.is_finished() {
            Err("the simple relay stopped before the stream was full".into())
        } else {
            Ok(())
        }
    })
    .await;
    let elapsed = started.elapsed();
    if waited.is_err() && !task.is_finished() {
        task.abort();
    }
    // Read once its last commit is in and before its backend exits (a
    // process that exits takes its CPU time with it).
    let (phases, conn) = task.await??;
    let cpu = Sample::now().since(&cpu_from);
    let cpu_wall = started.elapsed();
    drop(conn);
    let samples = waited?;
    wait_marked(&db.pool).await?;
    Ok(Run {
        rate: events.len() as f64 / elapsed.as_secs_f64(),
        bulk: bulk_rate(&samples, events.len()),
        tail: Some(tail_secs(&samples, events.len())),
        phases,
        cpu,
        wall: cpu_wall,
    })
}

type Row = (
    Uuid,
    String,
    String,
    String,
    DateTime<Utc>,
    serde_json::Value,
    i64,
);

/// Claims 500 rows with a row lock each, publishes them all, awaits every
/// ack, marks them in one statement and commits; until nothing is left.
/// Hands the connection back, so that its backend's CPU time can still be
/// read.
async fn simple_relay(
    mut conn: PgConnection,
    js: jetstream::Context,
) -> Result<(Phases, PgConnection)> {
    let mut phases = Phases::default();
    loop {
        let t = Instant::now();
        let mut tx = conn.begin().await?;
        let rows: Vec<Row> = sqlx::query_as(
            "select id, event_type, source, subject, time, data, seq
               from outbox_events
              where published_at is null
              order by created_at
              limit 500
                for update skip locked",
        )
        .fetch_all(&mut *tx)
        .await?;
        phases.record("claim", t.elapsed());
        if rows.is_empty() {
            tx.commit().await?;
            return Ok((phases, conn));
        }
        let t = Instant::now();
        let mut ids = Vec::with_capacity(rows.len());
        let mut acks = Vec::with_capacity(rows.len());
        for (id, event_type, source, subject, time, data, seq) in rows {
            let envelope = Envelope::from_parts(
                EventId::from_uuid(id),
                event_type,
                source,
                subject,
                time,
                data,
            )?
            .with_sequence(u64::try_from(seq)?);
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", envelope.id().to_string().as_str());
            acks.push(
                js.publish_with_headers(
                    envelope.event_type().as_str().to_owned(),
                    headers,
                    envelope.to_json()?.into(),
                )
                .await?,
            );
            ids.push(id);
        }
        for ack in acks {
            ack.await?;
        }
        phases.record("publish", t.elapsed());
        let t = Instant::now();
        sqlx::query("update outbox_events set published_at = now() where id = any($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        phases.record("mark", t.elapsed());
        phases.published += ids.len() as f64;
    }
}
