//! Where new rows come from, as flags: [`SourceArgs`] (`--source poll|wal`,
//! `--wal-slot`, `--wal-url`) sets the source of a [`RelayConfig`].

use outbox_pg::connect::{DatabaseArgs, ExposeSecret, Secret};

use crate::{RelayConfig, Result, WalSource};

/// The relay's source of new rows, as flags and environment variables.
/// `#[command(flatten)]` it into a binary's arguments beside
/// [`RelayArgs`](super::RelayArgs) and pass the configuration through
/// [`apply`](Self::apply).
#[derive(Debug, Clone, clap::Args)]
pub struct SourceArgs {
    /// Where new rows come from: `poll` claims them from the table (any
    /// number of replicas share the work); `wal` reads them from a logical
    /// replication slot (needs wal_level=logical and a role with
    /// REPLICATION; one replica leads, the others stand by). Rows written
    /// before the slot, and those of a slot that was lost, go through the
    /// polling path first.
    #[arg(long, env = "OUTBOX_SOURCE", value_enum, default_value = "poll")]
    source: Source,

    /// With --source wal: the replication slot's (and publication's) name.
    /// Default outbox_relay_<database>_<schema>.
    #[arg(long, env = "OUTBOX_WAL_SLOT", value_name = "NAME")]
    wal_slot: Option<String>,

    /// With --source wal: the PostgreSQL URL of the replication connection
    /// (same database and role rules as DATABASE_URL). Give the server's own
    /// address when DATABASE_URL goes through a pooler: PgBouncer does not
    /// carry the replication protocol. Default: the database URL.
    #[arg(
        long,
        env = "OUTBOX_WAL_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    wal_url: Option<Secret>,
}

/// The values of `--source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Source {
    Poll,
    Wal,
}

impl SourceArgs {
    /// `config` reading new rows as the flags say: unchanged for `poll`;
    /// for `wal`, from the slot `--wal-slot` through `--wal-url`, else
    /// through `database`'s URL.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) if the replication
    /// connection's URL cannot be read (`database`'s errors) or is not one
    /// the WAL source takes ([`WalSource::from_url`]).
    pub fn apply(&self, config: RelayConfig, database: &DatabaseArgs) -> Result<RelayConfig> {
        Ok(match self.wal(database)? {
            Some(wal) => config.source_wal(wal),
            None => config,
        })
    }

    /// The WAL source the flags name, or `None` with `--source poll`.
    fn wal(&self, database: &DatabaseArgs) -> Result<Option<WalSource>> {
        if self.source == Source::Poll {
            return Ok(None);
        }
        let url = match &self.wal_url {
            Some(url) => url.clone(),
            None => database.url()?,
        };
        let wal = WalSource::from_url(url.expose_secret())?;
        Ok(Some(match &self.wal_slot {
            Some(slot) => wal.slot(slot.clone()),
            None => wal,
        }))
    }
}
