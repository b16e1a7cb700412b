//! Where a URL's secrets are, found by parsing it, and the URL shown without
//! them.
//!
//! A password may hold any character, and `,` `:` `%` do not end it, so the
//! URL is parsed (the `url` crate, as sqlx and async-nats parse it), never
//! split on a character. The one thing parsing cannot settle is a URL whose
//! last `@` comes after a `/`, `?`, `#` or `\`: the parser ends the user-info
//! at the first of those, so a password holding one unencoded
//! (`postgres://app:a/b@db/app`) would be read as a host, a port and a path
//! made of pieces of the password. Such a URL is refused as ambiguous, and
//! shown as `scheme://***@` and what follows its last `@`; so is any URL that
//! does not parse. Nothing before the last `@` of a URL is ever shown unless
//! the parser put it in the user name.

use std::fmt;

use url::Url;
use url::form_urlencoded;

use super::secret::{ExposeSecret, Secret};

/// Query parameters whose value is a secret (compared without case, after
/// percent-decoding the name).
pub(crate) const SECRET_PARAMETERS: &[&str] =
    &["password", "pass", "token", "sslpassword", "auth_token"];

/// Characters that end a URL's authority: after one of them an `@` is not
/// where the user-info ends.
const AUTHORITY_ENDS: &[char] = &['/', '?', '#', '\\'];

/// Why a URL was refused. The text names the problem and never any part of
/// the URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UrlProblem {
    /// No `scheme://` at the start.
    NotAUrl,
    /// The parser refused it.
    Invalid(url::ParseError),
    /// An `@` follows a `/`, `?`, `#` or `\`.
    Ambiguous,
    /// A list of URLs whose credentials differ, or are in some URLs only.
    MixedCredentials,
}

impl fmt::Display for UrlProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAUrl => {
                f.write_str("is not a URL: expected scheme://user:password@host:port/…")
            }
            Self::Invalid(e) => write!(
                f,
                "is invalid ({e}): a `#`, `/`, `?`, `@` or `%` in its user name or password \
                 must be percent-encoded (%23, %2F, %3F, %40, %25)"
            ),
            Self::Ambiguous => f.write_str(
                "is ambiguous: an `@` comes after a `/`, `?` or `#`, so where its password \
                 ends cannot be told; percent-encode `/`, `?`, `#` and `@` in the user name \
                 and password (%2F, %3F, %23, %40), and an `@` in the path or query (%40)",
            ),
            Self::MixedCredentials => f.write_str(
                "has credentials in some of its URLs only, or different ones: give every \
                 URL the same, or none and pass them with --nats-user and --nats-password \
                 or --nats-token",
            ),
        }
    }
}

/// The scheme and what follows its `://`, if `raw` starts with a scheme.
fn scheme_and_rest(raw: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = raw.trim().split_once("://")?;
    let valid = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some((scheme, rest))
}

/// `raw` parsed, when its user-info can be told from the rest.
pub(crate) fn parse(raw: &str) -> Result<Url, UrlProblem> {
    let (_, rest) = scheme_and_rest(raw).ok_or(UrlProblem::NotAUrl)?;
    if let Some(at) = rest.rfind('@')
        && rest[..at].contains(AUTHORITY_ENDS)
    {
        return Err(UrlProblem::Ambiguous);
    }
    Url::parse(raw.trim()).map_err(UrlProblem::Invalid)
}

/// `url` with the password of its user info, and the value of any
/// `password`, `pass`, `token`, `sslpassword` or `auth_token` query
/// parameter, replaced by `***`. Safe to log, whatever `url` holds.
///
/// The URL is parsed, not split on characters, so a password holding `,`,
/// `:`, `%` or `@` is masked whole. One the parser cannot tell from the rest
/// of the URL (an unencoded `/`, `?` or `#` before the last `@`), or a URL
/// that does not parse, is shown as `scheme://***@` and what follows its last
/// `@` if that parses as a host of its own, else as `scheme://[redacted]`; a
/// string that is not a URL at all as `[not a URL]`.
///
/// ```
/// use outbox_pg::connect::redact_url;
///
/// assert_eq!(
///     redact_url("postgres://app:s3cret@db:5432/app?sslmode=verify-full"),
///     "postgres://app:***@db:5432/app?sslmode=verify-full"
/// );
/// assert_eq!(redact_url("postgres://db/app?password=s3cret"), "postgres://db/app?password=***");
/// assert_eq!(redact_url("postgres://app:Zq7,Wm3@db/app"), "postgres://app:***@db/app");
/// assert_eq!(redact_url("postgres://app:a#b/c@db/app"), "postgres://***@db/app");
/// ```
pub fn redact_url(url: &str) -> String {
    redact(url, false)
}

