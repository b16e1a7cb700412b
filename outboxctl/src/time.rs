//! Time in flags: durations as people write them (`30d`, `12h`), and the
//! cutoff a window reaches back to.

use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// Parses a duration flag: `30d`, `14days`, `12h`, `90m`, `1h 30m`.
pub(crate) fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration (like 30d, 12h, 90m): {e}"))
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
    fn a_cutoff_out_of_the_calendar_is_a_config_error() {
        let e = cutoff(Duration::from_secs(u64::MAX / 4), "--older-than").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(cutoff(Duration::from_secs(3_600), "--older-than").is_ok());
    }
}
