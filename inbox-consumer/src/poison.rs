//! [`Poison`]: a message that can never be handled, and its [`Reason`].

use std::fmt;

use outbox_pg::EventId;

use crate::error::Error;

/// Why a message was dead-lettered. Stored as [`Reason::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The body is not JSON.
    NotJson,
    /// The body is JSON but not a CloudEvents 1.0 structured-mode envelope with
    /// valid attributes (spec version, type, source, subject, time).
    NotCloudEvent,
    /// The envelope has no id, or one that is not a UUID.
    InvalidId,
    /// `data` does not decode as the handler's message type.
    UndecodablePayload,
    /// No handler is routed for the event type.
    Unroutable,
    /// The handler rejected the event ([`HandlerError::reject`](crate::HandlerError::reject)).
    Rejected,
    /// The last allowed delivery (the consumer's `max_deliver`) failed.
    MaxDeliveries,
    /// The handler (or a layer) panicked on the last allowed delivery; every
    /// attempt before rolled back and was retried like a failure (see
    /// [`runtime`](crate::runtime#a-panicking-handler)).
    Panic,
    /// The message's header block, as stored in the stream, is one no NATS
    /// client of this crate can read (a line without a colon, a bare LF, bytes
    /// that are not UTF-8, a status line): the client never hands such a
    /// message over, so the runtime reads it back by its stream sequence,
    /// records it with its raw header bytes, and terminates it (see
    /// [`runtime`](crate::runtime#messages-no-client-can-read)).
    UndecodableHeaders,
}

impl Reason {
    /// The stable code stored in `inbox_dead_letters.reason`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotJson => "not_json",
            Self::NotCloudEvent => "not_cloudevent",
            Self::InvalidId => "invalid_id",
            Self::UndecodablePayload => "undecodable_payload",
            Self::Unroutable => "unroutable",
            Self::Rejected => "rejected",
            Self::MaxDeliveries => "max_deliveries",
            Self::Panic => "panic",
            Self::UndecodableHeaders => "undecodable_headers",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message that can never be handled, and why.
#[derive(Debug)]
pub struct Poison {
    reason: Reason,
    error: Error,
    event_id: Option<EventId>,
}

impl Poison {
    pub(crate) fn new(reason: Reason, error: Error) -> Self {
        Self {
            reason,
            error,
            event_id: None,
        }
    }

    pub(crate) fn with_event_id(mut self, id: EventId) -> Self {
        self.event_id = Some(id);
        self
    }

    /// Why.
    pub fn reason(&self) -> Reason {
        self.reason
    }

    /// The decode error.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The envelope id, when the body had a readable one.
    pub fn event_id(&self) -> Option<EventId> {
        self.event_id
    }
}

impl fmt::Display for Poison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.error)
    }
}

impl std::error::Error for Poison {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
