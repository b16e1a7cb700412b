//! The acknowledgement decision: what a delivery's result means for JetStream.
//!
//! | result | JetStream |
//! | --- | --- |
//! | `Ok(Handled / Duplicate / Stale)` (committed) | `+ACK`, confirmed (`double_ack`) |
//! | retryable error (rolled back) | `-NAK {delay}`, delay from [`RetryPolicy`] or [`HandlerError::retry_after`] |
//! | retryable error on the last allowed delivery | dead letter (`max_deliveries`), then `+TERM` |
//! | reject, undecodable payload, no route | dead letter, then `+TERM` |
//! | [`ErrorKind::LeaseLost`] (an ordered consumer's deposed leader) | nothing: the new leader gets it |
//!
//! An error this crate does not know (from a third-party layer) is retried.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};

use crate::poison::Reason;
use crate::retry::RetryPolicy;
use crate::delivery::Outcome;
use crate::error::{Action, BoxError, Error, ErrorKind, HandlerError};

/// What to do with a message once its delivery finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    Ack(Outcome),
    Nak(Duration),
    DeadLetter(Reason),
    /// Another replica leads now: leave the message to it, neither ack nor nak.
    Abandon,
}

/// Decides the acknowledgement for a delivery's result.
pub(crate) fn decide(
    result: &Result<Outcome, BoxError>,
    delivered: u64,
    max_deliver: i64,
    retry: &RetryPolicy,
) -> Decision {
    let error = match result {
        Ok(outcome) => return Decision::Ack(*outcome),
        Err(error) => error,
    };
    match classify(error.as_ref()) {
        Classified::Reject(reason) => Decision::DeadLetter(reason),
        Classified::Abandon => Decision::Abandon,
        Classified::Retry(after) => {
            let last = u64::try_from(max_deliver).is_ok_and(|max| max > 0 && delivered >= max);
            if last {
                Decision::DeadLetter(Reason::MaxDeliveries)
            } else {
                Decision::Nak(after.unwrap_or_else(|| retry.delay(delivered)))
            }
        }
    }
}

enum Classified {
    Retry(Option<Duration>),
    Reject(Reason),
    Abandon,
}

fn classify(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Classified {
    if error
        .downcast_ref::<Error>()
        .is_some_and(|e| e.kind() == ErrorKind::LeaseLost)
    {
        return Classified::Abandon;
    }
    if let Some(handler) = error.downcast_ref::<HandlerError>() {
        return match handler.action() {
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
        Ok(Err(e)) => Err(Error::nats(&format!("sending {kind:?}"), e)),
        Err(elapsed) => Err(
            Error::new(ErrorKind::Nats, format!("sending {kind:?} timed out")).with_source(elapsed),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(e: impl Into<BoxError>) -> Result<Outcome, BoxError> {
        Err(e.into())
    }

    #[test]
    fn committed_outcomes_are_acked() {
        let p = RetryPolicy::default();
        for o in [Outcome::Handled, Outcome::Duplicate, Outcome::Stale] {
            assert_eq!(decide(&Ok(o), 1, 5, &p), Decision::Ack(o));
        }
    }

    #[test]
    fn retries_nak_with_growing_delay_until_the_last_delivery() {
        let p = RetryPolicy::default().base(Duration::from_secs(1));
        let e = || err(HandlerError::retry("db down"));
        assert_eq!(
            decide(&e(), 1, 3, &p),
            Decision::Nak(Duration::from_secs(1))
        );
        assert_eq!(
            decide(&e(), 2, 3, &p),
            Decision::Nak(Duration::from_secs(2))
        );
        assert_eq!(
            decide(&e(), 3, 3, &p),
            Decision::DeadLetter(Reason::MaxDeliveries)
        );
        // unlimited deliveries never dead-letter a retry
        assert_eq!(decide(&e(), 99, -1, &p), Decision::Nak(p.delay(99)));
    }

    #[test]
    fn retry_after_overrides_the_policy() {
        let p = RetryPolicy::default();
        let e = err(HandlerError::retry("busy").retry_after(Duration::from_millis(7)));
        assert_eq!(
            decide(&e, 1, 3, &p),
            Decision::Nak(Duration::from_millis(7))
        );
    }

    #[test]
    fn rejects_are_dead_lettered_with_their_reason() {
        let p = RetryPolicy::default();
        let rejected = err(HandlerError::reject("no such plan"));
        assert_eq!(
            decide(&rejected, 1, 3, &p),
            Decision::DeadLetter(Reason::Rejected)
        );
        let decode = err(HandlerError::reject(Error::new(
            ErrorKind::Decode,
            "bad data",
        )));
        assert_eq!(
            decide(&decode, 1, 3, &p),
            Decision::DeadLetter(Reason::UndecodablePayload)
        );
        let unroutable = err(Error::new(ErrorKind::Unroutable, "no route"));
        assert_eq!(
            decide(&unroutable, 1, 3, &p),
            Decision::DeadLetter(Reason::Unroutable)
        );
    }

    #[test]
    fn a_deposed_leader_abandons_the_message() {
        let p = RetryPolicy::default();
        let fenced = err(Error::new(ErrorKind::LeaseLost, "new leader"));
        assert_eq!(decide(&fenced, 1, 3, &p), Decision::Abandon);
        assert_eq!(decide(&fenced, 3, 3, &p), Decision::Abandon);
    }

    #[test]
    fn unknown_errors_are_retried() {
        let p = RetryPolicy::default();
        assert_eq!(decide(&err("timeout"), 1, 3, &p), Decision::Nak(p.delay(1)));
        let db = err(Error::new(ErrorKind::Database, "commit failed"));
        assert_eq!(decide(&db, 2, 3, &p), Decision::Nak(p.delay(2)));
    }
}
