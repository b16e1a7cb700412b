//! The relay: moves committed rows of `outbox_events` to JetStream, in insert
//! order per subject, across any number of replicas, at a cost per batch that
//! does not grow with the rows it already published.
//!
//! # Design
//!
//! **Order by insertion.** Every row gets `seq` from a trigger at insert time
//! (migration `…0005`). A writer that changes its entity row and inserts the
//! event in one transaction (the row lock orders the writers) gets seqs in
//! change order, whichever transaction began first; `created_at`, the
//! transaction's start, cannot promise that. Each subject is published in seq
//! order, and the seq travels as the CloudEvents `sequence` attribute
//! (20 zero-padded digits), so consumers compare events of one subject without
//! trusting a clock.
//!
//! **Shards, one owner each** ([`shards`]). Rows are hashed by
//! subject into 64 shards; relays share them out through advisory locks, so
//! one entity's rows are only ever read and published by one relay, and no
//! claim looks at rows held by another. Workers in one relay split its shards
//! the same way. N replicas or N workers add capacity instead of contention.
//!
//! **A cursor per shard, bounded by a settled horizon**
//! (`relay/horizon.rs`). A claim reads a shard's *main lane* (fresh
//! rows: index `(shard, seq) where published_at is null and next_attempt_at is
//! null`) from the shard's cursor on. Published rows leave dead index entries
//! that no vacuum can remove while an old snapshot pins the horizon; reading
//! from the cursor never visits them again, so the claim's cost depends on the
//! rows waiting, not on the rows published. A cursor only passes seqs that are
//! *settled*: every transaction that could still commit a row at or below them
//! has ended. A transaction that took its seq early and commits late is
//! therefore still read (the watermark trap stays shut). Every 60 s a shard is
//! read from its start once, to pick up rows an operator moved back by hand.
//!
//! **The retry lane.** A row that fails moves to the retry lane
//! (`next_attempt_at` set), due after its backoff, or parked at `'infinity'`
//! past the cap. Later rows of its subject are deferred into the retry lane
//! behind it, so a blocked subject neither blocks its shard's cursor nor fills
//! batches. A row published out of the retry lane makes the rows deferred
//! behind it due at once.
//!
//! **The due lane** (`relay/due.rs`). A scheduled row (`due_at` set) waits
//! in neither lane but in its own index, by due time, and is published by
//! the due source once the database's clock passes it; it neither blocks
//! nor waits behind its subject's immediate rows.
//!
//! **Publish outside any transaction.** The claim is one read-only statement;
//! publishing holds no lock and no transaction; each publish is bounded by the
//! publish timeout and each batch by the lease. One subject's rows are
//! published one after the other, each awaiting its PubAck; subjects go in
//! parallel. Outcomes are written in one statement per kind.
//!
//! **Faults.** Only a refusal of the row itself counts toward its attempts:
//! broker faults (not connected, no ack in time, no stream answering, the
//! stream gone) leave the row untouched, and the worker backs off. Every column is checked before a
//! row is published (`relay/message.rs`); a row no client could
//! decode is parked with an error naming the fault, counted and logged once,
//! and blocks only its own subject.
//!
//! **Stream positions and the audit** (`relay/audit.rs`, [`crate::audit`]).
//! Each row is marked published with its PubAck's stream and sequence
//! (`published_stream`, `published_seq`, in the statement that sets
//! `published_at`). A PubAck does not mean the message is on disk, so the
//! audit task reads back, for the shards this relay owns, the messages of
//! rows published within the audit horizon and longer ago than the stream's
//! duplicate window plus its margin (a republish inside the window could be
//! acked as a duplicate of the lost message and not stored), by sequence,
//! and compares the message id (after a lost store, sequences are handed out
//! again). A row whose message is gone or another one is put back in the
//! retry lane (not the main lane: the shard's cursor is past it), guarded by
//! the position found lost, and published again with the same id by the
//! workers; counted and logged once. An error reading the stream is never a
//! finding. At start the relay logs the durability in force and warns on,
//! or with `require_durable` refuses, a stream with one replica or memory
//! storage and a disabled audit (`relay/durability.rs`).
//!
//! **The stream as it is now** ([`StreamView`]). The stream may be edited,
//! or deleted and recreated, while the relay runs. Its config is read at
//! start, every `stream_refresh` (30 s), at once when a row's type looks
//! uncaptured or the broker refuses a message, and by each audit pass; the
//! sink judges rows by it and the audit reads its limits from it. A type
//! the stream, read again, does not capture is a configuration problem, not
//! the row's: the row waits in the retry lane (`stream_refresh`, no attempt
//! counted, never parked) and is published once an operator adds its subject
//! (one warning per type with the `nats stream edit` command). A stream
//! that is gone is a broker fault: rows wait, untouched, until it exists
//! again; the relay does not recreate it while it runs (an operator who
//! deleted it may be recreating it with other settings), and says so once
//! (`outbox_relay_stream_up` 0). A message over a lowered `max_msg_size` is
//! parked as too large only once a re-read confirms the limit.
//!
//! # The shape: one engine, sources beside it
//!
//! The **engine** (`relay/engine.rs`, `relay/chain.rs`) validates rows into
//! messages, publishes each subject's chain in order, records every outcome
//! and marks the published rows, never before their PubAck. It reads no
//! rows. **Sources** feed it, each a task that owns its own state: the
//! polling source (`relay/poll/`: workers, claims, cursors, LISTEN
//! wake-ups), the due source (`relay/due.rs`: scheduled rows at their time,
//! in both modes) and, where configured, the WAL source ([`crate::wal`]: the
//! slot's lead, the backfill, replication sessions and their pipeline).
//! They share no fields, only named handles made by the wiring in
//! [`Relay::run`]: the wake-up channel the polling workers listen on, and
//! the main lane's end (`MainLane`, a `watch` channel), which the WAL source
//! raises to hand the polling workers the rows written before its slot.
//! The shards, the settled horizon, the maintenance tasks (gauges,
//! retention, the stream's re-read) and the audit are the relay's, joined
//! beside the sources. The due source is one more task in that join: it
//! needs only the engine and the shards (it listens on a channel of its
//! own), and the other two did not change for it.
//!
//! # What this replaced, and why
//!
//! The first design claimed with `for update skip locked` in `created_at`
//! order, leased rows by writing `locked_until`, and checked per subject for an
//! earlier unpublished row held elsewhere. Measured on 2 cores: transaction
//! start is not change order (20 of 20 entities out of order with two writers);
//! with an open snapshot pinning the horizon, each claim re-walked every row
//! published since (0.07–0.15 of the free rate); and replicas claiming the same
//! head rows mostly skipped each other (4 replicas slower than 1). The numbers
//! for this design are in `BENCHMARKS.md`.
//!
//! # The writer's rule
//!
//! For per-entity order to be causal, change the entity's row (which takes its
//! row lock) and insert its event in the same transaction. Two transactions
//! that insert events for one entity without touching a common row are
//! unordered, as they are in the database itself.

