//! Messages no client can read: found by their stream sequence, settled as
//! dead letters.
//!
//! The NATS client drops its connection on a message whose header block it
//! cannot read (see [`crate::header_block`]) and never hands it over, so the
//! runtime never counts a delivery of it and its delivery budget never
//! starts: JetStream would redeliver it every `ack_wait` for ever, each time
//! taking the connection (and every other message in flight on it) down.
//! Nothing the runtime receives can tell it which message that was. The
//! consumer's ack floor can: such a message is never acked, so once every
//! message before it is settled the floor stops just below it.
//!
//! So while messages are pending and the floor has not moved since the last
//! look ([`SWEEP_EVERY`], at the durable's info the lag task reads), the
//! runtime reads the first stored message of the
//! consumer's subjects after the floor through JetStream's message-get API,
//! which answers in JSON with the header block base64-encoded, so the
//! client's reader never sees it. If the client could read that block, the
//! message is held by a replica or on its way back, and the sweep stops. If
//! not, no replica can ever have it: it is recorded in `inbox_dead_letters`
//! (reason `undecodable_headers`, the readable header lines in `headers`,
//! the block byte for byte in `raw_headers`, the body as stored), then
//! terminated through its ack subject (which names the stream, the durable
//! and the stream sequence; the server needs no delivery of it); the next
//! message after it is looked at in turn, up to [`MOST_PER_SWEEP`].
//!
//! Sound because each step only ever settles a message no client could
//! read: a message some replica holds is never terminated under it. A dead
//! letter written again (its term lost, a later sweep) is found by its
//! stream sequence and bytes and not written twice; two replicas of an
//! unordered consumer sweeping the same message at the same moment may
//! both write one (both rows are kept, as `insert_dead_letter.sql` says). An ordered
//! consumer sweeps while it leads; its takeover reader, which reads the
//! stream through the client too, steps over such a message the same way
//! ([`settle_next`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use base64::Engine as _;
use serde::Deserialize;

use super::process::{self, Shared};
use crate::dead_letter::Reason;
use crate::delivery::DeliveryInfo;
use crate::error::{Error, ErrorKind};
use crate::header_block::{self, HeaderBlock};

/// How often the ack floor is looked at.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(2);
/// The most messages one sweep settles.
const MOST_PER_SWEEP: usize = 64;
/// Bound on each request of a sweep.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A message as the stream stores it.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(crate) sequence: u64,
    subject: String,
    headers: Vec<u8>,
    payload: Vec<u8>,
}

impl Stored {
    /// The header block as the client would read it; a message stored
    /// without one is read whole.
    fn header_block(&self) -> HeaderBlock {
        if self.headers.is_empty() {
            return HeaderBlock::default();
        }
        header_block::read(&self.headers)
    }
}

/// Sweeps every [`SWEEP_EVERY`] until dropped, judging by the durable's
/// info as the lag task last read it (`Shared::info`, every second).
pub(super) async fn sweep_periodically(shared: Arc<Shared>) {
    let mut sweep = Sweep::default();
    let mut failing = false;
    let mut ticks = tokio::time::interval(SWEEP_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let info = shared.info.borrow().clone();
        let Some(info) = info else { continue };
        match sweep.once(&shared, &info).await {
            Ok(()) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(consumer = %shared.config.durable, "looking for unreadable messages again");
                }
            }
            // A warning once (a stream the user may not read by sequence
            // leaves unreadable messages unsettled), the repeats at debug.
            Err(e) if !std::mem::replace(&mut failing, true) => tracing::warn!(
                consumer = %shared.config.durable, error = %e,
                "cannot read the stream by sequence to settle messages no client can read; trying again",
            ),
            Err(e) => {
                tracing::debug!(consumer = %shared.config.durable, error = %e, "could not look for unreadable messages; next time");
            }
        }
    }
}

/// What a sweep remembers between looks.
#[derive(Debug, Default)]
struct Sweep {
    /// The floor at the last look.
    floor: Option<u64>,
    /// Sequences settled while the floor had not passed them yet.
    settled: BTreeSet<u64>,
}

