//! What a NATS server reports to a client that does something its user may
//! not: `-ERR 'Permissions Violation for Publish to "…"'` (or `for
//! Subscription to "…"`). The request itself gets no answer and times out,
//! so without this a missing permission looks like a broker that does not
//! answer. [`NatsArgs`](super::NatsArgs) installs an event callback that logs
//! every server error at error level, with its text (which names the
//! subject), and keeps the last permissions violation for the binaries'
//! start-up to stop on.

use std::collections::HashMap;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use async_nats::{Event, ServerError};

use crate::error::{Error, ErrorKind};

/// How often one and the same server error is logged again while it repeats.
const RELOG_EVERY: Duration = Duration::from_secs(60);

/// Distinct server errors remembered for [`RELOG_EVERY`]; past that the
/// memory starts again (each is then logged once more).
const REMEMBERED: usize = 256;

/// The server errors of the clients connected with one
/// [`NatsArgs`](super::NatsArgs) (and its clones): the last permissions
/// violation since the last `connect`, the tasks waiting for one, and when
/// each error was last logged.
#[derive(Clone, Default)]
pub(crate) struct Violations {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    last: Option<String>,
    waiting: Vec<Waker>,
    logged: HashMap<String, (Instant, u64)>,
}

impl Violations {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets the last violation (a new client starts clean).
    pub(crate) fn clear(&self) {
        self.state().last = None;
    }

    /// The last permissions violation, in the server's words.
    pub(crate) fn last(&self) -> Option<String> {
        self.state().last.clone()
    }