/// As [`redact_url`]; a bare user info (`nats://TOKEN@host`, the NATS form
/// of a token) is masked whole.
fn redact(raw: &str, bare_user_is_secret: bool) -> String {
    let Some((scheme, rest)) = scheme_and_rest(raw) else {
        return "[not a URL]".to_owned();
    };
    match parse(raw) {
        Ok(url) => shown(&url, bare_user_is_secret),
        Err(_) => hidden_user_info(scheme, rest),
    }
}

/// A URL that did not parse, or whose user info cannot be told from the
/// rest: `scheme://***@` and what follows the last `@` if that parses as a
/// host (port, path, query) of its own, else `scheme://[redacted]`.
fn hidden_user_info(scheme: &str, rest: &str) -> String {
    let tail = rest
        .rfind('@')
        .and_then(|at| Url::parse(&format!("{scheme}://{}", &rest[at + 1..])).ok())
        .filter(|tail| tail.host_str().is_some_and(|host| !host.is_empty()))
        .and_then(|mut tail| tail.set_username("***").is_ok().then_some(tail));
    match tail {
        Some(tail) => shown(&tail, false),
        None => format!("{scheme}://[redacted]"),
    }
}

/// A parsed URL without its password (or token) and fragment, its secret
/// query parameters masked.
fn shown(url: &Url, bare_user_is_secret: bool) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        let _ = shown.set_password(Some("***"));
    } else if bare_user_is_secret && !shown.username().is_empty() {
        let _ = shown.set_username("***");
    }
    if let Some(query) = url.query() {
        shown.set_query(Some(&masked_query(query)));
    }
    shown.set_fragment(None);
    shown.to_string()
}

fn masked_query(query: &str) -> String {
    query
        .split('&')
        .map(|pair| {
            let key = pair.split_once('=').map_or(pair, |(key, _)| key);
            if pair.contains('=') && is_secret_parameter(key) {
                format!("{key}=***")
            } else {
                pair.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Whether the (percent-encoded) query parameter name `key` names a secret.
pub(crate) fn is_secret_parameter(key: &str) -> bool {
    let decoded = decoded_parameter(key);
    SECRET_PARAMETERS
        .iter()
        .any(|secret| decoded.eq_ignore_ascii_case(secret))
}

/// Removes from `url`'s query every parameter whose percent-decoded name
/// `remove` picks; returns those names.
pub(crate) fn remove_query_parameters(url: &mut Url, remove: impl Fn(&str) -> bool) -> Vec<String> {
    let Some(query) = url.query() else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    let kept: Vec<String> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(name, _)| name);
            let decoded = decoded_parameter(name);
            if remove(&decoded) {
                removed.push(decoded);
                false
            } else {
                true
            }
        })
        .map(str::to_owned)
        .collect();
    if !removed.is_empty() {
        url.set_query((!kept.is_empty()).then(|| kept.join("&")).as_deref());
    }
    removed
}

/// A query parameter's name, percent-decoded.
fn decoded_parameter(name: &str) -> String {
    form_urlencoded::parse(name.as_bytes())
        .next()
        .map(|(name, _)| name.into_owned())
        .unwrap_or_default()
}

/// Credentials written into NATS URLs (`nats://user:password@host`,
/// `nats://token@host`), percent-decoded.
#[derive(Clone)]
pub(crate) enum UrlCredentials {
    /// `user:password@`.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: Secret,
    },
    /// `token@`.
    Token(Secret),
}

impl PartialEq for UrlCredentials {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (
                Self::UserPassword { user, password },
                Self::UserPassword {
                    user: other_user,
                    password: other_password,
                },
            ) => user == other_user && password.expose_secret() == other_password.expose_secret(),
            (Self::Token(token), Self::Token(other)) => {
                token.expose_secret() == other.expose_secret()
            }
            _ => false,
        }
    }
}

impl Eq for UrlCredentials {}

impl fmt::Debug for UrlCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .finish_non_exhaustive(),
            Self::Token(_) => f.write_str("Token([redacted])"),
        }
    }
}

/// A comma-separated list of NATS server URLs, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NatsServers {
    /// The servers, without credentials, trimmed, empty entries dropped; a
    /// URL without a scheme gets `nats://` (as async-nats reads it).
    pub(crate) urls: Vec<String>,
    /// The credentials every URL carried, if any.
    pub(crate) credentials: Option<UrlCredentials>,
}

