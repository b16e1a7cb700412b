//! A string that never shows in logs ([`secrecy`]), and reading one from a file.

use std::path::Path;

use crate::error::{Error, ErrorKind, Result};

/// A secret string: a password, a token, an nkey seed, a database URL with
/// its password ([`secrecy::SecretString`], zeroed when dropped).
///
/// `Debug` prints `[REDACTED]` and there is no `Display`, so a secret inside
/// an arguments struct, an error or a log field does not leak; read the value
/// with [`ExposeSecret::expose_secret`] only where it is handed to a client.
///
/// ```
/// use outbox_pg::connect::{ExposeSecret, Secret};
///
/// let token = Secret::from("s3cret");
/// assert!(!format!("{token:?}").contains("s3cret"));
/// assert_eq!(token.expose_secret(), "s3cret");
/// ```
pub type Secret = secrecy::SecretString;

pub use secrecy::ExposeSecret;

/// Reads a secret from the file at `path`, without its trailing line break
/// (`\n` or `\r\n`, as `echo` or an editor leaves it). `flag` names where
/// the path came from (for example `--nats-token-file`) in the error.
///
/// # Errors
/// [`ErrorKind::Config`], naming `flag` and `path`, if the file cannot be
/// read, is not UTF-8, or holds nothing but line breaks.
pub fn secret_from_file(path: &Path, flag: &str) -> Result<Secret> {
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
    Ok(Secret::from(text))
}

/// Either the inline secret or the one in `file`; `None` if neither is set.
pub(crate) fn inline_or_file(
    inline: Option<&Secret>,
    file: Option<&Path>,
    file_flag: &str,
) -> Result<Option<Secret>> {
    match (inline, file) {
        (Some(secret), _) => Ok(Some(secret.clone())),
        (None, Some(path)) => secret_from_file(path, file_flag).map(Some),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value() {
        let secret = Secret::from("hunter2");
        assert!(!format!("{secret:?}").contains("hunter2"));
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
            secret_from_file(&path, "--x-file").unwrap().expose_secret(),
            " to ken "
        );
        std::fs::write(&path, "\n").unwrap();
        let err = secret_from_file(&path, "--x-file").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("is empty"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unreadable_file_names_the_flag_and_the_path() {
        let err =
            secret_from_file(Path::new("/nonexistent/token"), "--nats-token-file").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        let text = err.to_string();
        assert!(text.contains("--nats-token-file"), "{text}");
        assert!(text.contains("/nonexistent/token"), "{text}");
    }
}
