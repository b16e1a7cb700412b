//! The HTTP API against a real Postgres, driven in-process through the router:
//! what each request answers, that a refused or rolled-back request writes
//! neither a row nor an event, and that a trial's scheduled end is written
//! with its subscription and cancelled with its conversion.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::{DateTime, Utc};
use example_subscriptions::{AppState, default_schemas_dir, migrate, router};
use outbox_pg::{Outbox, SchemaRegistry};
use outbox_testkit::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;
use tower::ServiceExt;

async fn app(fault_injection: bool) -> (TestDb, axum::Router) {
    app_with(|state| state.fault_injection(fault_injection)).await
}

async fn app_with(configure: impl FnOnce(AppState) -> AppState) -> (TestDb, axum::Router) {
    let db = TestDb::new().await.unwrap();
    migrate(&db.pool).await.unwrap();
    migrate(&db.pool).await.unwrap(); // start-up is idempotent
    let outbox = Outbox::new(SchemaRegistry::from_dir(default_schemas_dir()).unwrap());
    let app = router(configure(AppState::new(db.pool.clone(), outbox)));
    (db, app)
}

async fn send(app: &axum::Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
}

fn post_json(uri: &str, body: &str) -> Request<Body> {
    Request::post(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("select count(*) from {table}")))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn create_writes_the_row_and_its_event_together() {
    let (db, app) = app(false).await;
    let (status, body) = send(
        &app,
        post_json(
            "/v1/subscriptions",
            r#"{"customer_id": "cus_1", "plan": "pro", "amount_cents": 1234}"#,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let id = body["id"].as_str().unwrap();
    assert!(id.starts_with("sub_"), "{id}");
    let event_id: uuid::Uuid = body["event_id"].as_str().unwrap().parse().unwrap();

    let (event_type, source, subject, data): (String, String, String, Value) =
        sqlx::query_as("select event_type, source, subject, data from outbox_events where id = $1")
            .bind(event_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (event_type.as_str(), source.as_str(), subject.as_str()),
        ("subscription.created", "subscriptions", id),
        "the subject is the subscription"
    );
    assert_eq!(
        data,
        json!({"subscription_id": id, "customer_id": "cus_1", "plan": "pro", "amount_cents": 1234})
    );

    let (status, row) = send(
        &app,
        Request::get(format!("/v1/subscriptions/{id}"))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(row["status"], "active");
    assert_eq!(row["amount_cents"], 1234);
    assert_eq!(row["customer_id"], "cus_1");
}

#[tokio::test]
async fn unacceptable_bodies_answer_422_naming_the_field_and_write_nothing() {
    let (db, app) = app(false).await;
    let long_plan = "p".repeat(65);
    let cases: Vec<(String, &str)> = vec![
        ("{not json".into(), "JSON"),
        (
            r#"{"customer_id": "c", "plan": "p"}"#.into(),
            "amount_cents",
        ),
        (
            r#"{"customer_id": "c", "plan": "p", "amount_cents": "12"}"#.into(),
            "amount_cents",
        ),
        (
            r#"{"customer_id": "c", "plan": "p", "amount_cents": 1.5}"#.into(),
            "amount_cents",
        ),
        (
            r#"{"customer_id": "c", "plan": "p", "amount_cents": 1, "coupon": "x"}"#.into(),
            "coupon",
        ),
        (
            r#"{"customer_id": 7, "plan": "p", "amount_cents": 1}"#.into(),
            "customer_id",
        ),
        (
            r#"{"customer_id": "  ", "plan": "p", "amount_cents": 1}"#.into(),
            "customer_id",
        ),
        (
            r#"{"customer_id": "c", "plan": "", "amount_cents": 1}"#.into(),
            "plan",
        ),
        (
            r#"{"customer_id": "c", "plan": "p", "amount_cents": -1}"#.into(),
            "amount_cents",
        ),
        // Refused by outbox-pg's schema check, after the row insert: rolled back.
        (
            format!(r#"{{"customer_id": "c", "plan": "{long_plan}", "amount_cents": 1}}"#),
            "/plan",
        ),
        // Control characters are refused before anything is written.
        (
            r#"{"customer_id": "c\u0007", "plan": "p", "amount_cents": 1}"#.into(),
            "customer_id",
        ),
        ("[]".into(), "NewSubscription"),
        (
            r#"{"customer_id": "c", "plan": "p", "amount_cents": 1, "trial": "yes"}"#.into(),
            "trial",
        ),
    ];
    for (body, needle) in &cases {
        let (status, answer) = send(&app, post_json("/v1/subscriptions", body)).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body} → {answer}"
        );
        let message = answer["error"].as_str().unwrap_or_default();
        assert!(
            message.contains(needle),
            "{body} → {message} (wanted {needle})"
        );
    }
    // No JSON content type: axum's 415 becomes a JSON 422 too.
    let request = Request::post("/v1/subscriptions")
        .body(Body::from(
            r#"{"customer_id": "c", "plan": "p", "amount_cents": 1}"#,
        ))
        .unwrap();
    let (status, answer) = send(&app, request).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(answer["error"].as_str().unwrap().contains("content-type"));

    assert_eq!(count(&db.pool, "subscriptions").await, 0);
    assert_eq!(count(&db.pool, "outbox_events").await, 0);
}

#[tokio::test]
async fn cancel_once_then_409_and_404_for_unknown_ids() {
    let (db, app) = app(false).await;
    let (_, created) = send(
        &app,
        post_json(
            "/v1/subscriptions",
            r#"{"customer_id": "cus_2", "plan": "team", "amount_cents": 0}"#,
        ),
    )
    .await;
    let id = created["id"].as_str().unwrap();
    let cancel = |id: &str| {
        Request::post(format!("/v1/subscriptions/{id}/cancel"))
            .body(Body::empty())
            .unwrap()
    };

    let (status, body) = send(&app, cancel(id)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["id"], id);
    let event_id: uuid::Uuid = body["event_id"].as_str().unwrap().parse().unwrap();
    let (event_type, subject, data): (String, String, Value) =
        sqlx::query_as("select event_type, subject, data from outbox_events where id = $1")
            .bind(event_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (event_type.as_str(), subject.as_str()),
        ("subscription.cancelled", id)
    );
    assert_eq!(data, json!({"subscription_id": id, "customer_id": "cus_2"}));

    let (status, body) = send(&app, cancel(id)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("already cancelled")
    );
    let (status, body) = send(&app, cancel("sub_missing")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, _) = send(
        &app,
        Request::get("/v1/subscriptions/sub_missing")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        count(&db.pool, "outbox_events").await,
        2,
        "created + one cancelled"
    );

    let (status, body) = send(&app, Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!((status, body), (StatusCode::OK, json!({"status": "ok"})));
}

#[tokio::test]
async fn an_injected_rollback_leaves_nothing_and_only_with_the_switch() {
    let body = r#"{"customer_id": "cus_3", "plan": "pro", "amount_cents": 10}"#;
    let faulty = |uri: &str, body: &str| {
        Request::post(uri.to_owned())
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-fault", "rollback")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };

    let (db, app) = app(true).await;
    let (status, answer) = send(&app, faulty("/v1/subscriptions", body)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer["error"], "injected rollback");
    assert!(answer["id"].as_str().unwrap().starts_with("sub_"));
    assert_eq!(count(&db.pool, "subscriptions").await, 0);
    assert_eq!(count(&db.pool, "outbox_events").await, 0);

    // A cancel rolled back leaves the subscription active and no event.
    let (_, created) = send(&app, post_json("/v1/subscriptions", body)).await;
    let id = created["id"].as_str().unwrap();
    let (status, _) = send(&app, faulty(&format!("/v1/subscriptions/{id}/cancel"), "")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let status: String = sqlx::query_scalar("select status from subscriptions where id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "active");
    assert_eq!(count(&db.pool, "outbox_events").await, 1);

    // Without --fault-injection the header means nothing.
    let (db, app) = self::app(false).await;
    let (status, _) = send(&app, faulty("/v1/subscriptions", body)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(count(&db.pool, "outbox_events").await, 1);
}

const HOUR: Duration = Duration::from_secs(3600);

fn post_empty(uri: &str) -> Request<Body> {
    Request::post(uri.to_owned()).body(Body::empty()).unwrap()
}

/// Creates a subscription with a trial; returns its id and the trial event's id.
async fn create_trial(app: &axum::Router, customer: &str) -> (String, uuid::Uuid) {
    let body = format!(
        r#"{{"customer_id": "{customer}", "plan": "pro", "amount_cents": 500, "trial": true}}"#
    );
    let (status, body) = send(app, post_json("/v1/subscriptions", &body)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    (
        body["id"].as_str().unwrap().to_owned(),
        body["trial_event_id"].as_str().unwrap().parse().unwrap(),
    )
}

/// `(due_at, published_at is null, cancelled_at is null)` of an outbox row.
async fn schedule_of(pool: &PgPool, id: uuid::Uuid) -> (Option<DateTime<Utc>>, bool, bool) {
    sqlx::query_as(
        "select due_at, published_at is null, cancelled_at is null from outbox_events where id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_trial_schedules_its_end_with_the_row_and_a_conversion_cancels_it() {
    let (db, app) = app_with(|state| state.trial_period(HOUR)).await;
    let body = r#"{"customer_id": "cus_t", "plan": "pro", "amount_cents": 500, "trial": true}"#;
    let (status, created) = send(&app, post_json("/v1/subscriptions", body)).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["id"].as_str().unwrap();
    let trial_event: uuid::Uuid = created["trial_event_id"].as_str().unwrap().parse().unwrap();
    let ends: DateTime<Utc> = created["trial_ends_at"].as_str().unwrap().parse().unwrap();

    // The trial's end: scheduled at the row's trial_ends_at, an hour after
    // the creation (by the database's clock), its id stored with the row.
    let (event_type, subject, data, due_at, created_at): (
        String,
        String,
        Value,
        Option<DateTime<Utc>>,
        DateTime<Utc>,
    ) = sqlx::query_as(
        "select event_type, subject, data, due_at, created_at from outbox_events where id = $1",
    )
    .bind(trial_event)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (event_type.as_str(), subject.as_str()),
        ("subscription.trial_ended", id)
    );
    assert_eq!(due_at, Some(ends));
    let length = (ends - created_at).num_seconds();
    assert!((3599..=3601).contains(&length), "trial of {length} s");
    assert_eq!(data["subscription_id"], id);
    assert_eq!(data["customer_id"], "cus_t");
    assert_eq!(
        data["trial_ended_at"]
            .as_str()
            .unwrap()
            .parse::<DateTime<Utc>>()
            .unwrap(),
        ends
    );
    let (_, row) = send(
        &app,
        Request::get(format!("/v1/subscriptions/{id}"))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(row["trial_event_id"], created["trial_event_id"]);
    assert_eq!(row["converted_at"], Value::Null);
    assert_eq!(count(&db.pool, "outbox_events").await, 2);

    // Converted: the scheduled end is cancelled in the same transaction.
    let (status, converted) =
        send(&app, post_empty(&format!("/v1/subscriptions/{id}/convert"))).await;
    assert_eq!(status, StatusCode::OK, "{converted}");
    assert_eq!(converted["cancelled_event_id"], created["trial_event_id"]);
    assert_eq!(
        schedule_of(&db.pool, trial_event).await,
        (Some(ends), true, false),
        "cancelled, never published"
    );
    let (_, row) = send(
        &app,
        Request::get(format!("/v1/subscriptions/{id}"))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert!(row["converted_at"].is_string(), "{row}");

    let (status, body) = send(&app, post_empty(&format!("/v1/subscriptions/{id}/convert"))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("already converted")
    );

    // No trial, nothing scheduled and nothing to convert.
    let (_, plain) = send(
        &app,
        post_json(
            "/v1/subscriptions",
            r#"{"customer_id": "cus_p", "plan": "pro", "amount_cents": 500}"#,
        ),
    )
    .await;
    assert!(plain.get("trial_event_id").is_none(), "{plain}");
    let plain = plain["id"].as_str().unwrap();
    let (status, body) = send(
        &app,
        post_empty(&format!("/v1/subscriptions/{plain}/convert")),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["error"].as_str().unwrap().contains("has no trial"));
    let (status, _) = send(&app, post_empty("/v1/subscriptions/sub_missing/convert")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(count(&db.pool, "outbox_events").await, 3);
}

#[tokio::test]
async fn a_conversion_after_the_trial_ended_answers_409_and_writes_nothing() {
    let (db, app) = app_with(|state| state.trial_period(HOUR)).await;
    let (id, trial_event) = create_trial(&app, "cus_late").await;
    // What a relay does when the row falls due: it takes it for publishing.
    sqlx::query("update outbox_events set released_at = now() where id = $1")
        .bind(trial_event)
        .execute(&db.pool)
        .await
        .unwrap();

    let (status, body) = send(&app, post_empty(&format!("/v1/subscriptions/{id}/convert"))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("already ended its trial"),
        "{body}"
    );
    let converted: Option<DateTime<Utc>> =
        sqlx::query_scalar("select converted_at from subscriptions where id = $1")
            .bind(&id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(converted, None);
    assert!(schedule_of(&db.pool, trial_event).await.2, "not cancelled");
}

#[tokio::test]
async fn cancelling_in_the_trial_cancels_its_end_and_after_it_leaves_it() {
    let (db, app) = app_with(|state| state.trial_period(HOUR)).await;
    let (id, trial_event) = create_trial(&app, "cus_c").await;
    let (status, body) = send(&app, post_empty(&format!("/v1/subscriptions/{id}/cancel"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(!schedule_of(&db.pool, trial_event).await.2, "cancelled");
    let (status, body) = send(&app, post_empty(&format!("/v1/subscriptions/{id}/convert"))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["error"].as_str().unwrap().contains("is cancelled"));

    // A cancellation after the trial's end was published leaves it published.
    let (id, trial_event) = create_trial(&app, "cus_d").await;
    sqlx::query("update outbox_events set released_at = now(), published_at = now() where id = $1")
        .bind(trial_event)
        .execute(&db.pool)
        .await
        .unwrap();
    let (status, body) = send(&app, post_empty(&format!("/v1/subscriptions/{id}/cancel"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(!schedule_of(&db.pool, trial_event).await.1, "published");
    assert!(schedule_of(&db.pool, trial_event).await.2, "not cancelled");
}

#[tokio::test]
async fn rolled_back_trials_and_conversions_leave_nothing() {
    let (db, app) = app_with(|state| state.trial_period(HOUR).fault_injection(true)).await;
    let faulty = |uri: String, body: &str| {
        Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-fault", "rollback")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let body = r#"{"customer_id": "cus_r", "plan": "pro", "amount_cents": 10, "trial": true}"#;
    let (status, _) = send(&app, faulty("/v1/subscriptions".into(), body)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(count(&db.pool, "subscriptions").await, 0);
    assert_eq!(
        count(&db.pool, "outbox_events").await,
        0,
        "no scheduled row either"
    );

    // A conversion rolled back leaves the trial's end scheduled.
    let (id, trial_event) = create_trial(&app, "cus_r").await;
    let (status, _) = send(&app, faulty(format!("/v1/subscriptions/{id}/convert"), "")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(schedule_of(&db.pool, trial_event).await.2, "not cancelled");
    let (status, body) = send(&app, post_empty(&format!("/v1/subscriptions/{id}/convert"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}
