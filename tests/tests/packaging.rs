//! What publishing the library crates promises, checked from `cargo metadata`:
//! the declared `rust-version` is true for the whole dependency tree, and each
//! crate carries what crates.io shows (description, readme, licence files,
//! keywords, categories). `scripts/package-check` in CI checks that each
//! packages and compiles from its package alone.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

const LIBRARIES: [&str; 4] = [
    "outbox-pg",
    "outbox-publisher",
    "inbox-consumer",
    "outbox-testkit",
];

/// The host's target triple, from `rustc -vV`.
fn host() -> String {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("running rustc -vV");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV names the host")
}

/// `cargo metadata` for this host (the packages of other platforms need not
/// be downloaded).
fn metadata() -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", &host()])
        .current_dir(&root)
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn version(v: &str) -> (u64, u64, u64) {
    let mut parts = v.split('.').map(|p| p.parse::<u64>().unwrap());
    (
        parts.next().unwrap(),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

#[test]
fn the_declared_rust_version_covers_every_dependency() {
    let meta = metadata();
    let packages: HashMap<&str, &Value> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p))
        .collect();
    let nodes: HashMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].as_str().unwrap(), n))
        .collect();

    let mut queue: VecDeque<&str> = packages
        .iter()
        .filter(|(_, p)| LIBRARIES.contains(&p["name"].as_str().unwrap()))
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(queue.len(), LIBRARIES.len());
    let declared: HashSet<&str> = queue
        .iter()
        .map(|id| packages[id]["rust_version"].as_str().unwrap())
        .collect();
    assert_eq!(declared.len(), 1, "the libraries declare {declared:?}");
    let declared = version(declared.into_iter().next().unwrap());

    // Every package a library build (any feature, binaries included) compiles.
    let mut seen = HashSet::new();
    let mut needs = Vec::new();
    while let Some(id) = queue.pop_front() {
        if !seen.insert(id) {
            continue;
        }
        if let Some(rv) = packages[id]["rust_version"].as_str()
            && version(rv) > declared
        {
            needs.push(format!("{} needs {rv}", packages[id]["name"]));
        }
        for dep in nodes[id]["deps"].as_array().unwrap() {
            let normal_or_build = dep["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["kind"].as_str() != Some("dev"));
            if normal_or_build {
                queue.push_back(dep["pkg"].as_str().unwrap());
            }
        }
    }
    assert!(seen.len() > 50, "walked only {} packages", seen.len());
    assert!(
        needs.is_empty(),
        "rust-version {declared:?} is too low: {needs:?}"
    );
}

#[test]
fn each_library_crate_carries_what_the_registry_shows() {
    let meta = metadata();
    for package in meta["packages"].as_array().unwrap() {
        let name = package["name"].as_str().unwrap();
        if !LIBRARIES.contains(&name) {
            continue;
        }
        let dir = Path::new(package["manifest_path"].as_str().unwrap())
            .parent()
            .unwrap();
        for field in ["description", "license", "repository", "readme"] {
            assert!(package[field].is_string(), "{name}: no {field}");
        }
        let keywords = package["keywords"].as_array().unwrap();
        assert!(
            (1..=5).contains(&keywords.len()),
            "{name}: keywords {keywords:?}"
        );
        assert!(
            !package["categories"].as_array().unwrap().is_empty(),
            "{name}: no categories"
        );
        for file in ["README.md", "LICENSE-MIT", "LICENSE-APACHE"] {
            let text = std::fs::read_to_string(dir.join(file))
                .unwrap_or_else(|e| panic!("{name}: {file}: {e}"));
            assert!(text.len() > 200, "{name}: {file} is nearly empty");
        }
    }
    let changelog = Path::new(env!("CARGO_MANIFEST_DIR")).join("../CHANGELOG.md");
    assert!(changelog.is_file(), "no CHANGELOG.md");
}

