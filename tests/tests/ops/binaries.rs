//! The operations endpoint of the shipped binaries, run as processes with
//! their default flags (plus `--metrics-addr`) against a real PostgreSQL and
//! nats-server:
//!
//! - `outbox-relay` publishes events written to its table, one of them
//!   scheduled a second ahead; `billing` consumes them, and also a duplicate
//!   (an event republished under another message id), a message that is not
//!   JSON (dead-lettered) and an event whose payload billing cannot read
//!   (failed, dead-lettered); the relay fails an event of a type its stream
//!   does not capture.
//! - Both `/metrics` are scraped: every metric name the Grafana dashboard
//!   (`ops/grafana/outbox-dashboard.json`) and the alert rules
//!   (`ops/prometheus/outbox-alerts.yml`) use is exported (Prometheus' own `up`
//!   aside), and every exported name follows the Prometheus conventions.
//! - `/healthz` answers 200; `/readyz` 200 when ready, 503 naming the broker
//!   once the nats-server is killed, 200 again after it restarts.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use outbox_pg::{Due, Envelope, Outbox};
use outbox_testkit::{NatsServer, TestDb};
use serde_json::{Value, json};
use sqlx::Connection;
use tokio::process::{Child, Command};

/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(60);

const STREAM: &str = "OUTBOX";

/// A child process with a clean environment, its output in a log file.
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
    metrics: SocketAddr,
}

impl Proc {
    fn spawn(
        bin: &str,
        name: &'static str,
        dir: &Path,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Self {
        let metrics = super::support::http::free_addr();
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(super::support::bin_dir().join(bin))
            .env_clear()
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .args(args)
            .args(["--metrics-addr", &metrics.to_string()])
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self {
            name,
            child,
            log,
            metrics,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{} exited ({status}):\n{}", self.name, self.log());
        }
    }

    /// `GET path` on the metrics address: status and body.
    async fn get(&self, path: &str) -> Option<(u16, String)> {
        super::support::http::get(self.metrics, path, Duration::from_secs(10)).await
    }

    /// Waits (bounded) until `GET path` satisfies `done`, failing early if
    /// the process exits; returns the last answer.
    async fn wait_for(
        &mut self,
        what: &str,
        path: &str,
        done: impl Fn(u16, &str) -> bool,
    ) -> (u16, String) {
        let deadline = Instant::now() + WAIT;
        loop {
            let answer = self.get(path).await;
            if let Some((status, body)) = &answer
                && done(*status, body)
            {
                return answer.unwrap();
            }
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "{}: no {what} on {path} within {WAIT:?}; last answer {answer:?}\n{}",
                self.name,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Exported metric names (without `_bucket`/`_sum`/`_count` of histograms)
/// and their `# TYPE`.
fn exported(text: &str) -> BTreeMap<String, String> {
    let mut types = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            types.insert(name.to_owned(), kind.to_owned());
        }
    }
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap();
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| types.contains_key(*b)))
            .unwrap_or(name);
        assert!(
            types.contains_key(base),
            "sample `{line}` has no # TYPE line"
        );
    }
    types
}

/// Metric names a PromQL expression reads: identifiers that are not
/// functions, keywords, label names (inside `{}` or `by (…)`), durations or
/// strings.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "offset",
        "bool",
    ];
    // Drop strings, label matchers, ranges and grouping clauses.
    let mut cleaned = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                for d in chars.by_ref() {
                    if d == '"' {
                        break;
                    }
                }
            }
            '{' => for _ in chars.by_ref().take_while(|d| *d != '}') {},
            '[' => for _ in chars.by_ref().take_while(|d| *d != ']') {},
            c => cleaned.push(c),
        }
    }
    for clause in ["by", "without", "on", "ignoring"] {
        let mut out = String::new();
        let mut rest = cleaned.as_str();
        while let Some(i) = find_word(rest, clause) {
            out.push_str(&rest[..i]);
            let after = rest[i + clause.len()..].trim_start();
            if let Some(inner) = after.strip_prefix('(') {
                rest = inner.split_once(')').map_or("", |(_, r)| r);
            } else {
                rest = after;
            }
        }
        out.push_str(rest);
        cleaned = out;
    }
    let mut names = BTreeSet::new();
    let bytes = cleaned.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len()
                && ((bytes[i] as char).is_ascii_alphanumeric()
                    || bytes[i] == b'_'
                    || bytes[i] == b':')
            {
                i += 1;
            }
            let word = &cleaned[start..i];
            let is_call = cleaned[i..].trim_start().starts_with('(');
            let after_digit = start > 0 && (bytes[start - 1] as char).is_ascii_digit();
            if !is_call && !after_digit && !KEYWORDS.contains(&word) {
                names.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Position of `word` as a whole word in `s`.
fn find_word(s: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = s[from..].find(word).map(|i| i + from) {
        let before = s[..i].chars().next_back();
        let after = s[i + word.len()..].chars().next();
        let boundary = |c: Option<char>| c.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        if boundary(before) && boundary(after) {
            return Some(i);
        }
        from = i + word.len();
    }
    None
}

fn workspace_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)).unwrap()
}

