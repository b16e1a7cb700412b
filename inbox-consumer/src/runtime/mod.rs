//! The runtime: a JetStream durable pull consumer driving a service stack.
//!
//! Per message: decode → begin → layers → handler → commit → ack.
//!
//! - **Ack only after commit.** The stack's future resolves once
//!   [`Dedupe`](crate::dedupe::Dedupe) has committed; only then is the message
//!   acked (`double_ack`, confirmed by the server). A failed commit is an error,
//!   and an error is never acked: it is nak'ed and redelivered.
//! - **Errors** roll back; [`HandlerError`](crate::HandlerError) decides
//!   between a nak whose delay grows with the delivery count
//!   ([`RetryPolicy`]) and a reject:
//!
//!   | result | JetStream |
//!   | --- | --- |
//!   | `Ok(Handled / Duplicate / Stale)` (committed) | `+ACK`, confirmed (`double_ack`) |
//!   | the database unreachable, a lock wait timed out, or a privilege the role lacks (rolled back) | `-NAK {delay}`, whatever the delivery count: never dead-lettered |
//!   | other retryable error (rolled back) | `-NAK {delay}`, delay from [`RetryPolicy`] or [`HandlerError::retry_after`](crate::HandlerError::retry_after) |
//!   | other retryable error once the delivery budget is spent | dead letter (`max_deliveries`), then `+TERM` |
//!   | the handler or a layer panicked (caught, rolled back) | `-NAK {delay}`, delay from [`RetryPolicy`], counted (`inbox_handler_panics_total`) |
//!   | a panic once the delivery budget is spent | dead letter (`panic`), then `+TERM` |
//!   | reject, undecodable payload | dead letter, then `+TERM` |
//!   | no route for the event type | `+ACK`, counted (`inbox_unrouted_total`); or dead letter, by [`Unrouted`] |
//!   | [`ErrorKind::LeaseLost`](crate::ErrorKind::LeaseLost) (an ordered consumer's deposed leader) | nothing: the new leader gets it |
//!   | an error type this crate does not know (a third-party layer) | retried |
//!   | a message whose header block no client can read (never handed over) | found by its stream sequence: dead letter (`undecodable_headers`), then `+TERM` through its ack subject; see [below](#messages-no-client-can-read) |
//!
//!   The budget ([`ConsumerConfig::max_deliver`]) is counted by the runtime,
//!   from the delivery count JetStream reports; the server's own
//!   `max_deliver` is unlimited, so no message ever ends because the broker
//!   stopped redelivering it. A failure that is not the event's fault (no
//!   database) does not spend the budget's last delivery.
//!
//!   An ordered consumer retries a nak'ed failure (a panic too) in place
//!   instead, holding its subject; see [below](#a-panicking-handler).
//! - **Poison** (not JSON, not a CloudEvent, no valid id, undecodable payload,
//!   a reject, or a failure or panic once the delivery budget is spent) is written to
//!   `inbox_dead_letters` (and the DLQ subject, if configured) and terminated.
//!   The consumer goes on; nothing is dropped silently. A type no route
//!   handles is acked and counted, or dead-lettered
//!   ([`ConsumerConfig::unrouted`]).
//! - **Replays** (`outboxctl dead-letters replay`): a message whose
//!   [`REPLAY_CONSUMER_HEADER`](crate::dead_letter::REPLAY_CONSUMER_HEADER)
//!   names another consumer (durable) is acked as it arrives, without being
//!   decoded or handled, and counted (`inbox_replays_ignored_total`), in
//!   every mode (one at a time, batched, ordered; a taking-over leader does
//!   not wait for one). One naming this consumer goes the normal way, through
//!   the inbox: the event keeps its id, so a replay of an event the consumer
//!   already applied is a duplicate.
//! - **Nothing is lost, whatever the outage.** A message leaves the broker in
//!   two ways only: acked after its effect committed, or terminated after its
//!   dead letter committed. The durable consumer is created with an unlimited
//!   `max_deliver`, so the broker never gives up on a message; the runtime
//!   counts deliveries against its own budget
//!   ([`ConsumerConfig::max_deliver`]). A database that cannot be reached (or
//!   a lock wait that timed out) is not the event's fault: such failures are
//!   nak'ed with a delay of at most 30 s, however many deliveries they take,
//!   and never dead-lettered; a dead letter that cannot be written is nak'ed
//!   and tried again.
//! - **Concurrency.** Up to [`ConsumerConfig::concurrency`] deliveries (or
//!   batches) run at once, but never two of one envelope subject: later
//!   messages of a busy subject wait, in arrival order, until it frees. Each
//!   pull asks for no more than the room left under
//!   [`ConsumerConfig::max_buffered`], so the runtime never holds more.
//! - **Every held message keeps its deadline.** A running delivery, and every
//!   message waiting (behind a busy subject, for a free slot, or behind a
//!   previous leader's unfinished event), gets an in-progress ack every
//!   [`ConsumerConfig::progress_interval`], so JetStream redelivers none of
//!   them while the runtime holds it, however slow the handler ahead. That
//!   lets [`ConsumerConfig::ack_wait`] be short ([`DEFAULT_ACK_WAIT`], 3 s):
//!   what a dead process held is redelivered within it. A service call still
//!   running after 60 s is logged at warn with its messages' stream
//!   sequences, and again every 60 s: a hung handler keeps its messages
//!   while its process lives, but not silently.
//! - **Batched handling** ([`Consumer::run_batched`]): up to
//!   [`ConsumerConfig::max_batch`] deliveries of distinct subjects in one
//!   transaction (inbox rows written set-based, handlers in order, one
//!   commit), then their acks. A delivery whose handler fails is left out of
//!   the commit and handled alone afterwards.
//! - **Where a durable starts.** A durable the runtime has to create (new,
//!   or deleted by an operator) starts after the ack floor the inbox records
//!   for the consumer, or for the consumer it renames, so no event the inbox
//!   can no longer recognise (past its retention window) is applied again;
//!   see [`position`] and [`ConsumerConfig::start`].
//! - **Lag** is read from JetStream every [`LAG_INTERVAL`] on a task of its
//!   own (each request bounded by [`LAG_TIMEOUT`]) and exported as the gauges
//!   `inbox_pending_messages` and
//!   `inbox_ack_pending_messages` (see [`crate::metrics`]).
//! - **Broker outages**: a failed pull is issued again after a pause (a pull
//!   lost with a restarting broker ends after 7 s); ack failures are logged
//!   (the redelivery will be a duplicate).
//! - **Shutdown.** When the shutdown future resolves, pulling stops (the
//!   open pull is read to its end, at most 2 s, and what it still brings is
//!   nak'ed for the next puller rather than left to `ack_wait`), and
//!   every message already held (running or waiting) is finished, committed
//!   and acked before [`Consumer::run`] returns (an ordered
//!   consumer leaves an event whose in-place retry is cut short, and the
//!   later events of its subject, to the next leader). Dropping the `run`
//!   future instead aborts everything in flight without acking, like a
//!   crash: those messages are redelivered after `ack_wait` and the inbox
//!   turns any committed one into a duplicate.
//!
//! # Messages no client can read
//!
//! Any client allowed to publish on a subject the consumer reads can write
//! any bytes into a message's header block; the server stores them as they
//! are. async-nats reads every message it receives with strict rules and
//! drops its connection on a block it cannot read (a bare LF, a line without
//! a colon, bytes that are not UTF-8), without handing the message over. Left
//! alone, such a message is redelivered every `ack_wait` for ever (the
//! durable's `max_deliver` is unlimited), each time taking the connection
//! and every message in flight on it down, and the runtime never counts a
//! delivery of it, so its budget never starts.
//!
//! The runtime settles it from the other side:
//!
//! - **The ack floor points at it.** Nobody can ack it, so once the messages
//!   before it are settled the durable's ack floor stops just below it.
//!   While messages are pending and the floor has not moved since the last
//!   look (every 2 s, `runtime/ghosts.rs`), the runtime reads the first
//!   stored message of its subjects after the floor through JetStream's
//!   message-get API, which answers in JSON with the block base64-encoded, so
//!   the client's reader never sees it, and judges the block with the
//!   client's own rules. One the client can read is held by a replica or on
//!   its way back: nothing is done. One it cannot is recorded in
//!   `inbox_dead_letters` (reason `undecodable_headers`, the legible header
//!   lines in `headers`, the block byte for byte in `raw_headers`) and
//!   terminated through its ack subject, which names the stream, the durable
//!   and the sequence; the next message is looked at in turn. Only a message
//!   no client can read is ever terminated this way, so nothing a replica
//!   holds is taken from under it.
//! - **An ordered leader keeps order.** The leader is the durable's only
//!   puller, so a jump in its consumer sequence means deliveries it never
//!   got (such a message, or messages lost with a dropped connection). It
//!   holds what it receives until it has read the messages in between by
//!   sequence: each unreadable one is settled at once, each event is made
//!   the next its subject waits for (as after a takeover), then the held
//!   messages go on (`runtime/ordered/gaps.rs`). Its takeover reader, which reads the
//!   stream through the client too, steps over an unreadable message the same
//!   way instead of stopping at it.
//!
//! Why not a finite server-side `max_deliver` with its `MAX_DELIVERIES`
//! advisory instead: the server would then stop redelivering *any* message
//! after that many deliveries, a valid one whose deliveries a long database
//! outage spent among them (those are nak'ed, and never dead-lettered, for
//! as long as the outage lasts), and nothing would bring it back. The floor
//! names the unreadable message without the server giving up on anything,
//! and settles it within seconds of the messages before it, not after
//! `max_deliver × ack_wait`.
//!
//! A bare CR in a value is read as a space (async-nats 0.52), NUL is kept,
//! and a status a publisher writes on the version line is dropped by the
//! server when it stores the message: those are handled like any other.
//!
//! # A closed NATS client
//!
//! async-nats reconnects by itself, so a disconnected client is waited for.
//! A *closed* one (drained, or its connection task ended) never delivers or
//! acks again: [`Consumer::run`] returns
//! [`ErrorKind::ClientClosed`](crate::ErrorKind::ClientClosed) within a pull's
//! lifetime of finding it (counted in `inbox_nats_client_closed_total`),
//! having aborted what it held (running transactions roll back; the messages
//! come back after `ack_wait`, and the inbox turns any effect already
//! committed into a duplicate). [`Consumer::new`] refuses a closed client at
//! once. The caller builds a new client and runs again, or exits non-zero
//! for its supervisor; `billing` builds a new client from its flags.
//!
//! # A panicking handler
//!
//! A panic in a handler or a layer (an `unwrap` on a field, an index out of
//! range; in `poll_ready`, `call` or the response future) is the event's
//! failure, not the runtime's. Each service call runs inside
//! `catch_unwind` (see `runtime/panics.rs`); a panic is counted
//! (`inbox_handler_panics_total{consumer,event_type}`), logged once per
//! attempt at `error` with the event id, subject, stream sequence, attempt
//! and the panic's message, and handled as a failed delivery:
//!
//! - the transaction is dropped before its commit, so it rolls back: no
//!   effect and no inbox row remain;
//! - the message is nak'ed with the [`RetryPolicy`] delay; an ordered
//!   consumer retries it in place, and its subject stays held, so no later
//!   event of the entity runs before it is settled;
//! - once the budget ([`ConsumerConfig::max_deliver`]) is spent it is
//!   dead-lettered with reason [`Panic`](crate::Reason::Panic) (`panic`);
//! - in a batch ([`Consumer::run_batched`]) the whole batch rolls back (which
//!   delivery panicked is not known) and is handled one delivery at a time,
//!   as a batch that failed as a whole; only the delivery that panics again
//!   fails, and only its attempts alone are counted.
//!
//! The task running the delivery goes on; the session never sees it end by
//! a panic. (A task that does end without answering, by a panic of the
//! runtime itself, is logged as an error with its subjects and events; its
//! unfinished messages are not acked and come back after `ack_wait`, and an
//! ordered consumer holds the later events of those subjects until they do.)
//!
//! This is sound because the caught future owns everything a panic can
//! leave half-done (its service clone, the delivery, the transaction) and is
//! dropped, never polled again. What it cannot undo is a handler's own state
//! outside the transaction: a handler must not leave state shared between
//! its clones (a cache behind an `Arc<Mutex<…>>`; a `std::sync::Mutex` held
//! while panicking is poisoned) half-updated where it may panic, must not
//! count on outside work (HTTP, files) being undone, and must not spawn
//! tasks that go on writing for it.
//!
//! Catching needs `panic = "unwind"`, Rust's default: under
//! `panic = "abort"` the process dies at the first panic and every replica
//! that gets the message again dies on it too. The process's panic hook still
//! runs first (the default one prints `thread '…' panicked at <file>:<line>`
//! to stderr); the runtime's log line is the one that names the event.
//!
//! # Ordering guarantee
//!
//! By default, within one process, the deliveries of one subject are handled
//! one at a time in the order JetStream delivers them, which is stream order
//! for first deliveries. Two things reorder: a failed delivery is nak'ed and
//! the subject's next message is handled before its redelivery arrives; and
//! replicas sharing a durable each handle their own share of a subject's
//! messages, at the same time. A handler for which order matters then either
//! compares the events' insert order (`sequence`) through the inbox
//! ([`SkipStale`](crate::ordering::SkipStale)), as the contract's rule 3 asks,
//! or the consumer runs ordered.
//!
//! # Ordered consumption
//!
//! With [`ConsumerConfig::ordered`], no two events of one subject are ever
//! handled at once across all replicas of the durable, and each subject's
//! events are applied in stream order, through failures, crashes and
//! failovers:
//!
//! - **One leader.** Replicas compete for a session-level advisory lock on a
//!   database connection of their own; the holder leads and is the only one
//!   that pulls, the others stand by and try again every
//!   `lease_timeout / 50` (at most 250 ms). The server releases the lock when the
//!   leader's process dies (its socket closes) or its session stays silent for
//!   [`lease_timeout`](ConsumerConfig::lease_timeout) (frozen, cut off); a
//!   leader that cannot confirm its session steps down by itself.
//! - **Fenced commits.** Each new leader bumps an epoch in `inbox_leases`;
//!   [`Dedupe`](crate::Dedupe) checks it just before every commit, under a lock
//!   the bump takes exclusively. A deposed leader's transactions roll back
//!   ([`ErrorKind::LeaseLost`](crate::ErrorKind::LeaseLost)) and their messages
//!   are left to the new leader.
//! - **Pulls end with the lead.** A leader pulls one 500 ms batch at a time,
//!   and only while its session was confirmed (pinged every 250 ms) in the
//!   last second.
//! - **Takeover.** A new leader whose predecessor did not let go cleanly waits
//!   1.75 s for the predecessor's last pull to expire. Then it finds the
//!   events earlier leaders left unfinished (neither handled nor
//!   dead-lettered) and, per subject, handles those first, in stream order,
//!   as JetStream redelivers them (after `ack_wait`), holding later events of
//!   the same subject back (with in-progress acks). Other subjects go on at
//!   once. If an unfinished event never comes back (twice the longest
//!   redelivery delay, plus 10 s), its subject goes on without it and an
//!   error names it.
//! - **A bounded takeover, whatever the stream holds.** The events to look
//!   at lie between the consumer's ack floor and its last delivered message,
//!   and one message left unacked for hours keeps the floor below everything
//!   handled since. So each leader records a *checkpoint* in `inbox_leases`
//!   about once a second: the stream sequence at or below which every
//!   message is finished except a short list (at most 1,024), kept from
//!   what it receives and finishes (its delivery sequence tells it that it
//!   saw every delivery). A new leader reads that list and the stream from
//!   the checkpoint on, about a second of traffic, not from the ack floor;
//!   in bulk (an ephemeral ordered consumer, headers only: the id is the
//!   relay's `Nats-Msg-Id`; bodies only of the unfinished ones, for their
//!   subject) and one inbox query per 1,000 messages, keeping only the
//!   unfinished ones. Its reads are bounded
//!   ([`ConsumerConfig::takeover_scan`]: 1,000,000 messages, 5 s): past the
//!   bound, the unfinished events found still go first and every other
//!   message waits until the previous leader's messages have had time to
//!   come back, then all go in stream order: slower, logged, never
//!   reordered. See `ordered/takeover.rs` and `ordered/checkpoint.rs` for why each step is
//!   sound, and the crate's `BENCHMARKS.md` ("Ordered takeover with a stuck
//!   message") for what it takes.
//! - **In-place retries.** A failed delivery is retried by the leader after
//!   the [`RetryPolicy`] delay, keeping its subject busy, instead of being
//!   nak'ed past; the last allowed attempt is dead-lettered as usual.
//!
//! The cost is throughput: one process handles the whole consumer (up to
//! `concurrency` subjects at once), however many replicas run; the others are
//! hot standbys. A crashed leader's subjects in flight resume after the
//! failover (up to 250 ms to notice, 1.75 s, the scan, then `ack_wait` for
//! the unfinished events to come back); the other subjects after the first
//! three. All replicas of a durable must agree on
//! the setting; it needs PostgreSQL 14 or later (`idle_session_timeout`).
//!
//! # Consumers sharing a database
//!
//! Every consumer of a database shares the inbox tables, keyed by its durable
//! name, and under the roles of `ops/sql/roles.sql` every consumer's role is
//! a member of `outbox_consumer`. Row-level security (migration
//! `20260101000013_inbox_isolation.sql`) keeps them apart: each name has an
//! owner role (`inbox_consumers.owner`), and a session reads and writes the
//! inbox rows, dead letters, lease and registration of a consumer only when
//! its role is a member of that owner. So one consumer's role can neither
//! make another skip an event, apply one twice, bump its leader epoch, nor
//! read what it handled. The tables' owner and superusers are not subject to
//! it (migrations, `outboxctl`).
//!
//! - **The first registration claims the name.** [`Consumer::new`] records
//!   the consumer in `inbox_consumers` (where it stands on its stream,
//!   [`position`]); a new row is owned by the role it runs under
//!   ([`run`](Consumer::run) writes it before consuming if the database could
//!   not take it at start). A name owned by a role this one is not a member
//!   of is refused, before the durable is created and again after the
//!   registration, with
//!   [`ErrorKind::Privilege`](crate::ErrorKind::Privilege), naming the
//!   consumer, the owner and the role, before anything is consumed. The
//!   operator may claim a name beforehand or hand it over (`outboxctl inbox
//!   set-owner <consumer> <role>`); replicas under several login roles share
//!   a name through a group role granted to each, made its owner. A new
//!   durable name starts after the position of the consumer it replaces
//!   ([`position`]) only when its role owns that consumer too.
//! - **Advisory locks are not rows.** Any role can take an ordered
//!   consumer's leader lock. A standby that has not got the lead for longer
//!   than [`lease_timeout`](ConsumerConfig::lease_timeout) looks up the
//!   lock's holder (`pg_locks`, `pg_stat_activity`) and, when that session's
//!   role does not own the consumer, logs an error naming the role and the
//!   pid, once a minute. The epoch bump, a row, stays the owner's.

