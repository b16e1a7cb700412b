//! What the writers and the cancellers do, and when: drawn before the run
//! from a seed (printed in the summary; `SCHEDULED_SEED=<n>` replays it).
//! Every time is an offset from the start of the run, T0.

use std::time::Duration;

use outbox_pg::Envelope;
use serde_json::{Value, json};

/// Scheduled events committed, due over [`DUE_FIRST`, `DUE_LAST`).
pub(crate) const EVENTS: usize = 10_000;
/// Of them, due together at [`BURST_AT`] (the relay killed with rows in hand).
pub(crate) const BURST: usize = 300;
/// Of them, cancelled 2–6 s before their due time.
pub(crate) const CANCELLED: usize = 1_000;
/// Of them, cancelled within ±50 ms of their due time.
pub(crate) const RACES: usize = 200;
/// Schedules made in transactions that roll back.
pub(crate) const ROLLED_BACK: usize = 1_000;
/// Writer tasks, each with a connection of its own.
pub(crate) const WRITERS: usize = 8;
/// Events scheduled per transaction, due together (`Outbox::schedule_all`).
pub(crate) const PER_TX: usize = 5;
/// Envelope subjects the events are spread over (and so the relay's shards).
const SUBJECTS: u64 = 400;

pub(crate) const DUE_FIRST: Duration = Duration::from_secs(6);
pub(crate) const DUE_LAST: Duration = Duration::from_secs(66);
/// When the burst falls due and one relay is killed.
pub(crate) const BURST_AT: Duration = Duration::from_secs(20);
/// When the broker is stopped, and for how long.
pub(crate) const OUTAGE_AT: Duration = Duration::from_secs(34);
pub(crate) const OUTAGE: Duration = Duration::from_secs(10);
/// The racing cancels fall in these stretches (ms), clear of the kill and of
/// the outage, where the relays publish at the due time: a cancel there
/// meets a relay taking the row, not a lane that is stopped.
const RACE_ZONES: [(u64, u64); 3] = [(12_000, 18_000), (26_000, 32_000), (54_000, 64_000)];
/// Early cancels pick events due no sooner than this (writing is over by then).
const CANCEL_FROM: Duration = Duration::from_secs(16);

/// What becomes of a committed event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Published at its time.
    Kept,
    /// Cancelled at `at`, 2–6 s before its time: must answer Cancelled.
    Cancelled { at: Duration },
    /// Cancelled at `at`, within ±50 ms of its time.
    Race { at: Duration },
}

/// One scheduled event and its fate.
#[derive(Debug)]
pub(crate) struct Planned {
    pub(crate) event: Envelope<Value>,
    pub(crate) due: Duration,
    pub(crate) fate: Fate,
}

/// The whole run's events.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) seed: u64,
    /// In due order; each PER_TX in a row are one transaction's, due
    /// together.
    pub(crate) committed: Vec<Planned>,
    /// Likewise, each PER_TX in a row one transaction's.
    pub(crate) rolled_back: Vec<(Envelope<Value>, Duration)>,
}

/// Which writer writes transaction `tx` (events `tx * PER_TX ..`), and as
/// its how-manyth: writers take the transactions in turn, in due order.
pub(crate) fn writer_of(tx: usize) -> (usize, usize) {
    (tx % WRITERS, tx / WRITERS)
}

/// splitmix64: enough randomness for a test, from a printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A time in [from, to), to the millisecond.
    fn between(&mut self, from: Duration, to: Duration) -> Duration {
        let span = u64::try_from((to - from).as_millis()).unwrap();
        from + Duration::from_millis(self.below(span))
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.below(i as u64 + 1)).unwrap();
            items.swap(i, j);
        }
    }
}

fn event(rng: &mut Rng, n: usize) -> Envelope<Value> {
    let subject = format!("acct-{}", rng.below(SUBJECTS));
    Envelope::new(
        "sched.reminder",
        "scheduled-writer",
        subject,
        json!({ "n": n }),
    )
    .unwrap()
}

impl Plan {
    /// The seed from `SCHEDULED_SEED`, or a fresh one.
    pub(crate) fn seed() -> u64 {
        std::env::var("SCHEDULED_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| uuid::Uuid::now_v7().as_u64_pair().1)
    }

    pub(crate) fn draw(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut dues: Vec<Duration> = (0..(EVENTS - BURST) / PER_TX)
            .map(|_| rng.between(DUE_FIRST, DUE_LAST))
            .collect();
        dues.extend(std::iter::repeat_n(BURST_AT, BURST / PER_TX));
        dues.sort();
        let mut committed: Vec<Planned> = dues
            .into_iter()
            .flat_map(|due| std::iter::repeat_n(due, PER_TX))
            .enumerate()
            .map(|(n, due)| Planned {
                event: event(&mut rng, n),
                due,
                fate: Fate::Kept,
            })
            .collect();

        let in_zone = |due: Duration| {
            let ms = u64::try_from(due.as_millis()).unwrap();
            RACE_ZONES
                .iter()
                .any(|&(from, to)| (from..to).contains(&ms))
        };
        let mut racers: Vec<usize> = (0..committed.len())
            .filter(|&i| committed[i].due != BURST_AT && in_zone(committed[i].due))
            .collect();
        rng.shuffle(&mut racers);
        for &i in &racers[..RACES] {
            let due = committed[i].due;
            let at = due - Duration::from_millis(50) + Duration::from_millis(rng.below(101));
            committed[i].fate = Fate::Race { at };
        }
        let mut cancels: Vec<usize> = (0..committed.len())
            .filter(|&i| {
                let p = &committed[i];
                p.fate == Fate::Kept && p.due != BURST_AT && p.due >= CANCEL_FROM
            })
            .collect();
        rng.shuffle(&mut cancels);
        for &i in &cancels[..CANCELLED] {
            let due = committed[i].due;
            let ahead = rng.between(Duration::from_secs(2), Duration::from_secs(6));
            committed[i].fate = Fate::Cancelled { at: due - ahead };
        }

        let doomed: Vec<Duration> = (0..ROLLED_BACK / PER_TX)
            .map(|_| rng.between(DUE_FIRST, DUE_LAST))
            .collect();
        let rolled_back = doomed
            .into_iter()
            .flat_map(|due| std::iter::repeat_n(due, PER_TX))
            .enumerate()
            .map(|(n, due)| (event(&mut rng, EVENTS + n), due))
            .collect();
        Self {
            seed,
            committed,
            rolled_back,
        }
    }
}
