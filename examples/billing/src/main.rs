//! `billing`: the consumer of `example-billing` (see the library docs).
//!
//! ```text
//! DATABASE_URL=postgres://… NATS_URL=nats://127.0.0.1:4222 \
//!   cargo run -p example-billing --bin billing -- --consumer billing
//! ```
//!
//! Prints `billing ready` on stdout once it consumes; logs go to stderr.

use std::error::Error;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use example_billing::{
    CrashAfterCommitLayer, StackOptions, batch_service, connect_consumer, consumer_config,
    default_schemas_dir, service,
};
use inbox_consumer::connect::{DatabaseArgs, NatsArgs, cancel_on_signal};
use inbox_consumer::{ConsumerConfig, Readiness, Start};
use outbox_pg::{Outbox, SchemaRegistry};
use outbox_publisher::cli::{StreamArgs, TelemetryArgs, parse_ops_addr, serve_ops};
use outbox_publisher::{Relay, RelayConfig};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

/// How long to wait for the stream to exist before giving up.
const STREAM_PATIENCE: Duration = Duration::from_secs(30);

#[derive(Debug, Parser)]
#[command(
    name = "billing",
    version,
    about = "Billing consumer: one invoice per subscription, through the inbox",
    mut_arg("subjects", |a| a.default_value("subscription.>,invoice.>"))
)]
struct Args {
    /// Billing's database.
    #[command(flatten)]
    database: DatabaseArgs,

    #[command(flatten)]
    nats: NatsArgs,

    /// Durable consumer name; also the inbox dedupe namespace (keep it stable).
    #[arg(long, default_value = "billing")]
    consumer: String,

    /// Deliveries handled at once (never two of one subscription).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,

    /// Most deliveries handled in one transaction (1: each in its own). What
    /// has arrived is handled at once, never waiting to fill a batch: up to N
    /// deliveries of distinct subscriptions share one transaction, one
    /// set-based inbox insert and one commit, then their acks; one whose
    /// handler fails is handled alone afterwards.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4096))]
    batch: u16,

    /// Where the durable starts if billing creates it (it does not exist):
    /// `auto` (after where the inbox records billing, or the consumer it
    /// renames, to stand: nothing past the inbox window is applied again; a
    /// consumer that never ran here reads the whole stream), `all` (a replay
    /// of the whole stream), `new`, or a stream sequence.
    #[arg(long, default_value = "auto", value_parser = parse_start)]
    start: Start,

    /// The stream to consume from, which the in-process relay publishes into.
    #[command(flatten)]
    stream: StreamArgs,

    /// Do not run the in-process relay for billing's own outbox.
    #[arg(long)]
    no_relay: bool,

    /// Deliveries of one event before its failure is dead-lettered.
    #[arg(long, default_value_t = 50)]
    max_deliver: i64,

    /// How long JetStream waits for an ack before redelivering what a dead
    /// process held (a live one keeps its messages with in-progress acks, a
    /// third of this apart, however slow its handlers).
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    ack_wait: Duration,

    /// Let every replica consume at once, without per-subscription order
    /// across replicas (by default one replica leads and the others stand by).
    #[arg(long)]
    unordered: bool,

    /// How long the leading replica may stay silent towards the database
    /// before a standby takes over (a dead process is replaced at once).
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    lease_timeout: Duration,

    /// Serve Prometheus metrics on http://ADDR/metrics, liveness on /healthz
    /// and readiness (database, NATS, stream, durable consumer) on /readyz. A
    /// port alone binds loopback (127.0.0.1:PORT); give 0.0.0.0:PORT to
    /// serve other hosts. Off unless given.
    #[arg(long, value_name = "[IP:]PORT", value_parser = parse_ops_addr)]
    metrics_addr: Option<SocketAddr>,

    /// Directory of the event schemas [default: schemas/events, else the
    /// workspace's schemas/events].
    #[arg(long)]
    schemas: Option<PathBuf>,

    #[command(flatten)]
    telemetry: TelemetryArgs,

    /// TEST ONLY: abort the process after a committed delivery, before its
    /// ack, with this probability (0..1).
    #[arg(long, hide = true, value_parser = probability)]
    crash_after_commit: Option<f64>,

    /// TEST ONLY: seed of --crash-after-commit's dice (default: from the clock).
    #[arg(long, hide = true)]
    seed: Option<u64>,

    /// TEST ONLY: handle deliveries without the inbox, so redeliveries are
    /// handled again.
    #[arg(long, hide = true)]
    no_dedupe: bool,
}