/// The README's programs, each with the `[dependencies]` block beside it,
/// built as a new user builds them: in a fresh crate outside the workspace
/// (its own `Cargo.toml`, the lockfile's versions), the project's crates
/// taken by path as the registry would give them. So a README snippet that
/// stops compiling, or a dependency it needs that its block leaves out, fails
/// here. Built into `target/readme-snippets` (the workspace's own target
/// directory is locked while the tests run), then run as a user runs them
/// against real servers, beside the shipped `outbox-relay`, on a nats-server
/// that admits users by password only: the consumer connects through the
/// library's flags as its NATS user (password from a file) with its own
/// inbox prefix, the only inbox its user may subscribe to; without the
/// password it is refused at once. N writes give N invoices, once each,
/// through a duplicate delivery, and the consumer drains and exits 0 on
/// SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_programs_build_in_a_fresh_crate_and_run_against_real_servers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = root.canonicalize().unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let programs = readme_programs(&readme);
    assert!(
        programs.len() >= 2,
        "the README's writing and consuming programs, each after a ```toml [dependencies] block: found {}",
        programs.len()
    );
    let paths: HashMap<&str, &str> = [
        ("outbox-pg", "outbox-pg"),
        ("outbox-publisher", "outbox-publisher"),
        ("inbox-consumer", "inbox-consumer"),
    ]
    .into_iter()
    .collect();
    // One fresh crate per program, with its own block alone: a crate a
    // program needs and its block leaves out fails it.
    let mut binaries = Vec::new();
    for (i, (toml, rust)) in programs.iter().enumerate() {
        let dir = tempfile::Builder::new()
            .prefix("outbox-readme-")
            .tempdir()
            .unwrap();
        let mut deps: Vec<String> = Vec::new();
        for line in toml.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') || line == "[dependencies]" {
                continue;
            }
            let (name, spec) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("not a dependency line: {line}"));
            let (name, spec) = (name.trim(), spec.trim());
            deps.push(match paths.get(name) {
                // As the registry would resolve "0.1": the crate in this tree.
                Some(path) => {
                    let path = format!("path = {:?}", root.join(path).display().to_string());
                    let spec = if spec.starts_with('"') {
                        format!("{{ {path} }}")
                    } else {
                        spec.replacen("version = \"0.1\"", &path, 1)
                    };
                    format!("{name} = {spec}")
                }
                None => format!("{name} = {spec}"),
            });
        }
        std::fs::create_dir_all(dir.path().join("src")).unwrap();
        std::fs::write(dir.path().join("src/main.rs"), rust).unwrap();
        let manifest = format!(
            "[package]\nname = \"readme-program-{i}\"\nversion = \"0.0.0\"\nedition = \"2024\"\n\
             publish = false\n\n[dependencies]\n{}\n\n[workspace]\n",
            deps.join("\n")
        );
        std::fs::write(dir.path().join("Cargo.toml"), &manifest).unwrap();
        // The versions this tree is tested with; what is not used drops out.
        std::fs::copy(root.join("Cargo.lock"), dir.path().join("Cargo.lock")).unwrap();
        let target = root.join("target/readme-snippets");
        let mut cargo = Command::new(env!("CARGO"));
        // The rustc beside this cargo, not the one a rustup proxy would pick
        // in a dependency's directory (sqlx ships a rust-toolchain.toml).
        let rustc = Path::new(env!("CARGO")).with_file_name("rustc");
        if rustc.is_file() {
            cargo.env("RUSTC", rustc);
        }
        let out = cargo
            .args(["build", "--offline", "--quiet"])
            .env("CARGO_TARGET_DIR", &target)
            // No debug info: it changes nothing of what compiles, and on a
            // fresh clone this builds every dependency.
            .env("CARGO_PROFILE_DEV_DEBUG", "0")
            .env("SQLX_OFFLINE", "true")
            .env_remove("RUSTFLAGS")
            .current_dir(dir.path())
            .output()
            .expect("running cargo check");
        assert!(
            out.status.success(),
            "README program {} does not build in a fresh crate with its dependency block:\n{}\n\
             --- Cargo.toml:\n{manifest}",
            i + 1,
            String::from_utf8_lossy(&out.stderr),
        );
        binaries.push(target.join(format!("debug/readme-program-{i}")));
    }
    let [writer, consumer] = binaries.as_slice() else {
        panic!(
            "the README has {} programs, not the writer and the consumer",
            binaries.len()
        );
    };
    assert!(
        programs[0].1.contains("outbox.enqueue"),
        "the first program writes"
    );
    assert!(
        programs[1].1.contains("Consumer::builder"),
        "the second consumes"
    );
    run_readme_programs(writer, consumer).await;
}

/// The NATS users of the run: the relay's, the README consumer's (which may
/// subscribe to its own inbox prefix only, as docs/security.md's "NATS"
/// section sets up every consumer) and the test's own.
const NATS_CONFIG: &str = r#"authorization {
  users = [
    { user: relay, password: "relay-s3cret" }
    {
      user: billing
      password: "billing-s3cret"
      permissions: { subscribe: { allow: ["_INBOX_billing.>"] } }
    }
    { user: test, password: "test-s3cret" }
  ]
}
"#;

