use tower::Layer;

use super::SkipStale;

/// Applies [`SkipStale`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SkipStaleLayer {
    _priv: (),
}

impl SkipStaleLayer {
    /// A stale-event filter.
    pub const fn new() -> Self {
        Self { _priv: () }
    }
}

impl<S> Layer<S> for SkipStaleLayer {
    type Service = SkipStale<S>;

    fn layer(&self, inner: S) -> SkipStale<S> {
        SkipStale::new(inner)
    }
}
