//! The invariants, read from the databases and the stream, never from the
//! demo's own counters (those only say which ids to look for).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use outbox_pg::Envelope;
use serde_json::Value;
use sqlx::PgPool;

use crate::driver::Outcomes;

type Ts = chrono::DateTime<chrono::Utc>;

/// Rows an outbox still has to publish: a cancelled scheduled row never is.
const UNPUBLISHED: &str =
    "select count(*) from outbox_events where published_at is null and cancelled_at is null";
type InvoiceRow = (String, String, Ts, Option<Ts>);

/// What the check found.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    pub(crate) subscriptions: usize,
    pub(crate) cancelled_subscriptions: usize,
    pub(crate) events_published: usize,
    pub(crate) invoices: usize,
    pub(crate) voided: usize,
    pub(crate) invoice_events: usize,
    pub(crate) deliveries: u64,
    pub(crate) handled: i64,
    pub(crate) dead_letters: i64,
    pub(crate) lost: Vec<String>,
    pub(crate) applied_twice: Vec<String>,
    pub(crate) leaked: Vec<String>,
    pub(crate) order_violations: Vec<String>,
    /// Trials: subscriptions with a scheduled `subscription.trial_ended`.
    pub(crate) trials: Trials,
    /// A cancelled trial end that reached the stream or billing, or a
    /// converted trial whose end was not cancelled.
    pub(crate) cancelled_consumed: Vec<String>,
    /// A trial end published or handled before its due time.
    pub(crate) early: Vec<String>,
    pub(crate) undrained: i64,
    /// The unpublished rows (a few of each database) and the replication
    /// slots' positions, to tell why they were left.
    pub(crate) undrained_rows: Vec<String>,
}

/// What became of the trials' scheduled ends.
#[derive(Debug, Default)]
pub(crate) struct Trials {
    /// Scheduled `subscription.trial_ended` rows.
    pub(crate) scheduled: usize,
    /// Cancelled by a conversion.
    pub(crate) converted: usize,
    /// Cancelled with their subscription.
    pub(crate) cancelled_with_subscription: usize,
    /// Not cancelled: due, published and consumed.
    pub(crate) ran_out: usize,
    /// Rows of billing's `trial_ends`.
    pub(crate) recorded: usize,
    /// The latest a trial end was recorded by billing after its due time.
    pub(crate) max_lateness: chrono::Duration,
}

impl Findings {
    pub(crate) fn passed(&self) -> bool {
        self.lost.is_empty()
            && self.applied_twice.is_empty()
            && self.leaked.is_empty()
            && self.order_violations.is_empty()
            && self.cancelled_consumed.is_empty()
            && self.early.is_empty()
            && self.undrained == 0
    }
}

/// A message of the stream, decoded.
struct Stored {
    event_type: String,
    id: String,
    subject: String,
    data: Value,
    /// The due time of a scheduled event's message (`scheduledfor`).
    scheduled_for: Option<Ts>,
}