impl Sweep {
    async fn once(
        &mut self,
        shared: &Shared,
        info: &jetstream::consumer::Info,
    ) -> Result<(), Error> {
        let floor = info.ack_floor.stream_sequence;
        self.settled = self.settled.split_off(&floor.saturating_add(1));
        let moved = self.floor.replace(floor) != Some(floor);
        if info.num_ack_pending == 0 || moved {
            return Ok(());
        }
        let filters = filters_of(&info.config);
        let delivered = info.delivered.stream_sequence;
        tracing::debug!(
            consumer = %shared.config.durable, floor, delivered, pending = info.num_ack_pending,
            "the ack floor has not moved: looking at the messages after it",
        );
        let mut after = floor;
        for _ in 0..MOST_PER_SWEEP {
            let Some(stored) =
                next_stored(&shared.js, &shared.config.stream, &filters, after).await?
            else {
                return Ok(());
            };
            if stored.sequence > delivered {
                return Ok(());
            }
            after = stored.sequence;
            if self.settled.contains(&stored.sequence) {
                continue;
            }
            let block = stored.header_block();
            if block.readable() {
                // Held by a replica, or on its way back: the floor waits on it.
                tracing::debug!(consumer = %shared.config.durable, stream_sequence = stored.sequence, "readable: held, or on its way back");
                return Ok(());
            }
            if !settle(shared, &stored, &block).await {
                return Ok(());
            }
            self.settled.insert(stored.sequence);
        }
        Ok(())
    }
}

/// Looks at the first stored message of `filters` after `after`: if no
/// client can read it, settles it and returns its sequence (a reader of the
/// stream goes on after it). `None` if there is none, or it is readable.
///
/// # Errors
/// [`ErrorKind::Nats`] if the stream cannot be read.
pub(crate) async fn settle_next(
    shared: &Shared,
    filters: &[String],
    after: u64,
) -> Result<Option<u64>, Error> {
    let Some(stored) = next_stored(&shared.js, &shared.config.stream, filters, after).await? else {
        return Ok(None);
    };
    let block = stored.header_block();
    if block.readable() || !settle(shared, &stored, &block).await {
        return Ok(None);
    }
    Ok(Some(stored.sequence))
}

/// A message a leader never received: lost on the way (its subject waits
/// for it to come back).
#[derive(Debug)]
pub(crate) struct Lost {
    pub(crate) subject: String,
    pub(crate) id: outbox_pg::EventId,
    pub(crate) sequence: u64,
}

/// The most messages [`explain_gap`] looks at.
const MOST_PER_GAP: usize = 10_000;

/// Explains a gap in an ordered leader's deliveries: every stored message
/// of `filters` in `(after, before)` was delivered first in that order and
/// never reached the leader. Each one no client can read is settled now;
/// each other one that is an event is returned, in stream order, for its
/// subject to wait for (a body that is no event is dead-lettered when it
/// comes back, and holds nothing back).
///
/// # Errors
/// [`ErrorKind::Nats`] if the stream cannot be read.
pub(crate) async fn explain_gap(
    shared: &Shared,
    filters: &[String],
    (after, before): (u64, u64),
) -> Result<Vec<Lost>, Error> {
    let mut lost = Vec::new();
    let mut at = after;
    for _ in 0..MOST_PER_GAP {
        let Some(stored) = next_stored(&shared.js, &shared.config.stream, filters, at).await?
        else {
            break;
        };
        if stored.sequence >= before {
            break;
        }
        at = stored.sequence;
        let block = stored.header_block();
        if !block.readable() {
            settle(shared, &stored, &block).await;
            continue;
        }
        if let Ok(envelope) = crate::delivery::decode_envelope(&stored.payload) {
            lost.push(Lost {
                subject: envelope.subject().to_owned(),
                id: envelope.id(),
                sequence: stored.sequence,
            });
        }
    }
    Ok(lost)
}

/// The first message stored after `after` on any of `filters` (none: the
/// whole stream), read through the message-get API (JSON, the header block
/// base64-encoded).
async fn next_stored(
    js: &jetstream::Context,
    stream: &str,
    filters: &[String],
    after: u64,
) -> Result<Option<Stored>, Error> {
    let whole = [">".to_owned()];
    let filters = if filters.is_empty() {
        &whole[..]
    } else {
        filters
    };
    let mut first: Option<Stored> = None;
    for filter in filters {
        let request = serde_json::json!({ "seq": after.saturating_add(1), "next_by_subj": filter });
        let answer: Answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            js.request(format!("STREAM.MSG.GET.{stream}"), &request),
        )
        .await
        .map_err(|e| Error::caused(ErrorKind::Nats, "reading a stored message", e))?
        .map_err(|e| Error::caused(ErrorKind::Nats, "reading a stored message", e))?;
        let found = match answer {
            Answer::Found { message } => message.decode()?,
            Answer::Failed { error } if error.code == 404 => continue,
            Answer::Failed { error } => {
                return Err(Error::new(
                    ErrorKind::Nats,
                    format!(
                        "reading a stored message of `{stream}`: {} ({})",
                        error.description, error.code
                    ),
                ));
            }
        };
        if first.as_ref().is_none_or(|f| found.sequence < f.sequence) {
            first = Some(found);
        }
    }
    Ok(first)
}

/// The message-get API's answer.
#[derive(Deserialize)]
#[serde(untagged)]
enum Answer {
    Found { message: RawStored },
    Failed { error: ApiError },
}

