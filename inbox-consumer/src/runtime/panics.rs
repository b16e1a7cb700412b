//! A panicking handler is its event's failure, not the runtime's.
//!
//! The runtime drives each service call (tower's `oneshot`: `poll_ready`,
//! `call`, then the response future, as one future) inside
//! [`catch`], which catches a panic anywhere in it, in the handler or in a
//! layer. The panic becomes [`Panicked`], a failed result like any other:
//! counted (`inbox_handler_panics_total`, labels `consumer` and
//! `event_type`), logged once per attempt at `error` with the event id and
//! the panic's message, then nak'ed with the [`RetryPolicy`](crate::RetryPolicy)
//! delay (an ordered consumer retries it in place, holding its subject), and
//! dead-lettered with reason [`Panic`](crate::Reason::Panic) once the
//! delivery budget ([`ConsumerConfig::max_deliver`](super::ConsumerConfig::max_deliver))
//! is spent. The task that runs the delivery goes on, so its subject is
//! never freed by a panic, and the message is never left to redeliver
//! forever.
//!
//! # Unwind safety
//!
//! The caught future is wrapped in [`AssertUnwindSafe`]. That is sound here
//! because nothing it leaves behind is used again:
//!
//! - the future owns its service clone, its delivery and, inside
//!   [`Dedupe`](crate::Dedupe), the transaction; after a panic it is dropped
//!   without being polled again, and a transaction dropped before its commit
//!   rolls back (sqlx sends the `ROLLBACK` before the connection is used
//!   again), so none of the event's effects, nor its inbox row, remain;
//! - what it shares with the rest of the runtime is the connection pool and
//!   the metrics recorder, both synchronised and never left half-updated by
//!   a caller that unwinds; the runtime's own state (the message, its
//!   delivery count, the session's subjects) lives outside the caught future.
//!
//! What the runtime cannot roll back is a handler's own state outside the
//! transaction. A handler must therefore not, across a point where it may
//! panic:
//!
//! - leave state shared between its clones (a cache or counter behind an
//!   `Arc<Mutex<…>>`) half-updated: the next event sees it as it was left,
//!   and a `std::sync::Mutex` held during the panic is poisoned (recover it
//!   with `lock().unwrap_or_else(PoisonError::into_inner)` or use a lock that
//!   does not poison);
//! - count on work outside the transaction (HTTP calls, files, messages)
//!   being undone: it happened, and it happens again on each retry;
//! - spawn tasks that outlive it and write on its behalf.
//!
//! # Requirements and output
//!
//! Catching needs `panic = "unwind"`, Rust's default. A binary built with
//! `panic = "abort"` in a profile ends at the first panic, whatever the
//! runtime does: its messages come back to the next process after
//! `ack_wait`, which panics on the same event again. None of this
//! workspace's profiles sets it; a service embedding the consumer must not
//! either.
//!
//! The process's panic hook still runs before the unwinding is caught: the
//! default hook prints `thread '…' panicked at …` (with the location) to
//! stderr. The runtime's own log line, at `error`, is the one naming the
//! consumer, the event id, its subject and stream sequence, the attempt, the
//! panic's message and what happens next.
//!
//! In a batch ([`Consumer::run_batched`](super::Consumer::run_batched)) a
//! panic cannot be pinned on one delivery: the whole batch rolls back, is
//! logged with its event ids, and its deliveries are handled one at a time,
//! so only the one that panics again fails (and is counted, nak'ed or
//! dead-lettered); the others are handled once each.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;

use super::config::ConsumerConfig;
use crate::metrics::names;

/// The failure of a delivery whose service call panicked: its panic's message.
#[derive(Debug)]
pub(crate) struct Panicked {
    message: String,
}

impl Panicked {
    /// The panic's message (see [`message`]).
    pub(crate) fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Panicked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the handler panicked: {}", self.message)
    }
}

impl std::error::Error for Panicked {}

/// Runs `call` to its end, or catches a panic of any of its polls as
/// [`Panicked`]. `call` is dropped after a panic, never polled again (see
/// [Unwind safety](self#unwind-safety)).
///
/// # Errors
/// [`Panicked`] with the panic's message when a poll of `call` panicked.
pub(crate) async fn catch<F: Future>(call: F) -> Result<F::Output, Panicked> {
    AssertUnwindSafe(call)
        .catch_unwind()
        .await
        .map_err(|payload| Panicked {
            message: message(&*payload),
        })
}

