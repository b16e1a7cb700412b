//! The audit: reads published rows' messages back from the stream and puts a
//! row whose message is gone back in front of the relay.
//!
//! A PubAck says the stream accepted a message, not that it is on disk: by
//! default nats-server syncs its store every two minutes, so an unsynced crash
//! of a single-replica stream (or of a quorum of a replicated one) loses
//! messages it acknowledged, and the row says "published" for a message no
//! consumer will ever see. The relay keeps each PubAck's position on the row
//! (`published_stream`, `published_seq`); the audit reads the message at that
//! position and compares its `Nats-Msg-Id` (the row id) and subject (the
//! event type). A message that is gone, or another message at that sequence
//! (after a lost store the stream hands lost sequences out again), is a
//! finding: the row is made unpublished again by one guarded statement
//! (`queries/audit_unpublish.sql`, only while the row still has the position
//! found missing), in the retry lane and due now, and the relay publishes it
//! again through its normal path, with the same id, in order behind nothing
//! and ahead of its subject's later unpublished rows. Each such row is
//! counted (`outbox_relay_audit_republished_total`) and logged at warn level once.
//!
//! **Order.** A republished event reaches consumers after the later events
//! of its subject that the stream kept: a consumer's stale-event filter
//! (`inbox_consumer::SkipStaleLayer`) skips it when a later event of its
//! subject was applied; other handlers apply it late.
//!
//! **Which rows.** Only rows published longer ago than the stream's duplicate
//! window plus a margin ([`settle_margin`]): a republish inside the window could be
//! acked as a duplicate of the lost message (the server's dedupe map may still
//! hold its id) and not stored, and the row would be marked with the lost
//! position again. nats-server keeps an id in its dedupe map for the window
//! when the message is deleted or the stream purged (a republish then is
//! acked as a duplicate, with the deleted message's sequence), and forgets it
//! when a restart lost the store (`tests/tests/audit.rs` shows both). Past the
//! window the id has left the dedupe map and the republish is stored. Rows older than the stream's `max_age` are not
//! audited (the stream discards them); on a stream with `max_msgs` or
//! `max_bytes` limits a sequence below the stream's first one counts as
//! discarded by the limits, not lost (a purge of such a stream is not seen);
//! streams with work-queue or interest retention, or a per-subject limit,
//! remove messages as they are consumed and cannot be audited
//! ([`Audit::unauditable`]).
//! These limits are the stream's as each check reads it (and, in the relay,
//! as its [`StreamView`] last read it), so limits raised or lowered while the
//! relay runs are followed; a stream that has become unauditable fails the
//! check, judging nothing.
//!
//! **Errors are not findings.** Only the server's "no message found" answer,
//! or a message with another id, counts. A broker that cannot be reached,
//! a timeout or any other error fails the whole check; nothing is written and
//! the rows are checked again later.
//!
//! **Cost.** Rows are read in pages by age through
//! `outbox_events_published_idx`. A page whose sequences are dense (their
//! range at most 4 times the rows, plus 64: one relay, or a few sharing the
//! stream) is read back through one ephemeral consumer from its lowest
//! sequence, headers only and without acks, in fetches of up to 1,000
//! messages, and the consumer deleted after; a sparse page is read one
//! message at a time (headers and payload), `concurrency` at a time. That
//! consumer is always named [`RANGE_CONSUMER`] (`outbox-audit`), so a NATS
//! user can be allowed it and no other consumer; a page read while another
//! audit of the stream holds the name is read one message at a time. The relay's audit runs on a task, a
//! database connection and a page budget of its own, so it never delays a
//! batch; it reads each row once per relay start (a keyset mark per shard).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{
    self,
    stream::{ConsumerCreateStrictErrorKind, LastRawMessageErrorKind, RetentionPolicy},
};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use sqlx::PgPool;
use tracing::{debug, warn};
use uuid::Uuid;

use crate::error::{Error, ErrorKind, Result};
use crate::stream_view::StreamView;

/// The most added to the stream's duplicate window before a row is audited,
/// so the server has dropped its id from the dedupe map (and a slow mark has
/// committed) by then: a quarter of the window, at least 1 s and at most
/// this (30 s, so 2m30s for the default window of 2 minutes).
pub const SETTLE_MARGIN: Duration = Duration::from_secs(30);

/// The margin added to `duplicate_window` (see [`SETTLE_MARGIN`]).
pub fn settle_margin(duplicate_window: Duration) -> Duration {
    (duplicate_window / 4).clamp(Duration::from_secs(1), SETTLE_MARGIN)
}

