//! [`ConsumerBuilder`]: the standard consumer in one expression.
//!
//! [`Consumer::builder`] assembles what every service writes by hand
//! otherwise: a [`Router`] of [`Handler`]s, the standard stack around it
//! ([`Trace`] → [`Metrics`] → [`Dedupe`] → router), a [`ConsumerConfig`] that
//! subscribes to the router's event types only, and a start-up that waits for
//! the stream to exist. [`ConsumerBuilder::run`] then consumes until shutdown.
//!
//! Anything the builder does not cover is the same pieces assembled by hand:
//! see the [crate docs](crate#layers).

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream;
use sqlx::PgPool;
use tower::{Layer, Service, ServiceBuilder};

use crate::batch_handler::BatchHandler;
use crate::dedupe::{DedupeLayer, Timeouts};
use crate::delivery::{Delivery, InTx, Outcome};
use crate::error::{BoxError, Error, ErrorKind, Result};
use crate::grouping::GroupRoute;
use crate::handler::Handler;
use crate::metrics::MetricsLayer;
use crate::router::{Router, TxRoute};
use crate::runtime::{Consumer, ConsumerConfig};
use crate::trace::TraceLayer;

/// The router the builder fills: handlers inside the inbox transaction.
type TxRouter = Router<InTx<Delivery>, InTx<Outcome>>;

/// The layers added with [`ConsumerBuilder::layer`] and
/// [`ConsumerBuilder::batch_layer`], applied to the router at
/// [`run`](ConsumerBuilder::run) in the order they were added.
type Layers = Vec<Box<dyn FnOnce(TxRouter) -> TxRouter + Send>>;

/// The first pause between two looks for a stream that is not there yet.
const FIRST_STREAM_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two looks for a stream that is not there yet.
const MAX_STREAM_PAUSE: Duration = Duration::from_secs(2);

/// Builds and runs a consumer with the standard stack; from
/// [`Consumer::builder`].
///
/// ```no_run
/// use inbox_consumer::prelude::*;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, JsonSchema)]
/// struct SubscriptionCreated { subscription_id: String, plan: String }
///
/// impl Event for SubscriptionCreated {
///     const TYPE: &'static str = "subscription.created";
/// }
///
/// #[derive(Clone)]
/// struct OpenAccount;
///
/// impl Handler for OpenAccount {
///     type Message = SubscriptionCreated;
///     async fn handle(
///         &self,
///         event: Envelope<SubscriptionCreated>,
///         tx: &mut sqlx::PgTransaction<'static>,
///     ) -> Result<(), HandlerError> {
///         sqlx::query("insert into accounts (subscription_id, plan) values ($1, $2)")
///             .bind(&event.data().subscription_id)
///             .bind(&event.data().plan)
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     }
/// }
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://localhost/billing").await?;
/// outbox_pg::migrate(&pool).await?;
/// let nats = async_nats::connect("nats://localhost:4222").await?;
///
/// Consumer::builder(pool, nats, "SUBSCRIPTIONS", "billing")
///     .handler(OpenAccount) // subscribes to subscription.created
///     .configure(|config| config.concurrency(16))
///     .run(async { let _ = tokio::signal::ctrl_c().await; })
///     .await?;
/// # Ok(()) }
/// ```
#[must_use = "a builder does nothing until `run`"]
pub struct ConsumerBuilder {
    js: jetstream::Context,
    pool: PgPool,
    config: ConsumerConfig,
    router: TxRouter,
    timeouts: Timeouts,
    whole_stream: bool,
    batched: bool,
    stream_patience: Option<Duration>,
    layers: Layers,
}

