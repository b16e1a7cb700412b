//! `outbox-relay`: publishes committed rows of `outbox_events` to NATS JetStream.
//!
//! ```text
//! DATABASE_URL=postgres://… NATS_URL=nats://127.0.0.1:4222 \
//!   outbox-relay --stream OUTBOX --subjects 'subscription.>,invoice.>' --metrics-addr 127.0.0.1:9187
//! ```
//!
//! `--metrics-addr` serves `/metrics` (Prometheus text), `/healthz` (200
//! while the process runs) and `/readyz` (200 when the database answers, NATS
//! is connected and the stream exists; 503 with a JSON body naming the failed
//! check otherwise). A port alone (`--metrics-addr 9187`) binds loopback;
//! `0.0.0.0:9187` serves other hosts.
//!
//! No password reaches a log line or an error, at any level: URLs are parsed
//! and shown with their passwords masked, and one whose password cannot be
//! told from the rest (an unencoded `/`, `?`, `#`) is refused unshown.
//!
//! Secrets come from the environment or files, never only from argv:
//! `DATABASE_URL_FILE`, `NATS_TOKEN_FILE`, `NATS_NKEY_FILE`, `NATS_CREDS`, …
//! PostgreSQL TLS through the URL (`?sslmode=verify-full&sslrootcert=ca.pem`),
//! NATS TLS through `--nats-tls-ca` (and `--nats-tls-cert`/`--nats-tls-key`).
//!
//! At start the relay logs the durability in force (stream replicas, storage,
//! duplicate window against lease + publish timeout, the audit) and warns on
//! each setting that can lose acknowledged events; `--require-durable` refuses
//! to start on them instead. The audit (`--audit-horizon`, default 15m)
//! republishes rows whose acknowledged message the stream lost.
//!
//! The stream may be edited while the relay runs (`nats stream edit`: subjects
//! added, limits changed) or deleted and recreated: the relay reads it again
//! every `--stream-refresh` (30s) and whenever a row's type looks uncaptured or
//! the broker refuses a message. Rows of a type the stream does not capture
//! wait, without losing attempts, until it does; while the stream is gone,
//! rows wait untouched (the relay does not recreate it while it runs). Given
//! `--subjects` an existing stream lacks, the relay refuses to start naming
//! the `nats stream edit` command to run, or adds them with `--add-subjects`.
//!
//! Logs go to stderr (`--log-format`, `RUST_LOG`). Built with the
//! `opentelemetry` feature, `--otlp-endpoint URL` (or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`) also exports the relay's spans over
//! OTLP/HTTP to `URL/v1/traces`, service name `OTEL_SERVICE_NAME` (default
//! `outbox-relay`), flushed at exit. The relay carries each row's
//! `traceparent`/`tracestate` to its message's headers unchanged.
//!
//! One thread runs the relay (`--threads`, default 1): its loops and its
//! connections share it, which spends the least CPU per event where the
//! relay shares a few cores with PostgreSQL or nats-server. `--threads N`
//! runs N worker threads beside the main one.
//!
//! Run as many replicas as you like against one table. SIGTERM or ctrl-c
//! finishes the current batch and exits 0. `--once` drains the table and exits
//! (0 when every claimed row was published, 1 when some failed and wait in
//! backoff).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use outbox_publisher::cli::{
    DatabaseArgs, NatsArgs, RelayArgs, SourceArgs, StreamArgs, TelemetryArgs, cancel_on_signal,
    parse_ops_addr, serve_ops,
};
use outbox_publisher::{ErrorKind, Readiness, Relay, RelayConfig, StreamSpec};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// mimalloc in place of glibc's malloc, whose arena locks the relay's
/// threads queued on for a fifth of its CPU time under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relay outbox_events rows to NATS JetStream"
)]
struct Args {
    /// The database holding outbox_events.
    #[command(flatten)]
    database: DatabaseArgs,

    #[command(flatten)]
    nats: NatsArgs,

    #[command(flatten)]
    stream: StreamArgs,

    #[command(flatten)]
    relay: RelayArgs,

    #[command(flatten)]
    source: SourceArgs,

    /// Drain the table, then exit (through the polling path, whatever --source).
    #[arg(long)]
    once: bool,

    /// Threads that run the relay. 1 (the default): one thread runs its loop
    /// and its connections, which spends the least CPU per event (no
    /// hand-offs between threads) and so publishes the most where the relay
    /// shares a few cores with PostgreSQL or nats-server. N > 1: N worker
    /// threads beside the main one, for a host with cores to spare.
    #[arg(long, env = "OUTBOX_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: u16,

