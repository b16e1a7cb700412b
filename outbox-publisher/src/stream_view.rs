//! The relay's view of its stream, kept up to date while it runs.
//!
//! An operator edits a stream under a running relay (`nats stream edit`:
//! subjects added, limits raised or lowered), or deletes and recreates it.
//! The relay must not judge a row by the stream as it was at start, so the
//! sink and the audit share one [`StreamView`]: the stream's config as last
//! read, re-read
//!
//! - every [`RelayConfig::stream_refresh`](crate::RelayConfig::stream_refresh)
//!   (30 s by default), by the running relay;
//! - on demand, when a row looks uncapturable by the view or the broker
//!   refuses a message (at most one read per 250 ms, shared by every
//!   publish that asks meanwhile: the cost stays bounded however many rows
//!   ask);
//! - by each audit pass, which reads the stream anyway.
//!
//! Every change is logged once (one line naming what changed); a stream that
//! is gone is said at warn level once and shown by the gauge
//! `outbox_relay_stream_up` (0 while it is gone), and its return once at info.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::Config};
use tracing::{debug, info, warn};

use crate::error::{Error, ErrorKind, Result};
use crate::stream::{edit_command, is_not_found, subject_matches};

/// On-demand re-reads are at most this frequent: a publish that asks within
/// this long after a read began uses that read.
const RECHECK_GAP: Duration = Duration::from_millis(250);

/// Bound on the event types whose "not captured" is remembered as logged;
/// past it, further ones are logged at debug level until the subjects change.
const LOGGED_TYPES: usize = 1_024;

/// The stream's config as last read, shared by the sink and the audit.
/// Cloning shares it.
#[derive(Clone)]
pub struct StreamView {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    js: jetstream::Context,
    timeout: Duration,
    state: RwLock<State>,
    /// Held while a read is in flight: one read at a time.
    reading: tokio::sync::Mutex<()>,
    /// Event types whose "not captured" was logged since the subjects last
    /// changed.
    logged: Mutex<HashSet<String>>,
}

struct State {
    /// `None` while the stream is known not to exist.
    config: Option<Arc<Config>>,
    /// When the read that produced `config` began.
    read_at: Instant,
    /// When the last read (successful or not) began.
    tried_at: Instant,
    /// Why the last read failed, if it did.
    failed: Option<String>,
}

impl fmt::Debug for StreamView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = self.config();
        f.debug_struct("StreamView")
            .field("stream", &self.inner.name)
            .field("exists", &config.is_some())
            .field("subjects", &config.as_ref().map(|c| c.subjects.clone()))
            .finish_non_exhaustive()
    }
}

/// What a re-read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// The same config as before.
    None,
    /// Another config (subjects, limits, …), or the stream is back.
    Changed,
    /// The stream no longer exists (or did not before either).
    Gone,
}

