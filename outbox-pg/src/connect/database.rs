//! `--database-url` / `--database-url-file`: where PostgreSQL is and how to
//! reach it, TLS included.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::redact::{self, SECRET_PARAMETERS, UrlProblem, redact_url};
use super::secret::{ExposeSecret, Secret, inline_or_file};
use crate::error::{Error, ErrorKind, Result};

/// How to reach PostgreSQL, as flags and environment variables: exactly one
/// of `--database-url` (`DATABASE_URL`) and `--database-url-file`
/// (`DATABASE_URL_FILE`). `#[command(flatten)]` it into a binary's arguments.
///
/// The URL carries the TLS settings, as libpq's do: `sslmode=require`
/// (encrypted), `verify-ca` (and the server's certificate signed by
/// `sslrootcert`), `verify-full` (and its name matching the host), plus
/// `sslcert` / `sslkey` for a client certificate. The `PGSSLMODE`,
/// `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY` and `PGPASSWORD` environment
/// variables fill what the URL leaves out. TLS needs a TLS backend of sqlx in
/// the final binary (`sqlx/tls-rustls-ring-webpki`); this crate chooses none.
///
/// `Debug` shows the URL with its password masked ([`redact_url`]).
///
/// ```
/// use clap::Parser;
/// use outbox_pg::connect::DatabaseArgs;
///
/// #[derive(Debug, Parser)]
/// struct Args {
///     #[command(flatten)]
///     database: DatabaseArgs,
/// }
///
/// let args = Args::try_parse_from([
///     "app",
///     "--database-url",
///     "postgres://app:s3cret@db/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
/// ])?;
/// assert!(!format!("{args:?}").contains("s3cret"));
/// # Ok::<(), clap::Error>(())
/// ```
#[derive(Clone, clap::Args)]
#[group(id = "DatabaseArgs", required = true, multiple = false)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, e.g. postgres://app@db/app?sslmode=verify-full&sslrootcert=ca.pem
    /// (prefer DATABASE_URL or --database-url-file: argv is visible to `ps`).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "DATABASE_URL"
    )]
    pub database_url: Option<Secret>,

    /// File holding the PostgreSQL URL (a trailing newline is ignored).
    #[arg(long, env = "DATABASE_URL_FILE", value_name = "PATH")]
    pub database_url_file: Option<PathBuf>,
}

impl DatabaseArgs {
    /// Arguments naming `url` directly (for programs that build them in code).
    pub fn from_url(url: impl Into<Secret>) -> Self {
        Self {
            database_url: Some(url.into()),
            database_url_file: None,
        }
    }

