//! Waiting at start for what a component needs (the broker, a stream): the
//! same attempt again after a pause that doubles up to a bound
//! ([`backon`]'s exponential backoff), until it succeeds, fails in a way that
//! waiting cannot cure, or runs out of patience. The relay and the consumer
//! wait for their broker and stream through it; wrap it in a `select!` with
//! shutdown to stop waiting.

use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tokio::time::Instant;

/// Pauses from `first`, doubling up to `max`, without jitter or end.
pub fn pauses(first: Duration, max: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(max)
        .without_max_times()
}

/// Runs `attempt` until it succeeds, then returns what it made.
///
/// After a failure that `wait_on` accepts, `waiting` is told the error and
/// the pause, and the attempt is made again after that pause; unless the
/// pause would end past `patience` from the call (`None`: no limit).
///
/// # Errors
/// The first error `wait_on` refuses, or the last one once the next pause
/// would end past `patience`.
pub async fn until_ready<T, E, F, Fut>(
    pauses: ExponentialBuilder,
    patience: Option<Duration>,
    attempt: F,
    wait_on: impl FnMut(&E) -> bool,
    waiting: impl FnMut(&E, Duration),
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = patience.map(|patience| Instant::now() + patience);
    attempt
        .retry(pauses)
        .when(wait_on)
        .adjust(|_, pause| pause.filter(|&p| deadline.is_none_or(|d| Instant::now() + p <= d)))
        .notify(waiting)
        .await
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use backon::BackoffBuilder;

    use super::*;

    #[test]
    fn pauses_double_up_to_the_bound() {
        let ms: Vec<u128> = pauses(Duration::from_millis(100), Duration::from_secs(2))
            .build()
            .take(7)
            .map(|d| d.as_millis())
            .collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 2000, 2000]);
    }

    #[tokio::test(start_paused = true)]
    async fn waits_through_what_waiting_cures_and_returns_at_once_on_the_rest() {
        let tries = Cell::new(0);
        let told = Cell::new(0);
        let fast = pauses(Duration::from_millis(10), Duration::from_millis(20));
        let result: Result<u32, &str> = until_ready(
            fast,
            None,
            || async {
                tries.set(tries.get() + 1);
                if tries.get() < 4 {
                    Err("not yet")
                } else {
                    Ok(7)
                }
            },
            |e| *e == "not yet",
            |_, _| told.set(told.get() + 1),
        )
        .await;
        assert_eq!(result, Ok(7));
        assert_eq!((tries.get(), told.get()), (4, 3));

        tries.set(0);
        let result: Result<u32, &str> = until_ready(
            fast,
            None,
            || async {
                tries.set(tries.get() + 1);
                Err("refused")
            },
            |e| *e == "not yet",
            |_, _| {},
        )
        .await;
        assert_eq!(result, Err("refused"));
        assert_eq!(tries.get(), 1);

        tries.set(0);
        let started = Instant::now();
        let result: Result<u32, &str> = until_ready(
            fast,
            Some(Duration::from_millis(55)),
            || async {
                tries.set(tries.get() + 1);
                Err("not yet")
            },
            |_| true,
            |_, _| {},
        )
        .await;
        assert_eq!(result, Err("not yet"));
        assert_eq!(
            tries.get(),
            4,
            "10 + 20 + 20 ms of pauses; 20 more would pass 55 ms"
        );
        assert_eq!(started.elapsed(), Duration::from_millis(50));
    }
}
