//! Where a durable starts, so that no event is applied past the inbox window.
//!
//! The inbox recognises an event only while its row is kept
//! ([`Retention`](crate::Retention): 14 days by default). A JetStream durable
//! that has to be created again would, with JetStream's default deliver policy
//! (`all`), deliver the whole stream, and the relay's streams keep messages
//! without an age limit: every event older than the window would be applied a
//! second time. Two deployments do this: an operator deletes the durable
//! (`nats consumer rm`), or a new deployment gives the consumer a new durable
//! name.
//!
//! So the runtime records, in the table `inbox_consumers` of the inbox's
//! database, where each consumer stands on its stream: the stream, the filter
//! subjects and the **ack floor** (every message at or below that stream
//! sequence was acked: its effect committed, or its dead letter). It is
//! written when the consumer starts and again, rising only, each time the lag
//! task reads the durable's info ([`LAG_INTERVAL`](super::LAG_INTERVAL)).
//! When [`Consumer::new`](super::Consumer::new) finds the durable missing, it
//! creates it to start ([`Start::Auto`], the default):
//!
//! | the inbox knows | the new durable delivers from |
//! | --- | --- |
//! | this consumer, on this stream | the message after its recorded ack floor |
//! | another consumer on this stream with the same filter subjects that no runtime runs any more (stopped, or silent for 30 s): a new name for it | the message after that consumer's ack floor |
//! | neither (a consumer that never ran here) | the start of the stream |
//!
//! A consumer with the same stream and subjects that still runs (its runtime
//! writes its row at least every 5 s, and marks it at a clean stop) is
//! another consumer reading the same events, not one this name replaces.
//!
//! The messages between the recorded floor and the durable's last ack (at
//! most one lag interval of traffic) come again; they are recent, so their
//! inbox rows are there and they are duplicates. A consumer that never ran
//! against this inbox has applied nothing, so the whole stream is its first
//! delivery, not a replay. A recorded floor beyond the end of the stream (the
//! stream was deleted and created anew, so its sequences started again) is
//! refused at start: the position means nothing there, and guessing could
//! skip events or apply them twice; [`Start`] says which to choose.
//!
//! An existing durable is never moved: its deliver policy stays the one it
//! was created with (JetStream cannot change it), whatever [`Start`] says.

use async_nats::jetstream::consumer::{self, DeliverPolicy};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::stream::Stream;
use sqlx::PgPool;

use super::config::ConsumerConfig;
pub use super::config::Start;
use crate::error::{Error, ErrorKind, Result};

/// How the durable comes to be: already there, or created with this policy.
#[derive(Debug)]
pub(super) enum Durable {
    /// It exists: its own deliver policy stays.
    Exists(Box<consumer::Info>),
    /// It is created to deliver from here, every message up to `floor`
    /// counted as acked; `why` says how that was chosen.
    Create {
        policy: DeliverPolicy,
        floor: u64,
        why: String,
    },
}

impl Durable {
    /// The deliver policy to create or update the durable with.
    pub(super) fn policy(&self) -> DeliverPolicy {
        match self {
            Self::Exists(info) => info.config.deliver_policy,
            Self::Create { policy, .. } => *policy,
        }
    }

    /// The ack floor to record at start: the durable's, or just before where
    /// it will start.
    pub(super) fn floor(&self) -> u64 {
        match self {
            Self::Exists(info) => info.ack_floor.stream_sequence,
            Self::Create { floor, .. } => *floor,
        }
    }
}

/// A recorded position: the stream and the ack floor.
struct Recorded {
    stream: String,
    ack_floor: u64,
}

/// Decides how the durable of `config` comes to be on `stream`.
///
/// # Errors
/// [`ErrorKind::Config`] if the recorded position is past the end of the
/// stream; [`ErrorKind::Database`] if the position cannot be read;
/// [`ErrorKind::Nats`] or [`ErrorKind::StreamUnavailable`] if JetStream does
/// not answer.
pub(super) async fn durable(
    pool: &PgPool,
    config: &ConsumerConfig,
    stream: &mut Stream,
) -> Result<Durable> {
    match stream.consumer_info(&config.durable).await {
        Ok(info) => return Ok(Durable::Exists(Box::new(info))),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {}
        Err(e) => {
            let kind = match e.kind() {
                ConsumerInfoErrorKind::StreamNotFound
                | ConsumerInfoErrorKind::TimedOut
                | ConsumerInfoErrorKind::NoResponders => ErrorKind::StreamUnavailable,
                ConsumerInfoErrorKind::InvalidName => ErrorKind::Config,
                _ => ErrorKind::Nats,
            };
            return Err(Error::new(
                kind,
                format!(
                    "looking up durable consumer `{}` on `{}`: {e}",
                    config.durable, config.stream
                ),
            )
            .with_source(e));
        }
    }
    let (policy, why) = match config.start {
        Start::All => (
            DeliverPolicy::All,
            "the whole stream, as configured".to_owned(),
        ),
        Start::New => (
            DeliverPolicy::New,
            "new messages only, as configured".to_owned(),
        ),
        Start::Sequence(start_sequence) => (
            DeliverPolicy::ByStartSequence { start_sequence },
            format!("stream sequence {start_sequence}, as configured"),
        ),
        Start::Auto => auto(pool, config, stream).await?,
    };
    let floor = match policy {
        DeliverPolicy::ByStartSequence { start_sequence } => start_sequence.saturating_sub(1),
        // Whatever the stream holds now is not for this durable.
        DeliverPolicy::New => last_sequence(config, stream).await?,
        _ => 0,
    };
    Ok(Durable::Create { policy, floor, why })
}