fn parse_start(s: &str) -> Result<Start, String> {
    match s {
        "auto" => Ok(Start::Auto),
        "all" => Ok(Start::All),
        "new" => Ok(Start::New),
        n => n
            .parse()
            .map(Start::Sequence)
            .map_err(|_| format!("`{n}` is not auto, all, new or a stream sequence")),
    }
}

fn probability(s: &str) -> Result<f64, String> {
    let p: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is not a probability between 0 and 1"))
    }
}

/// A fatal error is one plain line on stderr (its message and causes), and
/// exit status 1.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_pg::exit_code("billing", run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let telemetry = args.telemetry.init("billing").map_err(|e| e.to_string())?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(
        shutdown.clone(),
        "draining the consumer, then the relay",
    ));

    // Served from the start; ready once connected and the durable exists.
    let _stop_ops = shutdown.clone().drop_guard();
    let readiness = serve_ops::<Readiness>(args.metrics_addr, shutdown.clone()).await?;
    inbox_consumer::metrics::describe();

    let schemas = args.schemas.clone().unwrap_or_else(default_schemas_dir);
    let registry = SchemaRegistry::from_dir(&schemas)
        .map_err(|e| format!("loading event schemas from {}: {e}", schemas.display()))?;
    let outbox = Outbox::new(registry);
    let concurrency = args.concurrency.max(1);
    let pool = args
        .database
        .connect(
            // No test round trip before a recently used connection's BEGIN.
            inbox_consumer::pool::handler_pool(PgPoolOptions::new())
                .max_connections(
                    u32::try_from(concurrency)
                        .unwrap_or(u32::MAX)
                        .saturating_add(4),
                )
                .acquire_timeout(Duration::from_secs(10)),
        )
        .await?;
    example_billing::migrate(&pool).await?;

    // One round per NATS client: a client closed under the consumer or the
    // relay (drained, or its connection task gone) never works again, so
    // both stop, a new client is built from the same flags, and both start
    // again on it. What was not acked comes back; the inbox drops what was
    // already applied.
    let served = loop {
        let nats = args.nats.connect("billing").await?;
        readiness.set(Readiness::new(
            pool.clone(),
            nats.clone(),
            args.stream.name().to_owned(),
            args.consumer.clone(),
        ));
        match serve(&args, &pool, &outbox, nats, &shutdown).await {
            Err(Round::ClientClosed(why)) if !shutdown.is_cancelled() => {
                tracing::warn!(error = %why, "building a new NATS client from the same flags");
            }
            Err(Round::ClientClosed(_)) => break Ok(()),
            Err(Round::Failed(e)) => break Err(e),
            Ok(()) => break Ok(()),
        }
    };
    pool.close().await;
    if served.is_ok() {
        tracing::info!("billing stopped");
    }
    // The spans not exported yet, before the process exits.
    telemetry.shutdown();
    served
}

/// How a round on one NATS client ended, if not by shutdown.
enum Round {
    /// The client was closed under the consumer or the relay: start again
    /// on a new one.
    ClientClosed(String),
    /// Anything else stops billing.
    Failed(Box<dyn Error>),
}

/// The in-process relay and the consumer on `nats`, until shutdown or until
/// either stops; then the other is stopped and waited for.
async fn serve(
    args: &Args,
    pool: &sqlx::PgPool,
    outbox: &Outbox,
    nats: async_nats::Client,
    shutdown: &CancellationToken,
) -> Result<(), Round> {
    let round = shutdown.child_token();
    let relay = (!args.no_relay).then(|| {
        let (pool, nats, stop) = (pool.clone(), nats.clone(), round.clone());
        let stream = args.stream.spec();
        tokio::spawn(async move {
            // Rows a crashed replica had claimed are taken over after 10 s.
            let config = RelayConfig::default()
                .lease(Duration::from_secs(10))
                .publish_timeout(Duration::from_secs(2));
            let result =
                Relay::run_jetstream(pool, nats, stream, config, stop.clone().cancelled_owned())
                    .await;
            if let Err(e) = &result {
                // A relay that cannot run (its role lacks a privilege, the
                // stream differs) stops billing rather than leaving its
                // events unpublished unnoticed.
                tracing::error!(error = %e, "the in-process relay stopped");
                stop.cancel();
            }
            result
        })
    });
    // Whatever stops the consumer (shutdown or a refusal), the relay stops
    // and is waited for first, so that the error, if any, is the last line.
    let consumed = consume(args, pool, outbox, nats, &round).await;
    round.cancel();
    let relayed = match relay {
        Some(relay) => match relay.await {
            Ok(Err(e)) if e.kind() == outbox_publisher::ErrorKind::ClientClosed => {
                Err(Round::ClientClosed(e.to_string()))
            }
            Ok(result) => result.map_err(|e| Round::Failed(e.into())),
            Err(e) => Err(Round::Failed(e.into())),
        },
        None => Ok(()),
    };
    match (consumed, relayed) {
        (Err(Round::Failed(e)), _) | (_, Err(Round::Failed(e))) => {
            shutdown.cancel();
            Err(Round::Failed(e))
        }
        (Err(closed), _) | (_, Err(closed)) => Err(closed),
        (Ok(()), Ok(())) => Ok(()),
    }
}

