//! The names a consuming service uses, in one import: the builder, the
//! handler trait and its error, typed events and their envelope.
//!
//! ```
//! use inbox_consumer::prelude::*;
//! # let _ = ConsumerConfig::new("STREAM", "durable");
//! ```

pub use crate::batch_handler::BatchHandler;
pub use crate::builder::ConsumerBuilder;
pub use crate::delivery::{Delivery, Outcome};
pub use crate::error::{Error, ErrorKind, HandlerError};
pub use crate::handler::Handler;
pub use crate::router::Router;
pub use crate::runtime::{Consumer, ConsumerConfig};
pub use outbox_pg::prelude::{Envelope, Event, EventId, JsonSchema, Outbox, SchemaRegistry};
