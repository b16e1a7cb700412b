//! The Prometheus alert rules shipped in `ops/prometheus/` are valid
//! (`promtool check rules`) and pass their unit tests (`promtool test rules`
//! on `outbox-alerts.test.yml`: every alert firing and not firing).
//!
//! promtool comes from the Debian package `prometheus`; `scripts/test`
//! installs it (and exports `PROMTOOL_BIN`). Without it this test fails,
//! saying how to install it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn ops_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../ops/prometheus")
        .canonicalize()
        .unwrap()
}

/// `$PROMTOOL_BIN`, else `promtool` on `PATH`; fails the test when neither runs.
fn promtool() -> PathBuf {
    let bin = std::env::var_os("PROMTOOL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("promtool"));
    match Command::new(&bin).arg("--version").output() {
        Ok(out) if out.status.success() => bin,
        Ok(out) => panic!(
            "{} --version failed ({}): {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!(
            "promtool not found ({}: {e}): install it with `scripts/test` (as root, it installs what is missing) or \
             `apt-get install prometheus`, or point PROMTOOL_BIN at a promtool binary",
            bin.display()
        ),
    }
}

fn run(args: &[&str]) -> String {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(ops_dir())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool {} failed:\n{text}",
        args.join(" ")
    );
    text
}

#[test]
fn alert_rules_are_valid() {
    let out = run(&["check", "rules", "outbox-alerts.yml"]);
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn alert_rules_pass_their_unit_tests() {
    let out = run(&["test", "rules", "outbox-alerts.test.yml"]);
    assert!(out.contains("SUCCESS"), "{out}");
}

/// Each alert has `for:`, a severity, a summary, a description and a
/// runbook link to its heading in `docs/alerts.md`, and is covered by the
/// unit tests both firing and not firing.
#[test]
fn every_alert_is_documented_and_tested_both_ways() {
    let rules = std::fs::read_to_string(ops_dir().join("outbox-alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(ops_dir().join("outbox-alerts.test.yml")).unwrap();
    let runbooks =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.md"))
            .unwrap();
    let alerts: Vec<&str> = rules
        .split("- alert: ")
        .skip(1)
        .map(|block| block.lines().next().unwrap().trim())
        .collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    for (name, block) in alerts.iter().zip(rules.split("- alert: ").skip(1)) {
        for key in [
            "for: ",
            "severity: ",
            "summary: ",
            "description: ",
            "runbook: ",
        ] {
            assert!(block.contains(key), "alert {name} has no `{key}`");
        }
        let runbook = block
            .split("runbook: \"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap();
        let anchor = runbook.strip_prefix(RUNBOOK_URL).unwrap_or_else(|| {
            panic!("alert {name}: the runbook {runbook} is not under {RUNBOOK_URL}")
        });
        assert!(
            runbooks
                .lines()
                .any(|l| l.starts_with('#') && github_anchor(l) == anchor),
            "alert {name}: docs/alerts.md has no heading for #{anchor}"
        );
        // Firing: an expected alert of this name; not firing: an empty one.
        let cases: Vec<&str> = tests
            .split("alertname: ")
            .skip(1)
            .filter(|c| c.lines().next().unwrap().trim() == *name)
            .collect();
        assert!(
            cases.iter().any(|c| c.contains("exp_alerts: []")),
            "alert {name} has no test where it does not fire"
        );
        assert!(
            cases.iter().any(|c| c.contains("exp_labels:")),
            "alert {name} has no test where it fires"
        );
    }
}

/// Where every alert's runbook link points: a heading of `docs/alerts.md`.
const RUNBOOK_URL: &str = "https://github.com/outbox-rs/outbox/blob/main/docs/alerts.md#";

/// GitHub's anchor of a Markdown heading: lowercase, spaces to `-`,
/// punctuation but `-` and `_` dropped.
fn github_anchor(heading: &str) -> String {
    heading
        .trim_start_matches('#')
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}