pub(crate) mod ack;
mod batch;
mod config;
mod dispatch;
mod ghosts;
mod lag;
mod ordered;
mod owner;
mod panics;
pub mod position;
mod process;
mod runner;
mod session;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use outbox_pg::Privilege;
use sqlx::PgPool;
use tokio_util::task::AbortOnDropHandle;
use tower::Service;

use crate::delivery::{BatchResults, Delivery, Outcome};
use crate::error::{BoxError, Error, ErrorKind, Result};
use crate::retention;

pub use crate::retry::RetryPolicy;
pub use config::{ConsumerConfig, DEFAULT_ACK_WAIT, Unrouted};
pub use lag::{LAG_INTERVAL, LAG_TIMEOUT};
pub use position::Start;

use ordered::lease::{self, Tenure};
use ordered::takeover::{self, Backlog};
use process::Shared;
use runner::{Batched, Runner, Single};
use session::{Served, Session};

/// How long to wait before reading a previous leader's leftovers again after a failure.
const RESCAN_DELAY: Duration = Duration::from_secs(1);

/// The error of looking up `stream`: missing or unanswered is
/// [`ErrorKind::StreamUnavailable`](crate::ErrorKind::StreamUnavailable), a bad
/// name is a configuration error.
fn stream_error(stream: &str, e: jetstream::context::GetStreamError) -> Error {
    use jetstream::context::GetStreamErrorKind as Kind;
    let kind = match e.kind() {
        Kind::EmptyName | Kind::InvalidStreamName => crate::ErrorKind::Config,
        Kind::Request => crate::ErrorKind::StreamUnavailable,
        Kind::JetStream(js) if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND => {
            crate::ErrorKind::StreamUnavailable
        }
        Kind::JetStream(_) => crate::ErrorKind::Nats,
    };
    Error::new(kind, format!("looking up stream `{stream}`: {e}")).with_source(e)
}

