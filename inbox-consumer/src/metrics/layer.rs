use tower::Layer;

use super::Metrics;

/// Applies [`Metrics`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MetricsLayer {
    _priv: (),
}

impl MetricsLayer {
    /// A metrics layer.
    pub const fn new() -> Self {
        Self { _priv: () }
    }
}

impl<S> Layer<S> for MetricsLayer {
    type Service = Metrics<S>;

    fn layer(&self, inner: S) -> Metrics<S> {
        Metrics::new(inner)
    }
}
