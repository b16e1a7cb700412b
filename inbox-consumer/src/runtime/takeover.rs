//! Taking over an ordered consumer: the events a previous leader left
//! unfinished, and the later events of their subjects held back behind them.
//!
//! A leader that dies holds messages JetStream has delivered and not seen
//! acked: running, queued behind their subject, or just fetched. They come
//! back to the new leader only when their ack wait runs out, and not
//! necessarily in stream order (a message that waited in a queue got no
//! in-progress acks and expires first). Meanwhile the new leader fetches
//! later messages of the same subjects. So before it fetches anything, a new
//! leader [`scan`]s the stream between the consumer's ack floor and its last
//! delivered sequence, keeps the events its inbox has neither handled nor
//! dead-lettered, and lets each such subject run only its oldest unfinished
//! event next ([`Backlog`]); every other message of the subject waits, in
//! arrival order. Subjects with nothing unfinished are not held at all.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use outbox_pg::{Envelope, EventId};
use serde_json::Value;
use tokio::time::Instant;
use uuid::Uuid;

use super::process::Shared;
use crate::error::Error;

/// A job the backlog can hold: it knows its event.
pub(crate) trait Pending {
    /// The envelope subject.
    fn subject(&self) -> &str;
    /// The event id.
    fn event_id(&self) -> EventId;
}

impl Pending for super::Job {
    fn subject(&self) -> &str {
        self.1.subject()
    }

    fn event_id(&self) -> EventId {
        self.1.id()
    }
}

/// Events left unfinished by earlier leaders, per subject in stream order, and
/// the jobs held behind them.
#[derive(Debug)]
pub(crate) struct Backlog<J> {
    blocked: HashMap<String, VecDeque<EventId>>,
    held: HashMap<String, Vec<J>>,
    deadline: Option<Instant>,
}

impl<J> Default for Backlog<J> {
    fn default() -> Self {
        Self {
            blocked: HashMap::new(),
            held: HashMap::new(),
            deadline: None,
        }
    }
}

impl<J: Pending> Backlog<J> {
    /// Whether nothing is blocked (every job passes straight through).
    pub(crate) fn is_empty(&self) -> bool {
        self.blocked.is_empty()
    }

    /// Unfinished events, over all subjects.
    pub(crate) fn unfinished(&self) -> usize {
        self.blocked.values().map(VecDeque::len).sum()
    }

    /// Returns `job` if it may go to the dispatcher now: its subject has
    /// nothing unfinished, or it is that subject's oldest unfinished event.
    /// Otherwise holds it.
    pub(crate) fn admit(&mut self, job: J) -> Option<J> {
        let subject = job.subject();
        let Some(queue) = self.blocked.get(subject) else {
            return Some(job);
        };
        if queue.front() == Some(&job.event_id()) {
            return Some(job);
        }
        self.held.entry(subject.to_owned()).or_default().push(job);
        None
    }

    /// Event `id` of `subject` was acked or dead-lettered: the jobs that may go
    /// to the dispatcher now, in order.
    pub(crate) fn finished(&mut self, subject: &str, id: EventId) -> Vec<J> {
        let Some(queue) = self.blocked.get_mut(subject) else {
            return Vec::new();
        };
        if queue.front() != Some(&id) {
            return Vec::new();
        }
        queue.pop_front();
        if let Some(next) = queue.front().copied() {
            let held = self.held.entry(subject.to_owned()).or_default();
            return match held.iter().position(|job| job.event_id() == next) {
                Some(at) => vec![held.remove(at)],
                None => Vec::new(),
            };
        }
        self.blocked.remove(subject);
        self.held.remove(subject).unwrap_or_default()
    }

    /// Once the deadline has passed, gives up on the events that never came
    /// back (JetStream stopped redelivering them), logging each, and returns
    /// every held job, in arrival order per subject.
    pub(crate) fn expire(&mut self, consumer: &str, now: Instant) -> Vec<J> {
        if self.deadline.is_none_or(|deadline| now < deadline) || self.blocked.is_empty() {
            return Vec::new();
        }
        for (subject, events) in self.blocked.drain() {
            let events: Vec<String> = events.iter().map(ToString::to_string).collect();
            tracing::error!(
                consumer, %subject, ?events,
                "events left by an earlier leader never came back; later events of the subject go on without them",
            );
        }
        self.held.drain().flat_map(|(_, jobs)| jobs).collect()
    }

    /// The jobs held back.
    pub(crate) fn held(&self) -> impl Iterator<Item = &J> {
        self.held.values().flatten()
    }