/// The privileges a consumer with `config` needs: SELECT and INSERT on
/// `inbox_events` and `inbox_dead_letters`, USAGE on
/// `inbox_dead_letters_id_seq`; SELECT, INSERT, and UPDATE on a column, of
/// `inbox_consumers` (the consumer's registration and where it stands on its
/// stream: `ops/sql/roles.sql` grants UPDATE of those columns, never of the
/// name or its owner); DELETE, and UPDATE on a column (the
/// pruning's row locks), on `inbox_events` when this process prunes, and on
/// `inbox_dead_letters` when it prunes dead letters too;
/// SELECT, INSERT and UPDATE on `inbox_leases` when ordered. Advisory locks
/// need none. A handler's own tables are the service's to grant.
///
/// Which consumers' rows the role may use is row-level security's to say:
/// those whose name it owns (see the [module docs](self), "Consumers
/// sharing a database").
pub fn required_privileges(config: &ConsumerConfig) -> Vec<Privilege> {
    let mut required = vec![
        Privilege::table("inbox_events", "SELECT"),
        Privilege::table("inbox_events", "INSERT"),
        Privilege::table("inbox_dead_letters", "SELECT"),
        Privilege::table("inbox_dead_letters", "INSERT"),
        Privilege::sequence("inbox_dead_letters_id_seq", "USAGE"),
        Privilege::table("inbox_consumers", "SELECT"),
        Privilege::table("inbox_consumers", "INSERT"),
        Privilege::any_column("inbox_consumers", "UPDATE"),
    ];
    // Pruning deletes in batches locked FOR UPDATE SKIP LOCKED, and a row
    // lock needs UPDATE on a column of the table.
    if config.prune {
        required.extend([
            Privilege::table("inbox_events", "DELETE"),
            Privilege::any_column("inbox_events", "UPDATE"),
        ]);
        if config.retention.get_dead_letter_window().is_some() {
            required.extend([
                Privilege::table("inbox_dead_letters", "DELETE"),
                Privilege::any_column("inbox_dead_letters", "UPDATE"),
            ]);
        }
    }
    if config.ordered {
        required.extend([
            Privilege::table("inbox_leases", "SELECT"),
            Privilege::table("inbox_leases", "INSERT"),
            Privilege::table("inbox_leases", "UPDATE"),
        ]);
    }
    required
}