async fn read_stream(js: &jetstream::Context, stream: &str) -> Result<Vec<Stored>, String> {
    let mut stream = js
        .get_stream(stream)
        .await
        .map_err(|e| format!("stream {stream}: {e}"))?;
    let total = stream
        .info()
        .await
        .map_err(|e| format!("stream info: {e}"))?
        .state
        .messages as usize;
    let mut out = Vec::with_capacity(total);
    if total == 0 {
        return Ok(out);
    }
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .map_err(|e| format!("ordered consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("reading the stream: {e}"))?;
    while out.len() < total {
        let message = match tokio::time::timeout(Duration::from_secs(10), messages.next()).await {
            Ok(Some(Ok(m))) => m,
            _ => return Err(format!("read {} of {total} stream messages", out.len())),
        };
        match Envelope::<Value>::from_json(&message.payload) {
            Ok(env) => out.push(Stored {
                event_type: env.event_type().to_string(),
                id: env.id().to_string(),
                subject: env.subject().to_owned(),
                scheduled_for: env.scheduled_for(),
                data: env.into_data(),
            }),
            Err(e) => return Err(format!("a stream message is not an envelope: {e}")),
        }
    }
    Ok(out)
}

/// Whether the system has settled: outboxes drained, the consumer caught up,
/// every subscription invoiced and every cancellation applied. `Err` says what
/// is still outstanding.
pub(crate) async fn settled(
    subs: &PgPool,
    billing: &PgPool,
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
) -> Result<(), String> {
    let q = |pool: &PgPool, sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap_or(-1)
        }
    };
    // A cancelled scheduled row is never published; one not yet due is
    // waited for.
    let unpublished = q(subs, UNPUBLISHED).await;
    let billing_unpublished = q(billing, UNPUBLISHED).await;
    let (pending, ack_pending, delivered, ack_floor) = match js
        .get_consumer_from_stream::<consumer::pull::Config, _, _>(durable, stream)
        .await
    {
        Ok(mut c) => match c.info().await {
            Ok(info) => (
                info.num_pending as i64,
                info.num_ack_pending as i64,
                info.delivered.stream_sequence as i64,
                info.ack_floor.stream_sequence as i64,
            ),
            Err(_) => (-1, -1, -1, -1),
        },
        Err(_) => (-1, -1, -1, -1),
    };
    let subscriptions = q(subs, "select count(*) from subscriptions").await;
    let cancelled = q(
        subs,
        "select count(*) from subscriptions where status = 'cancelled'",
    )
    .await;
    let invoiced = q(
        billing,
        "select count(distinct subscription_id) from invoices",
    )
    .await;
    let voided = q(
        billing,
        "select count(distinct subscription_id) from invoices where voided_at is not null",
    )
    .await;
    let trials_ended = q(
        subs,
        "select count(*) from outbox_events
          where event_type = 'subscription.trial_ended' and published_at is not null",
    )
    .await;
    let trials_recorded = q(billing, "select count(distinct event_id) from trial_ends").await;
    if unpublished == 0
        && billing_unpublished == 0
        && pending == 0
        && ack_pending == 0
        && subscriptions == invoiced
        && cancelled == voided
        && trials_ended == trials_recorded
    {
        Ok(())
    } else {
        Err(format!(
            "unpublished {unpublished}+{billing_unpublished}, consumer pending {pending} ack-pending {ack_pending} \
             (delivered up to {delivered}, acked up to {ack_floor}), invoiced {invoiced}/{subscriptions}, voided {voided}/{cancelled}, \
             trial ends recorded {trials_recorded}/{trials_ended}"
        ))
    }
}