    /// Makes event `id` the next of `subject` to run: a task of this leader
    /// ended without finishing it (a panic of the runtime itself). Later jobs
    /// of the subject [`admit`](Self::admit)ted from now on wait until it comes
    /// back and finishes, or until [`expire`](Self::expire) gives up on it
    /// after `deadline`.
    pub(crate) fn block(&mut self, subject: &str, id: EventId, deadline: Instant) {
        let queue = self.blocked.entry(subject.to_owned()).or_default();
        if !queue.contains(&id) {
            queue.push_front(id);
        }
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.max(deadline)));
    }
}

/// Finds the events that earlier leaders of `consumer` left unfinished.
///
/// # Errors
/// [`ErrorKind::Nats`](crate::ErrorKind::Nats) if the consumer or a stream
/// message cannot be read; [`ErrorKind::Database`](crate::ErrorKind::Database)
/// if the inbox cannot.
pub(crate) async fn scan<J: Pending>(
    shared: &Shared,
    consumer: &PullConsumer,
) -> Result<Backlog<J>, Error> {
    let durable = &shared.config.durable;
    let info = consumer
        .get_info()
        .await
        .map_err(|e| Error::nats(&format!("reading consumer `{durable}`"), e))?;
    if info.num_ack_pending == 0 {
        return Ok(Backlog::default());
    }
    let (floor, delivered) = (
        info.ack_floor.stream_sequence,
        info.delivered.stream_sequence,
    );
    let filters: Vec<&str> = if info.config.filter_subjects.is_empty() {
        [info.config.filter_subject.as_str()]
            .into_iter()
            .filter(|f| !f.is_empty())
            .collect()
    } else {
        info.config
            .filter_subjects
            .iter()
            .map(String::as_str)
            .collect()
    };
    let stream = shared
        .js
        .get_stream(&shared.config.stream)
        .await
        .map_err(|e| Error::nats(&format!("looking up stream `{}`", shared.config.stream), e))?;
    let mut events: Vec<(EventId, String)> = Vec::new();
    for sequence in floor.saturating_add(1)..=delivered {
        let message = match stream.get_raw_message(sequence).await {
            Ok(message) => message,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => continue,
            Err(e) => {
                return Err(Error::nats(
                    &format!("reading stream message {sequence}"),
                    e,
                ));
            }
        };
        if !filters.is_empty() && !filters.iter().any(|f| matches(f, &message.subject)) {
            continue;
        }
        // A replay for another consumer is acked unhandled when it comes back.
        if crate::dead_letter::replay_for_another(Some(&message.headers), durable).is_some() {
            continue;
        }
        // Poison has no subject to hold back; it is dead-lettered wherever it lands.
        if let Ok(envelope) = Envelope::<Value>::from_json(&message.payload) {
            events.push((envelope.id(), envelope.subject().to_owned()));
        }
    }
    let ids: Vec<Uuid> = events.iter().map(|(id, _)| *id.as_uuid()).collect();
    let done: HashSet<Uuid> = sqlx::query_file_scalar!("queries/done_events.sql", durable, &ids)
        .fetch_all(&shared.pool)
        .await
        .map_err(|e| Error::database("reading which pending events are done", e))?
        .into_iter()
        .collect();
    let mut backlog = Backlog::default();
    for (id, subject) in events {
        if !done.contains(id.as_uuid()) {
            backlog.blocked.entry(subject).or_default().push_back(id);
        }
    }
    if !backlog.is_empty() {
        let longest_wait = info
            .config
            .backoff
            .iter()
            .copied()
            .max()
            .unwrap_or_default()
            .max(info.config.ack_wait);
        backlog.deadline = Some(Instant::now() + longest_wait * 2 + Duration::from_secs(10));
        tracing::info!(
            consumer = %durable, events = backlog.unfinished(), subjects = backlog.blocked.len(),
            ack_floor = floor, delivered,
            "taking over: earlier leaders left events unfinished; later events of their subjects wait for them",
        );
    }
    Ok(backlog)
}