#[derive(Deserialize)]
struct ApiError {
    code: u16,
    #[serde(default)]
    description: String,
}

#[derive(Deserialize)]
struct RawStored {
    subject: String,
    seq: u64,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
}

impl RawStored {
    fn decode(self) -> Result<Stored, Error> {
        let bytes = |field: Option<String>, what: &str| {
            field
                .map(|b64| base64::engine::general_purpose::STANDARD.decode(b64))
                .transpose()
                .map(Option::unwrap_or_default)
                .map_err(|e| {
                    Error::caused(
                        ErrorKind::Nats,
                        format!("the stored message's {what} is not base64"),
                        e,
                    )
                })
        };
        Ok(Stored {
            sequence: self.seq,
            headers: bytes(self.hdrs, "header block")?,
            payload: bytes(self.data, "body")?,
            subject: self.subject,
        })
    }
}

/// Records `stored` as a dead letter (`undecodable_headers`) and terminates
/// it through its ack subject. Returns whether it was recorded.
async fn settle(shared: &Shared, stored: &Stored, block: &HeaderBlock) -> bool {
    let config = &shared.config;
    let reply = format!(
        "$JS.ACK.{}.{}.1.{}.0.0.0",
        config.stream, config.durable, stored.sequence
    );
    let message = jetstream::Message {
        message: async_nats::Message {
            subject: stored.subject.as_str().into(),
            reply: Some(reply.into()),
            payload: stored.payload.clone().into(),
            headers: Some(legible(block)),
            status: None,
            description: None,
            length: stored.headers.len() + stored.payload.len(),
        },
        context: shared.js.clone(),
    };
    let info = match DeliveryInfo::from_message(&message) {
        Ok(info) => info,
        Err(e) => {
            tracing::warn!(consumer = %config.durable, error = %e, "cannot name an unreadable message's ack subject");
            return false;
        }
    };
    let event_id = crate::delivery::decode_envelope(&stored.payload)
        .ok()
        .map(|envelope| envelope.id());
    let problem = block
        .problem
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default();
    let error = format!(
        "no NATS client of the runtime can read this message ({problem}): it was never \
         handed over, and was read back by its stream sequence"
    );
    process::dead_letter(
        shared,
        &message,
        &info,
        event_id,
        Reason::UndecodableHeaders,
        error,
        Some(&stored.headers),
    )
    .await
}

/// The header lines that could be read, as the client would hold them.
fn legible(block: &HeaderBlock) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in &block.headers {
        if let (Ok(name), Ok(value)) = (
            name.parse::<HeaderName>(),
            HeaderValue::try_from(value.as_str()),
        ) {
            headers.append(name, value);
        }
    }
    headers
}

/// The durable's filter subjects.
pub(super) fn filters_of(config: &async_nats::jetstream::consumer::Config) -> Vec<String> {
    if config.filter_subjects.is_empty() {
        [config.filter_subject.clone()]
            .into_iter()
            .filter(|f| !f.is_empty())
            .collect()
    } else {
        config.filter_subjects.clone()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

    use super::*;

    #[test]
    fn the_message_get_answer_decodes_found_and_missing() {
        let found: Answer = serde_json::from_str(
            r#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"a.b","seq":7,"hdrs":"TkFUUy8xLjANClg6IHkNCg0K","data":"e30=","time":"2026-12-06T00:00:00Z"}}"#,
        )
        .unwrap();
        let Answer::Found { message } = found else {
            panic!("not found")
        };
        let stored = message.decode().unwrap();
        assert_eq!(stored.sequence, 7);
        assert_eq!(stored.subject, "a.b");
        assert_eq!(stored.headers, b"NATS/1.0\r\nX: y\r\n\r\n");
        assert_eq!(stored.payload, b"{}");
        let missing: Answer = serde_json::from_str(
            r#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":404,"err_code":10037,"description":"no message found"}}"#,
        )
        .unwrap();
        assert!(matches!(missing, Answer::Failed { error } if error.code == 404));
        // A message stored without headers or body.
        let bare: Answer = serde_json::from_str(
            r#"{"message":{"subject":"a.b","seq":8,"time":"2026-12-06T00:00:00Z"}}"#,
        )
        .unwrap();
        let Answer::Found { message } = bare else {
            panic!("not found")
        };
        let stored = message.decode().unwrap();
        assert!(stored.headers.is_empty() && stored.payload.is_empty());
    }

    #[test]
    fn the_legible_lines_are_kept() {
        let block = header_block::read(b"NATS/1.0\r\nNats-Msg-Id: abc\r\nbroken\r\n\r\n");
        let headers = legible(&block);
        assert_eq!(
            headers.get("Nats-Msg-Id").map(HeaderValue::as_str),
            Some("abc")
        );
    }
}
