//! CPU time spent by each kind of process while a drain runs: where the
//! machine's cores went (the relay or publisher, nats-server, PostgreSQL).
//!
//! Read from `/proc/<pid>/stat` (user and system time, in clock ticks of
//! 1/100 s, the kernel's `USER_HZ` on Linux) for every process by its command
//! name, and this process's own. Where the bench started a kind of process
//! itself (its relays; PostgreSQL and nats-server unless `DATABASE_URL` /
//! `NATS_URL` name servers of their own), only its own descendants of that
//! kind count: other servers and relays on the machine are not the bench's.
//! A process that exits inside the window loses its share, so the end is
//! read before the relays are stopped; the PostgreSQL backends of the
//! relays' pools live as long as the relays.

use std::collections::HashMap;
use std::time::Duration;

/// Clock ticks per second of `/proc/<pid>/stat`'s times on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// Who used the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Who {
    /// `outbox-relay` processes.
    Relay,
    /// This process: the raw publisher and the simple relay run in it.
    Bench,
    Broker,
    Database,
}

impl Who {
    pub(crate) const ALL: [Self; 4] = [Self::Relay, Self::Bench, Self::Broker, Self::Database];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Relay => "outbox-relay",
            Self::Bench => "bench process",
            Self::Broker => "nats-server",
            Self::Database => "postgres",
        }
    }
}

/// Ticks used so far, per process.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    ticks: HashMap<u32, (Who, u64)>,
}

impl Sample {
    /// Reads every process's ticks now. Processes not of the kinds above,
    /// and any that cannot be read, are left out.
    pub(crate) fn now() -> Self {
        let me = std::process::id();
        let mut seen: HashMap<u32, (Who, u64, u32)> = HashMap::new();
        let mut parents: HashMap<u32, u32> = HashMap::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Self {
                ticks: HashMap::new(),
            };
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            if let Some((comm, used, parent)) = parse_stat(&stat) {
                parents.insert(pid, parent);
                let who = match comm {
                    _ if pid == me => Who::Bench,
                    "outbox-relay" => Who::Relay,
                    "nats-server" => Who::Broker,
                    "postgres" => Who::Database,
                    _ => continue,
                };
                seen.insert(pid, (who, used, parent));
            }
        }
        let ours = |pid: u32| descends_from(pid, me, &parents);
        let kinds_ours: Vec<Who> = seen
            .iter()
            .filter(|(pid, _)| ours(**pid))
            .map(|(_, (who, _, _))| *who)
            .collect();
        let ticks = seen
            .into_iter()
            .filter(|(pid, (who, _, _))| !kinds_ours.contains(who) || ours(*pid))
            .map(|(pid, (who, used, _))| (pid, (who, used)))
            .collect();
        Self { ticks }
    }

    /// CPU seconds each kind used between `before` and this sample
    /// (processes started meanwhile count from zero).
    pub(crate) fn since(&self, before: &Self) -> Use {
        let mut seconds = HashMap::new();
        for (pid, &(who, used)) in &self.ticks {
            let start = before.ticks.get(pid).map_or(0, |&(_, t)| t);
            *seconds.entry(who).or_insert(0.0) +=
                used.saturating_sub(start) as f64 / TICKS_PER_SECOND;
        }
        Use { seconds }
    }
}

/// CPU seconds used in a window, per kind of process.
#[derive(Debug, Clone, Default)]
pub(crate) struct Use {
    seconds: HashMap<Who, f64>,
}

impl Use {
    pub(crate) fn of(&self, who: Who) -> f64 {
        self.seconds.get(&who).copied().unwrap_or(0.0)
    }

    pub(crate) fn total(&self) -> f64 {
        self.seconds.values().sum()
    }

    /// The share of the machine's cores busy over `wall`.
    pub(crate) fn busy(&self, wall: Duration) -> f64 {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        self.total() / (wall.as_secs_f64() * cores as f64)
    }
}

/// A table of CPU seconds per 100,000 events by kind of process, one line
/// per `(name, runs)` (the median over its runs, each a window's use and
/// wall time), with the total and how busy the machine's cores were; the
/// first column is headed `first`.
pub(crate) fn per_events_table(
    first: &str,
    lines: &[(String, Vec<(Use, Duration)>)],
    events: usize,
) -> String {
    let per = 100_000.0 / events.max(1) as f64;
    let mut out = format!(
        "| {first} | {} | total | cores busy |\n|---|{}---:|---:|\n",
        Who::ALL.map(Who::name).join(" | "),
        "---:|".repeat(Who::ALL.len()),
    );
    for (name, runs) in lines {
        let median = |f: &dyn Fn(&Use, Duration) -> f64| {
            let values: Vec<f64> = runs.iter().map(|(u, w)| f(u, *w)).collect();
            crate::stats::Spread::of(&values).median
        };
        let cells: Vec<String> = Who::ALL
            .iter()
            .map(|&who| format!("{:.2}", median(&|u, _| u.of(who) * per)))
            .collect();
        out.push_str(&format!(
            "| {name} | {} | {:.2} | {:.0} % |\n",
            cells.join(" | "),
            median(&|u, _| u.total() * per),
            median(&|u, w| u.busy(w)) * 100.0
        ));
    }
    out
}

/// Whether `pid` is `ancestor` or one of its descendants, by `parents`.
fn descends_from(mut pid: u32, ancestor: u32, parents: &HashMap<u32, u32>) -> bool {
    // A chain longer than this is a loop in a racy read of /proc.
    for _ in 0..64 {
        if pid == ancestor {
            return true;
        }
        match parents.get(&pid) {
            Some(&parent) if parent != 0 && parent != pid => pid = parent,
            _ => return false,
        }
    }
    false
}

/// The command name, user + system ticks and parent pid of a
/// `/proc/<pid>/stat` line. The name is in parentheses and may itself hold
/// spaces or parentheses, so the fields are counted from the last `)`.
fn parse_stat(stat: &str) -> Option<(&str, u64, u32)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let mut fields = stat.get(close + 2..)?.split_whitespace();
    // Fields 3.. of proc(5): state is the first after the name, the parent
    // pid the second; utime and stime are fields 14 and 15.
    let parent: u32 = fields.nth(1)?.parse().ok()?;
    let utime: u64 = fields.nth(9)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((comm, utime + stime, parent))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_and_system_ticks_from_a_stat_line() {
        let line =
            "4242 (nats-server) S 1 4242 4242 0 -1 4194560 1000 0 0 0 150 25 0 0 20 0 8 0 100 0 0";
        assert_eq!(parse_stat(line), Some(("nats-server", 175, 1)));
        let odd = "7 (a (b) c) R 1 7 7 0 -1 0 0 0 0 0 3 4 0 0";
        assert_eq!(parse_stat(odd), Some(("a (b) c", 7, 1)));
    }

    #[test]
    fn descendants_by_parent_pids() {
        // 10 -> 20 -> 30; 40 is not ours; 50 loops on itself.
        let parents: HashMap<u32, u32> = [(20, 10), (30, 20), (40, 1), (50, 50), (10, 1)]
            .into_iter()
            .collect();
        assert!(descends_from(30, 10, &parents));
        assert!(descends_from(10, 10, &parents));
        assert!(!descends_from(40, 10, &parents));
        assert!(!descends_from(50, 10, &parents));
    }
}
