use tower::Layer;

use super::Trace;

/// Applies [`Trace`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer {
    _priv: (),
}

impl TraceLayer {
    /// A tracing layer.
    pub const fn new() -> Self {
        Self { _priv: () }
    }
}

impl<S> Layer<S> for TraceLayer {
    type Service = Trace<S>;

    fn layer(&self, inner: S) -> Trace<S> {
        Trace::new(inner)
    }
}
