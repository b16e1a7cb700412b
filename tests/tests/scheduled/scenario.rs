//! The run, step by step, and what is checked once it has settled.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_pg::{Cancellation, Due, EventId, Outbox};
use outbox_testkit::{NatsServer, Program, TestDb, wait_until};
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use uuid::Uuid;

use super::plan::{self, Fate, Plan};
use super::report::{self, ByClass, Faults, PublishedRow, Window};
use super::support::{self, blocking, count_where};

/// The first key of the relay's shard locks for an outbox in `public`
/// (`outbox_pg::Namespace`); the second is the shard.
const SHARD_LOCKS: i64 = 1_868_722_690;
const ALL_SHARDS: usize = 64;
/// The bound on lateness of the rows not due in the broker outage window,
/// at the 99th percentile (the killed relay's rows included).
const P99_BOUND_MS: f64 = 1_000.0;

/// Where the relays read new rows from (`--source`); the due lane is the
/// same in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    Poll,
    Wal,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Poll => "poll",
            Source::Wal => "wal",
        }
    }
}

// ---------------------------------------------------------------------------
// The relays, as processes.

/// How to run `outbox-relay` here: the default flags, but for the database,
/// the broker, the stream and the source.
struct Relays {
    log_dir: PathBuf,
    database_url: String,
    nats_url: String,
    stream: String,
    source: Source,
}

impl Relays {
    fn new(db: &TestDb, nats_url: &str, source: Source) -> Self {
        let unique = &db.name()[db.name().len() - 12..];
        let log_dir = std::env::temp_dir()
            .join("outbox-scheduled")
            .join(db.name());
        std::fs::create_dir_all(&log_dir).unwrap();
        Self {
            log_dir,
            database_url: db.url().to_owned(),
            nats_url: nats_url.to_owned(),
            stream: format!("SCHED_{}_{unique}", source.name().to_uppercase()),
            source,
        }
    }

