//! nats-server authentication set up in the test: tokens, nkey users and
//! decentralised (JWT) auth, each as a configuration snippet for
//! [`NatsServer::start_with_config`](crate::NatsServer::start_with_config).

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use nkeys::KeyPair;
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// `authorization { token: … }`: clients must present `token`.
pub fn token_config(token: &str) -> String {
    format!("authorization {{\n  token: {token:?}\n}}\n")
}

/// A user nkey: the server knows the public key, the client signs with the
/// seed.
#[derive(Debug)]
pub struct NkeyUser {
    seed: String,
    public_key: String,
}

impl NkeyUser {
    /// A new random user key pair.
    ///
    /// # Errors
    /// If the seed cannot be encoded.
    pub fn generate() -> Result<Self> {
        let pair = KeyPair::new_user();
        Ok(Self {
            seed: pair.seed().map_err(nkey_error)?,
            public_key: pair.public_key(),
        })
    }

    /// The seed (`SU…`), the client's secret.
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// The public key (`U…`).
    pub fn public_key(&self) -> &str {
        &self.public_key
    }

    /// `authorization { users: [ { nkey: … } ] }` admitting this user.
    pub fn server_config(&self) -> String {
        format!(
            "authorization {{\n  users: [ {{ nkey: {:?} }} ]\n}}\n",
            self.public_key
        )
    }
}

/// Decentralised authentication: an operator, its system account, one
/// account with JetStream enabled (no limits), and one user of that account, as JWTs signed with
/// nkeys. The server trusts the operator and knows the account from memory
/// (`resolver: MEMORY`, `resolver_preload`); the client presents a creds file
/// holding the user JWT and seed.
#[derive(Debug)]
pub struct JwtAuth {
    operator_jwt: String,
    system_public_key: String,
    system_jwt: String,
    account_public_key: String,
    account_jwt: String,
    user_jwt: String,
    user_seed: String,
}

impl JwtAuth {
    /// Generates the keys and signs the JWTs; the user is named `user`.
    ///
    /// # Errors
    /// If a key cannot be encoded or a JWT cannot be signed.
    pub fn generate(user: &str) -> Result<Self> {
        let operator = KeyPair::new_operator();
        let system = KeyPair::new_account();
        let account = KeyPair::new_account();
        let user_key = KeyPair::new_user();
        let operator_jwt = sign_jwt(
            &operator,
            &operator.public_key(),
            "outbox-test-operator",
            json!({"system_account": system.public_key(), "type": "operator", "version": 2}),
        )?;
        // The server's own account (JetStream needs one to start in operator mode).
        let system_jwt = sign_jwt(
            &operator,
            &system.public_key(),
            "SYS",
            json!({
                "limits": {
                    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                    "wildcards": true, "conn": -1, "leaf": -1,
                },
                "type": "account",
                "version": 2,
            }),
        )?;
        let account_jwt = sign_jwt(
            &operator,
            &account.public_key(),
            "OUTBOX",
            json!({
                "limits": {
                    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                    "wildcards": true, "conn": -1, "leaf": -1,
                    // JetStream is enabled for an account whose storage limits are not 0.
                    "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
                },
                "default_permissions": {"pub": {}, "sub": {}},
                "type": "account",
                "version": 2,
            }),
        )?;
        let user_jwt = sign_jwt(
            &account,
            &user_key.public_key(),
            user,
            json!({
                "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                "type": "user",
                "version": 2,
            }),
        )?;
        Ok(Self {
            operator_jwt,
            system_public_key: system.public_key(),
            system_jwt,
            account_public_key: account.public_key(),
            account_jwt,
            user_jwt,
            user_seed: user_key.seed().map_err(nkey_error)?,
        })
    }

    /// The server configuration: trust the operator, preload the account.
    pub fn server_config(&self) -> String {
        format!(
            "operator: {:?}\nsystem_account: {}\nresolver: MEMORY\nresolver_preload: {{\n  {}: {:?}\n  {}: {:?}\n}}\n",
            self.operator_jwt,
            self.system_public_key,
            self.system_public_key,
            self.system_jwt,
            self.account_public_key,
            self.account_jwt
        )
    }

    /// The user's creds file, as `nsc` writes it.
    pub fn creds(&self) -> String {
        format!(
            "-----BEGIN NATS USER JWT-----\n{}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\
             NKEYs are sensitive and should be treated as secrets.\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n\n\
             *************************************************************\n",
            self.user_jwt, self.user_seed
        )
    }

    /// The user's seed (part of [`JwtAuth::creds`]).
    pub fn user_seed(&self) -> &str {
        &self.user_seed
    }
}

/// A NATS JWT (`ed25519-nkey`) with subject `subject`, issued and signed by
/// `issuer`.
fn sign_jwt(issuer: &KeyPair, subject: &str, name: &str, nats: Value) -> Result<String> {
    let issued_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let header = json!({"typ": "JWT", "alg": "ed25519-nkey"});
    let claims = json!({
        "jti": uuid::Uuid::now_v7().simple().to_string().to_uppercase(),
        "iat": issued_at,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let signature = issuer.sign(signing_input.as_bytes()).map_err(nkey_error)?;
    Ok(format!(
        "{signing_input}.{}",
        URL_SAFE_NO_PAD.encode(signature)
    ))
}

fn nkey_error(e: nkeys::error::Error) -> Error {
    Error::new(format!("nkeys: {e}"))
}
