//! Namespaces: several outboxes in one database.
//!
//! The tables are never schema-qualified: each service finds them through its
//! `search_path`, so one database can hold any number of outboxes, one per
//! schema (a tenant each, with relays and consumers of its own). What the
//! components coordinate on through the database, beyond the tables, is
//! database-wide in PostgreSQL: advisory locks and NOTIFY channels. Each is
//! therefore keyed by the schema that holds the table it serves, so outboxes
//! in one database never see each other:
//!
//! | what | in `public` (as before namespaces) | in schema `S` |
//! |---|---|---|
//! | relays' member locks | `(0x6f62_7201, workers)` | `(hashtext('outbox_relay.members:S'), workers)` |
//! | relays' shard locks | `(0x6f62_7202, shard)` | `(hashtext('outbox_relay.shards:S'), shard)` |
//! | wake-up channel | `outbox_events` | `outbox_events.S` (hashed when over 63 bytes) |
//! | scheduled events' wake-up channel | `outbox_events_due` | `outbox_events_due.S` (hashed when over 63 bytes) |
//! | ordered consumers' leader, fence and subject locks | `hashtext('inbox_consumer.leader')`, … | `hashtext('inbox_consumer.leader:S')`, … |
//! | the migration lock taken by [`migrate`](crate::migrate) | `(1868721409, 0)` | `(1868721409, hashtext('S'))` |
//!
//! The outbox in `public` keeps the keys it always had, so relays of an
//! earlier build and of this one share shards correctly during a rolling
//! upgrade. Each migration file also takes `(1868721409, 0)` for its own
//! transaction (the files cannot change once released), so migrations of two
//! schemas wait for each other for the length of one file; nothing else is
//! shared.

use sqlx::PgExecutor;

use crate::error::{Error, Result};

/// First key of the relays' member locks of the outbox in `public`.
const PUBLIC_MEMBERS_KEY: i32 = 0x6f62_7201;
/// First key of the relays' shard locks of the outbox in `public`.
const PUBLIC_SHARDS_KEY: i32 = 0x6f62_7202;

/// The outbox a connection's `search_path` leads to, and the names its
/// components coordinate on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    schema: String,
    members_key: i32,
    shards_key: i32,
    channel: String,
    due_channel: String,
}

impl Namespace {
    /// The namespace of the schema holding `table` (`outbox_events`, or an
    /// inbox table), as the connection's `search_path` finds it; `None` if it finds
    /// no such table.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) if the lookup fails.
    pub async fn of_table<'e, E>(executor: E, table: &str) -> Result<Option<Self>>
    where
        E: PgExecutor<'e>,
    {
        let row = sqlx::query_file!(
            "queries/namespace.sql",
            table,
            PUBLIC_MEMBERS_KEY,
            PUBLIC_SHARDS_KEY
        )
        .fetch_optional(executor)
        .await
        .map_err(|e| Error::database(&format!("looking up the schema of {table}"), e))?;
        Ok(row.map(|r| Self {
            schema: r.schema,
            members_key: r.members_key,
            shards_key: r.shards_key,
            channel: r.channel,
            due_channel: r.due_channel,
        }))
    }

    /// The schema holding the table.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// First key of the relays' shared member locks (the second is the
    /// relay's worker count).
    pub fn relay_members_key(&self) -> i32 {
        self.members_key
    }

    /// First key of the relays' shard ownership locks (the second is the
    /// shard).
    pub fn relay_shards_key(&self) -> i32 {
        self.shards_key
    }

    /// The channel the outbox's insert trigger notifies on.
    pub fn notify_channel(&self) -> &str {
        &self.channel
    }

    /// The channel the outbox's trigger notifies on when a transaction
    /// schedules events (`outbox_events_due`, or `outbox_events_due.S`):
    /// the relay's due lane listens on it, and hears nothing of immediate
    /// events.
    pub fn due_channel(&self) -> &str {
        &self.due_channel
    }
}