/// Every `expr` of the dashboard's panels.
fn dashboard_exprs() -> Vec<String> {
    let dashboard: Value =
        serde_json::from_str(&workspace_file("ops/grafana/outbox-dashboard.json")).unwrap();
    let mut exprs = Vec::new();
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut exprs);
    // The datasource is a variable, so the dashboard imports anywhere.
    let templating = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        templating
            .iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        "the dashboard has no Prometheus datasource variable"
    );
    exprs
}

/// Every `expr` of the alert rules (single-line or `|` blocks).
fn alert_exprs() -> Vec<String> {
    let rules = workspace_file("ops/prometheus/outbox-alerts.yml");
    let mut exprs = Vec::new();
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        let indent = line.len() - line.trim_start().len();
        let rest = rest.trim();
        if rest == "|" {
            let mut block = String::new();
            while let Some(next) = lines.peek() {
                if !next.trim().is_empty() && next.len() - next.trim_start().len() <= indent {
                    break;
                }
                let next = lines.next().unwrap();
                if !next.trim_start().starts_with('#') {
                    block.push_str(next);
                    block.push('\n');
                }
            }
            exprs.push(block);
        } else {
            exprs.push(rest.to_owned());
        }
    }
    exprs
}

/// The Prometheus naming rules this project holds its metrics to.
fn check_name(name: &str, kind: &str) -> Result<(), String> {
    let snake = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !name.contains("__")
        && !name.ends_with('_');
    if !snake {
        return Err(format!("`{name}` is not lowercase snake case"));
    }
    if !(name.starts_with("outbox_") || name.starts_with("inbox_")) {
        return Err(format!(
            "`{name}` has neither the outbox_ nor the inbox_ prefix"
        ));
    }
    match kind {
        "counter" if !name.ends_with("_total") => {
            return Err(format!("counter `{name}` does not end `_total`"));
        }
        "gauge" | "histogram" | "summary" if name.ends_with("_total") => {
            return Err(format!("{kind} `{name}` ends `_total`"));
        }
        _ => {}
    }
    for wrong in [
        "_ms",
        "_millis",
        "_milliseconds",
        "_micros",
        "_us",
        "_nanos",
        "_minutes",
        "_hours",
        "_kb",
        "_mb",
        "_kilobytes",
        "_megabytes",
        "_duration",
        "_latency",
        "_size",
        "_count",
        "_second",
        "_byte",
        "_row",
    ] {
        let base = name.strip_suffix("_total").unwrap_or(name);
        if base.ends_with(wrong) {
            return Err(format!(
                "`{name}` ends in `{wrong}`: units are suffixes in plural base units (`_seconds`, `_bytes`, `_rows`)"
            ));
        }
    }
    Ok(())
}

#[test]
fn the_name_rules_reject_what_they_should() {
    assert!(check_name("outbox_relay_published_total", "counter").is_ok());
    assert!(check_name("outbox_relay_backlog_rows", "gauge").is_ok());
    assert!(check_name("outbox_relay_publish_latency_seconds", "histogram").is_ok());
    assert!(check_name("outbox_published", "counter").is_err());
    assert!(check_name("outbox_backlog_total", "gauge").is_err());
    assert!(check_name("outbox_batch_size", "histogram").is_err());
    assert!(check_name("outbox_publish_latency_ms", "histogram").is_err());
    assert!(check_name("Outbox_published_total", "counter").is_err());
    assert!(check_name("relay_published_total", "counter").is_err());
    assert_eq!(
        metric_names(
            r#"sum by (consumer, le) (rate(inbox_handler_duration_seconds_bucket{job="x"}[5m])) > 0.2"#
        ),
        BTreeSet::from(["inbox_handler_duration_seconds_bucket".to_owned()])
    );
    assert_eq!(
        metric_names("absent(up{job=\"outbox-relay\"} == 1) or x offset 10m"),
        BTreeSet::from(["up".to_owned(), "x".to_owned()])
    );
}

