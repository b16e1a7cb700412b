//! The report of a retention command (`inbox prune`, `dead-letters purge`):
//! per consumer, what was deleted, or what would be with `--dry-run`.

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::output::when;
use crate::output::{self, Report};

/// `{dry_run, older_than_seconds, cutoff, consumers: [{consumer, deleted |
/// would_delete}], total}`.
#[derive(Debug, Serialize)]
pub(crate) struct Deleted {
    dry_run: bool,
    older_than_seconds: f64,
    cutoff: DateTime<Utc>,
    consumers: Vec<ConsumerDeleted>,
    total: u64,
    /// What a row is, for people (`inbox row`, `dead letter`).
    #[serde(skip)]
    noun: &'static str,
    /// What the cutoff is compared with, for people (`handled`, `recorded`).
    #[serde(skip)]
    dated: &'static str,
    /// Whether to print the table when no consumer had anything.
    #[serde(skip)]
    table_when_empty: bool,
}

#[derive(Debug, Serialize)]
struct ConsumerDeleted {
    consumer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    would_delete: Option<u64>,
}

impl Deleted {
    pub(crate) fn new(
        dry_run: bool,
        older_than: Duration,
        cutoff: DateTime<Utc>,
        noun: &'static str,
        dated: &'static str,
    ) -> Self {
        Self {
            dry_run,
            older_than_seconds: older_than.as_secs_f64(),
            cutoff,
            consumers: Vec::new(),
            total: 0,
            noun,
            dated,
            table_when_empty: true,
        }
    }

    /// No table when no consumer is listed.
    pub(crate) fn without_empty_table(mut self) -> Self {
        self.table_when_empty = false;
        self
    }

    /// Rows deleted so far, over every consumer.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// `count` rows of `consumer` deleted (or, in a dry run, due).
    pub(crate) fn push(&mut self, consumer: String, count: u64) {
        self.total += count;
        self.consumers.push(ConsumerDeleted {
            consumer,
            deleted: (!self.dry_run).then_some(count),
            would_delete: self.dry_run.then_some(count),
        });
    }
}

impl Report for Deleted {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        if self.table_when_empty || !self.consumers.is_empty() {
            let mut rows = vec![vec!["consumer".to_owned(), verb.to_owned()]];
            for c in &self.consumers {
                let n = c.deleted.or(c.would_delete).unwrap_or(0);
                rows.push(vec![c.consumer.clone(), n.to_string()]);
            }
            output::table(out, &rows)?;
        }
        writeln!(
            out,
            "{verb} {} {}{} {} before {} (older than {})",
            self.total,
            self.noun,
            if self.total == 1 { "" } else { "s" },
            self.dated,
            when(Some(self.cutoff)),
            output::age(self.older_than_seconds)
        )
    }
}
