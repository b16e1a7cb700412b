//! The OTLP span exporter of the binaries (feature `opentelemetry`):
//! OTLP/HTTP with protobuf bodies, sent by hyper's client, behind the SDK's
//! batch span processor.
//!
//! HTTP/protobuf rather than gRPC: the binaries compile hyper's client
//! already (axum, the Prometheus endpoint), while tonic would add its own
//! stack. The SDK's batch processor exports from a thread of its own, where
//! no tokio runtime runs; hyper's client needs one, so [`ExportClient`] owns
//! a single-threaded runtime that it drives for each export, as reqwest's
//! blocking client does. Exports thus never run on, or wait for, the
//! application's runtime, and the last ones can be flushed after it is gone.
//!
//! The endpoint must be `http://`: this client has no TLS. Export to a
//! collector or agent beside the service, which forwards over TLS.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

use crate::error::{Error, ErrorKind, Result};

/// Bound on one export, unless the environment sets one (the OTLP default).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on one export: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds), else [`EXPORT_TIMEOUT`].
fn export_timeout() -> Duration {
    [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .find_map(|var| std::env::var(var).ok()?.trim().parse().ok())
    .map_or(EXPORT_TIMEOUT, Duration::from_millis)
}

/// The only value of `OTEL_EXPORTER_OTLP_PROTOCOL` this exporter speaks.
const PROTOCOL: &str = "http/protobuf";

/// The URL spans are posted to: `endpoint` with the traces path, as the
/// OTLP specification derives it from `OTEL_EXPORTER_OTLP_ENDPOINT`.
pub(crate) fn traces_url(endpoint: &str) -> String {
    format!("{}/v1/traces", endpoint.trim_end_matches('/'))
}

/// A tracer provider exporting to `endpoint` in batches, for the service
/// `OTEL_SERVICE_NAME` names, else `service`.
pub(crate) fn tracer_provider(endpoint: &str, service: &str) -> Result<SdkTracerProvider> {
    let config = |message: String| Error::new(ErrorKind::Config, message);
    let scheme = endpoint.split_once("://").map(|(scheme, _)| scheme);
    if !scheme.is_some_and(|s| s.eq_ignore_ascii_case("http")) {
        return Err(config(format!(
            "OTLP endpoint `{}`: give an http:// URL (this exporter has no TLS: export to a \
             collector or agent beside the service, e.g. http://127.0.0.1:4318)",
            endpoint.escape_debug()
        )));
    }
    for var in [
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    ] {
        if let Ok(protocol) = std::env::var(var)
            && !protocol.is_empty()
            && protocol != PROTOCOL
        {
            return Err(config(format!(
                "{var}={}: this exporter speaks {PROTOCOL} only",
                protocol.escape_debug()
            )));
        }
    }
    let timeout = export_timeout();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(traces_url(endpoint))
        .with_timeout(timeout)
        .with_http_client(ExportClient::new(timeout)?)
        .build()
        .map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("cannot build the OTLP exporter: {e}"),
            )
            .with_source(e)
        })?;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|name| !name.trim().is_empty())
        .unwrap_or_else(|| service.to_owned());
    Ok(SdkTracerProvider::builder()
        .with_resource(Resource::builder().with_service_name(service).build())
        .with_batch_exporter(exporter)
        .build())
}

/// hyper's client on a runtime of its own (see the [module docs](self)).
#[derive(Debug)]
struct ExportClient {
    inner: HyperClient,
    /// `Some` until dropped.
    runtime: Option<tokio::runtime::Runtime>,
}

impl ExportClient {
    fn new(timeout: Duration) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .thread_name("otlp-export")
            .build()
            .map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("cannot start the OTLP exporter's runtime: {e}"),
                )
                .with_source(e)
            })?;
        let inner = {
            let _entered = runtime.enter();
            HyperClient::with_default_connector(timeout, None)
        };
        Ok(Self {
            inner,
            runtime: Some(runtime),
        })
    }

    fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let Some(runtime) = &self.runtime else {
            return Err("the OTLP exporter's runtime is stopped".into());
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Driving a runtime from inside another would panic; the batch
            // processor's own thread never runs one.
            return Err("an OTLP export ran on an async runtime's thread".into());
        }
        runtime.block_on(self.inner.send_bytes(request))
    }
}

// The trait is declared with `async_trait`; this is its expanded signature.
impl HttpClient for ExportClient {
    fn send_bytes<'life0, 'async_trait>(
        &'life0 self,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move { self.send(request) })
    }
}

impl Drop for ExportClient {
    fn drop(&mut self) {
        // Without waiting, and safe wherever the exporter is dropped.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use opentelemetry::trace::{Tracer, TracerProvider as _};

    use super::*;

    #[test]
    fn the_traces_path_is_appended_once() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/"),
            "http://collector:4318/v1/traces"
        );
    }

    #[test]
    fn only_plain_http_endpoints_are_taken() {
        for endpoint in ["https://collector:4318", "collector:4318", "grpc://x"] {
            let err = tracer_provider(endpoint, "tests").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config);
            assert!(err.to_string().contains("http://"), "{err}");
        }
    }

    /// A collector stand-in: answers one POST with 200 and hands back the
    /// request's head.
    fn collector() -> (String, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let served = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut request = Vec::new();
            let mut buf = [0; 4096];
            // The head, then the body its content-length announces.
            loop {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0, "connection closed before a request");
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request);
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap())
                        })
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        (url, served)
    }

    #[test]
    fn spans_are_posted_as_protobuf_when_the_provider_shuts_down() {
        let (url, served) = collector();
        let provider = tracer_provider(&url, "outbox-tests").unwrap();
        provider.tracer("tests").in_span("work", |_| {});
        provider.shutdown().unwrap();
        let request = served.join().unwrap();
        let head = request.to_ascii_lowercase();
        assert!(head.starts_with("post /v1/traces http/1.1"), "{request}");
        assert!(
            head.contains("content-type: application/x-protobuf"),
            "{request}"
        );
        assert!(request.contains("outbox-tests"), "the service name is sent");
        assert!(request.contains("work"), "the span is sent");
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_provider_built_and_shut_down_inside_an_async_runtime_exports() {
        let (url, served) = collector();
        let provider = tracer_provider(&url, "outbox-tests").unwrap();
        provider.tracer("tests").in_span("work", |_| {});
        tokio::task::spawn_blocking(move || provider.shutdown())
            .await
            .unwrap()
            .unwrap();
        let request = tokio::task::spawn_blocking(move || served.join().unwrap())
            .await
            .unwrap();
        assert!(request.contains("work"));
    }
}
