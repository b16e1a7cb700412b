//! `--nats-*`: where NATS is, who we are to it, and TLS.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::ConnectErrorKind;

use super::redact::{self, UrlCredentials, UrlProblem};
use super::secret::{ExposeSecret, Secret, inline_or_file};
use super::violations::{self, Violations};
use crate::error::{Error, ErrorKind, Result};

/// How to reach NATS: the URL, credentials and TLS, as flags and environment
/// variables. `#[command(flatten)]` it into a binary's arguments.
///
/// Every secret can come from the environment or from a file instead of argv
/// (which `ps` shows): `--nats-password` / `--nats-password-file`,
/// `--nats-token` / `--nats-token-file`, `--nats-nkey` (a seed) /
/// `--nats-nkey-file`, each pair mutually exclusive, each with its
/// environment variable (`NATS_PASSWORD`, `NATS_PASSWORD_FILE`, …). A file's
/// trailing newline is ignored. `--nats-creds` names a credentials file (user
/// JWT and seed, decentralised auth).
///
/// TLS: `--nats-tls-ca` to verify the server (and require TLS),
/// `--nats-tls-cert` with `--nats-tls-key` for a client certificate (mutual
/// TLS). A `tls://` URL requires TLS with the system's roots.
///
/// Credentials may also be written into the URL (`nats://user:password@host`,
/// `nats://token@host`, percent-encoded): they are taken out of it and given
/// to the client as `--nats-user`/`--nats-password` or `--nats-token` would
/// be, so the client never holds, nor logs, a URL with a secret. In a list,
/// every URL carries the same credentials or none does.
///
/// A server error the client is told of (`-ERR`) is logged at error level
/// with the server's text: a missing permission (`Permissions Violation for
/// Publish to "$JS.API.CONSUMER.MSG.NEXT.OUTBOX.billing"`) names the subject,
/// where the request itself would only time out. See
/// [`permission_denied`](Self::permission_denied).
///
/// `Debug` redacts every secret, and a password or token in the URL.
#[derive(Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated: every node of a cluster
    /// (`nats://a:4222,nats://b:4222,nats://c:4222`).
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,

    /// NATS user (with --nats-password or --nats-password-file).
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,

    /// NATS password (prefer NATS_PASSWORD or --nats-password-file: argv is visible to `ps`).
    #[arg(
        long,
        env = "NATS_PASSWORD",
        hide_env_values = true,
        conflicts_with = "nats_password_file"
    )]
    pub nats_password: Option<Secret>,

    /// File holding the NATS password.
    #[arg(long, env = "NATS_PASSWORD_FILE", value_name = "PATH")]
    pub nats_password_file: Option<PathBuf>,

    /// NATS token (prefer NATS_TOKEN or --nats-token-file).
    #[arg(
        long,
        env = "NATS_TOKEN",
        hide_env_values = true,
        conflicts_with = "nats_token_file"
    )]
    pub nats_token: Option<Secret>,

    /// File holding the NATS token.
    #[arg(long, env = "NATS_TOKEN_FILE", value_name = "PATH")]
    pub nats_token_file: Option<PathBuf>,

    /// NATS nkey seed (prefer NATS_NKEY or --nats-nkey-file).
    #[arg(
        long,
        env = "NATS_NKEY",
        hide_env_values = true,
        conflicts_with = "nats_nkey_file"
    )]
    pub nats_nkey: Option<Secret>,

    /// File holding the NATS nkey seed (`SU…`).
    #[arg(long, env = "NATS_NKEY_FILE", value_name = "PATH")]
    pub nats_nkey_file: Option<PathBuf>,

    /// NATS credentials file (JWT + nkey seed).
    #[arg(long, env = "NATS_CREDS", value_name = "PATH")]
    pub nats_creds: Option<PathBuf>,

    /// CA certificate (PEM) to verify the NATS server's TLS certificate; requires TLS.
    #[arg(long, env = "NATS_TLS_CA", value_name = "PATH")]
    pub nats_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for TLS client authentication, with --nats-tls-key.
    #[arg(long, env = "NATS_TLS_CERT", value_name = "PATH")]
    pub nats_tls_cert: Option<PathBuf>,

    /// Client key (PEM) for TLS client authentication.
    #[arg(long, env = "NATS_TLS_KEY", value_name = "PATH")]
    pub nats_tls_key: Option<PathBuf>,

    /// Prefix of the reply subjects the client listens on (default `_INBOX`).
    /// JetStream answers on them, pulled messages included: give each NATS
    /// user a prefix of its own (`_INBOX_billing`) and allow it only
    /// `<prefix>.>` in `subscribe`, so no other user can listen in on its
    /// deliveries (docs/security.md, "NATS").
    #[arg(long, env = "NATS_INBOX_PREFIX", value_name = "PREFIX")]
    pub nats_inbox_prefix: Option<String>,

    /// TEST ONLY: drain (close for good) the first NATS client this process
    /// connects, this long after it connected, as a fault in the client
    /// would; shows how the process recovers.
    #[arg(long, env = "OUTBOX_TEST_CLOSE_NATS_AFTER", hide = true, value_parser = humantime::parse_duration)]
    pub nats_test_close_after: Option<Duration>,

    /// The server errors of the clients connected with these arguments (and
    /// their clones).
    #[arg(skip)]
    violations: Violations,
}