/// The audit horizon of the relay by default: rows published within the last
/// 15 minutes (and before the duplicate window) are audited.
pub const DEFAULT_HORIZON: Duration = crate::config::DEFAULT_AUDIT_HORIZON;

/// Message reads in flight at once by default.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// Bound on one message read by default.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A range of sequences is read by one consumer when it is at most this many
/// times the rows to check (plus [`RANGE_SLACK`]); sparser, one read per row.
const RANGE_DENSITY: u64 = 4;
const RANGE_SLACK: u64 = 64;
/// Messages per fetch of a range read.
const RANGE_BATCH: u64 = 1_000;
/// A range read's consumer, if its deletion failed, is removed by the server
/// after this long idle.
const RANGE_CONSUMER_IDLE: Duration = Duration::from_secs(10);

/// How long pages are read one message at a time after a range read failed.
const RANGE_OFF_FOR: Duration = Duration::from_secs(600);

/// The name of the consumer a dense page is read through, the same for every
/// audit of a stream (the relay's, `outboxctl audit`'s), so that a NATS user
/// can be allowed it (`$JS.API.CONSUMER.CREATE.<stream>.outbox-audit`, and
/// `MSG.NEXT`, `DELETE`) without being allowed any other consumer of the
/// stream. An audit that finds it taken by another one reading at the same
/// moment reads its page one message at a time instead.
pub const RANGE_CONSUMER: &str = "outbox-audit";

/// What the stream holds at a sequence: the message's id and subject.
#[derive(Debug, Clone)]
struct Stored {
    id: Option<String>,
    subject: String,
}

impl Stored {
    /// What `message` says: its `Nats-Msg-Id` and subject.
    fn of(message: &jetstream::Message) -> Self {
        Self {
            id: message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map(|v| v.as_str().to_owned()),
            subject: message.subject.to_string(),
        }
    }
}

/// What `stored` (the message at the row's sequence, if any) says of `row`.
fn judge(row: &AuditedRow, stored: Option<&Stored>) -> Finding {
    match stored {
        None => Finding::Missing,
        Some(m)
            if m.id.as_deref() == Some(row.id.to_string().as_str())
                && m.subject == row.event_type =>
        {
            Finding::Intact
        }
        Some(m) => Finding::Mismatched {
            message_id: m.id.clone(),
            subject: m.subject.clone(),
        },
    }
}

/// A published row as the audit reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditedRow {
    /// The event id (the message's `Nats-Msg-Id`).
    pub id: Uuid,
    /// The row's shard.
    pub shard: i16,
    /// The NATS subject it was published on (the event type).
    pub event_type: String,
    /// The envelope subject (the entity).
    pub subject: String,
    /// The stream it was acked by.
    pub stream: String,
    /// The sequence of its PubAck.
    pub seq: i64,
    /// When it was marked published.
    pub published_at: DateTime<Utc>,
}

/// What the stream holds at a row's position.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finding {
    /// The row's message: its id and subject.
    Intact,
    /// Below the stream's first sequence of a stream with count or size
    /// limits, or older than its `max_age`: discarded by the stream's limits.
    Discarded,
    /// No message at the sequence.
    Missing,
    /// Another message at the sequence (a lost sequence handed out again).
    Mismatched {
        /// The stored message's `Nats-Msg-Id`, if it has one.
        message_id: Option<String>,
        /// The stored message's subject.
        subject: String,
    },
}

impl Finding {
    /// Whether the row's message is lost (missing or another one).
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Missing | Self::Mismatched { .. })
    }

    /// What was found, for logs and `last_error`.
    pub fn describe(&self) -> String {
        match self {
            Self::Intact => "the message is intact".into(),
            Self::Discarded => "discarded by the stream's limits".into(),
            Self::Missing => "no message at the sequence".into(),
            Self::Mismatched {
                message_id,
                subject,
            } => format!(
                "another message at the sequence (Nats-Msg-Id {}, subject `{subject}`)",
                message_id.as_deref().unwrap_or("none")
            ),
        }
    }
}

/// A checked row and what was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The row.
    pub row: AuditedRow,
    /// What the stream holds at its position.
    pub finding: Finding,
}