/// [`Start::Auto`]: after the recorded position of this consumer or of the one
/// it renames; else the whole stream.
async fn auto(
    pool: &PgPool,
    config: &ConsumerConfig,
    stream: &mut Stream,
) -> Result<(DeliverPolicy, String)> {
    let filters = sorted_filters(config);
    let own = recorded(pool, &config.durable).await?;
    let (floor, whose) = match own {
        Some(own) if own.stream == config.stream => (own.ack_floor, None),
        other => {
            if let Some(own) = other {
                tracing::warn!(
                    consumer = %config.durable, recorded_stream = %own.stream, stream = %config.stream,
                    "the consumer was recorded on another stream: its position there does not apply",
                );
            }
            match predecessor(pool, config, &filters).await? {
                Some((name, floor)) => (floor, Some(name)),
                None => return Ok(whole_stream()),
            }
        }
    };
    let last = last_sequence(config, stream).await?;
    let by = whose.as_deref().map_or_else(
        || "its own".to_owned(),
        |name| format!("consumer `{name}`'s"),
    );
    if floor > last {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "consumer `{}`: {by} recorded ack floor on stream `{}` is {floor}, past the \
                 stream's last message ({last}): the stream was created anew, so where the consumer \
                 stands is unknown. Choose where its durable starts (ConsumerConfig::start: \
                 Start::All to apply the stream again through the inbox, Start::New, \
                 Start::Sequence), or delete its row from inbox_consumers",
                config.durable, config.stream
            ),
        ));
    }
    let start_sequence = floor.saturating_add(1);
    let why = match whose {
        None => format!("after its recorded ack floor {floor}"),
        Some(name) => format!(
            "after the ack floor {floor} of consumer `{name}`, which read the same stream and \
             subjects (a new name for it); ConsumerConfig::start(Start::All) replays instead"
        ),
    };
    Ok((DeliverPolicy::ByStartSequence { start_sequence }, why))
}

/// The stream's last sequence, read now.
async fn last_sequence(config: &ConsumerConfig, stream: &mut Stream) -> Result<u64> {
    let info = stream.info().await.map_err(|e| {
        Error::new(
            ErrorKind::StreamUnavailable,
            format!("reading stream `{}`: {e}", config.stream),
        )
        .with_source(e)
    })?;
    Ok(info.state.last_sequence)
}

fn whole_stream() -> (DeliverPolicy, String) {
    (
        DeliverPolicy::All,
        "the whole stream: the consumer never ran against this inbox".to_owned(),
    )
}

/// The filter subjects, sorted and without repeats, as recorded.
fn sorted_filters(config: &ConsumerConfig) -> Vec<String> {
    let mut filters = config.filter_subjects.clone();
    filters.sort();
    filters.dedup();
    filters
}

async fn recorded(pool: &PgPool, consumer: &str) -> Result<Option<Recorded>> {
    let row = sqlx::query_file!("queries/consumer_position.sql", consumer)
        .fetch_optional(pool)
        .await
        .map_err(|e| Error::database("reading where the consumer stands (inbox_consumers)", e))?;
    Ok(row.map(|row| Recorded {
        stream: row.stream,
        ack_floor: u64::try_from(row.ack_floor).unwrap_or(0),
    }))
}

async fn predecessor(
    pool: &PgPool,
    config: &ConsumerConfig,
    filters: &[String],
) -> Result<Option<(String, u64)>> {
    let row = sqlx::query_file!(
        "queries/consumer_predecessor.sql",
        config.durable,
        config.stream,
        filters
    )
    .fetch_optional(pool)
    .await
    .map_err(|e| Error::database("reading the consumers of the stream (inbox_consumers)", e))?;
    Ok(row.map(|row| (row.consumer, u64::try_from(row.ack_floor).unwrap_or(0))))
}

/// Marks the consumer stopped: a new name may now replace it (a replica still
/// running clears the mark with its next write).
///
/// # Errors
/// [`ErrorKind::Database`] if the row cannot be written.
pub(super) async fn stopped(pool: &PgPool, consumer: &str) -> Result<()> {
    sqlx::query_file!("queries/consumer_stopped.sql", consumer)
        .execute(pool)
        .await
        .map_err(|e| Error::database("recording that the consumer stopped (inbox_consumers)", e))?;
    Ok(())
}

/// Records the consumer, its stream, filter subjects and `floor` (kept if the
/// recorded one is higher on the same stream).
///
/// # Errors
/// [`ErrorKind::Database`] if the row cannot be written.
pub(super) async fn record(pool: &PgPool, config: &ConsumerConfig, floor: u64) -> Result<()> {
    let filters = sorted_filters(config);
    let floor = i64::try_from(floor).unwrap_or(i64::MAX);
    sqlx::query_file!(
        "queries/consumer_register.sql",
        config.durable,
        config.stream,
        &filters,
        floor
    )
    .execute(pool)
    .await
    .map_err(|e| Error::database("recording where the consumer stands (inbox_consumers)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_recorded_sorted_without_repeats() {
        let config = ConsumerConfig::new("S", "c").filter_subjects(["b.>", "a.>", "b.>"]);
        assert_eq!(sorted_filters(&config), vec!["a.>", "b.>"]);
    }
}
