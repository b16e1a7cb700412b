//! The chaos checker can catch what it claims to catch: with the dedupe layer
//! removed from billing (a test switch), redeliveries after deaths between
//! commit and ack produce double invoices, and the run must fail with
//! applied-twice > 0.

#[test]
fn without_dedupe_the_checker_reports_double_invoices() {
    let out = super::support::demo(&[
        "--duration",
        "20",
        "--seed",
        "7",
        "--no-dedupe",
        "--crash-rate",
        "0.05",
        "--settle-timeout",
        "60",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("RESULT: FAIL (dedupe layer removed)"),
        "{}",
        out.stdout
    );
    let applied_twice: u64 = out
        .stdout
        .lines()
        .find(|l| l.starts_with("applied twice"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|n| n.parse().ok())
        .expect("an applied-twice line");
    assert!(applied_twice > 0, "{}", out.stdout);
    // A failed run keeps its logs for inspection; this failure was the point.
    if let Some(dir) = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("logs kept in "))
    {
        let _ = std::fs::remove_dir_all(dir.trim());
    }
}