/// What an audit over a time range found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditReport {
    /// Rows published at or after this were read.
    pub from: Option<DateTime<Utc>>,
    /// Rows published at or before this were read.
    pub until: Option<DateTime<Utc>>,
    /// Rows checked.
    pub checked: u64,
    /// Rows whose message is intact.
    pub intact: u64,
    /// Rows whose message the stream discarded by its limits.
    pub discarded: u64,
    /// Rows with no message at their sequence.
    pub missing: u64,
    /// Rows with another message at their sequence.
    pub mismatched: u64,
    /// Rows made unpublished again (with `republish`).
    pub republished: u64,
    /// The lost rows, with what was found.
    pub lost: Vec<Checked>,
}

/// The stream's settings the audit depends on.
#[derive(Debug, Clone)]
struct Limits {
    duplicate_window: Duration,
    retention: RetentionPolicy,
    count_limited: bool,
    per_subject: bool,
    max_age: Duration,
}

impl Limits {
    fn of(config: &jetstream::stream::Config) -> Self {
        Self {
            duplicate_window: config.duplicate_window,
            retention: config.retention,
            count_limited: config.max_messages > 0 || config.max_bytes > 0,
            per_subject: config.max_messages_per_subject > 0,
            max_age: config.max_age,
        }
    }

    /// Why a stream with these limits cannot be audited, if it cannot.
    fn unauditable(&self, stream: &str) -> Option<String> {
        match self.retention {
            RetentionPolicy::Limits if self.per_subject => Some(format!(
                "stream `{stream}` keeps a limited number of messages per subject, so a missing message may have been discarded"
            )),
            RetentionPolicy::Limits => None,
            other => Some(format!(
                "stream `{stream}` has {other:?} retention, which removes messages once consumed"
            )),
        }
    }
}

/// Audits one stream's published rows. Shared by the relay's audit task and
/// `outboxctl audit`.
#[derive(Debug, Clone)]
pub struct Audit {
    pool: PgPool,
    js: jetstream::Context,
    stream: String,
    limits: Limits,
    /// The stream's config kept up to date (the relay's), if followed.
    view: Option<StreamView>,
    concurrency: usize,
    read_timeout: Duration,
    /// Until when pages are read one message at a time: a range read failed
    /// ([`RANGE_OFF_FOR`]). Shared by clones.
    range_off_until: Arc<Mutex<Option<std::time::Instant>>>,
}

impl Audit {
    /// An audit of `stream`'s rows, reading the stream's config once.
    ///
    /// # Errors
    /// [`ErrorKind::Stream`] if the stream does not exist;
    /// [`ErrorKind::Broker`] if it cannot be read.
    pub async fn new(pool: PgPool, js: jetstream::Context, stream: &str) -> Result<Self> {
        let config = js
            .get_stream(stream)
            .await
            .map_err(|e| {
                let kind = if crate::stream::is_not_found(&e) {
                    ErrorKind::Stream
                } else {
                    ErrorKind::Broker
                };
                Error::new(kind, format!("reading stream `{stream}`: {e}")).with_source(e)
            })?
            .cached_info()
            .config
            .clone();
        Ok(Self::from_config(pool, js, &config))
    }

    /// An audit of the stream whose config is `config` (as
    /// [`StreamSpec::ensure`](crate::StreamSpec::ensure) returns it).
    pub fn from_config(
        pool: PgPool,
        js: jetstream::Context,
        config: &jetstream::stream::Config,
    ) -> Self {
        Self {
            pool,
            js,
            stream: config.name.clone(),
            limits: Limits::of(config),
            view: None,
            concurrency: DEFAULT_CONCURRENCY,
            read_timeout: DEFAULT_READ_TIMEOUT,
            range_off_until: Arc::default(),
        }
    }

    /// Whether a page may be read through the range consumer now.
    fn range_on(&self) -> bool {
        let off = self
            .range_off_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        off.is_none_or(|until| std::time::Instant::now() >= until)
    }

    /// A range read failed: pages are read one message at a time for
    /// [`RANGE_OFF_FOR`].
    fn range_off(&self) {
        let mut off = self
            .range_off_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *off = Some(std::time::Instant::now() + RANGE_OFF_FOR);
    }

    /// Takes the stream's limits (duplicate window, count and size limits,
    /// `max_age`, retention) from `view` as it is re-read, instead of from
    /// the config it was built with, and keeps `view` up to date with the
    /// stream's config each check reads anyway. (Each check judges by the
    /// config it has just read, whether or not a view is followed.)
    #[must_use]
    pub fn follow(mut self, view: StreamView) -> Self {
        self.view = Some(view);
        self
    }