/// The README's writer `N` times, the relay, then the README's consumer: N
/// invoices, one per event, also after one message is delivered again under
/// another message id; SIGTERM drains the consumer, exit 0. NATS requires a
/// user and password ([`NATS_CONFIG`]): the consumer without them exits
/// non-zero at once, naming the refusal.
async fn run_readme_programs(writer: &Path, consumer: &Path) {
    const N: i64 = 5;
    const WAIT: std::time::Duration = std::time::Duration::from_secs(60);
    let db = outbox_testkit::TestDb::new().await.unwrap();
    // The tables the programs write: the service's own.
    sqlx::raw_sql(
        "create table subscriptions (id text not null, plan text not null);
         create table invoices (id text not null, subscription_id text not null, amount_cents bigint not null);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let broker =
        tokio::task::block_in_place(|| outbox_testkit::NatsServer::start_with_config(NATS_CONFIG))
            .unwrap();
    let logs = tempfile::Builder::new()
        .prefix("outbox-readme-run-")
        .tempdir()
        .unwrap();
    let password_file = logs.path().join("nats-password");
    std::fs::write(&password_file, "billing-s3cret\n").unwrap();
    for _ in 0..N {
        let out = tokio::process::Command::new(writer)
            .env_clear()
            .env("DATABASE_URL", db.url())
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "the README's writer: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("wrote "));
    }
    let bin_dir = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let mut relay =
        outbox_testkit::Program::new("outbox-relay", bin_dir.join("outbox-relay"), logs.path())
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", broker.url())
            .env("NATS_USER", "relay")
            .env("NATS_PASSWORD", "relay-s3cret")
            .args([
                "--stream",
                "OUTBOX",
                "--subjects",
                "subscription.>,invoice.>",
            ]);
    relay.start().await.unwrap();
    let log = |name: &str| {
        std::fs::read_to_string(logs.path().join(format!("{name}.log"))).unwrap_or_default()
    };
    // Without its password: refused by the server, an error at once.
    let mut refused = outbox_testkit::Program::new(
        "readme-consumer-refused",
        consumer.to_path_buf(),
        logs.path(),
    )
    .env("DATABASE_URL", db.url())
    .env("NATS_URL", broker.url());
    refused.start().await.unwrap();
    let status = refused.wait_exit(std::time::Duration::from_secs(30)).await;
    assert!(
        status.is_some_and(|code| code != 0)
            && log("readme-consumer-refused")
                .to_lowercase()
                .contains("authorization violation"),
        "the README's consumer without NATS credentials: {status:?}\n{}",
        log("readme-consumer-refused")
    );
    // As production runs it: its user, the password from a file, its own
    // inbox prefix (the default `_INBOX.>` is not allowed to it).
    let mut consumer =
        outbox_testkit::Program::new("readme-consumer", consumer.to_path_buf(), logs.path())
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", broker.url())
            .env("NATS_USER", "billing")
            .env("NATS_PASSWORD_FILE", password_file.display().to_string())
            .env("NATS_INBOX_PREFIX", "_INBOX_billing");
    consumer.start().await.unwrap();
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    outbox_testkit::wait_until("N invoices", WAIT, || async {
        count("select count(*) from invoices").await == N
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log("readme-consumer")));
    // One event delivered again, under another message id: no new invoice.
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::new()
            .user_and_password("test".into(), "test-s3cret".into())
            .connect(broker.url())
            .await
            .unwrap(),
    );
    let stored = js
        .get_stream("OUTBOX")
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(stored.subject.as_str(), "subscription.created");
    let copy = js
        .publish_with_headers(
            "subscription.created",
            {
                let mut h = async_nats::HeaderMap::new();
                h.insert("Nats-Msg-Id", "readme-redelivery");
                h
            },
            stored.payload.clone(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    outbox_testkit::wait_until("the copy handled and acked", WAIT, || {
        let js = js.clone();
        async move {
            let Ok(mut durable) = js
                .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
                    "billing", "OUTBOX",
                )
                .await
            else {
                return false;
            };
            durable
                .info()
                .await
                .is_ok_and(|i| i.ack_floor.stream_sequence >= copy && i.num_ack_pending == 0)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log("readme-consumer")));
    // Every event once: one inbox row and one invoice each, the copy none.
    assert_eq!(
        count("select count(*) from invoices").await,
        N,
        "{}",
        log("readme-consumer")
    );
    assert_eq!(count("select count(*) from inbox_events").await, N);
    outbox_testkit::wait_until("the follow-on events published", WAIT, || async {
        count("select count(*) from outbox_events where published_at is null").await == 0
    })
    .await
    .unwrap();
    let status = consumer.terminate().await;
    assert_eq!(
        status,
        Some(0),
        "the README's consumer on SIGTERM\n{}",
        log("readme-consumer")
    );
    assert_eq!(relay.terminate().await, Some(0), "{}", log("outbox-relay"));
}

/// Each ```rust block of `readme` that follows a ```toml block holding
/// `[dependencies]` (with prose between them or not), with that block.
fn readme_programs(readme: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut deps: Option<String> = None;
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.strip_prefix("```") else {
            continue;
        };
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        let body = body.join("\n") + "\n";
        if info == "toml" && body.contains("[dependencies]") {
            deps = Some(body);
        } else if info.starts_with("rust")
            && let Some(toml) = deps.take()
        {
            out.push((toml, body));
        }
    }
    out
}
