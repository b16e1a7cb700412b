//! `outboxctl retry <id>… | --entity S | --all-stuck`: rows of the retry lane
//! become claimable now, with a fresh attempt budget.
//!
//! One short transaction, safe while relays run: every id named is checked
//! first (an unknown, published, skipped or cancelled id fails the command
//! naming it, and nothing changes), then one `update` sets `next_attempt_at =
//! now(), attempts = 0` on the rows that are unpublished, not skipped and in
//! the retry lane, or scheduled and fallen due. `last_error` is kept until the
//! relay publishes the row. A row in the main lane is claimable already: it is
//! reported, not changed. A scheduled row waiting for its time is reported
//! and not changed either: no retry makes a row due before its time. Row
//! locks are taken only by that update, bounded by `lock_timeout`.
//!
//! `--entity` takes the subject's immediate rows (the retry lane: its failing
//! or parked head and the rows deferred behind it); a scheduled row is outside
//! its entity's order: retry it by id, or with `--all-stuck` (which takes the
//! scheduled rows that fell due and failed, as `stuck` lists them).
//!
//! `--json` prints `{"retried": [ids], "already_claimable": n,
//! "already_claimable_ids": [ids], "not_yet_due": [{"id", "due_at"}]}`
//! (`already_claimable_ids` lists the ids named that were in the main lane;
//! with `--entity`, `already_claimable` counts the subject's main-lane rows;
//! `not_yet_due` lists the ids named that are scheduled rows waiting for
//! their time).

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{TABLE, parse_ids};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{Report, print};

/// Flags of `outboxctl retry`.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("rows").required(true).multiple(false).args(["ids", "entity", "all_stuck"])
))]
pub(crate) struct Args {
    /// Event ids to retry.
    #[arg(value_name = "ID")]
    ids: Vec<String>,

    /// Every row of this entity (envelope subject) in the retry lane: its
    /// failing or parked head and the rows deferred behind it.
    #[arg(long, value_name = "SUBJECT")]
    entity: Option<String>,

    /// Every row past the cap or failing.
    #[arg(long)]
    all_stuck: bool,
}

/// What `outboxctl retry` prints.
#[derive(Debug, Serialize)]
struct Retried {
    retried: Vec<Uuid>,
    already_claimable: i64,
    already_claimable_ids: Vec<Uuid>,
    not_yet_due: Vec<NotYetDue>,
}

/// A scheduled row named, waiting for its time: left as it is.
#[derive(Debug, Serialize, PartialEq)]
struct NotYetDue {
    id: Uuid,
    due_at: Option<DateTime<Utc>>,
}

/// The transaction `retry` runs in.
type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let ids = parse_ids(&args.ids)?;
    if let Some(entity) = &args.entity
        && entity.is_empty()
    {
        return Err(Error::new(ErrorKind::Config, "--entity needs a subject"));
    }
    let pool = db.connect(&[TABLE]).await?;
    let mut tx = super::begin(&pool).await?;
    let report = if let Some(entity) = &args.entity {
        retry_entity(&mut tx, entity).await?
    } else if args.all_stuck {
        retry_all_stuck(&mut tx).await?
    } else {
        retry_ids(&mut tx, &ids).await?
    };
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the retry", e))?;
    print(&report, json)
}

/// `--entity`: the subject's rows of the retry lane, and a count of its
/// main-lane rows.
async fn retry_entity(tx: &mut Tx, entity: &str) -> Result<Retried> {
    let retried = sqlx::query_file_scalar!("queries/retry_entity.sql", entity)
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| Error::database("retrying the entity's rows", e))?;
    let already_claimable = sqlx::query_file_scalar!("queries/retry_entity_main_lane.sql", entity)
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| Error::database("counting the entity's claimable rows", e))?;
    Ok(Retried {
        retried,
        already_claimable,
        already_claimable_ids: Vec::new(),
        not_yet_due: Vec::new(),
    })
}

/// `--all-stuck`: every row past the cap or failing.
async fn retry_all_stuck(tx: &mut Tx) -> Result<Retried> {
    let retried = sqlx::query_file_scalar!("queries/retry_all_stuck.sql")
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| Error::database("retrying the stuck rows", e))?;
    Ok(Retried {
        retried,
        already_claimable: 0,
        already_claimable_ids: Vec::new(),
        not_yet_due: Vec::new(),
    })
}

/// One row named on the command line, as found.
#[derive(Debug, Clone)]
struct Found {
    id: Uuid,
    published_at: Option<DateTime<Utc>>,
    skipped_at: Option<DateTime<Utc>>,
    skipped_by: Option<String>,
    cancelled_at: Option<DateTime<Utc>>,
    cancelled_by: Option<String>,
    main_lane: bool,
    /// Scheduled, not due yet, not taken by a relay.
    waiting: bool,
    waiting_until: Option<DateTime<Utc>>,
}

/// The rows named: each checked first, then those of the retry lane retried.
async fn retry_ids(tx: &mut Tx, ids: &[Uuid]) -> Result<Retried> {
    let found: Vec<Found> = sqlx::query_file_as!(Found, "queries/retry_lookup.sql", ids)
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| Error::database("reading the rows", e))?;
    check_retryable(ids, &found)?;
    let claimable = main_lane_ids(&found);
    let retried = sqlx::query_file_scalar!("queries/retry_ids.sql", ids)
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| Error::database("retrying the rows", e))?;
    Ok(Retried {
        retried,
        already_claimable: claimable.len() as i64,
        already_claimable_ids: claimable,
        not_yet_due: not_yet_due(&found),
    })
}

