//! The quickstart, as a new user runs it: the `quickstart` binary against
//! real servers, a typed event written, relayed, read back and consumed by
//! `Consumer::builder`.

use std::process::Command;

use outbox_testkit::TestDb;

mod support;

#[tokio::test]
async fn the_quickstart_runs_its_round_trip_through_the_builder() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let bin = support::bin_dir().join("quickstart");
    assert!(
        bin.is_file(),
        "{} is missing: cargo build --workspace --bins",
        bin.display()
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin)
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats.url())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "quickstart failed\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("rejected:"), "{stdout}");
    assert!(
        stdout.contains("ok: 3 committed events delivered;"),
        "{stdout}"
    );
    assert!(stdout.contains("consumed:  3 accounts opened"), "{stdout}");
}