/// Checks every invariant.
pub(crate) async fn check(
    subs: &PgPool,
    billing: &PgPool,
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
    outcomes: &Outcomes,
) -> Result<Findings, String> {
    let db = |e: sqlx::Error| format!("database: {e}");
    let mut f = Findings::default();

    let rows: Vec<(String, String, String)> =
        sqlx::query_as("select id, customer_id, status from subscriptions")
            .fetch_all(subs)
            .await
            .map_err(db)?;
    let subscriptions: HashMap<String, (String, String)> =
        rows.into_iter().map(|(id, c, s)| (id, (c, s))).collect();
    f.subscriptions = subscriptions.len();
    f.cancelled_subscriptions = subscriptions
        .values()
        .filter(|(_, s)| s == "cancelled")
        .count();

    let invoices: Vec<InvoiceRow> =
        sqlx::query_as("select id::text, subscription_id, created_at, voided_at from invoices")
            .fetch_all(billing)
            .await
            .map_err(db)?;
    f.invoices = invoices.len();
    f.voided = invoices.iter().filter(|i| i.3.is_some()).count();
    let mut invoices_by_sub: HashMap<&str, Vec<&InvoiceRow>> = HashMap::new();
    for inv in &invoices {
        invoices_by_sub.entry(inv.1.as_str()).or_default().push(inv);
    }

    let messages = read_stream(js, stream).await?;
    let mut created_msgs: HashMap<String, usize> = HashMap::new();
    let mut cancelled_msgs: HashSet<String> = HashSet::new();
    let mut invoice_msgs: HashSet<String> = HashSet::new();
    let mut stream_order: HashMap<(String, String), Vec<String>> = HashMap::new();
    let mut ids_seen: HashSet<String> = HashSet::new();
    for m in &messages {
        let sub = m.data["subscription_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        match m.event_type.as_str() {
            "subscription.created" => *created_msgs.entry(sub).or_default() += 1,
            "subscription.cancelled" => {
                cancelled_msgs.insert(sub);
            }
            "invoice.created" => {
                invoice_msgs.insert(m.data["invoice_id"].as_str().unwrap_or_default().to_owned());
            }
            _ => {}
        }
        // Redeliveries of one id (outside the duplicate window) keep the
        // first position. A scheduled event is in no order with its
        // subject's other events: published at its due time.
        if m.scheduled_for.is_none() && ids_seen.insert(m.id.clone()) {
            let source = if m.event_type.starts_with("invoice.") {
                "billing"
            } else {
                "subscriptions"
            };
            stream_order
                .entry((source.to_owned(), m.subject.clone()))
                .or_default()
                .push(m.id.clone());
        }
    }
    f.events_published = messages
        .iter()
        .filter(|m| m.event_type.starts_with("subscription."))
        .count();
    f.invoice_events = invoice_msgs.len();

    // Every 201 was a commit.
    for id in &outcomes.accepted {
        if !subscriptions.contains_key(id) {
            f.lost
                .push(format!("accepted subscription {id} is not in the database"));
        }
    }
    for (id, (_, status)) in &subscriptions {
        if !created_msgs.contains_key(id) {
            f.lost.push(format!(
                "subscription.created of {id} never reached the stream"
            ));
        }
        match invoices_by_sub.get(id.as_str()).map_or(0, Vec::len) {
            0 => f.lost.push(format!("subscription {id} has no invoice")),
            1 => {}
            n => f
                .applied_twice
                .push(format!("subscription {id} has {n} invoices")),
        }
        if status == "cancelled" {
            if !cancelled_msgs.contains(id) {
                f.lost.push(format!(
                    "subscription.cancelled of {id} never reached the stream"
                ));
            }
            if invoices_by_sub
                .get(id.as_str())
                .is_some_and(|v| v.iter().any(|i| i.3.is_none()))
            {
                f.lost.push(format!(
                    "cancelled subscription {id} has an invoice that was not voided"
                ));
            }
        } else if invoices_by_sub
            .get(id.as_str())
            .is_some_and(|v| v.iter().any(|i| i.3.is_some()))
        {
            f.leaked
                .push(format!("active subscription {id} has a voided invoice"));
        }
    }
    for inv in &invoices {
        if !invoice_msgs.contains(&inv.0) {
            f.lost.push(format!(
                "invoice.created of invoice {} never reached the stream",
                inv.0
            ));
        }
        if !subscriptions.contains_key(&inv.1) {
            f.leaked.push(format!(
                "invoice {} is for subscription {}, which does not exist",
                inv.0, inv.1
            ));
        }
        // Effects in event order: the cancellation was applied after the creation.
        if let Some(voided) = &inv.3
            && *voided < inv.2
        {
            f.order_violations
                .push(format!("invoice {} voided before it was created", inv.0));
        }
    }

    // Nothing of a rolled-back or rejected request exists anywhere.
    let rolled_back: HashSet<&str> = outcomes.rolled_back.iter().map(String::as_str).collect();
    for id in &rolled_back {
        if subscriptions.contains_key(*id) {
            f.leaked
                .push(format!("rolled-back subscription {id} exists"));
        }
        if created_msgs.contains_key(*id) {
            f.leaked.push(format!(
                "an event of rolled-back subscription {id} was published"
            ));
        }
        if invoices_by_sub.contains_key(*id) {
            f.leaked
                .push(format!("rolled-back subscription {id} was invoiced"));
        }
    }
    for (id, (customer, _)) in &subscriptions {
        if customer.starts_with("invalid_") {
            f.leaked
                .push(format!("subscription {id} of a rejected request exists"));
        }
    }
    let leaked_rows: i64 = sqlx::query_scalar(
        "select count(*) from outbox_events where data->>'subscription_id' = any($1) or data->>'customer_id' like 'invalid\\_%'",
    )
    .bind(outcomes.rolled_back.clone())
    .fetch_one(subs)
    .await
    .map_err(db)?;
    if leaked_rows > 0 {
        f.leaked.push(format!(
            "{leaked_rows} outbox rows of rolled-back or rejected requests"
        ));
    }

    check_trials(subs, billing, durable, &messages, outcomes, &mut f).await?;

    // Per subject, the stream holds its immediate events in created_at order.
    for (source, pool) in [("subscriptions", subs), ("billing", billing)] {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "select subject, id::text from outbox_events where due_at is null
                  order by created_at, id",
        )
        .fetch_all(pool)
        .await
        .map_err(db)?;
        let mut expected: HashMap<String, Vec<String>> = HashMap::new();
        for (subject, id) in rows {
            expected.entry(subject).or_default().push(id);
        }
        for (subject, ids) in expected {
            let actual = stream_order.get(&(source.to_owned(), subject.clone()));
            if actual.is_some_and(|a| a != &ids) {
                f.order_violations.push(format!(
                    "{source} subject {subject}: stream order differs from created_at order"
                ));
            }
        }
    }

    f.undrained = sqlx::query_scalar::<_, i64>(UNPUBLISHED)
        .fetch_one(subs)
        .await
        .map_err(db)?
        + sqlx::query_scalar::<_, i64>(UNPUBLISHED)
            .fetch_one(billing)
            .await
            .map_err(db)?;
    if f.undrained > 0 {
        for (name, pool) in [("subscriptions", subs), ("billing", billing)] {
            let rows: Vec<(String,)> = sqlx::query_as(
                "select format('%s id %s seq %s subject %s type %s created %s attempts %s next_attempt %s',
                               $1::text, id, seq, subject, event_type, created_at, attempts, next_attempt_at)
                   from outbox_events where published_at is null and cancelled_at is null
                  order by seq limit 5",
            )
            .bind(name)
            .fetch_all(pool)
            .await
            .map_err(db)?;
            f.undrained_rows.extend(rows.into_iter().map(|r| r.0));
            let slots: Vec<(String,)> = sqlx::query_as(
                "select format('%s slot %s active %s restart %s confirmed %s, server at %s',
                               $1::text, slot_name, active, restart_lsn, confirmed_flush_lsn,
                               pg_current_wal_lsn())
                   from pg_replication_slots where database = current_database()",
            )
            .bind(name)
            .fetch_all(pool)
            .await
            .map_err(db)?;
            f.undrained_rows.extend(slots.into_iter().map(|r| r.0));
        }
    }
    f.handled = sqlx::query_scalar("select count(*) from inbox_events where consumer = $1")
        .bind(durable)
        .fetch_one(billing)
        .await
        .map_err(db)?;
    f.dead_letters = sqlx::query_scalar("select count(*) from inbox_dead_letters")
        .fetch_one(billing)
        .await
        .unwrap_or(0);
    if let Ok(mut c) = js
        .get_consumer_from_stream::<consumer::pull::Config, _, _>(durable, stream)
        .await
        && let Ok(info) = c.info().await
    {
        f.deliveries = info.delivered.consumer_sequence;
    }
    Ok(f)
}

