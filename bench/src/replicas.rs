//! Part 8: what a replicated stream costs the relay.
//!
//! The same backlog of `--replica-events` events drained by one
//! `outbox-relay` process with its default flags, into:
//!
//! - **R1**: a stream with one replica (file storage) on the single
//!   nats-server the other parts use;
//! - **R3**: a stream with three replicas (file storage) on a 3-node
//!   JetStream cluster on loopback ([`NatsCluster`]), the relay given every
//!   node's URL. Each PubAck then waits for a quorum of two nodes to store
//!   the message.
//!
//! Both modes run in every round, their order rotated, each on a fresh
//! database and stream; the three cluster nodes share the machine's cores
//! with PostgreSQL, the relay and the single node (idle while R3 runs). The
//! result is the R3 / R1 ratio per round: its median and range.

use outbox_testkit::NatsCluster;

use crate::Args;
use crate::harness::{
    Env, Phases, Result, drain, envelopes, insert_events, pad, repeat_if_killed, stop_all,
};
use crate::stats::{Spread, num, ratios};

#[derive(Debug, Clone, Copy)]
enum Mode {
    R1,
    R3,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::R1 => "R1 stream, one nats-server",
            Self::R3 => "R3 stream, 3-node cluster",
        }
    }

    fn replicas(self) -> usize {
        match self {
            Self::R1 => 1,
            Self::R3 => 3,
        }
    }
}

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let n = args.replica_events;
    println!(
        "\n## Stream replicas: {n} events over {} subjects, 1 outbox-relay process, R1 vs R3",
        args.subjects
    );
    let cluster = NatsCluster::start().await?;
    let on_cluster = Env::new(&env.admin_url, &cluster.url()).await?;
    println!("cluster   {}", cluster.url());
    let events = envelopes(n, args.subjects, pad()?)?;
    let modes = [Mode::R1, Mode::R3];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut phases: Vec<Phases> = vec![Phases::default(); modes.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..modes.len()).collect();
        order.rotate_left(round % modes.len());
        for i in order {
            let target = match modes[i] {
                Mode::R1 => env,
                Mode::R3 => &on_cluster,
            };
            let (rate, p) = repeat_if_killed(target, || once(target, &events, modes[i])).await?;
            println!(
                "round {round}: {:<30} {:>9} events/s",
                modes[i].name(),
                num(rate, 0)
            );
            rates[i].push(rate);
            phases[i].add(&p);
        }
    }
    for note in on_cluster.notes() {
        env.note(format!("(cluster) {note}"));
    }

    let mut out = format!(
        "### Stream replicas ({} events, {} subjects, 1 outbox-relay process, {} rounds)\n\n\
         | stream | events/s, median (range) | ratio to R1, median (range) | publish share | ms/batch |\n\
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
            mode.name(),
            Spread::of(&rates[i]),
            Spread::of(&ratios(&rates[i], &rates[0])).show(2),
            phases[i]
                .share("publish")
                .map_or("–".into(), |s| format!("{:.0} %", s * 100.0)),
            per.as_secs_f64() * 1e3,
        ));
    }
    println!("\n{out}");
    summary.push(out);
    drop(on_cluster);
    drop(cluster);
    Ok(())
}

/// One drain of `events` by one relay into a fresh stream of `mode`'s
/// replicas on `env`'s broker: the rate and the relay's batch phases.
async fn once(env: &Env, events: &[outbox_pg::Envelope], mode: Mode) -> Result<(f64, Phases)> {
    let db = env
        .database(match mode {
            Mode::R1 => "r1",
            Mode::R3 => "r3",
        })
        .await?;
    let stream = env.stream_name();
    let result = async {
        env.create_stream_with_replicas(&stream, mode.replicas())
            .await?;
        insert_events(&db.pool, events).await?;
        let run = drain(env, &db, &stream, events.len(), 1, |_, _| Ok(())).await?;
        let out = (run.rate(events.len()), run.phases.clone());
        stop_all(env, run.relays).await;
        Ok(out)
    }
    .await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}