/// Parses `list`: every URL the same credentials, or none.
pub(crate) fn nats_servers(list: &str) -> Result<NatsServers, UrlProblem> {
    let mut urls = Vec::new();
    let mut credentials: Vec<Option<UrlCredentials>> = Vec::new();
    for raw in list.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let raw = if raw.contains("://") {
            raw.to_owned()
        } else {
            format!("nats://{raw}")
        };
        let mut url = parse(&raw)?;
        credentials.push(url_credentials(&url));
        let _ = url.set_password(None);
        let _ = url.set_username("");
        urls.push(url.to_string());
    }
    let credentials = match credentials.split_first() {
        None => None,
        Some((first, others)) => {
            if others.iter().any(|c| c != first) {
                return Err(UrlProblem::MixedCredentials);
            }
            first.clone()
        }
    };
    Ok(NatsServers { urls, credentials })
}

fn url_credentials(url: &Url) -> Option<UrlCredentials> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    Some(match url.password() {
        Some(password) => UrlCredentials::UserPassword {
            user: decode(url.username()),
            password: Secret::from(decode(password)),
        },
        None => UrlCredentials::Token(Secret::from(decode(url.username()))),
    })
}

/// A comma-separated list of NATS URLs, each shown without its password or
/// token. A list that does not parse (see [`nats_servers`]) is shown as
/// `scheme://***@` and what follows its last `@` (if that is a host), as
/// [`redact_url`] shows a URL that does not parse.
pub(crate) fn redact_nats_urls(list: &str) -> String {
    if nats_servers(list).is_ok() {
        return list
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(|raw| {
                if raw.contains("://") {
                    redact(raw, true)
                } else {
                    redact(&format!("nats://{raw}"), true)
                }
            })
            .collect::<Vec<_>>()
            .join(",");
    }
    match scheme_and_rest(list) {
        Some((scheme, rest)) => hidden_user_info(scheme, rest),
        None => hidden_user_info("nats", list),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The password every test below hides: each character a URL parser or
    /// a splitter could stop at.
    const PASSWORD: &str = "Zq7,Wm3#xK9/pL?r2@Tn%5:Vb8";

    /// Every piece of `secret` of 3 characters or more.
    fn pieces(secret: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for start in 0..secret.len() {
            for end in start + 3..=secret.len() {
                if let Some(piece) = secret.get(start..end) {
                    out.push(piece);
                }
            }
        }
        out
    }

    fn assert_hidden(shown: &str, secret: &str) {
        for piece in pieces(secret) {
            assert!(!shown.contains(piece), "`{piece}` of the secret in {shown}");
        }
    }

    fn encoded(s: &str) -> String {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    }

    #[test]
    fn urls_lose_their_passwords_and_keep_the_rest() {
        for (url, shown) in [
            (
                "postgres://app:pw@db:5432/app?sslmode=require",
                "postgres://app:***@db:5432/app?sslmode=require",
            ),
            ("postgres://app@db/app", "postgres://app@db/app"),
            (
                "postgres://db/app?user=a&password=pw",
                "postgres://db/app?user=a&password=***",
            ),
            (
                "postgres://db/app?pass%77ord=pw&PASS=x",
                "postgres://db/app?pass%77ord=***&PASS=***",
            ),
            ("postgres://a:p@w@db/x", "postgres://a:***@db/x"),
            ("postgres://a:pw@db/x#frag", "postgres://a:***@db/x"),
            ("tls://tok@h:4222", "tls://tok@h:4222"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        assert_eq!(redact_url("host=db password=pw"), "[not a URL]");
    }

    #[test]
    fn a_password_with_any_character_is_hidden_whole() {
        let encoded = encoded(PASSWORD);
        for url in [
            format!("postgres://relay_secret:{encoded}@db:5432/app"),
            format!("postgres://relay_secret:{PASSWORD}@db:5432/app"),
            format!("postgres://relay_secret:{PASSWORD}@db:5432/app?sslmode=require#x"),
            format!("postgres://relay_secret:{PASSWORD}@db:54x32/app"),
            format!("postgres://relay_secret:{PASSWORD}"),
            format!("postgres://relay_secret:{PASSWORD}@"),
            format!("postgres://{PASSWORD}@db/app"),
            format!("postgres://db/app?password={encoded}"),
            format!("postgres://db/app?password={PASSWORD}"),
        ] {
            let shown = redact_url(&url);
            assert_hidden(&shown, PASSWORD);
            assert_hidden(&shown, &encoded);
            let shown = redact_nats_urls(&url);
            assert_hidden(&shown, PASSWORD);
            assert_hidden(&shown, &encoded);
        }
        // Each special character alone, raw.
        for c in [',', '#', '/', '?', '@', '%', ':'] {
            let password = format!("Ab1{c}Cd2{c}Ef3");
            let url = format!("postgres://u:{password}@db/app");
            let shown = redact_url(&url);
            assert_hidden(&shown, &password);
            assert!(shown.ends_with("@db/app"), "{shown}");
        }
    }

    #[test]
    fn a_parsed_password_is_the_one_the_driver_reads() {
        let url = parse(&format!("postgres://relay:{}@db/app", encoded(PASSWORD))).unwrap();
        assert_eq!(url.host_str(), Some("db"));
        let password =
            percent_encoding::percent_decode_str(url.password().unwrap()).decode_utf8_lossy();
        assert_eq!(password, PASSWORD);
        // Unencoded `,` `:` `%` `@` parse as the password too.
        let url = parse("postgres://relay:a,b:c%zz@d@db/app").unwrap();
        assert_eq!(url.host_str(), Some("db"));
        assert_eq!(url.username(), "relay");
    }

    #[test]
    fn unencoded_authority_ends_before_the_last_at_are_refused() {
        for url in [
            "postgres://u:a/b@db/app",
            "postgres://u:a?b@db/app",
            "postgres://u:a#b@db/app",
            "postgres://u:12/b@db/app",
            "postgres://db/app?application_name=me@host",
        ] {
            assert_eq!(parse(url), Err(UrlProblem::Ambiguous), "{url}");
        }
        assert_eq!(parse("db:5432/app"), Err(UrlProblem::NotAUrl));
        assert!(matches!(
            parse("postgres://u:pw@db:54x/app"),
            Err(UrlProblem::Invalid(_))
        ));
        // The problem's text names nothing of the URL.
        for problem in [
            UrlProblem::NotAUrl,
            UrlProblem::Ambiguous,
            UrlProblem::MixedCredentials,
            UrlProblem::Invalid(url::ParseError::InvalidPort),
        ] {
            assert_hidden(&problem.to_string(), PASSWORD);
        }
    }

    #[test]
    fn nats_lists_move_credentials_out_of_the_urls() {
        let servers = nats_servers(" nats://u:p%2Cw@a:4222, tls://u:p%2Cw@b:4222 ,,").unwrap();
        assert_eq!(servers.urls, ["nats://a:4222", "tls://b:4222"]);
        assert_eq!(
            servers.credentials,
            Some(UrlCredentials::UserPassword {
                user: "u".into(),
                password: Secret::from("p,w")
            })
        );
        let servers = nats_servers("tok%40en@a:4222,nats://tok%40en@b").unwrap();
        assert_eq!(servers.urls, ["nats://a:4222", "nats://b"]);
        assert_eq!(
            servers.credentials,
            Some(UrlCredentials::Token(Secret::from("tok@en")))
        );
        let servers = nats_servers("a:4222,nats://b:4222").unwrap();
        assert_eq!(servers.urls, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(servers.credentials, None);
        assert!(format!("{:?}", UrlCredentials::Token(Secret::from("t0k3n"))).contains("redacted"));
    }

    #[test]
    fn a_nats_list_split_inside_a_password_is_refused_and_hidden() {
        for list in [
            // `,` in the password: "nats://u:1234" then "abcd@host".
            "nats://u:1234,abcd@host:4222",
            "nats://u:12@a,bc@host:4222",
            "nats://u:pw@a:4222,nats://b:4222",
            "nats://u:pw@a:4222,nats://u:other@b:4222",
        ] {
            assert_eq!(
                nats_servers(list),
                Err(UrlProblem::MixedCredentials),
                "{list}"
            );
        }
        let shown = redact_nats_urls("nats://u:1234,abcd@host:4222");
        assert_eq!(shown, "nats://***@host:4222");
        let list = format!("nats://u:{PASSWORD}@h1:4222,nats://u:{PASSWORD}@h2:4222");
        assert_hidden(&redact_nats_urls(&list), PASSWORD);
        let shown = redact_nats_urls("nats://u:p@h1:4222,nats://u:p@h2:4222");
        assert_eq!(shown, "nats://u:***@h1:4222,nats://u:***@h2:4222");
        assert_eq!(redact_nats_urls("tls://tok@h:4222"), "tls://***@h:4222");
        assert_eq!(
            redact_nats_urls("a:4222, b:4222"),
            "nats://a:4222,nats://b:4222"
        );
    }
}
