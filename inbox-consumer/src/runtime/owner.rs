//! Who may run a consumer: the role that owns its name.
//!
//! Every consumer of a database shares the inbox tables, and every
//! consumer's role is a member of `outbox_consumer`, which may write them.
//! Row-level security (migration `20260101000013_inbox_isolation.sql`) keeps
//! them apart: a session sees and writes the rows of a consumer only when its
//! role is a member of the consumer's owner (`inbox_consumers.owner`). The
//! first registration of a name claims it: the runtime's row in
//! `inbox_consumers` ([`position::record`]) takes the role it runs under as
//! its owner (the column's default, `current_user`). A runtime under a role
//! that does not own its name would see none of its consumer's rows and have
//! every inbox insert refused, message after message; it refuses to start
//! instead, naming the consumer, the owner and its own role.
//!
//! A session not subject to row security (the tables' owner, a superuser)
//! sees every row and may run any consumer.

use std::time::Duration;

use sqlx::PgPool;

use super::config::ConsumerConfig;
use super::position;
use crate::error::{Error, ErrorKind, Result};

/// Before the consumer is registered: refuses a name another role owns. A
/// name not registered yet passes (the registration claims it), and so does
/// one whose owner cannot be read (the check after the registration,
/// [`require_owned`], tells). Bounded by `timeout`; a check that cannot run
/// passes with the reason, for the caller to log.
///
/// # Errors
/// [`ErrorKind::Privilege`] when another role owns the name, naming the
/// consumer, the owner and the role.
pub(crate) async fn check_at_start(
    pool: &PgPool,
    consumer: &str,
    timeout: Duration,
) -> Result<Option<String>> {
    let checked = async {
        let seen = visible(pool, consumer).await?;
        if seen.visible {
            return Ok(None);
        }
        match owner(pool, consumer).await {
            Owner::Unregistered => Ok(None),
            Owner::Unknown(why) => Ok(Some(format!(
                "cannot tell who owns consumer `{consumer}`: {why}"
            ))),
            // A replica started at the same moment may have registered the
            // name between the two reads: look again before refusing.
            _ if visible(pool, consumer).await?.visible => Ok(None),
            owner => Err(refusal(consumer, &owner, &seen.role)),
        }
    };
    match tokio::time::timeout(timeout, checked).await {
        Ok(Ok(passed)) => Ok(passed),
        Ok(Err(e)) if e.kind() == ErrorKind::Privilege && is_refusal(&e) => Err(e),
        Ok(Err(e)) => Ok(Some(e.to_string())),
        Err(_) => Ok(Some(format!(
            "the database did not answer within {}",
            outbox_pg::HumanDuration(timeout)
        ))),
    }
}

/// After the consumer's registration was written (or refused): the session
/// must see its row, so its role owns the name.
///
/// # Errors
/// [`ErrorKind::Privilege`] when it does not, naming the consumer, the owner
/// and the role; [`ErrorKind::Database`] if the check cannot run.
pub(crate) async fn require_owned(pool: &PgPool, consumer: &str) -> Result<()> {
    let seen = visible(pool, consumer).await?;
    if seen.visible {
        return Ok(());
    }
    Err(refusal(consumer, &owner(pool, consumer).await, &seen.role))
}

/// Before consuming: registers the consumer if it is not (its registration at
/// start could not be written: the lag task would write it later, and until
/// then every inbox write is refused), then [`require_owned`].
///
/// # Errors
/// As [`require_owned`]; [`ErrorKind::Database`] if the registration cannot
/// be written for another reason than the name being another role's.
pub(crate) async fn claim(pool: &PgPool, config: &ConsumerConfig) -> Result<()> {
    if visible(pool, &config.durable).await?.visible {
        return Ok(());
    }
    // Floor 0: the durable exists by now, and a higher recorded floor is kept.
    // Another role's row refuses the write (row-level security): told below.
    if let Err(e) = position::record(pool, config, 0).await
        && e.kind() != ErrorKind::Privilege
    {
        return Err(e);
    }
    require_owned(pool, &config.durable).await
}

