//! Per-subject serialisation: at most one delivery of a subject in flight,
//! later ones queued in arrival order.

use std::collections::{HashMap, VecDeque};

/// Jobs keyed by subject. A key is *busy* while one of its jobs runs; jobs
/// offered for a busy key wait in FIFO order.
#[derive(Debug)]
pub(crate) struct Dispatcher<J> {
    waiting: HashMap<String, VecDeque<J>>,
    queued: usize,
}

impl<J> Dispatcher<J> {
    pub(crate) fn new() -> Self {
        Self {
            waiting: HashMap::new(),
            queued: 0,
        }
    }

    /// Returns the job back if it may start now (its key becomes busy), or
    /// queues it behind the running job of its key.
    pub(crate) fn offer(&mut self, key: &str, job: J) -> Option<J> {
        match self.waiting.get_mut(key) {
            Some(queue) => {
                queue.push_back(job);
                self.queued += 1;
                None
            }
            None => {
                self.waiting.insert(key.to_owned(), VecDeque::new());
                Some(job)
            }
        }
    }

    /// The running job of `key` finished: returns the next job of the key to
    /// start (the key stays busy), or frees the key.
    pub(crate) fn finish(&mut self, key: &str) -> Option<J> {
        let queue = self.waiting.get_mut(key)?;
        match queue.pop_front() {
            Some(job) => {
                self.queued -= 1;
                Some(job)
            }
            None => {
                self.waiting.remove(key);
                None
            }
        }
    }

    /// Frees `key` and returns every job that waited behind it.
    pub(crate) fn abandon(&mut self, key: &str) -> VecDeque<J> {
        let queue = self.waiting.remove(key).unwrap_or_default();
        self.queued -= queue.len();
        queue
    }

    /// Jobs waiting behind a busy key.
    pub(crate) fn queued(&self) -> usize {
        self.queued
    }

    /// Every job waiting behind a busy key.
    pub(crate) fn queued_jobs(&self) -> impl Iterator<Item = &J> {
        self.waiting.values().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_job_per_key_in_arrival_order() {
        let mut d = Dispatcher::new();
        assert_eq!(d.offer("a", 1), Some(1));
        assert_eq!(d.offer("a", 2), None);
        assert_eq!(d.offer("b", 3), Some(3));
        assert_eq!(d.offer("a", 4), None);
        assert_eq!(d.queued(), 2);
        assert_eq!(d.finish("a"), Some(2));
        assert_eq!(d.offer("a", 5), None);
        assert_eq!(d.finish("b"), None);
        assert_eq!(d.offer("b", 6), Some(6));
        assert_eq!(d.finish("a"), Some(4));
        assert_eq!(d.finish("a"), Some(5));
        assert_eq!(d.finish("a"), None);
        assert_eq!(d.queued(), 0);
        assert_eq!(d.offer("a", 7), Some(7));
    }

    #[test]
    fn abandoning_a_key_hands_back_its_queue_and_frees_it() {
        let mut d = Dispatcher::new();
        assert_eq!(d.offer("a", 1), Some(1));
        assert_eq!(d.offer("a", 2), None);
        assert_eq!(d.offer("a", 3), None);
        assert_eq!(d.offer("b", 4), Some(4));
        assert_eq!(d.abandon("a"), VecDeque::from([2, 3]));
        assert_eq!(d.queued(), 0);
        assert_eq!(d.offer("a", 5), Some(5));
        assert!(d.abandon("x").is_empty());
    }

    #[test]
    fn finishing_an_unknown_key_is_harmless() {
        let mut d: Dispatcher<u8> = Dispatcher::new();
        assert_eq!(d.finish("x"), None);
    }
}