impl fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("config", &self.config)
            .field("router", &self.router)
            .field("timeouts", &self.timeouts)
            .field("whole_stream", &self.whole_stream)
            .field("batched", &self.batched)
            .field("stream_patience", &self.stream_patience)
            .field("layers", &self.layers.len())
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A builder for the durable consumer `durable` of `stream`, handling
    /// events in transactions on `pool`. `nats` is an
    /// [`async_nats::Client`] or a [`jetstream::Context`]. The database comes
    /// first, the broker second, as everywhere in the outbox crates.
    ///
    /// `durable` is also the inbox's dedupe namespace: keep it stable.
    pub fn builder(
        pool: PgPool,
        nats: impl IntoJetStream,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> ConsumerBuilder {
        ConsumerBuilder {
            js: nats.into_jetstream(),
            pool,
            config: ConsumerConfig::new(stream, durable),
            router: Router::new(),
            timeouts: Timeouts::default(),
            whole_stream: false,
            batched: true,
            stream_patience: None,
            layers: Vec::new(),
        }
    }
}

/// What [`Consumer::builder`] reaches JetStream through: an
/// [`async_nats::Client`] (with JetStream's default domain and prefix) or a
/// [`jetstream::Context`] set up by the caller.
pub trait IntoJetStream {
    /// The JetStream context.
    fn into_jetstream(self) -> jetstream::Context;
}

impl IntoJetStream for async_nats::Client {
    fn into_jetstream(self) -> jetstream::Context {
        jetstream::new(self)
    }
}

impl IntoJetStream for jetstream::Context {
    fn into_jetstream(self) -> jetstream::Context {
        self
    }
}

impl ConsumerBuilder {
    /// Handles `handler`'s message type ([`Handler::Message`]'s
    /// [`Event::TYPE`](outbox_pg::Event::TYPE)) with `handler`.
    pub fn handler<H>(mut self, handler: H) -> Self
    where
        H: Handler,
        H::Message: outbox_pg::Event,
    {
        self.router = self.router.handler(handler);
        self
    }

    /// Handles `H::Message`'s event type with a [`BatchHandler`]: every event
    /// of the type in a batch in one call (see [`Router::batch_handler`]).
    pub fn batch_handler<H>(mut self, handler: H) -> Self
    where
        H: BatchHandler,
        H::Message: outbox_pg::Event,
    {
        self.router = self.router.batch_handler(handler);
        self
    }

