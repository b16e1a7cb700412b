//! `outbox-demo`: the whole system as a new user meets it, under faults.
//!
//! It starts PostgreSQL and nats-server (unless `DATABASE_URL` / `NATS_URL`
//! name running ones), then as separate processes the `subscriptions` HTTP
//! service, two `outbox-relay` replicas and two `billing` consumer replicas.
//! It drives requests (some invalid, some rolled back, some cancelling, some
//! creating a subscription with a short trial, some converting a trial to
//! paid before it runs out) while
//! it restarts nats-server, kills -9 a relay and a billing replica, and lets
//! billing replicas die between commit and ack; then it waits for the system
//! to settle and checks, from the databases and the stream:
//!
//! - **lost = 0**: every accepted subscription has its events in the stream,
//!   exactly one invoice, and its `invoice.created`; every cancellation voided
//!   its invoice;
//! - **applied twice = 0**: no subscription has two invoices (the `invoices`
//!   table has no unique key: only the inbox prevents it);
//! - **leaked from rollbacks = 0**: nothing of a rolled-back or rejected request
//!   exists anywhere;
//! - **per-subject order violations = 0**: per subject, the stream holds
//!   events in created_at order, and effects were applied in event order;
//! - **cancelled yet consumed = 0**: a trial's scheduled
//!   `subscription.trial_ended`, cancelled by its conversion (or its
//!   subscription's cancellation), was never published nor handled by
//!   billing; every one not cancelled was handled exactly once (else lost or
//!   applied twice);
//! - **consumed before due = 0**: no trial end was published or handled by
//!   billing before its due time (`due_at`, by the database's clock);
//! - both outboxes drained.
//!
//! It exits non-zero if any invariant fails.
//!
//! With `--cluster` the broker is a 3-node JetStream cluster on loopback and
//! the stream is replicated on all three (R3, file storage, created before the
//! services start; the relays verify it with `--stream-replicas 3`). Every
//! process is given every node's URL. Instead of restarting the one
//! nats-server, the schedule kills -9 a node that does not lead the stream
//! (at 20 % of the load) and restarts it (40 %), then kills -9 the node that
//! leads the stream by then (60 %) and restarts it (80 %), each restart
//! waited on until the cluster is healthy again.
//!
//! ```text
//! scripts/demo                                      # 2,000 requests, the standard faults
//! scripts/demo --chaos --duration 300 --seed 7      # a long chaos run, Postgres restarts too
//! scripts/demo --chaos --cluster --duration 60      # the same on a 3-node cluster, R3 stream
//! ```

mod check;
mod driver;

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_pg::connect::{DatabaseArgs, NatsArgs};
use outbox_testkit::{NatsCluster, NatsHandle, PgHandle, Program, create_database};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::driver::{Load, Progress};

const STREAM: &str = "OUTBOX";
const SUBJECTS: &str = "subscription.>,invoice.>";
const DURABLE: &str = "billing";