    /// The limits as last read: the followed view's, else the ones built with.
    fn limits(&self) -> Limits {
        self.view
            .as_ref()
            .and_then(StreamView::config)
            .map_or_else(|| self.limits.clone(), |c| Limits::of(&c))
    }

    /// Message reads in flight at once. Default 16 (at least 1).
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Bound on one message read. Default 5 s.
    #[must_use]
    pub fn read_timeout(mut self, d: Duration) -> Self {
        self.read_timeout = d;
        self
    }

    /// The stream audited.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The stream's duplicate window (as last read).
    pub fn duplicate_window(&self) -> Duration {
        self.limits().duplicate_window
    }

    /// How long ago a row must have been published to be audited: the
    /// duplicate window plus [`settle_margin`].
    pub fn settle_age(&self) -> Duration {
        let window = self.duplicate_window();
        window + settle_margin(window)
    }

    /// Why this stream cannot be audited, if it cannot: it removes messages
    /// as they are consumed (work-queue or interest retention) or per subject
    /// (`max_msgs_per_subject`), so a missing message is not a loss.
    pub fn unauditable(&self) -> Option<String> {
        self.limits().unauditable(&self.stream)
    }

    /// The earliest `published_at` worth auditing now: rows older than the
    /// stream's `max_age` (less the margin) are discarded by the stream.
    fn oldest(limits: &Limits, now: DateTime<Utc>, from: DateTime<Utc>) -> DateTime<Utc> {
        if limits.max_age.is_zero() {
            return from;
        }
        let keep = limits
            .max_age
            .saturating_sub(settle_margin(limits.duplicate_window));
        let cut = chrono::Duration::from_std(keep)
            .ok()
            .and_then(|d| now.checked_sub_signed(d))
            .unwrap_or(from);
        from.max(cut)
    }

