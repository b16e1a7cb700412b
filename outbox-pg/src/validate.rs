//! What an event must satisfy to be publishable, checked before it is written.
//!
//! An event that is accepted here can be published by the relay and decoded by
//! consumers. Each rule exists because something downstream would otherwise fail:
//!
//! - [`validate_event_type`]: the type is the NATS subject, so it must be a
//!   literal subject outside the server's reserved namespaces (`$JS.`, `$SYS.`,
//!   `$KV.`, … and `_INBOX.`).
//! - [`validate_traceparent`] / [`validate_tracestate`]: both travel as NATS
//!   headers, where a line break would end the header block; they must also be
//!   well-formed W3C trace context for tracers to use them.
//! - [`validate_time`]: RFC 3339 writes the year in four digits.
//! - [`check_json_decodable`]: consumers decode `data` with ordinary JSON
//!   libraries, which keep numbers as 64-bit floats and bound nesting depth.
//!
//! The outbox applies every rule before it inserts anything, and the relay applies
//! the same functions to rows other writers inserted.

use std::fmt;

use chrono::{DateTime, Datelike, Utc};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::error::{Error, ErrorKind, Result};

/// Longest accepted `tracestate`, in bytes (the W3C limit vendors must propagate).
pub const MAX_TRACESTATE_LEN: usize = 512;
/// Longest accepted event type, in bytes.
pub const MAX_EVENT_TYPE_LEN: usize = 255;
/// Longest accepted `source` or `subject`, in bytes.
pub const MAX_ATTRIBUTE_LEN: usize = 1024;

/// Deepest accepted nesting of arrays and objects in `data`.
///
/// serde_json refuses by default to decode more than 127 nested levels; the
/// envelope around `data` is one of them.
pub const MAX_JSON_DEPTH: usize = 126;

/// Longest excerpt of an offending value quoted in an error message, in characters.
const EXCERPT_LEN: usize = 96;

/// `s` with control characters escaped (a line break shows as `\n`) and cut to
/// a readable length, for quoting in an error message.
pub(crate) fn excerpt(s: &str) -> String {
    let mut out: String = s.escape_debug().take(EXCERPT_LEN).collect();
    if s.escape_debug().nth(EXCERPT_LEN).is_some() {
        out.push('…');
    }
    out
}

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidEnvelope, message)
}