/// [`claim`], bounded by `timeout`; a claim that cannot run passes with the
/// reason, for the caller to log and try again.
///
/// # Errors
/// [`ErrorKind::Privilege`] when another role owns the name.
pub(crate) async fn claim_within(
    pool: &PgPool,
    config: &ConsumerConfig,
    timeout: Duration,
) -> Result<Option<String>> {
    match tokio::time::timeout(timeout, claim(pool, config)).await {
        Ok(Ok(())) => Ok(None),
        Ok(Err(e)) if is_refusal(&e) => Err(e),
        Ok(Err(e)) => Ok(Some(e.to_string())),
        Err(_) => Ok(Some(format!(
            "the database did not answer within {}",
            outbox_pg::HumanDuration(timeout)
        ))),
    }
}

struct Visible {
    visible: bool,
    role: String,
}

async fn visible(pool: &PgPool, consumer: &str) -> Result<Visible> {
    let row = sqlx::query_file!("queries/consumer_visible.sql", consumer)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database(&format!("reading consumer `{consumer}`'s owner"), e))?;
    Ok(Visible {
        visible: row.visible,
        role: row.role,
    })
}

/// The owner of a name the session's role does not see.
#[derive(Debug)]
enum Owner {
    /// A role that exists.
    Role(String),
    /// A role that no longer exists: no session owns the name.
    Dropped(String),
    /// No row: the name is not registered.
    Unregistered,
    /// It could not be read (why).
    Unknown(String),
}

async fn owner(pool: &PgPool, consumer: &str) -> Owner {
    sqlx::query_file!("queries/consumer_owner.sql", consumer)
        .fetch_one(pool)
        .await
        .map_or_else(
            |e| Owner::Unknown(e.to_string()),
            |row| match row.owner {
                Some(owner) if row.exists => Owner::Role(owner),
                Some(owner) => Owner::Dropped(owner),
                None => Owner::Unregistered,
            },
        )
}

/// The marker of a refusal's message, telling it from a statement refused
/// for want of a grant (both [`ErrorKind::Privilege`]).
const REFUSED: &str = "may neither read nor write that consumer's inbox rows";

fn is_refusal(e: &Error) -> bool {
    e.kind() == ErrorKind::Privilege && e.to_string().contains(REFUSED)
}

fn refusal(consumer: &str, owner: &Owner, role: &str) -> Error {
    let hand_over = format!(
        "or, if the name is to be this role's, have the schema owner hand it over: \
         `outboxctl inbox set-owner {consumer} {role}`"
    );
    let message = match owner {
        Owner::Role(owner) => format!(
            "consumer `{consumer}` is owned by role `{owner}`, and role `{role}` is not a member \
             of it: it {REFUSED}. Run the consumer under `{owner}` (or a role granted it), or \
             give it a durable name of its own, {hand_over}"
        ),
        Owner::Dropped(owner) => format!(
            "consumer `{consumer}` is owned by role `{owner}`, which no longer exists, so role \
             `{role}` {REFUSED}: {hand_over}"
        ),
        Owner::Unregistered | Owner::Unknown(_) => format!(
            "consumer `{consumer}` is owned by another role than `{role}` (which one could not \
             be read{}; grant outbox_consumer, ops/sql/roles.sql), so role `{role}` {REFUSED}: \
             run the consumer under its owner, {hand_over}",
            match owner {
                Owner::Unknown(why) => format!(": {why}"),
                _ => String::new(),
            }
        ),
    };
    Error::new(ErrorKind::Privilege, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_consumer_its_owner_the_role_and_the_way_out() {
        let e = refusal(
            "shipping",
            &Owner::Role("shipping_login".into()),
            "billing_login",
        );
        assert!(is_refusal(&e));
        let text = e.to_string();
        for needle in [
            "consumer `shipping`",
            "owned by role `shipping_login`",
            "role `billing_login` is not a member",
            "outboxctl inbox set-owner shipping billing_login",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        let e = refusal("shipping", &Owner::Dropped("gone".into()), "billing_login");
        assert!(is_refusal(&e));
        assert!(
            e.to_string().contains("`gone`, which no longer exists"),
            "{e}"
        );
        let e = refusal(
            "shipping",
            &Owner::Unknown("permission denied".into()),
            "billing_login",
        );
        assert!(is_refusal(&e));
        let text = e.to_string();
        assert!(
            text.contains("another role than `billing_login`")
                && text.contains("permission denied"),
            "{text}"
        );
    }
}
