//! Part 10: one hot entity against a spread backlog.
//!
//! The same number of events (`--hot-events`) drained by one `outbox-relay`
//! process with its default flags, in three modes side by side in every
//! round, their order rotated, each on a fresh database and stream:
//!
//! - **spread**: the events over `--subjects` envelope subjects (entities),
//!   the relay creating the stream;
//! - **one subject**: every event of one entity, the relay creating the
//!   stream (with `allow_atomic`, so one entity's rows go out in atomic
//!   batches);
//! - **one subject, no atomic batches**: the same, into a stream created
//!   before the relay starts without `allow_atomic` (an older stream, or one
//!   made by hand): one awaited PubAck per row of the entity;
//! - **spread** and **one subject** again with `--source wal`: the relay
//!   started first, reading its slot, and the same rows written after it
//!   (the clock from their commit).
//!
//! The figure is each mode's rate and its ratio to spread per round (for
//! the WAL modes, one subject to spread both read from the WAL).

use crate::Args;
use crate::harness::{
    Env, Phases, Result, drain, drop_slots, envelopes, insert_events, pad, repeat_if_killed,
    stop_all, wal_drain,
};
use crate::stats::{Spread, num, ratios};

#[derive(Debug, Clone, Copy)]
enum Mode {
    Spread,
    Hot,
    HotNoAtomic,
    SpreadWal,
    HotWal,
}

impl Mode {
    fn name(self, subjects: usize) -> String {
        match self {
            Self::Spread => format!("{} subjects", num(subjects as f64, 0)),
            Self::Hot => "one subject".into(),
            Self::HotNoAtomic => "one subject, stream without allow_atomic".into(),
            Self::SpreadWal => format!("{} subjects, --source wal", num(subjects as f64, 0)),
            Self::HotWal => "one subject, --source wal".into(),
        }
    }
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let n = args.hot_events;
    println!(
        "\n## Hot entity: {n} events of one subject vs over {} subjects, 1 outbox-relay process",
        args.subjects
    );
    let spread = envelopes(n, args.subjects, pad()?)?;
    let hot = envelopes(n, 1, pad()?)?;
    let modes = [
        Mode::Spread,
        Mode::Hot,
        Mode::HotNoAtomic,
        Mode::SpreadWal,
        Mode::HotWal,
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut phases: Vec<Phases> = vec![Phases::default(); modes.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..modes.len()).collect();
        order.rotate_left(round % modes.len());
        for i in order {
            let events = match modes[i] {
                Mode::Spread | Mode::SpreadWal => &spread,
                Mode::Hot | Mode::HotNoAtomic | Mode::HotWal => &hot,
            };
            let (rate, p) = repeat_if_killed(env, || once(env, events, modes[i])).await?;
            println!(
                "round {round}: {:<42} {:>9} events/s",
                modes[i].name(args.subjects),
                num(rate, 0)
            );
            rates[i].push(rate);
            phases[i].add(&p);
        }
    }
    let mut out = format!(
        "### Hot entity ({} events, one subject vs {} subjects, 1 outbox-relay process, {} rounds)\n\n\
         | backlog | events/s, median (range) | ratio to spread, median (range) | publish share | ms/batch |\n\
         |---|---:|---:|---:|---:|\n",
        num(n as f64, 0),
        num(args.subjects as f64, 0),
        args.rounds,
    );
    for (i, mode) in modes.iter().enumerate() {
        let (per, _) = phases[i]
            .per_batch()
            .unwrap_or((std::time::Duration::ZERO, 0.0));
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} |\n",
            mode.name(args.subjects),
            Spread::of(&rates[i]),
            Spread::of(&ratios(&rates[i], &rates[0])).show(2),
            phases[i]
                .share("publish")
                .map_or("–".into(), |s| format!("{:.0} %", s * 100.0)),
            per.as_secs_f64() * 1e3,
        ));
    }
    out.push_str(&format!(
        "\nWith `--source wal`, one subject / spread, per round: {}\n",
        Spread::of(&ratios(&rates[4], &rates[3])).show(2)
    ));
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// One drain of `events` by one relay into a fresh stream: the rate and the
/// relay's batch phases.
async fn once(env: &Env, events: &[outbox_pg::Envelope], mode: Mode) -> Result<(f64, Phases)> {
    let db = env
        .database(match mode {
            Mode::Spread => "hot_spread",
            Mode::Hot => "hot_one",
            Mode::HotNoAtomic => "hot_plain",
            Mode::SpreadWal => "hot_spread_wal",
            Mode::HotWal => "hot_one_wal",
        })
        .await?;
    let stream = env.stream_name();
    let result = async {
        if matches!(mode, Mode::HotNoAtomic) {
            // As the relay would create it, but without allow_atomic.
            env.create_stream(&stream).await?;
        }
        let run = if matches!(mode, Mode::SpreadWal | Mode::HotWal) {
            let write = insert_events(&db.pool, events);
            wal_drain(env, &db, &stream, events.len(), write, |_, _| Ok(())).await?
        } else {
            insert_events(&db.pool, events).await?;
            drain(env, &db, &stream, events.len(), 1, |_, _| Ok(())).await?
        };
        let out = (run.rate(events.len()), run.phases.clone());
        stop_all(env, run.relays).await;
        Ok(out)
    }
    .await;
    env.delete_stream(&stream).await;
    drop_slots(&db).await?;
    env.drop_database(db).await?;
    result
}
