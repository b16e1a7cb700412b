//! The WAL source: the relay reads new outbox rows from PostgreSQL's logical
//! decoding instead of claiming them (`outbox-relay --source wal`,
//! [`RelayConfig::source_wal`](crate::RelayConfig::source_wal)).
//!
//! # What it does
//!
//! A logical replication slot with the built-in `pgoutput` plugin and a
//! publication of `outbox_events` for inserts only stream every committed
//! row to the relay in commit order: no claim, no horizon, no cursor. Rows are
//! published as the polling relay publishes them (the same validation, the
//! same message, per-subject chains in atomic batches where the stream
//! allows them, subjects side by side) and marked published in bulk with
//! their stream positions, so `outboxctl status`, the backlog metrics,
//! retention and the audit see no difference.
//!
//! # Order and the slot's position
//!
//! Rows of one subject arrive in commit order, which for a writer that
//! locks its entity row is change order. They are published through a
//! pipeline, not in windows: each subject has at most one chain of its rows
//! out at a time (in `seq` order, an atomic batch where the stream allows),
//! and up to `max_in_flight` subjects are out at once, so a subject waits
//! only for its own earlier rows. Published rows are marked in bulk beside
//! it. The slot's confirmed position moves only past transactions every row
//! of which, and every row read before, was published and marked (or
//! recorded as refused or deferred): a relay killed at any point reads again
//! from there, and the stream's duplicate window absorbs the repeats. A row
//! that fails goes to the retry lane, exactly as in the polling relay, and
//! every later row of its subject is deferred behind it
//! (`queries/wal_blockers.sql`), so a subject is never stored out of order
//! whatever fails. A broker fault costs no attempt: the subject's rows go
//! back to the front of its queue and are tried again, with backoff, until
//! they are published. How, step by step, is in the pipeline's module
//! (`wal/pipeline.rs`); the confirm rule itself is a pure type with its
//! proof and tests (`wal/watermark.rs`), as is each subject's
//! ready/sending/stalled state (`wal/subjects.rs`).
//!
//! # Beside the polling source
//!
//! The WAL source is a task of its own (`wal/source.rs`) that publishes
//! through the relay's engine, as the polling source does. It shares two
//! handles with the polling source: the end of the polling source's main
//! lane, closed while it leads and raised to the floor by each backfill,
//! and the wake-up that sends the polling workers to read up to it.
//!
//! # Never lost with the slot
//!
//! Rows stay in the table until marked, so the polling path can always
//! publish them. When the relay makes the slot (first start, or again: dropped
//! by an operator, invalidated by `max_slot_wal_keep_size`, missing after a
//! failover), it reads the highest `seq` handed out, `S`, *after* the slot
//! exists, lets the polling workers publish the main lane up to `S`, waits
//! until the horizon has passed `S` (no transaction can still commit a row at
//! or below it) and no fresh row at or below `S` is left, and only then
//! publishes from the WAL, skipping rows at or below `S`. Every row committed
//! before the slot's start has a seq at or below `S`; every row above `S`
//! commits after it and is decoded. So the backlog at first start and the
//! rows of a lost slot are published once each, in order.
//!
//! Once that backfill is done it is recorded beside the outbox
//! (`outbox_relay_slots`), so a relay that takes the lead of the intact slot
//! later (a restart, a deploy, a takeover from a killed leader) backfills
//! nothing: it reads on from the slot's confirmed position, at the WAL's
//! speed, passing over the rows streamed again that already have an outcome.
//! Why that loses and reorders nothing, kill -9 included, is argued in
//! `wal/backfill.rs`.
//!
//! The same backfill runs when a fresh row above `S` is found left behind
//! (the WAL source reads inserts only, so a row made fresh again by an update
//! is never in its stream): see `wal/monitor.rs`.
//!
//! # One reader per slot
//!
//! The relay that holds the session advisory lock of the slot leads (runs
//! the polling workers and the WAL reader); replicas stand by on the lock
//! and take over when the leader's session ends (a crash, kill -9, a cut
//! connection), within about a second.
//!
//! # The wire crate
//!
//! The replication protocol comes from `pgwire-replication` (MIT/Apache-2.0,
//! tokio, its own small pgwire implementation with SCRAM, no second SQL
//! client), without its TLS feature: that feature turns on rustls' default
//! crypto provider beside the one the rest of the tree uses, which leaves
//! rustls without a process default. So the replication connection does not
//! use TLS yet, and a URL that requires it (`sslmode=require`, `verify-*`) is
//! refused at start, never connected in the clear. It was chosen for two properties the relay relies on:
//! standby status updates keep flowing while the consumer of the stream is
//! slow (a walsender that hears nothing for `wal_sender_timeout` kills the
//! connection), and the confirmed position is only what the caller says it
//! applied. Begin and Commit are parsed by it; the two `pgoutput` messages
//! the relay needs (Relation, Insert) by `pgoutput`. The slot and the
//! publication are made with sqlx, on the relay's own pool.
//!
//! # Requirements
//!
//! `wal_level = logical`, a free replication slot, and a role with the
//! REPLICATION attribute (`alter role relay replication`); each is checked at
//! start and refused with a message naming it. The publication is created
//! if missing (it needs CREATE on the database and ownership of the table,
//! or create it once as the owner:
//! `create publication outbox_relay for table outbox_events with (publish = 'insert')`).

