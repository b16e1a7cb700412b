//! The WAL source's publish pipeline: rows are published as they are read
//! from the replication stream, many subjects side by side, each marked in
//! bulk off the publish path, and the slot confirmed behind them.
//!
//! # Many PubAcks outstanding, one subject's rows in order
//!
//! The pipeline holds up to [`HELD_BATCHES`] batches of rows read and not
//! yet recorded (and [`HELD_BYTES_BATCHES`] batches' bytes not yet
//! published). Each subject (an entity) has a queue of its rows in `seq`
//! order and at most one *chain* out at a time: a run of its queued rows
//! (up to [`MAX_BATCH`]) published by the polling relay's own
//! `Engine::publish_chain` (an atomic batch when the chain is
//! long enough and the stream allows it, else one row at a time, each PubAck
//! awaited before the next row of the subject is sent). Up to
//! `max_in_flight` chains, of as many subjects, are out at once; the next
//! chain of a subject leaves only once the one before it is answered. So
//! there is no window that every subject waits for: a subject waits only
//! for its own earlier rows.
//!
//! Whatever fails, a later row of a subject is never stored before an
//! earlier one:
//! - a row the stream refuses (or that can never make a message) is
//!   recorded in the retry lane as by the polling relay, and every later row
//!   of its subject, queued or still to be read, is checked against the
//!   retry lane (`queries/wal_blockers.sql`) and deferred behind it;
//! - a broker fault stops the chain where it was (the rows after it were not
//!   sent): its rows go back to the front of the subject's queue at no cost
//!   to their attempts, and the subject waits a backoff before it is tried
//!   again;
//! - a subject seen for the first time in a session is checked against the
//!   retry lane once (rows the polling path left there: the backfill's,
//!   an earlier session's); a subject checked clear stays clear until a row
//!   of it fails, because above the floor only this reader puts rows there.
//!
//! # What the slot's confirmed position means
//!
//! Every row read gets a number in read order, and every commit read
//! remembers the number the next row would get. A row counts as resolved
//! once its outcome is written (its mark, its failure, its deferral); the
//! slot is confirmed up to the last commit all of whose rows, and all rows
//! before them, are resolved. So a relay killed at any point reads again
//! from a commit none of whose rows is lost, and the stream's duplicate
//! window absorbs the republished ones. The rule is a pure type of its own
//! (`wal/watermark.rs`, with its proof and tests); the pipeline only tells
//! it what was read and what was written. Likewise each subject's state
//! (ready, sending, stalled, its queue) is kept by `wal/subjects.rs`.
//!
//! # Written only once visible
//!
//! The stream carries a transaction as soon as its commit is flushed, a
//! moment before other sessions see it (longer while the commit waits for a
//! synchronous standby). Publishing it then is safe (the commit is durable),
//! but an update of its rows in that moment changes nothing, and a mark, a
//! failure or a deferral lost so would leave a row fresh above the floor,
//! where no path publishes it. So a deferral and a failure are written only
//! once the rows' transactions are visible, and a mark that changed fewer
//! rows than it named is written again once they are (`queries/wal_invisible.sql`);
//! a row counts as resolved only then.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use super::pgoutput::{self, Message};
use super::row::{Inserted, Layout};
use super::slot;
use super::subjects::Subjects;
use super::wal_error;
use super::watermark::Watermark;
use crate::backoff::LoopBackoff;
use crate::error::{Error, ErrorKind, Result};
use crate::metrics;
use crate::relay::{BatchReport, Engine, Outcome};
use crate::sink::{MAX_BATCH, Sink};
use crate::store::{ClaimedRow, Failure, Position};