/// The group role of `ops/sql/roles.sql` that holds a consumer's privileges.
const CONSUMER_ROLE: &str = "outbox_consumer";

/// How long the start-up privilege check may wait for the database before the
/// consumer goes on without it (an unreachable database is the runtime's to
/// wait for, per message).
const PRIVILEGE_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) async fn check_privileges(pool: &PgPool, config: &ConsumerConfig) -> Result<()> {
    check_sessions_and_layout(pool, config).await?;
    let required = required_privileges(config);
    let checked = outbox_pg::check_privileges_at_start(
        pool,
        &required,
        CONSUMER_ROLE,
        PRIVILEGE_CHECK_TIMEOUT,
    )
    .await
    .map_err(|e| {
        Error::new(
            crate::ErrorKind::Privilege,
            format!("consumer `{}`: {e}", config.durable),
        )
        .with_source(e)
    })?;
    if let Some(why) = checked {
        tracing::warn!(consumer = %config.durable, error = %why, "could not check the consumer's database privileges; going on");
    }
    let owned = owner::check_at_start(pool, &config.durable, PRIVILEGE_CHECK_TIMEOUT).await?;
    if let Some(why) = owned {
        tracing::warn!(consumer = %config.durable, error = %why, "could not check who owns the consumer's name; checked again once it is registered");
    }
    Ok(())
}

