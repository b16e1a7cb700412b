//! The JetStream stream the relay publishes into: created from the
//! configuration, or verified against it.

use std::time::Duration;

use async_nats::jetstream::{
    self,
    context::GetStreamErrorKind,
    stream::{Config, StorageType},
};

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
        }
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

    fn create_config(&self) -> Config {
        Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            storage: self.storage.unwrap_or(StorageType::File),
            num_replicas: self.replicas.unwrap_or(1),
            duplicate_window: self.duplicate_window.unwrap_or(DEFAULT_DUPLICATE_WINDOW),
            ..Default::default()
        }
    }

    /// What differs between this spec and an existing stream's config.
    fn mismatches(&self, existing: &Config) -> Vec<String> {
        let mut out = Vec::new();
        let missing: Vec<&String> = self
            .subjects
            .iter()
            .filter(|s| !existing.subjects.contains(s))
            .collect();
        if !missing.is_empty() {
            out.push(format!(
                "subjects {missing:?} are not among the stream's {:?}",
                existing.subjects
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
                "duplicate window is {:?}, configured {d:?}",
                existing.duplicate_window
            ));
        }
        if existing.duplicate_window.is_zero() {
            out.push(
                "the stream has no duplicate window, so republishes would be stored twice".into(),
            );
        }
        out
    }

    /// Creates the stream if it does not exist, or checks that the existing one
    /// matches this spec.
    ///
    /// # Errors
    /// [`ErrorKind::Stream`] if the stream differs from the spec (every
    /// difference is named), does not exist and no subjects were given, or
    /// cannot be created; [`ErrorKind::Broker`] if JetStream cannot be reached.
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
                let problems = self.mismatches(&info.config);
                if problems.is_empty() {
                    Ok(info.config.clone())
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
                let config = self.create_config();
                js.create_stream(config.clone()).await.map_err(|e| {
                    Error::new(
                        ErrorKind::Stream,
                        format!("creating stream `{}`: {e}", self.name),
                    )
                    .with_source(e)
                })?;
                Ok(config)
            }
            Err(e) => Err(Error::new(
                ErrorKind::Broker,
                format!("looking up stream `{}`: {e}", self.name),
            )
            .with_source(e)),
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
}
