//! The HTTP API against a real Postgres, driven in-process through the router:
//! what each request answers, and that a refused or rolled-back request
//! writes neither a row nor an event.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use example_subscriptions::{AppState, default_schemas_dir, migrate, router};
use outbox_pg::{Outbox, SchemaRegistry};
use outbox_testkit::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;
use tower::ServiceExt;

async fn app(fault_injection: bool) -> (TestDb, axum::Router) {
    let db = TestDb::new().await.unwrap();
    migrate(&db.pool).await.unwrap();
    migrate(&db.pool).await.unwrap(); // start-up is idempotent
    let outbox = Outbox::new(SchemaRegistry::from_dir(default_schemas_dir()).unwrap());
    let app = router(AppState::new(db.pool.clone(), outbox).fault_injection(fault_injection));
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