/// Checks, before consuming, that the consumer is registered and its role
/// owns the name ([`owner::claim`]), registering it if it is not: a
/// registration the database could not take at start is made once it does
/// (a consumer whose name is not registered has every inbox write refused).
/// Tried every [`CLAIM_RETRY`] while the database does not answer; `false`
/// if `shutdown` resolved first.
async fn claim_before_consuming<F: Future<Output = ()>>(
    shared: &Shared,
    mut shutdown: Pin<&mut F>,
) -> Result<bool> {
    let config = &shared.config;
    let mut told = false;
    loop {
        match owner::claim_within(&shared.pool, config, PRIVILEGE_CHECK_TIMEOUT).await? {
            None => return Ok(true),
            Some(why) if told => {
                tracing::debug!(consumer = %config.durable, error = %why, "still cannot register the consumer");
            }
            Some(why) => {
                tracing::warn!(consumer = %config.durable, error = %why, retry = ?CLAIM_RETRY, "cannot register the consumer; retrying before consuming");
                told = true;
            }
        }
        tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(false),
            () = tokio::time::sleep(CLAIM_RETRY) => {}
        }
    }
}

/// The pause between two tries of a registration the database did not answer.
const CLAIM_RETRY: Duration = Duration::from_secs(1);

/// Refuses a database URL that leads to a transaction pooler
/// ([`outbox_pg::require_sessions`]: the runtime's queries are named prepared
/// statements, and an ordered consumer's leadership is a session lock) and an
/// inbox schema that is not complete ([`outbox_pg::check_inbox_layout`]; one
/// not there yet is waited for [`outbox_pg::SCHEMA_WAIT`], for a consumer
/// started beside the service that migrates). Configuration errors, not
/// outages to retry message by message; a check that cannot run (the
/// database not reachable yet) is logged and passes.
async fn check_sessions_and_layout(pool: &PgPool, config: &ConsumerConfig) -> Result<()> {
    let refused = |e: outbox_pg::Error| {
        Error::new(
            crate::ErrorKind::Config,
            format!("consumer `{}`: {e}", config.durable),
        )
        .with_source(e)
    };
    let options = pool.connect_options();
    let sessions = outbox_pg::require_sessions_at_start(
        &options,
        "the consumer runtime",
        PRIVILEGE_CHECK_TIMEOUT,
    )
    .await
    .map_err(refused)?;
    if let Some(why) = sessions {
        tracing::warn!(consumer = %config.durable, error = %why, "could not check the database URL for a transaction pooler; going on");
    }
    let layout = outbox_pg::check_inbox_layout_at_start(
        pool,
        config.ordered,
        PRIVILEGE_CHECK_TIMEOUT,
        |e| {
            tracing::warn!(consumer = %config.durable, error = %e, wait = ?outbox_pg::SCHEMA_WAIT, "waiting for the inbox migrations");
        },
    )
    .await
    .map_err(refused)?;
    if let Some(why) = layout {
        tracing::warn!(consumer = %config.durable, error = %why, "could not check the inbox's schema; going on");
    }
    Ok(())
}

