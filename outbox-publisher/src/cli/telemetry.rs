//! The binaries' logs and traces, set up in one place: [`TelemetryArgs`]
//! (`--log-format`, and with the `opentelemetry` feature `--otlp-endpoint`)
//! flattened into each binary's flags, and [`TelemetryArgs::init`], which
//! installs the process's `tracing` subscriber.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default `info`). The same
//! filter decides which spans exist at all, so it also bounds what is
//! exported.
//!
//! With the `opentelemetry` feature and an endpoint (`--otlp-endpoint URL`,
//! or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`), `tracing` spans are also
//! exported as OpenTelemetry spans (through `tracing-opentelemetry`) over
//! OTLP/HTTP with protobuf bodies to `URL/v1/traces`, batched by the SDK's
//! batch span processor on a thread of its own (see the `otlp` module). The
//! service name is `OTEL_SERVICE_NAME`, else the binary's name; the SDK also
//! reads `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, the batch
//! processor's `OTEL_BSP_*` and the exporter's `OTEL_EXPORTER_OTLP_HEADERS`.
//! Without an endpoint no exporter, processor or thread exists: spans cost
//! what they cost without the feature. [`Telemetry::shutdown`] (or dropping
//! the [`Telemetry`]) flushes the spans not yet exported before the process
//! exits.

use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::{Error, ErrorKind, Result};

/// How logs are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line, fields flattened.
    Json,
}

/// The flags of logs and traces every binary takes (flatten them into its
/// `Args`).
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryArgs {
    /// Log format (logs go to stderr, filtered by RUST_LOG, default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,

    /// Export spans to this OpenTelemetry collector over OTLP/HTTP
    /// (protobuf), at URL/v1/traces, batched (e.g. http://127.0.0.1:4318).
    /// The service name is OTEL_SERVICE_NAME, else the binary's name. Off
    /// unless given: no exporter then.
    #[cfg(feature = "opentelemetry")]
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// Flags that log in `format` and export nothing.
    pub fn new(log_format: LogFormat) -> Self {
        Self {
            log_format,
            #[cfg(feature = "opentelemetry")]
            otlp_endpoint: None,
        }
    }

    /// Installs the process's `tracing` subscriber: logs to stderr as
    /// `--log-format` says (colours only on a terminal), filtered by
    /// `RUST_LOG` (default `info`), and with an OTLP endpoint, spans exported
    /// as the module docs say, the service named `service` unless
    /// `OTEL_SERVICE_NAME` names it. Keep the returned [`Telemetry`] until
    /// the process exits, and shut it down then.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if a global subscriber is installed already,
    /// or the OTLP endpoint is not an `http://` URL (the exporter speaks
    /// HTTP without TLS: export through a collector or agent next to the
    /// service), or `OTEL_EXPORTER_OTLP_PROTOCOL` asks for another protocol
    /// than `http/protobuf`.
    pub fn init(&self, service: &str) -> Result<Telemetry> {
        #[cfg(feature = "opentelemetry")]
        let provider = match self.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) {
            Some(endpoint) => Some(super::otlp::tracer_provider(endpoint, service)?),
            None => None,
        };
        #[cfg(not(feature = "opentelemetry"))]
        let _ = service;

        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let fmt = tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr);
        let fmt = match self.log_format {
            LogFormat::Human => fmt.boxed(),
            LogFormat::Json => fmt.json().flatten_event(true).boxed(),
        };
        let registry = tracing_subscriber::registry().with(filter).with(fmt);
        #[cfg(feature = "opentelemetry")]
        let registry = registry.with(provider.as_ref().map(|provider| {
            use opentelemetry::trace::TracerProvider as _;
            tracing_opentelemetry::layer().with_tracer(provider.tracer(env!("CARGO_PKG_NAME")))
        }));
        registry.try_init().map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("cannot install the log subscriber: {e}"),
            )
            .with_source(e)
        })?;

        #[cfg(feature = "opentelemetry")]
        if let Some(endpoint) = &self.otlp_endpoint {
            tracing::info!(
                endpoint = %super::otlp::traces_url(endpoint),
                "exporting spans over OTLP/HTTP"
            );
        }
        Ok(Telemetry {
            #[cfg(feature = "opentelemetry")]
            provider,
        })
    }
}

/// What [`TelemetryArgs::init`] set up that must be shut down: the tracer
/// provider of the OTLP exporter, if any.
#[derive(Debug)]
#[must_use = "dropping it at once stops the span export"]
pub struct Telemetry {
    #[cfg(feature = "opentelemetry")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported (an OTLP endpoint was given).
    pub fn exports_spans(&self) -> bool {
        #[cfg(feature = "opentelemetry")]
        return self.provider.is_some();
        #[cfg(not(feature = "opentelemetry"))]
        false
    }

    /// Exports the spans not exported yet and stops the exporter, blocking
    /// the calling thread until the collector answered or the export timed
    /// out (10 s by default, `OTEL_EXPORTER_OTLP_TIMEOUT`). Call it as the
    /// process exits; dropping the value does the same. A failure is logged.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        #[cfg(feature = "opentelemetry")]
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "exporting the last spans failed");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Installs a `tracing` subscriber writing to stderr, filtered by `RUST_LOG`
/// (default `info`); colours only on a terminal. As [`TelemetryArgs::init`]
/// without an exporter; does nothing if a subscriber is installed already.
pub fn init_logging(format: LogFormat) {
    if let Ok(telemetry) = TelemetryArgs::new(format).init("") {
        telemetry.shutdown();
    }
}