#[derive(Debug, Parser)]
#[command(
    name = "outbox-demo",
    about = "Outbox + inbox end to end, under faults, with the invariants checked"
)]
struct Args {
    /// Requests to drive (ignored with --duration).
    #[arg(long, default_value_t = 2_000)]
    requests: u64,
    /// Drive requests for this many seconds instead of a fixed count.
    #[arg(long)]
    duration: Option<u64>,
    /// Seed for the request mix and the fault schedule (random if not given).
    #[arg(long)]
    seed: Option<u64>,
    /// The faster chaos schedule: a fault every --fault-interval seconds,
    /// Postgres restarts included (when the demo runs its own Postgres).
    #[arg(long)]
    chaos: bool,
    /// Seconds between faults in chaos mode.
    #[arg(long, default_value_t = 6.0)]
    fault_interval: f64,
    /// Probability that a billing replica dies right after a commit, before the ack.
    #[arg(long, default_value_t = 0.002)]
    crash_rate: f64,
    /// Share of requests that are invalid (must be refused with 422).
    #[arg(long, default_value_t = 0.10)]
    invalid_rate: f64,
    /// Share of requests whose transaction is rolled back after the writes.
    #[arg(long, default_value_t = 0.05)]
    rollback_rate: f64,
    /// Share of requests that cancel an earlier subscription.
    #[arg(long, default_value_t = 0.10)]
    cancel_rate: f64,
    /// Share of creations with a trial: a `subscription.trial_ended`
    /// scheduled for --trial-seconds later.
    #[arg(long, default_value_t = 0.25)]
    trial_rate: f64,
    /// Share of requests that convert a trial to paid (cancelling its
    /// scheduled end, unless it has run out).
    #[arg(long, default_value_t = 0.05)]
    convert_rate: f64,
    /// How long a trial lasts, in seconds. The settle phase waits for the
    /// last trials to run out, so the run is at most this much longer.
    #[arg(long, default_value_t = 2.0)]
    trial_seconds: f64,
    /// Requests per second over all clients (default: unlimited for a fixed
    /// count, 100/s with --duration). 0 means unlimited.
    #[arg(long)]
    rate: Option<f64>,
    /// Concurrent HTTP clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Distinct customers.
    #[arg(long, default_value_t = 200)]
    customers: usize,
    /// No fault injection at all.
    #[arg(long)]
    no_faults: bool,
    /// Test switch: run billing without the dedupe layer. The run must then
    /// fail with applied-twice > 0 — proof that the check catches it.
    #[arg(long, hide = true)]
    no_dedupe: bool,
    /// Where the service binaries are (default: beside this one).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Seconds to wait for the system to settle after the load.
    #[arg(long, default_value_t = 180)]
    settle_timeout: u64,
    /// Run a 3-node JetStream cluster with an R3 stream instead of one
    /// nats-server; the broker faults kill -9 a node that does not lead the
    /// stream, then the stream leader (each restarted later).
    #[arg(long)]
    cluster: bool,
    /// Where the two `outbox-relay` replicas read new rows: `poll` claims
    /// them from the table, `wal` reads them from a replication slot (one
    /// replica leads, the other stands by).
    #[arg(long, default_value = "poll", value_parser = ["poll", "wal"])]
    source: String,
}

/// The broker: one nats-server (or `NATS_URL`), or a 3-node cluster.
enum Broker {
    Single(NatsHandle),
    Cluster(NatsCluster),
}

impl Broker {
    fn url(&self) -> String {
        match self {
            Self::Single(nats) => nats.url().to_owned(),
            Self::Cluster(cluster) => cluster.url(),
        }
    }
}

/// Where the cluster's fault schedule is: the node killed and not yet restarted.
#[derive(Debug, Default)]
struct NodeFaults {
    fired: usize,
    down: Option<usize>,
}

#[derive(Debug, Default)]
struct Faults {
    nats_restarts: u32,
    node_kills: u32,
    leader_kills: u32,
    node_restarts: u32,
    relay_kills: u32,
    billing_kills: u32,
    pg_restarts: u32,
}

#[tokio::main]
async fn main() {
    match run(Args::parse()).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("outbox-demo: {e}");
            std::process::exit(2);
        }
    }
}

