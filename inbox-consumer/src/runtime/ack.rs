//! The acknowledgement decision: what a delivery's result means for JetStream.
//!
//! [`decide`] turns a result into a [`Decision`], as the table in the
//! [runtime docs](super) says: that table is the one home of the rule, and
//! this module's tests go through it row by row.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use outbox_pg::failure::PgFailure;

use super::config::{ConsumerConfig, Unrouted};
use super::panics::Panicked;
use crate::delivery::Outcome;
use crate::error::{Action, BoxError, Error, ErrorKind, HandlerError};
use crate::poison::Reason;

/// The longest nak delay while the database cannot be reached: once it is
/// back, held-off messages return within this.
pub(crate) const UNAVAILABLE_MAX_DELAY: Duration = Duration::from_secs(30);

/// What to do with a message once its delivery finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    Ack(Outcome),
    /// No route for its type: acked without an effect, and counted.
    Unrouted,
    Nak(Duration),
    DeadLetter(Reason),
    /// Another replica leads now: leave the message to it, neither ack nor nak.
    Abandon,
}

/// Decides the acknowledgement for a delivery's result, on its `delivered`-th
/// delivery.
pub(crate) fn decide(
    result: &Result<Outcome, BoxError>,
    delivered: u64,
    config: &ConsumerConfig,
) -> Decision {
    let error = match result {
        Ok(outcome) => return Decision::Ack(*outcome),
        Err(error) => error.as_ref(),
    };
    match classify(error) {
        Classified::Reject(Reason::Unroutable) if config.unrouted == Unrouted::Ack => {
            Decision::Unrouted
        }
        Classified::Reject(reason) => Decision::DeadLetter(reason),
        Classified::Abandon => Decision::Abandon,
        Classified::Unavailable => {
            Decision::Nak(config.retry.delay(delivered).min(UNAVAILABLE_MAX_DELAY))
        }
        Classified::Retry(_) if spent(delivered, config) => {
            Decision::DeadLetter(Reason::MaxDeliveries)
        }
        Classified::Retry(after) => {
            Decision::Nak(after.unwrap_or_else(|| config.retry.delay(delivered)))
        }
        Classified::Panic if spent(delivered, config) => Decision::DeadLetter(Reason::Panic),
        Classified::Panic => Decision::Nak(config.retry.delay(delivered)),
    }
}

/// Whether the `delivered`-th delivery is the last the budget allows.
fn spent(delivered: u64, config: &ConsumerConfig) -> bool {
    u64::try_from(config.max_deliver).is_ok_and(|max| max > 0 && delivered >= max)
}

enum Classified {
    Retry(Option<Duration>),
    /// Not the event's fault: the database is unreachable or a lock wait timed out.
    Unavailable,
    Reject(Reason),
    Abandon,
    /// The handler or a layer panicked ([`Panicked`]).
    Panic,
}

fn classify(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Classified {
    if lease_lost(error) {
        return Classified::Abandon;
    }
    if error.is::<Panicked>() {
        return Classified::Panic;
    }
    if let Some(handler) = error.downcast_ref::<HandlerError>() {
        return match handler.action() {
            Action::Retry { .. } if unavailable(error) => Classified::Unavailable,
            Action::Retry { after } => Classified::Retry(after),
            Action::Reject => Classified::Reject(
                handler
                    .get_ref()
                    .downcast_ref::<Error>()
                    .and_then(|e| reject_reason(e.kind()))
                    .unwrap_or(Reason::Rejected),
            ),
        };
    }
    if let Some(reason) = error
        .downcast_ref::<Error>()
        .and_then(|e| reject_reason(e.kind()))
    {
        return Classified::Reject(reason);
    }
    if unavailable(error) {
        return Classified::Unavailable;
    }
    Classified::Retry(None)
}

fn reject_reason(kind: ErrorKind) -> Option<Reason> {
    match kind {
        ErrorKind::Decode => Some(Reason::UndecodablePayload),
        ErrorKind::Unroutable => Some(Reason::Unroutable),
        ErrorKind::InvalidEnvelope => Some(Reason::NotCloudEvent),
        _ => None,
    }
}

/// Whether `error` says an ordered consumer's replica no longer leads.
pub(crate) fn lease_lost(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    error
        .downcast_ref::<Error>()
        .is_some_and(|e| e.kind() == ErrorKind::LeaseLost)
}

/// Whether `error` (or a cause of it) says the database could not be used at
/// all, rather than that this event failed: no connection, a server shutting
/// down or refusing connections, or a lock wait that timed out (another
/// transaction, maybe of a frozen replica, holds what this one needs)
/// ([`PgFailure::Unavailable`]); or the role's grants, not the event
/// ([`PgFailure::Denied`]: retried, loudly, until granted).
pub(crate) fn unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    matches!(
        outbox_pg::failure::classify(error),
        Some(PgFailure::Unavailable | PgFailure::Denied)
    )
}

