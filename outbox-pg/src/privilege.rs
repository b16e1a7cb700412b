//! Least privilege: the rights a component needs on the outbox's tables,
//! checked once at start-up so that a role missing one fails at once with an
//! error naming the role, each missing privilege and its object, instead of
//! failing later, row by row.
//!
//! `ops/sql/roles.sql` creates three group roles, each granted exactly what
//! one component needs: `outbox_writer` (a service enqueuing events),
//! `outbox_relay` (the relay) and `outbox_consumer` (an inbox consumer). A
//! login role is made a member (`grant outbox_relay to relay_login`). The
//! relay ([`outbox_publisher`'s `Relay`]) and the consumer runtime
//! (`inbox_consumer::Consumer::new`) call [`check_privileges`] with what
//! their configuration uses; a service that only writes may call it with
//! [`WRITER`].
//!
//! [`outbox_publisher`'s `Relay`]: https://docs.rs/outbox-publisher

use sqlx::PgPool;

use crate::error::{Error, ErrorKind, Result};

pub use crate::failure::{INSUFFICIENT_PRIVILEGE, is_insufficient_privilege};

/// What a privilege is held on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ObjectKind {
    /// A table (`has_table_privilege`).
    Table,
    /// A sequence (`has_sequence_privilege`).
    Sequence,
    /// At least one column of a table (`has_any_column_privilege`): what a
    /// row lock (`FOR UPDATE`) needs of UPDATE, granted on one column only.
    AnyColumn,
}

impl ObjectKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Table => "table",
            Self::Sequence => "sequence",
            Self::AnyColumn => "a column of table",
        }
    }
}

/// One privilege a component needs: `UPDATE` on table `outbox_events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Privilege {
    /// The object's name, unqualified: it is found through the `search_path`,
    /// as every query of the library finds it.
    pub object: &'static str,
    /// Table or sequence.
    pub kind: ObjectKind,
    /// `SELECT`, `INSERT`, `UPDATE`, `DELETE` (tables, columns); `USAGE`,
    /// `SELECT` (sequences).
    pub privilege: &'static str,
}

impl Privilege {
    /// `privilege` on table `object`.
    pub const fn table(object: &'static str, privilege: &'static str) -> Self {
        Self {
            object,
            kind: ObjectKind::Table,
            privilege,
        }
    }

    /// `privilege` on at least one column of table `object`.
    pub const fn any_column(object: &'static str, privilege: &'static str) -> Self {
        Self {
            object,
            kind: ObjectKind::AnyColumn,
            privilege,
        }
    }

    /// `privilege` on sequence `object`.
    pub const fn sequence(object: &'static str, privilege: &'static str) -> Self {
        Self {
            object,
            kind: ObjectKind::Sequence,
            privilege,
        }
    }
}

/// What a writer needs: `INSERT` on `outbox_events`, and `USAGE` on
/// `outbox_events_seq`, whose `nextval` the insert trigger calls as the
/// inserting role.
pub const WRITER: &[Privilege] = &[
    Privilege::table("outbox_events", "INSERT"),
    Privilege::sequence("outbox_events_seq", "USAGE"),
];

/// Checks that the current role holds every privilege in `required`.
///
/// An object that does not exist (yet) is not checked: the component reports
/// it when it first uses it, and a relay started before the migrations waits
/// for them.
///
/// # Errors
/// [`ErrorKind::Privilege`] naming the role, each missing privilege and its
/// object, and `group` (the role of `ops/sql/roles.sql` that grants them):
/// "role `relay_login` lacks UPDATE on table outbox_events; grant it
/// outbox_relay (ops/sql/roles.sql)". [`ErrorKind::Database`] if the check
/// itself cannot run (the database is not reachable).
pub async fn check_privileges(pool: &PgPool, required: &[Privilege], group: &str) -> Result<()> {
    if required.is_empty() {
        return Ok(());
    }
    let objects: Vec<&str> = required.iter().map(|p| p.object).collect();
    let kinds: Vec<&str> = required.iter().map(|p| p.kind.as_str()).collect();
    let privileges: Vec<&str> = required.iter().map(|p| p.privilege).collect();
    let rows = sqlx::query_file!(
        "queries/check_privileges.sql",
        &objects as &[&str],
        &kinds as &[&str],
        &privileges as &[&str],
    )
    .fetch_all(pool)
    .await
    .map_err(|e| Error::database("checking the role's privileges", e))?;
    let Some(role) = rows.first().map(|r| r.role.clone()) else {
        return Ok(());
    };
    let missing: Vec<String> = rows
        .iter()
        .filter(|r| r.granted == Some(false))
        .map(|r| format!("{} on {} {}", r.privilege, r.kind, r.object))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Privilege,
        format!(
            "role `{role}` lacks {}; grant it {group} (ops/sql/roles.sql)",
            missing.join(", ")
        ),
    ))
}

/// [`check_privileges`] at a component's start-up, where the database may not
/// answer yet: bounded by `timeout`, and only a missing privilege is an
/// error. A check that cannot run (no answer in time, a failed statement)
/// passes with the reason, for the caller to log: the component then waits
/// for its database as it always does.
///
/// # Errors
/// [`ErrorKind::Privilege`], as [`check_privileges`].
pub async fn check_privileges_at_start(
    pool: &PgPool,
    required: &[Privilege],
    group: &str,
    timeout: std::time::Duration,
) -> Result<Option<String>> {
    match tokio::time::timeout(timeout, check_privileges(pool, required, group)).await {
        Ok(Ok(())) => Ok(None),
        Ok(Err(e)) if e.kind() == ErrorKind::Privilege => Err(e),
        Ok(Err(e)) => Ok(Some(e.to_string())),
        Err(_) => Ok(Some(format!(
            "the database did not answer within {}",
            crate::HumanDuration(timeout)
        ))),
    }
}