    /// Handles `event_type` with `service`, a stack inside the transaction
    /// (for example [`SkipStaleLayer`](crate::SkipStaleLayer) around a
    /// [`HandlerService`](crate::HandlerService)), or an untyped handler.
    pub fn route<S>(mut self, event_type: impl Into<String>, service: S) -> Self
    where
        S: Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        self.router = self.router.route(event_type, service);
        self
    }

    /// Wraps each handler in `layer`, inside the inbox transaction: between
    /// the standard stack ([`Trace`](crate::Trace) → [`Metrics`](crate::Metrics)
    /// → [`Dedupe`](crate::Dedupe)) and the handler, for every event type
    /// routed, whenever it was routed. Each call wraps what the earlier ones
    /// built, so the last layer added is the outermost
    /// ([`Router::layer`], as axum's `Router::layer`).
    ///
    /// A failure the layer returns fails the delivery as a handler's would:
    /// the transaction rolls back, the inbox row with it, and the delivery is
    /// retried with backoff, then dead-lettered once its budget is spent.
    ///
    /// Event types routed to a [`BatchHandler`] then get their events one at
    /// a time in a batch; [`batch_layer`](Self::batch_layer) keeps their
    /// groups.
    ///
    /// ```no_run
    /// # use inbox_consumer::prelude::*;
    /// # use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize, Deserialize, JsonSchema)]
    /// # struct InvoicePaid { invoice_id: String }
    /// # impl Event for InvoicePaid { const TYPE: &'static str = "invoice.paid"; }
    /// # #[derive(Clone)]
    /// # struct MarkPaid;
    /// # impl Handler for MarkPaid {
    /// #     type Message = InvoicePaid;
    /// #     async fn handle(&self, _: Envelope<InvoicePaid>, _: &mut sqlx::PgTransaction<'static>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::PgPool::connect("postgres://localhost/ledger").await?;
    /// # let nats = async_nats::connect("nats://localhost:4222").await?;
    /// use std::time::Duration;
    /// use tower::timeout::TimeoutLayer;
    ///
    /// Consumer::builder(pool, nats, "INVOICES", "ledger")
    ///     .handler(MarkPaid)
    ///     // A handler that takes over 10 s fails its delivery: rolled back, retried.
    ///     .layer(TimeoutLayer::new(Duration::from_secs(10)))
    ///     .run(inbox_consumer::shutdown_signal())
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn layer<L>(mut self, layer: L) -> Self
    where
        L: Layer<TxRoute> + Send + 'static,
        L::Service:
            Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + Sync + 'static,
        <L::Service as Service<InTx<Delivery>>>::Error: Into<BoxError>,
        <L::Service as Service<InTx<Delivery>>>::Future: Send + 'static,
    {
        self.layers
            .push(Box::new(move |router| router.layer(layer)));
        self
    }

    /// [`layer`](Self::layer) for a layer that also wraps a
    /// [`BatchHandler`]'s group call (`InTx<Vec<Delivery>>`), so batches keep
    /// handing it its events together ([`Router::batch_layer`]). tower's
    /// `TimeoutLayer` and `ConcurrencyLimitLayer` serve both; a timeout then
    /// bounds the whole group's call.
    pub fn batch_layer<L>(mut self, layer: L) -> Self
    where
        L: Layer<TxRoute> + Layer<GroupRoute> + Send + 'static,
        <L as Layer<TxRoute>>::Service:
            Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + Sync + 'static,
        <<L as Layer<TxRoute>>::Service as Service<InTx<Delivery>>>::Error: Into<BoxError>,
        <<L as Layer<TxRoute>>::Service as Service<InTx<Delivery>>>::Future: Send + 'static,
        <L as Layer<GroupRoute>>::Service:
            Service<InTx<Vec<Delivery>>, Response = InTx<()>> + Clone + Send + Sync + 'static,
        <<L as Layer<GroupRoute>>::Service as Service<InTx<Vec<Delivery>>>>::Error: Into<BoxError>,
        <<L as Layer<GroupRoute>>::Service as Service<InTx<Vec<Delivery>>>>::Future: Send + 'static,
    {
        self.layers
            .push(Box::new(move |router| router.batch_layer(layer)));
        self
    }

    /// Changes the [`ConsumerConfig`]: concurrency, ack wait, delivery budget,
    /// ordering, retention… The stream and durable stay the builder's, and so
    /// do the filter subjects unless [`whole_stream`](Self::whole_stream).
    pub fn configure(mut self, f: impl FnOnce(ConsumerConfig) -> ConsumerConfig) -> Self {
        self.config = f(self.config);
        self
    }

    /// The inbox transaction's timeouts ([`Timeouts`]; default: lock 5 s,
    /// statement 30 s, idle in transaction 60 s).
    pub fn timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// Reads the whole stream instead of the routed types only; types no
    /// route handles are then acked and counted, or dead-lettered, as
    /// [`ConsumerConfig::unrouted`] says. Off by default.
    pub fn whole_stream(mut self) -> Self {
        self.whole_stream = true;
        self
    }

    /// Handles up to `max_batch` deliveries of distinct subjects in one
    /// transaction ([`Consumer::run_batched`]); 1 gives each delivery a
    /// transaction of its own ([`Consumer::run`]). Default: batched, up to
    /// [`ConsumerConfig::max_batch`] (64). A batch is what has already
    /// arrived: the runtime never waits to fill one.
    pub fn batched(mut self, max_batch: usize) -> Self {
        self.batched = max_batch > 1;
        self.config = self.config.max_batch(max_batch);
        self
    }

    /// How long [`run`](Self::run) waits for the stream to exist (and for
    /// JetStream to answer) before it fails with
    /// [`ErrorKind::StreamUnavailable`]. Default: for as long as it takes,
    /// until shutdown; the stream's creator, often the relay, may start after
    /// the consumer.
    pub fn stream_patience(mut self, patience: Duration) -> Self {
        self.stream_patience = Some(patience);
        self
    }

    /// The configuration [`run`](Self::run) will use: the builder's, filtered
    /// to the routed event types.
    pub fn config(&self) -> ConsumerConfig {
        let config = self.config.clone();
        if self.whole_stream {
            config
        } else {
            config.filter_subjects(self.router.event_types())
        }
    }

    /// Creates (or updates) the durable consumer, once the stream exists, and
    /// consumes with the standard stack until `shutdown` resolves; then drains
    /// and returns.
    ///
    /// While the stream does not exist or JetStream does not answer, it looks
    /// again with a pause growing to 2 s, logging at info; `shutdown`
    /// resolving meanwhile returns `Ok` at once.
    ///
    /// # Errors
    /// - [`ErrorKind::Config`] if no handler is routed (and the whole stream
    ///   was not asked for), the stream name is invalid, or the inbox retention
    ///   is shorter than the redelivery window.
    /// - [`ErrorKind::StreamUnavailable`] if the stream is still missing after
    ///   [`stream_patience`](Self::stream_patience).
    /// - [`ErrorKind::Nats`] if JetStream refuses the consumer (for example a
    ///   durable of the same name with settings that cannot be changed).
    pub async fn run<F>(self, shutdown: F) -> Result<()>
    where
        F: Future<Output = ()> + Send,
    {
        if self.router.event_types().is_empty() && !self.whole_stream {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "consumer `{}` has no handler: route at least one event type \
                     (ConsumerBuilder::handler or ::route)",
                    self.config.durable()
                ),
            ));
        }
        let config = self.config();
        let mut shutdown = std::pin::pin!(shutdown);
        let consumer = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(()),
            consumer = Consumer::new_when_ready(self.pool.clone(), self.js, config, self.stream_patience) => consumer?,
        };
        let router = self
            .layers
            .into_iter()
            .fold(self.router, |router, layer| layer(router));
        let stack = ServiceBuilder::new()
            .layer(TraceLayer::new())
            .layer(MetricsLayer::new())
            .layer(DedupeLayer::new(self.pool).timeouts(self.timeouts))
            .service(router);
        if self.batched {
            consumer.run_batched(stack, shutdown).await
        } else {
            consumer.run(stack, shutdown).await
        }
    }
}

