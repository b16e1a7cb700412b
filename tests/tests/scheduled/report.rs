//! How late the published rows were (`published_at - due_at`, both by the
//! database's clock), per class of row: those a fault could make late, each
//! named by what identifies it, and all the others.

use std::fmt;

use chrono::{DateTime, Utc};
/// A published scheduled row, as `outbox_events` holds it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct PublishedRow {
    pub(crate) shard: i16,
    pub(crate) due_at: DateTime<Utc>,
    pub(crate) released_at: Option<DateTime<Utc>>,
    pub(crate) published_at: DateTime<Utc>,
}

impl PublishedRow {
    pub(crate) fn late_ms(&self) -> f64 {
        (self.published_at - self.due_at)
            .num_microseconds()
            .unwrap() as f64
            / 1000.0
    }
}

/// A stretch of time by the database's clock, both ends included.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    pub(crate) from: DateTime<Utc>,
    pub(crate) to: DateTime<Utc>,
}

impl Window {
    pub(crate) fn contains(&self, t: DateTime<Utc>) -> bool {
        self.from <= t && t <= self.to
    }
}

/// What the faults were, by the database's clock.
#[derive(Debug)]
pub(crate) struct Faults {
    /// The killed relay's shards when it died.
    pub(crate) killed_shards: Vec<i16>,
    /// Read just after the killed relay was reaped.
    pub(crate) killed_at: DateTime<Utc>,
    /// From 1 s before the kill (rows coming due in the killed relay's
    /// shards it had not taken yet) to 1 s after the survivor held every
    /// shard.
    pub(crate) kill: Window,
    /// From 1 s before the broker was stopped (rows in flight when it went)
    /// to 5 s after it was back.
    pub(crate) outage: Window,
}

/// The classes rows are reported in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Taken by the killed relay (released before it died, in its shards)
    /// and published by another after it died: by the shard's next owner,
    /// once it holds the shard.
    Held,
    /// Due in the kill window.
    KillWindow,
    /// Due in the outage window.
    OutageWindow,
    /// Everything else.
    Outside,
}

impl Faults {
    pub(crate) fn classify(&self, row: &PublishedRow) -> Class {
        let held = self.killed_shards.contains(&row.shard)
            && row.released_at.is_some_and(|r| r <= self.killed_at)
            && row.published_at > self.killed_at;
        if held {
            Class::Held
        } else if self.kill.contains(row.due_at) {
            Class::KillWindow
        } else if self.outage.contains(row.due_at) {
            Class::OutageWindow
        } else {
            Class::Outside
        }
    }
}

/// Percentiles of lateness, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Lateness {
    pub(crate) n: usize,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

impl Lateness {
    pub(crate) fn of(mut late_ms: Vec<f64>) -> Self {
        if late_ms.is_empty() {
            return Self::default();
        }
        late_ms.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let rank = (q * late_ms.len() as f64).ceil() as usize;
            late_ms[rank.clamp(1, late_ms.len()) - 1]
        };
        Self {
            n: late_ms.len(),
            p50: at(0.50),
            p99: at(0.99),
            max: late_ms[late_ms.len() - 1],
        }
    }
}

impl fmt::Display for Lateness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "n={} p50={:.0}ms p99={:.0}ms max={:.0}ms",
            self.n, self.p50, self.p99, self.max
        )
    }
}

/// Lateness per class.
#[derive(Debug)]
pub(crate) struct ByClass {
    /// Every row but those due in the outage window: held to the bound.
    pub(crate) but_outage: Lateness,
    pub(crate) outside: Lateness,
    pub(crate) kill_window: Lateness,
    pub(crate) held: Lateness,
    pub(crate) outage_window: Lateness,
}

impl ByClass {
    pub(crate) fn of(rows: &[PublishedRow], faults: &Faults) -> Self {
        let class = |c: Class| {
            Lateness::of(
                rows.iter()
                    .filter(|r| faults.classify(r) == c)
                    .map(PublishedRow::late_ms)
                    .collect(),
            )
        };
        Self {
            but_outage: Lateness::of(
                rows.iter()
                    .filter(|r| faults.classify(r) != Class::OutageWindow)
                    .map(PublishedRow::late_ms)
                    .collect(),
            ),
            outside: class(Class::Outside),
            kill_window: class(Class::KillWindow),
            held: class(Class::Held),
            outage_window: class(Class::OutageWindow),
        }
    }
}

impl fmt::Display for ByClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lateness of every row not due in the outage window [{}]: outside the windows \
             [{}], due in the kill window [{}], held by the killed relay [{}]; due in the \
             outage window [{}]",
            self.but_outage, self.outside, self.kill_window, self.held, self.outage_window
        )
    }
}

/// The rows not due in the outage window more than 1 s late, per second of
/// due time from `t0`: "T0+29s: 12 up to 4.3 s late".
pub(crate) fn late_outside(rows: &[PublishedRow], faults: &Faults, t0: DateTime<Utc>) -> String {
    let mut per_second: std::collections::BTreeMap<i64, (usize, f64)> = Default::default();
    for row in rows {
        let late = row.late_ms();
        if late > 1_000.0 && faults.classify(row) != Class::OutageWindow {
            let second = (row.due_at - t0).num_seconds();
            let entry = per_second.entry(second).or_default();
            entry.0 += 1;
            entry.1 = entry.1.max(late);
        }
    }
    per_second
        .iter()
        .map(|(s, (n, max))| format!("T0+{s}s: {n} up to {:.1} s late", max / 1000.0))
        .collect::<Vec<_>>()
        .join("; ")
}
