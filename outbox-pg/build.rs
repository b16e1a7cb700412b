//! Rebuild when a migration changes, so the embedded `MIGRATOR` stays current,
//! and when a query, its offline data or sqlx.toml changes: the query macros
//! read `queries/`, `.sqlx/` and `sqlx.toml` without telling cargo.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-changed=queries");
    println!("cargo:rerun-if-changed=.sqlx");
    println!("cargo:rerun-if-changed=sqlx.toml");
    println!("cargo:rerun-if-env-changed=OUTBOX_SQLX_DATABASE_URL");
}
