//! The durability in force, stated at start: one line with the stream's
//! replicas and storage, its duplicate window against the relay's republish
//! horizon, and the audit; a warning per setting that can lose (or double)
//! acknowledged events, or a refusal with
//! [`RelayConfig::require_durable`](crate::RelayConfig::require_durable).

use async_nats::jetstream::stream::{Config, StorageType};
use outbox_pg::HumanDuration;
use tracing::{info, warn};

use crate::audit::Audit;
use crate::config::RelayConfig;
use crate::error::{Error, ErrorKind, Result};

/// Logs the durability of `stream` under `config` and returns the audit to
/// run, if any (`None`: off by config, or the stream cannot be audited).
///
/// # Errors
/// [`ErrorKind::Config`] for a duplicate window not longer than the
/// republish horizon (always), and with `require_durable`, naming every
/// setting that can lose acknowledged events.
pub(crate) fn state(stream: &Config, config: &RelayConfig, audit: Audit) -> Result<Option<Audit>> {
    let republish = config.republish_horizon();
    let settle = audit.settle_age();
    let audit_off = audit_off(config, &audit);
    info!(
        stream = %stream.name,
        replicas = stream.num_replicas,
        storage = ?stream.storage,
        duplicate_window = ?stream.duplicate_window,
        republish_horizon = ?republish,
        audit_horizon = ?config.audit_horizon.filter(|_| audit_off.is_none()),
        audit_from_age = ?settle,
        audit_interval = ?config.audit_interval,
        require_durable = config.require_durable,
        "durability: stream replicas, storage and duplicate window; the relay's republish horizon (lease + publish timeout) and its audit"
    );
    let mut refused = risks(stream);
    if stream.duplicate_window <= republish {
        // Refused whatever the configuration: a republish must be deduplicated.
        warn!(
            stream = %stream.name,
            duplicate_window = ?stream.duplicate_window,
            republish_horizon = ?republish,
            "durability: the duplicate window is not longer than the republish horizon: a republish after a lost mark would be stored twice"
        );
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "stream `{}` has a duplicate window of {}, which must be longer than the lease plus the publish timeout ({}): a republish after a takeover would be stored twice",
                stream.name,
                HumanDuration(stream.duplicate_window),
                HumanDuration(republish)
            ),
        ));
    }
    if let Some(off) = &audit_off {
        warn!(
            stream = %stream.name,
            "durability: {off}: a message the stream loses after acknowledging it is never published again"
        );
        refused.push(off.clone());
    }
    if config.require_durable && !refused.is_empty() {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "refusing to start (require durable): {}",
                refused.join("; ")
            ),
        ));
    }
    Ok(audit_off.is_none().then_some(audit))
}

/// Whether the audit is off, and why: by config, the stream cannot be
/// audited, or its horizon is too short for any row to be old enough.
fn audit_off(config: &RelayConfig, audit: &Audit) -> Option<String> {
    let settle = audit.settle_age();
    match (config.audit_horizon, audit.unauditable()) {
        (None, _) => Some("the audit is off (audit horizon 0)".to_owned()),
        (Some(_), Some(why)) => Some(format!("the audit is off: {why}")),
        (Some(h), None) if h <= settle => Some(format!(
            "the audit is off: its horizon {} is not longer than the duplicate window plus margin {}, so no row is ever old enough to audit",
            HumanDuration(h),
            HumanDuration(settle),
        )),
        (Some(_), None) => None,
    }
}

/// The stream's settings that can lose acknowledged messages (one replica,
/// memory storage), each warned on; what `require_durable` refuses.
fn risks(stream: &Config) -> Vec<String> {
    let mut refused = Vec::new();
    if stream.num_replicas <= 1 {
        warn!(
            stream = %stream.name,
            replicas = stream.num_replicas,
            "durability: the stream has 1 replica: an unsynced crash of its server loses messages it acknowledged (the audit republishes them); run 3 replicas in production"
        );
        refused.push(format!(
            "stream `{}` has {} replica (3 are needed so that one server's crash loses no acknowledged message)",
            stream.name, stream.num_replicas
        ));
    }
    if stream.storage == StorageType::Memory {
        warn!(
            stream = %stream.name,
            "durability: the stream keeps messages in memory: a restart of its servers loses them"
        );
        refused.push(format!(
            "stream `{}` has memory storage (a restart loses its messages)",
            stream.name
        ));
    }
    refused
}