/// The names the libraries declare follow the rules too, whether or not this
/// run recorded them.
#[test]
fn every_declared_name_follows_the_rules() {
    for name in outbox_publisher::metrics::NAMES
        .iter()
        .chain(inbox_consumer::metrics::names::ALL)
    {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        check_name(name, kind).unwrap();
    }
}

async fn seed(db: &TestDb, event_type: &str, subjects: &[&str], data: impl Fn(&str) -> Value) {
    let events: Vec<_> = subjects
        .iter()
        .map(|s| Envelope::new(event_type, "ops-tests", *s, data(s)).unwrap())
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue_all(&mut tx, &events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

async fn publish(js: &async_nats::jetstream::Context, subject: &str, payload: Vec<u8>, id: &str) {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", id);
    js.publish_with_headers(subject.to_owned(), headers, payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binaries_export_what_the_dashboard_and_alerts_use_and_answer_probes() {
    let upstream = TestDb::new().await.unwrap();
    let billing_db = TestDb::new().await.unwrap();
    let mut broker = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-ops-")
        .tempdir()
        .unwrap();
    let nats_url = broker.url();

    let mut relay = Proc::spawn(
        "outbox-relay",
        "outbox-relay",
        dir.path(),
        &[("DATABASE_URL", upstream.url()), ("NATS_URL", &nats_url)],
        &["--stream", STREAM, "--subjects", "subscription.>,invoice.>"],
    );
    // A WAL relay exports the slot's series besides.
    let wal_db = TestDb::new().await.unwrap();
    let mut wal_relay = Proc::spawn(
        "outbox-relay",
        "outbox-relay-wal",
        dir.path(),
        &[("DATABASE_URL", wal_db.url()), ("NATS_URL", &nats_url)],
        &[
            "--stream",
            "OPS_WAL",
            "--subjects",
            "wal.>",
            "--source",
            "wal",
        ],
    );
    let mut billing = Proc::spawn(
        "billing",
        "billing",
        dir.path(),
        &[("DATABASE_URL", billing_db.url()), ("NATS_URL", &nats_url)],
        &[],
    );

    // Liveness at once; readiness once connected, the stream and the durable exist.
    for p in [&mut relay, &mut billing] {
        let (status, body) = p.wait_for("liveness", "/healthz", |s, _| s == 200).await;
        assert_eq!((status, body.as_str()), (200, "ok\n"));
        let (_, body) = p.wait_for("readiness", "/readyz", |s, _| s == 200).await;
        let report: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(report["ready"], true, "{body}");
        assert_eq!(report["checks"]["broker"]["ok"], true, "{body}");
    }
    let (_, body) = billing.get("/readyz").await.unwrap();
    let report: Value = serde_json::from_str(&body).unwrap();
    for check in ["database", "broker", "stream", "consumer"] {
        assert_eq!(report["checks"][check]["ok"], true, "{check}: {body}");
    }

    // Events through the relay to billing; one the stream does not capture.
    let subs: Vec<String> = (0..5).map(|i| format!("sub_{i}")).collect();
    let subs: Vec<&str> = subs.iter().map(String::as_str).collect();
    seed(
        &upstream,
        "subscription.created",
        &subs,
        |s| json!({"subscription_id": s, "customer_id": "cus_1", "amount_cents": 1200}),
    )
    .await;
    seed(&upstream, "audit.recorded", &["audit_1"], |_| json!({})).await;
    // A scheduled event (billing does not consume invoice.reminder): the
    // scheduled gauges and the lateness histogram.
    let mut tx = upstream.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .schedule(
            &mut tx,
            &Envelope::new("invoice.reminder", "ops-tests", "inv_1", json!({})).unwrap(),
            Due::In(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let client = async_nats::connect(&nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    relay
        .wait_for("published events", "/metrics", |_, b| {
            sample(b, "outbox_relay_published_total") >= 5.0
        })
        .await;
    // A duplicate: a published event again, under another message id.
    let first = js
        .get_stream(STREAM)
        .await
        .unwrap()
        .get_last_raw_message_by_subject("subscription.created")
        .await
        .unwrap();
    publish(
        &js,
        "subscription.created",
        first.payload.to_vec(),
        "ops-duplicate",
    )
    .await;
    // Not JSON: dead-lettered before any handler.
    publish(
        &js,
        "subscription.created",
        b"not json".to_vec(),
        "ops-garbage",
    )
    .await;
    // A CloudEvent whose payload billing cannot read: the handler fails.
    let unreadable = Envelope::new(
        "subscription.created",
        "ops-tests",
        "sub_unreadable",
        json!({"subscription_id": 7}),
    )
    .unwrap();
    publish(
        &js,
        "subscription.created",
        unreadable.to_json().unwrap(),
        "ops-unreadable",
    )
    .await;

    let (_, billing_text) = billing
        .wait_for(
            "handled, duplicate, failed and dead-lettered deliveries",
            "/metrics",
            |_, b| {
                sample(b, "inbox_handled_total") >= 5.0
                    && sample(b, "inbox_duplicates_total") >= 1.0
                    && sample(b, "inbox_dead_lettered_total") >= 2.0
                    && sample(b, "inbox_failed_total") >= 1.0
                    && b.contains("inbox_pending_messages{")
                    && b.contains("inbox_ack_pending_messages{")
                    && b.contains("outbox_relay_broker_up 1")
            },
        )
        .await;
    let (_, relay_text) = relay
        .wait_for("a publish failure and the gauges", "/metrics", |_, b| {
            b.contains("outbox_relay_publish_failures_total{reason=\"not_captured\"}")
                && b.contains("outbox_relay_backlog_rows ")
                && b.contains("outbox_relay_past_cap_rows ")
                && b.contains("outbox_relay_oldest_unpublished_age_seconds ")
                && b.contains("outbox_relay_database_up 1")
                && b.contains("outbox_relay_broker_up 1")
                && b.contains("outbox_relay_scheduled_rows ")
                && b.contains("outbox_relay_scheduled_next_due_timestamp_seconds ")
                && b.contains("outbox_relay_scheduled_lateness_seconds_bucket{")
        })
        .await;

    // Histograms of seconds are Prometheus histograms, with buckets.
    for (text, name) in [
        (&relay_text, "outbox_relay_publish_latency_seconds"),
        (&relay_text, "outbox_relay_commit_to_ack_seconds"),
        (&relay_text, "outbox_relay_batch_phase_seconds"),
        (&relay_text, "outbox_relay_scheduled_lateness_seconds"),
        (&billing_text, "inbox_handler_duration_seconds"),
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} histogram"))
                && text.contains(&format!("{name}_bucket{{")),
            "{name} is not a histogram with buckets:\n{text}"
        );
    }

    let (_, wal_text) = wal_relay
        .wait_for("the WAL source's series", "/metrics", |_, b| {
            b.contains("outbox_relay_wal_up 1")
                && b.contains("outbox_relay_wal_lag_bytes ")
                && b.contains("outbox_relay_wal_slot_lost_total ")
        })
        .await;

    // Every exported name follows the rules.
    let mut exported_names = BTreeMap::new();
    for (who, text) in [
        ("outbox-relay", &relay_text),
        ("outbox-relay --source wal", &wal_text),
        ("billing", &billing_text),
    ] {
        for (name, kind) in exported(text) {
            check_name(&name, &kind).unwrap_or_else(|e| panic!("{who} exports {e}"));
            exported_names.insert(name, kind);
        }
    }

    // Every name the dashboard and the alerts read is exported.
    let mut missing = Vec::new();
    for (source, exprs) in [
        ("dashboard", dashboard_exprs()),
        ("alert rules", alert_exprs()),
    ] {
        assert!(exprs.len() >= 8, "{source}: {exprs:?}");
        for expr in &exprs {
            for name in metric_names(expr) {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .filter(|b| exported_names.get(*b).is_some_and(|k| k == "histogram"))
                    .unwrap_or(&name);
                if base != "up" && !exported_names.contains_key(base) {
                    missing.push(format!("{source}: `{name}` in `{}`", expr.trim()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "used but not exported:\n{}\nexported: {:?}",
        missing.join("\n"),
        exported_names.keys().collect::<Vec<_>>()
    );

    // The broker goes away: both answer 503 naming it, and the relay's gauge drops.
    tokio::task::block_in_place(|| broker.kill()).unwrap();
    for p in [&mut relay, &mut billing] {
        let (_, body) = p
            .wait_for("503 naming the broker", "/readyz", |s, b| {
                s == 503
                    && serde_json::from_str::<Value>(b)
                        .is_ok_and(|r| r["checks"]["broker"]["ok"] == false)
            })
            .await;
        let report: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(report["ready"], false, "{body}");
        assert_eq!(report["checks"]["broker"]["ok"], false, "{body}");
        assert_eq!(report["checks"]["database"]["ok"], true, "{body}");
        assert!(
            report["checks"]["broker"]["error"]
                .as_str()
                .unwrap()
                .contains("not connected to NATS"),
            "{body}"
        );
        // Still alive.
        assert_eq!(p.get("/healthz").await.map(|a| a.0), Some(200));
    }
    relay
        .wait_for("outbox_relay_broker_up 0", "/metrics", |_, b| {
            b.contains("outbox_relay_broker_up 0")
        })
        .await;

    // Back: ready again, and the gauge follows.
    tokio::task::block_in_place(|| broker.start_again()).unwrap();
    for p in [&mut relay, &mut billing] {
        p.wait_for("readiness after the broker restarted", "/readyz", |s, _| {
            s == 200
        })
        .await;
    }
    relay
        .wait_for("outbox_relay_broker_up 1", "/metrics", |_, b| {
            b.contains("outbox_relay_broker_up 1")
        })
        .await;
}

/// `subscriptions` serves the same endpoint for its in-process relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_serves_the_relays_metrics_and_readiness() {
    let db = TestDb::new().await.unwrap();
    let broker = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-ops-subs-")
        .tempdir()
        .unwrap();
    let nats_url = broker.url();
    let mut subscriptions = Proc::spawn(
        "subscriptions",
        "subscriptions",
        dir.path(),
        &[("DATABASE_URL", db.url()), ("NATS_URL", &nats_url)],
        &["--listen", "127.0.0.1:0"],
    );
    subscriptions
        .wait_for("liveness", "/healthz", |s, _| s == 200)
        .await;
    let (_, body) = subscriptions
        .wait_for("readiness", "/readyz", |s, _| s == 200)
        .await;
    let report: Value = serde_json::from_str(&body).unwrap();
    for check in ["database", "broker", "stream"] {
        assert_eq!(report["checks"][check]["ok"], true, "{check}: {body}");
    }
    let (_, text) = subscriptions
        .wait_for("the relay's gauges", "/metrics", |_, b| {
            b.contains("outbox_relay_database_up 1") && b.contains("outbox_relay_broker_up 1")
        })
        .await;
    for (name, kind) in exported(&text) {
        check_name(&name, &kind).unwrap();
    }
}

/// `outbox_relay_database_up` and `/readyz` follow PostgreSQL going away and
/// coming back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_database_gauge_and_readiness_follow_postgres() {
    let mut pg = tokio::task::spawn_blocking(outbox_testkit::PgServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let broker = outbox_testkit::nats().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-ops-pg-")
        .tempdir()
        .unwrap();
    let mut relay = Proc::spawn(
        "outbox-relay",
        "outbox-relay",
        dir.path(),
        &[("DATABASE_URL", db.url()), ("NATS_URL", broker.url())],
        &["--stream", "OPS_PG", "--subjects", "opspg.>"],
    );
    relay
        .wait_for("outbox_relay_database_up 1", "/metrics", |_, b| {
            b.contains("outbox_relay_database_up 1")
        })
        .await;
    relay
        .wait_for("readiness", "/readyz", |s, _| s == 200)
        .await;

    tokio::task::block_in_place(|| pg.stop()).unwrap();
    relay
        .wait_for("outbox_relay_database_up 0", "/metrics", |_, b| {
            b.contains("outbox_relay_database_up 0")
        })
        .await;
    let (_, body) = relay
        .wait_for("503 naming the database", "/readyz", |s, _| s == 503)
        .await;
    let report: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["checks"]["database"]["ok"], false, "{body}");
    assert_eq!(report["checks"]["broker"]["ok"], true, "{body}");

    tokio::task::block_in_place(|| pg.start_again()).unwrap();
    relay
        .wait_for("outbox_relay_database_up 1 again", "/metrics", |_, b| {
            b.contains("outbox_relay_database_up 1")
        })
        .await;
    relay
        .wait_for("readiness after PostgreSQL restarted", "/readyz", |s, _| {
            s == 200
        })
        .await;
}

/// A database, a broker and an `outbox-relay` on them publishing `subjects`
/// to `stream`, once its horizon gauge is served.
async fn horizon_relay(
    stream: &str,
    subjects: &str,
) -> (TestDb, outbox_testkit::NatsHandle, tempfile::TempDir, Proc) {
    let db = TestDb::new().await.unwrap();
    let broker = outbox_testkit::nats().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-ops-horizon-")
        .tempdir()
        .unwrap();
    let mut relay = Proc::spawn(
        "outbox-relay",
        "outbox-relay",
        dir.path(),
        &[("DATABASE_URL", db.url()), ("NATS_URL", broker.url())],
        &["--stream", stream, "--subjects", subjects],
    );
    relay
        .wait_for("the horizon gauge", "/metrics", |_, b| {
            horizon_held(b).is_some()
        })
        .await;
    (db, broker, dir, relay)
}

/// `outbox_relay_horizon_held_seconds` from a scrape.
fn horizon_held(body: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix("outbox_relay_horizon_held_seconds "))
        .and_then(|v| v.trim().parse().ok())
}

/// Transactions left open that cannot hold an outbox seq (one in another
/// database, a prepared transaction left there, one in this database that
/// wrote another table) do not hold the
/// settled horizon back: `outbox_relay_horizon_held_seconds` stays near the
/// one second a candidate waits before they are passed over. A writer of
/// the outbox left open does hold it, and the gauge says so.
#[tokio::test]
async fn only_open_transactions_that_wrote_to_the_outbox_hold_the_horizon() {
    let (db, _broker, _dir, mut relay) = horizon_relay("OPS_HZ", "opshz.>").await;

    // Open, with a transaction id each, and never ending during the check.
    let other_name = format!("{}_other", db.name());
    let other_url = outbox_testkit::create_database(db.url(), &other_name)
        .await
        .unwrap();
    let mut elsewhere = sqlx::PgConnection::connect(&other_url).await.unwrap();
    sqlx::raw_sql("begin; select pg_current_xact_id();")
        .execute(&mut elsewhere)
        .await
        .unwrap();
    // A prepared transaction left behind in another database (a crashed
    // transaction manager), which wrote nothing to the outbox.
    let gid = format!("orphan_{}", &db.name()[db.name().len() - 8..]);
    let mut preparer = sqlx::PgConnection::connect(&other_url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "create table t (n int); begin; insert into t values (1); prepare transaction '{gid}';"
    )))
    .execute(&mut preparer)
    .await
    .unwrap();
    sqlx::query("create table unrelated (n int)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut unrelated = db.pool.acquire().await.unwrap();
    sqlx::raw_sql("begin; insert into unrelated values (1);")
        .execute(&mut *unrelated)
        .await
        .unwrap();
    let opened = Instant::now();
    // Rows keep coming, so candidates keep forming.
    let mut samples = Vec::new();
    while opened.elapsed() < Duration::from_secs(5) {
        seed(&db, "opshz.step", &["a"], |_| json!({})).await;
        let (_, body) = relay.wait_for("metrics", "/metrics", |s, _| s == 200).await;
        samples.push(horizon_held(&body).unwrap());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let worst = samples.iter().copied().fold(0.0, f64::max);
    assert!(
        worst < 2.5,
        "held {worst} s by transactions that cannot hold a seq: {samples:?}\n{}",
        relay.log()
    );

    // A writer of the outbox left open holds it.
    let mut writer = db.pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "begin; insert into outbox_events (id, event_type, source, subject, time, data)
                values (gen_random_uuid(), 'opshz.step', 'tests', 'held', now(), '{}');",
    )
    .execute(&mut *writer)
    .await
    .unwrap();
    seed(&db, "opshz.step", &["a"], |_| json!({})).await;
    relay
        .wait_for("the horizon held by the open writer", "/metrics", |_, b| {
            horizon_held(b).is_some_and(|h| h >= 3.0)
        })
        .await;
    sqlx::raw_sql("rollback")
        .execute(&mut *writer)
        .await
        .unwrap();
    seed(&db, "opshz.step", &["a"], |_| json!({})).await;
    relay
        .wait_for("the horizon moving again", "/metrics", |_, b| {
            horizon_held(b).is_some_and(|h| h < 2.0)
        })
        .await;
    let _ = sqlx::raw_sql("rollback").execute(&mut *unrelated).await;
    let _ = sqlx::raw_sql("rollback").execute(&mut elsewhere).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("rollback prepared '{gid}'")))
        .execute(&mut preparer)
        .await
        .unwrap();
}

/// A writer that stays open while no other transaction ends (a quiet
/// database): its transaction id is newer than the last one to end, so a
/// snapshot's list of running transactions leaves it out. The horizon waits
/// for it all the same, and its row is published the moment it commits, not
/// at the next sweep of the shard a minute later.
#[tokio::test]
async fn a_writer_open_in_a_quiet_database_is_published_when_it_commits() {
    let (db, _broker, _dir, mut relay) = horizon_relay("OPS_QUIET", "opsq.>").await;
    let mut writer = db.pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "begin; insert into outbox_events (id, event_type, source, subject, time, data)
                values (gen_random_uuid(), 'opsq.step', 'tests', 'quiet', now(), '{}');",
    )
    .execute(&mut *writer)
    .await
    .unwrap();
    // Several ticks while it is open and nothing else ends.
    relay
        .wait_for("the horizon waiting for the writer", "/metrics", |_, b| {
            horizon_held(b).is_some_and(|h| h >= 2.0)
        })
        .await;
    sqlx::raw_sql("commit").execute(&mut *writer).await.unwrap();
    let committed = Instant::now();
    outbox_testkit::wait_until("the row published", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from outbox_events where published_at is null",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == 0
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    assert!(committed.elapsed() < Duration::from_secs(20));
}

/// The relay says it works, in its log at the default level: one line at
/// start naming the stream, its subjects and the source, and one per
/// `--progress-interval` with what it published since the line before, the
/// backlog and the age of the oldest unpublished row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_logs_its_start_and_its_progress_per_interval() {
    let db = TestDb::new().await.unwrap();
    let broker = outbox_testkit::nats().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-ops-progress-")
        .tempdir()
        .unwrap();
    let mut relay = Proc::spawn(
        "outbox-relay",
        "outbox-relay",
        dir.path(),
        &[
            ("DATABASE_URL", db.url()),
            ("NATS_URL", broker.url()),
            ("OUTBOX_PROGRESS_INTERVAL", "1s"),
        ],
        &["--stream", "OPS_PROGRESS", "--subjects", "opsp.>"],
    );
    relay
        .wait_for("readiness", "/readyz", |status, _| status == 200)
        .await;
    let line = |log: &str, what: &str| log.lines().find(|l| l.contains(what)).map(str::to_owned);
    let start = line(&relay.log(), "outbox relay started")
        .unwrap_or_else(|| panic!("no start line:\n{}", relay.log()));
    for field in ["stream=OPS_PROGRESS", "subjects=opsp.>", "source=poll"] {
        assert!(start.contains(field), "{field} missing from: {start}");
    }
    seed(&db, "opsp.step", &["a", "b", "c"], |s| json!({ "s": s })).await;
    // The three may be counted over two intervals; the lines add up to them.
    let field = |l: &str, name: &str| -> Option<String> {
        let rest = &l[l.find(&format!(" {name}="))? + name.len() + 2..];
        Some(rest.split_whitespace().next().unwrap_or("").to_owned())
    };
    let deadline = Instant::now() + WAIT;
    let last = loop {
        let log = relay.log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("relay progress over the last 1s"))
            .collect();
        let sum: u64 = lines
            .iter()
            .filter_map(|l| field(l, "published")?.parse::<u64>().ok())
            .sum();
        if sum == 3
            && let Some(l) = lines.last()
            && field(l, "backlog").as_deref() == Some("0")
        {
            break (*l).to_owned();
        }
        relay.assert_running();
        assert!(
            Instant::now() < deadline,
            "progress lines do not add up to 3 published, backlog 0:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (name, want) in [("oldest_unpublished", "0s"), ("duplicates", "0")] {
        assert_eq!(
            field(&last, name).as_deref(),
            Some(want),
            "{name} in: {last}"
        );
    }
    // And a line every interval while nothing happens.
    let before = relay.log().matches("relay progress").count();
    outbox_testkit::wait_until("a later progress line", WAIT, || async {
        relay.log().matches("relay progress").count() > before
    })
    .await
    .unwrap();
    assert!(relay.log().contains("published=0"), "{}", relay.log());
}
