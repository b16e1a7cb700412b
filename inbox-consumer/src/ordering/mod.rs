//! Order-dependent handlers: skip an event older than one already applied.
//!
//! Events of one subject arrive in publish order from one relay, but a
//! redelivery can arrive late (the contract's rule 3: "order by subject, not by
//! arrival"). The inbox already records, per consumer, every applied event's
//! subject, time and `sequence`, so "the newest event applied for this
//! subject" is one indexed query ([`last_applied_sequence`], [`last_applied`]).
//!
//! [`SkipStale`] sits inside [`Dedupe`](crate::dedupe::Dedupe) (it needs the
//! transaction) in front of a handler whose effect must not go backwards (a
//! "current plan" column, say). If the subject already has an applied event
//! that is **newer** (below), the handler is skipped and the outcome is
//! [`Outcome::Stale`]; the inbox row still commits, so a redelivery of the stale
//! event is a plain duplicate.
//!
//! # Which event is newer
//!
//! - **An event with a `sequence`** (the CloudEvents extension the relay
//!   stamps on every event: its outbox row's insert-order number, see
//!   [`Envelope::sequence`](outbox_pg::Envelope::sequence)) is stale if an
//!   applied event of its subject has a **higher** sequence. Equal or lower,
//!   or no applied event with a sequence, and it is applied. Times are not
//!   read: a producer clock that runs ahead (one event stamped 2099) cannot
//!   silence a subject, and events stamped in the same microsecond still have
//!   an order.
//! - **An event without a `sequence`** (published before the relay sent one,
//!   or by another producer) keeps the time rule: it is stale if an applied
//!   event of its subject has a **later** `time`. Equal times are applied.
//! - **A scheduled event** (it carries `scheduledfor`, its due time, and no
//!   `sequence`: see [`Envelope::scheduled_for`](outbox_pg::Envelope::scheduled_for))
//!   is never stale. It is published at its due time, after any number of
//!   later immediate events of its subject, and belongs to no entity order;
//!   a handler that must not apply it after some state checks that state.
//!
//! A subject with events of both kinds compares like with like, as far as it
//! can. An event with a sequence is compared only with applied events that
//! carry one: applied events without a sequence never make it stale, whatever
//! their time. An event without a sequence is compared with the time of every
//! applied event of its subject, with a sequence or without, so an applied
//! event stamped in the future still makes *it* stale; that weakness is
//! confined to events that offer nothing better than a time.
//!
//! "Applied" here means recorded in the inbox. An event skipped as stale keeps
//! its row: its sequence is below the subject's highest and never decides
//! anything, but its time does count when an event without a sequence comes.
//!
//! # Sequences are per outbox database
//!
//! A sequence numbers the rows of one outbox database (`outbox_events.seq`),
//! so it orders the events one producer's database wrote, and nothing more.
//! The inbox does not record which database an event came from, and compares
//! the sequences of a subject's events as if they all came from one. If two
//! producers' databases write events of the same subject, their sequences are
//! **not comparable**: [`SkipStale`] would skip the events of whichever
//! counter is behind. Keep each subject to one producing database (a subject
//! usually names an entity that one service owns), or do not put
//! [`SkipStale`] in front of handlers of shared subjects. For the same reason
//! an outbox database whose counter starts again (recreated, or
//! `outbox_events_seq` reset) makes its new events look older than the ones
//! already applied.
//!
//! The inbox stores a sequence as a PostgreSQL `bigint`.
//! [`record`](crate::dedupe::record) refuses an event whose sequence is above
//! `i64::MAX` with [`ErrorKind::InvalidEnvelope`], so the runtime dead-letters
//! it (reason `not_cloudevent`) instead of handling it. The relay never sends
//! one (`outbox_events.seq` is a `bigint` too), and clamping it to `i64::MAX`
//! would rank it above every later event of its subject for good: the very
//! fault that comparing sequences removes.
//!
//! # Locking
//!
//! The read and the record share one lock: before reading, [`SkipStale`]
//! takes the subject's lock ([`lock_subject`]), held until the transaction
//! ends. Two replicas handling events of one subject at the same moment
//! therefore run one after the other: the second reads after the first has
//! committed its inbox row, so it sees the first's sequence (or time) and
//! skips itself if it is older. Without the lock both would read "nothing
//! newer", both apply, and the older could commit last.
//!
//! Handlers that need more (a merge rather than a skip) call [`lock_subject`]
//! and then [`last_applied_sequence`] or [`last_applied`] themselves from
//! [`Handler::handle`](crate::Handler::handle), in that order.
//!
//! To keep replicas from handling a subject's events concurrently at all, and
//! in stream order, see [`ConsumerConfig::ordered`](crate::ConsumerConfig::ordered).

