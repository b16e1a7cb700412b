//! [`Dedupe`] as a batch service: several deliveries, one transaction.
//!
//! Per batch it begins one transaction, writes every delivery's inbox row in
//! one statement (`insert … select from unnest(…) on conflict do nothing
//! returning event_id`), runs the inner service on each delivery that is not a
//! duplicate, in the batch's order, passing the transaction along, and commits
//! once. A delivery whose inner service fails loses the transaction (it rolls
//! back): that delivery is set aside with its error, and the batch runs again
//! without it, so one failure never fails the others. The runtime then handles
//! each failed delivery alone. Duplicates, inside the batch or already in the
//! inbox, skip their handler as in single mode.
//!
//! A batch needs its inner service to state whether it keeps groups
//! ([`GroupBatching`]: a [`Router`](crate::Router), as
//! [`Consumer::builder`](crate::Consumer::builder) and `billing` build it, or
//! a service stated to keep none, such as [`Ungrouped`](crate::Ungrouped)).
//! When it gives a group route for an event type (a router's type routed to
//! a [`BatchHandler`](crate::BatchHandler)), the batch's fresh deliveries of
//! that type go to it together, in one call, at the place of the first of
//! them (their subjects are distinct, so no subject's order changes). A group of one that fails is set aside as
//! above; a larger group that fails fails the batch as a whole (which of its
//! events caused it is not known), so the runtime handles each delivery
//! alone, where the handler gets a group of one.

use std::collections::HashSet;
use std::task::{Context, Poll};

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use sqlx::{PgPool, PgTransaction};
use tower::{Service, ServiceExt};
use uuid::Uuid;

use super::{Dedupe, begin_tx, commit, note_duplicate};
use crate::delivery::{BatchResults, Delivery, InTx, Outcome};
use crate::error::{BoxError, Error, ErrorKind};
use crate::grouping::GroupBatching;
use crate::ordering::sequence_column;

impl<S> Service<Vec<Delivery>> for Dedupe<S>
where
    S: Service<InTx<Delivery>, Response = InTx<Outcome>> + GroupBatching + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = BatchResults;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<BatchResults, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, deliveries: Vec<Delivery>) -> Self::Future {
        // The ready service goes into the future; the clone stays for next time.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (pool, begin) = (self.pool.clone(), self.timeouts.begin_statement());
        Box::pin(handle(inner, pool, begin, deliveries))
    }
}

/// A delivery to write and handle: its index in the batch and its sequence column.
type Row = (usize, Option<i64>);

/// Handles `deliveries` in one transaction. See the [module docs](self).
async fn handle<S>(
    mut inner: S,
    pool: PgPool,
    begin: String,
    deliveries: Vec<Delivery>,
) -> Result<BatchResults, BoxError>
where
    S: tower::Service<InTx<Delivery>, Response = InTx<Outcome>> + GroupBatching + Send,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let Sorted {
        consumer,
        mut rows,
        mut duplicates,
        mut results,
    } = sort_out(&deliveries);
    let fence = deliveries.iter().find_map(Delivery::fence);
    while !rows.is_empty() {
        let mut tx = begin_tx(&pool, begin.clone()).await?;
        let fresh = insert(&mut tx, &consumer, &deliveries, &rows).await?;
        let batch = Pass {
            deliveries: &deliveries,
            rows: &rows,
            fresh: &fresh,
        };
        match batch.run(&mut inner, tx).await? {
            Passed::Failed(position, error) => {
                // The transaction is gone (rolled back): run the others again.
                let (index, _) = rows.remove(position);
                results[index] = Some(Err(error));
            }
            Passed::Handled(tx, handled) => {
                commit(tx, &consumer, fence).await?;
                for (index, outcome) in handled {
                    if outcome == Outcome::Duplicate {
                        duplicates.push(index);
                    }
                    results[index] = Some(Ok(outcome));
                }
                break;
            }
        }
    }
    for &index in &duplicates {
        note_duplicate(&deliveries[index]);
        results[index] = Some(Ok(Outcome::Duplicate));
    }
    Ok(results
        .into_iter()
        .map(|result| {
            result.unwrap_or_else(|| {
                Err(Box::new(Error::new(
                    ErrorKind::Database,
                    "the delivery was left unhandled by its batch",
                )))
            })
        })
        .collect())
}

