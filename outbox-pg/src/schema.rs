//! JSON Schema validation of event payloads.
//!
//! Each event type has a schema at `schemas/events/<type>.schema.json` (JSON
//! Schema 2020-12). A [`SchemaRegistry`] reads a directory once, compiles every
//! schema, and then validates payloads without touching the file system.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result, Violation};
use crate::validate::validate_event_type;

/// File name suffix of a schema: `<type>.schema.json`.
pub const SCHEMA_SUFFIX: &str = ".schema.json";
/// At most this many violations are reported for one payload.
const MAX_VIOLATIONS: usize = 16;

/// Compiled validators, one per event type. Cheap to clone.
#[derive(Clone, Default)]
pub struct SchemaRegistry {
    validators: Arc<HashMap<String, Arc<jsonschema::Validator>>>,
}

impl fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<_> = self.validators.keys().collect();
        types.sort();
        f.debug_struct("SchemaRegistry")
            .field("event_types", &types)
            .finish()
    }
}

impl SchemaRegistry {
    /// A registry with no schemas: every event type is unknown.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads and compiles every `<type>.schema.json` in `dir` (not recursive).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSchema`] if the directory cannot be read, a file is not
    /// JSON, is not a valid JSON Schema, or its name is not a valid event type.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let read_err = |e: std::io::Error| {
            Error::new(
                ErrorKind::InvalidSchema,
                format!("cannot read schema directory {}: {e}", dir.display()),
            )
            .with_source(e)
        };
        let mut schemas = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let path = entry.map_err(read_err)?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(event_type) = name.strip_suffix(SCHEMA_SUFFIX) else {
                continue;
            };
            let text = std::fs::read_to_string(&path).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidSchema,
                    format!("cannot read schema {}: {e}", path.display()),
                )
                .with_source(e)
            })?;
            let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidSchema,
                    format!("schema {} is not JSON: {e}", path.display()),
                )
                .with_event_type(event_type)
                .with_source(e)
            })?;
            schemas.push((event_type.to_owned(), schema));
        }
        let mut registry = Self::new();
        for (event_type, schema) in schemas {
            registry = registry.with_schema(&event_type, &schema)?;
        }
        Ok(registry)
    }

    /// Adds (or replaces) the schema of one event type; use it to embed schemas
    /// at compile time with `include_str!`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSchema`] if `schema` is not a valid JSON Schema or
    /// `event_type` is not a valid event type.
    pub fn with_schema(mut self, event_type: &str, schema: &serde_json::Value) -> Result<Self> {
        validate_event_type(event_type).map_err(|e| {
            Error::new(
                ErrorKind::InvalidSchema,
                format!("schema for `{event_type}`: {e}"),
            )
            .with_event_type(event_type)
        })?;
        let validator = jsonschema::draft202012::new(schema).map_err(|e| {
            Error::new(
                ErrorKind::InvalidSchema,
                format!("schema for `{event_type}` is not a valid JSON Schema: {e}"),
            )
            .with_event_type(event_type)
        })?;
        Arc::make_mut(&mut self.validators).insert(event_type.to_owned(), Arc::new(validator));
        Ok(self)
    }

    /// The event types with a schema, sorted.
    pub fn event_types(&self) -> Vec<&str> {
        let mut types: Vec<&str> = self.validators.keys().map(String::as_str).collect();
        types.sort_unstable();
        types
    }

    /// Whether `event_type` has a schema.
    pub fn contains(&self, event_type: &str) -> bool {
        self.validators.contains_key(event_type)
    }

    /// Validates `data` against the schema of `event_type`.
    ///
    /// # Errors
    /// [`ErrorKind::UnknownEventType`] if there is no schema for the type;
    /// [`ErrorKind::SchemaViolation`] naming the type and, per failure, the JSON
    /// pointer and the reason (see [`Error::violations`]).
    pub fn validate(&self, event_type: &str, data: &serde_json::Value) -> Result<()> {
        let validator = self.validators.get(event_type).ok_or_else(|| {
            Error::new(
                ErrorKind::UnknownEventType,
                format!(
                    "unknown event type `{event_type}`: no schema {event_type}{SCHEMA_SUFFIX} is registered"
                ),
            )
            .with_event_type(event_type)
        })?;
        let violations: Vec<Violation> = validator
            .iter_errors(data)
            .take(MAX_VIOLATIONS)
            .map(|e| Violation {
                instance_path: e.instance_path().to_string(),
                schema_path: e.schema_path().to_string(),
                message: e.to_string(),
            })
            .collect();
        if violations.is_empty() {
            Ok(())
        } else {
            Err(Error::schema_violation(event_type, violations))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn registry() -> SchemaRegistry {
        SchemaRegistry::new()
            .with_schema(
                "subscription.created",
                &json!({
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "type": "object",
                    "required": ["plan", "amount_cents"],
                    "properties": {
                        "plan": {"type": "string", "minLength": 1},
                        "amount_cents": {"type": "integer", "minimum": 0}
                    },
                    "additionalProperties": false
                }),
            )
            .unwrap()
    }

    #[test]
    fn valid_payload_passes() {
        registry()
            .validate(
                "subscription.created",
                &json!({"plan": "pro", "amount_cents": 5}),
            )
            .unwrap();
    }

    #[test]
    fn violation_names_type_pointer_and_reason() {
        let err = registry()
            .validate(
                "subscription.created",
                &json!({"plan": "pro", "amount_cents": -1}),
            )
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::SchemaViolation);
        assert_eq!(err.event_type(), Some("subscription.created"));
        let v = &err.violations()[0];
        assert_eq!(v.instance_path, "/amount_cents");
        assert!(v.message.contains("minimum"), "{v:?}");
        assert!(err.to_string().contains("subscription.created"));
        assert!(err.to_string().contains("/amount_cents"));
    }

    #[test]
    fn unknown_type_is_named() {
        let err = registry().validate("nope.x", &json!({})).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnknownEventType);
        assert!(err.to_string().contains("nope.x"));
    }

    #[test]
    fn invalid_schema_is_rejected() {
        let err = SchemaRegistry::new()
            .with_schema("a.b", &json!({"type": 12}))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidSchema);
    }
}
