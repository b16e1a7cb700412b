//! Deliveries an ordered leader never received.
//!
//! A leader is its durable's only puller, and JetStream numbers every
//! delivery of a consumer one more than the last (the consumer sequence) and
//! delivers each message the first time in stream order. So a jump in the
//! consumer sequence means deliveries the leader never got: lost with a
//! connection that dropped (a broker restart, or a message no client can
//! read, on which the client drops its connection), and which JetStream
//! redelivers only after `ack_wait`, if it can be read at all. Later events
//! of their subjects must not overtake them.
//!
//! When a first delivery (at stream sequence `s`) comes after such a jump,
//! every stored message of the consumer's subjects between the highest
//! first delivery received before (`f`) and `s` was delivered first and
//! never received. Until those are known, every message received is held
//! (in-progress acks keep it). Then [`ghosts::explain_gap`] reads them by
//! sequence: one no client can read is settled as a dead letter at once;
//! each event is made the next its subject waits for (the
//! [`Backlog`](super::takeover::Backlog), in stream order, with the
//! backlog's expiry); and the held messages go on through the backlog. A
//! gap seen while one is being explained is explained after it, the
//! messages held until both are.

use std::collections::VecDeque;

use tokio::task::JoinHandle;

use crate::delivery::DeliveryInfo;
use crate::error::Error;
use crate::runtime::Job;
use crate::runtime::ghosts::Lost;

/// What a leader knows of its deliveries; see the [module docs](self).
#[derive(Default)]
pub(crate) struct Gaps {
    /// The last consumer sequence received.
    delivered: Option<u64>,
    /// The highest stream sequence received as a first delivery.
    frontier: u64,
    /// Deliveries went missing since the last first delivery.
    jumped: bool,
    /// Ranges `(after, before)` of stream sequences to explain, in order.
    waiting: VecDeque<(u64, u64)>,
    explaining: Option<JoinHandle<Result<Vec<Lost>, Error>>>,
    /// Jobs received while a gap is not explained yet, in arrival order.
    held: Vec<Job>,
}

impl Gaps {
    /// Notes a received delivery; when it comes after deliveries that never
    /// arrived, queues the stream range to explain and returns it.
    pub(crate) fn note(&mut self, info: &DeliveryInfo) -> Option<(u64, u64)> {
        if self
            .delivered
            .is_some_and(|last| info.consumer_sequence > last.saturating_add(1))
        {
            self.jumped = true;
        }
        self.delivered = Some(
            self.delivered
                .map_or(info.consumer_sequence, |d| d.max(info.consumer_sequence)),
        );
        if info.delivered > 1 {
            // Where a redelivery stands in the stream says nothing of the
            // first deliveries missed: the next first delivery will.
            return None;
        }
        let after = self.frontier;
        self.frontier = self.frontier.max(info.stream_sequence);
        let jumped = std::mem::take(&mut self.jumped);
        let range = (after, info.stream_sequence);
        let missed = jumped && info.stream_sequence > after.saturating_add(1);
        missed.then(|| {
            self.waiting.push_back(range);
            range
        })
    }

    /// The next range to explain, if none is being explained.
    pub(crate) fn next_range(&mut self) -> Option<(u64, u64)> {
        if self.explaining.is_some() {
            return None;
        }
        self.waiting.pop_front()
    }

    /// Runs `task` as the explanation of the current range.
    pub(crate) fn explain(&mut self, task: JoinHandle<Result<Vec<Lost>, Error>>) {
        self.explaining = Some(task);
    }

    /// Whether received jobs must wait: a gap is being explained, or waits to be.
    pub(crate) fn holding(&self) -> bool {
        self.explaining.is_some() || !self.waiting.is_empty()
    }

    /// Holds `job` while a gap is not explained; returns it otherwise.
    pub(crate) fn hold(&mut self, job: Job) -> Option<Job> {
        if self.holding() {
            self.held.push(job);
            return None;
        }
        Some(job)
    }

    /// The jobs held, for their in-progress acks.
    pub(crate) fn held(&self) -> impl Iterator<Item = &Job> {
        self.held.iter()
    }

    /// Once nothing is left to explain, the held jobs, in arrival order.
    pub(crate) fn release(&mut self) -> Vec<Job> {
        if self.holding() {
            return Vec::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Resolves with the running explanation's result; never while none runs.
    pub(crate) async fn explained(&mut self) -> Result<Vec<Lost>, Error> {
        let Some(task) = &mut self.explaining else {
            return std::future::pending().await;
        };
        let result = match task.await {
            Ok(result) => result,
            Err(e) => Err(Error::caused(
                crate::ErrorKind::Nats,
                "explaining a gap in the deliveries",
                e,
            )),
        };
        self.explaining = None;
        result
    }
}

impl Drop for Gaps {
    fn drop(&mut self) {
        if let Some(task) = &self.explaining {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

    use super::*;

    fn info(consumer_sequence: u64, stream_sequence: u64, delivered: u64) -> DeliveryInfo {
        let mut info = DeliveryInfo::new("c");
        info.consumer_sequence = consumer_sequence;
        info.stream_sequence = stream_sequence;
        info.delivered = delivered;
        info
    }

    #[test]
    fn a_jump_in_the_deliveries_names_the_stream_range_never_received() {
        let mut gaps = Gaps::default();
        // The first delivery sets where the leader stands.
        assert_eq!(gaps.note(&info(11, 40, 1)), None);
        assert_eq!(gaps.note(&info(12, 41, 1)), None);
        // Deliveries 13 and 14 never came: stream 42..=44 (some may not be
        // the consumer's) lie between.
        assert_eq!(gaps.note(&info(15, 45, 1)), Some((41, 45)));
        assert_eq!(gaps.note(&info(16, 46, 1)), None);
    }

    #[test]
    fn redeliveries_move_no_frontier_and_a_jump_to_one_waits_for_a_first_delivery() {
        let mut gaps = Gaps::default();
        assert_eq!(gaps.note(&info(1, 10, 1)), None);
        // A redelivery after a jump: its stream position says nothing.
        assert_eq!(gaps.note(&info(5, 3, 2)), None);
        // The next first delivery tells which first deliveries were missed.
        assert_eq!(gaps.note(&info(6, 14, 1)), Some((10, 14)));
        // A jump whose first delivery follows the frontier at once: nothing
        // between to explain.
        assert_eq!(gaps.note(&info(9, 15, 1)), None);
        assert_eq!(gaps.note(&info(10, 16, 1)), None);
    }

    #[test]
    fn jobs_wait_while_a_gap_is_unexplained() {
        let mut gaps = Gaps::default();
        assert_eq!(gaps.note(&info(1, 1, 1)), None);
        assert!(!gaps.holding());
        assert_eq!(gaps.note(&info(3, 5, 1)), Some((1, 5)));
        assert!(gaps.holding());
        assert_eq!(gaps.next_range(), Some((1, 5)));
        assert!(gaps.release().is_empty());
        assert!(!gaps.holding(), "explained, none running");
    }
}
