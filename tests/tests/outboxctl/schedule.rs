//! `outboxctl`'s commands for scheduled events (`schedule list | show |
//! cancel`) and what `status`, `stuck` and `retry` make of scheduled rows,
//! run as an operator runs them: the shipped binary as a child process
//! against a real PostgreSQL (rows scheduled through `outbox_pg::Outbox`,
//! as an application schedules them), with the real `outbox-relay` where the
//! promise involves it; every `--json` output parsed and asserted on.
//!
//! - `schedule list` (filters, limit, total), `show` (each state in words, an
//!   unknown id exit 1) and `cancel` (cancelled by this run or earlier, too
//!   late, not scheduled, unknown: the answers printed, exit 1 when any id was
//!   not cancelled, `--by` and its default recorded); `retry` and `skip`
//!   refuse a cancelled row; `prune` deletes a row cancelled longer ago than
//!   the window, as the relay's retention does.
//! - 1,000 scheduled rows not due are no backlog: `status` counts them apart
//!   with the next due time; a row fallen due is backlog; rows that fell due
//!   and failed are in backoff or parked, listed by `stuck`, retried by
//!   `retry --all-stuck`; no retry makes a row due before its time.
//! - With a relay running: a retried future row stays unpublished while a row
//!   due a moment later is published; a cancel after the publish is too late.

use std::time::Duration;

use outbox_pg::{Due, Envelope, Outbox};
use outbox_testkit::{TestDb, nats, wait_until};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use super::outbox::{MAX_ATTEMPTS, Relay, ctl, ctl_with, i, ids, read_stream, status};
use super::support::count;

fn envelope(event_type: &str, subject: &str) -> Envelope<Value> {
    Envelope::new(event_type, "ctl-test", subject, json!({"n": 0})).unwrap()
}

/// Schedules one event through the library, as an application does.
async fn schedule(pool: &PgPool, event_type: &str, subject: &str, due: Due) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let id = Outbox::unvalidated()
        .schedule(&mut tx, &envelope(event_type, subject), due)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    *id.as_uuid()
}

/// Writes an immediate event through the library.
async fn enqueue(pool: &PgPool, event_type: &str, subject: &str) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let id = Outbox::unvalidated()
        .enqueue(&mut tx, &envelope(event_type, subject))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    *id.as_uuid()
}

/// Sets `set` on row `id` by SQL (as a relay or an operator would have).
async fn set(pool: &PgPool, id: Uuid, set: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "update outbox_events set {set} where id = $1"
    )))
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

