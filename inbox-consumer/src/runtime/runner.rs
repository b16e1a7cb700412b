//! How a session starts work: one delivery per task ([`Single`], for
//! [`Consumer::run`](super::Consumer::run)) or a batch per task ([`Batched`],
//! for [`Consumer::run_batched`](super::Consumer::run_batched)).

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::{Id, JoinSet};
use tower::Service;

use super::Job;
use super::batch::deliver_batch;
use super::process::{Shared, deliver};
use crate::delivery::{BatchResults, Delivery, Outcome};
use crate::error::BoxError;

/// Starts the task that handles a group of jobs of distinct subjects. The task
/// answers, per job, whether its message is finished.
pub(crate) trait Runner {
    /// The most jobs one task takes.
    fn max_jobs(&self) -> usize;

    /// Spawns the task for `jobs` on `tasks`.
    fn spawn(
        &self,
        tasks: &mut JoinSet<Vec<bool>>,
        shared: &Arc<Shared>,
        jobs: Vec<Job>,
        stopping: watch::Receiver<bool>,
    ) -> Id;
}

/// One delivery per task, through a `Service<Delivery>`.
#[derive(Clone, Debug)]
pub(crate) struct Single<S>(pub(crate) S);

impl<S> Runner for Single<S>
where
    S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    fn max_jobs(&self) -> usize {
        1
    }

    fn spawn(
        &self,
        tasks: &mut JoinSet<Vec<bool>>,
        shared: &Arc<Shared>,
        jobs: Vec<Job>,
        stopping: watch::Receiver<bool>,
    ) -> Id {
        let (shared, service) = (Arc::clone(shared), self.0.clone());
        tasks
            .spawn(async move {
                let mut finished = Vec::with_capacity(jobs.len());
                for (message, delivery) in jobs {
                    let service = service.clone();
                    let stopping = stopping.clone();
                    let shared = Arc::clone(&shared);
                    finished.push(deliver(shared, service, message, delivery, stopping).await);
                }
                finished
            })
            .id()
    }
}

/// Up to `max` deliveries per task, through a `Service<Vec<Delivery>>`.
#[derive(Clone, Debug)]
pub(crate) struct Batched<S> {
    pub(crate) service: S,
    pub(crate) max: usize,
}

impl<S> Runner for Batched<S>
where
    S: Service<Vec<Delivery>, Response = BatchResults> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    fn max_jobs(&self) -> usize {
        self.max
    }

    fn spawn(
        &self,
        tasks: &mut JoinSet<Vec<bool>>,
        shared: &Arc<Shared>,
        jobs: Vec<Job>,
        stopping: watch::Receiver<bool>,
    ) -> Id {
        let task = deliver_batch(Arc::clone(shared), self.service.clone(), jobs, stopping);
        tasks.spawn(task).id()
    }
}
