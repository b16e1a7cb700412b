//! Typed events: an event type declared once, as a payload type.
//!
//! An [`Event`] is a payload type that knows its CloudEvents type string, and
//! whose JSON Schema is derived from it with [`schemars`]. Everything that
//! needs the type string or the schema takes it from there:
//!
//! - [`Envelope::event`] builds the envelope without naming the type;
//! - [`SchemaRegistry::with_event`] registers the derived schema, so
//!   [`Outbox::enqueue`](crate::Outbox::enqueue) validates against it;
//! - the consumer's router routes a handler by its message's type, and the
//!   consumer subscribes to the router's types (see `inbox-consumer`);
//! - [`check_schema_file`] fails, in a test, when a schema file kept for
//!   other languages has drifted from the type.
//!
//! Untyped events ([`Envelope<serde_json::Value>`], [`Envelope::new`]) keep
//! working beside typed ones.
//!
//! ```
//! use outbox_pg::{Envelope, Event, SchemaRegistry};
//! use schemars::JsonSchema;
//! use serde::{Deserialize, Serialize};
//!
//! /// A customer subscribed to a plan.
//! #[derive(Debug, Serialize, Deserialize, JsonSchema)]
//! #[serde(deny_unknown_fields)]
//! struct SubscriptionCreated {
//!     #[schemars(length(min = 1))]
//!     subscription_id: String,
//!     #[schemars(range(min = 0))]
//!     amount_cents: i64,
//! }
//!
//! impl Event for SubscriptionCreated {
//!     const TYPE: &'static str = "subscription.created";
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let schemas = SchemaRegistry::new().with_event::<SubscriptionCreated>()?;
//! assert!(schemas.contains("subscription.created"));
//!
//! let data = SubscriptionCreated { subscription_id: "sub_1".into(), amount_cents: 1234 };
//! let event = Envelope::event("subscriptions", "sub_1", data)?;
//! assert_eq!(event.event_type().as_str(), "subscription.created");
//! schemas.validate(SubscriptionCreated::TYPE, &serde_json::to_value(event.data())?)?;
//! # Ok(()) }
//! ```

use std::path::Path;

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::envelope::Envelope;
use crate::error::{Error, ErrorKind, Result};
use crate::schema::{SCHEMA_SUFFIX, SchemaRegistry};

/// A payload type that is an event type: its type string, its payload and its
/// schema, declared once.
///
/// Derive `Serialize`, `Deserialize` and [`JsonSchema`], then name the type:
///
/// ```
/// # use schemars::JsonSchema;
/// # use serde::{Deserialize, Serialize};
/// #[derive(Serialize, Deserialize, JsonSchema)]
/// struct InvoiceCreated { invoice_id: String, amount_cents: i64 }
/// # let _ = InvoiceCreated { invoice_id: String::new(), amount_cents: 0 };
///
/// impl outbox_pg::Event for InvoiceCreated {
///     const TYPE: &'static str = "invoice.created";
/// }
/// ```
///
/// The schema is what [`schemars`] derives (JSON Schema 2020-12): field
/// constraints go on the fields (`#[schemars(length(min = 1))]`,
/// `#[schemars(range(min = 0))]`, `#[serde(deny_unknown_fields)]` for
/// `additionalProperties: false`), and the doc comment becomes its
/// `description`. Override [`Event::schema`] to add to it.
pub trait Event: Serialize + DeserializeOwned + JsonSchema + Send + Sync + 'static {
    /// The CloudEvents `type`, which is also the NATS subject the relay
    /// publishes on: dot-separated tokens, no wildcards or whitespace (see
    /// [`validate_event_type`](crate::validate_event_type)).
    const TYPE: &'static str;

    /// The JSON Schema of the payload: derived from the type, titled with
    /// [`Event::TYPE`].
    fn schema() -> serde_json::Value {
        let mut schema = schemars::schema_for!(Self);
        schema.insert("title".to_owned(), Self::TYPE.into());
        schema.to_value()
    }
}

impl<E: Event> Envelope<E> {
    /// A new event of type `E::TYPE` about `subject`, from `source`: the same
    /// as [`Envelope::new`] without writing the type string.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidEnvelope`] if `E::TYPE` is not a valid event type,
    /// or `source` / `subject` is empty, too long or holds control characters.
    pub fn event(source: impl Into<String>, subject: impl Into<String>, data: E) -> Result<Self> {
        Self::new(E::TYPE, source, subject, data)
    }
}

impl SchemaRegistry {
    /// Adds the schema derived from `E` ([`Event::schema`]) under `E::TYPE`,
    /// replacing an earlier one for that type.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSchema`] if `E::TYPE` is not a valid event type or
    /// the derived schema does not compile.
    pub fn with_event<E: Event>(self) -> Result<Self> {
        self.with_schema(E::TYPE, &E::schema())
    }
}

/// The schema file name of `E`: `<type>.schema.json`.
pub fn schema_file_name<E: Event>() -> String {
    format!("{}{SCHEMA_SUFFIX}", E::TYPE)
}