    /// The URL, read from `--database-url-file` if that is the one given.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if neither is set, or the file cannot be read
    /// (the message names the flag and the path).
    pub fn url(&self) -> Result<Secret> {
        inline_or_file(
            self.database_url.as_ref(),
            self.database_url_file.as_deref(),
            "--database-url-file",
        )?
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Config,
                "no database: set --database-url (DATABASE_URL) or --database-url-file (DATABASE_URL_FILE)",
            )
        })
    }

    /// The URL with its password masked, for logs; `"<unreadable>"` if the
    /// file cannot be read.
    pub fn redacted(&self) -> String {
        self.url().map_or_else(
            |_| "<unreadable>".to_owned(),
            |url| redact_url(url.expose_secret()),
        )
    }

    /// Parsed connection options, TLS settings included.
    ///
    /// The URL is parsed before sqlx reads it, so that no error and no log
    /// line shows a piece of its password: a URL that does not parse, or
    /// whose password holds an unencoded `/`, `?` or `#` (so that where it
    /// ends cannot be told), is refused naming what is wrong, and shown as
    /// `postgres://***@` and what follows its last `@`. Query parameters
    /// holding a secret that sqlx does not read (`sslpassword`, `pass`,
    /// `token`) are dropped with a warning naming them, before sqlx would log
    /// their value.
    ///
    /// # Errors
    /// As [`DatabaseArgs::url`]; [`ErrorKind::Config`] if the URL does not
    /// parse, is ambiguous or sqlx refuses a setting (the message shows the
    /// URL with its password masked).
    pub fn connect_options(&self) -> Result<PgConnectOptions> {
        let url = self.url()?;
        let raw = url.expose_secret();
        let mut parsed = redact::parse(raw).map_err(|problem| invalid_url(raw, problem))?;
        let dropped = redact::remove_query_parameters(&mut parsed, |name| {
            !name.eq_ignore_ascii_case("password")
                && SECRET_PARAMETERS
                    .iter()
                    .any(|secret| name.eq_ignore_ascii_case(secret))
        });
        for parameter in dropped {
            tracing::warn!(
                %parameter,
                "ignoring a parameter of the database URL that sqlx does not read (its value is not logged)"
            );
        }
        PgConnectOptions::from_str(parsed.as_str()).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("the database URL {} is invalid: {e}", redact_url(raw)),
            )
            .with_source(e)
        })
    }

    /// Opens a pool with `pool`'s settings; the first connection is made
    /// before this returns, so a refused TLS handshake or password fails here.
    /// Then checks that the URL gives each connection a session of its own
    /// ([`crate::require_sessions`]): the binaries' queries are named
    /// prepared statements, and the relay and consumers hold session locks,
    /// neither of which survives a transaction pooler.
    ///
    /// `extra_float_digits`, a startup parameter sqlx sends by default and
    /// PgBouncer refuses unless configured to ignore it, is not sent: the
    /// server's default (PostgreSQL 12+) prints floats exactly already.
    ///
    /// # Errors
    /// As [`DatabaseArgs::connect_options`]; [`ErrorKind::Database`] if the
    /// server cannot be reached or refuses the connection (the message names
    /// the URL with its password masked and sqlx's reason, e.g. an unknown
    /// certificate issuer); [`ErrorKind::Config`] if the URL leads to a
    /// transaction pooler.
    pub async fn connect(&self, pool: PgPoolOptions) -> Result<PgPool> {
        let options = self.connect_options()?.extra_float_digits(None);
        let shown = self.redacted();
        tracing::info!(database = %shown, "connecting to the database");
        let pool = pool.connect_with(options.clone()).await.map_err(|e| {
            Error::new(
                ErrorKind::Database,
                format!(
                    "connecting to the database at {shown}: {}",
                    crate::db_error_text(&e)
                ),
            )
            .with_source(e)
        })?;
        let program = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "this program".to_owned());
        crate::require_sessions(&options, &program).await?;
        Ok(pool)
    }
}

/// The error for a database URL that [`redact::parse`] refused: what is
/// wrong, and the URL with nothing of its user info when that cannot be told.
fn invalid_url(raw: &str, problem: UrlProblem) -> Error {
    let message = match &problem {
        UrlProblem::NotAUrl => format!("the database URL {problem}"),
        _ => format!("the database URL {} {problem}", redact_url(raw)),
    };
    let error = Error::new(ErrorKind::Config, message);
    match problem {
        UrlProblem::Invalid(e) => error.with_source(e),
        _ => error,
    }
}

