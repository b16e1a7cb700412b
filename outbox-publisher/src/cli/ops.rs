//! The binaries' operations endpoint: one small HTTP server on
//! `--metrics-addr` (off unless given; a port alone binds loopback, see
//! [`parse_ops_addr`]) answering
//!
//! | path | answer |
//! |---|---|
//! | `GET /metrics` | Prometheus text of every metric recorded in the process |
//! | `GET /healthz` | 200 `ok` while the process runs (liveness) |
//! | `GET /readyz` | 200 when every readiness check passed, 503 otherwise; the body is the [`Report`] as JSON, naming each failed check with a plain reason (never a driver's error text, a URL or a secret) |
//!
//! [`install_prometheus`] installs the process-wide recorder, rendering every
//! histogram of seconds as a Prometheus histogram with [`SECONDS_BUCKETS`]
//! (so `histogram_quantile` aggregates across replicas) and
//! `outbox_relay_batch_rows` with [`ROWS_BUCKETS`]. The readiness checks are the
//! libraries' ([`crate::Readiness`], `inbox_consumer::Readiness`); any
//! function returning a [`Report`] will do.

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use outbox_pg::health::{Check, Probe, Report};
use tokio_util::sync::CancellationToken;

/// Bucket bounds, in seconds, of every histogram whose name ends `_seconds`.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Bucket bounds of `outbox_relay_batch_rows` (rows per batch).
pub const ROWS_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
];

/// The value of `--metrics-addr`: `PORT` or `:PORT` binds loopback
/// (`127.0.0.1:PORT`), so the endpoint is reachable from other hosts only
/// when told so with an address (`0.0.0.0:PORT`, `[::]:PORT`, an
/// interface's IP). Use it as the flag's `value_parser`.
///
/// ```
/// use outbox_publisher::cli::parse_ops_addr;
///
/// assert_eq!(parse_ops_addr("9187")?.to_string(), "127.0.0.1:9187");
/// assert_eq!(parse_ops_addr(":9187")?.to_string(), "127.0.0.1:9187");
/// assert_eq!(parse_ops_addr("0.0.0.0:9187")?.to_string(), "0.0.0.0:9187");
/// # Ok::<(), outbox_publisher::Error>(())
/// ```
///
/// # Errors
/// [`ErrorKind::Config`](crate::ErrorKind::Config) if `value` is neither a
/// port nor an `IP:PORT` address.
pub fn parse_ops_addr(value: &str) -> crate::Result<SocketAddr> {
    let port = value.strip_prefix(':').unwrap_or(value);
    if let Ok(port) = port.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    value.parse::<SocketAddr>().map_err(|e| {
        crate::Error::new(
            crate::ErrorKind::Config,
            format!(
                "`{value}` is not a port (bound on 127.0.0.1) nor an IP:PORT address \
                 (0.0.0.0:PORT serves other hosts)"
            ),
        )
        .with_source(e)
    })
}

/// How often histogram data is folded into the rendered buckets.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder for the whole process, with the buckets
/// above, and registers the relay's metric descriptions
/// ([`crate::metrics::describe`]). Call once, early; services that also
/// consume call `inbox_consumer::metrics::describe()` after it.
///
/// # Errors
/// A [`BuildError`] if a recorder is already installed.
pub fn install_prometheus() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(crate::metrics::BATCH_ROWS.into()),
            ROWS_BUCKETS,
        )?
        .install_recorder()?;
    crate::metrics::describe();
    Ok(handle)
}

/// The operations endpoint, bound and not yet serving.
#[derive(Debug)]
pub struct OpsServer {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl OpsServer {
    /// Binds `addr` (port 0 picks a free port: see [`local_addr`](Self::local_addr)).
    ///
    /// # Errors
    /// An I/O error naming `addr` if it cannot be bound.
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("binding the metrics and health endpoint to {addr}: {e}"),
            )
        })?;
        let addr = listener.local_addr()?;
        Ok(Self { listener, addr })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `/metrics` from `metrics`, `/healthz`, and `/readyz` from
    /// `ready` (run once per request) on a task of its own until `shutdown`
    /// is cancelled. Also runs the recorder's upkeep.
    pub fn spawn<R, F>(
        self,
        metrics: PrometheusHandle,
        ready: R,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()>
    where
        R: Fn() -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Report> + Send + 'static,
    {
        let upkeep = metrics.clone();
        let stop_upkeep = shutdown.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(UPKEEP_INTERVAL);
            loop {
                tokio::select! {
                    () = stop_upkeep.cancelled() => break,
                    _ = ticks.tick() => upkeep.run_upkeep(),
                }
            }
        });
        let app = Router::new()
            .route("/metrics", get(render_metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route(
                "/readyz",
                get(move || {
                    let ready = ready.clone();
                    async move { readiness_response(ready().await) }
                }),
            )
            .with_state(metrics);
        let addr = self.addr;
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        tokio::spawn(async move {
            let served = axum::serve(self.listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::error!(%addr, error = %e, "the metrics and health endpoint stopped");
            }
        })
    }
}

/// The readiness of a binary that serves its endpoint before it has
/// connected: `/readyz` answers 503, "still connecting at start-up", until
/// [`set`](Self::set) hands it the probe. Cloning shares the slot.
#[derive(Debug)]
pub struct LateReadiness<P> {
    probe: Arc<OnceLock<P>>,
}

impl<P> Clone for LateReadiness<P> {
    fn clone(&self) -> Self {
        Self {
            probe: Arc::clone(&self.probe),
        }
    }
}

impl<P> Default for LateReadiness<P> {
    fn default() -> Self {
        Self {
            probe: Arc::new(OnceLock::new()),
        }
    }
}

impl<P: Probe> LateReadiness<P> {
    /// From now on, `/readyz` runs `probe`. Only the first call counts.
    pub fn set(&self, probe: P) {
        let _ = self.probe.set(probe);
    }

    /// The probe's report, or the start-up one while there is none.
    pub async fn check(&self) -> Report {
        match self.probe.get() {
            Some(probe) => probe.check().await,
            None => Report::new().with(Check::failed(
                "database",
                "not checked: still connecting at start-up",
            )),
        }
    }
}

/// A binary's `--metrics-addr` (parsed by [`parse_ops_addr`]): with an
/// address, installs the Prometheus
/// recorder ([`install_prometheus`]), binds it and serves `/metrics`,
/// `/healthz` and `/readyz` until `shutdown`; without one, serves nothing.
/// Either way the returned slot takes the probe once the binary has
/// connected.
///
/// # Errors
/// An I/O error naming the address if it cannot be bound, or the recorder
/// if one is installed already.
pub async fn serve_ops<P: Probe>(
    addr: Option<SocketAddr>,
    shutdown: CancellationToken,
) -> std::io::Result<LateReadiness<P>> {
    let readiness = LateReadiness::default();
    if let Some(addr) = addr {
        let metrics = install_prometheus()
            .map_err(|e| std::io::Error::other(format!("installing the metrics recorder: {e}")))?;
        let server = OpsServer::bind(addr).await?;
        let slot = readiness.clone();
        server.spawn(
            metrics,
            move || {
                let slot = slot.clone();
                async move { slot.check().await }
            },
            shutdown,
        );
    }
    Ok(readiness)
}

async fn render_metrics(State(handle): State<PrometheusHandle>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}

fn readiness_response(report: Report) -> Response {
    let status = if report.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(report.to_json())).into_response()
}