impl Default for NatsArgs {
    /// `nats://127.0.0.1:4222`, no credentials, no TLS.
    fn default() -> Self {
        Self::new("nats://127.0.0.1:4222")
    }
}

impl NatsArgs {
    /// Arguments for `url`, no credentials, no TLS; set the public fields for
    /// more.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            nats_url: url.into(),
            nats_user: None,
            nats_password: None,
            nats_password_file: None,
            nats_token: None,
            nats_token_file: None,
            nats_nkey: None,
            nats_nkey_file: None,
            nats_creds: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            nats_inbox_prefix: None,
            nats_test_close_after: None,
            violations: Violations::default(),
        }
    }

    /// The inbox prefix of `--nats-inbox-prefix`, checked: a subject of
    /// tokens without wildcards, spaces or an empty token.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] naming the prefix and what is wrong with it.
    pub fn inbox_prefix(&self) -> Result<Option<&str>> {
        let Some(prefix) = self.nats_inbox_prefix.as_deref() else {
            return Ok(None);
        };
        let problem = if prefix.is_empty() {
            Some("is empty")
        } else if prefix.split('.').any(str::is_empty) {
            Some("has an empty token (a leading, trailing or doubled `.`)")
        } else if prefix.contains(['*', '>']) {
            Some("holds a wildcard (`*` or `>`)")
        } else if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            Some("holds white space or a control character")
        } else {
            None
        };
        match problem {
            None => Ok(Some(prefix)),
            Some(problem) => Err(Error::new(
                ErrorKind::Config,
                format!(
                    "--nats-inbox-prefix (NATS_INBOX_PREFIX) `{prefix}` {problem}: give a subject such as `_INBOX_billing`"
                ),
            )),
        }
    }

    /// The URL(s) with any password or token masked, for logs. The URLs are
    /// parsed, not split on characters, so a password holding `,` `#` `/`
    /// `?` `@` `%` `:` is masked whole; a list that does not parse shows
    /// nothing before its last `@`.
    pub fn redacted_url(&self) -> String {
        redact::redact_nats_urls(&self.nats_url)
    }

    /// The server URLs of `--nats-url`, without credentials: split on
    /// commas, whitespace trimmed, empty entries dropped (`"nats://a:4222,
    /// nats://b:4222"` is two servers), as the `nats` CLI and the other NATS
    /// clients read it; `nats://` added to an address without a scheme.
    ///
    /// The client is given all of them: it connects to one, and after a
    /// disconnect tries the others and the servers the cluster announced
    /// since, so a node that dies does not take the connection with it.
    /// Credentials written into the URLs go to the client through
    /// [`connect_options`](Self::connect_options).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if a URL does not parse, a password in one
    /// holds an unencoded `/`, `?` or `#`, or the URLs carry different
    /// credentials (the message shows the URLs with their secrets masked).
    pub fn server_urls(&self) -> Result<Vec<String>> {
        self.servers().map(|servers| servers.urls)
    }

    fn servers(&self) -> Result<redact::NatsServers> {
        redact::nats_servers(&self.nats_url).map_err(|problem| {
            let message = match &problem {
                UrlProblem::NotAUrl => format!("--nats-url (NATS_URL) {problem}"),
                _ => format!("--nats-url (NATS_URL) {} {problem}", self.redacted_url()),
            };
            let error = Error::new(ErrorKind::Config, message);
            match problem {
                UrlProblem::Invalid(e) => error.with_source(e),
                _ => error,
            }
        })
    }

    /// The password, from `--nats-password` or its file.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if the file cannot be read.
    pub fn password(&self) -> Result<Option<Secret>> {
        inline_or_file(
            self.nats_password.as_ref(),
            self.nats_password_file.as_deref(),
            "--nats-password-file",
        )
    }

    /// The token, from `--nats-token` or its file.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if the file cannot be read.
    pub fn token(&self) -> Result<Option<Secret>> {
        inline_or_file(
            self.nats_token.as_ref(),
            self.nats_token_file.as_deref(),
            "--nats-token-file",
        )
    }

    /// The nkey seed, from `--nats-nkey` or its file, checked to be a seed.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if the file cannot be read or the value is not
    /// an nkey seed.
    pub fn nkey_seed(&self) -> Result<Option<Secret>> {
        let seed = inline_or_file(
            self.nats_nkey.as_ref(),
            self.nats_nkey_file.as_deref(),
            "--nats-nkey-file",
        )?;
        if let Some(seed) = &seed {
            nkeys::KeyPair::from_seed(seed.expose_secret()).map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("--nats-nkey (or its file) is not an nkey seed: {e}"),
                )
                .with_source(e)
            })?;
        }
        Ok(seed)
    }

    /// The client options these arguments describe, named `name`: secrets
    /// read, pairs checked, TLS set up. The client reconnects forever after
    /// a disconnect. Its event callback logs every server error at error
    /// level, with the server's text, and keeps the last permissions
    /// violation for [`permission_violation`](Self::permission_violation)
    /// (an `event_callback` set on the options afterwards replaces it).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] if a secret file or the credentials file cannot
    /// be read, an nkey seed is malformed, one half of a pair is missing
    /// (user and password, client certificate and key), the URLs do not
    /// parse ([`server_urls`](Self::server_urls)), or carry credentials the
    /// flags give too.
    pub async fn connect_options(&self, name: &str) -> Result<async_nats::ConnectOptions> {
        let mut options = async_nats::ConnectOptions::new()
            .name(name)
            .max_reconnects(None);
        if let Some(prefix) = self.inbox_prefix()? {
            options = options.custom_inbox_prefix(prefix);
        }
        let (seen, client) = (self.violations.clone(), name.to_owned());
        let inbox = self
            .inbox_prefix()?
            .unwrap_or(DEFAULT_INBOX_PREFIX)
            .to_owned();
        options = options.event_callback(move |event| {
            seen.observe(&event, &client, &inbox);
            std::future::ready(())
        });
        let options = self.with_url_credentials(options)?;
        let options = self.with_flag_credentials(options).await?;
        self.with_tls(options)
    }

    /// `options` with the credentials `--nats-url` carries, if any; refused
    /// if the `--nats-*` flags give credentials too.
    fn with_url_credentials(
        &self,
        options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions> {
        let Some(credentials) = self.servers()?.credentials else {
            return Ok(options);
        };
        if self.nats_user.is_some()
            || self.password()?.is_some()
            || self.token()?.is_some()
            || self.nats_nkey.is_some()
            || self.nats_nkey_file.is_some()
            || self.nats_creds.is_some()
        {
            return Err(Error::new(
                ErrorKind::Config,
                "--nats-url carries credentials and so do the --nats-* flags: give them once",
            ));
        }
        Ok(match credentials {
            UrlCredentials::UserPassword { user, password } => {
                options.user_and_password(user, password.expose_secret().to_owned())
            }
            UrlCredentials::Token(token) => options.token(token.expose_secret().to_owned()),
        })
    }

    /// `options` with the credentials of the flags: user and password,
    /// token, nkey seed, credentials file.
    async fn with_flag_credentials(
        &self,
        mut options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions> {
        match (&self.nats_user, self.password()?) {
            (Some(user), Some(password)) => {
                options =
                    options.user_and_password(user.clone(), password.expose_secret().to_owned());
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(Error::new(
                    ErrorKind::Config,
                    "--nats-user needs --nats-password or --nats-password-file",
                ));
            }
            (None, Some(_)) => {
                return Err(Error::new(
                    ErrorKind::Config,
                    "a NATS password needs --nats-user",
                ));
            }
        }
        if let Some(token) = self.token()? {
            options = options.token(token.expose_secret().to_owned());
        }
        if let Some(seed) = self.nkey_seed()? {
            options = options.nkey(seed.expose_secret().to_owned());
        }
        if let Some(path) = &self.nats_creds {
            options = options.credentials_file(path).await.map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("--nats-creds: cannot read {}: {e}", path.display()),
                )
                .with_source(e)
            })?;
        }
        Ok(options)
    }

    /// `options` requiring TLS with the flags' root certificates and client
    /// certificate, where given.
    fn with_tls(
        &self,
        mut options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions> {
        if let Some(ca) = &self.nats_tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        match (&self.nats_tls_cert, &self.nats_tls_key) {
            (Some(cert), Some(key)) => Ok(options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true)),
            (None, None) => Ok(options),
            _ => Err(Error::new(
                ErrorKind::Config,
                "--nats-tls-cert and --nats-tls-key go together",
            )),
        }
    }

    /// Connects as `name`.
    ///
    /// The first attempt tells a refusal from an absence: a server that
    /// rejects the credentials or the TLS handshake is an error at once,
    /// while one that cannot be reached yet is waited for in the background
    /// (the client keeps retrying, publishes fail fast meanwhile), so a
    /// broker that is down does not stop the process.
    ///
    /// Every URL of `--nats-url` is given to the client
    /// ([`server_urls`](Self::server_urls)); the first attempt tries each.
    ///
    /// # Errors
    /// As [`NatsArgs::connect_options`]; [`ErrorKind::Config`] if
    /// `--nats-url` names no server or does not parse; [`ErrorKind::Broker`] if the server
    /// refuses the credentials (authorization violation) or the TLS handshake
    /// fails, or the URL is invalid.
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client> {
        // What an earlier client was refused is not this one's.
        self.violations.clear();
        let shown = self.redacted_url();
        let urls = self.server_urls()?;
        if urls.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                "--nats-url (NATS_URL) names no server",
            ));
        }
        let first = self
            .connect_options(name)
            .await?
            .connect(urls.as_slice())
            .await;
        let error = match first {
            Ok(client) => {
                tracing::info!(nats = %shown, "connected to NATS");
                self.close_for_test(&client);
                return Ok(client);
            }
            Err(e) => e,
        };
        match error.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                return Err(Error::new(
                    ErrorKind::Broker,
                    format!(
                        "NATS at {shown} refused the credentials ({error}): check --nats-user/--nats-password, \
                         --nats-token, --nats-nkey or --nats-creds"
                    ),
                )
                .with_source(error));
            }
            _ if is_tls_failure(&error) => {
                return Err(Error::new(
                    ErrorKind::Broker,
                    format!(
                        "TLS with NATS at {shown} failed ({error}): check --nats-tls-ca, \
                         --nats-tls-cert and --nats-tls-key"
                    ),
                )
                .with_source(error));
            }
            _ => {}
        }
        tracing::warn!(nats = %shown, error = %error, "NATS is not reachable yet; connecting in the background");
        self.connect_options(name)
            .await?
            .retry_on_initial_connect()
            .connect(urls.as_slice())
            .await
            .inspect(|client| self.close_for_test(client))
            .map_err(|e| {
                Error::new(
                    ErrorKind::Broker,
                    format!("connecting to NATS at {shown}: {e}"),
                )
                .with_source(e)
            })
    }

    /// The last permissions violation the server reported to a client
    /// connected with these arguments (or a clone of them) since the last
    /// [`connect`](Self::connect), in the server's words, which name the
    /// operation and the subject: `Permissions Violation for Publish to
    /// "$JS.API.STREAM.INFO.OUTBOX"`.
    pub fn permission_violation(&self) -> Option<String> {
        self.violations.last()
    }

    /// Resolves once the server reports a permissions violation to a client
    /// connected with these arguments (or a clone of them), at once if it
    /// did since the last [`connect`](Self::connect): an error naming the
    /// subject and the permission to add it to.
    ///
    /// A request the user may not publish, or whose reply it may not
    /// receive, gets no answer: it times out, and a start-up that waits for
    /// a broker would wait for ever. Race the start-up against this instead,
    /// so that it stops at once naming what is missing:
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let nats = outbox_pg::connect::NatsArgs::new("nats://127.0.0.1:4222");
    /// let client = nats.connect("my-service").await?;
    /// let js = async_nats::jetstream::new(client);
    /// let stream = tokio::select! {
    ///     stream = js.get_stream("OUTBOX") => stream?,
    ///     denied = nats.permission_denied() => return Err(denied.into()),
    /// };
    /// # let _ = stream; Ok(()) }
    /// ```
    ///
    /// The error is of kind [`ErrorKind::Broker`].
    pub async fn permission_denied(&self) -> Error {
        let text = self.violations.next().await;
        let prefix = self
            .nats_inbox_prefix
            .as_deref()
            .unwrap_or(DEFAULT_INBOX_PREFIX);
        violations::denied(&text, &self.redacted_url(), prefix)
    }

    /// `--nats-test-close-after`: drains the process's first client after
    /// the delay, once.
    fn close_for_test(&self, client: &async_nats::Client) {
        static CLOSED_ONCE: AtomicBool = AtomicBool::new(false);
        let Some(after) = self.nats_test_close_after else {
            return;
        };
        if CLOSED_ONCE.swap(true, Ordering::SeqCst) {
            return;
        }
        let client = client.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            tracing::warn!("TEST ONLY: closing the NATS client (--nats-test-close-after)");
            if let Err(e) = client.drain().await {
                tracing::warn!(error = %e, "TEST ONLY: draining the NATS client failed");
            }
        });
    }
}