impl Consumer {
    /// [`Consumer::new`] (its privilege check once), again while the stream is unavailable
    /// ([`ErrorKind::StreamUnavailable`]: missing, or JetStream not
    /// answering), for up to `patience`, or without end if `None`. The pause
    /// between looks grows from 100 ms to 2 s; the first wait is logged at
    /// info. Wrap it in a `select!` with shutdown to stop waiting.
    ///
    /// # Errors
    /// As [`Consumer::new`]; [`ErrorKind::StreamUnavailable`] once `patience`
    /// has run out.
    pub async fn new_when_ready(
        pool: PgPool,
        js: jetstream::Context,
        config: ConsumerConfig,
        patience: Option<Duration>,
    ) -> Result<Self> {
        // Once: waiting for the stream changes nothing about the role.
        crate::runtime::check_privileges(&pool, &config).await?;
        let mut told = false;
        let consumer = outbox_pg::ready::until_ready(
            outbox_pg::ready::pauses(FIRST_STREAM_PAUSE, MAX_STREAM_PAUSE),
            patience,
            || Self::create(js.clone(), pool.clone(), config.clone()),
            |e| e.kind() == ErrorKind::StreamUnavailable,
            |e, _| {
                if told {
                    tracing::debug!(stream = config.stream(), error = %e, "still waiting for the stream");
                } else {
                    tracing::info!(
                        stream = config.stream(), consumer = config.durable(), error = %e,
                        "waiting for the stream to exist",
                    );
                    told = true;
                }
            },
        )
        .await?;
        if told {
            tracing::info!(stream = config.stream(), "the stream is there; consuming");
        }
        Ok(consumer)
    }
}
