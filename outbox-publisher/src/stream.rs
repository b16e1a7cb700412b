//! The JetStream stream the relay publishes into: created from the
//! configuration, or verified against it (with
//! [`StreamSpec::add_subjects`], given subjects it lacks are added to it).

use std::time::Duration;

use async_nats::jetstream::{
    self,
    context::{CreateStreamErrorKind, GetStreamErrorKind},
    stream::{Config, StorageType},
};
use outbox_pg::HumanDuration;
use tracing::info;

use crate::error::{Error, ErrorKind, Result};

/// The stream the relay expects. Settings left `None` are taken from an
/// existing stream as they are; settings given must match it.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    name: String,
    subjects: Vec<String>,
    storage: Option<StorageType>,
    replicas: Option<usize>,
    duplicate_window: Option<Duration>,
    add_subjects: bool,
}

/// Duplicate window used when the relay creates the stream: a republish after a
/// relay crash is dropped within it.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

impl StreamSpec {
    /// A stream named `name` capturing `subjects` (may be empty to use an
    /// existing stream whatever its subjects).
    pub fn new(name: impl Into<String>, subjects: Vec<String>) -> Self {
        Self {
            name: name.into(),
            subjects,
            storage: None,
            replicas: None,
            duplicate_window: None,
            add_subjects: false,
        }
    }

    /// Adds the given subjects an existing stream does not capture to it
    /// (keeping every subject it has) instead of refusing it. Default off:
    /// the mismatch is an error that says what to run.
    #[must_use]
    pub fn add_subjects(mut self, on: bool) -> Self {
        self.add_subjects = on;
        self
    }

    /// Requires file or memory storage (created with file storage by default).
    #[must_use]
    pub fn storage(mut self, storage: StorageType) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Requires this many replicas (created with 1 by default).
    #[must_use]
    pub fn replicas(mut self, n: usize) -> Self {
        self.replicas = Some(n);
        self
    }

    /// Requires this duplicate window (created with [`DEFAULT_DUPLICATE_WINDOW`]).
    #[must_use]
    pub fn duplicate_window(mut self, d: Duration) -> Self {
        self.duplicate_window = Some(d);
        self
    }