/// The pipeline holds up to this many batches (`batch_size` rows each) read
/// and not yet recorded: enough that the stream is read on while marks of
/// earlier rows are written (a mark of a thousand rows takes 10–20 ms, and a
/// row counts until its mark lands), few enough that the relay's memory stays
/// flat. A row waiting to be sent is the whole row in memory (with its strings
/// and the allocator's slack, about 1.5 KiB for ~300 bytes of data): draining
/// 1,000,000 rows, a window of 16 batches peaked at 72–79 MiB of RSS, one of
/// 4 at 52–59 MiB, at the same rate and CPU per row within the noise.
const HELD_BATCHES: usize = 4;
/// And up to this many batches' worth of payloads (`batch_bytes` each) read
/// and not yet published. The stream is not read further while either bound
/// is reached.
const HELD_BYTES_BATCHES: usize = 4;
/// Mark statements in flight at once. One starts as soon as a row is
/// published and none is in flight; a second only for a full batch, so marks
/// stay few and large while the pipeline is busy.
const MARK_TASKS: usize = 2;
/// Replication events taken from the client's buffer before the pipeline
/// sends what they brought.
const READ_BURST: usize = 1_024;
/// Subjects remembered as clear of the retry lane before the memory is
/// dropped (and each is checked again when it next has a row).
const CLEAR_SUBJECTS: usize = 100_000;
/// How often the lag gauge is set while nothing is confirmed.
const LAG_EVERY: Duration = Duration::from_millis(100);
/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;
/// How long a transaction read from the stream may stay invisible before the
/// relay says so, and how often it says it again.
const INVISIBLE_WARN_AFTER: Duration = Duration::from_secs(1);
const INVISIBLE_WARN_EVERY: Duration = Duration::from_secs(30);

/// A chain of one subject out to the broker.
type Chain<'a> = BoxFuture<'a, (String, Vec<(ClaimedRow, Outcome)>)>;
/// A mark statement in flight, with the row numbers it resolves.
type Marking = BoxFuture<'static, (Vec<u64>, Result<u64>)>;
/// A look for the outcomes of rows read again, with the rows (each with
/// whether it is looked for) and the ids of those still to publish.
type Rechecking = BoxFuture<'static, (Vec<(ClaimedRow, bool)>, Result<Vec<Uuid>>)>;

/// A row held by the pipeline: its number in read order, payload bytes and
/// transaction (as the stream names it).
#[derive(Debug, Clone, Copy)]
struct Held {
    number: u64,
    bytes: usize,
    xid: u32,
}

/// What the pipeline holds: rows read and not recorded, and the payload
/// bytes of those not yet published.
#[derive(Debug, Clone, Copy)]
struct Holding {
    unresolved: usize,
    bytes: usize,
}

impl Holding {
    /// Whether any bound is reached, for batches of `batch_size` rows and
    /// `batch_bytes` bytes: then the stream is not read further.
    fn at_bound(self, batch_size: usize, batch_bytes: usize) -> bool {
        self.unresolved >= batch_size.saturating_mul(HELD_BATCHES)
            || self.bytes >= batch_bytes.saturating_mul(HELD_BYTES_BATCHES)
    }
}

/// Where the replication stream is, for the rows it brings.
#[derive(Debug)]
struct Reader<'s> {
    schema: &'s str,
    /// Rows at or below it are the polling path's.
    floor: i64,
    /// Transactions ending below this WAL position were written before the
    /// session: their rows may have an outcome already.
    written: u64,
    relations: HashMap<u32, Option<Layout>>,
    /// The transaction being read.
    xid: u32,
    /// Whether its rows are checked for an outcome before they are queued.
    recheck: bool,
}

/// What the WAL task keeps from one replication session to the next.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// Rows at or below it belong to the polling path (the backfill);
    /// `None`: the next session backfills first, unless the slot's backfill
    /// is recorded.
    pub(super) floor: Option<i64>,
    /// The next session backfills, whatever is recorded (the slot was made
    /// by this relay, or rows were left behind).
    pub(super) must_backfill: bool,
    /// Every transaction ending at or before it is published and recorded.
    pub(super) done: Lsn,
    /// A session failed and was not followed by a good one yet.
    pub(super) failing: bool,
}

/// The publish pipeline of one replication session.
pub(super) struct Pipeline<'a, S: Sink> {
    engine: &'a Engine<S>,
    stop: CancellationToken,
    max_payload: usize,
    subjects: Subjects,
    /// Rows of subjects not known clear, to check before they are queued.
    unchecked: Vec<ClaimedRow>,
    /// Rows read again from WAL written before the session, to check for an
    /// outcome before anything else (`true`), and every row read after them
    /// (`false`), so a subject's rows stay in order.
    rechecks: Vec<(ClaimedRow, bool)>,
    /// A look for outcomes is in flight (one at a time, so rows are taken
    /// on in read order).
    rechecking: bool,
    /// What catching up with that WAL did, said once it is done.
    catch_up: CatchUp,
    /// When the stalled subjects may send again.
    stalled_until: Option<Instant>,
    fault_backoff: LoopBackoff,
    /// Rows held, not yet given an outcome.
    held: HashMap<Uuid, Held>,
    held_bytes: usize,
    /// Rows handed out and resolved, commits seen: how far the slot may
    /// be confirmed.
    watermark: Watermark,
    /// Published rows not yet in a mark statement, with their numbers.
    marks: Vec<(Uuid, Option<Position>)>,
    mark_numbers: Vec<u64>,
    mark_xids: Vec<u32>,
    /// When the lag gauge was last set.
    lag_set: Instant,
}