use std::future::Future;
use std::time::Duration;

use outbox_pg::Privilege;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::RelayConfig;
use crate::error::{ErrorKind, Result};
use crate::sink::{JetStreamSink, Sink};
use crate::store::Store;
use crate::stream::StreamSpec;
use crate::stream_view::StreamView;
use crate::wal::WalReader;

mod audit;
mod due;
mod durability;
mod engine;
mod horizon;
mod listen;
mod maintenance;
pub(crate) mod message;
mod poll;
pub mod shards;

use due::DueSource;
pub use engine::BatchReport;
pub(crate) use engine::{Engine, Outcome};
pub(crate) use horizon::Horizon;
use poll::PollSource;
pub(crate) use poll::{MainLane, MainLaneLimit};
pub use shards::SHARDS;

/// The channel the migration's trigger notifies on every insert into the
/// table in schema `public`; a table in another schema notifies a channel of
/// its own ([`outbox_pg::Namespace::notify_channel`]).
pub const NOTIFY_CHANNEL: &str = "outbox_events";

/// The relay. Run any number of them against one table.
///
/// It wires the parts together: the engine both sources publish through,
/// the sources (polling, and WAL where configured), shard ownership, the
/// maintenance tasks and the audit, all joined in [`run`](Self::run).
#[derive(Debug)]
pub struct Relay<S = JetStreamSink> {
    engine: Engine<S>,
    horizon: Horizon,
    shards: shards::Shards,
    audit: Option<crate::audit::Audit>,
    /// The stream and subjects, for the start line (a JetStream relay).
    target: Option<engine::progress::Target>,
}

