//! Rebuild when a migration changes, so the embedded `MIGRATOR` stays current.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
