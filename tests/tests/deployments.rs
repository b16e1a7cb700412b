//! The deployments production runs, beyond one outbox on one direct
//! connection: several outboxes in one database (`tenants`), connection
//! poolers (`poolers`), drains beside other relays (`once`), settings that
//! break the relay (`settings`).

mod support;

#[path = "deployments/once.rs"]
mod once;
#[path = "deployments/poolers.rs"]
mod poolers;
#[path = "deployments/settings.rs"]
mod settings;
#[path = "deployments/tenants.rs"]
mod tenants;

use sqlx::PgPool;

/// Writes `rows` events of `event_type` over `subjects` subjects in one
/// transaction of plain SQL, as a service in another language would.
async fn write(pool: &PgPool, event_type: &str, subjects: i32, rows: i32) {
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         select gen_random_uuid(), $1, 'tests', 'sub_' || (g % $2), now(), jsonb_build_object('g', g)
           from generate_series(0, $3 - 1) g",
    )
    .bind(event_type)
    .bind(subjects)
    .bind(rows)
    .execute(pool)
    .await
    .unwrap();
}

/// Rows not published yet.
async fn unpublished(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from outbox_events where published_at is null")
        .fetch_one(pool)
        .await
        .unwrap()
}