/// A message and its decoded delivery.
type Job = (jetstream::Message, Delivery);

/// A durable pull consumer bound to a database: the runtime of the inbox.
///
/// Build it with [`Consumer::new`], then [`run`](Consumer::run) a service stack
/// on it (or [`run_batched`](Consumer::run_batched) a batch stack). Several
/// processes may run the same durable: JetStream shares the messages (or,
/// [`ordered`](ConsumerConfig::ordered), one leads and the others stand by),
/// the inbox keeps one effect per event.
#[derive(Debug)]
pub struct Consumer {
    shared: Arc<Shared>,
    consumer: PullConsumer,
}

impl Consumer {
    /// Checks the database role's privileges ([`required_privileges`]) and
    /// that no other role owns the consumer's name, creates the durable
    /// consumer on the stream, or updates it to `config`, records the
    /// consumer in `inbox_consumers` ([`position`]; the first record of a
    /// name claims it for the role), and checks the inbox retention window
    /// against its redelivery window.
    ///
    /// # Errors
    /// [`ErrorKind::Privilege`](crate::ErrorKind::Privilege) if the role lacks
    /// a privilege the configuration uses, naming the role, each privilege
    /// and its table ("role `billing_login` lacks INSERT on table
    /// inbox_events; grant it outbox_consumer (ops/sql/roles.sql)"), or if
    /// the consumer's name is owned by a role it is not a member of, naming
    /// the consumer, the owner and the role (the first registration of a
    /// name claims it; see the [module docs](self), "Consumers sharing a
    /// database"); a check that cannot run (the database not reachable) is
    /// logged and passes (the registration is then made before
    /// [`run`](Self::run) consumes);
    /// [`ErrorKind::StreamUnavailable`](crate::ErrorKind::StreamUnavailable)
    /// if the stream does not exist or JetStream does not answer (see
    /// [`Consumer::builder`], which waits for it);
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) if the stream name is
    /// not valid; [`ErrorKind::Nats`](crate::ErrorKind::Nats) if the consumer
    /// cannot be created;
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) if the retention window
    /// is shorter than the delivery budget's redeliveries (see
    /// [`crate::retention`] and
    /// [`check_window`](crate::retention::check_window)).
    pub async fn new(pool: PgPool, js: jetstream::Context, config: ConsumerConfig) -> Result<Self> {
        check_privileges(&pool, &config).await?;
        Self::create(js, pool, config).await
    }

    /// [`Consumer::new`] after the privilege check: the stream, the durable,
    /// the retention check and the durability statement.
    pub(crate) async fn create(
        js: jetstream::Context,
        pool: PgPool,
        config: ConsumerConfig,
    ) -> Result<Self> {
        check_client(&js, &config)?;
        let mut stream = js
            .get_stream(&config.stream)
            .await
            .map_err(|e| stream_error(&config.stream, e))?;
        let mut durable = position::durable(&pool, &config, &mut stream).await?;
        let mut created = stream
            .create_consumer(config.pull_config(durable.policy()))
            .await;
        if created.is_err() && matches!(durable, position::Durable::Create { .. }) {
            // A replica started at the same moment may have created the
            // durable first, from another start: take it as it is.
            durable = position::durable(&pool, &config, &mut stream).await?;
            if matches!(durable, position::Durable::Exists(_)) {
                created = stream
                    .create_consumer(config.pull_config(durable.policy()))
                    .await;
            }
        }
        let consumer: PullConsumer = created.map_err(|e| {
            Error::caused(
                ErrorKind::Nats,
                format!(
                    "creating durable consumer `{}` on `{}`",
                    config.durable, config.stream
                ),
                e,
            )
        })?;
        if let position::Durable::Create { policy, why, .. } = &durable {
            tracing::info!(
                consumer = %config.durable, stream = %config.stream, deliver_policy = ?policy,
                "created the durable consumer: it delivers from {why}",
            );
        }
        // The first registration of a name claims it for this role; a name
        // another role owns refuses the write (row-level security), and the
        // consumer with it.
        match position::record(&pool, &config, durable.floor()).await {
            Ok(()) => owner::require_owned(&pool, &config.durable).await?,
            Err(e) if e.kind() == crate::ErrorKind::Privilege => {
                owner::require_owned(&pool, &config.durable).await?;
                return Err(e);
            }
            Err(e) => tracing::warn!(
                consumer = %config.durable, error = %e,
                "could not record where the consumer stands; recorded before consuming",
            ),
        }
        let redelivery = retention::redelivery_window(
            config.ack_wait,
            config.max_deliver,
            &config.backoff,
            &config.retry,
        );
        retention::check_window(config.retention.get_window(), redelivery)?;
        state_durability(&config, stream.cached_info(), redelivery);
        if config.filter_subjects.is_empty() {
            tracing::info!(
                consumer = %config.durable, stream = %config.stream,
                "the consumer reads the whole stream: types no route handles are acked and counted \
                 (ConsumerConfig::for_router subscribes to the router's types only)",
            );
        }
        Ok(Self {
            shared: Arc::new(Shared {
                js,
                pool,
                config,
                settled: tokio::sync::Notify::new(),
                info: tokio::sync::watch::Sender::new(None),
            }),
            consumer,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.shared.config
    }

    /// Runs `service` on every message until `shutdown` resolves, then drains.
    ///
    /// `service` is cloned per message and driven with `oneshot` (ready, then
    /// call), so every layer sees tower's usual contract. An
    /// [`ordered`](ConsumerConfig::ordered) consumer first waits to lead (or
    /// for `shutdown`), and goes back to standing by if it loses the lead.
    ///
    /// # Errors
    /// [`ErrorKind::Privilege`](crate::ErrorKind::Privilege) before consuming
    /// anything if the consumer's name is owned by a role this one is not a
    /// member of (checked again here, as [`Consumer::new`] does, so that a
    /// registration the database could not answer then is made first).
    /// [`ErrorKind::ClientClosed`](crate::ErrorKind::ClientClosed) if the NATS
    /// client is closed under it (see [A closed NATS
    /// client](self#a-closed-nats-client)). Nothing else after that: pull and
    /// ack failures are logged and retried, and handler failures are acked,
    /// nak'ed or dead-lettered per message.
    pub async fn run<S, F>(self, service: S, shutdown: F) -> Result<()>
    where
        S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
        F: Future<Output = ()> + Send,
    {
        self.drive(Single(service), shutdown).await
    }

    /// Runs `service` on batches of up to [`ConsumerConfig::max_batch`]
    /// deliveries of distinct subjects, until `shutdown` resolves, then drains.
    ///
    /// The service answers one result per delivery, in order, once its one
    /// transaction has committed: [`Dedupe`](crate::Dedupe) does this for any
    /// `Service<InTx<Delivery>>` stack (writing the batch's inbox rows in one
    /// statement), and [`Trace`](crate::Trace) and [`Metrics`](crate::Metrics)
    /// wrap it as they wrap a single delivery. The committed deliveries are
    /// then acked; each failed one is handled alone, through the same service
    /// given a batch of one, and nak'ed, dead-lettered or (ordered) retried in
    /// place as [`run`](Self::run) would. See the [module docs](self).
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn run_batched<S, F>(self, service: S, shutdown: F) -> Result<()>
    where
        S: Service<Vec<Delivery>, Response = BatchResults> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
        F: Future<Output = ()> + Send,
    {
        let max = self.shared.config.max_batch;
        self.drive(Batched { service, max }, shutdown).await
    }

    /// Serves with `runner`: leading first if ordered, then until shutdown.
    async fn drive<R, F>(self, runner: R, shutdown: F) -> Result<()>
    where
        R: Runner + Clone,
        F: Future<Output = ()> + Send,
    {
        let shared = Arc::clone(&self.shared);
        let config = &shared.config;
        let mut shutdown = std::pin::pin!(shutdown);
        if !claim_before_consuming(&shared, shutdown.as_mut()).await? {
            return Ok(());
        }
        let _pruner = config
            .prune
            .then(|| AbortOnDropHandle::new(tokio::spawn(prune_periodically(Arc::clone(&shared)))));
        let _lag = AbortOnDropHandle::new(tokio::spawn(lag::poll(
            self.consumer.clone(),
            Arc::clone(&shared),
        )));
        tracing::info!(
            consumer = %config.durable, stream = %config.stream, concurrency = config.concurrency,
            max_batch = runner.max_jobs(), ordered = config.ordered, "inbox consumer started",
        );
        panics::register(config);
        if !config.ordered {
            let _ghosts = AbortOnDropHandle::new(tokio::spawn(ghosts::sweep_periodically(
                Arc::clone(&shared),
            )));
            let session = Session::new(
                &shared,
                &self.consumer,
                runner,
                None,
                Backlog::default(),
                None,
            );
            if let Served::ClientClosed = session.run(shutdown.as_mut()).await {
                return Err(client_closed(config));
            }
            lag::record_floor(&self.consumer, &shared).await;
            tracing::info!(consumer = %config.durable, "inbox consumer stopped");
            return Ok(());
        }
        loop {
            let tenure = tokio::select! {
                biased;
                () = shutdown.as_mut() => break,
                tenure = lease::acquire(&shared.pool, &config.durable, config.lease_timeout) => tenure,
            };
            match self.lead(runner.clone(), shutdown.as_mut(), tenure).await {
                Served::Shutdown(tenure) => {
                    if let Some(tenure) = tenure {
                        tenure.release().await;
                    }
                    break;
                }
                Served::Deposed => {}
                // The tenure was dropped with the session: the lock goes
                // with its connection, without a clean handover.
                Served::ClientClosed => return Err(client_closed(config)),
            }
        }
        lag::record_floor(&self.consumer, &shared).await;
        tracing::info!(consumer = %config.durable, "inbox consumer stopped");
        Ok(())
    }

    /// Serves as the leader of an ordered consumer: first lets a predecessor's
    /// last pull expire, then reads what earlier leaders left unfinished.
    async fn lead<R: Runner, F: Future<Output = ()>>(
        &self,
        runner: R,
        mut shutdown: Pin<&mut F>,
        mut tenure: Tenure,
    ) -> Served {
        let shared = &self.shared;
        // Only the leader settles what no client can read.
        let _ghosts =
            AbortOnDropHandle::new(tokio::spawn(ghosts::sweep_periodically(Arc::clone(shared))));
        if !tenure.clean_handover() {
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return Served::Shutdown(Some(tenure)),
                () = tenure.lost() => return Served::Deposed,
                () = tokio::time::sleep(lease::takeover_wait()) => {}
            }
        }
        let taken = loop {
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return Served::Shutdown(Some(tenure)),
                () = tenure.lost() => return Served::Deposed,
                scanned = takeover::scan(shared, &self.consumer) => match scanned {
                    Ok(found) => break found,
                    Err(_) if outbox_pg::nats::is_closed(&shared.js.client()) => {
                        return Served::ClientClosed;
                    }
                    Err(e) => {
                        tracing::warn!(consumer = %shared.config.durable, error = %e, "cannot read what earlier leaders left; retrying");
                    }
                },
            }
            tokio::time::sleep(RESCAN_DELAY).await;
        };
        let checkpoint = Some(taken.checkpoint);
        Session::new(
            shared,
            &self.consumer,
            runner,
            Some(tenure),
            taken.backlog,
            checkpoint,
        )
        .run(shutdown)
        .await
    }
}

