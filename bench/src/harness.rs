//! What every part shares: a fresh database and stream per mode, the events,
//! and the shipped `outbox-relay` binary run as a process with its default
//! flags, read through its Prometheus metrics, `/proc` and its log.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::{self, stream::Config};
use futures::StreamExt;
use outbox_pg::{Envelope, Outbox};
use outbox_publisher::DEFAULT_DUPLICATE_WINDOW;
use outbox_testkit::{Program, create_database};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(crate) type Result<T, E = BoxError> = std::result::Result<T, E>;

/// The subjects every bench stream captures; every bench event is `bench.created`.
pub(crate) const SUBJECTS: &str = "bench.>";
const EVENT_TYPE: &str = "bench.created";
/// The size of one published message body (the CloudEvents JSON with its
/// `sequence`), give or take the digits of the counters in it.
pub(crate) const MESSAGE_BYTES: usize = 300;
/// How often a drain's progress is read from the stream.
pub(crate) const POLL: Duration = Duration::from_millis(50);
/// The share of a drain's rows whose time is reported as its tail.
pub(crate) const TAIL: f64 = 0.05;
/// A drain that publishes nothing for this long has failed.
const STALL: Duration = Duration::from_secs(60);

/// The servers, the binaries and the names handed out in this run.
#[derive(Debug)]
pub(crate) struct Env {
    pub(crate) admin: PgPool,
    pub(crate) admin_url: String,
    pub(crate) nats_url: String,
    pub(crate) js: jetstream::Context,
    pub(crate) bin_dir: PathBuf,
    pub(crate) logs: PathBuf,
    /// This run's copy of `outbox-relay`, so a rebuild during the run cannot
    /// change the binary between modes; `None` if it was not built.
    relay_bin: Option<PathBuf>,
    next: AtomicUsize,
    notes: Mutex<Vec<String>>,
}

/// A database closed to connections, copied by [`Env::database_from`].
#[derive(Debug)]
pub(crate) struct Template {
    pub(crate) name: String,
    url: String,
}

/// One mode's own database.
#[derive(Debug)]
pub(crate) struct Db {
    pub(crate) name: String,
    pub(crate) url: String,
    pub(crate) pool: PgPool,
}

impl Env {
    pub(crate) async fn new(admin_url: &str, nats_url: &str) -> Result<Self> {
        if let Some((key, _)) = std::env::vars().find(|(k, _)| {
            k.starts_with("OUTBOX_") && !k.starts_with("OUTBOX_TEST_") && k != "OUTBOX_STREAM"
        }) {
            return Err(format!(
                "{key} is set and the relays would inherit it; unset it, they run with their defaults"
            )
            .into());
        }
        let bin_dir = std::env::current_exe()?
            .parent()
            .map(std::path::Path::to_path_buf)
            .ok_or("no directory for this executable")?;
        let logs = std::env::temp_dir()
            .join("outbox-bench")
            .join(std::process::id().to_string());
        std::fs::create_dir_all(&logs)?;
        let built = bin_dir.join("outbox-relay");
        let relay_bin = if built.is_file() {
            let copy = logs.join("outbox-relay");
            std::fs::copy(&built, &copy)?;
            Some(copy)
        } else {
            None
        };
        let admin = PgPoolOptions::new()
            .max_connections(4)
            .connect(admin_url)
            .await?;
        // Every node of a cluster (`a,b,c`), as the relays are given them.
        let urls: Vec<&str> = nats_url.split(',').map(str::trim).collect();
        let client = async_nats::connect(urls).await?;
        Ok(Self {
            admin,
            admin_url: admin_url.to_owned(),
            nats_url: nats_url.to_owned(),
            js: jetstream::new(client),
            bin_dir,
            logs,
            relay_bin,
            next: AtomicUsize::new(0),
            notes: Mutex::new(Vec::new()),
        })
    }

