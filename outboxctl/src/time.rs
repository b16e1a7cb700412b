//! Time in flags: durations as people write them (`30d`, `12h`), the cutoff
//! a window reaches back to, and a time given either way (`--due-before`).

use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// Parses a duration flag: `30d`, `14days`, `12h`, `90m`, `1h 30m`.
pub(crate) fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration (like 30d, 12h, 90m): {e}"))
}

/// A time given on the command line: an RFC 3339 timestamp, or a duration
/// from now (by the database's clock, where it is compared).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    /// This time.
    At(chrono::DateTime<chrono::Utc>),
    /// This long from now.
    In(Duration),
}

impl Until {
    /// As two query parameters: the time, or the milliseconds from now.
    pub(crate) fn split(
        this: Option<Self>,
    ) -> (Option<chrono::DateTime<chrono::Utc>>, Option<i64>) {
        match this {
            Some(Self::At(at)) => (Some(at), None),
            Some(Self::In(d)) => (None, Some(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))),
            None => (None, None),
        }
    }
}

/// Parses a time flag: `2026-12-01T09:00:00Z` (RFC 3339), or `10m`, `2h`,
/// `3d` from now.
pub(crate) fn parse_until(text: &str) -> std::result::Result<Until, String> {
    let t = text.trim();
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(t) {
        return Ok(Until::At(at.with_timezone(&chrono::Utc)));
    }
    humantime::parse_duration(t).map(Until::In).map_err(|_| {
        format!(
            "`{text}` is neither an RFC 3339 time (like 2026-12-01T09:00:00Z) nor a duration \
             from now (like 10m, 2h, 3d)"
        )
    })
}

/// `now - window`.
///
/// # Errors
/// [`ErrorKind::Config`] when the window reaches out of the calendar.
pub(crate) fn cutoff(window: Duration, flag: &str) -> Result<chrono::DateTime<chrono::Utc>> {
    chrono::Duration::from_std(window)
        .ok()
        .and_then(|window| chrono::Utc::now().checked_sub_signed(window))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Config,
                format!("{flag} {}: too long", humantime::format_duration(window)),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_duration("14d"), Ok(Duration::from_secs(14 * 86_400)));
        assert_eq!(parse_duration("90m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_duration(" 1h 30m "), Ok(Duration::from_secs(5_400)));
        assert!(parse_duration("soon").unwrap_err().contains("`soon`"));
    }

    #[test]
    fn times_read_as_a_timestamp_or_a_duration_from_now() {
        assert_eq!(parse_until("10m"), Ok(Until::In(Duration::from_secs(600))));
        let at = parse_until("2026-12-01T10:00:00+01:00").unwrap();
        let Until::At(at) = at else { panic!("{at:?}") };
        assert_eq!(at.to_rfc3339(), "2026-12-01T09:00:00+00:00");
        assert!(parse_until("tomorrow").unwrap_err().contains("RFC 3339"));
        assert_eq!(Until::split(None), (None, None));
        assert_eq!(
            Until::split(Some(Until::In(Duration::from_secs(2)))),
            (None, Some(2000))
        );
    }

    #[test]
    fn a_cutoff_out_of_the_calendar_is_a_config_error() {
        let e = cutoff(Duration::from_secs(u64::MAX / 4), "--older-than").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(cutoff(Duration::from_secs(3_600), "--older-than").is_ok());
    }
}