/// The ids of a `schedule list` in the order listed.
fn listed(list: &Value) -> Vec<Uuid> {
    ids(&Value::Array(
        list["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].clone())
            .collect(),
    ))
}

/// `outboxctl --json schedule list <args>`.
async fn list(db: &TestDb, args: &[&str]) -> Value {
    let mut all = vec!["--json", "schedule", "list"];
    all.extend_from_slice(args);
    ctl(db.url(), &all).await.ok()
}

/// `outboxctl --json schedule show <id>`.
async fn show(db: &TestDb, id: Uuid) -> Value {
    ctl(db.url(), &["--json", "schedule", "show", &id.to_string()])
        .await
        .ok()
}

/// Waits until the database's clock has passed row `id`'s due time.
async fn wait_due(pool: &PgPool, id: Uuid) {
    wait_until(
        "the row's due time passed",
        Duration::from_secs(10),
        || async {
            count(
                pool,
                &format!(
                    "select count(*) from outbox_events where id = '{id}' and due_at <= now()"
                ),
            )
            .await
                == 1
        },
    )
    .await
    .unwrap();
}

fn secs(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

// ---------------------------------------------------------------------------
// 1. list, show, cancel.

#[tokio::test(flavor = "multi_thread")]
async fn scheduled_rows_are_listed_shown_and_cancelled() {
    let db = TestDb::new().await.unwrap();
    let pool = &db.pool;
    let hour = Due::In(Duration::from_secs(3600));
    let r1 = schedule(pool, "a.remind", "s-1", hour).await;
    let r2 = schedule(pool, "b.expire", "s-2", Due::In(Duration::from_secs(7200))).await;
    let r3 = schedule(pool, "a.remind", "s-3", Due::In(Duration::from_secs(600))).await;
    let earlier = schedule(pool, "a.remind", "s-4", hour).await;
    let published = schedule(pool, "a.remind", "s-5", hour).await;
    let immediate = enqueue(pool, "a.remind", "s-6").await;
    let mut tx = pool.begin().await.unwrap();
    Outbox::unvalidated()
        .cancel_as(
            &mut tx,
            outbox_pg::EventId::from_uuid(earlier),
            Some("billing"),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    set(
        pool,
        published,
        "published_at = now(), next_attempt_at = null",
    )
    .await;

    // list: next due first, each waiting, with how long until it is due.
    let all = list(&db, &[]).await;
    assert_eq!(i(&all["total"]), 3, "{all:#}");
    assert_eq!(listed(&all), vec![r3, r1, r2], "{all:#}");
    for (row, due_in) in all["rows"]
        .as_array()
        .unwrap()
        .iter()
        .zip([600.0, 3600.0, 7200.0])
    {
        assert_eq!(row["state"], "waiting", "{row:#}");
        assert_eq!(i(&row["attempts"]), 0);
        let left = secs(&row["due_in_secs"]);
        assert!(left <= due_in && left > due_in - 60.0, "{row:#}");
        assert_eq!(row["due_at"], row["next_attempt_at"], "{row:#}");
    }
    assert_eq!(
        listed(&list(&db, &["--type", "a.remind"]).await),
        vec![r3, r1]
    );
    assert_eq!(listed(&list(&db, &["--subject", "s-2"]).await), vec![r2]);
    let soon = list(&db, &["--due-before", "30m"]).await;
    assert_eq!(
        (i(&soon["total"]), listed(&soon)),
        (1, vec![r3]),
        "{soon:#}"
    );
    let at = (chrono::Utc::now() + chrono::Duration::minutes(90)).to_rfc3339();
    assert_eq!(
        listed(&list(&db, &["--due-before", &at]).await),
        vec![r3, r1]
    );
    let one = list(&db, &["--limit", "1"]).await;
    assert_eq!((i(&one["total"]), listed(&one)), (3, vec![r3]), "{one:#}");
    let text = ctl(db.url(), &["schedule", "list", "--limit", "1"]).await;
    assert!(text.status.success(), "{}", text.stderr);
    for needle in [
        &r3.to_string()[..],
        "a.remind",
        "in 9m",
        "waiting",
        "1 of 3 scheduled rows shown",
    ] {
        assert!(
            text.stdout.contains(needle),
            "{needle:?} in:\n{}",
            text.stdout
        );
    }
    let bad = ctl(db.url(), &["schedule", "list", "--due-before", "soon"]).await;
    assert_eq!(bad.status.code(), Some(2), "{}", bad.stderr);

    // show: each state in words; an unknown id is exit 1.
    let s = show(&db, r1).await;
    assert_eq!(
        (s["state"].as_str(), s["subject"].as_str()),
        (Some("waiting"), Some("s-1"))
    );
    assert!(
        s["description"]
            .as_str()
            .unwrap()
            .starts_with("waiting: due in 59m"),
        "{s:#}"
    );
    assert!(
        s["due_at"].is_string() && s["released_at"].is_null(),
        "{s:#}"
    );
    let s = show(&db, earlier).await;
    assert_eq!(s["state"], "cancelled", "{s:#}");
    assert_eq!(s["cancelled_by"], "billing", "{s:#}");
    assert_eq!(show(&db, published).await["state"], "published");
    assert_eq!(show(&db, immediate).await["state"], "not_scheduled");
    let text = ctl(db.url(), &["schedule", "show", &r2.to_string()]).await;
    assert!(
        text.stdout.contains("waiting: due in 1h 59m"),
        "{}",
        text.stdout
    );
    let unknown = Uuid::now_v7();
    let (kind, message) = ctl(
        db.url(),
        &["--json", "schedule", "show", &unknown.to_string()],
    )
    .await
    .error();
    assert_eq!(kind, "not_found");
    assert!(message.contains(&unknown.to_string()), "{message}");

    // cancel: by name, then again with an earlier cancel kept as it was.
    let c = ctl(
        db.url(),
        &[
            "--json",
            "schedule",
            "cancel",
            &r1.to_string(),
            "--by",
            "alice",
        ],
    )
    .await
    .ok();
    assert_eq!(
        (i(&c["cancelled"]), i(&c["not_cancelled"])),
        (1, 0),
        "{c:#}"
    );
    let a = &c["results"][0];
    assert_eq!(
        (a["answer"].as_str(), a["earlier"].as_bool()),
        (Some("cancelled"), Some(false))
    );
    assert_eq!(a["cancelled_by"], "alice");
    assert_eq!(
        count(pool, &format!("select count(*) from outbox_events where id = '{r1}' and cancelled_by = 'alice' and cancelled_at is not null")).await,
        1
    );
    let again = ctl_with(
        db.url(),
        &[
            "--json",
            "schedule",
            "cancel",
            &r1.to_string(),
            &earlier.to_string(),
        ],
        &[("USER", "carol")],
    )
    .await
    .ok();
    let answers: Vec<(&str, bool, &str)> = again["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["answer"].as_str().unwrap(),
                a["earlier"].as_bool().unwrap(),
                a["cancelled_by"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        answers,
        vec![("cancelled", true, "alice"), ("cancelled", true, "billing")],
        "{again:#}"
    );

    // A mixed run: the answers printed, exit status 1, one line on stderr.
    let mixed = ctl_with(
        db.url(),
        &[
            "--json",
            "schedule",
            "cancel",
            &r2.to_string(),
            &immediate.to_string(),
            &published.to_string(),
            &unknown.to_string(),
        ],
        &[("USER", "carol")],
    )
    .await;
    assert_eq!(mixed.status.code(), Some(1), "{}", mixed.stderr);
    assert_eq!(mixed.stderr.trim(), "outboxctl: 3 of 4 ids not cancelled");
    let m = mixed.json();
    let answers: Vec<&str> = m["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["answer"].as_str().unwrap())
        .collect();
    assert_eq!(
        answers,
        [
            "cancelled",
            "already_published",
            "already_published",
            "unknown"
        ],
        "{m:#}"
    );
    let by = m["results"][0]["cancelled_by"].as_str().unwrap();
    assert!(by.starts_with("outboxctl:carol@") && by.len() > 16, "{by}");
    assert!(
        m["results"][1]["detail"]
            .as_str()
            .unwrap()
            .contains("not scheduled"),
        "{m:#}"
    );
    assert!(
        m["results"][2]["detail"]
            .as_str()
            .unwrap()
            .contains("already published at"),
        "{m:#}"
    );
    let text = ctl(db.url(), &["schedule", "cancel", &unknown.to_string()]).await;
    assert_eq!(text.status.code(), Some(1));
    assert!(
        text.stdout.contains("unknown: no outbox row"),
        "{}",
        text.stdout
    );
    assert!(text.stdout.contains("0 of 1 cancelled"), "{}", text.stdout);

    // status: the cancelled rows are no backlog; one scheduled row left.
    let s = status(&db).await;
    let t = &s["totals"];
    assert_eq!(i(&t["unpublished"]), 1, "the immediate row: {s:#}");
    assert_eq!(i(&t["fresh"]), 1, "{s:#}");
    assert_eq!(i(&t["scheduled"]), 1, "{s:#}");
    assert_eq!(i(&t["cancelled"]), 3, "{s:#}");
    let next = secs(&t["next_due_in_secs"]);
    assert!(next > 500.0 && next <= 600.0, "{s:#}");
    assert_eq!(listed(&list(&db, &[]).await), vec![r3]);

    // skip and retry refuse a cancelled row; skip points a waiting one to cancel.
    let (kind, message) = ctl(db.url(), &["--json", "retry", &r1.to_string()])
        .await
        .error();
    assert_eq!(kind, "invalid_state");
    assert!(
        message.contains("cancelled") && message.contains("alice"),
        "{message}"
    );
    let (kind, message) = ctl(
        db.url(),
        &["--json", "skip", &r1.to_string(), "--reason", "x"],
    )
    .await
    .error();
    assert_eq!(kind, "invalid_state");
    assert!(message.contains("cancelled"), "{message}");
    let (kind, message) = ctl(
        db.url(),
        &["--json", "skip", &r3.to_string(), "--reason", "x"],
    )
    .await
    .error();
    assert_eq!(kind, "invalid_state");
    assert!(message.contains("outboxctl schedule cancel"), "{message}");
    assert_eq!(
        count(
            pool,
            "select count(*) from outbox_events where skipped_at is not null"
        )
        .await,
        0
    );
    // prune: a row cancelled longer ago than the window goes, as the relay's
    // retention takes it; the others are kept.
    set(pool, r1, "cancelled_at = now() - interval '30 days'").await;
    let dry = ctl(db.url(), &["--json", "prune", "--dry-run"]).await.ok();
    let tally = |v: &Value| {
        [
            i(&v["deleted"]),
            i(&v["deleted_published"]),
            i(&v["deleted_cancelled"]),
        ]
    };
    assert_eq!(tally(&dry), [1, 0, 1], "{dry:#}");
    let pruned = ctl(db.url(), &["prune"]).await;
    assert!(
        pruned
            .stdout
            .contains("deleted 0 published rows and 1 cancelled scheduled row older than 7days"),
        "{}",
        pruned.stdout
    );
    let (kind, _) = ctl(db.url(), &["--json", "schedule", "show", &r1.to_string()])
        .await
        .error();
    assert_eq!(kind, "not_found");
    assert_eq!(
        count(
            pool,
            "select count(*) from outbox_events where cancelled_at is not null"
        )
        .await,
        2
    );
}

// ---------------------------------------------------------------------------
// 2. Scheduled rows in status, stuck and retry.

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_future_rows_are_no_backlog_and_failed_due_rows_are_stuck() {
    let db = TestDb::new().await.unwrap();
    let pool = &db.pool;
    let events: Vec<Envelope<Value>> = (0..1000)
        .map(|n| envelope("c.later", &format!("acct-{n}")))
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let future: Vec<Uuid> = Outbox::unvalidated()
        .schedule_all(&mut tx, &events, Due::In(Duration::from_secs(3600)))
        .await
        .unwrap()
        .iter()
        .map(|id| *id.as_uuid())
        .collect();
    tx.commit().await.unwrap();

    let s = status(&db).await;
    let t = &s["totals"];
    assert_eq!(i(&t["unpublished"]), 0, "{s:#}");
    assert_eq!(i(&t["scheduled"]), 1000, "{s:#}");
    assert_eq!(t["oldest_unpublished_age_secs"], Value::Null, "{s:#}");
    let next = secs(&t["next_due_in_secs"]);
    assert!(next > 3500.0 && next <= 3600.0, "{s:#}");
    assert!(t["next_due_at"].is_string(), "{s:#}");
    assert_eq!(i(&s["event_types"][0]["scheduled"]), 1000, "{s:#}");
    assert_eq!(i(&s["blocked_subjects"]["total"]), 0, "{s:#}");
    let text = ctl(db.url(), &["status"]).await;
    assert!(
        text.stdout.contains("backlog: 0 unpublished"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .contains("scheduled: 1000 not yet due (next due in 59m"),
        "{}",
        text.stdout
    );
    let stuck = ctl(db.url(), &["--json", "stuck"]).await.ok();
    assert_eq!(i(&stuck["total"]), 0, "{stuck:#}");
    let all = list(&db, &[]).await;
    assert_eq!(
        (i(&all["total"]), all["rows"].as_array().unwrap().len()),
        (1000, 100)
    );
    assert_eq!(i(&list(&db, &["--due-before", "10m"]).await["total"]), 0);

    // Fallen due: one waiting for a relay (due), one failed (in backoff),
    // one past the cap (parked) whose subject also has an immediate row.
    let soon = Due::In(Duration::from_millis(300));
    let due = schedule(pool, "c.soon", "acct-due", soon).await;
    let failing = schedule(pool, "c.soon", "acct-failing", soon).await;
    let parked = schedule(pool, "c.soon", "acct-parked", soon).await;
    wait_due(pool, parked).await;
    wait_due(pool, due).await;
    set(pool, failing, "released_at = now(), attempts = 1, last_error = 'refused', next_attempt_at = now() + interval '1 hour'").await;
    set(
        pool,
        parked,
        "released_at = now(), attempts = 3, last_error = 'too big', next_attempt_at = 'infinity'",
    )
    .await;
    let behind = enqueue(pool, "c.now", "acct-parked").await;

    let s = status(&db).await;
    let counts = |v: &Value| {
        [
            "unpublished",
            "fresh",
            "due",
            "in_backoff",
            "deferred",
            "parked",
            "scheduled",
            "cancelled",
        ]
        .map(|k| i(&v[k]))
    };
    assert_eq!(counts(&s["totals"]), [4, 1, 1, 1, 0, 1, 1000, 0], "{s:#}");
    let oldest = secs(&s["totals"]["oldest_unpublished_age_secs"]);
    assert!(oldest < 60.0, "from the due time, not the insert: {s:#}");
    assert_eq!(
        i(&s["blocked_subjects"]["total"]),
        0,
        "a scheduled row blocks nothing: {s:#}"
    );
    assert_eq!(
        count(pool, &format!("select count(*) from outbox_events where id = '{behind}' and next_attempt_at is null")).await,
        1
    );
    let stuck = ctl(
        db.url(),
        &["--json", "stuck", "--max-attempts", MAX_ATTEMPTS],
    )
    .await
    .ok();
    assert_eq!(i(&stuck["total"]), 2, "{stuck:#}");
    let rows: Vec<(Uuid, String, bool)> = stuck["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().parse().unwrap(),
                r["state"].as_str().unwrap().to_owned(),
                r["due_at"].is_string(),
            )
        })
        .collect();
    assert!(
        rows.contains(&(failing, "backoff".to_owned(), true)),
        "{stuck:#}"
    );
    assert!(
        rows.contains(&(parked, "parked".to_owned(), true)),
        "{stuck:#}"
    );
    let states: Vec<(Uuid, String)> = list(&db, &["--due-before", "1m"]).await["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().parse().unwrap(),
                r["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![(due, "due".to_owned())],
        "the failing row is next due in an hour, the parked never"
    );

    // retry: the failed rows retried, no future row made due or called retried.
    let one = future[7];
    let r = ctl(
        db.url(),
        &["--json", "retry", &one.to_string(), &due.to_string()],
    )
    .await
    .ok();
    assert_eq!(ids(&r["retried"]), vec![due], "{r:#}");
    assert_eq!(r["not_yet_due"][0]["id"], one.to_string(), "{r:#}");
    assert!(r["not_yet_due"][0]["due_at"].is_string(), "{r:#}");
    let r = ctl(db.url(), &["--json", "retry", "--all-stuck"])
        .await
        .ok();
    let mut retried = ids(&r["retried"]);
    retried.sort();
    let mut expected = vec![failing, parked];
    expected.sort();
    assert_eq!(retried, expected, "{r:#}");
    let r = ctl(db.url(), &["--json", "retry", "--entity", "acct-7"])
        .await
        .ok();
    assert_eq!(ids(&r["retried"]), Vec::<Uuid>::new(), "{r:#}");
    assert_eq!(
        count(pool, "select count(*) from outbox_events where due_at > now() and (next_attempt_at < due_at or attempts <> 0)").await,
        0,
        "no future row made due"
    );
    let s = status(&db).await;
    assert_eq!(counts(&s["totals"]), [4, 1, 3, 0, 0, 0, 1000, 0], "{s:#}");
}

// ---------------------------------------------------------------------------
// 3. With a relay: a retried future row stays unpublished.

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_never_publishes_a_future_row_and_a_late_cancel_is_refused() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let pool = &db.pool;
    let mut relay = Relay::start(&db, broker.url(), "CTL_SCHEDULED").await;
    let later = schedule(
        pool,
        "ctl.reminder",
        "acct-1",
        Due::In(Duration::from_secs(3600)),
    )
    .await;
    let r = ctl(db.url(), &["--json", "retry", &later.to_string()])
        .await
        .ok();
    assert_eq!(ids(&r["retried"]), Vec::<Uuid>::new(), "{r:#}");
    let r = ctl(db.url(), &["--json", "retry", "--all-stuck"])
        .await
        .ok();
    assert_eq!(ids(&r["retried"]), Vec::<Uuid>::new(), "{r:#}");
    // A row due a moment after the retries, published by the running relay:
    // its due lane read the table after them.
    let soon = schedule(
        pool,
        "ctl.reminder",
        "acct-1",
        Due::In(Duration::from_secs(1)),
    )
    .await;
    wait_until(
        "the row due soon published",
        Duration::from_secs(30),
        || async { show(&db, soon).await["state"] == "published" },
    )
    .await
    .unwrap_or_else(|e| relay.fail(e));
    let s = show(&db, later).await;
    assert_eq!(s["state"], "waiting", "{s:#}");
    let messages = read_stream(broker.url(), &relay.stream).await;
    assert_eq!(messages.iter().map(|m| m.0).collect::<Vec<_>>(), vec![soon]);

    // Too late for the published row; in time for the waiting one.
    let c = ctl(
        db.url(),
        &[
            "--json",
            "schedule",
            "cancel",
            &soon.to_string(),
            &later.to_string(),
        ],
    )
    .await;
    assert_eq!(c.status.code(), Some(1), "{}", c.stderr);
    let c = c.json();
    assert_eq!(c["results"][0]["answer"], "already_published", "{c:#}");
    assert_eq!(c["results"][1]["answer"], "cancelled", "{c:#}");
    let s = status(&db).await;
    let t = &s["totals"];
    assert_eq!(
        (i(&t["unpublished"]), i(&t["scheduled"]), i(&t["cancelled"])),
        (0, 0, 1),
        "{s:#}"
    );
    assert_eq!(i(&t["published_last_hour"]), 1, "{s:#}");
    relay.stop().await;
    assert_eq!(show(&db, later).await["state"], "cancelled");
}