async fn run(args: Args) -> Result<bool, Box<dyn Error>> {
    let started = Instant::now();
    let seed = args.seed.unwrap_or_else(|| rand::rng().random());
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .map(PathBuf::from)
            .ok_or("cannot locate the binaries")?,
    };
    let run_dir = std::env::temp_dir().join(format!("outbox-demo-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir)?;
    println!("outbox demo (seed {seed}); logs in {}", run_dir.display());

    // --- Servers -----------------------------------------------------------
    let mut pg = outbox_testkit::postgres().await?;
    let admin_url = pg.url().to_owned();
    // A DATABASE_URL or NATS_URL given is checked first, so that one which
    // does not parse is refused naming what is wrong, and none is printed
    // with its password.
    let admin = DatabaseArgs::from_url(admin_url.as_str());
    admin.connect_options()?;
    let owns_pg = pg.server().is_some();
    let mut broker = if args.cluster {
        Broker::Cluster(NatsCluster::start().await?)
    } else {
        Broker::Single(outbox_testkit::nats()?)
    };
    let nats_url = broker.url();
    let nats_args = NatsArgs::new(nats_url.as_str());
    let nats_servers = nats_args.server_urls()?;
    let suffix = format!("{}_{}", std::process::id(), seed % 100_000);
    let subs_url = create_database(&admin_url, &format!("demo_subscriptions_{suffix}")).await?;
    let billing_url = create_database(&admin_url, &format!("demo_billing_{suffix}")).await?;
    println!(
        "postgres  {}\nnats      {}",
        admin.redacted(),
        nats_args.redacted_url()
    );
    let client = nats_args
        .connect_options("outbox-demo")
        .await?
        .retry_on_initial_connect()
        .connect(nats_servers)
        .await?;
    let js = async_nats::jetstream::new(client);
    if args.cluster {
        // Replicated on every node, as in production; the relays verify it.
        js.get_or_create_stream(async_nats::jetstream::stream::Config {
            name: STREAM.to_owned(),
            subjects: SUBJECTS.split(',').map(str::to_owned).collect(),
            storage: async_nats::jetstream::stream::StorageType::File,
            num_replicas: 3,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
        println!("stream    {STREAM}: 3 replicas, file storage");
    }

    // --- Processes ---------------------------------------------------------
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut subscriptions = Program::new("subscriptions", bin_dir.join("subscriptions"), &run_dir)
        .env("DATABASE_URL", &subs_url)
        .env("NATS_URL", &nats_url)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--no-relay",
            "--fault-injection",
            "--trial-period",
            &format!("{}ms", (args.trial_seconds.max(0.001) * 1000.0).round()),
        ])
        .ready_when("listening on");
    subscriptions.start().await?;
    let base_url = format!("http://127.0.0.1:{port}");

    let mut relays: Vec<Program> = (1..=2)
        .map(|i| {
            Program::new(
                &format!("relay-{i}"),
                bin_dir.join("outbox-relay"),
                &run_dir,
            )
            .env("DATABASE_URL", &subs_url)
            .env("NATS_URL", &nats_url)
            .args(["--stream", STREAM, "--subjects", SUBJECTS])
            .args(["--source", args.source.as_str()])
            .args([
                "--poll-interval",
                "100ms",
                "--publish-timeout",
                "1s",
                "--lease",
                "4s",
            ])
            .args(["--backoff-base", "200ms", "--max-backoff", "2s"])
            .args(
                if args.cluster {
                    &["--stream-replicas", "3", "--stream-storage", "file"][..]
                } else {
                    &[][..]
                }
                .iter()
                .copied(),
            )
        })
        .collect();
    for relay in &mut relays {
        relay.start().await?;
    }
    let mut billings: Vec<Program> = (1..=2)
        .map(|i| {
            let mut p = Program::new(&format!("billing-{i}"), bin_dir.join("billing"), &run_dir)
                .env("DATABASE_URL", &billing_url)
                .env("NATS_URL", &nats_url)
                .args([
                    "--consumer",
                    DURABLE,
                    "--concurrency",
                    "8",
                    "--ack-wait",
                    "5s",
                ])
                .args(["--stream", STREAM, "--subjects", SUBJECTS])
                .args(["--seed", &(seed + i).to_string()])
                .ready_when("billing ready");
            if !args.no_faults && args.crash_rate > 0.0 {
                p = p.args(["--crash-after-commit", &args.crash_rate.to_string()]);
            }
            if args.no_dedupe {
                p = p.arg("--no-dedupe");
            }
            p
        })
        .collect();
    for billing in &mut billings {
        billing.start().await?;
    }

    let subs_pool = pool(&subs_url).await?;
    let billing_pool = pool(&billing_url).await?;

    // --- Load, faults, progress -------------------------------------------
    let progress = Arc::new(Progress::default());
    let until = args
        .duration
        .map(|s| Instant::now() + Duration::from_secs(s));
    let load = Load {
        base_url,
        requests: if until.is_some() {
            None
        } else {
            Some(args.requests)
        },
        until,
        workers: args.clients.max(1),
        customers: args.customers.max(1),
        invalid_rate: args.invalid_rate,
        rollback_rate: args.rollback_rate,
        cancel_rate: args.cancel_rate,
        trial_rate: args.trial_rate,
        convert_rate: args.convert_rate,
        seed,
        rate: args.rate.or(args.duration.map(|_| 100.0)),
        started: Instant::now(),
    };
    let mut driving = tokio::spawn(driver::drive(load, progress.clone()));
    let mut faults = Faults::default();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut next_fault = Instant::now() + Duration::from_secs_f64(args.fault_interval.max(1.0));
    let mut fired = 0usize;
    let mut round: Vec<usize> = Vec::new();
    let mut node_faults = NodeFaults::default();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut last_print = Instant::now();
    let outcomes = loop {
        tokio::select! {
            done = &mut driving => break done?,
            _ = tick.tick() => {}
        }
        supervise(&mut subscriptions, &mut relays, &mut billings).await;
        if !args.no_faults {
            let due = if args.chaos {
                (Instant::now() >= next_fault).then(|| {
                    next_fault =
                        Instant::now() + Duration::from_secs_f64(args.fault_interval.max(1.0));
                    // Rounds of every fault kind once, each round in a seeded order.
                    if round.is_empty() {
                        // On a cluster the nodes have a schedule of their own.
                        let first = usize::from(args.cluster);
                        let last = if owns_pg { 3 } else { 2 };
                        round = (first..=last).collect();
                        round.shuffle(&mut rng);
                    }
                    round.pop().unwrap_or(0)
                })
            } else {
                // The standard demo: one of each fault, at 25 %, 50 % and 75 % of the load.
                let share = load_share(until, args.duration, args.requests, &progress);
                let step = [0.25, 0.5, 0.75].iter().filter(|s| share >= **s).count();
                (step > fired).then(|| {
                    fired += 1;
                    fired - 1
                })
            };
            if let Some(kind) = due {
                inject(
                    kind,
                    &mut faults,
                    &mut broker,
                    &mut pg,
                    &mut relays,
                    &mut billings,
                    &mut rng,
                )
                .await?;
            }
            if let Broker::Cluster(cluster) = &mut broker {
                let share = load_share(until, args.duration, args.requests, &progress);
                let step = [0.2, 0.4, 0.6, 0.8].iter().filter(|s| share >= **s).count();
                if step > node_faults.fired {
                    node_fault(cluster, &js, &mut node_faults, &mut faults).await?;
                }
            }
        }
        if last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            print_progress(
                started,
                &progress,
                &subs_pool,
                &billing_pool,
                &faults,
                &billings,
            )
            .await;
        }
    };

    // The standard schedule's faults that the load outran still happen.
    if !args.no_faults && !args.chaos {
        while fired < 3 {
            inject(
                fired,
                &mut faults,
                &mut broker,
                &mut pg,
                &mut relays,
                &mut billings,
                &mut rng,
            )
            .await?;
            fired += 1;
        }
    }

    // The cluster's schedule finishes too: every node is back before the check.
    if let Broker::Cluster(cluster) = &mut broker {
        while node_faults.fired < 4 {
            node_fault(cluster, &js, &mut node_faults, &mut faults).await?;
        }
    }

    // --- Settle and check --------------------------------------------------
    println!("load done; waiting for the system to settle …");
    let deadline = Instant::now() + Duration::from_secs(args.settle_timeout);
    let mut outstanding = String::new();
    while Instant::now() < deadline {
        supervise(&mut subscriptions, &mut relays, &mut billings).await;
        match check::settled(&subs_pool, &billing_pool, &js, STREAM, DURABLE).await {
            Ok(()) => {
                outstanding.clear();
                break;
            }
            Err(what) => outstanding = what,
        }
        if last_print.elapsed() >= Duration::from_secs(2) {
            last_print = Instant::now();
            print_progress(
                started,
                &progress,
                &subs_pool,
                &billing_pool,
                &faults,
                &billings,
            )
            .await;
            println!("          waiting for: {outstanding}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    if !outstanding.is_empty() {
        println!(
            "not settled after {}s ({outstanding}); checking anyway",
            args.settle_timeout
        );
    }
    let findings = check::check(&subs_pool, &billing_pool, &js, STREAM, DURABLE, &outcomes).await?;
    // What an operator sees now, with the relays still holding their shards.
    for (name, url) in [("subscriptions", &subs_url), ("billing", &billing_url)] {
        outboxctl_status(&bin_dir, name, url).await;
    }

    // Graceful shutdown: every process must exit 0 on SIGTERM.
    let mut unclean = Vec::new();
    for p in billings
        .iter_mut()
        .chain(relays.iter_mut())
        .chain(std::iter::once(&mut subscriptions))
    {
        if p.is_running() && p.terminate().await != Some(0) {
            unclean.push(p.name.clone());
        }
    }
    let crashes: u32 = billings.iter().map(|b| b.crashes).sum();
    report(
        &args, started, &outcomes, &findings, &faults, crashes, &unclean,
    );
    let passed = findings.passed() && unclean.is_empty();
    if passed {
        let _ = std::fs::remove_dir_all(&run_dir);
    } else {
        println!("logs kept in {}", run_dir.display());
    }
    drop(broker);
    drop(pg);
    Ok(passed)
}

/// How far the load is, from 0 to 1.
fn load_share(
    until: Option<Instant>,
    duration: Option<u64>,
    requests: u64,
    progress: &Progress,
) -> f64 {
    match until {
        Some(t) => {
            1.0 - (t.saturating_duration_since(Instant::now()).as_secs_f64()
                / duration.unwrap_or(1).max(1) as f64)
        }
        None => progress.issued.load(Ordering::Relaxed) as f64 / requests.max(1) as f64,
    }
}

/// The cluster's next broker fault: kill -9 a node that does not lead the
/// stream, restart it, kill -9 the stream's leader, restart it. A restart is
/// waited on until the cluster is healthy (the node caught up).
async fn node_fault(
    cluster: &mut NatsCluster,
    js: &async_nats::jetstream::Context,
    schedule: &mut NodeFaults,
    faults: &mut Faults,
) -> Result<(), Box<dyn Error>> {
    const PATIENCE: Duration = Duration::from_secs(60);
    let step = schedule.fired % 4;
    schedule.fired += 1;
    match (step, schedule.down.take()) {
        (0 | 2, _) => {
            let leader = cluster.stream_leader(js, STREAM, PATIENCE).await?;
            let (victim, role) = if step == 0 {
                ((leader + 1) % cluster.len(), "not the stream leader")
            } else {
                (leader, "the stream leader")
            };
            println!(
                "fault: kill -9 nats node {} ({role})",
                cluster.server_name(victim)?
            );
            tokio::task::block_in_place(|| cluster.kill(victim))?;
            if step == 0 {
                faults.node_kills += 1;
            } else {
                faults.leader_kills += 1;
            }
            schedule.down = Some(victim);
        }
        (_, Some(node)) => {
            println!("fault: restarting nats node {}", cluster.server_name(node)?);
            tokio::task::block_in_place(|| cluster.restart(node))?;
            cluster.wait_healthy(PATIENCE).await?;
            faults.node_restarts += 1;
        }
        (_, None) => {}
    }
    Ok(())
}

/// Prints `outboxctl status` of one database (the demo goes on without it
/// when the binary is missing or fails).
async fn outboxctl_status(bin_dir: &std::path::Path, name: &str, url: &str) {
    println!();
    println!("== outboxctl status: the {name} database ==");
    let out = tokio::process::Command::new(bin_dir.join("outboxctl"))
        .arg("status")
        .env("DATABASE_URL", url)
        .output()
        .await;
    match out {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            if !out.status.success() {
                print!("{}", String::from_utf8_lossy(&out.stderr));
            }
        }
        Err(e) => println!("(outboxctl not run: {e})"),
    }
}

async fn pool(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
}

/// Restarts any process that died on its own (a billing replica that crashed
/// between commit and ack, most often).
async fn supervise(subscriptions: &mut Program, relays: &mut [Program], billings: &mut [Program]) {
    for p in std::iter::once(subscriptions)
        .chain(relays.iter_mut())
        .chain(billings.iter_mut())
    {
        if p.died() {
            p.crashes += 1;
            reseed(p);
            if let Err(e) = p.start().await {
                eprintln!("restarting {}: {e}", p.name);
            }
        }
    }
}

/// A restarted billing replica draws new crash dice: with the same seed it
/// would die after the same number of commits every time. Deterministic, so
/// a run's seed still fixes everything.
fn reseed(p: &mut Program) {
    if let Some(seed) = p.arg_after("--seed").and_then(|s| s.parse::<u64>().ok()) {
        let next = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        p.set_arg("--seed", next.to_string());
    }
}

async fn inject(
    kind: usize,
    faults: &mut Faults,
    broker: &mut Broker,
    pg: &mut PgHandle,
    relays: &mut [Program],
    billings: &mut [Program],
    rng: &mut StdRng,
) -> Result<(), Box<dyn Error>> {
    match kind {
        0 => {
            if let Broker::Single(nats) = broker
                && let Some(server) = nats.server()
            {
                println!("fault: restarting nats-server");
                server.restart()?;
                faults.nats_restarts += 1;
            }
        }
        1 => {
            let i = rng.random_range(0..relays.len());
            println!("fault: kill -9 {}", relays[i].name);
            relays[i].kill9().await;
            faults.relay_kills += 1;
            relays[i].start().await?;
        }
        2 => {
            let i = rng.random_range(0..billings.len());
            println!("fault: kill -9 {}", billings[i].name);
            billings[i].kill9().await;
            faults.billing_kills += 1;
            reseed(&mut billings[i]);
            billings[i].start().await?;
        }
        _ => {
            if let Some(server) = pg.take_server() {
                println!("fault: restarting postgres");
                let restarted = tokio::task::spawn_blocking(move || {
                    let mut server = server;
                    server.restart().map(|()| server)
                })
                .await??;
                pg.put_server(restarted);
                faults.pg_restarts += 1;
            }
        }
    }
    Ok(())
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1)
}

