//! The load: HTTP requests against the subscriptions service, a mix of valid,
//! invalid, rolled-back and cancelling requests, some creations with a trial
//! and some conversions of a trial to paid before it runs out.
//!
//! Each worker owns a slice of the customers, so the requests of one customer
//! are sequential and commit in the order they were made.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::Mutex;

/// What the requests came back with. Ids are the service's answers; the
/// databases are checked against them afterwards.
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    pub(crate) accepted: Vec<String>,
    pub(crate) rolled_back: Vec<String>,
    pub(crate) cancelled: Vec<String>,
    /// Accepted with a trial (also in `accepted`).
    pub(crate) trials: Vec<String>,
    /// Trials converted to paid (`200`): their scheduled end was cancelled.
    pub(crate) converted: Vec<String>,
    /// Conversions refused because the trial had ended (`409`): the
    /// scheduled end was published, or on its way.
    pub(crate) too_late: Vec<String>,
    pub(crate) rejected: u64,
    /// No usable answer (a 5xx other than the injected rollback, a dropped
    /// connection): the databases say whether it committed.
    pub(crate) failed: u64,
}

/// Shared counters for the progress line.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub(crate) issued: AtomicU64,
    pub(crate) accepted: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) rolled_back: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) converted: AtomicU64,
    pub(crate) failed: AtomicU64,
}

/// How much load, and of what kind.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    pub(crate) base_url: String,
    pub(crate) requests: Option<u64>,
    pub(crate) until: Option<Instant>,
    pub(crate) workers: usize,
    pub(crate) customers: usize,
    pub(crate) invalid_rate: f64,
    pub(crate) rollback_rate: f64,
    pub(crate) cancel_rate: f64,
    /// Share of creations (rolled back ones included) with a trial.
    pub(crate) trial_rate: f64,
    /// Share of requests that convert a trial of the worker's to paid.
    pub(crate) convert_rate: f64,
    pub(crate) seed: u64,
    /// Requests per second over all clients; `None` as fast as they answer.
    pub(crate) rate: Option<f64>,
    /// When the load began (the rate's time base).
    pub(crate) started: Instant,
}