/// The privileges a relay with `config` needs: SELECT and UPDATE on
/// `outbox_events` (claims, marks, deferrals), DELETE on it when retention is
/// on, and SELECT on the sequence `outbox_events_seq` (the settled horizon).
/// Advisory locks, `pg_locks` and LISTEN need none.
pub fn required_privileges(config: &RelayConfig) -> Vec<Privilege> {
    let mut required = vec![
        Privilege::table("outbox_events", "SELECT"),
        Privilege::table("outbox_events", "UPDATE"),
        Privilege::sequence("outbox_events_seq", "SELECT"),
    ];
    if config.retention.is_some() {
        required.push(Privilege::table("outbox_events", "DELETE"));
    }
    required
}

/// The group role of `ops/sql/roles.sql` that holds a relay's privileges.
const RELAY_ROLE: &str = "outbox_relay";

/// How long the start-up privilege check may wait for the database before
/// the relay goes on without it (a database that is down is waited for by
/// the relay's loops, not here).
const PRIVILEGE_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The start-up checks: no transaction pooler
/// ([`outbox_pg::require_sessions`]), a complete outbox schema whose sequence
/// keeps the settled horizon ([`outbox_pg::check_outbox_layout`]; a schema not
/// there yet is waited for [`outbox_pg::SCHEMA_WAIT`], for a relay started
/// beside the services that migrate), and the role's privileges. Each is a
/// configuration error, not an outage; a check that cannot run (the database
/// not reachable yet) is logged and passes, and each new shard ownership
/// session checks for a pooler again.
async fn check_privileges(pool: &PgPool, config: &RelayConfig) -> Result<()> {
    let options = pool.connect_options();
    if let Some(why) =
        outbox_pg::require_sessions_at_start(&options, "the relay", PRIVILEGE_CHECK_TIMEOUT).await?
    {
        warn!(error = %why, "could not check the database URL for a transaction pooler; going on");
    }
    let waited = std::sync::atomic::AtomicBool::new(false);
    let layout = outbox_pg::check_outbox_layout_at_start(pool, PRIVILEGE_CHECK_TIMEOUT, |e| {
        waited.store(true, std::sync::atomic::Ordering::Relaxed);
        warn!(error = %e, wait = ?outbox_pg::SCHEMA_WAIT, "waiting for the outbox migrations");
    })
    .await?;
    match layout {
        Some(why) => warn!(error = %why, "could not check the outbox's schema; going on"),
        None if waited.load(std::sync::atomic::Ordering::Relaxed) => {
            info!("the outbox schema is in place")
        }
        None => {}
    }
    let required = required_privileges(config);
    let unchecked =
        outbox_pg::check_privileges_at_start(pool, &required, RELAY_ROLE, PRIVILEGE_CHECK_TIMEOUT)
            .await?;
    if let Some(why) = unchecked {
        warn!(error = %why, "could not check the relay's database privileges; going on");
    }
    Ok(())
}

impl Relay<JetStreamSink> {
    /// A relay publishing to JetStream through `client`, after checking the
    /// database role's privileges ([`Relay::check_privileges`]) and creating
    /// or verifying `stream`.
    ///
    /// # Errors
    /// [`ErrorKind::Privilege`] if the role lacks a privilege the relay needs;
    /// [`ErrorKind::Config`] for an invalid config, or a stream whose
    /// duplicate window is not longer than the lease plus the publish timeout
    /// (a republish after a takeover would be stored twice), or, with
    /// [`RelayConfig::require_durable`], a stream with one replica or memory
    /// storage or the audit off (the durability in force is logged first,
    /// with a warning per risk);
    /// [`ErrorKind::Stream`] / [`ErrorKind::Broker`] from [`StreamSpec::ensure`].
    pub async fn jetstream(
        pool: PgPool,
        client: async_nats::Client,
        stream: &StreamSpec,
        config: RelayConfig,
    ) -> Result<Self> {
        config.validate()?;
        check_privileges(&pool, &config).await?;
        Self::set_up(pool, client, stream, config).await
    }