    /// Serve Prometheus metrics on http://ADDR/metrics, liveness on /healthz
    /// and readiness (database, NATS, stream) on /readyz. A port alone binds
    /// loopback (127.0.0.1:PORT); give 0.0.0.0:PORT to serve other hosts.
    /// Off unless given.
    #[arg(long, env = "OUTBOX_METRICS_ADDR", value_name = "[IP:]PORT", value_parser = parse_ops_addr)]
    metrics_addr: Option<SocketAddr>,

    #[command(flatten)]
    telemetry: TelemetryArgs,
}

impl Args {
    /// The relay's configuration, validated: `--once` drains through the
    /// polling path whatever `--source`.
    fn config(&self) -> Result<RelayConfig, outbox_publisher::Error> {
        let config = self.relay.config();
        let config = if self.once {
            config
        } else {
            self.source.apply(config, &self.database)?
        };
        config.validate()?;
        Ok(config)
    }

    /// The async runtime `--threads` asks for.
    fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = match self.threads {
            1 => tokio::runtime::Builder::new_current_thread(),
            n => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(usize::from(n));
                builder
            }
        };
        builder.enable_all().build()
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let telemetry = match args.telemetry.init("outbox-relay") {
        Ok(telemetry) => telemetry,
        Err(e) => {
            eprintln!("outbox-relay: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match args.runtime() {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            error!(error = %e, "outbox-relay failed");
            ExitCode::FAILURE
        }
    };
    // The spans not exported yet, before the process exits.
    telemetry.shutdown();
    code
}

async fn run(args: Args) -> Result<ExitCode, Box<dyn std::error::Error>> {
    // Served from the start; ready once connected and the stream exists.
    let ops_shutdown = CancellationToken::new();
    let _stop_ops = ops_shutdown.clone().drop_guard();
    let readiness = serve_ops::<Readiness>(args.metrics_addr, ops_shutdown.clone()).await?;
    let config = args.config()?;
    let pool = args
        .database
        .connect(
            PgPoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(10)),
        )
        .await?;
    let stream = args.stream.spec();
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(
        shutdown.clone(),
        "finishing the current batch",
    ));
    // A NATS client closed under the relay (drained, or its connection task
    // gone) never publishes again: a new one is built from the same flags,
    // and the relay set up on it again. Rows wait in the table meanwhile.
    loop {
        let nats = args.nats.connect("outbox-relay").await?;
        readiness.set(Readiness::new(
            pool.clone(),
            nats.clone(),
            args.stream.name().to_owned(),
        ));
        let round = Round {
            args: &args,
            pool: &pool,
            stream: &stream,
            config: &config,
            shutdown: &shutdown,
        };
        match round.run(nats).await {
            Err(e) if e.kind() == ErrorKind::ClientClosed && !shutdown.is_cancelled() => {
                warn!(error = %e, "building a new NATS client from the same flags");
            }
            ran => return Ok(ran?),
        }
    }
}

/// The relay on one NATS client, until shutdown, the drain's end
/// (`--once`), or an error.
struct Round<'a> {
    args: &'a Args,
    pool: &'a PgPool,
    stream: &'a StreamSpec,
    config: &'a RelayConfig,
    shutdown: &'a CancellationToken,
}

impl Round<'_> {
    async fn run(self, nats: async_nats::Client) -> Result<ExitCode, outbox_publisher::Error> {
        // A broker that is down at start is waited for, not an error; a
        // permission the NATS user lacks (its request is never answered)
        // stops the start, naming the subject.
        let connected = tokio::select! {
            connected = Relay::connect_jetstream(
                self.pool.clone(),
                nats,
                self.stream.clone(),
                self.config.clone(),
                self.shutdown.cancelled(),
            ) => connected?,
            denied = self.args.nats.permission_denied() => return Err(denied.into()),
        };
        let Some(relay) = connected else {
            return Ok(ExitCode::SUCCESS);
        };
        if self.args.once {
            return drain(relay).await;
        }
        relay.run(self.shutdown.cancelled()).await?;
        Ok(ExitCode::SUCCESS)
    }
}

/// `--once`: drains the table; 0 when every claimed row was published, 1
/// when some failed and wait in backoff.
async fn drain(relay: Relay) -> Result<ExitCode, outbox_publisher::Error> {
    let report = relay.drain().await?;
    info!(
        published = report.published,
        duplicates = report.duplicates,
        failed = report.failed,
        "drained outbox"
    );
    Ok(if report.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