/// The message of a panic's payload: the `&'static str` of `panic!("…")`
/// without arguments, the `String` of a formatted `panic!`, of `unwrap`,
/// `expect` or an index out of range. A payload of another type
/// (`std::panic::panic_any`) has no message to show, and says so.
pub(crate) fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&'static str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(the panic's payload is not a string)".to_owned()
    }
}

/// Counts one panicked attempt of a delivery of `event_type`.
pub(crate) fn count(consumer: &str, event_type: &str) {
    metrics::counter!(
        names::HANDLER_PANICS,
        "consumer" => consumer.to_owned(),
        "event_type" => event_type.to_owned(),
    )
    .increment(1);
}

/// Starts `inbox_handler_panics_total` at zero for each event type the
/// durable is filtered to (a filter subject without wildcards is an event
/// type: the relay publishes each event on its type), so that the series
/// exists before the first panic and the first one is an increase
/// Prometheus sees. Types reached through a wildcard appear at their first
/// panic.
pub(crate) fn register(config: &ConsumerConfig) {
    let literal = |subject: &&String| !subject.split('.').any(|t| t == "*" || t == ">");
    for event_type in config.filter_subjects.iter().filter(literal) {
        metrics::counter!(
            names::HANDLER_PANICS,
            "consumer" => config.durable.clone(),
            "event_type" => event_type.clone(),
        )
        .increment(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload_of(f: impl FnOnce() + std::panic::UnwindSafe) -> Box<dyn Any + Send> {
        std::panic::catch_unwind(f).unwrap_err()
    }

    #[test]
    fn the_message_is_read_from_str_and_string_payloads() {
        let fields: Vec<u8> = Vec::new();
        let cases: [(Box<dyn Any + Send>, &str); 5] = [
            (payload_of(|| panic!("a literal")), "a literal"),
            (payload_of(|| panic!("formatted {}", 7)), "formatted 7"),
            (
                payload_of(|| {
                    let none: Option<u8> = std::hint::black_box(None);
                    none.expect("the field is set");
                }),
                "the field is set",
            ),
            (
                payload_of(move || {
                    let _ = fields[3];
                }),
                "index out of bounds: the len is 0 but the index is 3",
            ),
            (
                payload_of(|| std::panic::panic_any(42_u32)),
                "(the panic's payload is not a string)",
            ),
        ];
        for (payload, expected) in cases {
            assert_eq!(message(&*payload), expected);
        }
        // A boxed payload is read through, not taken as the `Any` itself.
        let boxed: Box<dyn Any + Send> = Box::new(String::from("inside"));
        assert_eq!(message(boxed.as_ref()), "inside");
    }

    #[test]
    fn a_panic_anywhere_in_the_call_is_caught_and_the_rest_runs_on() {
        futures::executor::block_on(async {
            let ok = catch(async { 5 }).await;
            assert_eq!(ok.ok(), Some(5));
            let panicked = catch(async {
                futures::future::ready(()).await;
                let none: Option<u8> = std::hint::black_box(None);
                none.unwrap()
            })
            .await
            .unwrap_err();
            assert_eq!(
                panicked.message(),
                "called `Option::unwrap()` on a `None` value"
            );
            assert_eq!(
                panicked.to_string(),
                "the handler panicked: called `Option::unwrap()` on a `None` value"
            );
            // A panic in a layer's `poll_ready` or `call`, not only in its
            // future: `oneshot` runs both inside the caught future.
            for at in [At::PollReady, At::Call] {
                let caught = catch(tower::ServiceExt::oneshot(Panics(at), ())).await;
                let expected = format!("in {at:?}");
                assert_eq!(caught.map_err(|p| p.message().to_owned()), Err(expected));
            }
        });
    }

    #[derive(Debug, Clone, Copy)]
    enum At {
        PollReady,
        Call,
    }

    /// A service that panics in `poll_ready` or in `call`.
    struct Panics(At);

    impl tower::Service<()> for Panics {
        type Response = ();
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<(), Self::Error>>;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            if let At::PollReady = self.0 {
                panic!("in {:?}", self.0);
            }
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, (): ()) -> Self::Future {
            panic!("in {:?}", self.0);
        }
    }
}
