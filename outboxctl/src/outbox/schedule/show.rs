//! `outboxctl schedule show <id>`: one row of the outbox, every column that
//! says where it is in its schedule, and that place in words. An id no row
//! has is an error (exit status 1, kind `not_found`); an immediate event is
//! shown, as `not_scheduled`.
//!
//! `--json` prints `{"id", "event_type", "source", "subject", "state",
//! "description", "created_at", "due_at", "due_in_secs", "released_at",
//! "cancelled_at", "cancelled_by", "published_at", "published_stream",
//! "published_seq", "attempts", "last_error", "next_attempt_at",
//! "next_in_secs", "locked_until", "skipped_at", "skipped_by",
//! "skip_reason"}`: `state` as `schedule list` names it, or `published`,
//! `cancelled`, `skipped`, `not_scheduled`; `description` says the same for
//! people.

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{Facts, State, from_now};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::outbox::{Cap, TABLE, parse_ids};
use crate::output::{Report, print, table, when};

/// Flags of `outboxctl schedule show`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    cap: Cap,

    /// The event id of the row.
    #[arg(value_name = "ID")]
    id: String,
}

/// What `outboxctl schedule show` prints.
#[derive(Debug, Serialize)]
struct Show {
    id: Uuid,
    event_type: String,
    source: String,
    subject: String,
    state: State,
    description: String,
    created_at: Option<DateTime<Utc>>,
    due_at: Option<DateTime<Utc>>,
    due_in_secs: Option<f64>,
    released_at: Option<DateTime<Utc>>,
    cancelled_at: Option<DateTime<Utc>>,
    cancelled_by: Option<String>,
    published_at: Option<DateTime<Utc>>,
    published_stream: Option<String>,
    published_seq: Option<i64>,
    attempts: i32,
    last_error: Option<String>,
    next_attempt_at: Option<DateTime<Utc>>,
    next_in_secs: Option<f64>,
    locked_until: Option<DateTime<Utc>>,
    skipped_at: Option<DateTime<Utc>>,
    skipped_by: Option<String>,
    skip_reason: Option<String>,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let id = parse_ids(std::slice::from_ref(&args.id))?
        .into_iter()
        .next()
        .ok_or_else(|| Error::new(ErrorKind::Config, "no event id given"))?;
    let pool = db.connect(&[TABLE]).await?;
    let r = sqlx::query_file!("queries/schedule_show.sql", id, args.cap.max_attempts)
        .fetch_optional(&pool)
        .await
        .map_err(|e| Error::database("reading the row", e))?
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no outbox row with id {id}")))?;
    let state = State::of(Facts {
        scheduled: r.scheduled,
        fallen_due: r.fallen_due,
        released: r.released,
        cancelled: r.cancelled,
        published: r.published,
        skipped: r.skipped,
        parked: r.parked,
        attempts: r.attempts,
        retry_later: r.next_in_secs.is_some_and(|s| s > 0.0),
    });
    let mut show = Show {
        id: r.id,
        event_type: r.event_type,
        source: r.source,
        subject: r.subject,
        state,
        description: String::new(),
        created_at: r.created_at,
        due_at: r.due_at,
        due_in_secs: r.due_in_secs,
        released_at: r.released_at,
        cancelled_at: r.cancelled_at,
        cancelled_by: r.cancelled_by,
        published_at: r.published_at,
        published_stream: r.published_stream,
        published_seq: r.published_seq,
        attempts: r.attempts,
        last_error: r.last_error,
        next_attempt_at: r.next_attempt_at,
        next_in_secs: r.next_in_secs,
        locked_until: r.locked_until,
        skipped_at: r.skipped_at,
        skipped_by: r.skipped_by,
        skip_reason: r.skip_reason,
    };
    show.description = show.describe();
    print(&show, json)
}

impl Show {
    /// The state in a sentence.
    fn describe(&self) -> String {
        match self.state {
            State::Waiting => format!(
                "waiting: due {}; a cancel keeps it from being published",
                from_now(self.due_in_secs, "ago")
            ),
            State::Due => format!(
                "due: fell due {}, not taken by a relay yet; a cancel still keeps it from being published",
                from_now(self.due_in_secs, "ago")
            ),
            State::Publishing => format!(
                "being published: taken by a relay at {}; too late to cancel",
                when(self.released_at)
            ),
            State::Backoff => format!(
                "failing: {} attempt{}, tried again {}; too late to cancel",
                self.attempts,
                if self.attempts == 1 { "" } else { "s" },
                from_now(self.next_in_secs, "ago")
            ),
            State::Parked => "parked: past the attempt cap, left alone until `outboxctl retry` \
                              or `skip`; too late to cancel"
                .to_owned(),
            State::Published => format!("published at {}", when(self.published_at)),
            State::Cancelled => format!(
                "cancelled at {} by {}: never published; kept as the record until retention",
                when(self.cancelled_at),
                self.cancelled_by.as_deref().unwrap_or("-")
            ),
            State::Skipped => format!(
                "skipped at {} by {}: never published",
                when(self.skipped_at),
                self.skipped_by.as_deref().unwrap_or("-")
            ),
            State::NotScheduled => "not scheduled: an immediate event (no due time)".to_owned(),
        }
    }
}

/// A cell for an optional value.
fn cell<T: ToString>(value: Option<&T>) -> String {
    value.map_or_else(|| "-".to_owned(), ToString::to_string)
}

impl Report for Show {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let rows: Vec<Vec<String>> = [
            ("id", self.id.to_string()),
            ("state", self.state.as_str().to_owned()),
            ("type", self.event_type.clone()),
            ("source", self.source.clone()),
            ("subject", self.subject.clone()),
            ("created", when(self.created_at)),
            ("due", when(self.due_at)),
            ("released", when(self.released_at)),
            ("cancelled", when(self.cancelled_at)),
            ("cancelled by", cell(self.cancelled_by.as_ref())),
            ("published", when(self.published_at)),
            ("stream", cell(self.published_stream.as_ref())),
            ("stream sequence", cell(self.published_seq.as_ref())),
            ("attempts", self.attempts.to_string()),
            ("next attempt", when(self.next_attempt_at)),
            ("leased until", when(self.locked_until)),
            ("skipped", when(self.skipped_at)),
            ("skipped by", cell(self.skipped_by.as_ref())),
            ("skip reason", cell(self.skip_reason.as_ref())),
        ]
        .into_iter()
        .map(|(k, v)| vec![format!("{k}:"), v])
        .collect();
        table(out, &rows)?;
        writeln!(
            out,
            "last error: {}",
            self.last_error.as_deref().unwrap_or("-")
        )?;
        writeln!(out, "{}", self.description)
    }
}
