//! The length of PostgreSQL's text rendering of a `jsonb` value, which is what
//! the relay sends as an event's `data`.
//!
//! The relay publishes `data::text` as it is: the payload a consumer receives
//! is the stored value digit for digit, whichever client wrote the row, with no
//! parse and re-rendering that could round a number PostgreSQL holds exactly
//! and a 64-bit float does not. That text is not the compact JSON the writer
//! serialized: `jsonb` puts a space after every `:` and `,`, and writes every
//! number out in plain decimal (`1e300` is stored as a 301-digit integer,
//! `1.5e-7` as `0.00000015`). So the writer's size check measures this
//! rendering instead, computed from the value it inserts; an event it accepts
//! is never too large for the relay to send.

use serde_json::Value;

/// Bytes of `value::jsonb::text` for a value that sqlx sends as serde_json's
/// compact text. Key order (which `jsonb` changes) does not change the length.
pub(crate) fn rendered_len(value: &Value) -> usize {
    // An explicit stack: the value may be nested deeper than the call stack
    // would like (the depth check of `check_json_decodable` comes separately).
    let mut len = 0;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        len += match v {
            Value::Null => "null".len(),
            Value::Bool(true) => "true".len(),
            Value::Bool(false) => "false".len(),
            Value::Number(n) => numeric_len(&n.to_string()),
            Value::String(s) => string_len(s),
            Value::Array(items) => {
                stack.extend(items);
                "[]".len() + ", ".len() * items.len().saturating_sub(1)
            }
            Value::Object(map) => {
                stack.extend(map.values());
                let keys: usize = map.keys().map(|k| string_len(k) + ": ".len()).sum();
                "{}".len() + keys + ", ".len() * map.len().saturating_sub(1)
            }
        };
    }
    len
}

/// A string as `jsonb` writes it (PostgreSQL's `escape_json`): quoted, with
/// `"` `\` and the short-form controls escaped in two bytes, other control
/// characters as `\u00XX`, everything else (non-ASCII included) as it is.
fn string_len(s: &str) -> usize {
    let escaped: usize = s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | 0x08 | 0x0c | b'\n' | b'\r' | b'\t' => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum();
    escaped + 2
}

/// A JSON number as PostgreSQL's `numeric` writes it: plain decimal, no
/// exponent, as many fraction digits as the input had after its point minus
/// its exponent (never fewer than zero), no sign on zero. `text` is serde_json's
/// rendering of a number (digits, at most one `.`, an optional exponent).
fn numeric_len(text: &str) -> usize {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(i) => (
            &unsigned[..i],
            unsigned[i + 1..]
                .trim_start_matches('+')
                .parse::<i64>()
                .unwrap_or(0),
        ),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits: Vec<u8> = int.bytes().chain(frac.bytes()).collect();
    let count = i64::try_from(digits.len()).unwrap_or(i64::MAX);
    let frac_len = i64::try_from(frac.len()).unwrap_or(i64::MAX);
    let int_len = i64::try_from(int.len()).unwrap_or(i64::MAX);
    // Where the point falls among the digits once the exponent is applied.
    let point = int_len.saturating_add(exponent);
    let scale = frac_len.saturating_sub(exponent).max(0);
    let integer_digits = if point <= 0 {
        1
    } else {
        let shown = usize::try_from(point.min(count)).unwrap_or(0);
        let leading_zeros = digits[..shown].iter().take_while(|&&d| d == b'0').count();
        let leading_zeros = i64::try_from(leading_zeros).unwrap_or(0);
        (point - leading_zeros).max(1)
    };
    let zero = digits.iter().all(|&d| d == b'0');
    let sign = i64::from(negative && !zero);
    let fraction = if scale > 0 { 1 + scale } else { 0 };
    usize::try_from(sign + integer_digits + fraction).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn numbers_are_measured_as_numeric_writes_them() {
        // What PostgreSQL 15 prints for each (`select '<n>'::jsonb::text`).
        let long_int = format!("1{}", "0".repeat(300));
        let tiny = format!("0.{}5", "0".repeat(323));
        for (n, pg) in [
            ("0", "0"),
            ("-0.0", "0.0"),
            ("1e300", long_int.as_str()),
            ("1e+300", long_int.as_str()),
            ("1.5e-7", "0.00000015"),
            ("0.001", "0.001"),
            ("-1e-3", "-0.001"),
            ("1E+2", "100"),
            ("123.0", "123.0"),
            ("-42", "-42"),
            ("18446744073709551615", "18446744073709551615"),
            ("5e-324", tiny.as_str()),
            ("1.25e2", "125"),
            ("1.255e1", "12.55"),
        ] {
            assert_eq!(numeric_len(n), pg.len(), "{n}");
        }
    }

    #[test]
    fn structure_gets_the_spaces_jsonb_puts_in() {
        let v = json!({"b": 1, "a": [1, 2, {}], "c": "\u{1}\n\"/é"});
        // {"a": [1, 2, {}], "b": 1, "c": "\u0001\n\"/é"}
        assert_eq!(
            rendered_len(&v),
            r#"{"a": [1, 2, {}], "b": 1, "c": "\u0001\n\"/é"}"#.len()
        );
        assert_eq!(rendered_len(&json!([])), 2);
        assert_eq!(rendered_len(&json!({})), 2);
        assert_eq!(rendered_len(&json!([null, true, false])), 19);
    }

    #[test]
    fn a_float_is_measured_from_the_text_serde_json_sends() {
        let v = json!([1e300, 1.5e-7]);
        assert_eq!(serde_json::to_string(&v).unwrap(), "[1e+300,1.5e-7]");
        assert_eq!(rendered_len(&v), 2 + 301 + 2 + 10);
    }
}