/// Refuses the retry, naming the row, if an id is unknown, or a row was
/// skipped, published or cancelled.
fn check_retryable(ids: &[Uuid], found: &[Found]) -> Result<()> {
    let unknown: Vec<String> = ids
        .iter()
        .filter(|id| !found.iter().any(|r| r.id == **id))
        .map(Uuid::to_string)
        .collect();
    if !unknown.is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "no outbox row with id {}; nothing was changed",
                unknown.join(", ")
            ),
        ));
    }
    for r in found {
        if let Some(skipped_at) = &r.skipped_at {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "row {} was skipped at {} by {}: a skipped row is not retried; nothing was changed",
                    r.id,
                    when(Some(*skipped_at)),
                    r.skipped_by.as_deref().unwrap_or("an unknown operator")
                ),
            ));
        }
        if let Some(published_at) = &r.published_at {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "row {} was published at {}: nothing to retry; nothing was changed",
                    r.id,
                    when(Some(*published_at))
                ),
            ));
        }
        if let Some(cancelled_at) = &r.cancelled_at {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "row {} was cancelled at {} by {}: a cancelled row is never published; nothing was changed",
                    r.id,
                    when(Some(*cancelled_at)),
                    r.cancelled_by.as_deref().unwrap_or("an unknown canceller")
                ),
            ));
        }
    }
    Ok(())
}

/// The scheduled rows found waiting for their time, each once, sorted.
fn not_yet_due(found: &[Found]) -> Vec<NotYetDue> {
    let mut waiting: Vec<NotYetDue> = found
        .iter()
        .filter(|r| r.waiting)
        .map(|r| NotYetDue {
            id: r.id,
            due_at: r.waiting_until,
        })
        .collect();
    waiting.sort_unstable_by_key(|w| w.id);
    waiting.dedup_by_key(|w| w.id);
    waiting
}

/// The rows found in the main lane (claimable already), each once, sorted.
fn main_lane_ids(found: &[Found]) -> Vec<Uuid> {
    let mut claimable: Vec<Uuid> = found.iter().filter(|r| r.main_lane).map(|r| r.id).collect();
    claimable.sort_unstable();
    claimable.dedup();
    claimable
}

impl Report for Retried {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "{} row{} claimable again now",
            self.retried.len(),
            if self.retried.len() == 1 { "" } else { "s" }
        )?;
        for id in &self.retried {
            writeln!(out, "  {id}")?;
        }
        if !self.already_claimable_ids.is_empty() {
            writeln!(
                out,
                "already claimable (in the main lane), left as they are:"
            )?;
            for id in &self.already_claimable_ids {
                writeln!(out, "  {id}")?;
            }
        } else if self.already_claimable > 0 {
            writeln!(
                out,
                "{} more row{} of the entity already claimable (in the main lane)",
                self.already_claimable,
                if self.already_claimable == 1 { "" } else { "s" }
            )?;
        }
        if !self.not_yet_due.is_empty() {
            writeln!(
                out,
                "scheduled, not due yet, left as they are (a retry never makes a row due before its time):"
            )?;
            for w in &self.not_yet_due {
                writeln!(out, "  {}  due {}", w.id, when(w.due_at))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(n: u128, main_lane: bool) -> Found {
        Found {
            id: Uuid::from_u128(n),
            published_at: None,
            skipped_at: None,
            skipped_by: None,
            cancelled_at: None,
            cancelled_by: None,
            main_lane,
            waiting: false,
            waiting_until: None,
        }
    }

    #[test]
    fn an_unknown_id_is_named() {
        let ids = [Uuid::from_u128(1), Uuid::from_u128(2)];
        let err = check_retryable(&ids, &[found(1, false)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
        assert!(err.to_string().contains(&Uuid::from_u128(2).to_string()));
        assert!(check_retryable(&ids, &[found(1, false), found(2, true)]).is_ok());
    }

    #[test]
    fn a_skipped_or_published_row_is_refused() {
        let ids = [Uuid::from_u128(1)];
        let mut row = found(1, false);
        row.published_at = Some(Utc::now());
        let err = check_retryable(&ids, &[row]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidState);
        assert!(err.to_string().contains("was published at"));
        let mut row = found(1, false);
        row.skipped_at = Some(Utc::now());
        let err = check_retryable(&ids, &[row]).unwrap_err();
        assert!(err.to_string().contains("by an unknown operator"), "{err}");
        let mut row = found(1, false);
        row.cancelled_at = Some(Utc::now());
        row.cancelled_by = Some("outboxctl:alice@ops".into());
        let err = check_retryable(&ids, &[row]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidState);
        assert!(err.to_string().contains("alice@ops"), "{err}");
    }

    #[test]
    fn scheduled_rows_waiting_are_listed_once() {
        let mut waiting = found(2, false);
        waiting.waiting = true;
        let rows = [waiting.clone(), found(1, false), waiting];
        assert_eq!(
            not_yet_due(&rows),
            [NotYetDue {
                id: Uuid::from_u128(2),
                due_at: None
            }]
        );
    }

    #[test]
    fn main_lane_ids_are_sorted_and_distinct() {
        let rows = [
            found(3, true),
            found(1, true),
            found(2, false),
            found(3, true),
        ];
        assert_eq!(
            main_lane_ids(&rows),
            [Uuid::from_u128(1), Uuid::from_u128(3)]
        );
    }
}