    /// [`Relay::jetstream`] after the privilege check: the stream, the
    /// durability statement, the audit.
    async fn set_up(
        pool: PgPool,
        client: async_nats::Client,
        stream: &StreamSpec,
        config: RelayConfig,
    ) -> Result<Self> {
        if outbox_pg::nats::is_closed(&client) {
            return Err(crate::Error::new(
                ErrorKind::ClientClosed,
                "the NATS client given to the relay is closed (drained, or its connection task \
                 ended): build a new client",
            ));
        }
        let sink = JetStreamSink::new(client, config.publish_timeout).expect_stream(stream.name());
        let existing = stream.ensure(sink.context()).await?;
        // The sink and the audit follow the stream as it is edited.
        let view = StreamView::new(
            sink.context().clone(),
            existing.clone(),
            config.publish_timeout,
        );
        // The audit reads on a connection of its own, never a worker's.
        let audit_pool = Store::new(&pool, 1).pool().clone();
        let audit = crate::audit::Audit::from_config(audit_pool, sink.context().clone(), &existing)
            .follow(view.clone());
        let audit = durability::state(&existing, &config, audit)?;
        let sink = sink.follow(view);
        let mut relay = Self::new(pool, sink, config)?;
        relay.audit = audit;
        relay.target = Some(engine::progress::Target {
            stream: existing.name.clone(),
            subjects: existing.subjects.clone(),
        });
        Ok(relay)
    }

    /// Sets up a JetStream relay as [`Relay::jetstream`] does and runs it until
    /// `shutdown` resolves, for a service that runs its relay in-process
    /// or a binary that must not depend on the broker being up when it starts.
    /// A set-up failure that may pass (NATS not reachable yet) is logged once
    /// and retried with backoff (0.5 s doubling to 10 s); events wait in the
    /// table meanwhile.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if `config` is invalid or the stream's duplicate
    /// window is too short; [`ErrorKind::Stream`] if the stream differs from
    /// `stream`; [`ErrorKind::Privilege`] if the database role lacks a
    /// privilege the relay needs — none passes by waiting;
    /// [`ErrorKind::ClientClosed`] if `client` is closed, or is found closed
    /// while the relay runs (see [`Relay::run`]).
    pub async fn run_jetstream(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSpec,
        config: RelayConfig,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<()> {
        let token = CancellationToken::new();
        let run = async {
            let Some(relay) = Self::connect_until(pool, client, stream, config, &token).await?
            else {
                return Ok(());
            };
            relay.run_until(&token).await
        };
        until_shutdown(shutdown, &token, run).await
    }

    /// [`Relay::jetstream`], its set-up retried while the broker cannot be
    /// reached (one log line when it starts waiting, one when it is through;
    /// the privileges are checked once, before). `None` if `shutdown` came
    /// first.
    ///
    /// # Errors
    /// As [`Relay::run_jetstream`].
    pub async fn connect_jetstream(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSpec,
        config: RelayConfig,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Option<Self>> {
        let token = CancellationToken::new();
        let connect = Self::connect_until(pool, client, stream, config, &token);
        until_shutdown(shutdown, &token, connect).await
    }

    /// [`Relay::connect_jetstream`] until `shutdown` is cancelled.
    async fn connect_until(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSpec,
        config: RelayConfig,
        shutdown: &CancellationToken,
    ) -> Result<Option<Self>> {
        config.validate()?;
        // Once: waiting for the broker changes nothing about the role.
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            checked = check_privileges(&pool, &config) => checked?,
        }
        let mut waiting = false;
        let set_up = outbox_pg::ready::until_ready(
            outbox_pg::ready::pauses(Duration::from_millis(500), Duration::from_secs(10)),
            None,
            || Self::set_up(pool.clone(), client.clone(), &stream, config.clone()),
            // Waiting cures the broker, not a configuration, a stream or a role.
            |e: &crate::Error| {
                !matches!(
                    e.kind(),
                    ErrorKind::Config
                        | ErrorKind::Stream
                        | ErrorKind::Privilege
                        | ErrorKind::ClientClosed
                )
            },
            |e, _| {
                crate::metrics::broker_up(false);
                if !waiting {
                    warn!(stream = stream.name(), error = %e, "broker not reachable; waiting for it");
                    waiting = true;
                }
            },
        );
        let relay = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            relay = set_up => relay?,
        };
        if waiting {
            info!(stream = stream.name(), "broker reachable; relay set up");
        }
        Ok(Some(relay))
    }
}

