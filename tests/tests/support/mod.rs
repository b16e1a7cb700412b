//! Runs the workspace's binaries as a user would.

#[allow(dead_code)] // each test binary uses what it needs
pub(crate) mod http;
#[allow(dead_code)] // the tests that run a WAL relay use it
pub(crate) mod wal;

use std::path::PathBuf;
use std::process::Command;

/// What a finished process printed.
pub(crate) struct Output {
    pub(crate) status: std::process::ExitStatus,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// The directory holding the workspace's binaries (`target/debug`), next to
/// this test executable's `deps/`.
pub(crate) fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    for bin in ["outbox-demo", "subscriptions", "billing", "outbox-relay"] {
        assert!(
            dir.join(bin).is_file(),
            "{} is missing: build the binaries first with `cargo build --workspace --bins` (scripts/test does)",
            dir.join(bin).display()
        );
    }
    dir
}

/// Runs `outbox-demo` with `args` to completion.
pub(crate) fn demo(args: &[&str]) -> Output {
    let dir = bin_dir();
    let out = Command::new(dir.join("outbox-demo"))
        .args(args)
        .arg("--bin-dir")
        .arg(&dir)
        .env_remove("DATABASE_URL")
        .env_remove("NATS_URL")
        .output()
        .unwrap();
    Output {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
