//! The names a service that writes events uses, in one import:
//!
//! ```
//! use outbox_pg::prelude::*;
//! # let _ = (Outbox::unvalidated(), SchemaRegistry::new());
//! ```

pub use crate::envelope::{Envelope, EventId};
pub use crate::event::Event;
pub use crate::outbox::Outbox;
pub use crate::schedule::{Cancellation, Due};
pub use crate::schema::SchemaRegistry;
pub use schemars::JsonSchema;
