//! `outboxctl schedule list | show | cancel`: the scheduled events of the
//! outbox (rows with a due time, written by `outbox_pg::Outbox::schedule` or
//! by SQL setting `due_at`), and cancelling them.
//!
//! A scheduled row waits in the relay's *due lane* (`outbox_events_due_idx`)
//! until its due time, by the database's clock; then a relay takes it
//! (`released_at`) and publishes it. Where a row is, in words ([`State`]):
//!
//! - `waiting`: not due yet; a cancel keeps it from ever being published;
//! - `due`: fallen due, not taken by a relay yet (none runs, or it is
//!   behind); a cancel still wins;
//! - `publishing`: taken by a relay, being published: a cancel is too late;
//! - `backoff`: fallen due, and its publish failed: tried again at
//!   `next_attempt_at` (`outboxctl stuck` lists it);
//! - `parked`: fallen due, past the attempt cap: left alone until retried or
//!   skipped (`outboxctl stuck` lists it);
//! - `published`, `cancelled` (never published; kept as the record until
//!   retention deletes it), `skipped` (abandoned by an operator), and
//!   `not_scheduled` (an immediate event, or one whose due time was not after
//!   its insert).

mod cancel;
mod list;
mod show;

use serde::Serialize;

use crate::db::Database;
use crate::error::Result;
use crate::output::age;

/// `outboxctl schedule …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Scheduled rows not published, cancelled or skipped, next due first:
    /// due time, how long until it (or how late), attempts and last error.
    List(list::Args),
    /// One row: every column of its schedule, and where it is, in words.
    Show(show::Args),
    /// Cancel scheduled rows no relay has taken yet: each is then never
    /// published. Exit status 1 if any id was not cancelled.
    Cancel(cancel::Args),
}

/// Runs `command`; `Ok(false)` when it did its work and found some of it
/// refused (a cancel that came too late, an unknown id), so the exit status
/// is 1.
pub(crate) async fn run(db: &Database, command: &Command, json: bool) -> Result<bool> {
    match command {
        Command::List(args) => list::run(db, args, json).await.map(|()| true),
        Command::Show(args) => show::run(db, args, json).await.map(|()| true),
        Command::Cancel(args) => cancel::run(db, args, json).await,
    }
}

/// Where a row is in its schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum State {
    /// Not due yet.
    Waiting,
    /// Fallen due, not taken by a relay yet.
    Due,
    /// Taken by a relay: being published (at least once).
    Publishing,
    /// Fallen due; its publish failed; tried again later.
    Backoff,
    /// Fallen due; past the attempt cap.
    Parked,
    /// Published.
    Published,
    /// Cancelled before a relay took it: never published.
    Cancelled,
    /// Abandoned by an operator (`outboxctl skip`).
    Skipped,
    /// No due time: an immediate event.
    NotScheduled,
}

/// What a row's columns say, compared with the database's clock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Facts {
    /// `due_at` is set.
    pub(crate) scheduled: bool,
    /// `due_at <= now()`.
    pub(crate) fallen_due: bool,
    /// `released_at` is set: a relay took it.
    pub(crate) released: bool,
    pub(crate) cancelled: bool,
    pub(crate) published: bool,
    pub(crate) skipped: bool,
    /// Past the cap: `attempts >= --max-attempts`, or due at `'infinity'`.
    pub(crate) parked: bool,
    pub(crate) attempts: i32,
    /// `next_attempt_at > now()`.
    pub(crate) retry_later: bool,
}

impl State {
    /// The state `facts` describe.
    pub(crate) fn of(f: Facts) -> Self {
        if !f.scheduled {
            Self::NotScheduled
        } else if f.published {
            Self::Published
        } else if f.cancelled {
            Self::Cancelled
        } else if f.skipped {
            Self::Skipped
        } else if !f.fallen_due && !f.released {
            Self::Waiting
        } else if f.parked {
            Self::Parked
        } else if f.attempts > 0 || f.retry_later {
            Self::Backoff
        } else if f.released {
            Self::Publishing
        } else {
            Self::Due
        }
    }

    /// The state's name, as `--json` prints it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Due => "due",
            Self::Publishing => "publishing",
            Self::Backoff => "backoff",
            Self::Parked => "parked",
            Self::Published => "published",
            Self::Cancelled => "cancelled",
            Self::Skipped => "skipped",
            Self::NotScheduled => "not_scheduled",
        }
    }
}

/// Seconds from now (negative: ago) as people read them: `in 4m 3s`,
/// `2m 5s late`; `-` when unknown.
pub(crate) fn from_now(secs: Option<f64>, past: &str) -> String {
    match secs {
        Some(s) if s >= 0.0 => format!("in {}", age(s)),
        Some(s) if s.is_finite() => format!("{} {past}", age(-s)),
        _ => "-".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduled() -> Facts {
        Facts {
            scheduled: true,
            ..Facts::default()
        }
    }

    #[test]
    fn a_row_not_due_yet_is_waiting_and_once_due_is_due() {
        assert_eq!(State::of(scheduled()), State::Waiting);
        let due = Facts {
            fallen_due: true,
            ..scheduled()
        };
        assert_eq!(State::of(due), State::Due);
        let taken = Facts {
            released: true,
            ..due
        };
        assert_eq!(State::of(taken), State::Publishing);
    }

    #[test]
    fn a_failed_row_is_in_backoff_or_parked() {
        let failed = Facts {
            fallen_due: true,
            released: true,
            attempts: 2,
            retry_later: true,
            ..scheduled()
        };
        assert_eq!(State::of(failed), State::Backoff);
        let uncounted = Facts {
            attempts: 0,
            ..failed
        };
        assert_eq!(State::of(uncounted), State::Backoff);
        let parked = Facts {
            parked: true,
            ..failed
        };
        assert_eq!(State::of(parked), State::Parked);
    }

    #[test]
    fn published_cancelled_skipped_and_immediate_rows_say_so() {
        let published = Facts {
            published: true,
            released: true,
            fallen_due: true,
            ..scheduled()
        };
        assert_eq!(State::of(published), State::Published);
        let cancelled = Facts {
            cancelled: true,
            ..scheduled()
        };
        assert_eq!(State::of(cancelled), State::Cancelled);
        let skipped = Facts {
            skipped: true,
            parked: true,
            ..scheduled()
        };
        assert_eq!(State::of(skipped), State::Skipped);
        let immediate = Facts {
            published: true,
            ..Facts::default()
        };
        assert_eq!(State::of(immediate), State::NotScheduled);
        assert_eq!(State::NotScheduled.as_str(), "not_scheduled");
    }

    #[test]
    fn times_from_now_read_both_ways() {
        assert_eq!(from_now(Some(125.0), "late"), "in 2m 5s");
        assert_eq!(from_now(Some(-3.0), "late"), "3.0s late");
        assert_eq!(from_now(None, "late"), "-");
    }
}