/// A batch's deliveries sorted out before any statement: the ones to write
/// and handle, the repeated ones, and those failed already.
#[derive(Debug)]
struct Sorted {
    /// The batch's consumer: the first delivery's.
    consumer: String,
    /// To write and handle, in the batch's order.
    rows: Vec<Row>,
    /// A copy of an earlier delivery of the batch (same event id).
    duplicates: Vec<usize>,
    /// Per delivery: its result if it has one already (another consumer's,
    /// a sequence the inbox cannot store).
    results: Vec<Option<Result<Outcome, BoxError>>>,
}

/// Sorts `deliveries` out (see [`Sorted`]).
fn sort_out(deliveries: &[Delivery]) -> Sorted {
    let mut sorted = Sorted {
        consumer: deliveries
            .first()
            .map(|d| d.consumer().to_owned())
            .unwrap_or_default(),
        rows: Vec::with_capacity(deliveries.len()),
        duplicates: Vec::new(),
        results: deliveries.iter().map(|_| None).collect(),
    };
    let mut seen = HashSet::with_capacity(deliveries.len());
    for (index, delivery) in deliveries.iter().enumerate() {
        if delivery.consumer() != sorted.consumer {
            sorted.results[index] = Some(Err(Box::new(Error::new(
                ErrorKind::Config,
                format!(
                    "a batch holds deliveries of one consumer: `{}` in a batch of `{}`",
                    delivery.consumer(),
                    sorted.consumer
                ),
            ))));
            continue;
        }
        match sequence_column(delivery.envelope().sequence()) {
            Err(e) => sorted.results[index] = Some(Err(Box::new(e))),
            Ok(_) if !seen.insert(delivery.id()) => sorted.duplicates.push(index),
            Ok(sequence) => sorted.rows.push((index, sequence)),
        }
    }
    sorted
}

/// The fresh deliveries of `event_type` among `rows`, by index: a batch
/// handler's group.
fn group_of(
    rows: &[Row],
    deliveries: &[Delivery],
    event_type: &str,
    fresh: &HashSet<Uuid>,
) -> Vec<usize> {
    rows.iter()
        .map(|&(i, _)| i)
        .filter(|&i| {
            let d = &deliveries[i];
            d.event_type().as_str() == event_type && fresh.contains(d.id().as_uuid())
        })
        .collect()
}

/// One pass over a batch's rows, in one transaction whose inbox rows are
/// written (`fresh`: the ones that were not there yet).
struct Pass<'a> {
    deliveries: &'a [Delivery],
    rows: &'a [Row],
    fresh: &'a HashSet<Uuid>,
}