impl fmt::Debug for DatabaseArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseArgs")
            .field(
                "database_url",
                &self
                    .database_url
                    .as_ref()
                    .map(|url| redact_url(url.expose_secret())),
            )
            .field("database_url_file", &self.database_url_file)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use clap::{Args as _, FromArgMatches as _};

    use super::*;

    #[derive(Debug)]
    struct Args {
        database: DatabaseArgs,
    }

    /// Parses flags alone: the environment of the test run (a developer's
    /// `DATABASE_URL`) is not read.
    fn parse(args: &[&str]) -> std::result::Result<Args, clap::Error> {
        let command = DatabaseArgs::augment_args(clap::Command::new("app"))
            .mut_args(|arg| arg.env(None::<&str>));
        let matches =
            command.try_get_matches_from(std::iter::once("app").chain(args.iter().copied()))?;
        Ok(Args {
            database: DatabaseArgs::from_arg_matches(&matches)?,
        })
    }

    #[test]
    fn debug_masks_the_password() {
        let args = parse(&["--database-url", "postgres://app:pg-s3cret@db/app"]).unwrap();
        let shown = format!("{args:?}");
        assert!(!shown.contains("pg-s3cret"), "{shown}");
        assert!(shown.contains("postgres://app:***@db/app"), "{shown}");
    }

    #[test]
    fn the_url_and_its_file_exclude_each_other() {
        let err = parse(&[
            "--database-url",
            "postgres://db/a",
            "--database-url-file",
            "/f",
        ])
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn the_url_is_read_from_its_file() {
        let dir = std::env::temp_dir().join(format!("outbox-dburl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("url");
        std::fs::write(&path, "postgres://app:pw@db:5433/app?sslmode=require\n").unwrap();
        let args = parse(&["--database-url-file", path.to_str().unwrap()]).unwrap();
        let options = args.database.connect_options().unwrap();
        assert_eq!(options.get_port(), 5433);
        assert_eq!(options.get_database(), Some("app"));
        assert_eq!(
            args.database.redacted(),
            "postgres://app:***@db:5433/app?sslmode=require"
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let err = args.database.url().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("--database-url-file"), "{err}");
    }

    /// A password holding every character that ends or splits a URL part.
    const PASSWORD: &str = "Zq7,Wm3#xK9/pL?r2@Tn%5:Vb8";

    fn assert_no_piece(text: &str) {
        for start in 0..PASSWORD.len() - 2 {
            let piece = &PASSWORD[start..start + 3];
            assert!(!text.contains(piece), "`{piece}` of the password in {text}");
        }
    }

    #[test]
    fn a_percent_encoded_password_connects_and_a_raw_one_is_refused_unseen() {
        let encoded = "Zq7%2CWm3%23xK9%2FpL%3Fr2%40Tn%255%3AVb8";
        let args = DatabaseArgs::from_url(format!("postgres://relay_secret:{encoded}@db:5433/app"));
        let options = args.connect_options().unwrap();
        assert_eq!(options.get_host(), "db");
        assert_eq!(options.get_port(), 5433);
        assert_eq!(options.get_username(), "relay_secret");
        assert_eq!(args.redacted(), "postgres://relay_secret:***@db:5433/app");
        for url in [
            format!("postgres://relay_secret:{PASSWORD}@db:5433/app"),
            format!("postgres://relay_secret:{PASSWORD}@db:54x33/app"),
            format!("postgres://relay_secret:{PASSWORD}"),
            "postgres://relay_secret:Zq7,Wm3xK9pL#r2@db/app".to_owned(),
            format!("relay_secret:{PASSWORD}@db/app"),
        ] {
            let args = DatabaseArgs::from_url(url.clone());
            let err = args.connect_options().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            let text = format!("{err} {err:?} {args:?} {}", args.redacted());
            assert_no_piece(&text);
            assert!(text.contains("database URL"), "{text}");
        }
        // A comma, a colon, a `%` and an `@` need no encoding.
        let args = DatabaseArgs::from_url("postgres://relay_secret:Zq7,Wm3:K9%p@Lr2@db/app");
        assert_eq!(args.connect_options().unwrap().get_host(), "db");
        assert_eq!(args.redacted(), "postgres://relay_secret:***@db/app");
    }

    #[test]
    fn clap_errors_do_not_echo_the_url() {
        let url = format!("postgres://relay_secret:{PASSWORD}@db/app");
        for args in [
            vec!["--database-url", url.as_str(), "--database-url-file", "/f"],
            vec![
                "--database-url",
                url.as_str(),
                "--database-url",
                url.as_str(),
            ],
            vec!["--database-url", url.as_str(), "--no-such-flag"],
        ] {
            let err = parse(&args).unwrap_err();
            assert_no_piece(&format!("{err} {}", err.render()));
        }
    }

    #[test]
    fn secret_parameters_sqlx_does_not_read_are_dropped() {
        let args = DatabaseArgs::from_url(
            "postgres://db/app?sslpassword=Zq7Wm3&sslmode=disable&token=Zq7Wm3",
        );
        args.connect_options().unwrap();
        assert_eq!(
            args.redacted(),
            "postgres://db/app?sslpassword=***&sslmode=disable&token=***"
        );
    }
}
