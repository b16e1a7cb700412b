//! The counts of `outboxctl status`: unpublished rows by state, per event
//! type and in total, with the scheduled rows apart from the backlog, and
//! the rows published in the last hour.

use std::collections::BTreeMap;
use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::outbox::shown;
use crate::output::{age, table, when};

/// Counts of one event type, or of all.
#[derive(Debug, Default, Serialize)]
pub(super) struct Counts {
    /// The backlog: rows to be published now or after a failure (fresh, due,
    /// in backoff, deferred, parked). Not scheduled rows waiting for their
    /// time, cancelled rows or skipped rows.
    pub(super) unpublished: i64,
    /// In the main lane, claimable now.
    pub(super) fresh: i64,
    /// Scheduled rows fallen due, never failed: claimable now by the due lane.
    pub(super) due: i64,
    /// Failed, below the cap, waiting for the next attempt.
    pub(super) in_backoff: i64,
    /// Never failed, waiting behind a failed earlier row of the subject.
    pub(super) deferred: i64,
    /// Past the cap: left alone until retried or skipped.
    pub(super) parked: i64,
    /// Abandoned by an operator (kept, never published).
    pub(super) skipped: i64,
    /// Scheduled rows waiting for their time: not backlog.
    pub(super) scheduled: i64,
    /// The earliest due time of those.
    pub(super) next_due_at: Option<DateTime<Utc>>,
    /// Seconds from now to it, by the database's clock.
    pub(super) next_due_in_secs: Option<f64>,
    /// Scheduled rows cancelled: never published, kept as the record until
    /// retention deletes them; not backlog.
    pub(super) cancelled: i64,
    /// Age of the oldest row in the backlog, in seconds (since its insert, or
    /// a scheduled row's due time).
    pub(super) oldest_unpublished_age_secs: Option<f64>,
    /// Rows published in the last hour.
    pub(super) published_last_hour: i64,
}

/// The smaller of two optional values, either when one is missing.
fn least<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b < a { b } else { a }),
        (a, b) => a.or(b),
    }
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.unpublished += other.unpublished;
        self.fresh += other.fresh;
        self.due += other.due;
        self.in_backoff += other.in_backoff;
        self.deferred += other.deferred;
        self.parked += other.parked;
        self.skipped += other.skipped;
        self.scheduled += other.scheduled;
        self.cancelled += other.cancelled;
        self.published_last_hour += other.published_last_hour;
        self.next_due_at = least(self.next_due_at, other.next_due_at);
        self.next_due_in_secs = least(self.next_due_in_secs, other.next_due_in_secs);
        self.oldest_unpublished_age_secs = match (
            self.oldest_unpublished_age_secs,
            other.oldest_unpublished_age_secs,
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// One event type's counts.
#[derive(Debug, Serialize)]
pub(super) struct TypeCounts {
    pub(super) event_type: String,
    #[serde(flatten)]
    pub(super) counts: Counts,
}

/// The counts of each event type: its unpublished rows by state (`cap`
/// parks), and its rows published in the last hour.
///
/// # Errors
/// [`ErrorKind::Database`](crate::error::ErrorKind::Database).
pub(super) async fn event_types(pool: &PgPool, cap: i32) -> Result<BTreeMap<String, Counts>> {
    let unpublished = sqlx::query_file!("queries/status_types.sql", cap)
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("counting unpublished rows", e))?;
    let published = sqlx::query_file!("queries/status_published.sql")
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("counting rows published in the last hour", e))?;
    let mut types: BTreeMap<String, Counts> = BTreeMap::new();
    for r in unpublished {
        let c = types.entry(r.event_type).or_default();
        c.unpublished = r.unpublished;
        c.fresh = r.fresh;
        c.due = r.due;
        c.in_backoff = r.in_backoff;
        c.deferred = r.deferred;
        c.parked = r.parked;
        c.skipped = r.skipped;
        c.scheduled = r.scheduled;
        c.next_due_at = r.next_due_at;
        c.next_due_in_secs = r.next_due_in_secs;
        c.cancelled = r.cancelled;
        c.oldest_unpublished_age_secs = r.oldest_age_secs.map(|s| s.max(0.0));
    }
    for r in published {
        types.entry(r.event_type).or_default().published_last_hour = r.published;
    }
    Ok(types)
}