/// How a [`Pass`] ended.
enum Passed {
    /// Every row handled (or a duplicate): the transaction, to commit.
    Handled(PgTransaction<'static>, Vec<(usize, Outcome)>),
    /// The row at this position failed; the transaction is gone.
    Failed(usize, BoxError),
}

impl Pass<'_> {
    /// Runs each fresh row's handler (a batch handler's group at its first
    /// row) in `tx`, in order, until one fails.
    ///
    /// # Errors
    /// A group of more than one that failed: which of its events caused it
    /// is not known, so the runtime retries each delivery alone.
    async fn run<S>(&self, inner: &mut S, tx: PgTransaction<'static>) -> Result<Passed, BoxError>
    where
        S: tower::Service<InTx<Delivery>, Response = InTx<Outcome>> + GroupBatching + Send,
        S::Error: Into<BoxError>,
        S::Future: Send,
    {
        let mut handled = Vec::with_capacity(self.rows.len());
        let mut tx = tx;
        let mut in_group = HashSet::new();
        for (position, &(index, _)) in self.rows.iter().enumerate() {
            let delivery = &self.deliveries[index];
            if !self.fresh.contains(delivery.id().as_uuid()) {
                handled.push((index, Outcome::Duplicate));
                continue;
            }
            if in_group.contains(&index) {
                continue;
            }
            let event_type = delivery.event_type().as_str();
            if let Some(route) = inner.group_route(event_type).cloned() {
                let members = group_of(
                    &self.rows[position..],
                    self.deliveries,
                    event_type,
                    self.fresh,
                );
                let group = members
                    .iter()
                    .map(|&i| self.deliveries[i].clone())
                    .collect();
                match route.oneshot(InTx::new(tx, group)).await {
                    Ok(back) => {
                        tx = back.into_parts().0;
                        for &i in &members {
                            in_group.insert(i);
                            handled.push((i, Outcome::Handled));
                        }
                        continue;
                    }
                    Err(e) if members.len() > 1 => return Err(e),
                    Err(e) => return Ok(Passed::Failed(position, e)),
                }
            }
            match call(inner, InTx::new(tx, delivery.clone())).await {
                Ok(back) => {
                    let (open, outcome) = back.into_parts();
                    tx = open;
                    handled.push((index, outcome));
                }
                Err(e) => return Ok(Passed::Failed(position, e)),
            }
        }
        Ok(Passed::Handled(tx, handled))
    }
}

/// Drives the inner service once (ready, then call).
async fn call<S>(inner: &mut S, request: InTx<Delivery>) -> Result<InTx<Outcome>, BoxError>
where
    S: Service<InTx<Delivery>, Response = InTx<Outcome>>,
    S::Error: Into<BoxError>,
{
    inner
        .ready()
        .await
        .map_err(Into::into)?
        .call(request)
        .await
        .map_err(Into::into)
}

/// Writes the inbox rows of `rows`; returns the ids that were new.
async fn insert(
    tx: &mut PgTransaction<'static>,
    consumer: &str,
    deliveries: &[Delivery],
    rows: &[Row],
) -> Result<HashSet<Uuid>, Error> {
    let mut ids: Vec<Uuid> = Vec::with_capacity(rows.len());
    let mut types: Vec<&str> = Vec::with_capacity(rows.len());
    let mut subjects: Vec<&str> = Vec::with_capacity(rows.len());
    let mut times: Vec<DateTime<Utc>> = Vec::with_capacity(rows.len());
    let mut sequences: Vec<Option<i64>> = Vec::with_capacity(rows.len());
    for &(index, sequence) in rows {
        let envelope = deliveries[index].envelope();
        ids.push(*envelope.id().as_uuid());
        types.push(envelope.event_type().as_str());
        subjects.push(envelope.subject());
        times.push(envelope.time());
        sequences.push(sequence);
    }
    let inserted: Vec<Uuid> = sqlx::query_file_scalar!(
        "queries/insert_inbox_batch.sql",
        consumer,
        &ids,
        &types as &[&str],
        &subjects as &[&str],
        &times,
        // Elements may be NULL (the macro expects `&[i64]`).
        &sequences as &[Option<i64>],
    )
    .fetch_all(&mut **tx)
    .await
    .map_err(|e| Error::database("inserting a batch into inbox_events", e))?;
    Ok(inserted.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use outbox_pg::Envelope;

    use super::*;
    use crate::delivery::DeliveryInfo;

    fn delivery(consumer: &str, event_type: &str) -> Delivery {
        let env = Envelope::new(event_type, "svc", "s1", serde_json::json!({})).unwrap();
        Delivery::new(env, DeliveryInfo::new(consumer))
    }

    #[test]
    fn a_batch_is_sorted_into_rows_repeats_and_refusals_before_any_statement() {
        let first = delivery("c1", "a.one");
        let deliveries = vec![
            first.clone(),
            delivery("c2", "a.one"),
            first,
            delivery("c1", "a.two"),
        ];
        let sorted = sort_out(&deliveries);
        assert_eq!(sorted.consumer, "c1");
        assert_eq!(sorted.rows, [(0, None), (3, None)]);
        assert_eq!(
            sorted.duplicates,
            [2],
            "the same event id again in the batch"
        );
        let refused = sorted.results[1].as_ref().unwrap().as_ref().unwrap_err();
        assert!(
            refused.to_string().contains("`c2` in a batch of `c1`"),
            "{refused}"
        );
        assert!(sorted.results[0].is_none() && sorted.results[3].is_none());
    }

    #[test]
    fn a_group_is_the_fresh_deliveries_of_its_type_from_its_first_row_on() {
        let deliveries = vec![
            delivery("c1", "a.one"),
            delivery("c1", "a.two"),
            delivery("c1", "a.one"),
            delivery("c1", "a.one"),
        ];
        let rows: Vec<Row> = (0..4).map(|i| (i, None)).collect();
        // The last one was in the inbox already.
        let fresh: HashSet<Uuid> = deliveries[..3].iter().map(|d| *d.id().as_uuid()).collect();
        assert_eq!(group_of(&rows, &deliveries, "a.one", &fresh), [0, 2]);
        assert_eq!(group_of(&rows[1..], &deliveries, "a.one", &fresh), [2]);
        assert_eq!(group_of(&rows, &deliveries, "a.two", &fresh), [1]);
    }
}
