//! `subscriptions`: the HTTP service of `example-subscriptions` (see the
//! library docs for the API).
//!
//! ```text
//! DATABASE_URL=postgres://… NATS_URL=nats://127.0.0.1:4222 \
//!   cargo run -p example-subscriptions --bin subscriptions -- --listen 127.0.0.1:8080
//! ```
//!
//! Prints `listening on http://ADDR` on stdout once it accepts connections
//! (`--listen 127.0.0.1:0` picks a free port and prints it); logs go to stderr.

use std::error::Error;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use example_subscriptions::{AppState, default_schemas_dir, router};
use outbox_pg::health::{self, Probe, Report};
use outbox_pg::{Outbox, SchemaRegistry};
use outbox_publisher::cli::{
    DatabaseArgs, LateReadiness, NatsArgs, StreamArgs, TelemetryArgs, cancel_on_signal,
    parse_ops_addr, serve_ops,
};
use outbox_publisher::{Relay, RelayConfig};
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The in-process relay's error, sent back from its task.
type BoxError = Box<dyn Error + Send + Sync>;

#[derive(Debug, Parser)]
#[command(
    name = "subscriptions",
    version,
    about = "Subscriptions HTTP service: each write and its event in one transaction",
    mut_arg("subjects", |a| a.default_value("subscription.>,invoice.>"))
)]
struct Args {
    /// This service's database.
    #[command(flatten)]
    database: DatabaseArgs,

    /// Address to listen on (port 0 picks a free one; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,

    #[command(flatten)]
    nats: NatsArgs,

    /// Do not run the in-process relay (publish with a separate outbox-relay).
    #[arg(long)]
    no_relay: bool,

    /// The stream the in-process relay publishes into.
    #[command(flatten)]
    stream: StreamArgs,

    /// Directory of the event schemas [default: schemas/events, else the
    /// workspace's schemas/events].
    #[arg(long)]
    schemas: Option<PathBuf>,

    /// How long a trial lasts (`"trial": true` at creation): its
    /// `subscription.trial_ended` falls due this long after the creation
    /// (`30s`, `2h`, `14days`).
    #[arg(long, env = "TRIAL_PERIOD", default_value = "14days", value_parser = parse_trial_period)]
    trial_period: Duration,

    /// Honour `x-fault: rollback` on write requests (tests and demos only).
    #[arg(long)]
    fault_injection: bool,

    /// Serve Prometheus metrics on http://ADDR/metrics, liveness on /healthz
    /// and readiness on /readyz (the database; with the in-process relay,
    /// also NATS and the stream). A port alone binds loopback
    /// (127.0.0.1:PORT); give 0.0.0.0:PORT to serve other hosts. Off unless
    /// given.
    #[arg(long, value_name = "[IP:]PORT", value_parser = parse_ops_addr)]
    metrics_addr: Option<SocketAddr>,

    #[command(flatten)]
    telemetry: TelemetryArgs,
}

/// A trial period: a humantime duration of at least a millisecond.
fn parse_trial_period(s: &str) -> Result<Duration, String> {
    let period = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if period < Duration::from_millis(1) {
        return Err("a trial lasts at least 1ms".to_owned());
    }
    Ok(period)
}