    /// Where the relay binary was copied from, and when it was built.
    pub(crate) fn relay_built(&self) -> String {
        let built = self.bin_dir.join("outbox-relay");
        let when = std::fs::metadata(&built)
            .and_then(|m| m.modified())
            .ok()
            .map(|t| {
                chrono::DateTime::<chrono::Utc>::from(t)
                    .format("%Y-%m-%d %H:%M:%S UTC")
                    .to_string()
            });
        match (&self.relay_bin, when) {
            (Some(_), Some(when)) => format!("{} (built {when})", built.display()),
            _ => format!("{} missing", built.display()),
        }
    }

    fn serial(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// A fresh, migrated database.
    pub(crate) async fn database(&self, label: &str) -> Result<Db> {
        let name = format!("bench_{}_{}_{label}", std::process::id(), self.serial());
        let url = create_database(&self.admin_url, &name).await?;
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&url)
            .await?;
        outbox_pg::migrate(&pool).await?;
        Ok(Db { name, url, pool })
    }

    /// Closes `db` and keeps it as a template: no one may connect to it
    /// (autovacuum included), so it can be copied.
    pub(crate) async fn freeze(&self, db: Db) -> Result<Template> {
        db.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "alter database \"{}\" allow_connections false",
            db.name
        )))
        .execute(&self.admin)
        .await?;
        Ok(Template {
            name: db.name,
            url: db.url,
        })
    }

    /// A copy of `template`, file by file (its rows, indexes, visibility map
    /// and statistics as they are).
    pub(crate) async fn database_from(&self, template: &Template, label: &str) -> Result<Db> {
        let name = format!("bench_{}_{}_{label}", std::process::id(), self.serial());
        let create = format!(
            "create database \"{name}\" template \"{}\" strategy file_copy",
            template.name
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        // A backend that just left the template may still be exiting.
        while let Err(e) = sqlx::query(sqlx::AssertSqlSafe(create.clone()))
            .execute(&self.admin)
            .await
        {
            if Instant::now() > deadline || !e.to_string().contains("other users") {
                return Err(e.into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let url = template
            .url
            .replacen(&format!("/{}", template.name), &format!("/{name}"), 1);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&url)
            .await?;
        Ok(Db { name, url, pool })
    }

    pub(crate) async fn drop_template(&self, template: Template) -> Result<()> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "drop database if exists \"{}\" with (force)",
            template.name
        )))
        .execute(&self.admin)
        .await?;
        Ok(())
    }

    pub(crate) async fn drop_database(&self, db: Db) -> Result<()> {
        db.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "drop database if exists \"{}\" with (force)",
            db.name
        )))
        .execute(&self.admin)
        .await?;
        Ok(())
    }

    /// A stream name not used before in this run.
    pub(crate) fn stream_name(&self) -> String {
        format!("BENCH_{}_{}", std::process::id(), self.serial())
    }

    /// Creates `name` as `outbox-relay` would with its defaults.
    pub(crate) async fn create_stream(&self, name: &str) -> Result<()> {
        self.create_stream_with_replicas(name, 1).await
    }

    /// Creates `name` as `outbox-relay` would with its defaults (file
    /// storage, its duplicate window) but with `replicas` replicas.
    pub(crate) async fn create_stream_with_replicas(
        &self,
        name: &str,
        replicas: usize,
    ) -> Result<()> {
        self.js
            .create_stream(Config {
                name: name.into(),
                subjects: vec![SUBJECTS.into()],
                storage: jetstream::stream::StorageType::File,
                num_replicas: replicas,
                duplicate_window: DEFAULT_DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await?;
        Ok(())
    }

    /// Deletes `name` (its messages would otherwise fill the disk, and its
    /// subjects would overlap the next stream's).
    pub(crate) async fn delete_stream(&self, name: &str) {
        let _ = self.js.delete_stream(name).await;
    }

    /// Messages stored in `name`; 0 while it does not exist.
    pub(crate) async fn stream_messages(&self, name: &str) -> Result<u64> {
        match self.js.get_stream(name).await {
            Ok(mut stream) => Ok(stream.info().await?.state.messages),
            Err(e)
                if matches!(e.kind(), GetStreamErrorKind::JetStream(ref js)
                if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                Ok(0)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Something the reader of the summary should know (a relay's warning,
    /// error or failed exit).
    pub(crate) fn note(&self, line: String) {
        println!("  note: {line}");
        if let Ok(mut notes) = self.notes.lock() {
            notes.push(line);
        }
    }

    pub(crate) fn notes(&self) -> Vec<String> {
        self.notes.lock().map(|n| n.clone()).unwrap_or_default()
    }
}

/// The payload of event `n`, padded with `pad` bytes.
fn payload(n: u64, pad: usize) -> serde_json::Value {
    json!({
        "n": n,
        "plan": "pro",
        "amount_cents": 1234,
        "customer_id": "cust_123456",
        "note": "x".repeat(pad),
    })
}

/// The padding that makes a message body [`MESSAGE_BYTES`] long.
pub(crate) fn pad() -> Result<usize> {
    let probe =
        Envelope::new(EVENT_TYPE, "bench", "entity_100", payload(10_000, 0))?.with_sequence(10_000);
    Ok(MESSAGE_BYTES.saturating_sub(probe.to_json()?.len()))
}

/// `n` events over `subjects` entities, with the sequence the relay would
/// give them in a fresh table (so a raw publish sends the relay's bytes).
pub(crate) fn envelopes(n: usize, subjects: usize, pad: usize) -> Result<Vec<Envelope>> {
    (0..n as u64)
        .map(|i| {
            Ok(Envelope::new(
                EVENT_TYPE,
                "bench",
                format!("entity_{}", i % subjects as u64),
                payload(i, pad),
            )?
            .with_sequence(i + 1))
        })
        .collect()
}

/// Writes `events` through the outbox in one statement, then vacuums, so
/// every mode starts from the same settled table.
pub(crate) async fn insert_events(pool: &PgPool, events: &[Envelope]) -> Result<()> {
    enqueue_events(pool, events).await?;
    vacuum(pool).await
}

/// Writes `events` through the outbox in one statement and commits; no
/// vacuum (for a relay reading the WAL, whose clock runs from the commit).
pub(crate) async fn enqueue_events(pool: &PgPool, events: &[Envelope]) -> Result<()> {
    let mut tx = pool.begin().await?;
    Outbox::unvalidated().enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(())
}

/// `rows` events shaped like [`envelopes`], written by the database in one
/// statement (a million envelopes would not fit the bench's memory
/// comfortably), then vacuumed.
pub(crate) async fn insert_series(
    pool: &PgPool,
    rows: usize,
    subjects: usize,
    pad: usize,
) -> Result<()> {
    insert_scheduled(pool, rows, subjects, pad, None).await
}

/// [`insert_series`] with `due_at` set to `due` on every row (scheduled
/// events, written in plain SQL; `None`: immediate ones), then vacuumed.
pub(crate) async fn insert_scheduled(
    pool: &PgPool,
    rows: usize,
    subjects: usize,
    pad: usize,
    due: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<()> {
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, due_at)
         select gen_random_uuid(), $4, 'bench', 'entity_' || (i % $2), now(),
                jsonb_build_object('n', i, 'plan', 'pro', 'amount_cents', 1234,
                                   'customer_id', 'cust_123456', 'note', repeat('x', $3)),
                $5
           from generate_series(0, $1 - 1) i",
    )
    .bind(i64::try_from(rows)?)
    .bind(i64::try_from(subjects)?)
    .bind(i32::try_from(pad)?)
    .bind(EVENT_TYPE)
    .bind(due)
    .execute(pool)
    .await?;
    vacuum(pool).await
}

pub(crate) async fn vacuum(pool: &PgPool) -> Result<()> {
    sqlx::query("vacuum analyze outbox_events")
        .execute(pool)
        .await?;
    Ok(())
}

/// Rows that should be published by now and are not: immediate rows, and
/// scheduled rows fallen due (rows scheduled later, or cancelled, are not
/// the relay's yet, or ever).
pub(crate) async fn unpublished(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "select count(*) from outbox_events
          where published_at is null and cancelled_at is null
            and (due_at is null or due_at <= now())",
    )
    .fetch_one(pool)
    .await?)
}

/// Waits (up to 30 s) until no row is unpublished: the stream can hold a
/// batch's messages before the relay has marked them.
pub(crate) async fn wait_marked(pool: &PgPool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = unpublished(pool).await?;
        if left == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(
                format!("{left} rows still unpublished 30 s after the stream was full").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Publishes each envelope on its event type with `Nats-Msg-Id`, up to 1,024
/// acks in flight, every PubAck awaited; returns how long that took.
pub(crate) async fn publish_all(js: &jetstream::Context, events: &[Envelope]) -> Result<Duration> {
    let bodies: Vec<(String, String, bytes::Bytes)> = events
        .iter()
        .map(|e| {
            Ok((
                e.event_type().as_str().to_owned(),
                e.id().to_string(),
                e.to_json()?.into(),
            ))
        })
        .collect::<Result<_, outbox_pg::Error>>()?;
    let started = Instant::now();
    let acks = futures::stream::iter(bodies)
        .map(|(subject, id, body)| async move {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", id.as_str());
            js.publish_with_headers(subject, headers, body).await?.await
        })
        .buffer_unordered(1_024)
        .collect::<Vec<_>>()
        .await;
    let elapsed = started.elapsed();
    for ack in acks {
        ack?;
    }
    Ok(elapsed)
}

/// A relay process ended on its own during a measurement.
#[derive(Debug)]
pub(crate) struct RelayDied(String);

impl std::fmt::Display for RelayDied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RelayDied {}

/// Runs one mode's measurement, and again (twice at most) if a relay process
/// ended on its own: the relays stop only on a signal, and the bench sends
/// none before a drain ends, so the run is void rather than slow. Each
/// attempt cleans up after itself.
pub(crate) async fn repeat_if_killed<T, F, Fut>(env: &Env, mut run: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 0;
    loop {
        match run().await {
            Err(e) if attempt < 2 && e.downcast_ref::<RelayDied>().is_some() => {
                attempt += 1;
                let first = e.to_string();
                let first = first.lines().next().unwrap_or_default();
                env.note(format!("run void and repeated: {first}"));
            }
            other => return other,
        }
    }
}

/// Polls `stream` every [`POLL`] until it holds `n` messages and returns the
/// samples (seconds since `started`, messages). `each` runs at every poll
/// (with the messages so far) and
/// stops the wait with its error; so does a relay that dies, or a stream
/// that gains nothing for a minute.
pub(crate) async fn wait_for_messages(
    env: &Env,
    stream: &str,
    n: usize,
    started: Instant,
    relays: &mut [RelayProc],
    mut each: impl FnMut(&[RelayProc], u64) -> Result<()>,
) -> Result<Vec<(f64, u64)>> {
    let mut samples = Vec::new();
    let mut last = (0, Instant::now());
    loop {
        let messages = env.stream_messages(stream).await?;
        samples.push((started.elapsed().as_secs_f64(), messages));
        if messages >= n as u64 {
            return Ok(samples);
        }
        if messages > last.0 {
            last = (messages, Instant::now());
        } else if last.1.elapsed() > STALL {
            return Err(format!("{stream}: {messages} of {n} messages, none for {STALL:?}").into());
        }
        for relay in relays.iter_mut() {
            if relay.died() {
                return Err(RelayDied(format!(
                    "{} exited at {messages} of {n} messages; its log:\n{}",
                    relay.name(),
                    relay.log_tail()
                ))
                .into());
            }
        }
        each(relays, messages)?;
        tokio::time::sleep(POLL).await;
    }
}

/// Rates over consecutive `window`s of a drain's samples, from the first
/// sample that shows a message (start-up excluded) to the last full window.
pub(crate) fn window_rates(samples: &[(f64, u64)], window: Duration) -> Vec<f64> {
    let Some(first) = samples.iter().position(|&(_, m)| m > 0) else {
        return Vec::new();
    };
    let samples = &samples[first..];
    let at = |t: f64| -> f64 {
        match samples.iter().position(|&(s, _)| s >= t) {
            None => samples.last().map_or(0.0, |&(_, m)| m as f64),
            Some(0) => samples[0].1 as f64,
            Some(i) => {
                let (t0, m0) = samples[i - 1];
                let (t1, m1) = samples[i];
                m0 as f64 + (m1 as f64 - m0 as f64) * (t - t0) / (t1 - t0)
            }
        }
    };
    let (start, end) = (samples[0].0, samples[samples.len() - 1].0);
    let w = window.as_secs_f64();
    let mut rates = Vec::new();
    let mut t = start;
    while t + w <= end {
        rates.push((at(t + w) - at(t)) / w);
        t += w;
    }
    rates
}

/// When the stream first held all but the last [`TAIL`] of `rows`, and
/// when it held them all: seconds since the start.
fn bulk_and_end(samples: &[(f64, u64)], rows: usize) -> (f64, f64) {
    let end = samples.last().map_or(0.0, |s| s.0);
    let mark = (rows as f64 * (1.0 - TAIL)).ceil() as u64;
    let bulk = samples.iter().find(|s| s.1 >= mark).map_or(end, |s| s.0);
    (bulk, end)
}

/// Seconds the last [`TAIL`] of `rows` took to reach the stream. A drain
/// whose rate holds to the end spends about that share of its time here.
pub(crate) fn tail_secs(samples: &[(f64, u64)], rows: usize) -> f64 {
    let (bulk, end) = bulk_and_end(samples, rows);
    end - bulk
}

/// Rows per second until all but the last [`TAIL`] were in the stream.
pub(crate) fn bulk_rate(samples: &[(f64, u64)], rows: usize) -> f64 {
    let (bulk, _) = bulk_and_end(samples, rows);
    rows as f64 * (1.0 - TAIL) / bulk
}

/// The relay's batch phases and publish count, summed over relays and rounds.
#[derive(Debug, Clone, Default)]
pub(crate) struct Phases {
    pub(crate) seconds: BTreeMap<String, f64>,
    pub(crate) batches: BTreeMap<String, f64>,
    /// Per phase, the batches that spent at most 100 ms in it (the
    /// histogram's `le="0.1"` bucket).
    pub(crate) within_100ms: BTreeMap<String, f64>,
    pub(crate) published: f64,
}

impl Phases {
    fn parse(text: &str) -> Self {
        let mut out = Self::default();
        for (name, labels, value) in samples(text) {
            let phase = labels
                .split_once("phase=\"")
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(p, _)| p.to_owned());
            match (name, phase) {
                ("outbox_relay_batch_phase_seconds_sum", Some(p)) => {
                    *out.seconds.entry(p).or_default() += value;
                }
                ("outbox_relay_batch_phase_seconds_count", Some(p)) => {
                    *out.batches.entry(p).or_default() += value;
                }
                ("outbox_relay_batch_phase_seconds_bucket", Some(p))
                    if labels.contains("le=\"0.1\"") =>
                {
                    *out.within_100ms.entry(p).or_default() += value;
                }
                ("outbox_relay_published_total", _) => out.published += value,
                _ => {}
            }
        }
        out
    }

    pub(crate) fn record(&mut self, phase: &str, took: Duration) {
        *self.seconds.entry(phase.to_owned()).or_default() += took.as_secs_f64();
        *self.batches.entry(phase.to_owned()).or_default() += 1.0;
    }

    pub(crate) fn add(&mut self, other: &Self) {
        for (k, v) in &other.seconds {
            *self.seconds.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.batches {
            *self.batches.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.within_100ms {
            *self.within_100ms.entry(k.clone()).or_default() += v;
        }
        self.published += other.published;
    }

    /// Batches that spent more than 100 ms in `phase` (0 when its buckets
    /// were not read).
    pub(crate) fn over_100ms(&self, phase: &str) -> f64 {
        match (self.batches.get(phase), self.within_100ms.get(phase)) {
            (Some(all), Some(fast)) => all - fast,
            _ => 0.0,
        }
    }

    /// Each phase's share of the time all phases took.
    pub(crate) fn share(&self, phase: &str) -> Option<f64> {
        let total: f64 = self.seconds.values().sum();
        let s = self.seconds.get(phase)?;
        (total > 0.0).then(|| s / total)
    }

    /// Mean time a claimed batch took through every phase, and rows per batch.
    pub(crate) fn per_batch(&self) -> Option<(Duration, f64)> {
        let batches = *self.batches.get("claim")?;
        if batches == 0.0 {
            return None;
        }
        let total: f64 = self.seconds.values().sum();
        Some((
            Duration::from_secs_f64(total / batches),
            self.published / batches,
        ))
    }
}

/// One `outbox-relay` process: default flags but for `--stream`,
/// `--subjects` and `--metrics-addr`.
#[derive(Debug)]
pub(crate) struct RelayProc {
    program: Program,
    metrics: SocketAddr,
    log: PathBuf,
}

impl RelayProc {
    pub(crate) async fn start(env: &Env, name: &str, db_url: &str, stream: &str) -> Result<Self> {
        Self::start_with_subjects(env, name, db_url, stream, SUBJECTS).await
    }

    /// [`RelayProc::start`] with `--subjects subjects` (comma-separated).
    pub(crate) async fn start_with_subjects(
        env: &Env,
        name: &str,
        db_url: &str,
        stream: &str,
        subjects: &str,
    ) -> Result<Self> {
        Self::start_with_args(env, name, db_url, stream, subjects, &[]).await
    }

    /// [`RelayProc::start_with_subjects`] with `extra` flags.
    pub(crate) async fn start_with_args(
        env: &Env,
        name: &str,
        db_url: &str,
        stream: &str,
        subjects: &str,
        extra: &[&str],
    ) -> Result<Self> {
        let bin = env.relay_bin.clone().ok_or_else(|| {
            format!(
                "{} is missing: cargo build --release -p outbox-publisher --features cli --bins",
                env.bin_dir.join("outbox-relay").display()
            )
        })?;
        let metrics = SocketAddr::from(([127, 0, 0, 1], outbox_testkit::free_port()?));
        let mut program = Program::new(name, bin, &env.logs)
            .env("DATABASE_URL", db_url)
            .env("NATS_URL", &env.nats_url)
            .args([
                "--stream",
                stream,
                "--subjects",
                subjects,
                "--metrics-addr",
                &metrics.to_string(),
            ])
            .args(extra.iter().copied());
        program.start().await?;
        Ok(Self {
            log: env.logs.join(format!("{name}.log")),
            program,
            metrics,
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.program.name
    }

    /// Where it serves `/metrics`.
    pub(crate) fn metrics(&self) -> SocketAddr {
        self.metrics
    }

    fn died(&mut self) -> bool {
        self.program.died()
    }

    /// `Err(RelayDied)` if the process ended on its own, saying `when`.
    pub(crate) fn check_alive(&mut self, when: &str) -> Result<()> {
        if self.died() {
            return Err(RelayDied(format!(
                "{} exited {when}; its log:\n{}",
                self.name(),
                self.log_tail()
            ))
            .into());
        }
        Ok(())
    }

    /// Waits (at most 60 s) until the process has logged `marker`.
    pub(crate) async fn wait_logged(&mut self, marker: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .contains(marker)
        {
            self.check_alive(&format!("before it logged {marker:?}"))?;
            if Instant::now() >= deadline {
                return Err(format!("{} did not log {marker:?} within 60 s", self.name()).into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The process id: our child whose command line names its metrics address.
    pub(crate) fn pid(&self) -> Option<u32> {
        let me = std::process::id();
        let needle = self.metrics.to_string();
        std::fs::read_dir("/proc")
            .ok()?
            .flatten()
            .find_map(|entry| {
                let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
                let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
                let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
                if ppid.parse::<u32>().ok()? != me {
                    return None;
                }
                let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
                String::from_utf8_lossy(&cmdline)
                    .contains(&needle)
                    .then_some(pid)
            })
    }

    /// Its `/metrics`, read now.
    pub(crate) async fn phases(&self) -> Result<Phases> {
        let body = scrape_metrics(self.metrics, self.name()).await?;
        Ok(Phases::parse(&body))
    }

    /// SIGTERM; notes a failed exit and every warning or error in its log
    /// (the start-up statement's warnings on the bench's one-replica streams
    /// are expected).
    pub(crate) async fn stop(mut self, env: &Env) {
        stop_noting(env, &mut self.program, &self.log, "durability:").await;
    }
}

/// SIGTERMs `program`; notes a failed exit and every warning or error line
/// of its `log` but those containing `expected`.
pub(crate) async fn stop_noting(env: &Env, program: &mut Program, log: &Path, expected: &str) {
    let code = program.terminate().await;
    if code != Some(0) {
        env.note(format!("{} exited with {code:?}", program.name));
    }
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let flagged: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .filter(|l| !l.contains(expected))
        .collect();
    if let Some(first) = flagged.first() {
        env.note(format!(
            "{}: {} warning/error lines in {}, first: {first}",
            program.name,
            flagged.len(),
            log.display()
        ));
    }
}

/// Stops every relay (see [`RelayProc::stop`]).
pub(crate) async fn stop_all(env: &Env, relays: Vec<RelayProc>) {
    for relay in relays {
        relay.stop(env).await;
    }
}

/// A drain by `replicas` relay processes of the `rows` already in `db`.
#[derive(Debug)]
pub(crate) struct Drain {
    /// From the first process's start until the stream held every row.
    pub(crate) elapsed: Duration,
    pub(crate) samples: Vec<(f64, u64)>,
    pub(crate) phases: Phases,
    /// CPU time by kind of process over the same window.
    pub(crate) cpu: crate::cpu::Use,
    /// Still running; stop them with [`stop_all`].
    pub(crate) relays: Vec<RelayProc>,
}

impl Drain {
    pub(crate) fn rate(&self, rows: usize) -> f64 {
        rows as f64 / self.elapsed.as_secs_f64()
    }

    /// See [`tail_secs`].
    pub(crate) fn tail(&self, rows: usize) -> f64 {
        tail_secs(&self.samples, rows)
    }

    /// See [`bulk_rate`].
    pub(crate) fn bulk_rate(&self, rows: usize) -> f64 {
        bulk_rate(&self.samples, rows)
    }
}

/// Starts `replicas` relays on `db` publishing into a new `stream`, waits
/// until every row is in the stream and marked, and reads their metrics.
pub(crate) async fn drain(
    env: &Env,
    db: &Db,
    stream: &str,
    rows: usize,
    replicas: usize,
    each: impl FnMut(&[RelayProc], u64) -> Result<()>,
) -> Result<Drain> {
    let started = Instant::now();
    let mut relays = Vec::with_capacity(replicas);
    for i in 0..replicas {
        relays.push(RelayProc::start(env, &format!("{stream}_relay{i}"), &db.url, stream).await?);
    }
    finish_drain(env, db, stream, rows, started, relays, each).await
}

/// Waits until `relays` have put `rows` messages in `stream` (timed from
/// `started`) and marked every row, then reads their metrics; stops them on
/// a failure.
pub(crate) async fn finish_drain(
    env: &Env,
    db: &Db,
    stream: &str,
    rows: usize,
    started: Instant,
    mut relays: Vec<RelayProc>,
    each: impl FnMut(&[RelayProc], u64) -> Result<()>,
) -> Result<Drain> {
    let cpu_from = crate::cpu::Sample::now();
    let samples = match wait_for_messages(env, stream, rows, started, &mut relays, each).await {
        Ok(samples) => samples,
        Err(e) => {
            stop_all(env, relays).await;
            return Err(e);
        }
    };
    let elapsed = started.elapsed();
    let cpu = crate::cpu::Sample::now().since(&cpu_from);
    wait_marked(&db.pool).await?;
    let messages = env.stream_messages(stream).await?;
    if messages != rows as u64 {
        env.note(format!("{stream}: {messages} messages for {rows} rows"));
    }
    let mut phases = Phases::default();
    for relay in &relays {
        phases.add(&relay.phases().await?);
    }
    Ok(Drain {
        elapsed,
        samples,
        phases,
        cpu,
        relays,
    })
}

/// The body of the Prometheus text served on `http://addr/metrics` by the
/// process `name`.
pub(crate) async fn scrape_metrics(addr: std::net::SocketAddr, name: &str) -> Result<String> {
    let mut conn =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await??;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut response)).await??;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP response from {name}'s /metrics"))?;
    if !head.lines().next().is_some_and(|l| l.contains(" 200")) {
        return Err(format!("{name}'s /metrics answered {head}").into());
    }
    Ok(body.to_owned())
}

/// The samples of a Prometheus text exposition: metric name, the label
/// text between the braces (empty without labels), value. Comments and lines
/// that do not parse are skipped.
pub(crate) fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let value = value.parse::<f64>().ok()?;
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            Some((name, labels, value))
        })
}

/// Starts one `outbox-relay --source wal` on `db` (default flags but the
/// source) publishing into a new `stream`, waits until it reads the WAL (its
/// slot made, the rows before it published), then runs `write` and waits
/// until every one of `rows` is in the stream and marked. The clock runs
/// from `write`'s return: its rows are committed, and a transaction's rows
/// are decoded only once it commits.
pub(crate) async fn wal_drain(
    env: &Env,
    db: &Db,
    stream: &str,
    rows: usize,
    write: impl std::future::Future<Output = Result<()>>,
    each: impl FnMut(&[RelayProc], u64) -> Result<()>,
) -> Result<Drain> {
    let mut relay = RelayProc::start_with_args(
        env,
        &format!("{stream}_wal"),
        &db.url,
        stream,
        SUBJECTS,
        &["--source", "wal"],
    )
    .await?;
    if let Err(e) = relay.wait_logged("reading the WAL").await {
        relay.stop(env).await;
        return Err(e);
    }
    let relays = vec![relay];
    if let Err(e) = write.await {
        stop_all(env, relays).await;
        return Err(e);
    }
    finish_drain(env, db, stream, rows, Instant::now(), relays, each).await
}

/// Drops `db`'s replication slots, made by a WAL relay: a database with one
/// cannot be dropped. A relay that just exited may leave its walsender a
/// moment behind, holding the slot: waited for (up to 10 s).
pub(crate) async fn drop_slots(db: &Db) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dropped = sqlx::query(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots
              where database = current_database()",
        )
        .execute(&db.pool)
        .await;
        match dropped {
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("55006") && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other.map(drop).map_err(Into::into),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_from_prometheus_text() {
        // As outbox-relay serves it: a histogram with buckets.
        let text = "# TYPE outbox_relay_batch_phase_seconds histogram\n\
            outbox_relay_batch_phase_seconds_bucket{phase=\"claim\",le=\"0.1\"} 7\n\
            outbox_relay_batch_phase_seconds_bucket{phase=\"claim\",le=\"0.25\"} 10\n\
            outbox_relay_batch_phase_seconds_bucket{phase=\"claim\",le=\"+Inf\"} 10\n\
            outbox_relay_batch_phase_seconds_sum{phase=\"claim\"} 1.5\n\
            outbox_relay_batch_phase_seconds_count{phase=\"claim\"} 10\n\
            outbox_relay_batch_phase_seconds_sum{phase=\"publish\"} 4.5\n\
            outbox_relay_published_total{event_type=\"bench.created\"} 2000\n";
        let p = Phases::parse(text);
        assert_eq!(p.seconds["claim"], 1.5);
        assert_eq!(p.batches["claim"], 10.0);
        assert_eq!(p.published, 2000.0);
        assert_eq!(p.share("publish"), Some(0.75));
        assert_eq!(p.over_100ms("claim"), 3.0);
        let (per, rows) = p.per_batch().unwrap();
        assert_eq!((per.as_millis(), rows), (600, 200.0));
    }

    #[test]
    fn the_tail_is_the_time_of_the_last_rows() {
        let samples = [(0.0, 0), (1.0, 90), (2.0, 95), (3.0, 99), (4.0, 100)];
        assert_eq!(tail_secs(&samples, 100), 2.0);
        assert_eq!(bulk_rate(&samples, 100), 47.5);
    }

    #[test]
    fn windows_skip_start_up_and_the_partial_tail() {
        let samples: Vec<(f64, u64)> = (0..=50)
            .map(|i: u32| {
                (
                    f64::from(i) * 0.1,
                    if i < 10 { 0 } else { u64::from(i - 10) * 100 },
                )
            })
            .collect();
        let rates = window_rates(&samples, Duration::from_secs(1));
        assert_eq!(rates.len(), 3);
        assert!(rates.iter().all(|r| (r - 1000.0).abs() < 1e-6));
    }
}
