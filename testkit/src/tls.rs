//! Certificates made in the test: a CA, a server certificate for the
//! loopback address, a client certificate, and a second CA that signed
//! nothing (to show verification failing).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::error::{Error, Result};
use crate::process::remove_stale_dirs;

const DIR_PREFIX: &str = "outbox-testkit-certs-";

/// The common name of [`TestCerts`]' client certificate: the PostgreSQL role
/// a `cert`-authenticated connection logs in as.
pub const CLIENT_NAME: &str = "outbox_client";

/// PEM files in a temporary directory (removed on drop): a CA, a server
/// certificate and key valid for `127.0.0.1` and `localhost` signed by it, a
/// client certificate and key (common name [`CLIENT_NAME`]) signed by it, and
/// an unrelated CA.
#[derive(Debug)]
pub struct TestCerts {
    dir: tempfile::TempDir,
}

impl TestCerts {
    /// Generates every certificate and key (ECDSA P-256).
    ///
    /// # Errors
    /// If generation or writing fails.
    pub fn generate() -> Result<Self> {
        remove_stale_dirs(DIR_PREFIX);
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let certs = Self { dir };

        let ca_key = KeyPair::generate().map_err(tls_error)?;
        let ca_fields = ca_params("outbox test CA")?;
        let ca = ca_fields.self_signed(&ca_key).map_err(tls_error)?;
        certs.write("ca.pem", &ca.pem())?;
        let issuer = Issuer::new(ca_fields, ca_key);

        let server_key = KeyPair::generate().map_err(tls_error)?;
        let mut server =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .map_err(tls_error)?;
        server
            .distinguished_name
            .push(DnType::CommonName, "127.0.0.1");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = server.signed_by(&server_key, &issuer).map_err(tls_error)?;
        certs.write("server.pem", &server.pem())?;
        certs.write("server.key", &server_key.serialize_pem())?;

        let client_key = KeyPair::generate().map_err(tls_error)?;
        let mut client = CertificateParams::new(Vec::<String>::new()).map_err(tls_error)?;
        client
            .distinguished_name
            .push(DnType::CommonName, CLIENT_NAME);
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = client.signed_by(&client_key, &issuer).map_err(tls_error)?;
        certs.write("client.pem", &client.pem())?;
        certs.write("client.key", &client_key.serialize_pem())?;

        let other_key = KeyPair::generate().map_err(tls_error)?;
        let other = ca_params("an unrelated CA")?
            .self_signed(&other_key)
            .map_err(tls_error)?;
        certs.write("other-ca.pem", &other.pem())?;
        Ok(certs)
    }

    fn write(&self, name: &str, pem: &str) -> Result<()> {
        let path = self.dir.path().join(name);
        std::fs::write(&path, pem)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        Ok(())
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate that signed the server and client certificates.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server certificate (for `127.0.0.1` and `localhost`).
    pub fn server_cert(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    /// The server's private key.
    pub fn server_key(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }

    /// The client certificate (common name [`CLIENT_NAME`]).
    pub fn client_cert(&self) -> PathBuf {
        self.dir.path().join("client.pem")
    }

    /// The client's private key.
    pub fn client_key(&self) -> PathBuf {
        self.dir.path().join("client.key")
    }

    /// A CA that signed neither certificate.
    pub fn other_ca(&self) -> PathBuf {
        self.dir.path().join("other-ca.pem")
    }

    /// A nats-server `tls { … }` block serving the server certificate;
    /// `verify_clients` requires a client certificate signed by the CA.
    pub fn nats_tls_block(&self, verify_clients: bool) -> String {
        format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {verify_clients}\n  timeout: 5\n}}\n",
            self.server_cert().display().to_string(),
            self.server_key().display().to_string(),
            self.ca().display().to_string(),
        )
    }
}

fn ca_params(name: &str) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_error)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

fn tls_error(e: rcgen::Error) -> Error {
    Error::new(format!("generating test certificates: {e}"))
}
