//! `outboxctl inbox owners | set-owner`: which role owns each consumer name.
//!
//! Row-level security (migration `20260101000013_inbox_isolation.sql`) lets
//! a consumer's role read and write only the inbox rows, dead letters, lease
//! and registration of the consumers whose owner (`inbox_consumers.owner`)
//! it is a member of. The runtime's first registration of a name claims it
//! for the role it runs under; `set-owner` claims a name before its consumer
//! first starts (with `--stream`), or hands one over to another role (a group
//! role shared by replicas under several login roles). It runs as the
//! tables' owner, whom row security does not apply to.
//!
//! `--json`:
//!
//! ```text
//! owners:    {"consumers": [{"consumer": "billing", "owner": "billing_login",
//!                            "owner_exists": true, "stream": "OUTBOX",
//!                            "filter_subjects": ["subscription.created"],
//!                            "created_at": "…"}]}
//! set-owner: {"consumer": "billing", "owner": "billing_consumers",
//!             "previous_owner": "billing_login" | null, "registered": false}
//! ```

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{self, Report};

/// The table the owners are recorded in.
const TABLE: &str = "inbox_consumers";

/// Flags of `outboxctl inbox owners`.
#[derive(Debug, clap::Args)]
pub(crate) struct ListArgs {
    /// Only this consumer (durable name).
    #[arg(long, value_name = "C")]
    consumer: Option<String>,
}

/// Flags of `outboxctl inbox set-owner`.
#[derive(Debug, clap::Args)]
pub(crate) struct SetArgs {
    /// The consumer (durable name).
    consumer: String,

    /// The role to own it: its login role, or a group role granted to each
    /// login role its replicas run under.
    role: String,

    /// The stream the consumer reads: registers a name its runtime has not
    /// registered yet, so that no other role claims it first.
    #[arg(long, value_name = "STREAM")]
    stream: Option<String>,
}

#[derive(Debug, Serialize)]
struct Owners {
    consumers: Vec<Owned>,
}

#[derive(Debug, Serialize)]
struct Owned {
    consumer: String,
    owner: String,
    owner_exists: bool,
    stream: String,
    filter_subjects: Vec<String>,
    created_at: DateTime<Utc>,
}

#[derive(Debug, Serialize)]
struct Changed {
    consumer: String,
    owner: String,
    previous_owner: Option<String>,
    registered: bool,
}

pub(crate) async fn list(db: &Database, args: &ListArgs, json: bool) -> Result<()> {
    let pool = db.connect_as_owner(&[TABLE]).await?;
    let consumers = sqlx::query_file!("queries/inbox_owners.sql", args.consumer.as_deref())
        .fetch_all(&pool)
        .await
        .map_err(|e| Error::database("reading the consumers' owners", e))?
        .into_iter()
        .map(|r| Owned {
            consumer: r.consumer,
            owner: r.owner,
            owner_exists: r.owner_exists,
            stream: r.stream,
            filter_subjects: r.filter_subjects,
            created_at: r.created_at,
        })
        .collect::<Vec<_>>();
    if let (Some(consumer), true) = (&args.consumer, consumers.is_empty()) {
        return Err(not_registered(consumer));
    }
    output::print(&Owners { consumers }, json)
}

pub(crate) async fn set(db: &Database, args: &SetArgs, json: bool) -> Result<()> {
    let pool = db.connect_as_owner(&[TABLE]).await?;
    check_role(&pool, args).await?;
    let mut tx = pool
        .begin()
        .await
        .map_err(|e| Error::database("beginning the change", e))?;
    let previous: Option<String> =
        sqlx::query_file_scalar!("queries/inbox_owner_lock.sql", &args.consumer)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| Error::database("reading the consumer's owner", e))?;
    let registered = match (&previous, &args.stream) {
        (Some(_), _) => {
            change_owner(&mut tx, args).await?;
            false
        }
        (None, Some(stream)) => {
            register(&mut tx, args, stream).await?;
            true
        }
        (None, None) => {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "consumer `{}` is not registered (its runtime never started): pass \
                     --stream <STREAM> to register it for role `{}` now",
                    args.consumer, args.role
                ),
            ));
        }
    };
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the change", e))?;
    let changed = Changed {
        consumer: args.consumer.clone(),
        owner: args.role.clone(),
        previous_owner: previous,
        registered,
    };
    output::print(&changed, json)
}