impl StreamView {
    /// A view of the stream whose config is `config` (as
    /// [`StreamSpec::ensure`](crate::StreamSpec::ensure) returns it), read
    /// again through `js`, each read bounded by `timeout`.
    pub fn new(js: jetstream::Context, config: Config, timeout: Duration) -> Self {
        crate::metrics::stream_up(true);
        Self {
            inner: Arc::new(Inner {
                name: config.name.clone(),
                js,
                timeout,
                state: RwLock::new(State {
                    config: Some(Arc::new(config)),
                    read_at: Instant::now(),
                    tried_at: Instant::now(),
                    failed: None,
                }),
                reading: tokio::sync::Mutex::new(()),
                logged: Mutex::new(HashSet::new()),
            }),
        }
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The config as last read; `None` while the stream is known to be gone.
    pub fn config(&self) -> Option<Arc<Config>> {
        self.read_state(|s| s.config.clone())
    }

    /// Whether the stream, as last read, captures `subject`.
    pub fn captures(&self, subject: &str) -> bool {
        self.config()
            .is_some_and(|c| c.subjects.iter().any(|f| subject_matches(f, subject)))
    }

    fn read_state<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self
            .inner
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// Reads the stream's config again (now, whatever the last read's age;
    /// a read already in flight is waited for and, since it began after
    /// this call, used), logs what changed and returns it; `None` if the
    /// stream does not exist.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] if the stream cannot be read (not reachable,
    /// no answer within the timeout); the view stays as it was.
    pub async fn refresh(&self) -> Result<Option<Arc<Config>>> {
        self.read_after(Instant::now(), Duration::ZERO)
            .await
            .map(|_| self.config())
    }

    /// Re-reads on demand (a row looks uncapturable, the broker refused a
    /// message), unless a read began less than [`RECHECK_GAP`] ago, whose
    /// outcome is then taken. Returns the config as just read and whether it
    /// changed.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] if the stream could not be read: nothing may be
    /// judged by the view then (the view stays as it was).
    pub(crate) async fn recheck(&self) -> Result<(Option<Arc<Config>>, Change)> {
        let change = self.read_after(Instant::now(), RECHECK_GAP).await?;
        Ok((self.config(), change))
    }

    /// Reads unless a read began at or after `asked - gap`, whose outcome
    /// is then returned (as `Change::None`, or its error).
    async fn read_after(&self, asked: Instant, gap: Duration) -> Result<Change> {
        let _reading = self.inner.reading.lock().await;
        let (tried, failed) = self.read_state(|s| (s.tried_at, s.failed.clone()));
        if tried + gap >= asked {
            return match failed {
                None => Ok(Change::None),
                Some(why) => Err(Error::new(ErrorKind::Broker, why)),
            };
        }
        let started = Instant::now();
        let result = self.read().await;
        let mut state = self
            .inner
            .state
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        state.tried_at = started;
        state.failed = result.as_ref().err().map(ToString::to_string);
        drop(state);
        match result {
            Ok(read) => Ok(self.set(read, started)),
            Err(e) => {
                debug!(stream = %self.inner.name, error = %e, "reading the stream failed");
                Err(e)
            }
        }
    }

    /// The stream's config from the server, `None` if it does not exist.
    async fn read(&self) -> Result<Option<Config>> {
        tokio::time::timeout(self.inner.timeout, async {
            match self.inner.js.get_stream(&self.inner.name).await {
                Ok(stream) => Ok(Some(stream.cached_info().config.clone())),
                Err(e) if is_not_found(&e) => Ok(None),
                Err(e) => Err(Error::new(
                    ErrorKind::Broker,
                    format!("reading stream `{}`: {e}", self.inner.name),
                )
                .with_source(e)),
            }
        })
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Broker,
                format!(
                    "reading stream `{}`: no answer within {}",
                    self.inner.name,
                    outbox_pg::HumanDuration(self.inner.timeout)
                ),
            )
        })?
    }

    /// Takes a config read elsewhere (the audit's read of the stream).
    pub(crate) fn observe(&self, config: &Config, started: Instant) {
        if config.name == self.inner.name {
            self.set(Some(config.clone()), started);
        }
    }

    /// Stores what a read that began at `started` found, unless a later
    /// read is already stored, and logs the change.
    fn set(&self, read: Option<Config>, started: Instant) -> Change {
        let mut state = self
            .inner
            .state
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if state.read_at > started {
            return Change::None;
        }
        state.read_at = started;
        let old = state.config.clone();
        let name = &self.inner.name;
        match (old.as_deref(), read) {
            (Some(_), None) => {
                state.config = None;
                drop(state);
                crate::metrics::stream_up(false);
                warn!(
                    stream = %name,
                    "stream `{name}` no longer exists: rows wait, without losing attempts, until it \
                     exists again; the relay does not recreate it while it runs (create it, e.g. \
                     `nats stream add {name} --subjects …`, or restart the relay with --subjects)"
                );
                Change::Gone
            }
            (None, None) => Change::Gone,
            (None, Some(new)) => {
                crate::metrics::stream_up(true);
                info!(
                    stream = %name,
                    subjects = ?new.subjects,
                    max_msg_size = new.max_message_size,
                    "stream `{name}` exists again; publishing resumes"
                );
                state.config = Some(Arc::new(new));
                drop(state);
                self.forget_logged();
                Change::Changed
            }
            (Some(old), Some(new)) => {
                let changes = differences(old, &new);
                if changes.is_empty() {
                    return Change::None;
                }
                let subjects_changed = old.subjects != new.subjects;
                state.config = Some(Arc::new(new));
                drop(state);
                if subjects_changed {
                    self.forget_logged();
                }
                info!(
                    stream = %name,
                    changes = %changes.join("; "),
                    "the stream's configuration changed; the relay follows it"
                );
                Change::Changed
            }
        }
    }

    fn forget_logged(&self) {
        self.inner
            .logged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Logs once per event type (until the subjects change) that the stream
    /// does not capture `event_type`, with the command that makes it.
    pub(crate) fn note_uncaptured(&self, event_type: &str, config: &Config) {
        let first = {
            let mut logged = self
                .inner
                .logged
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            logged.len() < LOGGED_TYPES && logged.insert(event_type.to_owned())
        };
        if first {
            warn!(
                stream = %self.inner.name,
                event_type,
                subjects = ?config.subjects,
                "the stream does not capture this event type: its rows wait in the retry lane, \
                 without losing attempts, and are published once it does; add it: `{}`",
                edit_command(config, &[event_type.to_owned()])
            );
        } else {
            debug!(stream = %self.inner.name, event_type, "event type still not captured");
        }
    }
}

/// What differs between two configs of a stream, in the settings the relay
/// and the audit depend on.
fn differences(old: &Config, new: &Config) -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! field {
        ($label:literal, $($f:ident).+) => {
            if old.$($f).+ != new.$($f).+ {
                out.push(format!(
                    concat!($label, " {:?} → {:?}"),
                    old.$($f).+,
                    new.$($f).+
                ));
            }
        };
    }
    // A limit of 0 or -1 is no limit.
    macro_rules! limit {
        ($label:literal, $f:ident) => {
            let (a, b) = (i64::from(old.$f).max(-1), i64::from(new.$f).max(-1));
            if a.max(0) != b.max(0) {
                out.push(format!(concat!($label, " {} → {}"), a, b));
            }
        };
    }
    field!("subjects", subjects);
    limit!("max_msg_size", max_message_size);
    limit!("max_msgs", max_messages);
    limit!("max_bytes", max_bytes);
    limit!("max_msgs_per_subject", max_messages_per_subject);
    field!("max_age", max_age);
    field!("discard", discard);
    field!("retention", retention);
    field!("storage", storage);
    field!("replicas", num_replicas);
    field!("duplicate_window", duplicate_window);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_the_relay_depends_on_are_compared() {
        let old = Config {
            name: "S".into(),
            subjects: vec!["a.>".into()],
            max_message_size: -1,
            ..Default::default()
        };
        assert!(differences(&old, &old.clone()).is_empty());
        // 0 and -1 both mean no limit.
        let unlimited = Config {
            max_message_size: 0,
            max_messages: -1,
            ..old.clone()
        };
        assert!(differences(&old, &unlimited).is_empty());
        let new = Config {
            subjects: vec!["a.>".into(), "b.>".into()],
            max_message_size: 1_000,
            max_messages: 10,
            ..old.clone()
        };
        let changes = differences(&old, &new);
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert!(changes[0].starts_with("subjects"), "{changes:?}");
        assert!(changes[1].contains("-1 → 1000"), "{changes:?}");
    }
}