    /// The database's clock (which set `published_at`).
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if the database cannot be asked.
    pub async fn now(&self) -> Result<DateTime<Utc>> {
        sqlx::query_file_scalar!("queries/audit_now.sql")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| Error::database("reading the database's clock", e))
    }

    /// Rows of `shards` published in `[from, until]` after each shard's
    /// keyset mark, oldest first, at most `limit`.
    pub(crate) async fn rows(
        &self,
        marks: &[(i16, DateTime<Utc>, Uuid)],
        until: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<AuditedRow>> {
        if marks.is_empty() {
            return Ok(Vec::new());
        }
        let shards: Vec<i16> = marks.iter().map(|m| m.0).collect();
        let after_at: Vec<DateTime<Utc>> = marks.iter().map(|m| m.1).collect();
        let after_id: Vec<Uuid> = marks.iter().map(|m| m.2).collect();
        let earliest = after_at.iter().min().copied().unwrap_or(until);
        let rows = sqlx::query_file!(
            "queries/audit_rows.sql",
            self.stream,
            &shards,
            &after_at,
            &after_id,
            earliest,
            until,
            limit,
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| Error::database("reading published rows to audit", e))?;
        Ok(rows
            .into_iter()
            .map(|r| AuditedRow {
                id: r.id,
                shard: r.shard,
                event_type: r.event_type,
                subject: r.subject,
                stream: self.stream.clone(),
                seq: r.seq,
                published_at: r.published_at,
            })
            .collect())
    }

    /// Reads each row's message back and says what was found, in `rows`'
    /// order.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] if the stream or any message cannot be read (not
    /// reachable, a timeout, an error other than "no message found"): no row
    /// is judged on an error.
    pub async fn check(&self, rows: Vec<AuditedRow>) -> Result<Vec<Checked>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let (stream, limits) = self.read_stream().await?;
        let first = stream.cached_info().state.first_sequence;
        let oldest = Self::oldest(&limits, self.now().await?, DateTime::<Utc>::MIN_UTC);
        let stream = &stream;
        // Discarded by the stream's limits, or read back.
        let mut findings: Vec<Option<Finding>> = rows
            .iter()
            .map(|row| {
                let seq = u64::try_from(row.seq).unwrap_or(0);
                (row.published_at < oldest || (limits.count_limited && seq < first))
                    .then_some(Finding::Discarded)
            })
            .collect();
        let wanted: Vec<u64> = rows
            .iter()
            .zip(&findings)
            .filter(|(_, f)| f.is_none())
            .map(|(row, _)| u64::try_from(row.seq).unwrap_or(0))
            .collect();
        if !wanted.is_empty() {
            let found = self.read_wanted(stream, &wanted).await?;
            for (row, finding) in rows.iter().zip(findings.iter_mut()) {
                if finding.is_none() {
                    let seq = u64::try_from(row.seq).unwrap_or(0);
                    *finding = Some(judge(row, found.get(&seq)));
                }
            }
        }
        Ok(rows
            .into_iter()
            .zip(findings)
            .map(|(row, finding)| Checked {
                row,
                finding: finding.unwrap_or(Finding::Missing),
            })
            .collect())
    }

    /// The stream as it is now, and its limits (judged by them: limits
    /// raised or lowered since the relay started, a per-subject limit
    /// added); the stream view, if any, sees the config read.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] if the stream cannot be read;
    /// [`ErrorKind::Stream`] if it cannot be audited now.
    async fn read_stream(&self) -> Result<(jetstream::stream::Stream, Limits)> {
        let broker = |what: String, e: Option<crate::BoxError>| self.broker(what, e);
        let read_at = std::time::Instant::now();
        let stream = tokio::time::timeout(self.read_timeout, self.js.get_stream(&self.stream))
            .await
            .map_err(|_| {
                broker(
                    format!(
                        "reading stream `{}`: no answer within {}",
                        self.stream,
                        outbox_pg::HumanDuration(self.read_timeout)
                    ),
                    None,
                )
            })?
            .map_err(|e| {
                broker(
                    format!("reading stream `{}`: {e}", self.stream),
                    Some(e.into()),
                )
            })?;
        // Judged by the stream as it is now: limits raised or lowered since
        // the relay started, a per-subject limit added.
        let config = &stream.cached_info().config;
        if let Some(view) = &self.view {
            view.observe(config, read_at);
        }
        let limits = Limits::of(config);
        if let Some(why) = limits.unauditable(&self.stream) {
            return Err(Error::new(
                ErrorKind::Stream,
                format!("the stream cannot be audited now: {why}"),
            ));
        }
        Ok((stream, limits))
    }

    /// The messages at `wanted` (not empty): the range's headers when the
    /// sequences are dense, else one direct read each.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] if a message cannot be read one at a time.
    async fn read_wanted(
        &self,
        stream: &jetstream::stream::Stream,
        wanted: &[u64],
    ) -> Result<HashMap<u64, Stored>> {
        let (Some(&lo), Some(&hi)) = (wanted.iter().min(), wanted.iter().max()) else {
            return Ok(HashMap::new());
        };
        let last = stream.cached_info().state.last_sequence;
        let span = hi.min(last).saturating_sub(lo).saturating_add(1);
        let dense = span <= RANGE_DENSITY * wanted.len() as u64 + RANGE_SLACK;
        // Dense: the range's headers, in one consumer's fetches, unless
        // another audit reads through that consumer now.
        let ranged = if dense && self.range_on() {
            match self.read_range(stream, lo, hi.min(last)).await {
                Ok(found) => found,
                Err(e) => {
                    // A message no client can read in the range (any
                    // client allowed on the stream's subjects can write
                    // one) drops the connection the range is read on;
                    // each row's own message reads back whole.
                    warn!(
                        stream = %self.stream, error = %e,
                        "the audit could not read its page through a range read; reading one \
                         message at a time, for 10 minutes",
                    );
                    self.range_off();
                    None
                }
            }
        } else {
            None
        };
        match ranged {
            Some(found) => Ok(found),
            None => self.read_each(stream, wanted).await,
        }
    }

    /// The messages at `seqs`, one direct read each, `concurrency` at a
    /// time; a sequence without a message is absent from the map.
    async fn read_each(
        &self,
        stream: &jetstream::stream::Stream,
        seqs: &[u64],
    ) -> Result<HashMap<u64, Stored>> {
        let results: Vec<Result<Option<(u64, Stored)>>> =
            futures::stream::iter(seqs.iter().copied())
                .map(|seq| async move {
                    let read = tokio::time::timeout(self.read_timeout, stream.get_raw_message(seq));
                    match read.await {
                        Err(_) => Err(self.broker(
                            format!(
                                "reading sequence {seq} of stream `{}`: no answer within {}",
                                self.stream,
                                outbox_pg::HumanDuration(self.read_timeout)
                            ),
                            None,
                        )),
                        Ok(Err(e)) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {
                            Ok(None)
                        }
                        Ok(Err(e)) => Err(self.broker(
                            format!("reading sequence {seq} of stream `{}`: {e}", self.stream),
                            Some(e.into()),
                        )),
                        Ok(Ok(message)) => Ok(Some((
                            seq,
                            Stored {
                                id: message
                                    .headers
                                    .get("Nats-Msg-Id")
                                    .map(|v| v.as_str().to_owned()),
                                subject: message.subject.to_string(),
                            },
                        ))),
                    }
                })
                .buffered(self.concurrency)
                .collect()
                .await;
        let mut out = HashMap::with_capacity(seqs.len());
        for r in results {
            if let Some((seq, stored)) = r? {
                out.insert(seq, stored);
            }
        }
        Ok(out)
    }

    /// The headers and subjects of every message in `lo..=hi`, read by an
    /// ephemeral consumer (headers only, no acks) from `lo`, deleted after;
    /// deleted sequences are absent from the map. The consumer's pending
    /// count says when the stream has no more, so a deleted tail is not
    /// waited for. `None` if another audit reads through
    /// [`RANGE_CONSUMER`] now.
    async fn read_range(
        &self,
        stream: &jetstream::stream::Stream,
        lo: u64,
        hi: u64,
    ) -> Result<Option<HashMap<u64, Stored>>> {
        let mut out = HashMap::new();
        if lo > hi {
            return Ok(Some(out));
        }
        let Some(consumer) = self.range_consumer(stream, lo, hi).await? else {
            return Ok(None);
        };
        let name = consumer.cached_info().name.clone();
        let read = self.read_headers(&consumer, lo, hi, &mut out).await;
        // Best effort: an ephemeral consumer left behind goes by itself
        // once idle.
        let _ = tokio::time::timeout(self.read_timeout, stream.delete_consumer(&name)).await;
        read.map(|()| Some(out))
    }

    /// An ephemeral consumer named [`RANGE_CONSUMER`] reading headers only
    /// from `lo` on, unacked, in memory, gone by itself once idle; `None` if
    /// one of that name exists (another audit's, reading now, or left
    /// behind for a few seconds by one that died).
    async fn range_consumer(
        &self,
        stream: &jetstream::stream::Stream,
        lo: u64,
        hi: u64,
    ) -> Result<Option<jetstream::consumer::PullConsumer>> {
        let config = jetstream::consumer::pull::Config {
            name: Some(RANGE_CONSUMER.to_owned()),
            // Never the same config twice, so that creating it finds any
            // other audit's in the way instead of sharing it.
            description: Some(format!("outbox audit read {}", Uuid::now_v7())),
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: lo,
            },
            ack_policy: jetstream::consumer::AckPolicy::None,
            headers_only: true,
            memory_storage: true,
            inactive_threshold: RANGE_CONSUMER_IDLE,
            ..Default::default()
        };
        match tokio::time::timeout(self.read_timeout, stream.create_consumer_strict(config)).await {
            Err(_) => Err(self.range_failed(lo, hi, "no answer creating a consumer", None)),
            Ok(Ok(consumer)) => Ok(Some(consumer)),
            Ok(Err(e)) if e.kind() == ConsumerCreateStrictErrorKind::AlreadyExists => {
                debug!(
                    stream = %self.stream, consumer = RANGE_CONSUMER,
                    "another audit reads through the range consumer; reading one message at a time",
                );
                Ok(None)
            }
            Ok(Err(e)) => Err(self.range_failed(
                lo,
                hi,
                &format!("creating consumer `{RANGE_CONSUMER}`: {e}"),
                Some(e.into()),
            )),
        }
    }

    /// Reads what `consumer` delivers up to sequence `hi` into `out`, by
    /// stream sequence, in fetches of at most [`RANGE_BATCH`].
    async fn read_headers(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
        lo: u64,
        hi: u64,
        out: &mut HashMap<u64, Stored>,
    ) -> Result<()> {
        let failed = |what: &str, e: Option<crate::BoxError>| self.range_failed(lo, hi, what, e);
        let mut pending = consumer.cached_info().num_pending;
        while pending > 0 {
            let want = usize::try_from(pending.min(hi - lo + 1).min(RANGE_BATCH))
                .unwrap_or(1)
                .max(1);
            let mut batch = consumer
                .batch()
                .max_messages(want)
                .expires(self.read_timeout)
                .messages()
                .await
                .map_err(|e| failed(&format!("fetching: {e}"), Some(e.into())))?;
            let mut got = 0_usize;
            loop {
                let next = tokio::time::timeout(self.read_timeout * 2, batch.next())
                    .await
                    .map_err(|_| failed("no answer fetching", None))?;
                let Some(message) = next else { break };
                let message = message.map_err(|e| failed(&format!("fetching: {e}"), Some(e)))?;
                let info = message
                    .info()
                    .map_err(|e| failed(&format!("reading a message's metadata: {e}"), Some(e)))?;
                let seq = info.stream_sequence;
                pending = info.pending;
                got += 1;
                if seq > hi {
                    return Ok(());
                }
                out.insert(seq, Stored::of(&message));
                if seq == hi || pending == 0 {
                    return Ok(());
                }
            }
            if got == 0 {
                return Err(failed(
                    &format!(
                        "no message within {} though {pending} are pending",
                        outbox_pg::HumanDuration(self.read_timeout)
                    ),
                    None,
                ));
            }
        }
        Ok(())
    }

    /// A broker error reading sequences `lo..=hi`.
    fn range_failed(&self, lo: u64, hi: u64, what: &str, e: Option<crate::BoxError>) -> Error {
        self.broker(
            format!(
                "reading sequences {lo}..={hi} of stream `{}`: {what}",
                self.stream
            ),
            e,
        )
    }

    fn broker(&self, what: String, source: Option<crate::BoxError>) -> Error {
        let err = Error::new(ErrorKind::Broker, what);
        match source {
            Some(e) => err.with_source(e),
            None => err,
        }
    }

    /// Makes `checked`'s row unpublished again, in the retry lane and due
    /// now, if it still has the position found lost; counts
    /// `outbox_relay_audit_republished_total` and logs at warn level when it did.
    /// Returns whether it did (`false`: published again meanwhile, put back
    /// by another audit, or not lost).
    ///
    /// # Errors
    /// [`ErrorKind::Database`] / [`ErrorKind::Privilege`] if the update fails.
    pub async fn republish(&self, checked: &Checked) -> Result<bool> {
        if !checked.finding.is_lost() {
            return Ok(false);
        }
        let row = &checked.row;
        let found = checked.finding.describe();
        let error = format!(
            "audit: stream `{}` lost the message at sequence {} ({found}); published again",
            row.stream, row.seq
        );
        let done = sqlx::query_file!(
            "queries/audit_unpublish.sql",
            row.id,
            row.stream,
            row.seq,
            error,
        )
        .execute(&self.pool)
        .await
        .map_err(|e| Error::database("making a lost row unpublished", e))?
        .rows_affected()
            > 0;
        if done {
            crate::metrics::audit_republished();
            warn!(
                event_id = %row.id,
                event_type = %row.event_type,
                subject = %row.subject,
                stream = %row.stream,
                seq = row.seq,
                published_at = %row.published_at,
                found = %found,
                "audit: the stream lost an acknowledged message; the row is unpublished and will be published again"
            );
        }
        Ok(done)
    }

    /// Audits every row of this stream published in `[from, until]` (all
    /// shards), in pages of `page` rows; with `republish`, makes each lost
    /// row unpublished again ([`Audit::republish`]). `until` is clamped to
    /// `settle_age` before the database's clock when `republish` is set: a
    /// republish inside the duplicate window could be dropped as a duplicate.
    ///
    /// # Errors
    /// As [`Audit::check`] and [`Audit::republish`]; rows already made
    /// unpublished stay so.
    pub async fn run(
        &self,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        republish: bool,
        page: usize,
    ) -> Result<AuditReport> {
        let until = if republish {
            until.min(self.settled_before(self.now().await?))
        } else {
            until
        };
        let mut report = AuditReport {
            from: Some(from),
            until: Some(until),
            ..AuditReport::default()
        };
        let mut marks: Vec<(i16, DateTime<Utc>, Uuid)> = (0..outbox_pg::SHARDS)
            .filter_map(|s| i16::try_from(s).ok())
            .map(|s| (s, from - chrono::Duration::microseconds(1), Uuid::max()))
            .collect();
        let limit = i64::try_from(page.max(1)).unwrap_or(i64::MAX);
        loop {
            let rows = self.rows(&marks, until, limit).await?;
            let full = rows.len() >= page.max(1);
            let last = rows.last().map(|r| (r.published_at, r.id));
            for checked in self.check(rows).await? {
                report.add(&checked);
                if republish && self.republish(&checked).await? {
                    report.republished += 1;
                }
                if checked.finding.is_lost() {
                    report.lost.push(checked);
                }
            }
            match last {
                Some((at, id)) if full => {
                    for m in &mut marks {
                        m.1 = at;
                        m.2 = id;
                    }
                }
                _ => break,
            }
        }
        Ok(report)
    }

    /// Rows published before this may be audited at `now`.
    pub fn settled_before(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        chrono::Duration::from_std(self.settle_age())
            .ok()
            .and_then(|d| now.checked_sub_signed(d))
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }
}