/// NATS subject matching: `*` is one token, a final `>` one or more.
fn matches(filter: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in filter.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(s)) if token == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct J(&'static str, EventId, u8);

    impl Pending for J {
        fn subject(&self) -> &str {
            self.0
        }
        fn event_id(&self) -> EventId {
            self.1
        }
    }

    fn backlog(blocked: &[(&str, &[EventId])]) -> Backlog<J> {
        let mut b = Backlog::default();
        for (subject, ids) in blocked {
            b.blocked
                .insert((*subject).to_owned(), ids.iter().copied().collect());
        }
        b.deadline = Some(Instant::now() + Duration::from_secs(60));
        b
    }

    #[test]
    fn a_subject_runs_its_unfinished_events_in_order_before_anything_later() {
        let (e1, e2, e3, e4) = (
            EventId::new(),
            EventId::new(),
            EventId::new(),
            EventId::new(),
        );
        let mut b = backlog(&[("s", &[e1, e2])]);
        // e2 comes back first, then a new event, then e1.
        assert_eq!(b.admit(J("s", e2, 1)), None);
        assert_eq!(b.admit(J("s", e3, 2)), None);
        assert_eq!(b.admit(J("s", e1, 3)), Some(J("s", e1, 3)));
        // Other subjects pass straight through.
        assert_eq!(b.admit(J("t", e4, 4)), Some(J("t", e4, 4)));
        // e1 done: e2 (held) goes next, alone.
        assert_eq!(b.finished("s", e1), vec![J("s", e2, 1)]);
        assert!(!b.is_empty());
        // e2 done: everything held goes, in arrival order, and the subject is free.
        assert_eq!(b.finished("s", e2), vec![J("s", e3, 2)]);
        assert!(b.is_empty());
        assert_eq!(b.admit(J("s", e3, 5)), Some(J("s", e3, 5)));
    }

    #[test]
    fn the_next_unfinished_event_waits_until_it_arrives() {
        let (e1, e2, e3) = (EventId::new(), EventId::new(), EventId::new());
        let mut b = backlog(&[("s", &[e1, e2])]);
        assert_eq!(b.admit(J("s", e1, 1)), Some(J("s", e1, 1)));
        assert_eq!(b.admit(J("s", e3, 2)), None);
        assert_eq!(b.finished("s", e1), vec![]);
        assert_eq!(b.admit(J("s", e2, 3)), Some(J("s", e2, 3)));
        assert_eq!(b.finished("s", e2), vec![J("s", e3, 2)]);
        // A finish that is not the subject's oldest changes nothing.
        assert_eq!(b.finished("s", e3), vec![]);
    }

    #[test]
    fn after_the_deadline_held_jobs_go_on_without_the_missing_events() {
        let (e1, e2) = (EventId::new(), EventId::new());
        let mut b = backlog(&[("s", &[e1])]);
        assert_eq!(b.admit(J("s", e2, 1)), None);
        assert_eq!(b.expire("c", Instant::now()), vec![]);
        let later = Instant::now() + Duration::from_secs(61);
        assert_eq!(b.expire("c", later), vec![J("s", e2, 1)]);
        assert!(b.is_empty());
        assert_eq!(b.held().count(), 0);
    }

    #[test]
    fn an_event_a_task_lost_runs_before_the_later_events_of_its_subject() {
        let (lost, later, other) = (EventId::new(), EventId::new(), EventId::new());
        let mut b: Backlog<J> = Backlog::default();
        b.block("s", lost, Instant::now() + Duration::from_secs(60));
        assert_eq!(b.admit(J("s", later, 1)), None);
        assert_eq!(b.admit(J("t", other, 2)), Some(J("t", other, 2)));
        // The lost event comes back, runs, finishes: the later one goes.
        assert_eq!(b.admit(J("s", lost, 3)), Some(J("s", lost, 3)));
        assert_eq!(b.finished("s", lost), vec![J("s", later, 1)]);
        assert!(b.is_empty());
        // Blocked again behind one that never comes back: released at the deadline.
        b.block("s", lost, Instant::now() + Duration::from_secs(60));
        b.block("s", lost, Instant::now());
        assert_eq!(b.unfinished(), 1);
        assert_eq!(b.admit(J("s", later, 4)), None);
        assert_eq!(b.expire("c", Instant::now()), vec![]);
        let after = Instant::now() + Duration::from_secs(61);
        assert_eq!(b.expire("c", after), vec![J("s", later, 4)]);
    }

    #[test]
    fn subject_filters_match_like_nats() {
        assert!(matches("a.b", "a.b"));
        assert!(!matches("a.b", "a.b.c"));
        assert!(!matches("a.b.c", "a.b"));
        assert!(matches("a.*", "a.b"));
        assert!(!matches("a.*", "a.b.c"));
        assert!(matches("a.>", "a.b.c"));
        assert!(!matches("a.>", "a"));
        assert!(matches(">", "a"));
        assert!(matches("*.b", "x.b"));
        assert!(!matches("a.b", "a.c"));
    }
}
