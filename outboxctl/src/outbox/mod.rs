//! Commands on `outbox_events`.

pub(crate) mod prune;
pub(crate) mod retry;
pub(crate) mod skip;
pub(crate) mod status;
pub(crate) mod stuck;