/// A trial's scheduled end, as the subscriptions database has it, with its
/// subscription.
#[derive(sqlx::FromRow)]
struct TrialEnd {
    id: String,
    subscription: String,
    due_at: Option<Ts>,
    published_at: Option<Ts>,
    cancelled: bool,
    status: Option<String>,
    converted: bool,
}

/// Where billing and the stream saw one trial end.
#[derive(Default)]
struct Consumed {
    /// `trial_ends.recorded_at` of each row for it.
    recorded: Vec<Ts>,
    /// The inbox's `handled_at`.
    handled: Option<Ts>,
    /// The `scheduledfor` of each stream message with its id.
    sent: Vec<Option<Ts>>,
}

/// The trials: every scheduled end either cancelled (a conversion, or the
/// subscription cancelled in its trial) and then never published, never in
/// the stream, never handled; or due, published and handled exactly once,
/// none of it before its due time. The conversions' answers agree.
async fn check_trials(
    subs: &PgPool,
    billing: &PgPool,
    durable: &str,
    messages: &[Stored],
    outcomes: &Outcomes,
    f: &mut Findings,
) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("database: {e}");
    let ends: Vec<TrialEnd> = sqlx::query_as(
        "select e.id::text as id, e.data->>'subscription_id' as subscription, e.due_at,
                e.published_at, e.cancelled_at is not null as cancelled, s.status,
                coalesce(s.converted_at is not null, false) as converted
           from outbox_events e left join subscriptions s on s.trial_event_id = e.id
          where e.event_type = 'subscription.trial_ended'",
    )
    .fetch_all(subs)
    .await
    .map_err(db)?;
    let recorded: Vec<(String, Ts)> =
        sqlx::query_as("select event_id::text, recorded_at from trial_ends")
            .fetch_all(billing)
            .await
            .map_err(db)?;
    let handled: Vec<(String, Ts)> = sqlx::query_as(
        "select event_id::text, handled_at from inbox_events
          where consumer = $1 and event_type = 'subscription.trial_ended'",
    )
    .bind(durable)
    .fetch_all(billing)
    .await
    .map_err(db)?;

    let mut consumed: HashMap<&str, Consumed> = HashMap::new();
    for (id, at) in &recorded {
        consumed.entry(id).or_default().recorded.push(*at);
    }
    for (id, at) in &handled {
        consumed.entry(id).or_default().handled = Some(*at);
    }
    for m in messages
        .iter()
        .filter(|m| m.event_type == "subscription.trial_ended")
    {
        consumed
            .entry(&m.id)
            .or_default()
            .sent
            .push(m.scheduled_for);
    }
    f.trials.scheduled = ends.len();
    f.trials.recorded = recorded.len();
    let none = Consumed::default();
    for end in &ends {
        judge_trial_end(end, consumed.get(end.id.as_str()).unwrap_or(&none), f);
    }
    let known: HashMap<&str, &TrialEnd> = ends.iter().map(|e| (e.id.as_str(), e)).collect();
    for id in consumed.keys().filter(|id| !known.contains_key(**id)) {
        f.leaked
            .push(format!("trial end {id} was consumed but never written"));
    }
    check_trial_answers(&ends, outcomes, f);
    Ok(())
}

