//! What the `outbox-relay` binary and services that embed a relay share:
//! log set-up and shutdown on a signal.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind, Result};

/// How logs are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line, fields flattened.
    Json,
}

/// Installs a `tracing` subscriber writing to stderr, filtered by `RUST_LOG`
/// (default `info`). Colours only on a terminal.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// Waits for SIGTERM or ctrl-c, logs `what` is shutting down, and cancels
/// `shutdown`. Spawn it beside the work it stops.
pub async fn cancel_on_signal(shutdown: CancellationToken, what: &'static str) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; ctrl-c only");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutting down: {what}");
    shutdown.cancel();
}

/// How to reach NATS: the URL, credentials and TLS, as flags and environment
/// variables. `#[command(flatten)]` it into a binary's arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,

    /// NATS user (with --nats-password).
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,

    /// NATS password.
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,

    /// NATS token.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,

    /// NATS nkey seed.
    #[arg(long, env = "NATS_NKEY", hide_env_values = true)]
    pub nats_nkey: Option<String>,

    /// NATS credentials file (JWT + nkey).
    #[arg(long, env = "NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,

    /// CA certificate (PEM) to verify the NATS server's TLS certificate; requires TLS.
    #[arg(long, env = "NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for TLS client authentication, with --nats-tls-key.
    #[arg(long, env = "NATS_TLS_CERT")]
    pub nats_tls_cert: Option<PathBuf>,

    /// Client key (PEM) for TLS client authentication.
    #[arg(long, env = "NATS_TLS_KEY")]
    pub nats_tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// Connects as `name`. The client keeps retrying while the server is
    /// unreachable (at start and after any disconnect), so a broker that is
    /// down does not stop the process; publishes fail fast meanwhile.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if the credentials file cannot be read;
    /// [`ErrorKind::Broker`] if the URL is invalid.
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client> {
        let mut options = async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None);
        if let (Some(user), Some(password)) = (&self.nats_user, &self.nats_password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.nats_token {
            options = options.token(token.clone());
        }
        if let Some(seed) = &self.nats_nkey {
            options = options.nkey(seed.clone());
        }
        if let Some(path) = &self.nats_creds {
            options = options.credentials_file(path).await.map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("reading NATS credentials {}: {e}", path.display()),
                )
                .with_source(e)
            })?;
        }
        if let Some(ca) = &self.nats_tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.nats_tls_cert, &self.nats_tls_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        options.connect(self.nats_url.as_str()).await.map_err(|e| {
            Error::new(
                ErrorKind::Broker,
                format!("connecting to NATS at {}: {e}", self.nats_url),
            )
            .with_source(e)
        })
    }
}
