//! Replication slots a WAL relay leaves behind.

use std::time::Duration;

use outbox_testkit::wait_until;
use sqlx::PgPool;

/// Drops the database's replication slots once their readers have let go, so
/// that a finished test pins no WAL on a server other tests share.
pub(crate) async fn drop_slots(pool: &PgPool) {
    let count = |active: &'static str| async move {
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            "select count(*) from pg_replication_slots where database = current_database() {active}"
        )))
        .fetch_one(pool)
        .await
        .unwrap()
    };
    wait_until("the slots let go", Duration::from_secs(30), || async {
        count("and active").await == 0
    })
    .await
    .unwrap();
    sqlx::query(
        "select pg_drop_replication_slot(slot_name) from pg_replication_slots
          where database = current_database()",
    )
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(count("").await, 0);
}