async fn print_progress(
    started: Instant,
    progress: &Progress,
    subs: &PgPool,
    billing: &PgPool,
    faults: &Faults,
    billings: &[Program],
) {
    let published = count(
        subs,
        "select count(*) from outbox_events where published_at is not null",
    )
    .await;
    let invoices = count(billing, "select count(*) from invoices").await;
    let crashes: u32 = billings.iter().map(|b| b.crashes).sum();
    println!(
        "[{:>6.1}s] requests {:>5} (accepted {}, rejected {}, rolled back {}, cancelled {}, converted {}, failed {}) | published {} | invoices {} | faults: nats {} relay {} billing {} crashes {} pg {}",
        started.elapsed().as_secs_f64(),
        progress.issued.load(Ordering::Relaxed),
        progress.accepted.load(Ordering::Relaxed),
        progress.rejected.load(Ordering::Relaxed),
        progress.rolled_back.load(Ordering::Relaxed),
        progress.cancelled.load(Ordering::Relaxed),
        progress.converted.load(Ordering::Relaxed),
        progress.failed.load(Ordering::Relaxed),
        published,
        invoices,
        faults.nats_restarts,
        faults.relay_kills,
        faults.billing_kills,
        crashes,
        faults.pg_restarts,
    );
}

fn report(
    args: &Args,
    started: Instant,
    outcomes: &driver::Outcomes,
    f: &check::Findings,
    faults: &Faults,
    crashes: u32,
    unclean: &[String],
) {
    let mark = |ok: bool| if ok { "ok" } else { "FAIL" };
    println!();
    println!("== outbox demo report ==");
    println!(
        "requests                {:>7}  accepted {} ({} with a trial), rejected {}, rolled back {}, cancelled {}, converted {}, too late to convert {}, failed {}",
        outcomes.accepted.len()
            + outcomes.rolled_back.len()
            + outcomes.cancelled.len()
            + outcomes.converted.len()
            + outcomes.too_late.len()
            + outcomes.rejected as usize
            + outcomes.failed as usize,
        outcomes.accepted.len(),
        outcomes.trials.len(),
        outcomes.rejected,
        outcomes.rolled_back.len(),
        outcomes.cancelled.len(),
        outcomes.converted.len(),
        outcomes.too_late.len(),
        outcomes.failed
    );
    println!(
        "subscriptions           {:>7}  in the database ({} cancelled)",
        f.subscriptions, f.cancelled_subscriptions
    );
    println!(
        "events published        {:>7}  subscription.* messages in the stream",
        f.events_published
    );
    println!(
        "deliveries to billing   {:>7}  (JetStream deliveries, redeliveries included)",
        f.deliveries
    );
    println!(
        "events handled          {:>7}  (inbox rows: one per event)",
        f.handled
    );
    println!(
        "duplicates suppressed   {:>7}  (deliveries that did not produce a new effect)",
        f.deliveries.saturating_sub(f.handled.max(0) as u64)
    );
    println!(
        "invoices                {:>7}  ({} voided)",
        f.invoices, f.voided
    );
    println!(
        "invoice.created         {:>7}  in the stream",
        f.invoice_events
    );
    let t = &f.trials;
    println!(
        "trial ends scheduled    {:>7}  cancelled by a conversion {}, with their subscription {}; ran out {}",
        t.scheduled, t.converted, t.cancelled_with_subscription, t.ran_out
    );
    println!(
        "trial ends recorded     {:>7}  by billing, each at or after its due time (at most {:.3}s after)",
        t.recorded,
        t.max_lateness.num_milliseconds() as f64 / 1000.0
    );
    println!("dead letters            {:>7}", f.dead_letters);
    println!(
        "faults                           nats restarts {}, relay kill -9 {}, billing kill -9 {}, billing deaths between commit and ack {}, postgres restarts {}",
        faults.nats_restarts, faults.relay_kills, faults.billing_kills, crashes, faults.pg_restarts
    );
    if args.cluster {
        println!(
            "cluster faults                   node kill -9 {} (not leading the stream), stream-leader kill -9 {}, node restarts {}",
            faults.node_kills, faults.leader_kills, faults.node_restarts
        );
    }
    let line = |name: &str, items: &[String]| {
        println!("{name:<24}{:>7}  {}", items.len(), mark(items.is_empty()));
        for item in items.iter().take(5) {
            println!("    {item}");
        }
    };
    line("lost", &f.lost);
    line("applied twice", &f.applied_twice);
    line("leaked from rollbacks", &f.leaked);
    line("order violations", &f.order_violations);
    line("cancelled yet consumed", &f.cancelled_consumed);
    line("consumed before due", &f.early);
    println!(
        "{:<24}{:>7}  {}",
        "outbox undrained",
        f.undrained,
        mark(f.undrained == 0)
    );
    for row in &f.undrained_rows {
        println!("    {row}");
    }
    if !unclean.is_empty() {
        println!("unclean shutdown        {unclean:?}  FAIL");
    }
    println!(
        "elapsed                 {:>6.1}s",
        started.elapsed().as_secs_f64()
    );
    println!(
        "RESULT: {}{}",
        if f.passed() && unclean.is_empty() {
            "PASS"
        } else {
            "FAIL"
        },
        if args.no_dedupe {
            " (dedupe layer removed)"
        } else {
            ""
        }
    );
}
