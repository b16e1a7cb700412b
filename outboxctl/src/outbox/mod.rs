//! Commands on `outbox_events`: what is waiting and why (`status`, `stuck`),
//! what an operator does about it (`retry`, `skip`, `prune`), and the
//! scheduled events (`schedule list | show | cancel`).
//!
//! The relay's lanes, as these commands name them (see
//! `outbox-publisher/src/relay/mod.rs`): a row not published and not skipped
//! is *fresh* (the main lane, `next_attempt_at` null: claimable now), *in
//! backoff* (failed, below the cap, due at `next_attempt_at`), *deferred*
//! (never failed, waiting behind a failed earlier row of its subject) or
//! *parked* (past the cap: `attempts >= --max-attempts`, or due at
//! `'infinity'`). A *skipped* row was abandoned by an operator: kept, never
//! published, passed over by the relay.
//!
//! A *scheduled* row (`due_at` set) is none of those while it waits for its
//! time: it sits in the relay's due lane, is not backlog, blocks nothing and
//! waits behind nothing; no command here makes it due before its time. Once
//! due it is backlog (*due*), and if its publish fails it is *in backoff* or
//! *parked* like any row (`stuck` lists it, `retry` and `skip` act on it). A
//! *cancelled* scheduled row is never published: kept as the record until
//! retention deletes it, counted apart, never backlog.

use uuid::Uuid;

use crate::error::{Error, ErrorKind, Result};

pub(crate) mod prune;
pub(crate) mod retry;
pub(crate) mod schedule;
pub(crate) mod skip;
pub(crate) mod status;
pub(crate) mod stuck;

/// The table every command here reads.
pub(crate) const TABLE: &str = "outbox_events";

/// `--max-attempts`, as the relay's.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Cap {
    /// The relay's attempt cap (its --max-attempts): a row with this many
    /// attempts is past the cap (parked).
    #[arg(
        long,
        env = "OUTBOX_MAX_ATTEMPTS",
        default_value_t = 20,
        value_parser = clap::value_parser!(i32).range(1..)
    )]
    pub(crate) max_attempts: i32,
}

/// A transaction for an operator's change (`retry`, `skip`), with the lock
/// and statement timeouts of `queries/session_timeouts.sql`, so it never
/// waits long on a row a relay holds while relays run.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn begin(
    pool: &sqlx::PgPool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool
        .begin()
        .await
        .map_err(|e| Error::database("starting the transaction", e))?;
    sqlx::query_file!("queries/session_timeouts.sql")
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Error::database("setting the transaction's timeouts", e))?;
    Ok(tx)
}

/// Parses event ids given on the command line, naming the first that is not
/// a UUID.
///
/// # Errors
/// [`ErrorKind::Config`].
pub(crate) fn parse_ids(ids: &[String]) -> Result<Vec<Uuid>> {
    ids.iter()
        .map(|s| {
            Uuid::parse_str(s.trim()).map_err(|_| {
                Error::new(
                    ErrorKind::Config,
                    format!("`{s}` is not an event id (a UUID such as 0191e2c4-6b1a-7c3e-9f00-1a2b3c4d5e6f)"),
                )
            })
        })
        .collect()
}

/// The operating system user running the command (`$USER`, else
/// `$LOGNAME`), if either is set.
pub(crate) fn os_user() -> Option<String> {
    ["USER", "LOGNAME"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .map(|u| u.trim().to_owned())
        .find(|u| !u.is_empty())
}

/// This host's name, or `unknown-host`.
pub(crate) fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned())
}

/// At most `max` characters of `s` on one line, with `…` when cut.
pub(crate) fn short(s: &str, max: usize) -> String {
    let line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() <= max {
        line
    } else {
        let mut out: String = line.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// Longest column value shown whole in text output, in characters.
const VALUE_LEN: usize = 80;

/// A column value (a subject, an event type) for text output: as it is, or,
/// past [`VALUE_LEN`] characters (a row any SQL client wrote may hold text of
/// any length), its beginning and its length in bytes. `--json` prints it whole.
pub(crate) fn shown(s: &str) -> String {
    if s.chars().count() <= VALUE_LEN {
        s.to_owned()
    } else {
        format!("{} ({} bytes)", short(s, VALUE_LEN), s.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_are_not_uuids_are_named() {
        let e = parse_ids(&["nope".into()]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("`nope`"), "{e}");
        let id = Uuid::now_v7();
        assert_eq!(parse_ids(&[id.to_string()]).unwrap(), vec![id]);
    }

    #[test]
    fn long_errors_are_cut_to_one_line() {
        assert_eq!(short("a\nb  c", 10), "a b c");
        assert_eq!(short("abcdefghij", 5), "abcd…");
    }

    #[test]
    fn long_values_are_shown_cut_with_their_length() {
        assert_eq!(shown("order-1"), "order-1");
        let long = "x".repeat(100_000);
        let s = shown(&long);
        assert!(s.ends_with("… (100000 bytes)") && s.len() < 120, "{s}");
    }
}