/// async-nats' inbox prefix when none is given.
const DEFAULT_INBOX_PREFIX: &str = "_INBOX";

/// Whether the connection failed in the TLS handshake: a certificate not
/// trusted, a client certificate the server requires and did not get. These
/// do not heal by retrying. async-nats reports some as [`ConnectErrorKind::Tls`]
/// and others as I/O errors wrapping a rustls error.
fn is_tls_failure(error: &async_nats::ConnectError) -> bool {
    if error.kind() == ConnectErrorKind::Tls {
        return true;
    }
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        if e.is::<async_nats::rustls::Error>() {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io
                .get_ref()
                .is_some_and(|inner| inner.is::<async_nats::rustls::Error>())
        {
            return true;
        }
        cause = e.source();
    }
    false
}

impl fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsArgs")
            .field("nats_url", &self.redacted_url())
            .field("nats_user", &self.nats_user)
            .field("nats_password", &self.nats_password)
            .field("nats_password_file", &self.nats_password_file)
            .field("nats_token", &self.nats_token)
            .field("nats_token_file", &self.nats_token_file)
            .field("nats_nkey", &self.nats_nkey)
            .field("nats_nkey_file", &self.nats_nkey_file)
            .field("nats_creds", &self.nats_creds)
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("nats_inbox_prefix", &self.nats_inbox_prefix)
            .field("nats_test_close_after", &self.nats_test_close_after)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use clap::{Args as _, FromArgMatches as _};

    use super::*;

    /// Parses flags alone, ignoring the test run's environment.
    fn parse(args: &[&str]) -> std::result::Result<NatsArgs, clap::Error> {
        let command =
            NatsArgs::augment_args(clap::Command::new("app")).mut_args(|arg| arg.env(None::<&str>));
        let matches =
            command.try_get_matches_from(std::iter::once("app").chain(args.iter().copied()))?;
        NatsArgs::from_arg_matches(&matches)
    }

    #[test]
    fn debug_redacts_every_secret() {
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let args = parse(&[
            "--nats-url",
            "nats://url-token@127.0.0.1:4222",
            "--nats-user",
            "relay",
            "--nats-password",
            "pw-s3cret",
            "--nats-token",
            "tok-s3cret",
            "--nats-nkey",
            &seed,
        ])
        .unwrap();
        let shown = format!("{args:?}");
        for secret in ["url-token", "pw-s3cret", "tok-s3cret", seed.as_str()] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("relay"), "{shown}");
    }

    #[test]
    fn inline_secrets_exclude_their_files() {
        for (inline, file) in [
            ("--nats-password", "--nats-password-file"),
            ("--nats-token", "--nats-token-file"),
            ("--nats-nkey", "--nats-nkey-file"),
        ] {
            let err = parse(&[inline, "x", file, "/f"]).unwrap_err();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{inline}"
            );
        }
    }

    #[test]
    fn a_comma_separated_url_is_every_node_of_a_cluster() {
        let args = parse(&[
            "--nats-url",
            " nats://a:4222, nats://b:4222 ,,nats://c:4222 ",
        ])
        .unwrap();
        assert_eq!(
            args.server_urls().unwrap(),
            ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
        );
        assert_eq!(
            NatsArgs::new("nats://127.0.0.1:4222")
                .server_urls()
                .unwrap(),
            ["nats://127.0.0.1:4222"]
        );
        assert!(NatsArgs::new(" , ").server_urls().unwrap().is_empty());
        // Each is a server address async-nats accepts.
        for url in args.server_urls().unwrap() {
            url.parse::<async_nats::ServerAddr>().unwrap();
        }
    }

    #[test]
    fn every_url_of_the_list_is_redacted() {
        let args = NatsArgs::new("nats://u:pw-a@a:4222, nats://u:pw-a@b:4222,tls://u:pw-a@c:4222");
        let shown = format!("{} {args:?}", args.redacted_url());
        assert!(!shown.contains("pw-a"), "{shown}");
        for host in ["u:***@a:4222", "u:***@b:4222", "tls://u:***@c:4222"] {
            assert!(shown.contains(host), "{host} missing from {shown}");
        }
        let args = NatsArgs::new("nats://tok-b@a:4222,nats://tok-b@b:4222");
        let shown = format!("{} {args:?}", args.redacted_url());
        assert!(!shown.contains("tok-b"), "{shown}");
        assert!(shown.contains("nats://***@b:4222"), "{shown}");
    }

    #[tokio::test]
    async fn credentials_in_the_url_leave_it_for_the_client_options() {
        let args = NatsArgs::new("nats://relay:p%2Cw%23d@a:4222,nats://relay:p%2Cw%23d@b:4222");
        assert_eq!(
            args.server_urls().unwrap(),
            ["nats://a:4222", "nats://b:4222"]
        );
        args.connect_options("t").await.unwrap();
        let mut both = NatsArgs::new("nats://tok@a:4222");
        both.nats_token = Some(Secret::from("tok"));
        let err = both.connect_options("t").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("give them once"), "{err}");
    }

    #[tokio::test]
    async fn a_url_split_inside_its_password_is_refused_without_showing_it() {
        for url in [
            "nats://relay:Zq7,Wm3xK9pLr2@a:4222",
            "nats://relay:5432,Wm3xK9pLr2@a:4222",
            "nats://relay:Zq7/Wm3xK9pLr2@a:4222",
            "nats://relay:Zq7#Wm3xK9pLr2@a:4222",
        ] {
            let args = NatsArgs::new(url);
            let err = args.connect("t").await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}: {err}");
            let text = format!("{err} {err:?} {args:?} {}", args.redacted_url());
            for piece in ["Zq7", "5432", "Wm3", "K9pL", "Lr2"] {
                assert!(!text.contains(piece), "{piece} of {url} in {text}");
            }
        }
    }

    #[tokio::test]
    async fn a_url_list_naming_no_server_is_a_config_error() {
        let err = NatsArgs::new(", ,").connect("t").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("--nats-url"), "{err}");
    }

    #[tokio::test]
    async fn secrets_come_from_files_and_pairs_are_checked() {
        let dir = std::env::temp_dir().join(format!("outbox-nats-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "tok\n").unwrap();
        let args = parse(&["--nats-token-file", token.to_str().unwrap()]).unwrap();
        assert_eq!(args.token().unwrap().unwrap().expose_secret(), "tok");

        let seed = dir.join("seed");
        std::fs::write(&seed, "not a seed\n").unwrap();
        let args = parse(&["--nats-nkey-file", seed.to_str().unwrap()]).unwrap();
        let err = args.connect_options("t").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("nkey seed"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();

        let args = parse(&[
            "--nats-password-file",
            "/nonexistent/pw",
            "--nats-user",
            "u",
        ])
        .unwrap();
        let err = args.connect_options("t").await.unwrap_err();
        assert!(err.to_string().contains("--nats-password-file"), "{err}");
        assert!(err.to_string().contains("/nonexistent/pw"), "{err}");

        let args = parse(&["--nats-user", "u"]).unwrap();
        assert_eq!(
            args.connect_options("t").await.unwrap_err().kind(),
            ErrorKind::Config
        );
        let args = parse(&["--nats-tls-cert", "/c.pem"]).unwrap();
        assert_eq!(
            args.connect_options("t").await.unwrap_err().kind(),
            ErrorKind::Config
        );
    }
}