impl<S: Sink> Relay<S> {
    /// A relay publishing to `sink`. It opens connections of its own with
    /// `pool`'s connect options and JIT off (at most `workers + 2`, plus one
    /// for shard ownership and one for LISTEN); `pool` itself is not used.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if `config` is invalid.
    pub fn new(pool: PgPool, sink: S, config: RelayConfig) -> Result<Self> {
        config.validate()?;
        let options = (*pool.connect_options()).clone();
        // Workers, the pruner and the gauges; the shard session and the
        // LISTEN connection are their own.
        let store = Store::new(
            &pool,
            u32::try_from(config.workers)
                .unwrap_or(u32::MAX)
                .saturating_add(2),
        );
        Ok(Self {
            shards: shards::Shards::new(options, config.workers, config.lease),
            horizon: Horizon::default(),
            engine: Engine::new(store, sink, config),
            audit: None,
            target: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.engine.config
    }

    /// Checks that the database role holds what this relay's configuration
    /// uses ([`required_privileges`]). [`Relay::jetstream`] (and so
    /// [`Relay::connect_jetstream`] and [`Relay::run_jetstream`]) calls it
    /// before anything else; a relay built with [`Relay::new`] on a sink of
    /// its own may call it before [`run`](Self::run).
    ///
    /// # Errors
    /// [`ErrorKind::Privilege`], naming the role and each missing privilege
    /// and table: "role `relay_login` lacks UPDATE on table outbox_events;
    /// grant it outbox_relay (ops/sql/roles.sql)". A check that cannot run
    /// (the database not reachable) is logged and passes: the relay waits
    /// for the database as it always does.
    pub async fn check_privileges(&self) -> Result<()> {
        check_privileges(self.engine.store.pool(), &self.engine.config).await
    }

    /// Runs until `shutdown` resolves: shard ownership, the publisher
    /// workers, the LISTEN wake-ups, the backlog gauges, the pruner, the
    /// audit ([`crate::audit`], on a relay built by [`Relay::jetstream`]) and
    /// the sink's periodic re-read of the stream ([`Sink::refresh`]). On
    /// shutdown each worker finishes its batch (every publish in it is
    /// bounded) and marks it, the shards are given back, then `run` returns.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when a shard ownership session finds the database
    /// URL leads to a transaction pooler (a relay whose start-up check could
    /// not run): the relay stops as on shutdown.
    /// [`ErrorKind::ClientClosed`] when the sink's NATS client is found closed
    /// for good ([`Sink::is_closed`], asked every second while the broker
    /// counts as down): the relay stops as on shutdown, its rows left in the
    /// table for a relay on a new client. Database and broker failures are
    /// retried with backoff, not returned.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let token = CancellationToken::new();
        until_shutdown(shutdown, &token, self.run_until(&token)).await
    }

    /// [`Relay::run`] until `shutdown` is cancelled.
    async fn run_until(&self, shutdown: &CancellationToken) -> Result<()> {
        let crate::config::Source::Wal(wal) = &self.engine.config.source else {
            return self.run_sources(shutdown, MainLane::open(), None).await;
        };
        // A standby publishes nothing: the leader's polling workers and WAL
        // reader do it all (see crate::wal).
        loop {
            let Some((mut lead, names)) =
                crate::wal::lead(&self.engine.store, wal, shutdown).await?
            else {
                info!("outbox relay stopped");
                return Ok(());
            };
            // The polling source reads no fresh row until the WAL source
            // hands it the backfill.
            let (limit, lane) = MainLane::closed();
            let reader = WalReader::new(&self.engine, &self.horizon, wal, names, limit);
            let stop = shutdown.child_token();
            let (result, ()) = tokio::join!(
                async {
                    let result = self.run_sources(&stop, lane, Some(reader)).await;
                    // Done, or stopped by a failure of its own: let go of the lead.
                    stop.cancel();
                    result
                },
                crate::wal::keep_lead(&mut lead, self.engine.config.publish_timeout, &stop),
            );
            result?;
            if shutdown.is_cancelled() {
                return Ok(());
            }
        }
    }

    /// The relay's tasks until `shutdown`, joined: shard ownership, the
    /// polling source (its main lane ending at `lane`), the due source
    /// (scheduled rows, in both modes), the WAL source when
    /// given (the polling source then serves the backfill and the retry
    /// lane), the LISTEN wake-ups (polling alone), the client watch, the
    /// maintenance tasks and the audit. A source is added here, beside the
    /// others, with the handles it shares (`wake`, a [`MainLane`]).
    async fn run_sources(
        &self,
        shutdown: &CancellationToken,
        lane: MainLane,
        wal: Option<WalReader<'_, S>>,
    ) -> Result<()> {
        let engine = &self.engine;
        let (wake, wake_rx) = watch::channel(0_u64);
        let source = if wal.is_some() { "wal" } else { "poll" };
        engine::progress::log_start(&engine.config, self.target.as_ref(), source);
        let poll = PollSource::new(engine, &self.shards, &self.horizon, lane);
        let due = DueSource::new(engine, &self.shards);
        let auditor = audit::Auditor {
            audit: self.audit.as_ref(),
            config: &engine.config,
            shards: &self.shards,
        };
        let wal_failure = std::sync::Mutex::new(None);
        let client_failure = std::sync::Mutex::new(None);
        let workers_done = CancellationToken::new();
        // Cancelled by `shutdown`, or when the relay finds it cannot run here
        // (its shard session leads to a transaction pooler).
        let stop = shutdown.child_token();
        tokio::join!(
            async {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = self.shards.failed() => stop.cancel(),
                }
            },
            async {
                tokio::join!(poll.run(&wake_rx, &stop), due.run(&stop));
                workers_done.cancel();
            },
            // Shards are given back only once no worker can claim any more.
            self.shards.maintain(&workers_done),
            async {
                // The WAL wakes nothing up: its rows come from the slot.
                if wal.is_none() && engine.config.listen {
                    listen::listen_loop(
                        engine.store.pool(),
                        listen::Channel::Inserts,
                        &wake,
                        &stop,
                    )
                    .await;
                }
            },
            async {
                if let Some(wal) = &wal
                    && let Err(e) = wal.run(&wake, &stop).await
                {
                    stop_with(&wal_failure, e, &stop);
                }
            },
            async {
                if let Some(e) = engine.client_watch(&stop).await {
                    stop_with(&client_failure, e, &stop);
                }
            },
            engine.stats_loop(&self.shards, &stop),
            engine.progress_loop(&stop),
            engine.prune_loop(&stop),
            auditor.run(&stop),
            engine.stream_refresh_loop(&stop),
        );
        if let Some(e) = wal_failure.into_inner().ok().flatten() {
            error!(error = %e, "outbox relay stopped: its WAL source cannot run here");
            return Err(e);
        }
        if let Some(e) = client_failure.into_inner().ok().flatten() {
            return Err(e);
        }
        if let Some(e) = self.shards.take_failure() {
            error!(error = %e, "outbox relay stopped: it cannot run on this database connection");
            return Err(e);
        }
        info!("outbox relay stopped");
        Ok(())
    }