impl<'a, S: Sink> Pipeline<'a, S> {
    /// A pipeline for a session that reads from after `done`.
    pub(super) fn new(engine: &'a Engine<S>, stop: &CancellationToken, done: Lsn) -> Self {
        Self {
            engine,
            stop: stop.clone(),
            max_payload: engine.sink.max_payload(),
            subjects: Subjects::default(),
            unchecked: Vec::new(),
            rechecks: Vec::new(),
            rechecking: false,
            catch_up: CatchUp::default(),
            stalled_until: None,
            fault_backoff: LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            held: HashMap::new(),
            held_bytes: 0,
            watermark: Watermark::new(done),
            marks: Vec::new(),
            mark_numbers: Vec::new(),
            mark_xids: Vec::new(),
            lag_set: Instant::now(),
        }
    }

    /// Reads the session's stream until `stop`, publishing and confirming
    /// behind it.
    ///
    /// # Errors
    /// A failure of the stream or of the database: the session ends, and the
    /// next reads again from the slot's confirmed position.
    pub(super) async fn run(
        mut self,
        client: &mut ReplicationClient,
        schema: &str,
        (floor, written): (i64, u64),
        p: &mut Progress,
    ) -> Result<()> {
        let stop = self.stop.clone();
        let mut reader = Reader {
            schema,
            floor,
            written,
            relations: HashMap::new(),
            xid: 0,
            recheck: false,
        };
        let mut chains: FuturesUnordered<Chain<'a>> = FuturesUnordered::new();
        let mut marking: FuturesUnordered<Marking> = FuturesUnordered::new();
        let mut rechecking: FuturesUnordered<Rechecking> = FuturesUnordered::new();
        let result = loop {
            self.start_recheck(&mut rechecking);
            if let Err(e) = self.step(&mut chains, &mut marking, client, p).await {
                break Err(e);
            }
            let reading = !self.full();
            let retry_at = self.stalled_until;
            let outcome = tokio::select! {
                biased;
                () = stop.cancelled() => break Ok(()),
                Some((numbers, landed)) = marking.next(), if !marking.is_empty() => {
                    landed.map(|_| self.resolve(&numbers))
                }
                Some((rows, fresh)) = rechecking.next(), if !rechecking.is_empty() => {
                    fresh.map(|fresh| self.rechecked(rows, &fresh))
                }
                Some((subject, results)) = chains.next(), if !chains.is_empty() => {
                    let mut answered = self.answered(subject, results).await;
                    // Take every answer already in before the next step.
                    while answered.is_ok()
                        && let Some(Some((subject, results))) = chains.next().now_or_never()
                    {
                        answered = self.answered(subject, results).await;
                    }
                    answered
                }
                () = sleep_until(retry_at), if retry_at.is_some() => {
                    self.unstall();
                    Ok(())
                }
                event = client.recv(), if reading => {
                    let mut read = self.read(event, &mut reader, client, p);
                    for _ in 0..READ_BURST {
                        if read.is_err() || self.full() {
                            break;
                        }
                        match client.recv().now_or_never() {
                            Some(event) => read = self.read(event, &mut reader, client, p),
                            None => break,
                        }
                    }
                    read
                }
            };
            if let Err(e) = outcome {
                break Err(e);
            }
        };
        if result.is_ok() {
            self.finish(&mut chains, &mut marking, client, p).await?;
        }
        if let Err(e) = &result {
            let failed: Result<BatchReport> = Err(Error::new(e.kind(), e.to_string()));
            self.engine.note_db_health(&failed);
            self.engine.report_health();
        }
        result
    }