mod layer;

use std::mem;
use std::task::{Context, Poll};

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use outbox_pg::EventId;
use sqlx::PgConnection;
use tower::Service;

use crate::delivery::{Delivery, InTx, Outcome};
use crate::error::{BoxError, Error, ErrorKind};
use crate::grouping::{GroupBatching, GroupRoute};

pub use layer::SkipStaleLayer;

/// Takes `consumer`'s lock on `subject`, held until `conn`'s transaction
/// commits or rolls back; waits while another transaction holds it.
///
/// Every transaction of `consumer` that reads state of `subject` to decide
/// what to write (an "apply only if newer" check, a merge) should take it
/// before that read, so that the read and the write are not split by another
/// replica's commit. Outside a transaction the lock is released at once.
///
/// # Errors
/// [`ErrorKind::Database`] if the statement fails.
pub async fn lock_subject(
    conn: &mut PgConnection,
    consumer: &str,
    subject: &str,
) -> Result<(), Error> {
    sqlx::query_file!("queries/lock_subject.sql", consumer, subject)
        .execute(conn)
        .await
        .map_err(|e| Error::database("taking the subject's lock", e))?;
    Ok(())
}

/// The latest event time `consumer` has recorded for `subject`, other than
/// `except` (the event being handled, whose inbox row is already inserted).
///
/// # Errors
/// [`ErrorKind::Database`] if the query fails.
pub async fn last_applied(
    conn: &mut PgConnection,
    consumer: &str,
    subject: &str,
    except: EventId,
) -> Result<Option<DateTime<Utc>>, Error> {
    sqlx::query_file_scalar!(
        "queries/last_applied.sql",
        consumer,
        subject,
        except.as_uuid()
    )
    .fetch_one(conn)
    .await
    .map_err(|e| Error::database("reading the last applied event time", e))
}

/// The highest `sequence` `consumer` has recorded for `subject`, other than
/// `except` (the event being handled, whose inbox row is already inserted);
/// `None` when no other recorded event of the subject carries one.
///
/// Compare it only with the sequence of an event from the same outbox
/// database: sequences of different databases are not comparable (see the
/// [module docs](self#sequences-are-per-outbox-database)).
///
/// # Errors
/// [`ErrorKind::Database`] if the query fails, or
/// if it finds a negative sequence (which the column's check forbids).
pub async fn last_applied_sequence(
    conn: &mut PgConnection,
    consumer: &str,
    subject: &str,
    except: EventId,
) -> Result<Option<u64>, Error> {
    let last: Option<i64> = sqlx::query_file_scalar!(
        "queries/last_applied_sequence.sql",
        consumer,
        subject,
        except.as_uuid(),
    )
    .fetch_one(conn)
    .await
    .map_err(|e| Error::database("reading the last applied event sequence", e))?;
    last.map(|last| {
        u64::try_from(last).map_err(|e| {
            Error::new(
                ErrorKind::Database,
                format!("inbox_events holds a negative sequence ({last}) for subject `{subject}`"),
            )
            .with_source(e)
        })
    })
    .transpose()
}

/// An event's `sequence` as `inbox_events.sequence` stores it: `None` stays
/// NULL; a value above `i64::MAX` is refused, not clamped (see the
/// [module docs](self#sequences-are-per-outbox-database)).
pub(crate) fn sequence_column(sequence: Option<u64>) -> Result<Option<i64>, Error> {
    sequence
        .map(|seq| {
            i64::try_from(seq).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidEnvelope,
                    format!(
                        "invalid envelope sequence {seq}: the inbox stores sequences up to \
                         {} (no relay sends a higher one)",
                        i64::MAX
                    ),
                )
                .with_source(e)
            })
        })
        .transpose()
}