/// The error that ends a run whose NATS client was closed under it.
fn client_closed(config: &ConsumerConfig) -> Error {
    Error::new(
        ErrorKind::ClientClosed,
        format!(
            "the NATS client was closed under consumer `{}` (drained, or its connection task \
             ended); nothing was acked after that: build a new client and run again",
            config.durable
        ),
    )
}

/// [`client_closed`] before a consumer is created on a closed client.
fn check_client(js: &jetstream::Context, config: &ConsumerConfig) -> Result<()> {
    if outbox_pg::nats::is_closed(&js.client()) {
        return Err(client_closed(config));
    }
    Ok(())
}

async fn prune_periodically(shared: Arc<Shared>) {
    let retention = &shared.config.retention;
    let mut ticks = tokio::time::interval(retention.get_interval().max(Duration::from_secs(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match retention.prune(&shared.pool, &shared.config.durable).await {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(consumer = %shared.config.durable, deleted, "pruned inbox rows past retention");
            }
            Err(e) => {
                tracing::warn!(consumer = %shared.config.durable, error = %e, "inbox pruning failed");
            }
        }
        match retention
            .prune_dead_letters(&shared.pool, &shared.config.durable)
            .await
        {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(consumer = %shared.config.durable, deleted, "pruned dead letters past retention");
            }
            Err(e) => {
                tracing::warn!(consumer = %shared.config.durable, error = %e, "dead-letter pruning failed");
            }
        }
    }
}