/// A fatal error is one plain line on stderr (its message and causes), and
/// exit status 1.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_pg::exit_code("subscriptions", run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let telemetry = args
        .telemetry
        .init("subscriptions")
        .map_err(|e| e.to_string())?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(
        shutdown.clone(),
        "finishing requests in flight and the relay's batch",
    ));

    // Served from the start; ready once connected (and the stream exists).
    let _stop_ops = shutdown.clone().drop_guard();
    let readiness = serve_ops::<Readiness>(args.metrics_addr, shutdown.clone()).await?;

    let schemas = args.schemas.clone().unwrap_or_else(default_schemas_dir);
    let registry = SchemaRegistry::from_dir(&schemas)
        .map_err(|e| format!("loading event schemas from {}: {e}", schemas.display()))?;
    let pool = args
        .database
        .connect(
            PgPoolOptions::new()
                .max_connections(10)
                .acquire_timeout(Duration::from_secs(5)),
        )
        .await?;
    example_subscriptions::migrate(&pool).await?;
    // A role without the writer's grants is refused here, naming what it
    // lacks, rather than at its first request.
    outbox_pg::check_privileges(&pool, outbox_pg::privilege::WRITER, "outbox_writer")
        .await
        .map_err(|e| e.to_string())?;

    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("listening on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;

    let relay = if args.no_relay {
        readiness.set(Readiness::Database(pool.clone()));
        None
    } else {
        Some(spawn_relay(&args, &pool, &readiness, &shutdown).await?)
    };

    let app = router(
        AppState::new(pool.clone(), Outbox::new(registry))
            .trial_period(args.trial_period)
            .fault_injection(args.fault_injection),
    );
    tracing::info!(%addr, relay = !args.no_relay, fault_injection = args.fault_injection, "subscriptions service started");
    println!("listening on http://{addr}");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .await?;

    shutdown.cancel();
    if let Some(relay) = relay {
        relay.await?.map_err(|e| -> Box<dyn Error> { e })?;
    }
    pool.close().await;
    tracing::info!("subscriptions service stopped");
    // The spans not exported yet, before the process exits.
    telemetry.shutdown();
    Ok(())
}

/// The in-process relay's task: connects to NATS, then runs the relay
/// until `shutdown`.
async fn spawn_relay(
    args: &Args,
    pool: &sqlx::PgPool,
    readiness: &LateReadiness<Readiness>,
    shutdown: &CancellationToken,
) -> Result<JoinHandle<Result<(), BoxError>>, Box<dyn Error>> {
    let nats = args.nats.connect("subscriptions").await?;
    let set_ready = {
        let (readiness, pool) = (readiness.clone(), pool.clone());
        let stream = args.stream.name().to_owned();
        move |nats: &async_nats::Client| {
            readiness.set(Readiness::Relay(Box::new(
                outbox_publisher::Readiness::new(pool.clone(), nats.clone(), stream.clone()),
            )));
        }
    };
    set_ready(&nats);
    let stream = args.stream.spec();
    let (pool, stop, nats_args) = (pool.clone(), shutdown.clone(), args.nats.clone());
    Ok(tokio::spawn(async move {
        let mut nats = nats;
        loop {
            let result = Relay::run_jetstream(
                pool.clone(),
                nats,
                stream.clone(),
                RelayConfig::default(),
                stop.clone().cancelled_owned(),
            )
            .await;
            let e = match result {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if e.kind() == outbox_publisher::ErrorKind::ClientClosed && !stop.is_cancelled() {
                // A closed client never publishes again: a new one,
                // from the same flags.
                tracing::warn!(error = %e, "building a new NATS client from the same flags");
                match nats_args.connect("subscriptions").await {
                    Ok(client) => {
                        set_ready(&client);
                        nats = client;
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the in-process relay stopped; shutting down");
                        stop.cancel();
                        return Err(BoxError::from(e));
                    }
                }
            }
            // A relay that cannot run (its role lacks a privilege, the
            // stream differs) stops the service rather than leaving its
            // events unpublished unnoticed.
            tracing::error!(error = %e, "the in-process relay stopped; shutting down");
            stop.cancel();
            return Err(e.into());
        }
    }))
}

/// What `/readyz` checks: the relay's dependencies, or (`--no-relay`) the
/// database alone.
enum Readiness {
    Relay(Box<outbox_publisher::Readiness>),
    Database(sqlx::PgPool),
}

impl Probe for Readiness {
    async fn check(&self) -> Report {
        match self {
            Readiness::Relay(relay) => relay.check().await,
            Readiness::Database(pool) => {
                Report::new().with(health::database(pool, health::DEFAULT_CHECK_TIMEOUT).await)
            }
        }
    }
}