/// Creates the durable consumer on `nats` and consumes until `round` is
/// cancelled.
async fn consume(
    args: &Args,
    pool: &sqlx::PgPool,
    outbox: &Outbox,
    nats: async_nats::Client,
    round: &CancellationToken,
) -> Result<(), Round> {
    let batch = batch(args);
    let js = async_nats::jetstream::new(nats);
    let creating = |e: &dyn std::fmt::Display| {
        format!(
            "creating consumer `{}` on stream `{}`: {e}",
            args.consumer,
            args.stream.name()
        )
    };
    // A permission the NATS user lacks stops the start, naming the subject,
    // rather than a wait for a stream that does not answer.
    let consumer = tokio::select! {
        () = round.cancelled() => return Ok(()),
        consumer = connect_consumer(js, pool.clone(), config(args), STREAM_PATIENCE) => consumer.map_err(|e| {
            if e.kind() == inbox_consumer::ErrorKind::ClientClosed {
                Round::ClientClosed(creating(&e))
            } else {
                Round::Failed(creating(&e).into())
            }
        })?,
        denied = args.nats.permission_denied() => return Err(Round::Failed(creating(&denied).into())),
    };
    // Billing also enqueues (invoice.created, in its handlers' transactions).
    outbox_pg::check_privileges(pool, outbox_pg::privilege::WRITER, "outbox_writer")
        .await
        .map_err(|e| Round::Failed(e.to_string().into()))?;
    let options = stack_options(args);
    // The runtime logs `inbox consumer started` with its settings.
    let stopped = round.clone().cancelled_owned();
    let ran = if batch > 1 {
        let stack = batch_service(pool.clone(), outbox.clone(), options)
            .map_err(|e| Round::Failed(e.into()))?;
        println!("billing ready");
        consumer.run_batched(stack, stopped).await
    } else {
        let stack = service(pool.clone(), outbox.clone(), options);
        println!("billing ready");
        consumer.run(stack, stopped).await
    };
    match ran {
        Err(e) if e.kind() == inbox_consumer::ErrorKind::ClientClosed => {
            Err(Round::ClientClosed(e.to_string()))
        }
        ran => ran.map_err(|e| Round::Failed(e.into())),
    }
}

/// Most deliveries handled in one transaction: `--batch`, or one at a
/// time without the inbox (a test mode).
fn batch(args: &Args) -> usize {
    if args.no_dedupe {
        1
    } else {
        usize::from(args.batch)
    }
}

/// The durable consumer the flags describe.
fn config(args: &Args) -> ConsumerConfig {
    let (concurrency, batch) = (args.concurrency.max(1), batch(args));
    // Room for every slot to fill its batch, and for the next batches.
    let buffered = (concurrency * batch * 2).max(256);
    consumer_config(args.stream.name(), &args.consumer)
        .concurrency(concurrency)
        .max_batch(batch)
        .max_buffered(buffered)
        .max_ack_pending(i64::try_from(buffered * 2).unwrap_or(i64::MAX).max(1_000))
        .max_deliver(args.max_deliver)
        .ack_wait(args.ack_wait)
        .ordered(!args.unordered)
        .lease_timeout(args.lease_timeout)
        .start(args.start)
}

/// The handler stack's options: the test modes the flags ask for, each
/// warned of.
fn stack_options(args: &Args) -> StackOptions {
    let mut options = StackOptions::default();
    if let Some(p) = args.crash_after_commit {
        let seed = args.seed.unwrap_or_else(clock_seed);
        tracing::warn!(
            probability = p,
            seed,
            "TEST ONLY: crashing after commits, before acks"
        );
        options = options.crash_after_commit(CrashAfterCommitLayer::new(p, seed));
    }
    if args.no_dedupe {
        tracing::warn!("TEST ONLY: running without the inbox; redeliveries will be handled again");
        options = options.dedupe(false);
    }
    options
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id())
}
