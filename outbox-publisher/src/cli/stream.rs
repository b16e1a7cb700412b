//! The stream flags (`--stream`, `--subjects`, and what an existing stream
//! must match): [`StreamArgs`], flattened into every binary that runs a
//! relay, builds the [`StreamSpec`] it publishes into.

use std::time::Duration;

use crate::{StorageType, StreamSpec};

/// The JetStream stream a relay publishes into, as flags and environment
/// variables. `#[command(flatten)]` it into a binary's arguments and hand
/// [`spec`](Self::spec) to the relay.
///
/// ```
/// use clap::Parser;
/// use outbox_publisher::cli::StreamArgs;
///
/// #[derive(Debug, Parser)]
/// struct Args {
///     #[command(flatten)]
///     stream: StreamArgs,
/// }
///
/// let args = Args::try_parse_from(["app", "--stream", "ORDERS", "--subjects", "orders.>,refunds.>"])?;
/// assert_eq!(args.stream.name(), "ORDERS");
/// assert_eq!(args.stream.subjects(), ["orders.>", "refunds.>"]);
/// # Ok::<(), clap::Error>(())
/// ```
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// JetStream stream to publish into (created if missing and --subjects is given).
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    stream: String,

    /// Subjects the stream captures, comma-separated (e.g. 'subscription.>,invoice.>').
    #[arg(long, env = "OUTBOX_SUBJECTS", value_delimiter = ',')]
    subjects: Vec<String>,

    /// Add the --subjects an existing stream lacks to it (keeping all of its
    /// own) instead of refusing to start; without it the refusal names the
    /// `nats stream edit` command that adds them.
    #[arg(long, env = "OUTBOX_ADD_SUBJECTS")]
    add_subjects: bool,

    /// Required stream storage (file or memory); new streams use file.
    #[arg(long, value_enum)]
    stream_storage: Option<Storage>,

    /// Required stream replicas; new streams use 1.
    #[arg(long)]
    stream_replicas: Option<usize>,

    /// Required stream duplicate window (e.g. 2m); new streams use 2m.
    #[arg(long, value_parser = humantime::parse_duration)]
    duplicate_window: Option<Duration>,
}

/// The values of `--stream-storage`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Storage {
    File,
    Memory,
}

impl From<Storage> for StorageType {
    fn from(storage: Storage) -> Self {
        match storage {
            Storage::File => StorageType::File,
            Storage::Memory => StorageType::Memory,
        }
    }
}

impl StreamArgs {
    /// The stream's name (`--stream`).
    pub fn name(&self) -> &str {
        &self.stream
    }

    /// The subjects the stream captures (`--subjects`).
    pub fn subjects(&self) -> &[String] {
        &self.subjects
    }

    /// The stream the relay expects: the name and subjects, and the storage,
    /// replicas and duplicate window an existing stream must match where
    /// given.
    pub fn spec(&self) -> StreamSpec {
        let mut spec = StreamSpec::new(self.stream.clone(), self.subjects.clone())
            .add_subjects(self.add_subjects);
        if let Some(storage) = self.stream_storage {
            spec = spec.storage(storage.into());
        }
        if let Some(n) = self.stream_replicas {
            spec = spec.replicas(n);
        }
        if let Some(d) = self.duplicate_window {
            spec = spec.duplicate_window(d);
        }
        spec
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    #[command(mut_arg("subjects", |a| a.default_value("orders.>,refunds.>")))]
    struct Args {
        #[command(flatten)]
        stream: StreamArgs,
    }

    fn parse(args: &[&str]) -> StreamArgs {
        let argv = std::iter::once("app").chain(args.iter().copied());
        match Args::try_parse_from(argv) {
            Ok(args) => args.stream,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_binary_may_give_the_subjects_a_default() {
        let stream = parse(&[]);
        assert_eq!(stream.name(), "OUTBOX");
        assert_eq!(stream.subjects(), ["orders.>", "refunds.>"]);
        assert_eq!(parse(&["--subjects", "a.>"]).subjects(), ["a.>"]);
    }

    #[test]
    fn what_an_existing_stream_must_match_is_optional() {
        let stream = parse(&[]);
        assert!(!stream.add_subjects);
        assert!(stream.stream_storage.is_none() && stream.stream_replicas.is_none());
        let stream = parse(&[
            "--stream-storage",
            "memory",
            "--stream-replicas",
            "3",
            "--duplicate-window",
            "5m",
            "--add-subjects",
        ]);
        assert!(stream.add_subjects);
        assert!(matches!(stream.stream_storage, Some(Storage::Memory)));
        assert_eq!(stream.stream_replicas, Some(3));
        assert_eq!(stream.duplicate_window, Some(Duration::from_secs(300)));
        assert_eq!(stream.spec().name(), "OUTBOX");
    }
}