    /// Stopping: what is out is answered and recorded (bounded by the
    /// publish timeout), nothing new is sent; unsent rows are read again by
    /// the next session. The slot is confirmed behind what was recorded.
    async fn finish(
        &mut self,
        chains: &mut FuturesUnordered<Chain<'a>>,
        marking: &mut FuturesUnordered<Marking>,
        client: &ReplicationClient,
        p: &mut Progress,
    ) -> Result<()> {
        self.subjects.stop_sending();
        while let Some((subject, results)) = chains.next().await {
            self.answered(subject, results).await?;
        }
        self.start_marks(marking, true);
        while let Some((numbers, landed)) = marking.next().await {
            landed?;
            self.resolve(&numbers);
        }
        self.confirm(client, p);
        Ok(())
    }

    /// Whether the pipeline holds as much as it may.
    fn full(&self) -> bool {
        let held = Holding {
            unresolved: self.watermark.unresolved(),
            bytes: self.held_bytes,
        };
        held.at_bound(
            self.engine.config.batch_size,
            self.engine.config.batch_bytes,
        )
    }

    /// Takes one replication event.
    fn read(
        &mut self,
        event: std::result::Result<Option<ReplicationEvent>, PgWireError>,
        r: &mut Reader<'_>,
        client: &ReplicationClient,
        p: &mut Progress,
    ) -> Result<()> {
        let event = event
            .map_err(|e| wal_error("reading the replication stream", &e))?
            .ok_or_else(|| Error::new(ErrorKind::Database, "the replication stream ended"))?;
        match event {
            ReplicationEvent::Begin { final_lsn, xid, .. } => {
                r.xid = xid;
                r.recheck = final_lsn.0 < r.written;
                if !r.recheck {
                    self.catch_up.reached();
                }
                // A transaction confirmed before (a session that replays
                // from the slot's position) is skipped: its rows are resolved.
                self.watermark.begin(final_lsn);
            }
            ReplicationEvent::XLogData { data, .. } => {
                match pgoutput::decode(&data)
                    .map_err(|e| Error::new(ErrorKind::Database, e.to_string()))?
                {
                    Message::Relation(rel) => {
                        let ours = rel.name == "outbox_events" && rel.namespace == r.schema;
                        let layout = if ours { Some(Layout::of(&rel)?) } else { None };
                        r.relations.insert(rel.id, layout);
                    }
                    Message::Insert { relation, values } if !self.watermark.replaying() => {
                        if let Some(Some(layout)) = r.relations.get(&relation)
                            && let Inserted::Fresh(row) = layout.row(values, self.max_payload)
                            && row.seq > r.floor
                        {
                            self.hold(*row, r.xid, r.recheck);
                        }
                    }
                    _ => {}
                }
            }
            ReplicationEvent::Commit {
                end_lsn,
                commit_time_micros,
                ..
            } => self.watermark.commit(end_lsn, commit_time_micros),
            // Idle: nothing read is waiting, so the slot may move on (an
            // idle outbox must not hold WAL back).
            // (A logical walsender's keep-alive carries how far it has
            // decoded, so the stream has passed `written` once it does.)
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                if wal_end.0 >= r.written {
                    self.catch_up.reached();
                }
                if let Some(lsn) = self.watermark.idle(wal_end) {
                    client.update_applied_lsn(lsn);
                    p.done = lsn;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes a row read from the stream into the pipeline; `recheck`: it
    /// may have an outcome already.
    fn hold(&mut self, row: ClaimedRow, xid: u32, recheck: bool) {
        let number = self.watermark.hand_out();
        let bytes = usize::try_from(row.data_len).unwrap_or(usize::MAX);
        self.held.insert(row.id, Held { number, bytes, xid });
        self.held_bytes = self.held_bytes.saturating_add(bytes);
        if recheck || self.rechecking || !self.rechecks.is_empty() {
            self.catch_up.read += u64::from(recheck);
            self.rechecks.push((row, recheck));
        } else {
            self.take_on(row);
        }
    }

    /// Queues a row of a subject known clear of the retry lane; keeps the
    /// others to check first.
    fn take_on(&mut self, row: ClaimedRow) {
        if self.subjects.is_clear(&row.subject) {
            self.subjects.enqueue(row);
        } else {
            self.unchecked.push(row);
        }
    }

    /// Checks, sends, marks and confirms what it can.
    async fn step(
        &mut self,
        chains: &mut FuturesUnordered<Chain<'a>>,
        marking: &mut FuturesUnordered<Marking>,
        client: &ReplicationClient,
        p: &mut Progress,
    ) -> Result<()> {
        if !self.unchecked.is_empty() {
            self.check().await?;
        }
        let engine = self.engine;
        while chains.len() < engine.config.max_in_flight
            && let Some((name, rows)) = self.subjects.next_chain(MAX_BATCH)
        {
            let deadline = Instant::now()
                + engine
                    .config
                    .lease
                    .saturating_sub(engine.config.publish_timeout);
            let max_payload = self.max_payload;
            chains.push(
                async move {
                    let results = engine.publish_chain(rows, deadline, max_payload).await;
                    (name, results)
                }
                .boxed(),
            );
        }
        self.start_marks(marking, false);
        self.confirm(client, p);
        self.subjects.forget_idle(CLEAR_SUBJECTS);
        Ok(())
    }

    /// Starts a look for the outcomes of the rows read again, unless one is
    /// in flight: it runs beside publishing, and takes every row read again
    /// meanwhile next time.
    fn start_recheck(&mut self, rechecking: &mut FuturesUnordered<Rechecking>) {
        if self.rechecking || self.rechecks.is_empty() {
            return;
        }
        self.rechecking = true;
        let rows = std::mem::take(&mut self.rechecks);
        let ids: Vec<Uuid> = rows.iter().filter(|r| r.1).map(|r| r.0.id).collect();
        let xids = self.xids(ids.iter().copied());
        let pool = self.engine.store.pool().clone();
        let stop = self.stop.clone();
        rechecking.push(
            async move {
                let fresh = async {
                    if ids.is_empty() {
                        return Ok(Vec::new());
                    }
                    // A row is passed over only on a visible outcome.
                    await_visible(&pool, &xids, &stop).await?;
                    slot::still_fresh(&pool, &ids).await
                };
                (rows, fresh.await)
            }
            .boxed(),
        );
    }

    /// Passes over the rows read again that have an outcome (the relay or
    /// session before published them, or put them in the retry lane: all
    /// but `fresh`) and takes the others on, in read order.
    fn rechecked(&mut self, rows: Vec<(ClaimedRow, bool)>, fresh: &[Uuid]) {
        self.rechecking = false;
        let fresh: std::collections::HashSet<&Uuid> = fresh.iter().collect();
        let mut numbers = Vec::new();
        for (row, looked) in rows {
            if looked && !fresh.contains(&row.id) {
                numbers.extend(self.settle(row.id).map(|h| h.number));
            } else {
                self.take_on(row);
            }
        }
        self.catch_up.passed_over += numbers.len() as u64;
        self.resolve(&numbers);
    }

    /// Checks the unchecked rows' subjects against the retry lane: rows of a
    /// subject with an earlier row there are deferred behind it, the others
    /// queued and their subjects remembered clear.
    async fn check(&mut self) -> Result<()> {
        let engine = self.engine;
        let mut rows = std::mem::take(&mut self.unchecked);
        rows.sort_by_key(|r| r.seq);
        let mut lowest: HashMap<&str, i64> = HashMap::new();
        for row in &rows {
            lowest.entry(row.subject.as_str()).or_insert(row.seq);
        }
        let subjects: Vec<(&str, i64)> = lowest.into_iter().collect();
        let blockers =
            slot::blockers(engine.store.pool(), &subjects, engine.config.max_attempts).await?;
        let mut deferred = Vec::new();
        let mut queued = Vec::new();
        for row in rows {
            match blockers.get(&row.subject) {
                Some(crate::store::Blocker::Until(t)) => deferred.push((row.id, Some(*t))),
                Some(_) => deferred.push((row.id, None)),
                None => queued.push(row),
            }
        }
        let xids = self.xids(deferred.iter().map(|d| d.0));
        await_visible(engine.store.pool(), &xids, &self.stop).await?;
        engine
            .store
            .defer(&deferred, engine.config.backoff_max)
            .await?;
        let numbers: Vec<u64> = deferred
            .iter()
            .filter_map(|(id, _)| self.settle(*id).map(|h| h.number))
            .collect();
        self.resolve(&numbers);
        for row in queued {
            self.subjects.enqueue_checked(row);
        }
        Ok(())
    }

    /// Takes a chain's answers: published rows wait for their mark, refused
    /// ones are recorded and their subject's later rows checked again (so
    /// deferred behind them), rows behind a broker fault go back to the
    /// front of the queue and the subject waits a backoff.
    async fn answered(&mut self, name: String, results: Vec<(ClaimedRow, Outcome)>) -> Result<()> {
        let engine = self.engine;
        let mut back: Vec<ClaimedRow> = Vec::new();
        let mut refused: Vec<Failure> = Vec::new();
        let mut published = 0;
        let mut faults = 0;
        let mut first_fault: Option<String> = None;
        for (row, outcome) in results {
            match outcome {
                Outcome::Published { position, .. } => {
                    published += 1;
                    if let Some(held) = self.settle(row.id) {
                        self.marks.push((row.id, position));
                        self.mark_numbers.push(held.number);
                        self.mark_xids.push(held.xid);
                    }
                }
                Outcome::Failed(failure) if failure.kind().is_broker_fault() => {
                    metrics::failed(failure.kind().as_str());
                    faults += 1;
                    first_fault.get_or_insert_with(|| failure.to_string());
                    back.push(row);
                }
                Outcome::Failed(failure) => refused.push(engine.refusal(&row, &failure)),
                Outcome::Unresolved => back.push(row),
            }
        }
        engine.note_broker_health(published, faults, first_fault.as_deref());
        if published > 0 {
            self.fault_backoff.reset();
        }
        if !refused.is_empty() {
            let xids = self.xids(refused.iter().map(|f| f.id));
            await_visible(engine.store.pool(), &xids, &self.stop).await?;
            engine.record_refusals(&refused).await?;
            let numbers: Vec<u64> = refused
                .iter()
                .filter_map(|f| self.settle(f.id).map(|h| h.number))
                .collect();
            self.resolve(&numbers);
            let queued = self.subjects.refused(name);
            self.unchecked.extend(back);
            self.unchecked.extend(queued);
            return Ok(());
        }
        if self.subjects.returned(name, back, faults > 0) && self.stalled_until.is_none() {
            self.stalled_until = Some(Instant::now() + self.fault_backoff.next());
        }
        Ok(())
    }

    /// The backoff after a broker fault is over: the stalled subjects are
    /// tried again.
    fn unstall(&mut self) {
        self.stalled_until = None;
        self.subjects.unstall();
    }

    /// The transactions of these held rows.
    fn xids(&self, ids: impl Iterator<Item = Uuid>) -> Vec<u32> {
        ids.filter_map(|id| self.held.get(&id).map(|h| h.xid))
            .collect()
    }

    /// A row has its outcome: it no longer counts toward the bytes held.
    fn settle(&mut self, id: Uuid) -> Option<Held> {
        let held = self.held.remove(&id)?;
        self.held_bytes = self.held_bytes.saturating_sub(held.bytes);
        Some(held)
    }

    /// The outcomes of these rows are written.
    fn resolve(&mut self, numbers: &[u64]) {
        for &n in numbers {
            self.watermark.resolve(n);
        }
    }

    /// Starts a mark statement for the published rows waiting for one: at
    /// once when none is in flight (or `now`), else when a batch of them is
    /// waiting and fewer than [`MARK_TASKS`] are.
    fn start_marks(&mut self, marking: &mut FuturesUnordered<Marking>, now: bool) {
        if self.marks.is_empty() {
            return;
        }
        let due = now
            || marking.is_empty()
            || (marking.len() < MARK_TASKS && self.marks.len() >= self.engine.config.batch_size);
        if !due {
            return;
        }
        let marks = std::mem::take(&mut self.marks);
        let numbers = std::mem::take(&mut self.mark_numbers);
        let xids = std::mem::take(&mut self.mark_xids);
        let store = self.engine.store.clone();
        let stop = self.stop.clone();
        metrics::batch(marks.len());
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut marked = store.mark_published(&marks).await?;
            if usize::try_from(marked).unwrap_or(usize::MAX) < marks.len() {
                // Rows left unchanged were published already, or their
                // transaction is not visible yet: once it is, mark again.
                await_visible(store.pool(), &xids, &stop).await?;
                marked += store.mark_published(&marks).await?;
            }
            metrics::phase("mark", started.elapsed());
            Ok::<u64, Error>(marked)
        });
        marking.push(
            async move {
                let landed = task.await.unwrap_or_else(|e| {
                    Err(Error::new(
                        ErrorKind::Database,
                        format!("marking rows published: {e}"),
                    ))
                });
                (numbers, landed)
            }
            .boxed(),
        );
    }

    /// Confirms the slot up to the last commit whose rows, and every row
    /// before them, have their outcomes written; sets the lag gauge from the
    /// oldest commit not confirmed.
    fn confirm(&mut self, client: &ReplicationClient, p: &mut Progress) {
        if let Some(lsn) = self.watermark.confirm() {
            client.update_applied_lsn(lsn);
            p.done = lsn;
        } else if self.lag_set.elapsed() < LAG_EVERY {
            return;
        }
        self.lag_set = Instant::now();
        let lag = self.watermark.oldest_commit().map_or(0, |micros| {
            let now = chrono::Utc::now().timestamp_micros() - PG_EPOCH_MICROS;
            u64::try_from(now - micros).unwrap_or(0)
        });
        metrics::wal_lag(Duration::from_micros(lag));
    }
}

/// Waits until every transaction of `xids` is visible to new statements, so
/// that a write to rows read from the stream changes them: the stream carries
/// a transaction once its commit is flushed, a moment before other sessions
/// see it (much longer while the commit waits for a synchronous standby).
/// Says so when the wait is long; the slot is not confirmed meanwhile.
///
/// # Errors
/// [`ErrorKind::Database`] when the check fails, or `stop` came first (the
/// rows stay unresolved and are read again).
async fn await_visible(pool: &sqlx::PgPool, xids: &[u32], stop: &CancellationToken) -> Result<()> {
    let mut left = xids.to_vec();
    left.sort_unstable();
    left.dedup();
    let started = Instant::now();
    let mut warned: Option<Instant> = None;
    let mut pause = LoopBackoff::new(Duration::from_millis(2), Duration::from_millis(500));
    loop {
        left = slot::invisible(pool, &left).await?;
        if left.is_empty() {
            return Ok(());
        }
        let waited = started.elapsed();
        if waited >= INVISIBLE_WARN_AFTER
            && warned.is_none_or(|t| t.elapsed() >= INVISIBLE_WARN_EVERY)
        {
            warn!(
                transactions = left.len(),
                waited = ?waited,
                "rows read from the WAL are not visible yet: their commit is in the WAL but other \
                 sessions do not see it (waiting for a synchronous standby?); the relay records \
                 them, and moves the slot past them, once they are"
            );
            warned = Some(Instant::now());
        }
        tokio::select! {
            () = stop.cancelled() => {
                return Err(Error::new(
                    ErrorKind::Database,
                    "stopped while rows read from the WAL were not visible yet",
                ));
            }
            () = tokio::time::sleep(pause.next()) => {}
        }
    }
}

/// Catching up with the WAL written before a session: said once the stream
/// reaches a transaction that ended after the session began.
#[derive(Debug)]
struct CatchUp {
    started: Instant,
    /// Rows read from that WAL, and how many of them had an outcome.
    read: u64,
    passed_over: u64,
    said: bool,
}

impl Default for CatchUp {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            read: 0,
            passed_over: 0,
            said: false,
        }
    }
}

impl CatchUp {
    /// The stream reached the WAL written since the session began.
    fn reached(&mut self) {
        if self.said {
            return;
        }
        self.said = true;
        if self.read > 0 {
            tracing::info!(
                rows = self.read,
                already_done = self.passed_over,
                took = ?self.started.elapsed(),
                "caught up with the WAL written before this session: its rows are published or queued"
            );
        }
    }
}

/// Sleeps until `at` (never, without one).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pipeline_holds_four_batches_of_rows_and_of_bytes() {
        let (rows, bytes) = (1_000, 8 << 20);
        let held = |unresolved, bytes| Holding { unresolved, bytes };
        assert!(!held(0, 0).at_bound(rows, bytes));
        assert!(!held(3_999, 0).at_bound(rows, bytes));
        assert!(held(4_000, 0).at_bound(rows, bytes));
        assert!(!held(100, (32 << 20) - 1).at_bound(rows, bytes));
        assert!(held(100, 32 << 20).at_bound(rows, bytes));
        // Bounds scale with the batch, and never overflow.
        assert!(!held(39_999, 0).at_bound(10_000, bytes));
        assert!(!held(usize::MAX - 1, 0).at_bound(usize::MAX, usize::MAX));
    }
}