impl Load {
    /// Takes the next request slot, waiting for its turn when the load is
    /// rate-limited; `false` when the load is over.
    async fn more(&self, progress: &Progress, started: Instant) -> bool {
        if self.until.is_some_and(|t| Instant::now() >= t) {
            return false;
        }
        let index = progress.issued.fetch_add(1, Ordering::Relaxed);
        if self.requests.is_some_and(|n| index >= n) {
            return false;
        }
        if let Some(rate) = self.rate.filter(|r| *r > 0.0) {
            let due = started + Duration::from_secs_f64(index as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        self.until.is_none_or(|t| Instant::now() < t)
    }
}

/// Runs the load to completion.
pub(crate) async fn drive(load: Load, progress: Arc<Progress>) -> Outcomes {
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .pool_max_idle_per_host(load.workers)
        .build()
        .unwrap_or_default();
    let mut workers = Vec::new();
    for w in 0..load.workers {
        let load = load.clone();
        let client = client.clone();
        let progress = progress.clone();
        let outcomes = outcomes.clone();
        workers.push(tokio::spawn(async move {
            worker(w, load, client, progress, outcomes).await;
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    match Arc::try_unwrap(outcomes) {
        Ok(m) => m.into_inner(),
        Err(shared) => std::mem::take(&mut *shared.lock().await),
    }
}

async fn worker(
    w: usize,
    load: Load,
    client: reqwest::Client,
    progress: Arc<Progress>,
    outcomes: Arc<Mutex<Outcomes>>,
) {
    let mut rng = StdRng::seed_from_u64(load.seed.wrapping_add(w as u64 * 7919));
    let customers: Vec<String> = (0..load.customers)
        .filter(|c| c % load.workers == w)
        .map(|c| format!("cust_{c}"))
        .collect();
    if customers.is_empty() {
        return;
    }
    let mut active: Vec<String> = Vec::new();
    // Subscriptions with a trial not converted yet (it may have run out).
    let mut trialing: Vec<String> = Vec::new();
    let started = load.started;
    let (invalid_to, rollback_to) = (load.invalid_rate, load.invalid_rate + load.rollback_rate);
    let cancel_to = rollback_to + load.cancel_rate;
    let convert_to = cancel_to + load.convert_rate;
    while load.more(&progress, started).await {
        let customer = &customers[rng.random_range(0..customers.len())];
        let roll: f64 = rng.random();
        let trial = rng.random_bool(load.trial_rate.clamp(0.0, 1.0));
        if roll < invalid_to {
            invalid(&client, &load.base_url, &mut rng, &progress, &outcomes).await;
        } else if roll < rollback_to {
            rollback(
                &client,
                &load.base_url,
                customer,
                trial,
                &progress,
                &outcomes,
            )
            .await;
        } else if roll < cancel_to && !active.is_empty() {
            let id = active.swap_remove(rng.random_range(0..active.len()));
            trialing.retain(|t| *t != id);
            cancel(&client, &load.base_url, id, &progress, &outcomes).await;
        } else if (cancel_to..convert_to).contains(&roll) && !trialing.is_empty() {
            // Mostly the newest trial, converted in time; sometimes any,
            // which may have run out (the service then answers 409).
            let id = if rng.random_bool(0.8) {
                trialing.pop()
            } else {
                Some(trialing.swap_remove(rng.random_range(0..trialing.len())))
            };
            if let Some(id) = id {
                convert(&client, &load.base_url, id, &progress, &outcomes).await;
            }
        } else if let Some(id) = create(
            &client,
            &load.base_url,
            customer,
            trial,
            &mut rng,
            &progress,
            &outcomes,
        )
        .await
        {
            if trial {
                trialing.push(id.clone());
            }
            active.push(id);
        }
    }
}

fn plan(rng: &mut StdRng) -> &'static str {
    ["basic", "pro", "team"][rng.random_range(0..3)]
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> Option<(u16, Value)> {
    let mut req = client.post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(body) = body {
        req = req.json(body);
    }
    let resp = req.send().await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    Some((status, body))
}

async fn create(
    client: &reqwest::Client,
    base: &str,
    customer: &str,
    trial: bool,
    rng: &mut StdRng,
    progress: &Progress,
    outcomes: &Mutex<Outcomes>,
) -> Option<String> {
    let body = json!({"customer_id": customer, "plan": plan(rng), "amount_cents": rng.random_range(100..100_000), "trial": trial});
    match post(
        client,
        &format!("{base}/v1/subscriptions"),
        Some(&body),
        &[],
    )
    .await
    {
        Some((201, resp)) => {
            let id = resp["id"].as_str()?.to_owned();
            progress.accepted.fetch_add(1, Ordering::Relaxed);
            let mut outcomes = outcomes.lock().await;
            outcomes.accepted.push(id.clone());
            if trial {
                outcomes.trials.push(id.clone());
            }
            Some(id)
        }
        _ => {
            progress.failed.fetch_add(1, Ordering::Relaxed);
            outcomes.lock().await.failed += 1;
            None
        }
    }
}

async fn rollback(
    client: &reqwest::Client,
    base: &str,
    customer: &str,
    trial: bool,
    progress: &Progress,
    outcomes: &Mutex<Outcomes>,
) {
    let body = json!({"customer_id": customer, "plan": "pro", "amount_cents": 999, "trial": trial});
    match post(
        client,
        &format!("{base}/v1/subscriptions"),
        Some(&body),
        &[("x-fault", "rollback")],
    )
    .await
    {
        Some((500, resp)) if resp["id"].is_string() => {
            progress.rolled_back.fetch_add(1, Ordering::Relaxed);
            let id = resp["id"].as_str().unwrap_or_default().to_owned();
            outcomes.lock().await.rolled_back.push(id);
        }
        _ => {
            progress.failed.fetch_add(1, Ordering::Relaxed);
            outcomes.lock().await.failed += 1;
        }
    }
}

async fn cancel(
    client: &reqwest::Client,
    base: &str,
    id: String,
    progress: &Progress,
    outcomes: &Mutex<Outcomes>,
) {
    match post(
        client,
        &format!("{base}/v1/subscriptions/{id}/cancel"),
        None,
        &[],
    )
    .await
    {
        Some((200, _)) => {
            progress.cancelled.fetch_add(1, Ordering::Relaxed);
            outcomes.lock().await.cancelled.push(id);
        }
        _ => {
            progress.failed.fetch_add(1, Ordering::Relaxed);
            outcomes.lock().await.failed += 1;
        }
    }
}

/// Converts a trial to paid: `200` cancelled its scheduled end, `409` found
/// the trial ended (its end published, or on its way).
async fn convert(
    client: &reqwest::Client,
    base: &str,
    id: String,
    progress: &Progress,
    outcomes: &Mutex<Outcomes>,
) {
    let answer = post(
        client,
        &format!("{base}/v1/subscriptions/{id}/convert"),
        None,
        &[],
    )
    .await;
    match answer {
        Some((200, _)) => {
            progress.converted.fetch_add(1, Ordering::Relaxed);
            outcomes.lock().await.converted.push(id);
        }
        Some((409, body))
            if body["error"]
                .as_str()
                .is_some_and(|e| e.contains("already ended its trial")) =>
        {
            outcomes.lock().await.too_late.push(id);
        }
        _ => {
            progress.failed.fetch_add(1, Ordering::Relaxed);
            outcomes.lock().await.failed += 1;
        }
    }
}

/// A request the service must refuse with 422. Where the body still has a
/// customer id, it starts with `invalid_`, so the check can prove nothing of
/// it was written.
async fn invalid(
    client: &reqwest::Client,
    base: &str,
    rng: &mut StdRng,
    progress: &Progress,
    outcomes: &Mutex<Outcomes>,
) {
    let url = format!("{base}/v1/subscriptions");
    let kind = rng.random_range(0..5);
    let result = if kind == 0 {
        // Not JSON at all.
        client
            .post(&url)
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await
            .ok()
            .map(|r| r.status().as_u16())
    } else {
        let body = match kind {
            1 => json!({"customer_id": "invalid_neg", "plan": "pro", "amount_cents": -5}),
            2 => json!({"customer_id": "invalid_noplan", "amount_cents": 5}),
            3 => json!({"customer_id": "invalid_type", "plan": "pro", "amount_cents": "12"}),
            _ => json!({"customer_id": "invalid_empty", "plan": "", "amount_cents": 5}),
        };
        post(client, &url, Some(&body), &[]).await.map(|(s, _)| s)
    };
    if result == Some(422) {
        progress.rejected.fetch_add(1, Ordering::Relaxed);
        outcomes.lock().await.rejected += 1;
    } else {
        progress.failed.fetch_add(1, Ordering::Relaxed);
        outcomes.lock().await.failed += 1;
    }
}
