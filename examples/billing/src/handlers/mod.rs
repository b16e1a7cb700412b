//! The handlers, one per event type.

mod cancelled;
mod created;

pub use cancelled::{CANCEL_RETRY_AFTER, NotInvoicedYet, VoidInvoices};
pub use created::InvoiceSubscription;