impl AuditReport {
    fn add(&mut self, checked: &Checked) {
        self.checked += 1;
        crate::metrics::audit_checked();
        match checked.finding {
            Finding::Intact => self.intact += 1,
            Finding::Discarded => self.discarded += 1,
            Finding::Missing => self.missing += 1,
            Finding::Mismatched { .. } => self.mismatched += 1,
        }
    }
}

/// Per-shard keyset marks of the relay's audit: each shard is read from the
/// row after the last one checked.
#[derive(Debug, Default)]
pub(crate) struct Marks {
    marks: HashMap<i16, (DateTime<Utc>, Uuid)>,
}

impl Marks {
    /// The marks of `owned` shards, no earlier than `from`; shards given up
    /// are forgotten, shards taken start at `from`.
    pub(crate) fn for_shards(
        &mut self,
        owned: &[i16],
        from: DateTime<Utc>,
    ) -> Vec<(i16, DateTime<Utc>, Uuid)> {
        self.marks.retain(|s, _| owned.contains(s));
        owned
            .iter()
            .map(|&s| {
                let m = self.marks.entry(s).or_insert((from, Uuid::nil()));
                if m.0 < from {
                    *m = (from, Uuid::nil());
                }
                (s, m.0, m.1)
            })
            .collect()
    }