mod backfill;
mod monitor;
pub(crate) mod pgoutput;
mod pipeline;
pub(crate) mod row;
pub(crate) mod slot;
mod source;
mod subjects;
mod watermark;

use pgwire_replication::PgWireError;
use std::time::Duration;

pub(crate) use source::{WalReader, keep_lead, lead};

use crate::error::{Error, ErrorKind, Result};

/// Where and how the WAL source reads: the replication connection (a
/// PostgreSQL URL) and the slot's name.
#[derive(Clone)]
pub struct WalSource {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) user: String,
    pub(crate) password: String,
    pub(crate) database: String,
    pub(crate) tls: pgwire_replication::TlsConfig,
    pub(crate) slot: Option<String>,
}

impl std::fmt::Debug for WalSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalSource")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("database", &self.database)
            .field("tls", &self.tls.mode)
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl WalSource {
    /// The replication connection of a PostgreSQL URL
    /// (`postgres://user:password@host:port/database?sslmode=…`),
    /// the URL the relay's pool uses. Without a password in the URL,
    /// `PGPASSWORD` is used.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for a URL that is not a PostgreSQL URL, or an
    /// `sslmode` other than `disable`, `allow`, `prefer` (which connect
    /// without TLS): the replication connection does not use TLS yet, so
    /// `require`, `verify-ca` and `verify-full` are refused rather than
    /// connected in the clear (the message never shows the password).
    pub fn from_url(url: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::new(
                ErrorKind::Config,
                format!("the WAL source's database URL {why}"),
            )
        };
        let parsed = url::Url::parse(url).map_err(|e| bad(&format!("is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(bad("must start with postgres:// or postgresql://"));
        }
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|s| s.into_owned())
                .map_err(|_| bad("has a user or password that is not UTF-8"))
        };
        let mut host = parsed.host_str().unwrap_or("localhost").to_owned();
        let mut port = parsed.port().unwrap_or(5432);
        let user = match parsed.username() {
            "" => std::env::var("PGUSER").unwrap_or_else(|_| "postgres".to_owned()),
            u => decode(u)?,
        };
        let password = match parsed.password() {
            Some(p) => decode(p)?,
            None => std::env::var("PGPASSWORD").unwrap_or_default(),
        };
        let mut database = decode(parsed.path().trim_start_matches('/'))?;
        let mut mode = "prefer".to_owned();
        for (key, value) in parsed.query_pairs() {
            match key.as_ref() {
                "sslmode" => mode = value.into_owned(),
                "host" => host = value.into_owned(),
                "port" => {
                    port = value
                        .parse()
                        .map_err(|_| bad("has a port that is not a number"))?;
                }
                "dbname" => database = value.into_owned(),
                _ => {}
            }
        }
        if database.is_empty() {
            database.clone_from(&user);
        }
        let tls = match mode.as_str() {
            // `prefer` (sqlx's default) and `allow` connect without TLS.
            "disable" | "allow" | "prefer" => pgwire_replication::TlsConfig::disabled(),
            "require" | "verify-ca" | "verify-full" => {
                return Err(bad(&format!(
                    "has sslmode={mode}, and the WAL source's replication connection does not \
                     use TLS yet: run the relay with --source poll, or give the WAL source a \
                     URL with sslmode=disable on a network you trust"
                )));
            }
            other => {
                return Err(bad(&format!(
                    "has sslmode={other}; expected disable, allow, prefer, require, verify-ca or verify-full"
                )));
            }
        };
        Ok(Self {
            host,
            port,
            user,
            password,
            database,
            tls,
            slot: None,
        })
    }

    /// The replication slot's name (and the publication's). Default:
    /// `outbox_relay_<database>_<schema>` (letters, digits and `_`, cut to
    /// 63 characters with a hash), so outboxes of one cluster never share one.
    #[must_use]
    pub fn slot(mut self, name: impl Into<String>) -> Self {
        self.slot = Some(name.into());
        self
    }

    /// The replication session's settings for the slot `slot`.
    pub(crate) fn replication_config(&self, slot: &str) -> pgwire_replication::ReplicationConfig {
        pgwire_replication::ReplicationConfig::new(
            self.host.clone(),
            self.user.clone(),
            self.password.clone(),
            self.database.clone(),
            slot,
            slot,
        )
        .with_port(self.port)
        .with_tls(self.tls.clone())
        // Values as the claim reads them: UTC, ISO dates.
        .with_options("-c timezone=UTC -c datestyle=ISO,MDY -c extra_float_digits=3")
        .with_application_name("outbox-relay wal")
        .with_status_interval(Duration::from_secs(1))
        .with_wakeup_interval(Duration::from_secs(5))
    }
}