/// Refuses a role that does not exist, or one every consumer's role is a
/// member of (owning a consumer, it would give every consumer its rows).
async fn check_role(pool: &sqlx::PgPool, args: &SetArgs) -> Result<()> {
    let role = sqlx::query_file!("queries/role_for_owner.sql", &args.role)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("looking the role up", e))?;
    if !role.exists {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("role `{}` does not exist", args.role),
        ));
    }
    if role.shared {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "role `{}` has every consumer's role (each member of outbox_consumer) as a \
                 member: owning `{}`, it would give every consumer that consumer's rows; give \
                 it a role of its own",
                args.role, args.consumer
            ),
        ));
    }
    Ok(())
}

/// Hands the registered consumer over to the role.
async fn change_owner(tx: &mut sqlx::PgConnection, args: &SetArgs) -> Result<()> {
    sqlx::query_file!("queries/inbox_owner_set.sql", &args.consumer, &args.role)
        .execute(&mut *tx)
        .await
        .map_err(|e| Error::database("changing the consumer's owner", e))?;
    Ok(())
}

/// Registers the consumer, on `stream`, for the role; refused if its
/// runtime registered it meanwhile.
async fn register(tx: &mut sqlx::PgConnection, args: &SetArgs, stream: &str) -> Result<()> {
    let done = sqlx::query_file!(
        "queries/inbox_owner_register.sql",
        &args.consumer,
        &args.role,
        stream
    )
    .execute(&mut *tx)
    .await
    .map_err(|e| Error::database("registering the consumer", e))?;
    if done.rows_affected() == 0 {
        return Err(Error::new(
            ErrorKind::InvalidState,
            format!(
                "consumer `{}` was registered meanwhile (its runtime started): run \
                 set-owner again to hand it over",
                args.consumer
            ),
        ));
    }
    Ok(())
}

fn not_registered(consumer: &str) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("consumer `{consumer}` is not registered in {TABLE}"),
    )
}

impl Report for Owners {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.consumers.is_empty() {
            return writeln!(out, "no consumers registered");
        }
        let mut rows = vec![
            [
                "consumer",
                "owner",
                "stream",
                "filter subjects",
                "registered",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for c in &self.consumers {
            rows.push(vec![
                c.consumer.clone(),
                if c.owner_exists {
                    c.owner.clone()
                } else {
                    format!("{} (no such role)", c.owner)
                },
                c.stream.clone(),
                if c.filter_subjects.is_empty() {
                    "-".to_owned()
                } else {
                    c.filter_subjects.join(",")
                },
                when(Some(c.created_at)),
            ]);
        }
        output::table(out, &rows)
    }
}

impl Report for Changed {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        match (&self.previous_owner, self.registered) {
            (_, true) => writeln!(
                out,
                "consumer `{}` registered, owned by `{}`",
                self.consumer, self.owner
            ),
            (Some(previous), _) if *previous == self.owner => writeln!(
                out,
                "consumer `{}` is owned by `{}` already",
                self.consumer, self.owner
            ),
            (Some(previous), _) => writeln!(
                out,
                "consumer `{}` now owned by `{}` (was `{previous}`); a runtime of it still \
                 running under `{previous}` has its writes refused until it runs under `{}`",
                self.consumer, self.owner, self.owner
            ),
            (None, false) => writeln!(
                out,
                "consumer `{}` owned by `{}`",
                self.consumer, self.owner
            ),
        }
    }
}