/// Checks that `dir/<type>.schema.json`, the schema file other languages read,
/// is the schema derived from `E` ([`Event::schema`]), so the two cannot drift.
/// Run it in a test, once per event type. `$id` and `$comment` in the file
/// are ignored; everything else must be equal as JSON.
///
/// When the environment variable `UPDATE_SCHEMAS` is set to `1`, a missing or
/// different file is written from the type instead (then review the diff and
/// commit it).
///
/// # Errors
/// [`ErrorKind::InvalidSchema`] naming the file and the first difference, or
/// why it cannot be read, parsed or written.
pub fn check_schema_file<E: Event>(dir: impl AsRef<Path>) -> Result<()> {
    let path = dir.as_ref().join(schema_file_name::<E>());
    let derived = E::schema();
    let invalid =
        |message: String| Error::new(ErrorKind::InvalidSchema, message).with_event_type(E::TYPE);
    let current = match std::fs::read_to_string(&path) {
        Ok(text) => Some(
            serde_json::from_str::<serde_json::Value>(&text)
                .map_err(|e| invalid(format!("schema {} is not JSON: {e}", path.display())))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(invalid(format!(
                "cannot read schema {}: {e}",
                path.display()
            )));
        }
    };
    let difference = match &current {
        None => Some("the file does not exist".to_owned()),
        Some(file) => first_difference("", &without_annotations(file), &derived),
    };
    let Some(difference) = difference else {
        return Ok(());
    };
    if std::env::var("UPDATE_SCHEMAS").is_ok_and(|v| v == "1") {
        let mut updated = derived;
        if let (Some(file), Some(map)) = (&current, updated.as_object_mut()) {
            for key in ANNOTATIONS {
                if let Some(value) = file.get(key) {
                    map.insert((*key).to_owned(), value.clone());
                }
            }
        }
        let mut text = serde_json::to_string_pretty(&updated)
            .map_err(|e| invalid(format!("cannot write the schema of `{}`: {e}", E::TYPE)))?;
        text.push('\n');
        return std::fs::write(&path, text)
            .map_err(|e| invalid(format!("cannot write schema {}: {e}", path.display())));
    }
    Err(invalid(format!(
        "schema {} differs from the one derived from {} ({difference}); \
         run the test with UPDATE_SCHEMAS=1 to rewrite it from the type",
        path.display(),
        std::any::type_name::<E>(),
    )))
}

/// Keys of a schema file that are the file's own, not the type's.
const ANNOTATIONS: &[&str] = &["$id", "$comment"];

fn without_annotations(schema: &serde_json::Value) -> serde_json::Value {
    let mut schema = schema.clone();
    if let Some(map) = schema.as_object_mut() {
        for key in ANNOTATIONS {
            map.remove(*key);
        }
    }
    schema
}

/// The JSON pointer of the first place `a` and `b` differ, with both values.
pub(crate) fn first_difference(
    at: &str,
    a: &serde_json::Value,
    b: &serde_json::Value,
) -> Option<String> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort_unstable();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let path = format!("{at}/{k}");
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => first_difference(&path, p, q),
                    (Some(p), None) => Some(format!("at {path}: {p} is not in the type's schema")),
                    (None, Some(q)) => Some(format!("at {path}: the type's schema has {q}")),
                    (None, None) => None,
                }
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(&format!("{at}/{i}"), p, q)),
        _ if a == b => None,
        _ => Some(format!(
            "at {}: {a} in the file, {b} in the type's schema",
            if at.is_empty() { "/" } else { at }
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    /// An order was placed.
    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    struct OrderPlaced {
        #[schemars(length(min = 1))]
        order_id: String,
        #[schemars(range(min = 0))]
        total_cents: i64,
    }

    impl Event for OrderPlaced {
        const TYPE: &'static str = "order.placed";
    }

    #[test]
    fn the_derived_schema_carries_the_type_the_docs_and_the_constraints() {
        let schema = OrderPlaced::schema();
        assert_eq!(schema["title"], "order.placed");
        assert_eq!(schema["description"], "An order was placed.");
        assert_eq!(
            schema["$schema"],
            "https://json-schema.org/draft/2020-12/schema"
        );
        assert_eq!(schema["additionalProperties"], false);
        assert_eq!(schema["properties"]["order_id"]["minLength"], 1);
        assert_eq!(schema["properties"]["total_cents"]["minimum"], 0);
    }

    #[test]
    fn a_registered_event_validates_its_payloads_by_its_derived_schema() {
        let registry = SchemaRegistry::new().with_event::<OrderPlaced>().unwrap();
        let ok = json!({"order_id": "o1", "total_cents": 5});
        registry.validate(OrderPlaced::TYPE, &ok).unwrap();
        let bad = json!({"order_id": "", "total_cents": -1, "extra": true});
        let err = registry.validate(OrderPlaced::TYPE, &bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::SchemaViolation);
        assert!(err.violations().len() >= 3, "{err}");
    }

    #[test]
    fn the_envelope_takes_its_type_from_the_event() {
        let data = OrderPlaced {
            order_id: "o1".into(),
            total_cents: 5,
        };
        let env = Envelope::event("shop", "o1", data).unwrap();
        assert_eq!(env.event_type().as_str(), "order.placed");
        assert_eq!(env.subject(), "o1");
    }

    #[test]
    fn a_schema_file_that_drifted_from_the_type_is_named_with_the_difference() {
        let dir = std::env::temp_dir().join(format!("outbox-pg-schemas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("order.placed.schema.json");

        // Missing.
        let _ = std::fs::remove_file(&path);
        let err = check_schema_file::<OrderPlaced>(&dir).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");

        // Equal, with the file's own $id.
        let mut file = OrderPlaced::schema();
        file["$id"] = json!("https://example.com/order.placed.schema.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&file).unwrap()).unwrap();
        check_schema_file::<OrderPlaced>(&dir).unwrap();

        // A constraint changed in the file only.
        file["properties"]["order_id"]["minLength"] = json!(2);
        std::fs::write(&path, serde_json::to_vec_pretty(&file).unwrap()).unwrap();
        let err = check_schema_file::<OrderPlaced>(&dir).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidSchema);
        let text = err.to_string();
        assert!(text.contains("/properties/order_id/minLength"), "{text}");
        assert!(text.contains("order.placed.schema.json"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