    /// Every shard of `marks` has been read up to `to`.
    pub(crate) fn advance(&mut self, shards: &[i16], to: (DateTime<Utc>, Uuid)) {
        for s in shards {
            let m = self.marks.entry(*s).or_insert(to);
            if *m < to {
                *m = to;
            }
        }
    }

    /// The oldest mark: rows published before it are checked.
    pub(crate) fn oldest(&self) -> Option<DateTime<Utc>> {
        self.marks.values().map(|m| m.0).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_quarter_of_the_window_within_1_to_30_seconds() {
        assert_eq!(
            settle_margin(Duration::from_secs(120)),
            Duration::from_secs(30)
        );
        assert_eq!(settle_margin(Duration::from_secs(600)), SETTLE_MARGIN);
        assert_eq!(
            settle_margin(Duration::from_secs(8)),
            Duration::from_secs(2)
        );
        assert_eq!(
            settle_margin(Duration::from_secs(2)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn marks_start_at_the_horizon_follow_the_shards_and_only_move_forward() {
        let t0 = DateTime::<Utc>::from_timestamp(1_000, 0).unwrap();
        let t1 = DateTime::<Utc>::from_timestamp(2_000, 0).unwrap();
        let t2 = DateTime::<Utc>::from_timestamp(3_000, 0).unwrap();
        let id = Uuid::now_v7();
        let mut marks = Marks::default();
        assert_eq!(
            marks.for_shards(&[1, 2], t0),
            vec![(1, t0, Uuid::nil()), (2, t0, Uuid::nil())]
        );
        marks.advance(&[1, 2], (t1, id));
        // Never backwards.
        marks.advance(&[1], (t0, Uuid::max()));
        assert_eq!(marks.oldest(), Some(t1));
        // A shard given up is forgotten; one taken starts at the horizon.
        assert_eq!(
            marks.for_shards(&[2, 3], t0),
            vec![(2, t1, id), (3, t0, Uuid::nil())]
        );
        // The horizon moves past a mark: the mark follows it.
        assert_eq!(
            marks.for_shards(&[2, 3], t2),
            vec![(2, t2, Uuid::nil()), (3, t2, Uuid::nil())]
        );
    }

    #[test]
    fn only_missing_and_mismatched_messages_are_lost() {
        assert!(!Finding::Intact.is_lost());
        assert!(!Finding::Discarded.is_lost());
        assert!(Finding::Missing.is_lost());
        let other = Finding::Mismatched {
            message_id: Some("x".into()),
            subject: "a.b".into(),
        };
        assert!(other.is_lost());
        assert_eq!(
            other.describe(),
            "another message at the sequence (Nats-Msg-Id x, subject `a.b`)"
        );
    }
}
