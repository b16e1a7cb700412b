//! The CloudEvents `sequence` extension: an event's insert-order number.
//!
//! The relay numbers every row of `outbox_events` in insert order and sends the
//! number as the `sequence` attribute. The CloudEvents sequence extension asks
//! for a string that orders *lexicographically*, so the number is written as
//! decimal digits zero-padded to [`SEQUENCE_WIDTH`] characters (the width of
//! `u64::MAX`): `"00000000000000000042"` sorts before `"00000000000000000100"`,
//! as 42 comes before 100.
//!
//! [`format_sequence`] and [`parse_sequence`] are the one definition the relay,
//! [`Envelope`](crate::Envelope) and consumers share.

use crate::error::{Error, ErrorKind, Result};

/// Characters in a formatted sequence: the decimal width of `u64::MAX`.
pub const SEQUENCE_WIDTH: usize = 20;

/// Formats `seq` as the `sequence` attribute: exactly [`SEQUENCE_WIDTH`]
/// decimal digits, zero-padded, so string order is numeric order.
///
/// ```
/// assert_eq!(outbox_pg::format_sequence(42), "00000000000000000042");
/// ```
pub fn format_sequence(seq: u64) -> String {
    format!("{seq:0SEQUENCE_WIDTH$}")
}

/// Parses a `sequence` attribute: decimal digits, zero-padded or not.
///
/// ```
/// assert_eq!(outbox_pg::parse_sequence("00000000000000000042").ok(), Some(42));
/// assert_eq!(outbox_pg::parse_sequence("42").ok(), Some(42));
/// assert!(outbox_pg::parse_sequence("+42").is_err());
/// ```
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`], with a message naming `sequence`, if `s` is
/// empty, holds anything but the ASCII digits `0`–`9` (a sign, a space, a
/// decimal point), or is greater than `u64::MAX`.
pub fn parse_sequence(s: &str) -> Result<u64> {
    let invalid = |why: &str| {
        Error::new(
            ErrorKind::InvalidEnvelope,
            format!(
                "invalid envelope sequence `{}`: {why}",
                crate::validate::excerpt(s)
            ),
        )
    };
    if s.is_empty() {
        return Err(invalid("it is empty"));
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("it must be decimal digits only"));
    }
    s.parse::<u64>()
        .map_err(|_| invalid("it is greater than the largest 64-bit unsigned integer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_to_fixed_width() {
        assert_eq!(format_sequence(0), "00000000000000000000");
        assert_eq!(format_sequence(1), "00000000000000000001");
        assert_eq!(format_sequence(u64::MAX), "18446744073709551615");
        assert_eq!(format_sequence(u64::MAX).len(), SEQUENCE_WIDTH);
    }

    #[test]
    fn string_order_is_numeric_order() {
        let mut values = [1, 100, 9, 10, 99, 1_000_000, u64::MAX, 0, 11];
        let mut strings: Vec<String> = values.iter().copied().map(format_sequence).collect();
        strings.sort();
        values.sort_unstable();
        let expected: Vec<String> = values.iter().copied().map(format_sequence).collect();
        assert_eq!(strings, expected);
    }

    #[test]
    fn round_trips() {
        for seq in [0, 1, 42, 1 << 40, i64::MAX as u64, u64::MAX - 1, u64::MAX] {
            assert_eq!(parse_sequence(&format_sequence(seq)).unwrap(), seq);
        }
    }

    #[test]
    fn accepts_unpadded_and_overpadded_digits() {
        assert_eq!(parse_sequence("7").unwrap(), 7);
        assert_eq!(parse_sequence("0").unwrap(), 0);
        assert_eq!(parse_sequence("00000000000000000000000000007").unwrap(), 7);
    }

    #[test]
    fn refuses_what_is_not_a_u64_in_decimal_digits() {
        for bad in [
            "",
            " 1",
            "1 ",
            "+1",
            "-1",
            "1.0",
            "1e3",
            "0x10",
            "abc",
            "１",
            "18446744073709551616",
            "99999999999999999999999",
        ] {
            let err = parse_sequence(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidEnvelope, "{bad:?}");
            assert!(err.to_string().contains("sequence"), "{err}");
        }
    }
}