    /// The stream name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The config the relay creates the stream with; `atomic` (the server
    /// is 2.12 or later) turns on atomic batch publishing, with which the
    /// relay publishes one entity's rows without an ack per row.
    fn create_config(&self, atomic: bool) -> Config {
        Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            storage: self.storage.unwrap_or(StorageType::File),
            num_replicas: self.replicas.unwrap_or(1),
            duplicate_window: self.duplicate_window.unwrap_or(DEFAULT_DUPLICATE_WINDOW),
            allow_atomic_publish: atomic,
            ..Default::default()
        }
    }

    /// The given subjects the existing stream does not capture: neither one
    /// of its subjects nor covered by one of its wildcards.
    fn missing_subjects(&self, existing: &Config) -> Vec<String> {
        self.subjects
            .iter()
            .filter(|s| !existing.subjects.iter().any(|f| covers(f, s)))
            .cloned()
            .collect()
    }

    /// What differs between this spec and an existing stream's config,
    /// the subjects it lacks first.
    fn mismatches(&self, existing: &Config) -> Vec<String> {
        let mut out = Vec::new();
        let missing = self.missing_subjects(existing);
        if !missing.is_empty() {
            out.push(format!(
                "subjects {missing:?} are not among the stream's {:?}; add them: `{}` \
                 (or start the relay with --add-subjects to add them itself); rows of those \
                 types wait meanwhile and are published once the stream captures them \
                 (rows an earlier relay parked as not captured: `outboxctl retry --all-stuck`)",
                existing.subjects,
                edit_command(existing, &missing)
            ));
        }
        if let Some(storage) = self.storage
            && storage != existing.storage
        {
            out.push(format!(
                "storage is {:?}, configured {storage:?}",
                existing.storage
            ));
        }
        if let Some(n) = self.replicas
            && n != existing.num_replicas
        {
            out.push(format!(
                "replicas are {}, configured {n}",
                existing.num_replicas
            ));
        }
        if let Some(d) = self.duplicate_window
            && d != existing.duplicate_window
        {
            out.push(format!(
                "duplicate window is {}, configured {}",
                HumanDuration(existing.duplicate_window),
                HumanDuration(d)
            ));
        }
        if existing.duplicate_window.is_zero() {
            out.push(
                "the stream has no duplicate window, so republishes would be stored twice".into(),
            );
        }
        out
    }

    /// Adds the given subjects the existing stream lacks to it, keeping all
    /// of its own, and returns its new config.
    async fn add_missing(&self, js: &jetstream::Context, existing: Config) -> Result<Config> {
        let missing = self.missing_subjects(&existing);
        if missing.is_empty() {
            return Ok(existing);
        }
        let command = edit_command(&existing, &missing);
        let mut config = existing;
        let before = config.subjects.clone();
        config.subjects.extend(missing.iter().cloned());
        let info = js.update_stream(&config).await.map_err(|e| {
            // No answer is the broker's state (waited for); a refusal is not.
            let kind = match e.kind() {
                CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => {
                    ErrorKind::Broker
                }
                _ => ErrorKind::Stream,
            };
            Error::new(
                kind,
                format!(
                    "adding subjects {missing:?} to stream `{}`: {e}; add them by hand: `{command}`",
                    self.name
                ),
            )
            .with_source(e)
        })?;
        info!(
            stream = %self.name,
            added = ?missing,
            before = ?before,
            subjects = ?info.config.subjects,
            "added the missing subjects to the stream (--add-subjects)"
        );
        Ok(info.config)
    }

    /// Creates the stream if it does not exist, or checks that the existing one
    /// matches this spec; with [`add_subjects`](Self::add_subjects), adds
    /// the given subjects it lacks first.
    ///
    /// # Errors
    /// [`ErrorKind::Stream`] if the stream differs from the spec (every
    /// difference is named; subjects it lacks with the `nats stream edit`
    /// command that adds them), does not exist and no subjects were given,
    /// or cannot be created or updated; [`ErrorKind::Broker`] if JetStream
    /// cannot be reached.
    pub async fn ensure(&self, js: &jetstream::Context) -> Result<Config> {
        match js.get_stream(&self.name).await {
            Ok(mut stream) => {
                let info = stream.info().await.map_err(|e| {
                    Error::new(
                        ErrorKind::Broker,
                        format!("reading stream `{}`: {e}", self.name),
                    )
                    .with_source(e)
                })?;
                let existing = if self.add_subjects {
                    self.add_missing(js, info.config.clone()).await?
                } else {
                    info.config.clone()
                };
                let problems = self.mismatches(&existing);
                if problems.is_empty() {
                    if !existing.allow_atomic_publish
                        && supports_atomic_batches(&js.client().server_info().version)
                    {
                        info!(
                            stream = %self.name,
                            "the stream does not allow atomic batches (allow_atomic): the rows of \
                             one entity are published one at a time, an ack awaited for each; \
                             turn allow_atomic on in its config to publish them in batches"
                        );
                    }
                    Ok(existing)
                } else {
                    Err(Error::new(
                        ErrorKind::Stream,
                        format!(
                            "stream `{}` does not match the configuration: {}",
                            self.name,
                            problems.join("; ")
                        ),
                    ))
                }
            }
            Err(e) if is_not_found(&e) => {
                if self.subjects.is_empty() {
                    return Err(Error::new(
                        ErrorKind::Stream,
                        format!(
                            "stream `{}` does not exist; give its subjects (--subjects) to create it",
                            self.name
                        ),
                    ));
                }
                let atomic = supports_atomic_batches(&js.client().server_info().version);
                let stream = js
                    .create_stream(self.create_config(atomic))
                    .await
                    .map_err(|e| {
                        Error::new(
                            ErrorKind::Stream,
                            format!("creating stream `{}`: {e}", self.name),
                        )
                        .with_source(e)
                    })?;
                // As the server filled it in (unlimited limits as -1, …).
                Ok(stream.cached_info().config.clone())
            }
            Err(e) => Err(Error::new(
                ErrorKind::Broker,
                format!("looking up stream `{}`: {e}", self.name),
            )
            .with_source(e)),
        }
    }
}