    /// Resolves with the last permissions violation, at once if there is
    /// one, else when the next is reported.
    pub(crate) async fn next(&self) -> String {
        poll_fn(|cx| {
            let mut state = self.state();
            if let Some(text) = &state.last {
                return Poll::Ready(text.clone());
            }
            if !state.waiting.iter().any(|w| w.will_wake(cx.waker())) {
                state.waiting.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// Takes in one client event: a server error is logged at error level
    /// (a slow consumer at warn), at most once a minute per distinct text,
    /// and a permissions violation is kept.
    pub(crate) fn observe(&self, event: &Event, client: &str, inbox_prefix: &str) {
        let Event::ServerError(error) = event else {
            return;
        };
        let text = match error {
            ServerError::Other(text) => text.clone(),
            other => other.to_string(),
        };
        let violation = is_permission_violation(&text);
        let repeated = {
            let mut state = self.state();
            if violation {
                state.last = Some(text.clone());
                for waker in state.waiting.drain(..) {
                    waker.wake();
                }
            }
            match log_now(&mut state.logged, &text, Instant::now()) {
                Some(repeated) => repeated,
                None => return,
            }
        };
        match error {
            ServerError::SlowConsumer(_) => tracing::warn!(
                client, error = %text, repeated,
                "NATS: a subscription of this client cannot keep up; messages were dropped",
            ),
            _ if violation => tracing::error!(
                client, error = %text, repeated,
                "NATS refused what this client asked for: {}",
                remedy(&text, inbox_prefix),
            ),
            _ => tracing::error!(client, error = %text, repeated, "NATS server error"),
        }
    }
}

impl std::fmt::Debug for Violations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Violations")
            .field("last", &self.last())
            .finish_non_exhaustive()
    }
}

/// Whether `time` is due for logging `text` again; returns how many times it
/// came since it was last logged.
fn log_now(logged: &mut HashMap<String, (Instant, u64)>, text: &str, now: Instant) -> Option<u64> {
    if let Some((at, repeated)) = logged.get_mut(text) {
        if now.duration_since(*at) < RELOG_EVERY {
            *repeated += 1;
            return None;
        }
        let times = *repeated;
        *at = now;
        *repeated = 0;
        return Some(times);
    }
    if logged.len() >= REMEMBERED {
        logged.clear();
    }
    logged.insert(text.to_owned(), (now, 0));
    Some(0)
}

/// `Permissions Violation for Publish to "…"`, `… for Subscription to "…"`.
fn is_permission_violation(text: &str) -> bool {
    text.starts_with("Permissions Violation")
}

/// The first quoted subject of a server error.
fn quoted_subject(text: &str) -> Option<&str> {
    let (_, rest) = text.split_once('"')?;
    rest.split_once('"').map(|(subject, _)| subject)
}

/// What to change for the violation `text`, for a client whose replies come
/// on `inbox_prefix.>`.
fn remedy(text: &str, inbox_prefix: &str) -> String {
    let subject = quoted_subject(text).unwrap_or("the subject");
    if text.contains("for Subscription") {
        let inbox = subject
            .strip_prefix(inbox_prefix)
            .is_some_and(|rest| rest.starts_with('.'));
        if inbox {
            format!(
                "the client's replies (JetStream's answers, pulled messages) come on \
                 `{inbox_prefix}.>`: allow the user to subscribe to it, or give \
                 --nats-inbox-prefix the prefix it may subscribe to (docs/security.md, \"NATS\")"
            )
        } else {
            format!(
                "allow `{subject}` in the user's `subscribe` permissions (docs/security.md, \"NATS\")"
            )
        }
    } else {
        format!(
            "allow `{subject}` in the user's `publish` permissions (docs/security.md, \"NATS\")"
        )
    }
}

/// The start-up error for the violation `text`.
pub(crate) fn denied(text: &str, shown_url: &str, inbox_prefix: &str) -> Error {
    Error::new(
        ErrorKind::Broker,
        format!(
            "NATS at {shown_url} refused this client: {text}; {}",
            remedy(text, inbox_prefix)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const PUBLISH: &str = r#"Permissions Violation for Publish to "$JS.API.STREAM.INFO.OUTBOX""#;
    const INBOX: &str = r#"Permissions Violation for Subscription to "_INBOX_billing.AbC.*""#;

    #[test]
    fn the_remedy_names_the_subject_and_the_permission_list() {
        let shown = denied(PUBLISH, "nats://127.0.0.1:4222", "_INBOX").to_string();
        assert!(
            shown.contains("allow `$JS.API.STREAM.INFO.OUTBOX` in the user's `publish`"),
            "{shown}"
        );
        let shown = denied(INBOX, "nats://n:4222", "_INBOX_billing").to_string();
        assert!(shown.contains("`_INBOX_billing.>`"), "{shown}");
        assert!(shown.contains("--nats-inbox-prefix"), "{shown}");
        let other = r#"Permissions Violation for Subscription to "events.>""#;
        let shown = denied(other, "nats://n:4222", "_INBOX").to_string();
        assert!(
            shown.contains("allow `events.>` in the user's `subscribe`"),
            "{shown}"
        );
    }

    #[test]
    fn a_repeated_error_is_logged_once_a_minute_with_its_count() {
        let mut logged = HashMap::new();
        let t0 = Instant::now();
        assert_eq!(log_now(&mut logged, "e", t0), Some(0));
        assert_eq!(log_now(&mut logged, "e", t0 + Duration::from_secs(1)), None);
        assert_eq!(log_now(&mut logged, "e", t0 + Duration::from_secs(2)), None);
        assert_eq!(
            log_now(&mut logged, "f", t0 + Duration::from_secs(2)),
            Some(0)
        );
        assert_eq!(
            log_now(&mut logged, "e", t0 + Duration::from_secs(61)),
            Some(2)
        );
    }

    #[tokio::test]
    async fn a_violation_wakes_whoever_waits_for_one_until_cleared() {
        let violations = Violations::default();
        let waiting = tokio::spawn({
            let violations = violations.clone();
            async move { violations.next().await }
        });
        tokio::task::yield_now().await;
        violations.observe(
            &Event::ServerError(ServerError::Other("Stale Connection".into())),
            "t",
            "_INBOX",
        );
        assert_eq!(violations.last(), None, "not a permissions violation");
        violations.observe(
            &Event::ServerError(ServerError::Other(PUBLISH.into())),
            "t",
            "_INBOX",
        );
        assert_eq!(waiting.await.unwrap(), PUBLISH);
        assert_eq!(
            violations.next().await,
            PUBLISH,
            "at once once there is one"
        );
        violations.clear();
        assert_eq!(violations.last(), None);
    }
}