/// The counts of all event types together.
pub(super) fn totals<'a>(types: impl IntoIterator<Item = &'a Counts>) -> Counts {
    let mut totals = Counts::default();
    for c in types {
        totals.add(c);
    }
    totals
}

fn count_cell(n: i64) -> String {
    if n == 0 {
        "-".to_owned()
    } else {
        n.to_string()
    }
}

fn oldest(c: &Counts) -> String {
    c.oldest_unpublished_age_secs
        .map_or_else(|| "-".to_owned(), age)
}

/// The backlog's totals, the scheduled rows', the last hour's, and a table
/// of event types.
pub(super) fn write(
    out: &mut dyn Write,
    t: &Counts,
    types: &[TypeCounts],
    cap: i32,
) -> std::io::Result<()> {
    writeln!(
        out,
        "backlog: {} unpublished (oldest {}): {} fresh, {} due, {} in backoff, {} deferred, {} parked (cap {cap}); {} skipped",
        t.unpublished,
        oldest(t),
        t.fresh,
        t.due,
        t.in_backoff,
        t.deferred,
        t.parked,
        t.skipped
    )?;
    write_scheduled(out, t)?;
    writeln!(out, "published in the last hour: {}", t.published_last_hour)?;
    if types.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    let mut rows = vec![
        [
            "event type",
            "unpublished",
            "oldest",
            "due",
            "backoff",
            "deferred",
            "parked",
            "skipped",
            "scheduled",
            "cancelled",
            "published/1h",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for e in types {
        let c = &e.counts;
        rows.push(vec![
            shown(&e.event_type),
            count_cell(c.unpublished),
            oldest(c),
            count_cell(c.due),
            count_cell(c.in_backoff),
            count_cell(c.deferred),
            count_cell(c.parked),
            count_cell(c.skipped),
            count_cell(c.scheduled),
            count_cell(c.cancelled),
            count_cell(c.published_last_hour),
        ]);
    }
    table(out, &rows)
}

/// The scheduled rows waiting (and the next due time), and the cancelled
/// ones kept.
fn write_scheduled(out: &mut dyn Write, t: &Counts) -> std::io::Result<()> {
    let next = match (t.next_due_in_secs, t.next_due_at) {
        (Some(secs), at) if t.scheduled > 0 => {
            format!(" (next due in {}, at {})", age(secs.max(0.0)), when(at))
        }
        _ => String::new(),
    };
    writeln!(
        out,
        "scheduled: {} not yet due{next}; {} cancelled (kept as the record until retention)",
        t.scheduled, t.cancelled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_the_counts_and_keep_the_oldest_age_and_the_next_due() {
        let soon = Utc::now();
        let a = Counts {
            unpublished: 2,
            parked: 1,
            oldest_unpublished_age_secs: Some(5.0),
            scheduled: 3,
            next_due_at: Some(soon + chrono::Duration::minutes(5)),
            next_due_in_secs: Some(300.0),
            ..Counts::default()
        };
        let b = Counts {
            unpublished: 3,
            due: 1,
            published_last_hour: 7,
            scheduled: 1,
            next_due_at: Some(soon),
            next_due_in_secs: Some(1.0),
            cancelled: 2,
            ..Counts::default()
        };
        let t = totals([&a, &b]);
        assert_eq!((t.unpublished, t.parked, t.published_last_hour), (5, 1, 7));
        assert_eq!((t.due, t.scheduled, t.cancelled), (1, 4, 2));
        assert_eq!(t.oldest_unpublished_age_secs, Some(5.0));
        assert_eq!(t.next_due_at, Some(soon));
        assert_eq!(t.next_due_in_secs, Some(1.0));
    }

    #[test]
    fn scheduled_rows_read_apart_from_the_backlog() {
        let t = Counts {
            scheduled: 1000,
            next_due_in_secs: Some(125.0),
            cancelled: 1,
            ..Counts::default()
        };
        let mut out = Vec::new();
        write(&mut out, &t, &[], 20).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("backlog: 0 unpublished"), "{text}");
        assert!(
            text.contains("scheduled: 1000 not yet due (next due in 2m 5s, at -); 1 cancelled"),
            "{text}"
        );
    }
}
