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

use clap::{Parser, ValueEnum};
use outbox_publisher::cli::{
    DatabaseArgs, ExposeSecret, NatsArgs, Secret, TelemetryArgs, cancel_on_signal, parse_ops_addr,
    serve_ops,
};
use outbox_publisher::{
    ErrorKind, Readiness, Relay, RelayConfig, StorageType, StreamSpec, WalSource,
};
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

    /// JetStream stream to publish into (created if missing and --subjects is given).
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    stream: String,

    /// Subjects the stream captures, comma-separated (e.g. 'subscription.>,invoice.>').
    #[arg(long, env = "OUTBOX_SUBJECTS", value_delimiter = ',')]
    subjects: Vec<String>,

    /// Add the --subjects an existing stream lacks to it (keeping all of its
    /// own) instead of refusing to start; without it the refusal names the
    /// `nats stream edit` command that adds them.
    #[arg(long, env = "OUTBOX_ADD_SUBJECTS")]
    add_subjects: bool,

    /// How often the stream's config (subjects, limits) is read again while
    /// the relay runs; it is also read at once when a row's type looks
    /// uncaptured or the broker refuses a message. A row whose type the
    /// stream does not capture waits this long before it is tried again,
    /// without losing an attempt.
    #[arg(long, env = "OUTBOX_STREAM_REFRESH", default_value = "30s", value_parser = humantime::parse_duration)]
    stream_refresh: Duration,

    /// Required stream storage (file or memory); new streams use file.
    #[arg(long, value_enum)]
    stream_storage: Option<Storage>,

    /// Required stream replicas; new streams use 1.
    #[arg(long)]
    stream_replicas: Option<usize>,

    /// Required stream duplicate window (e.g. 2m); new streams use 2m.
    #[arg(long, value_parser = humantime::parse_duration)]
    duplicate_window: Option<Duration>,

    /// Rows read per batch (1–5000).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 1000)]
    batch_size: usize,

    /// Concurrent claim → publish → mark loops in this process.
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 2)]
    workers: usize,

    /// Poll interval when no notification arrives (e.g. 500ms).
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "500ms", value_parser = humantime::parse_duration)]
    poll_interval: Duration,

    /// Failed publishes after which a row is left alone.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 20)]
    max_attempts: i32,

    /// First retry delay after a failure; doubles per attempt.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    backoff_base: Duration,

    /// Cap on the retry delay.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    max_backoff: Duration,

    /// How often to log, at info, what this relay published since the line
    /// before, the backlog and the age of the oldest unpublished row; 0 logs none.
    #[arg(long, env = "OUTBOX_PROGRESS_INTERVAL", default_value = "1m", value_parser = humantime::parse_duration)]
    progress_interval: Duration,

    /// Bound on one publish and its PubAck.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    publish_timeout: Duration,

    /// How long a relay that stops answering keeps its shards before another
    /// replica takes them over; also bounds one batch. The stream's duplicate
    /// window must be longer than this plus the publish timeout.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    lease: Duration,

    /// Delete published rows older than this (e.g. 7d); 0 disables retention.
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
    retention: Duration,

    /// Audit rows published within this horizon: read each one's message back
    /// from the stream by its PubAck sequence and publish again a row whose
    /// message the stream lost (rows younger than the duplicate window plus a
    /// quarter of it, 1–30 s, wait). 0 disables the audit.
    #[arg(long, env = "OUTBOX_AUDIT_HORIZON", default_value = "15m", value_parser = humantime::parse_duration)]
    audit_horizon: Duration,

    /// Pause between audit passes.
    #[arg(long, env = "OUTBOX_AUDIT_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    audit_interval: Duration,

    /// Refuse to start on a durability that can lose acknowledged events: a
    /// stream with 1 replica or memory storage, or the audit disabled.
    #[arg(long, env = "OUTBOX_REQUIRE_DURABLE")]
    require_durable: bool,

    /// Where new rows come from: `poll` claims them from the table (any
    /// number of replicas share the work); `wal` reads them from a logical
    /// replication slot (needs wal_level=logical and a role with
    /// REPLICATION; one replica leads, the others stand by). Rows written
    /// before the slot, and those of a slot that was lost, go through the
    /// polling path first.
    #[arg(long, env = "OUTBOX_SOURCE", value_enum, default_value = "poll")]
    source: SourceArg,

    /// With --source wal: the replication slot's (and publication's) name.
    /// Default outbox_relay_<database>_<schema>.
    #[arg(long, env = "OUTBOX_WAL_SLOT", value_name = "NAME")]
    wal_slot: Option<String>,

    /// With --source wal: the PostgreSQL URL of the replication connection
    /// (same database and role rules as DATABASE_URL). Give the server's own
    /// address when DATABASE_URL goes through a pooler: PgBouncer does not
    /// carry the replication protocol. Default: the database URL.
    #[arg(
        long,
        env = "OUTBOX_WAL_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    wal_url: Option<Secret>,

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SourceArg {
    Poll,
    Wal,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Storage {
    File,
    Memory,
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
    let mut builder = match args.threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(usize::from(n));
            builder
        }
    };
    let runtime = match builder.enable_all().build() {
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

    let config = RelayConfig::default()
        .batch_size(args.batch_size)
        .workers(args.workers)
        .poll_interval(args.poll_interval)
        .max_attempts(args.max_attempts)
        .backoff_base(args.backoff_base)
        .backoff_max(args.max_backoff)
        .publish_timeout(args.publish_timeout)
        .lease(args.lease)
        .retention((!args.retention.is_zero()).then_some(args.retention))
        .audit_horizon((!args.audit_horizon.is_zero()).then_some(args.audit_horizon))
        .audit_interval(args.audit_interval)
        .require_durable(args.require_durable)
        .stream_refresh(args.stream_refresh)
        .progress_interval(args.progress_interval);
    let config = if args.source == SourceArg::Wal && !args.once {
        let url = match &args.wal_url {
            Some(url) => url.clone(),
            None => args.database.url()?,
        };
        let mut wal = WalSource::from_url(url.expose_secret())?;
        if let Some(slot) = &args.wal_slot {
            wal = wal.slot(slot.clone());
        }
        config.source_wal(wal)
    } else {
        config
    };
    config.validate()?;

    let pool = args
        .database
        .connect(
            PgPoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(10)),
        )
        .await?;
    let mut stream =
        StreamSpec::new(args.stream.clone(), args.subjects.clone()).add_subjects(args.add_subjects);
    if let Some(storage) = args.stream_storage {
        stream = stream.storage(match storage {
            Storage::File => StorageType::File,
            Storage::Memory => StorageType::Memory,
        });
    }
    if let Some(n) = args.stream_replicas {
        stream = stream.replicas(n);
    }
    if let Some(d) = args.duplicate_window {
        stream = stream.duplicate_window(d);
    }
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
            args.stream.clone(),
        ));
        let ran = async {
            // A broker that is down at start is waited for, not an error; a
            // permission the NATS user lacks (its request is never answered)
            // stops the start, naming the subject.
            let connected = tokio::select! {
                connected = Relay::connect_jetstream(
                    pool.clone(),
                    nats,
                    stream.clone(),
                    config.clone(),
                    shutdown.cancelled(),
                ) => connected?,
                denied = args.nats.permission_denied() => return Err(denied.into()),
            };
            let Some(relay) = connected else {
                return Ok(ExitCode::SUCCESS);
            };
            if args.once {
                let report = relay.drain().await?;
                info!(
                    published = report.published,
                    duplicates = report.duplicates,
                    failed = report.failed,
                    "drained outbox"
                );
                return Ok(if report.failed == 0 {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                });
            }
            relay.run(shutdown.cancelled()).await?;
            Ok::<_, outbox_publisher::Error>(ExitCode::SUCCESS)
        };
        match ran.await {
            Err(e) if e.kind() == ErrorKind::ClientClosed && !shutdown.is_cancelled() => {
                warn!(error = %e, "building a new NATS client from the same flags");
            }
            ran => return Ok(ran?),
        }
    }
}