/// The durability in force, stated once at start: the stream's replicas and
/// storage, and the inbox retention window against the redelivery window (a
/// redelivery later than the retention window would find its inbox row pruned
/// and be handled twice; [`retention::check_window`] refuses that). A stream
/// with one replica or memory storage is warned on: a crash or restart of its
/// server can lose messages it acknowledged to their publisher (the relay's
/// audit republishes them; the inbox drops the copies already handled).
fn state_durability(
    config: &ConsumerConfig,
    info: &jetstream::stream::Info,
    redelivery: Option<Duration>,
) {
    let stream = &info.config;
    tracing::info!(
        consumer = %config.durable,
        stream = %config.stream,
        replicas = stream.num_replicas,
        storage = ?stream.storage,
        inbox_retention = ?config.retention.get_window(),
        redelivery_window = ?redelivery,
        "durability: stream replicas and storage; inbox retention against the redelivery window \
         (max_deliver × ack_wait/backoff and nak delays; none: unbounded)",
    );
    if stream.num_replicas <= 1 {
        tracing::warn!(
            consumer = %config.durable,
            stream = %config.stream,
            replicas = stream.num_replicas,
            "durability: the stream has 1 replica: an unsynced crash of its server loses \
             acknowledged messages; run 3 replicas in production",
        );
    }
    if stream.storage == jetstream::stream::StorageType::Memory {
        tracing::warn!(
            consumer = %config.durable,
            stream = %config.stream,
            "durability: the stream keeps messages in memory: a restart of its servers loses them",
        );
    }
}