/// Whether a nats-server of `version` ("2.12.0", "2.15.1-beta") knows
/// atomic batch publishing (2.12 and later); an unreadable version does not.
pub(crate) fn supports_atomic_batches(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= (2, 12),
        _ => false,
    }
}

/// What to run so that the stream of `existing` captures `added` too: the
/// `nats stream edit` command with the full new list of subjects.
pub(crate) fn edit_command(existing: &Config, added: &[String]) -> String {
    let all: Vec<&str> = existing
        .subjects
        .iter()
        .chain(added)
        .map(String::as_str)
        .collect();
    format!(
        "nats stream edit {} --subjects '{}'",
        existing.name,
        all.join(",")
    )
}

/// Whether NATS subject `subject` matches `filter` (`*` one token, `>` the rest).
pub(crate) fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether every subject `pattern` (itself a filter, wildcards allowed)
/// matches is matched by `filter`: `orders.>` covers `orders.created` and
/// `orders.*`, not `orders` or `>`.
pub(crate) fn covers(filter: &str, pattern: &str) -> bool {
    let mut f = filter.split('.');
    let mut p = pattern.split('.');
    loop {
        match (f.next(), p.next()) {
            (Some(">"), Some(_)) => return true,
            (Some(_), Some(">")) => return false,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

pub(crate) fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(js)
        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_batches_from_2_12() {
        for v in ["2.12.0", "2.15.1", "v2.14.0-RC.1", "3.0.0"] {
            assert!(supports_atomic_batches(v), "{v}");
        }
        for v in ["2.9.25", "2.11.9", "", "dev"] {
            assert!(!supports_atomic_batches(v), "{v}");
        }
    }

    #[test]
    fn every_mismatch_is_named() {
        let existing = Config {
            name: "S".into(),
            subjects: vec!["a.>".into()],
            storage: StorageType::Memory,
            num_replicas: 1,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        let spec = StreamSpec::new("S", vec!["a.>".into(), "b.>".into()])
            .storage(StorageType::File)
            .replicas(3)
            .duplicate_window(Duration::from_secs(60));
        let problems = spec.mismatches(&existing);
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert!(problems[0].contains("b.>"));
        assert!(
            problems[0].contains("`nats stream edit S --subjects 'a.>,b.>'`"),
            "{problems:?}"
        );
        assert!(problems[0].contains("--add-subjects"), "{problems:?}");
        assert!(
            problems[0].contains("outboxctl retry --all-stuck"),
            "{problems:?}"
        );
        // A subject the stream's wildcard covers is not missing.
        assert!(
            StreamSpec::new("S", vec!["a.b".into(), "a.*".into()])
                .mismatches(&existing)
                .is_empty()
        );
        assert!(
            StreamSpec::new("S", vec!["a.>".into()])
                .mismatches(&existing)
                .is_empty()
        );
        assert!(
            StreamSpec::new("S", vec![])
                .mismatches(&existing)
                .is_empty()
        );
    }

    #[test]
    fn filters_match_like_nats() {
        assert!(subject_matches("a.>", "a.b"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.c"));
        assert!(subject_matches(">", "x.y"));
    }

    #[test]
    fn a_filter_covers_the_patterns_whose_subjects_it_all_matches() {
        assert!(covers("a.>", "a.b"));
        assert!(covers("a.>", "a.*"));
        assert!(covers("a.>", "a.>"));
        assert!(covers("a.*", "a.*"));
        assert!(covers("a.*", "a.b"));
        assert!(covers(">", "a.>"));
        assert!(!covers("a.*", "a.>"));
        assert!(!covers("a.b", "a.*"));
        assert!(!covers("a.>", "a"));
        assert!(!covers("a.>", ">"));
        assert!(!covers("order.>", "orders.>"));
    }
}