    fn program(&self, name: &str) -> Program {
        let relay = Program::new(name, support::bin_dir().join("outbox-relay"), &self.log_dir)
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", &self.nats_url)
            .args(["--stream", &self.stream, "--subjects", "sched.>"]);
        match self.source {
            Source::Poll => relay,
            Source::Wal => relay.args(["--source", "wal"]),
        }
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// The end of both relays' logs, for a failure message.
    fn tails(&self) -> String {
        ["relay-1", "relay-2"]
            .iter()
            .map(|name| {
                let tail = support::log_tail(&self.log_dir.join(format!("{name}.log")));
                format!("--- {name}, end of its log:\n{tail}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn fail(&self, error: impl std::fmt::Display) -> ! {
        panic!("{error}\n{}", self.tails());
    }
}

impl Drop for Relays {
    /// Keeps the relays' logs only when the test failed.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// The sessions holding shard locks, and the shards each holds.
async fn shard_holders<'e>(db: impl sqlx::PgExecutor<'e>) -> HashMap<i32, Vec<i16>> {
    let rows: Vec<(i32, Vec<i32>)> = sqlx::query_as(
        "select pid, array_agg(objid::text::int order by objid::text::int)
           from pg_locks
          where locktype = 'advisory' and classid::text::bigint = $1 and granted
            and database = (select oid from pg_database where datname = current_database())
          group by pid",
    )
    .bind(SHARD_LOCKS)
    .fetch_all(db)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(pid, shards)| {
            let shards = shards.into_iter().map(|s| i16::try_from(s).unwrap());
            (pid, shards.collect())
        })
        .collect()
}

fn held(holders: &HashMap<i32, Vec<i16>>) -> usize {
    holders.values().map(Vec::len).sum()
}

/// The database's clock now.
async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("select clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Starts relay-1 alone until it holds every shard (in WAL mode: leads), then
/// relay-2 beside it (polling: with half the shards; WAL: standing by).
/// Returns both and relay-1's shard session.
async fn start_relays(relays: &Relays, pool: &PgPool) -> (Vec<Program>, i32) {
    let mut first = relays.program("relay-1");
    first.start().await.unwrap();
    wait_until(
        "relay-1 holding every shard",
        Duration::from_secs(60),
        || async {
            let holders = shard_holders(pool).await;
            holders.len() == 1 && held(&holders) == ALL_SHARDS
        },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e));
    let first_pid = *shard_holders(pool).await.keys().next().unwrap();
    let mut second = relays.program("relay-2");
    second.start().await.unwrap();
    let settled = match relays.source {
        Source::Poll => {
            wait_until(
                "both relays holding shards",
                Duration::from_secs(60),
                || async {
                    let holders = shard_holders(pool).await;
                    holders.len() == 2 && held(&holders) == ALL_SHARDS
                },
            )
            .await
        }
        Source::Wal => {
            wait_until("relay-2 standing by", Duration::from_secs(60), || async {
                relays.log("relay-2").contains("standing by")
            })
            .await
        }
    };
    settled.unwrap_or_else(|e| relays.fail(e));
    (vec![first, second], first_pid)
}

// ---------------------------------------------------------------------------
// Writers and cancellers.

/// The start of the run, T0, on the wall clock (for due times) and on the
/// runtime's clock (for sleeps).
#[derive(Debug, Clone, Copy)]
struct Clock {
    t0: DateTime<Utc>,
    start: Instant,
}

impl Clock {
    fn start() -> Self {
        Self {
            t0: Utc::now(),
            start: Instant::now(),
        }
    }

    fn at(&self, offset: Duration) -> DateTime<Utc> {
        self.t0 + chrono::Duration::from_std(offset).unwrap()
    }

    async fn sleep_until(&self, offset: Duration) {
        tokio::time::sleep_until(self.start + offset).await;
    }

    fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// Writer `w`'s share: every WRITERS-th transaction in due order (PER_TX
/// events due together), and after every tenth one a transaction that
/// schedules PER_TX more and rolls back. `progress` counts its committed
/// transactions.
async fn write(
    pool: PgPool,
    clock: Clock,
    plan: Arc<Plan>,
    w: usize,
    progress: watch::Sender<usize>,
) {
    let outbox = Outbox::unvalidated();
    let txs: Vec<_> = plan.committed.chunks(plan::PER_TX).collect();
    let mine: Vec<_> = txs.iter().skip(w).step_by(plan::WRITERS).collect();
    let doomed: Vec<_> = plan.rolled_back.chunks(plan::PER_TX).collect();
    let mut doomed = doomed.iter().skip(w).step_by(plan::WRITERS);
    for (k, chunk) in mine.iter().enumerate() {
        let events: Vec<_> = chunk.iter().map(|p| p.event.clone()).collect();
        let mut tx = pool.begin().await.unwrap();
        let due = Due::At(clock.at(chunk[0].due));
        outbox.schedule_all(&mut tx, &events, due).await.unwrap();
        tx.commit().await.unwrap();
        progress.send_replace(k + 1);
        if k % 10 != 9 {
            continue;
        }
        if let Some(chunk) = doomed.next() {
            let events: Vec<_> = chunk.iter().map(|(e, _)| e.clone()).collect();
            let mut tx = pool.begin().await.unwrap();
            let due = Due::At(clock.at(chunk[0].1));
            outbox.schedule_all(&mut tx, &events, due).await.unwrap();
            tx.rollback().await.unwrap();
        }
    }
    assert!(doomed.next().is_none(), "writer {w} rolled back its share");
}

/// What a cancel answered, and when it was issued relative to the due time
/// (ms, by the test's clock, which is the database's: one host).
#[derive(Debug)]
struct Answer {
    id: EventId,
    fate: Fate,
    answer: Cancellation,
    issued_ms: f64,
}

/// Cancels `id` at its planned time, in a transaction of its own opened
/// just before (so that the cancel's statement is what runs at that time),
/// once it is written (`written` has counted `tx` transactions).
async fn cancel(
    pool: PgPool,
    clock: Clock,
    mut written: watch::Receiver<usize>,
    tx: usize,
    id: EventId,
    due: Duration,
    fate: Fate,
) -> Answer {
    written.wait_for(|&n| n > tx).await.unwrap();
    let (Fate::Cancelled { at } | Fate::Race { at }) = fate else {
        unreachable!("only cancelled events are cancelled")
    };
    clock
        .sleep_until(at.saturating_sub(Duration::from_millis(200)))
        .await;
    let mut tx = pool.begin().await.unwrap();
    clock.sleep_until(at).await;
    let issued = clock.elapsed();
    let answer = Outbox::unvalidated().cancel(&mut tx, id).await.unwrap();
    tx.commit().await.unwrap();
    Answer {
        id,
        fate,
        answer,
        issued_ms: (issued.as_secs_f64() - due.as_secs_f64()) * 1000.0,
    }
}

// ---------------------------------------------------------------------------
// The faults.

/// What the kill found and did.
struct Kill {
    shards: Vec<i16>,
    in_hand: i64,
    killed_at: DateTime<Utc>,
    taken_at: DateTime<Utc>,
}

/// Leased rows of `shards`: taken by their relay, not yet marked published.
async fn in_hand(conn: &mut sqlx::PgConnection, shards: &[i16]) -> i64 {
    sqlx::query_scalar(
        "select count(*) from outbox_events
          where shard = any($1) and released_at is not null and published_at is null
            and locked_until > now()",
    )
    .bind(shards)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// At the burst, kills relay-1 (-9) as soon as it has rows of its shards in
/// hand (or after 3 s), then waits for the survivor to hold every shard.
async fn kill_relay_1(
    relays: &Relays,
    pool: &PgPool,
    clock: Clock,
    relay: &mut Program,
    pid: i32,
) -> Kill {
    // A connection of its own, so that the watch waits for no writer or
    // canceller.
    let mut conn = pool.acquire().await.unwrap();
    clock.sleep_until(plan::BURST_AT).await;
    let shards = shard_holders(&mut *conn)
        .await
        .remove(&pid)
        .unwrap_or_else(|| relays.fail("relay-1 holds no shard before the kill"));
    let give_up = Instant::now() + Duration::from_secs(3);
    let mut rows = 0;
    while Instant::now() < give_up {
        rows = in_hand(&mut conn, &shards).await;
        if rows > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    relay.kill9().await;
    let killed_at = db_now(pool).await;
    wait_until(
        "the survivor holding every shard",
        Duration::from_secs(30),
        || async {
            let holders = shard_holders(pool).await;
            !holders.contains_key(&pid) && held(&holders) == ALL_SHARDS
        },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e));
    let taken_at = db_now(pool).await;
    Kill {
        shards,
        in_hand: rows,
        killed_at,
        taken_at,
    }
}

/// Stops the broker (SIGTERM) at OUTAGE_AT, for OUTAGE, and starts it again
/// on its port and store. Returns when it went and when it was back.
async fn broker_outage(
    broker: &mut NatsServer,
    pool: &PgPool,
    clock: Clock,
) -> (DateTime<Utc>, DateTime<Utc>) {
    clock.sleep_until(plan::OUTAGE_AT).await;
    let stopped_at = db_now(pool).await;
    blocking(|| broker.stop()).unwrap();
    tokio::time::sleep(plan::OUTAGE).await;
    blocking(|| broker.start_again()).unwrap();
    (stopped_at, db_now(pool).await)
}

// ---------------------------------------------------------------------------
// The run.

/// The scenario (see the binary's docs) with relays of `source`.
pub(crate) async fn run(source: Source) {
    let db = TestDb::new().await.unwrap();
    let mut broker = blocking(NatsServer::start).unwrap();
    let relays = Relays::new(&db, &broker.url(), source);
    let pool = db.pool.clone();
    let plan = Arc::new(Plan::draw(Plan::seed()));
    let (mut replicas, first_pid) = start_relays(&relays, &pool).await;

    let clock = Clock::start();
    let (writers, cancels) = start_writing(&pool, clock, &plan);
    for writer in writers {
        writer.await.unwrap();
    }
    let written_in = clock.elapsed();
    let kill = kill_relay_1(&relays, &pool, clock, &mut replicas[0], first_pid).await;
    // Restarted: polling, it takes its share of the shards back from the
    // survivor; WAL, it stands by.
    tokio::time::sleep(Duration::from_secs(2)).await;
    replicas[0].start().await.unwrap();
    let (stopped_at, back_at) = broker_outage(&mut broker, &pool, clock).await;
    let mut answers = Vec::with_capacity(cancels.len());
    for task in cancels {
        answers.push(task.await.unwrap());
    }
    settle(&relays, &pool, clock).await;
    for relay in &mut replicas {
        let log = relays.log_dir.join(format!("{}.log", relay.name));
        support::assert_running(relay, &log);
    }

    let checked = Checked::run(&pool, &broker.url(), &relays.stream, &plan, &answers).await;
    let faults = Faults {
        killed_shards: kill.shards.clone(),
        killed_at: kill.killed_at,
        kill: Window {
            from: kill.killed_at - chrono::Duration::seconds(1),
            to: kill.taken_at + chrono::Duration::seconds(1),
        },
        outage: Window {
            from: stopped_at - chrono::Duration::seconds(1),
            to: back_at + chrono::Duration::seconds(5),
        },
    };
    let rows: Vec<PublishedRow> = sqlx::query_as(
        "select shard, due_at, released_at, published_at
           from outbox_events where published_at is not null",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let lateness = ByClass::of(&rows, &faults);
    let resumed = rows
        .iter()
        .map(|r| r.published_at)
        .filter(|&p| p > back_at)
        .min()
        .map_or(-1, |p| (p - back_at).num_milliseconds());
    println!(
        "scheduled[{}] seed={} written in {:.1}s; {checked}; kill: relay-1 killed -9 at \
         T0+{:.1}s ({} rows of its {} shards seen in hand just before), the survivor held every \
         shard {} ms later, relay-1 restarted 2 s after; broker stopped for {} ms, first publish \
         {resumed} ms after it was back; {lateness}",
        source.name(),
        plan.seed,
        written_in.as_secs_f64(),
        (kill.killed_at - clock.t0).num_milliseconds() as f64 / 1000.0,
        kill.in_hand,
        kill.shards.len(),
        (kill.taken_at - kill.killed_at).num_milliseconds(),
        (back_at - stopped_at).num_milliseconds(),
    );
    assert!(
        lateness.but_outage.p99 <= P99_BOUND_MS,
        "p99 lateness outside the outage window is {:.0} ms (bound {P99_BOUND_MS} ms): {lateness}\n\
         rows outside it more than 1 s late, per second of due time (from T0): {}",
        lateness.but_outage.p99,
        report::late_outside(&rows, &faults, clock.t0)
    );

    for relay in &mut replicas {
        relay.terminate().await;
    }
    if source == Source::Wal {
        support::wal::drop_slots(&pool).await;
    }
}

/// Starts the writers, and the cancellers, each of which waits for its
/// event to be written and then for its time. Each writer writes in due
/// order, ahead of the due times (that no due time had passed at its insert
/// is checked on the table: every row is a scheduled one).
fn start_writing(
    pool: &PgPool,
    clock: Clock,
    plan: &Arc<Plan>,
) -> (Vec<JoinHandle<()>>, Vec<JoinHandle<Answer>>) {
    let (progress, written): (Vec<_>, Vec<_>) =
        (0..plan::WRITERS).map(|_| watch::channel(0)).unzip();
    let writers = progress
        .into_iter()
        .enumerate()
        .map(|(w, progress)| tokio::spawn(write(pool.clone(), clock, plan.clone(), w, progress)))
        .collect();
    let cancels = plan
        .committed
        .iter()
        .enumerate()
        .filter(|(_, p)| p.fate != Fate::Kept)
        .map(|(i, p)| {
            let (w, k) = plan::writer_of(i / plan::PER_TX);
            let written = written[w].clone();
            let task = cancel(pool.clone(), clock, written, k, p.event.id(), p.due, p.fate);
            tokio::spawn(task)
        })
        .collect();
    (writers, cancels)
}

/// Waits until every committed event is published or cancelled: by 45 s
/// after the last due time (the rows the killed relay held wait out its 30 s
/// lease).
async fn settle(relays: &Relays, pool: &PgPool, clock: Clock) {
    let settle = clock.at(plan::DUE_LAST + Duration::from_secs(45)) - Utc::now();
    let settled = wait_until(
        "every committed event published or cancelled",
        settle.to_std().unwrap_or_default(),
        || async { count_where(pool, "published_at is null and cancelled_at is null").await == 0 },
    )
    .await;
    if let Err(e) = settled {
        relays.fail(format!("{e}\n{}", unresolved(pool).await));
    }
}

/// id, shard, due_at, released_at, locked_until, attempts.
type Unresolved = (Uuid, i16, String, Option<String>, Option<String>, i32);

/// A sample of the rows left unresolved, for a failure message.
async fn unresolved(pool: &PgPool) -> String {
    let rows: Vec<Unresolved> = sqlx::query_as(
        "select id, shard, due_at::text, released_at::text, locked_until::text, attempts
           from outbox_events where published_at is null and cancelled_at is null
          order by due_at limit 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let total = count_where(pool, "published_at is null and cancelled_at is null").await;
    format!(
        "{total} unresolved (id, shard, due_at, released_at, locked_until, attempts), e.g.:\n{rows:#?}"
    )
}

// ---------------------------------------------------------------------------
// The checks.

/// The outcome, checked against the plan, the answers, the table and the
/// stream.
struct Checked {
    published: usize,
    cancelled_early: usize,
    race_cancelled: Vec<f64>,
    race_published: Vec<f64>,
    rolled_back: usize,
    attempts: i64,
}

impl Checked {
    async fn run(pool: &PgPool, url: &str, stream: &str, plan: &Plan, answers: &[Answer]) -> Self {
        let mut cancelled = HashSet::new();
        let (mut race_cancelled, mut race_published) = (Vec::new(), Vec::new());
        for a in answers {
            match (a.fate, a.answer) {
                (Fate::Cancelled { .. }, Cancellation::Cancelled) => {}
                (Fate::Race { .. }, Cancellation::Cancelled) => race_cancelled.push(a.issued_ms),
                (Fate::Race { .. }, Cancellation::AlreadyPublished) => {
                    race_published.push(a.issued_ms);
                    continue;
                }
                _ => panic!(
                    "the cancel of {} ({:?}, issued {:+.0} ms from its due time) answered {:?}",
                    a.id, a.fate, a.issued_ms, a.answer
                ),
            }
            cancelled.insert(*a.id.as_uuid());
        }
        let expected: HashSet<Uuid> = plan
            .committed
            .iter()
            .map(|p| *p.event.id().as_uuid())
            .filter(|id| !cancelled.contains(id))
            .collect();
        check_table(pool, plan, &cancelled, expected.len()).await;
        check_stream(pool, url, stream, &expected).await;
        let race_cancelled_n = race_cancelled.len();
        Self {
            published: expected.len(),
            cancelled_early: cancelled.len() - race_cancelled_n,
            race_cancelled,
            race_published,
            rolled_back: plan.rolled_back.len(),
            attempts: count_where(pool, "attempts > 0").await,
        }
    }
}

/// Spread of the issue times of some racing cancels, relative to the due time.
fn spread(issued_ms: &[f64]) -> String {
    let min = issued_ms.iter().copied().fold(f64::INFINITY, f64::min);
    let max = issued_ms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if issued_ms.is_empty() {
        "none".to_owned()
    } else {
        format!("issued {min:+.0}..{max:+.0} ms from the due time")
    }
}

impl std::fmt::Display for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let within = self
            .race_cancelled
            .iter()
            .chain(&self.race_published)
            .filter(|ms| ms.abs() <= 50.0)
            .count();
        write!(
            f,
            "published {} of {} committed, each once in the stream; cancelled early {} (all answered \
             Cancelled); rolled back {} (none in the table or the stream); races: {} Cancelled \
             ({}, none in the stream), {} AlreadyPublished ({}, each in the stream), {} of {} \
             issued within ±50 ms; rows with attempts > 0: {}",
            self.published,
            plan::EVENTS,
            self.cancelled_early,
            self.rolled_back,
            self.race_cancelled.len(),
            spread(&self.race_cancelled),
            self.race_published.len(),
            spread(&self.race_published),
            within,
            plan::RACES,
            self.attempts,
        )
    }
}

/// The table: every committed event scheduled (none turned immediate by a
/// due time already past at insert), the cancelled ones cancelled and
/// unpublished, the others published, none early, none rolled back.
async fn check_table(pool: &PgPool, plan: &Plan, cancelled: &HashSet<Uuid>, published: usize) {
    assert_eq!(
        count_where(pool, "due_at is not null").await,
        plan::EVENTS as i64,
        "every committed event is a scheduled row"
    );
    assert_eq!(count_where(pool, "true").await, plan::EVENTS as i64);
    let cancelled: Vec<Uuid> = cancelled.iter().copied().collect();
    let marked: i64 = sqlx::query_scalar(
        "select count(*) from outbox_events
          where id = any($1) and cancelled_at is not null and published_at is null",
    )
    .bind(&cancelled)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        marked,
        cancelled.len() as i64,
        "every cancelled row kept, unpublished"
    );
    assert_eq!(
        count_where(pool, "cancelled_at is not null").await,
        cancelled.len() as i64,
        "no other row cancelled"
    );
    assert_eq!(
        count_where(pool, "published_at is not null").await,
        published as i64
    );
    let early: Vec<(Uuid, String, String)> = sqlx::query_as(
        "select id, due_at::text, published_at::text from outbox_events
          where published_at < due_at limit 5",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(early.is_empty(), "published before the due time: {early:?}");
    let doomed: Vec<Uuid> = plan
        .rolled_back
        .iter()
        .map(|(e, _)| *e.id().as_uuid())
        .collect();
    let found: i64 = sqlx::query_scalar("select count(*) from outbox_events where id = any($1)")
        .bind(&doomed)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(found, 0, "rolled-back schedules left rows");
}

/// The stream, read back whole: exactly the expected events, each once
/// (by `Nats-Msg-Id` and by envelope id, which agree), each a scheduled
/// message (`scheduledfor` its row's due time, no `sequence`).
async fn check_stream(pool: &PgPool, url: &str, stream: &str, expected: &HashSet<Uuid>) {
    let due: Vec<(Uuid, DateTime<Utc>)> =
        sqlx::query_as("select id, due_at from outbox_events where published_at is not null")
            .fetch_all(pool)
            .await
            .unwrap();
    let due: HashMap<Uuid, DateTime<Utc>> = due.into_iter().collect();
    let messages = support::stream_messages(url, stream).await;
    let mut seen: HashMap<Uuid, usize> = HashMap::new();
    for message in &messages {
        let event = outbox_pg::Envelope::<Value>::from_json(&message.payload).unwrap();
        let id = *event.id().as_uuid();
        let msg_id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(ToString::to_string);
        assert_eq!(msg_id, Some(id.to_string()), "Nats-Msg-Id is the event id");
        assert_eq!(
            event.sequence(),
            None,
            "{id}: a scheduled message has no sequence"
        );
        assert_eq!(
            event.scheduled_for(),
            due.get(&id).copied(),
            "{id}: scheduledfor is its row's due time"
        );
        *seen.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    let stored: HashSet<Uuid> = seen.into_keys().collect();
    let missing: Vec<_> = expected.difference(&stored).take(5).collect();
    let extra: Vec<_> = stored.difference(expected).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the stream holds {} messages for {} expected events; missing e.g. {missing:?}, \
         not expected (cancelled or rolled back) e.g. {extra:?}",
        messages.len(),
        expected.len()
    );
    assert_eq!(messages.len(), expected.len());
}