/// Sends `kind` for `message`, bounded by `timeout`. An `Ack` waits for the
/// server's confirmation.
pub(crate) async fn send(
    message: &jetstream::Message,
    kind: AckKind,
    timeout: Duration,
) -> Result<(), Error> {
    let sent = async {
        match kind {
            AckKind::Ack => message.double_ack().await,
            other => message.ack_with(other).await,
        }
    };
    match tokio::time::timeout(timeout, sent).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::caused(
            ErrorKind::Nats,
            format!("sending {kind:?}"),
            e,
        )),
        Err(elapsed) => Err(
            Error::new(ErrorKind::Nats, format!("sending {kind:?} timed out")).with_source(elapsed),
        ),
    }
}

/// Acks `messages` (a committed batch's) at once, each waiting for the
/// server's confirmation, all under one `timeout`: one timer for the batch,
/// not one per message. The errors, one per message that failed, or one for
/// the batch if the time ran out.
pub(crate) async fn ack_all(messages: &[jetstream::Message], timeout: Duration) -> Vec<Error> {
    let acks = futures::future::join_all(messages.iter().map(jetstream::Message::double_ack));
    match tokio::time::timeout(timeout, acks).await {
        Ok(results) => results
            .into_iter()
            .filter_map(Result::err)
            .map(|e| Error::caused(ErrorKind::Nats, "sending Ack", e))
            .collect(),
        Err(elapsed) => vec![
            Error::new(
                ErrorKind::Nats,
                format!("acking {} messages timed out", messages.len()),
            )
            .with_source(elapsed),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::RetryPolicy;

    fn err(e: impl Into<BoxError>) -> Result<Outcome, BoxError> {
        Err(e.into())
    }

    fn config(budget: i64) -> ConsumerConfig {
        ConsumerConfig::new("S", "c")
            .max_deliver(budget)
            .retry(RetryPolicy::default().base(Duration::from_secs(1)))
    }

    fn db_down() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
    }

    #[test]
    fn committed_outcomes_are_acked() {
        for o in [Outcome::Handled, Outcome::Duplicate, Outcome::Stale] {
            assert_eq!(decide(&Ok(o), 1, &config(5)), Decision::Ack(o));
        }
    }

    #[test]
    fn retries_nak_with_growing_delay_until_the_budget_is_spent() {
        let c = config(3);
        let e = || err(HandlerError::retry("handler failed"));
        assert_eq!(decide(&e(), 1, &c), Decision::Nak(Duration::from_secs(1)));
        assert_eq!(decide(&e(), 2, &c), Decision::Nak(Duration::from_secs(2)));
        assert_eq!(
            decide(&e(), 3, &c),
            Decision::DeadLetter(Reason::MaxDeliveries)
        );
        assert_eq!(
            decide(&e(), 4, &c),
            Decision::DeadLetter(Reason::MaxDeliveries)
        );
        // an unlimited budget never dead-letters a retry
        let unlimited = config(-1);
        assert_eq!(
            decide(&e(), 99, &unlimited),
            Decision::Nak(unlimited.retry.delay(99))
        );
    }

    #[test]
    fn an_unreachable_database_never_spends_the_budget() {
        let c = config(3);
        let from_dedupe = || {
            err(Error::database(
                "beginning the inbox transaction",
                db_down(),
            ))
        };
        let from_handler = || err(HandlerError::from(db_down()));
        let pool = || err(Error::database("acquiring", sqlx::Error::PoolTimedOut));
        for delivered in [1, 3, 50, 10_000] {
            for e in [from_dedupe(), from_handler(), pool()] {
                let Decision::Nak(delay) = decide(&e, delivered, &c) else {
                    panic!("delivery {delivered} of {e:?} was not nak'ed");
                };
                assert!(delay <= UNAVAILABLE_MAX_DELAY);
            }
        }
        // an error that is the event's own still ends in a dead letter
        let other = err(Error::database("inserting", sqlx::Error::RowNotFound));
        assert_eq!(
            decide(&other, 3, &c),
            Decision::DeadLetter(Reason::MaxDeliveries)
        );
    }

    #[test]
    fn a_panic_is_retried_with_backoff_then_dead_lettered_as_a_panic() {
        let c = config(3);
        let panicked = || {
            let payload: Box<dyn std::any::Any + Send> = Box::new("index out of range");
            let caught = futures::executor::block_on(crate::runtime::panics::catch(async move {
                std::panic::resume_unwind(payload)
            }));
            err(caught.unwrap_err())
        };
        assert_eq!(
            decide(&panicked(), 1, &c),
            Decision::Nak(Duration::from_secs(1))
        );
        assert_eq!(
            decide(&panicked(), 2, &c),
            Decision::Nak(Duration::from_secs(2))
        );
        assert_eq!(
            decide(&panicked(), 3, &c),
            Decision::DeadLetter(Reason::Panic)
        );
        assert_eq!(
            decide(&panicked(), 9, &c),
            Decision::DeadLetter(Reason::Panic)
        );
        let unlimited = config(-1);
        assert_eq!(
            decide(&panicked(), 99, &unlimited),
            Decision::Nak(unlimited.retry.delay(99))
        );
    }

    #[test]
    fn retry_after_overrides_the_policy() {
        let e = err(HandlerError::retry("busy").retry_after(Duration::from_millis(7)));
        assert_eq!(
            decide(&e, 1, &config(3)),
            Decision::Nak(Duration::from_millis(7))
        );
    }

    #[test]
    fn rejects_are_dead_lettered_with_their_reason() {
        let c = config(3);
        let rejected = err(HandlerError::reject("no such plan"));
        assert_eq!(
            decide(&rejected, 1, &c),
            Decision::DeadLetter(Reason::Rejected)
        );
        let decode = err(HandlerError::reject(Error::new(
            ErrorKind::Decode,
            "bad data",
        )));
        assert_eq!(
            decide(&decode, 1, &c),
            Decision::DeadLetter(Reason::UndecodablePayload)
        );
    }

    #[test]
    fn unrouted_types_are_acked_unless_configured_to_dead_letter() {
        let unroutable = err(Error::new(ErrorKind::Unroutable, "no route"));
        assert_eq!(decide(&unroutable, 1, &config(3)), Decision::Unrouted);
        let strict = config(3).unrouted(Unrouted::DeadLetter);
        assert_eq!(
            decide(&unroutable, 1, &strict),
            Decision::DeadLetter(Reason::Unroutable)
        );
    }

    #[test]
    fn a_deposed_leader_abandons_the_message() {
        let fenced = err(Error::new(ErrorKind::LeaseLost, "new leader"));
        assert_eq!(decide(&fenced, 1, &config(3)), Decision::Abandon);
        assert_eq!(decide(&fenced, 3, &config(3)), Decision::Abandon);
    }

    #[test]
    fn unknown_errors_are_retried() {
        let c = config(3);
        assert_eq!(
            decide(&err("timeout"), 1, &c),
            Decision::Nak(c.retry.delay(1))
        );
        let db = err(Error::new(ErrorKind::Database, "commit failed"));
        assert_eq!(decide(&db, 2, &c), Decision::Nak(c.retry.delay(2)));
    }
}
