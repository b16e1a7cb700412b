//! A string that never shows in logs, and reading one from a file.

use std::fmt;
use std::path::Path;

use crate::error::{Error, ErrorKind, Result};

/// A secret string: a password, a token, an nkey seed, a database URL with
/// its password.
///
/// `Debug` and `Display` print `[redacted]`, so a secret inside an arguments
/// struct, an error or a log field does not leak; read the value with
/// [`Secret::expose_secret`] only where it is handed to a client.
///
/// ```
/// use outbox_pg::connect::Secret;
///
/// let token = Secret::from("s3cret".to_owned());
/// assert_eq!(format!("{token:?} {token}"), "Secret([redacted]) [redacted]");
/// assert_eq!(token.expose_secret(), "s3cret");
/// ```
#[derive(Clone, Default)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself: pass it to the client that needs it, never to a
    /// log.
    pub fn expose_secret(&self) -> &str {
        &self.0
    }

    /// Reads a secret from the file at `path`, without its trailing line
    /// break (`\n` or `\r\n`, as `echo` or an editor leaves it). `flag` names
    /// where the path came from (for example `--nats-token-file`) in the
    /// error.
    ///
    /// # Errors
    /// [`ErrorKind::Config`], naming `flag` and `path`, if the file cannot be
    /// read, is not UTF-8, or holds nothing but line breaks.
    pub fn from_file(path: &Path, flag: &str) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("{flag}: cannot read {}: {e}", path.display()),
            )
            .with_source(e)
        })?;
        let mut text = String::from_utf8(bytes).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("{flag}: {} is not UTF-8 text", path.display()),
            )
            .with_source(e)
        })?;
        let kept = text.trim_end_matches(['\n', '\r']).len();
        text.truncate(kept);
        if text.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("{flag}: {} is empty", path.display()),
            ));
        }
        Ok(Self(text))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

/// Either the inline secret or the one in `file`; `None` if neither is set.
pub(crate) fn inline_or_file(
    inline: Option<&Secret>,
    file: Option<&Path>,
    file_flag: &str,
) -> Result<Option<Secret>> {
    match (inline, file) {
        (Some(secret), _) => Ok(Some(secret.clone())),
        (None, Some(path)) => Secret::from_file(path, file_flag).map(Some),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_never_show_the_value() {
        let secret = Secret::from("hunter2");
        assert!(!format!("{secret:?}").contains("hunter2"));
        assert!(!format!("{secret}").contains("hunter2"));
        assert!(!format!("{:?}", Some(secret.clone())).contains("hunter2"));
        assert_eq!(secret.expose_secret(), "hunter2");
    }

    #[test]
    fn a_file_loses_its_trailing_line_break_only() {
        let dir = std::env::temp_dir().join(format!("outbox-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, " to ken \r\n").unwrap();
        assert_eq!(
            Secret::from_file(&path, "--x-file")
                .unwrap()
                .expose_secret(),
            " to ken "
        );
        std::fs::write(&path, "\n").unwrap();
        let err = Secret::from_file(&path, "--x-file").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("is empty"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unreadable_file_names_the_flag_and_the_path() {
        let err =
            Secret::from_file(Path::new("/nonexistent/token"), "--nats-token-file").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        let text = err.to_string();
        assert!(text.contains("--nats-token-file"), "{text}");
        assert!(text.contains("/nonexistent/token"), "{text}");
    }
}