    /// Publishes every row due when it starts, in every shard, and returns
    /// the totals; prunes once if retention is on. Rows in backoff, parked
    /// or skipped are not waited for; a broker that is down is.
    ///
    /// Alone, a relay owns every shard and drains the whole table. Beside
    /// other relays (a long-running one, or another drain started by an
    /// overlapping cron job) it drains its share, then waits while the
    /// others publish theirs, taking over the shards they let go of, until
    /// no row that was due is left anywhere.
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if a claim or mark
    /// fails; [`ErrorKind::Stalled`] when rows were
    /// left for 60 s without one of them getting published (the message
    /// counts them and names their shards).
    pub async fn drain(&self) -> Result<BatchReport> {
        let poll = PollSource::new(&self.engine, &self.shards, &self.horizon, MainLane::open());
        let due = DueSource::new(&self.engine, &self.shards);
        let stop = CancellationToken::new();
        let (total, scheduled) = tokio::join!(
            async {
                let total = poll.drain().await;
                stop.cancel();
                total
            },
            due.drain(&stop),
        );
        let mut total = total?;
        total.add(scheduled?);
        if self.engine.config.retention.is_some() {
            self.engine.prune().await?;
        }
        Ok(total)
    }

    /// Deletes published rows older than the retention window, in batches;
    /// returns how many. Unpublished rows are never deleted.
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if a delete fails.
    pub async fn prune(&self) -> Result<u64> {
        self.engine.prune().await
    }
}

/// Keeps `e`, the failure a task stopped on, in `slot`, and stops the relay.
fn stop_with(
    slot: &std::sync::Mutex<Option<crate::Error>>,
    e: crate::Error,
    stop: &CancellationToken,
) {
    if let Ok(mut failure) = slot.lock() {
        *failure = Some(e);
    }
    stop.cancel();
}

/// Runs `work`, which stops once `token` is cancelled, to its end; when
/// `shutdown` resolves first, cancels `token` and lets `work` finish.
/// Shutdown is a future, as in axum's `with_graceful_shutdown` and
/// `inbox_consumer::Consumer::run`.
async fn until_shutdown<T>(
    shutdown: impl Future<Output = ()>,
    token: &CancellationToken,
    work: impl Future<Output = T>,
) -> T {
    let mut work = std::pin::pin!(work);
    tokio::select! {
        out = &mut work => return out,
        () = shutdown => token.cancel(),
    }
    work.await
}