/// Checks that `s` is usable as an event type and NATS subject.
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`], with a message naming the offending part, if
/// `s` is empty, longer than [`MAX_EVENT_TYPE_LEN`], has an empty token (`a..b`,
/// `.a`, `a.`), contains whitespace, a control character, `*` or `>`, or lies in
/// a NATS reserved namespace: a first token starting with `$` (`$JS`, `$SYS`,
/// `$KV`, `$O`, …) or the `_INBOX` prefix.
pub fn validate_event_type(s: &str) -> Result<()> {
    let fail = |why: &str| {
        Err(invalid(format!("invalid event type `{}`: {why}", excerpt(s))).with_event_type(s))
    };
    if s.is_empty() {
        return fail("it is empty");
    }
    if s.len() > MAX_EVENT_TYPE_LEN {
        return fail(&format!(
            "it is {} bytes, longer than {MAX_EVENT_TYPE_LEN} bytes",
            s.len()
        ));
    }
    if let Some(c) = s
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '*' | '>'))
    {
        return fail(&format!(
            "it contains {c:?}, which a NATS subject cannot carry"
        ));
    }
    if s.split('.').any(str::is_empty) {
        return fail("it has an empty token (leading, trailing or doubled `.`)");
    }
    let first = s.split('.').next().unwrap_or_default();
    if first.starts_with('$') {
        return fail(&format!(
            "`{first}` is a NATS reserved namespace (subjects starting with `$` belong \
             to the server: JetStream, system, KV and object store APIs)"
        ));
    }
    if first == "_INBOX" {
        return fail("`_INBOX` is the NATS reserved namespace for request-reply inboxes");
    }
    Ok(())
}

/// Checks a W3C `traceparent`: `version-traceid-parentid-flags`, that is 2, 32,
/// 16 and 2 lowercase hex digits separated by `-`, with a version other than
/// `ff` and a trace-id and parent-id that are not all zeros.
///
/// ```
/// outbox_pg::validate_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")?;
/// assert!(outbox_pg::validate_traceparent("00-4bf9\n").is_err());
/// # Ok::<(), outbox_pg::Error>(())
/// ```
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`], with a message containing `traceparent`, the
/// value (control characters escaped) and what is wrong with it.
pub fn validate_traceparent(s: &str) -> Result<()> {
    let fail = |why: &str| {
        Err(invalid(format!(
            "invalid traceparent `{}`: {why}",
            excerpt(s)
        )))
    };
    if let Some(c) = s
        .chars()
        .find(|c| !matches!(c, '0'..='9' | 'a'..='f' | '-'))
    {
        return fail(&format!(
            "it contains {c:?}; only lowercase hex digits and `-` are allowed"
        ));
    }
    let fields: Vec<&str> = s.split('-').collect();
    let [version, trace_id, parent_id, flags] = fields.as_slice() else {
        return fail(&format!(
            "it has {} `-`-separated fields, not the 4 of `version-traceid-parentid-flags`",
            fields.len()
        ));
    };
    for (name, field, len) in [
        ("version", version, 2),
        ("trace-id", trace_id, 32),
        ("parent-id", parent_id, 16),
        ("trace-flags", flags, 2),
    ] {
        if field.len() != len {
            return fail(&format!(
                "the {name} has {} hex digits, not {len}",
                field.len()
            ));
        }
    }
    if *version == "ff" {
        return fail("version `ff` is invalid");
    }
    if trace_id.bytes().all(|b| b == b'0') {
        return fail("the trace-id is all zeros");
    }
    if parent_id.bytes().all(|b| b == b'0') {
        return fail("the parent-id is all zeros");
    }
    Ok(())
}

/// Checks a W3C `tracestate`: at most [`MAX_TRACESTATE_LEN`] bytes of printable
/// ASCII (`0x20`–`0x7E`), a comma-separated list of non-empty `key=value`
/// members, with optional spaces around the commas.
///
/// ```
/// outbox_pg::validate_tracestate("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE")?;
/// assert!(outbox_pg::validate_tracestate("rojo=1\r\ncongo=2").is_err());
/// # Ok::<(), outbox_pg::Error>(())
/// ```
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`], with a message containing `tracestate` and
/// what is wrong: too long, a character outside printable ASCII (a line break,
/// a tab, a non-ASCII letter), an empty member, or a member that is not
/// `key=value`.
pub fn validate_tracestate(s: &str) -> Result<()> {
    let fail = |why: &str| {
        Err(invalid(format!(
            "invalid tracestate `{}`: {why}",
            excerpt(s)
        )))
    };
    if s.len() > MAX_TRACESTATE_LEN {
        return fail(&format!(
            "it is {} bytes, over the limit of {MAX_TRACESTATE_LEN}",
            s.len()
        ));
    }
    if let Some(c) = s.chars().find(|c| !matches!(c, ' '..='~')) {
        return fail(&format!(
            "it contains {c:?}; only printable ASCII (0x20-0x7E) is allowed"
        ));
    }
    for (i, member) in s.split(',').map(|m| m.trim_matches(' ')).enumerate() {
        let n = i + 1;
        if member.is_empty() {
            return fail(&format!("list member {n} is empty"));
        }
        let Some((key, value)) = member.split_once('=') else {
            return fail(&format!("list member {n} `{member}` is not `key=value`"));
        };
        if key.is_empty() || value.is_empty() {
            return fail(&format!(
                "list member {n} `{member}` has an empty key or value"
            ));
        }
        if key.contains(' ') {
            return fail(&format!(
                "list member {n} `{member}` has a space in its key"
            ));
        }
    }
    Ok(())
}

/// Checks that `time` can be written as an RFC 3339 timestamp: its year is
/// within `1..=9999`.
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`], with a message containing `time` and the year.
pub fn validate_time(time: DateTime<Utc>) -> Result<()> {
    let year = time.year();
    if (1..=9999).contains(&year) {
        return Ok(());
    }
    Err(invalid(format!(
        "invalid envelope time `{time}`: year {year} is outside 1..=9999 \
         (RFC 3339 writes a four-digit year)"
    )))
}

