//! Readiness reports: which dependency of a process answered and which did
//! not, and why.
//!
//! The relay (`outbox_publisher::Readiness`) and the consumer runtime
//! (`inbox_consumer::Readiness`) each check their own dependencies — the
//! database, the NATS connection, the stream, the durable consumer — and
//! return a [`Report`]. Serve it wherever your process answers probes: the
//! shipped binaries answer `GET /readyz` with 200 and the report's
//! [`to_json`](Report::to_json) when [`Report::is_ready`], 503 otherwise:
//!
//! ```json
//! {"checks":{"broker":{"error":"not connected to NATS (state: disconnected)","ok":false},"database":{"ok":true}},"ready":false}
//! ```

use std::fmt;
use std::future::Future;
use std::time::Duration;

use sqlx::{Connection, PgPool};

/// The default bound on each check: 2 s.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// `database`: a connection from `pool` answers a ping within `timeout`.
///
/// A failure is named in a few plain words ([`database_failure`]), not with
/// the driver's text: a report is served to whoever can reach the probe
/// endpoint.
pub async fn database(pool: &PgPool, timeout: Duration) -> Check {
    let ping = async {
        let mut conn = pool.acquire().await?;
        conn.ping().await
    };
    match tokio::time::timeout(timeout, ping).await {
        Ok(Ok(())) => Check::passed("database"),
        Ok(Err(e)) => Check::failed("database", database_failure(&e)),
        Err(_) => Check::failed(
            "database",
            format!(
                "the database did not answer within {}",
                crate::HumanDuration(timeout)
            ),
        ),
    }
}

/// Why a database round trip failed, in a few words and without the
/// driver's text: the kind of failure (unreachable, TLS, login refused, …)
/// and for a server error its SQLSTATE.
pub fn database_failure(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Io(_) => "cannot reach the database server".to_owned(),
        sqlx::Error::Tls(_) => "the TLS handshake with the database server failed".to_owned(),
        sqlx::Error::PoolTimedOut => {
            "no database connection within the pool's acquire timeout".to_owned()
        }
        sqlx::Error::PoolClosed => "the connection pool is closed".to_owned(),
        sqlx::Error::Protocol(_) => "the database server broke the protocol".to_owned(),
        sqlx::Error::Configuration(_) => "the connection settings are invalid".to_owned(),
        sqlx::Error::Database(e) => match e.code().as_deref() {
            Some("28P01" | "28000") => "the database server refused the login".to_owned(),
            Some("3D000") => "the database does not exist".to_owned(),
            Some("53300") => "the database server has no connection slot left".to_owned(),
            Some("57P01" | "57P02" | "57P03") => {
                "the database server is shutting down or starting up".to_owned()
            }
            Some(code) => format!("the database server answered with an error (SQLSTATE {code})"),
            None => "the database server answered with an error".to_owned(),
        },
        _ => "the database did not answer".to_owned(),
    }
}

/// Something that checks whether a process is ready: the libraries'
/// `Readiness` types, or a service's own. The binaries' `/readyz` runs it
/// once per request.
pub trait Probe: Send + Sync + 'static {
    /// Runs the checks, each bounded in time by the implementation.
    fn check(&self) -> impl Future<Output = Report> + Send;
}

/// The result of one check: passed, or failed with a message naming what is
/// wrong. The message is served as is (`/readyz`): keep it plain, without a
/// driver's error text or anything a client was configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    name: &'static str,
    error: Option<String>,
}

impl Check {
    /// A check named `name` that passed.
    pub fn passed(name: &'static str) -> Self {
        Self { name, error: None }
    }

    /// A check named `name` that failed with `error`.
    pub fn failed(name: &'static str, error: impl fmt::Display) -> Self {
        Self {
            name,
            error: Some(error.to_string()),
        }
    }

    /// The check's name (`database`, `broker`, `stream`, `consumer`, …).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether it passed.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Why it failed.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }
}

/// Checks in the order they ran; ready when every one passed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    checks: Vec<Check>,
}

impl Report {
    /// An empty report (ready: nothing failed).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `check`, replacing an earlier check of the same name.
    #[must_use]
    pub fn with(mut self, check: Check) -> Self {
        self.push(check);
        self
    }

    /// Adds `check`, replacing an earlier check of the same name.
    pub fn push(&mut self, check: Check) {
        match self.checks.iter_mut().find(|c| c.name == check.name) {
            Some(existing) => *existing = check,
            None => self.checks.push(check),
        }
    }

    /// Adds every check of `other`.
    #[must_use]
    pub fn merge(mut self, other: Report) -> Self {
        for check in other.checks {
            self.push(check);
        }
        self
    }

    /// Whether every check passed.
    pub fn is_ready(&self) -> bool {
        self.checks.iter().all(Check::ok)
    }

    /// The checks.
    pub fn checks(&self) -> &[Check] {
        &self.checks
    }

    /// The check named `name`.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// The checks that failed.
    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.ok())
    }

    /// `{"ready": bool, "checks": {name: {"ok": bool, "error"?: string}}}`.
    pub fn to_json(&self) -> serde_json::Value {
        let checks: serde_json::Map<String, serde_json::Value> = self
            .checks
            .iter()
            .map(|c| {
                let mut body = serde_json::Map::new();
                body.insert("ok".into(), c.ok().into());
                if let Some(e) = &c.error {
                    body.insert("error".into(), e.as_str().into());
                }
                (c.name.to_owned(), body.into())
            })
            .collect();
        let mut report = serde_json::Map::new();
        report.insert("ready".into(), self.is_ready().into());
        report.insert("checks".into(), checks.into());
        report.into()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ready() {
            return f.write_str("ready");
        }
        f.write_str("not ready:")?;
        for (i, check) in self.failures().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(
                f,
                "{sep}{}: {}",
                check.name,
                check.error().unwrap_or_default()
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_failures_are_named_without_the_drivers_text() {
        let io = sqlx::Error::Io(std::io::Error::other("connect to 10.0.0.7:5432 as relay"));
        assert_eq!(database_failure(&io), "cannot reach the database server");
        let config = sqlx::Error::Configuration("postgres://relay:Zq7,Wm3@db".into());
        let shown = database_failure(&config);
        assert!(
            !shown.contains("Zq7") && !shown.contains("relay"),
            "{shown}"
        );
        assert_eq!(
            database_failure(&sqlx::Error::PoolTimedOut),
            "no database connection within the pool's acquire timeout"
        );
    }

    #[test]
    fn ready_only_when_every_check_passed() {
        let report = Report::new()
            .with(Check::passed("database"))
            .with(Check::failed("broker", "not connected"));
        assert!(!report.is_ready());
        assert_eq!(report.to_string(), "not ready: broker: not connected");
        assert_eq!(
            report.to_json(),
            serde_json::json!({"ready": false, "checks": {
                "database": {"ok": true},
                "broker": {"ok": false, "error": "not connected"},
            }})
        );
        let report = report.with(Check::passed("broker"));
        assert!(report.is_ready());
        assert_eq!(report.checks().len(), 2);
    }
}