/// One scheduled trial end against what consumed it.
fn judge_trial_end(end: &TrialEnd, seen: &Consumed, f: &mut Findings) {
    let (id, sub) = (&end.id, &end.subscription);
    let Some(due) = end.due_at else {
        f.early
            .push(format!("trial end {id} of {sub} was written unscheduled"));
        return;
    };
    if end.cancelled {
        if end.converted {
            f.trials.converted += 1;
        } else if end.status.as_deref() == Some("cancelled") {
            f.trials.cancelled_with_subscription += 1;
        } else {
            f.lost.push(format!(
                "trial end {id} of {sub} was cancelled, yet the trial was neither converted nor its subscription cancelled"
            ));
        }
        if end.published_at.is_some() || !seen.sent.is_empty() {
            f.cancelled_consumed
                .push(format!("cancelled trial end {id} of {sub} was published"));
        }
        if !seen.recorded.is_empty() || seen.handled.is_some() {
            f.cancelled_consumed.push(format!(
                "cancelled trial end {id} of {sub} was handled by billing"
            ));
        }
        return;
    }
    f.trials.ran_out += 1;
    if end.converted {
        f.cancelled_consumed.push(format!(
            "subscription {sub} was converted, yet its trial end {id} was not cancelled"
        ));
    }
    match end.published_at {
        None => f
            .lost
            .push(format!("trial end {id} of {sub} was never published")),
        Some(at) if at < due => f.early.push(format!(
            "trial end {id} of {sub} published {} before its due time",
            at - due
        )),
        Some(_) => {}
    }
    if seen.sent.is_empty() {
        f.lost
            .push(format!("trial end {id} of {sub} never reached the stream"));
    }
    if seen.sent.iter().any(|s| *s != Some(due)) {
        f.early.push(format!(
            "trial end {id} of {sub} reached the stream without its due time as scheduledfor"
        ));
    }
    match seen.recorded.len() {
        0 => f.lost.push(format!(
            "trial end {id} of {sub} was never recorded by billing"
        )),
        1 => {}
        n => f
            .applied_twice
            .push(format!("trial end {id} of {sub} was recorded {n} times")),
    }
    for at in seen.recorded.iter().chain(seen.handled.iter()) {
        if *at < due {
            f.early.push(format!(
                "trial end {id} of {sub} handled {} before its due time",
                due - *at
            ));
        }
        f.trials.max_lateness = f.trials.max_lateness.max(*at - due);
    }
}

/// The service's answers agree with the rows: a trial accepted has its
/// scheduled end, a conversion answered 200 cancelled it, one answered "too
/// late" did not.
fn check_trial_answers(ends: &[TrialEnd], outcomes: &Outcomes, f: &mut Findings) {
    let by_sub: HashMap<&str, &TrialEnd> =
        ends.iter().map(|e| (e.subscription.as_str(), e)).collect();
    for id in &outcomes.trials {
        if !by_sub.contains_key(id.as_str()) {
            f.lost
                .push(format!("accepted trial {id} has no scheduled trial end"));
        }
    }
    for id in &outcomes.converted {
        if by_sub
            .get(id.as_str())
            .is_none_or(|e| !e.cancelled || !e.converted)
        {
            f.cancelled_consumed.push(format!(
                "the conversion of {id} was answered 200, yet its trial end is not cancelled"
            ));
        }
    }
    for id in &outcomes.too_late {
        if by_sub.get(id.as_str()).is_none_or(|e| e.cancelled) {
            f.lost.push(format!(
                "the conversion of {id} was answered too late, yet its trial end did not run out"
            ));
        }
    }
}