/// Checks that `raw` is one JSON value that consumers can decode: it parses,
/// every number fits a finite 64-bit float (`1e400` and a 400-digit integer do
/// not), and arrays and objects nest at most [`MAX_JSON_DEPTH`] deep.
///
/// The text is walked, not built into a value, so the check allocates next to
/// nothing.
///
/// ```
/// outbox_pg::check_json_decodable(r#"{"amount": 12.5, "tags": ["a"]}"#)?;
/// assert!(outbox_pg::check_json_decodable(r#"{"n": 1e400}"#).is_err());
/// # Ok::<(), outbox_pg::Error>(())
/// ```
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`], with a message containing `data` and what
/// the decoder reported, with its line and column.
pub fn check_json_decodable(raw: &str) -> Result<()> {
    let mut de = serde_json::Deserializer::from_str(raw);
    Walk { depth: 0 }
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| {
            invalid(format!("data is not JSON that consumers can decode: {e}")).with_source(e)
        })
}

/// serde_json, when its `arbitrary_precision` feature is on (any crate in a
/// build may turn it on), hands a number to `deserialize_any` as a one-entry map
/// under this key, with the number's text as the value.
const ARBITRARY_PRECISION_NUMBER: &str = "$serde_json::private::Number";

/// Walks one JSON value at `depth` enclosing arrays and objects.
#[derive(Clone, Copy)]
struct Walk {
    depth: usize,
}

impl Walk {
    fn enter<E: de::Error>(self) -> std::result::Result<Self, E> {
        let depth = self.depth + 1;
        if depth > MAX_JSON_DEPTH {
            return Err(E::custom(format_args!(
                "arrays and objects nested deeper than {MAX_JSON_DEPTH} levels"
            )));
        }
        Ok(Self { depth })
    }
}

impl<'de> DeserializeSeed<'de> for Walk {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> std::result::Result<(), E> {
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<(), E> {
        finite(v)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let inner = self.enter()?;
        while seq.next_element_seed(inner)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let mut inner = None;
        while let Some(key) = map.next_key_seed(Key)? {
            if key == KeyKind::ArbitraryPrecisionNumber && inner.is_none() {
                return map.next_value_seed(NumberText);
            }
            let walk = match inner {
                Some(walk) => walk,
                None => *inner.insert(self.enter()?),
            };
            map.next_value_seed(walk)?;
        }
        if inner.is_none() {
            self.enter::<A::Error>()?;
        }
        Ok(())
    }
}

fn finite<E: de::Error>(v: f64) -> std::result::Result<(), E> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(E::custom("number out of range of a 64-bit float"))
    }
}

#[derive(PartialEq, Eq)]
enum KeyKind {
    ArbitraryPrecisionNumber,
    Other,
}

/// An object key, checked only for serde_json's number marker.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = KeyKind;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<KeyKind, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Key {
    type Value = KeyKind;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> std::result::Result<KeyKind, E> {
        Ok(if key == ARBITRARY_PRECISION_NUMBER {
            KeyKind::ArbitraryPrecisionNumber
        } else {
            KeyKind::Other
        })
    }
}

/// The text of a number under serde_json's `arbitrary_precision`.
struct NumberText;

impl<'de> DeserializeSeed<'de> for NumberText {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for NumberText {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> std::result::Result<(), E> {
        match text.parse::<f64>() {
            Ok(v) => finite(v),
            Err(_) => Err(E::custom(format_args!("`{text}` is not a number"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn message(r: Result<()>) -> String {
        let err = r.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidEnvelope);
        err.to_string()
    }

    #[test]
    fn reserved_nats_namespaces_are_refused_by_name() {
        for (bad, namespace) in [
            ("$JS.API.STREAM.DELETE.X", "`$JS`"),
            ("$SYS.x", "`$SYS`"),
            ("$KV.bucket.key", "`$KV`"),
            ("$O.store.x", "`$O`"),
            ("$JSC.x", "`$JSC`"),
            ("$", "`$`"),
            ("$foo", "`$foo`"),
            ("_INBOX.abc", "`_INBOX`"),
            ("_INBOX", "`_INBOX`"),
            ("_INBOX.abc.def", "`_INBOX`"),
        ] {
            let msg = message(validate_event_type(bad));
            assert!(msg.contains("invalid event type"), "{msg}");
            assert!(
                msg.contains(namespace) && msg.contains("reserved namespace"),
                "{msg}"
            );
        }
    }

    #[test]
    fn dollar_and_inbox_elsewhere_are_fine() {
        for good in [
            "a.$JS",
            "orders.$x",
            "_INBOXES.a",
            "_inbox.a",
            "my_INBOX.a",
            "a._INBOX",
        ] {
            validate_event_type(good).unwrap();
        }
    }

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn w3c_traceparents_are_accepted() {
        for good in [
            TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-09",
        ] {
            validate_traceparent(good).unwrap();
        }
    }

    #[test]
    fn malformed_traceparents_are_refused_with_the_reason() {
        let cases = [
            (format!("{TRACEPARENT}\n"), r"\n"),
            (
                "00-4bf92f3577b34da6\r\na3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
                r"\r",
            ),
            (TRACEPARENT.to_uppercase(), "lowercase hex"),
            (String::new(), "1 `-`-separated fields"),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7".into(),
                "not the 4",
            ),
            (format!("{TRACEPARENT}-00"), "not the 4"),
            (
                "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                "version has 1",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01".into(),
                "trace-id has 31",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01".into(),
                "parent-id has 15",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1".into(),
                "trace-flags has 1",
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                "version `ff`",
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01".into(),
                "trace-id is all zeros",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".into(),
                "parent-id is all zeros",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g".into(),
                "'g'",
            ),
            (
                "00 4bf92f3577b34da6a3ce929d0e0e4736 00f067aa0ba902b7 01".into(),
                "' '",
            ),
        ];
        for (bad, reason) in cases {
            let msg = message(validate_traceparent(&bad));
            assert!(msg.contains("traceparent"), "{msg}");
            assert!(msg.contains(reason), "{msg} !~ {reason}");
            assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg:?}");
        }
    }

    #[test]
    fn w3c_tracestates_are_accepted() {
        for good in [
            "k=v",
            "rojo=00f067aa0ba902b7",
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7 , congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7,   congo=t61rcWkgMzE  ",
            "fw529a3039@dt=ZmY0Yjk4ZDkwMjMzNDM0ZQ==",
            "vendor=value with spaces",
        ] {
            validate_tracestate(good).unwrap();
        }
        validate_tracestate(&format!("k={}", "v".repeat(MAX_TRACESTATE_LEN - 2))).unwrap();
    }

    #[test]
    fn malformed_tracestates_are_refused_with_the_reason() {
        let too_long = format!("k={}", "v".repeat(MAX_TRACESTATE_LEN - 1));
        let cases = [
            ("k=v\r\nX-Injected: 1", r"'\r'"),
            ("k=v\nother=1", r"'\n'"),
            ("k=\tv", r"'\t'"),
            ("k=caf\u{e9}", "'\u{e9}'"),
            ("k=v\u{7f}", r"'\u{7f}'"),
            (too_long.as_str(), "over the limit of 512"),
            ("", "member 1 is empty"),
            ("  ", "member 1 is empty"),
            ("a=1,,b=2", "member 2 is empty"),
            ("a=1,", "member 2 is empty"),
            ("novalue", "not `key=value`"),
            ("=v", "empty key or value"),
            ("k=", "empty key or value"),
            ("a b=1", "space in its key"),
        ];
        for (bad, reason) in cases {
            let msg = message(validate_tracestate(bad));
            assert!(msg.contains("tracestate"), "{msg}");
            assert!(msg.contains(reason), "{msg} !~ {reason}");
            assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg:?}");
        }
    }

    #[test]
    fn times_need_a_four_digit_year() {
        let at = |y: i32| Utc.with_ymd_and_hms(y, 1, 1, 0, 0, 0).unwrap();
        for good in [1, 1970, 2026, 9999] {
            validate_time(at(good)).unwrap();
        }
        validate_time(Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap()).unwrap();
        for (bad, year) in [(10000, "year 10000"), (0, "year 0"), (-1, "year -1")] {
            let msg = message(validate_time(at(bad)));
            assert!(msg.contains("time") && msg.contains(year), "{msg}");
        }
        message(validate_time(DateTime::<Utc>::MAX_UTC));
        message(validate_time(DateTime::<Utc>::MIN_UTC));
    }

    #[test]
    fn decodable_json_is_accepted() {
        for good in [
            "null",
            "true",
            "0",
            "-12.5e3",
            "1.7976931348623157e308",
            "-1.7976931348623157e308",
            "1e-400",
            "18446744073709551615",
            "-9223372036854775808",
            "123456789012345678901234567890",
            r#""\ud83d\ude00 é""#,
            r#"{"a":[1,{"b":null}],"c":"d","":{}}"#,
            " [ ] ",
        ] {
            check_json_decodable(good).unwrap();
        }
    }

    #[test]
    fn numbers_beyond_a_float_are_refused() {
        let big_integer = "9".repeat(400);
        for bad in [
            "1e400".to_owned(),
            "-1e400".to_owned(),
            r#"{"n":1e400}"#.to_owned(),
            format!("[1,{big_integer}]"),
            format!("-{big_integer}"),
            "1.8e308".to_owned(),
        ] {
            let msg = message(check_json_decodable(&bad));
            assert!(
                msg.contains("data") && msg.contains("out of range"),
                "{msg}"
            );
        }
    }

    #[test]
    fn what_is_not_json_is_refused() {
        for bad in [
            "",
            "{",
            "{\"a\":1}x",
            "NaN",
            "Infinity",
            "[1,]",
            "'a'",
            r#""\ud800""#,
        ] {
            let msg = message(check_json_decodable(bad));
            assert!(msg.contains("data"), "{msg}");
        }
    }

    fn nested(depth: usize) -> String {
        let mut s = String::new();
        for i in 0..depth {
            s.push_str(if i % 2 == 0 { "[" } else { "{\"k\":" });
        }
        s.push('1');
        for i in (0..depth).rev() {
            s.push(if i % 2 == 0 { ']' } else { '}' });
        }
        s
    }

    #[test]
    fn nesting_is_bounded() {
        check_json_decodable(&nested(MAX_JSON_DEPTH)).unwrap();
        for depth in [MAX_JSON_DEPTH + 1, 1_000, 100_000] {
            let msg = message(check_json_decodable(&nested(depth)));
            assert!(
                msg.contains("data") && msg.contains("nested deeper"),
                "{msg}"
            );
        }
        // Empty containers count too.
        let empty = format!(
            "{}{}",
            "[".repeat(MAX_JSON_DEPTH + 1),
            "]".repeat(MAX_JSON_DEPTH + 1)
        );
        message(check_json_decodable(&empty));
        let empty = format!(
            "{}{}",
            "{\"a\":".repeat(MAX_JSON_DEPTH) + "{",
            "}".repeat(MAX_JSON_DEPTH + 1)
        );
        message(check_json_decodable(&empty));
    }

    #[test]
    fn the_deepest_accepted_data_decodes_inside_an_envelope() {
        let envelope = |data: &str| {
            format!(
                r#"{{"specversion":"1.0","id":"0190a5f2-7c3e-7000-8000-000000000000","source":"s","type":"a","subject":"s","time":"2026-01-01T00:00:00Z","data":{data}}}"#
            )
        };
        let deepest = nested(MAX_JSON_DEPTH);
        check_json_decodable(&deepest).unwrap();
        crate::Envelope::<serde_json::Value>::from_json(envelope(&deepest).as_bytes()).unwrap();
        let deeper = nested(MAX_JSON_DEPTH + 1);
        assert!(
            crate::Envelope::<serde_json::Value>::from_json(envelope(&deeper).as_bytes()).is_err(),
            "serde_json's own limit is where MAX_JSON_DEPTH assumes"
        );
    }

    #[test]
    fn excerpts_escape_and_truncate() {
        assert_eq!(excerpt("a\nb"), r"a\nb");
        let long = "x".repeat(500);
        let e = excerpt(&long);
        assert!(e.ends_with('…') && e.chars().count() == EXCERPT_LEN + 1);
    }
}