/// The applied value that makes an event with value `event` stale: `last`,
/// when it is strictly greater. Equal is not stale.
fn newer<T: PartialOrd>(event: T, last: Option<T>) -> Option<T> {
    last.filter(|last| *last > event)
}

/// Skips events older than one already applied for their subject. See the
/// [module docs](self).
#[derive(Debug, Clone)]
pub struct SkipStale<S> {
    inner: S,
}

impl<S> SkipStale<S> {
    /// Wraps `inner`.
    pub const fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Keeps no groups: a group call would pass the staleness check by, so in a
/// batch each delivery is checked, then handled, on its own (a
/// [`BatchHandler`](crate::BatchHandler) behind it gets groups of one).
impl<S> GroupBatching for SkipStale<S> {
    fn group_route(&self, _event_type: &str) -> Option<&GroupRoute> {
        None
    }
}

impl<S> Service<InTx<Delivery>> for SkipStale<S>
where
    S: Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = InTx<Outcome>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<InTx<Outcome>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: InTx<Delivery>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (tx, delivery) = request.parts_mut();
            let (consumer, subject, id) = (delivery.consumer(), delivery.subject(), delivery.id());
            // A scheduled event belongs to no entity order: published at its
            // due time, after any number of later immediate events.
            if delivery.envelope().scheduled_for().is_some() {
                return inner.call(request).await.map_err(Into::into);
            }
            lock_subject(tx, consumer, subject).await?;
            match delivery.envelope().sequence() {
                Some(sequence) => {
                    let last = last_applied_sequence(tx, consumer, subject, id).await?;
                    if let Some(last) = newer(sequence, last) {
                        tracing::info!(
                            consumer,
                            event_id = %id,
                            subject,
                            event_sequence = sequence,
                            last_applied_sequence = last,
                            "stale event skipped: an event of this subject with a higher \
                             sequence was already applied",
                        );
                        return Ok(request.map(|_| Outcome::Stale));
                    }
                }
                None => {
                    let time = delivery.envelope().time();
                    let last = last_applied(tx, consumer, subject, id).await?;
                    if let Some(last) = newer(time, last) {
                        tracing::info!(
                            consumer,
                            event_id = %id,
                            subject,
                            event_time = %time,
                            last_applied = %last,
                            "stale event skipped: a later event of this subject was already \
                             applied (the event has no sequence, so times are compared)",
                        );
                        return Ok(request.map(|_| Outcome::Stale));
                    }
                }
            }
            inner.call(request).await.map_err(Into::into)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_strictly_greater_applied_value_makes_an_event_stale() {
        assert_eq!(newer(5_u64, None), None);
        assert_eq!(newer(5_u64, Some(4)), None);
        assert_eq!(newer(5_u64, Some(5)), None, "equal is applied");
        assert_eq!(newer(5_u64, Some(6)), Some(6));
        assert_eq!(newer(0_u64, Some(u64::MAX)), Some(u64::MAX));
    }

    #[test]
    fn the_time_rule_compares_the_same_way() {
        let t0 = DateTime::<Utc>::UNIX_EPOCH;
        let later = t0 + chrono::Duration::milliseconds(1);
        assert_eq!(newer(t0, Some(later)), Some(later));
        assert_eq!(newer(later, Some(t0)), None);
        assert_eq!(newer(t0, Some(t0)), None);
    }

    #[test]
    fn a_missing_sequence_is_stored_as_null() {
        assert_eq!(sequence_column(None).unwrap(), None);
    }

    #[test]
    fn sequences_up_to_i64_max_are_stored_as_they_are() {
        for seq in [0, 1, 42, i64::MAX as u64 - 1, i64::MAX as u64] {
            assert_eq!(
                sequence_column(Some(seq)).unwrap(),
                Some(i64::try_from(seq).unwrap())
            );
        }
    }

    #[test]
    fn a_sequence_above_i64_max_is_refused_as_an_invalid_envelope() {
        for seq in [i64::MAX as u64 + 1, u64::MAX] {
            let err = sequence_column(Some(seq)).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidEnvelope, "{err}");
            assert!(err.to_string().contains("sequence"), "{err}");
            assert!(err.to_string().contains(&seq.to_string()), "{err}");
        }
    }
}