/// The default slot (and publication) name of the outbox in `schema` of
/// `database`: `outbox_relay_<database>_<schema>`, lower-case letters,
/// digits and `_` only, at most 63 characters (longer names are cut and end
/// with a hash of the whole).
pub(crate) fn default_slot_name(database: &str, schema: &str) -> String {
    let raw = format!("outbox_relay_{database}_{schema}");
    let clean: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if clean.len() <= 63 && clean == raw {
        return clean;
    }
    // Cut or changed: a hash of the exact names keeps two outboxes apart.
    let hash = raw.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let keep: String = clean.chars().take(46).collect();
    format!("{keep}_{hash:016x}")
}

/// Whether `name` is a valid slot name (lower-case letters, digits, `_`; 1–63).
pub(crate) fn valid_slot_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// A replication client's error as the relay's. A pooler refusing the
/// replication startup parameter (PgBouncer's `unsupported startup
/// parameter`) is a configuration error no retry passes, named with what to
/// do; so is a refused login.
pub(super) fn wal_error(doing: &str, e: &PgWireError) -> Error {
    match e {
        PgWireError::Auth(_) => Error::new(ErrorKind::Privilege, format!("{doing}: {e}")),
        PgWireError::Server(message) if message.contains("unsupported startup parameter") => {
            Error::new(
                ErrorKind::Config,
                format!(
                    "{doing}: {e}: the replication connection reached a pooler (PgBouncer does \
                     not carry the replication protocol); give the WAL source the server's own \
                     address (outbox-relay --wal-url / OUTBOX_WAL_URL)"
                ),
            )
        }
        _ => Error::new(ErrorKind::Database, format!("{doing}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_valid_and_keep_outboxes_apart() {
        assert_eq!(
            default_slot_name("app", "public"),
            "outbox_relay_app_public"
        );
        let a = default_slot_name("app", "Tenant-A");
        let b = default_slot_name("app", "tenant_a");
        assert_ne!(a, b);
        let long = default_slot_name(&"d".repeat(60), &"s".repeat(60));
        for name in [&a, &b, &long] {
            assert!(valid_slot_name(name), "{name}");
        }
        assert!(!valid_slot_name("Has-Caps"));
    }

    #[test]
    fn a_url_gives_the_replication_connection_and_debug_hides_the_password() {
        let w = WalSource::from_url("postgres://relay:p%2Cw@db.example:6543/app?sslmode=disable")
            .unwrap();
        assert_eq!(
            (
                w.host.as_str(),
                w.port,
                w.user.as_str(),
                w.password.as_str(),
                w.database.as_str()
            ),
            ("db.example", 6543, "relay", "p,w", "app")
        );
        assert!(!format!("{w:?}").contains("p,w"));
        let err = WalSource::from_url("postgres://u:secret@h/db?sslmode=bogus").unwrap_err();
        assert!(!err.to_string().contains("secret"), "{err}");
        let err = WalSource::from_url("postgres://u:secret@h/db?sslmode=verify-full").unwrap_err();
        assert!(err.to_string().contains("--source poll"), "{err}");
        assert!(WalSource::from_url("mysql://h/db").is_err());
    }
}
