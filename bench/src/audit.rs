//! Part 9: what the audit costs the relay.
//!
//! A backlog of `--audit-events` events is drained by one `outbox-relay`
//! process and left to age past the audit's settle age; then a second
//! backlog of as many events is drained by a new relay process while, with
//! the audit on, its audit task reads the first backlog's messages back from
//! the stream (a fresh process audits from its horizon). Both modes use the
//! same flags but `--audit-horizon` (`10m`, or `0` for off): a duplicate
//! window of 10 s (lease 4 s, publish timeout 2 s), so the first backlog is
//! auditable 12.5 s after it was published, and `--audit-interval 1s`. The
//! figure is the second drain's rate, and how many rows the audit checked
//! during it (`outbox_relay_audit_checked_total`).

use std::time::{Duration, Instant};

use crate::Args;
use crate::harness::{
    Env, RelayProc, Result, SUBJECTS, envelopes, insert_events, pad, repeat_if_killed, samples,
    scrape_metrics, wait_for_messages, wait_marked,
};
use crate::stats::{Spread, num, ratios};

#[derive(Debug, Clone, Copy)]
enum Mode {
    Off,
    On,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Off => "audit off",
            Self::On => "audit on",
        }
    }

    fn horizon(self) -> &'static str {
        match self {
            Self::Off => "0",
            Self::On => "10m",
        }
    }
}

/// The first backlog is auditable this long after it was published
/// (duplicate window 10 s plus a quarter of it), and a little more.
const SETTLE: Duration = Duration::from_millis(13_000);

pub(crate) async fn run(env: &Env, args: &Args, summary: &mut Vec<String>) -> Result<()> {
    let n = args.audit_events;
    println!(
        "\n## Audit: {n} events drained while the audit reads back {n} published before, 1 outbox-relay process, on vs off"
    );
    let first = envelopes(n, args.subjects, pad()?)?;
    let second = envelopes(n, args.subjects, pad()?)?;
    let modes = [Mode::Off, Mode::On];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut checked: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..modes.len()).collect();
        order.rotate_left(round % modes.len());
        for i in order {
            let (rate, audited) =
                repeat_if_killed(env, || once(env, &first, &second, modes[i])).await?;
            println!(
                "round {round}: {:<10} {:>9} events/s, {:>7} rows audited meanwhile",
                modes[i].name(),
                num(rate, 0),
                num(audited, 0)
            );
            rates[i].push(rate);
            checked[i].push(audited);
        }
    }
    let mut out = format!(
        "### Audit ({} events drained while {} published before are audited, {} subjects, 1 outbox-relay process, {} rounds)\n\n\
         | mode | events/s, median (range) | ratio to off, median (range) | rows audited during the drain |\n\
         |---|---:|---:|---:|\n",
        num(n as f64, 0),
        num(n as f64, 0),
        num(args.subjects as f64, 0),
        args.rounds,
    );
    for (i, mode) in modes.iter().enumerate() {
        out.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            mode.name(),
            Spread::of(&rates[i]),
            Spread::of(&ratios(&rates[i], &rates[0])).show(2),
            Spread::of(&checked[i]),
        ));
    }
    println!("\n{out}");
    summary.push(out);
    Ok(())
}

/// One run of `mode`: the first backlog drained and aged, then the second
/// drained with the audit as `mode` says; the second drain's rate and the
/// rows the audit checked during it.
async fn once(
    env: &Env,
    first: &[outbox_pg::Envelope],
    second: &[outbox_pg::Envelope],
    mode: Mode,
) -> Result<(f64, f64)> {
    let db = env
        .database(match mode {
            Mode::Off => "audit_off",
            Mode::On => "audit_on",
        })
        .await?;
    let stream = env.stream_name();
    let extra = [
        "--duplicate-window",
        "10s",
        "--lease",
        "4s",
        "--publish-timeout",
        "2s",
        "--audit-interval",
        "1s",
        "--audit-horizon",
        mode.horizon(),
    ];
    let result = async {
        // The first backlog, published and marked, then old enough to audit.
        insert_events(&db.pool, first).await?;
        let started = Instant::now();
        let mut relay = RelayProc::start_with_args(
            env,
            &format!("{stream}_first"),
            &db.url,
            &stream,
            SUBJECTS,
            &extra,
        )
        .await?;
        let waited = wait_for_messages(
            env,
            &stream,
            first.len(),
            started,
            std::slice::from_mut(&mut relay),
            |_, _| Ok(()),
        )
        .await;
        if let Err(e) = waited {
            relay.stop(env).await;
            return Err(e);
        }
        wait_marked(&db.pool).await?;
        relay.stop(env).await;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let settled: bool = sqlx::query_scalar(
                "select coalesce(max(published_at) < now() - $1::bigint * interval '1 millisecond', true)
                   from outbox_events",
            )
            .bind(i64::try_from(SETTLE.as_millis()).unwrap_or(i64::MAX))
            .fetch_one(&db.pool)
            .await?;
            if settled {
                break;
            }
            if Instant::now() > deadline {
                return Err("the first backlog did not age past the settle age".into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // The second backlog, drained while the audit reads the first.
        insert_events(&db.pool, second).await?;
        let started = Instant::now();
        let mut relay = RelayProc::start_with_args(
            env,
            &format!("{stream}_second"),
            &db.url,
            &stream,
            SUBJECTS,
            &extra,
        )
        .await?;
        let waited = wait_for_messages(
            env,
            &stream,
            first.len() + second.len(),
            started,
            std::slice::from_mut(&mut relay),
            |_, _| Ok(()),
        )
        .await;
        let elapsed = started.elapsed();
        let audited = match waited {
            Ok(_) => scrape_metrics(relay.metrics(), relay.name())
                .await
                .map(|body| {
                    samples(&body)
                        .filter(|(name, _, _)| *name == "outbox_relay_audit_checked_total")
                        .map(|(_, _, v)| v)
                        .fold(0.0, |a, v| a + v)
                }),
            Err(e) => Err(e),
        };
        relay.stop(env).await;
        Ok((second.len() as f64 / elapsed.as_secs_f64(), audited?))
    }
    .await;
    env.delete_stream(&stream).await;
    env.drop_database(db).await?;
    result
}
