//! A real PostgreSQL server, and one migrated database per test.

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::process::{
    current_uid, find_binary, free_port, have_setpriv, launch_on_a_free_port, remove_stale_dirs,
    signal, spawn, wait_exit, wait_ready,
};
use crate::tls::TestCerts;

const DIR_PREFIX: &str = "outbox-testkit-pg-";
const INSTALL_HINT: &str = "install PostgreSQL (Debian: `apt-get install postgresql`), \
     run `scripts/setup`, set PG_BIN_DIR to the directory holding `initdb` and `postgres`, \
     or point DATABASE_URL at a running server";

/// A PostgreSQL server process on a free loopback port, with its data in a
/// temporary directory. Stopped (immediate shutdown) and removed on drop.
#[derive(Debug)]
pub struct PgServer {
    dir: tempfile::TempDir,
    bin_dir: PathBuf,
    run_as: Option<String>,
    port: u16,
    child: Option<Child>,
    tls: bool,
    /// `name=value` settings given to the server after the harness's own.
    settings: Vec<String>,
}

impl PgServer {
    /// Runs `initdb` and starts the server.
    ///
    /// # Errors
    /// If the binaries are missing (the message says how to install them), the
    /// unprivileged user does not exist, or the server does not come up.
    pub fn start() -> Result<Self> {
        Self::start_inner(None, &[])
    }

    /// [`PgServer::start`] with `settings` (`name=value`, e.g.
    /// `wal_level=replica`) passed to the server after the harness's own
    /// (`wal_level=logical` among them), which they override.
    ///
    /// # Errors
    /// As [`PgServer::start`].
    pub fn start_with(settings: &[&str]) -> Result<Self> {
        Self::start_inner(None, settings)
    }

    /// Starts a server that accepts only TLS connections on its TCP port:
    /// `ssl=on` with `certs`' server certificate and key (copied into the
    /// server's directory, the key owned by the server's user, mode 0600) and
    /// a `pg_hba.conf` of `hostssl` lines and `hostnossl … reject`. The role
    /// [`CLIENT_NAME`](crate::CLIENT_NAME), if a test creates it, logs in with
    /// the client certificate (`cert`); every other role is trusted over TLS.
    /// [`url`](Self::url) names `sslmode=verify-full` and the CA.
    ///
    /// # Errors
    /// As [`PgServer::start`]; also if the files cannot be copied.
    pub fn start_tls(certs: &TestCerts) -> Result<Self> {
        Self::start_inner(Some(certs), &[])
    }

    fn start_inner(certs: Option<&TestCerts>, settings: &[&str]) -> Result<Self> {
        remove_stale_dirs(DIR_PREFIX);
        let bin_dir = pg_bin_dir()?;
        let run_as = if current_uid() == Some(0) {
            Some(std::env::var("OUTBOX_TEST_PG_USER").unwrap_or_else(|_| "postgres".into()))
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data)?;
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700))?;
        if let Some(user) = &run_as {
            let (uid, gid) = user_ids(user)?;
            std::os::unix::fs::chown(&data, Some(uid), Some(gid))?;
        }
        let mut server = Self {
            port: free_port()?,
            dir,
            bin_dir,
            run_as,
            child: None,
            tls: certs.is_some(),
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
        };
        server.initdb()?;
        if let Some(certs) = certs {
            server.install_tls(certs)?;
        }
        launch_on_a_free_port(&mut server, Self::launch, |server, port| {
            server.child = None;
            server.port = port;
        })?;
        Ok(server)
    }

    fn tls_dir(&self) -> PathBuf {
        self.dir.path().join("tls")
    }

    /// Copies the certificate, key and CA where the server's user owns them,
    /// and writes a `pg_hba.conf` that refuses unencrypted TCP connections.
    fn install_tls(&self, certs: &TestCerts) -> Result<()> {
        let dir = self.tls_dir();
        std::fs::create_dir(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        let hba = format!(
            "local all all trust\n\
             hostssl all {client} 127.0.0.1/32 cert\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostnossl all all all reject\n",
            client = crate::CLIENT_NAME
        );
        std::fs::write(dir.join("pg_hba.conf"), hba)?;
        for (from, to, mode) in [
            (certs.server_cert(), "server.pem", 0o644),
            (certs.server_key(), "server.key", 0o600),
            (certs.ca(), "ca.pem", 0o644),
            (dir.join("pg_hba.conf"), "pg_hba.conf", 0o644),
        ] {
            let to = dir.join(to);
            if from != to {
                std::fs::copy(&from, &to)?;
            }
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))?;
            if let Some(user) = &self.run_as {
                let (uid, gid) = user_ids(user)?;
                std::os::unix::fs::chown(&to, Some(uid), Some(gid))?;
            }
        }
        Ok(())
    }

    /// The CA the server's certificate is checked against (a copy of the
    /// [`TestCerts`] CA); `None` unless started with
    /// [`start_tls`](Self::start_tls).
    pub fn tls_ca(&self) -> Option<PathBuf> {
        self.tls.then(|| self.tls_dir().join("ca.pem"))
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn command(&self, program: &str, pdeathsig: bool) -> Command {
        let program = self.bin_dir.join(program);
        let wrap = self.run_as.is_some() || (pdeathsig && have_setpriv());
        if !wrap {
            return Command::new(program);
        }
        let mut cmd = Command::new("setpriv");
        if let Some(user) = &self.run_as {
            cmd.args(["--reuid", user, "--regid", user, "--init-groups"]);
        }
        if pdeathsig {
            // Immediate shutdown if the thread that started us goes away.
            cmd.args(["--pdeathsig", "QUIT"]);
        }
        cmd.arg(program);
        cmd
    }

    fn initdb(&self) -> Result<()> {
        let log = self.dir.path().join("initdb.log");
        let out = self
            .command("initdb", false)
            .arg("-D")
            .arg(self.data_dir())
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Error::new(format!("cannot run initdb: {e}; {INSTALL_HINT}")))?;
        std::fs::write(
            &log,
            [out.stdout.as_slice(), out.stderr.as_slice()].concat(),
        )?;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::new(format!(
                "initdb failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    fn launch(&mut self) -> Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let data = self.data_dir();
        let _ = std::fs::remove_file(data.join("postmaster.pid"));
        let mut cmd = self.command("postgres", true);
        cmd.arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-c")
            .arg("listen_addresses=127.0.0.1")
            .arg("-c")
            .arg(format!("unix_socket_directories={}", data.display()))
            .args(self.tls_options())
            .args([
                "-c",
                "max_connections=300",
                // Tests of prepared (two-phase) transactions left open.
                "-c",
                "max_prepared_transactions=16",
                "-c",
                "shared_buffers=128MB",
                // No fsync: data survives a process crash (the OS keeps it), not a
                // machine crash, which tests do not simulate. Commits stay synchronous.
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "log_min_messages=warning",
                // The relay's WAL source (`--source wal`) decodes the outbox.
                "-c",
                "wal_level=logical",
                "-c",
                "max_replication_slots=32",
                "-c",
                "max_wal_senders=32",
            ])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut child = spawn(cmd)
            .map_err(|e| Error::new(format!("cannot start postgres: {e}; {INSTALL_HINT}")))?;
        let pid_file = data.join("postmaster.pid");
        let ready = wait_ready(
            "postgres",
            &mut child,
            Duration::from_secs(60),
            &self.log_path(),
            || {
                std::fs::read_to_string(&pid_file)
                    .map(|s| s.lines().nth(7).map(str::trim) == Some("ready"))
                    .unwrap_or(false)
            },
        );
        self.child = Some(child);
        ready
    }

    fn tls_options(&self) -> Vec<String> {
        if !self.tls {
            return Vec::new();
        }
        let dir = self.tls_dir();
        let file = |name: &str| dir.join(name).display().to_string();
        [
            "ssl=on".to_owned(),
            format!("ssl_cert_file={}", file("server.pem")),
            format!("ssl_key_file={}", file("server.key")),
            format!("ssl_ca_file={}", file("ca.pem")),
            format!("hba_file={}", file("pg_hba.conf")),
        ]
        .into_iter()
        .flat_map(|setting| ["-c".to_owned(), setting])
        .collect()
    }

    /// The loopback port the server listens on (it keeps it across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection URL for `database` on this server; for a TLS server,
    /// with `sslmode=verify-full` and `sslrootcert` naming the CA.
    pub fn url(&self, database: &str) -> String {
        let url = format!("postgres://postgres@127.0.0.1:{}/{database}", self.port);
        match self.tls_ca() {
            Some(ca) => format!("{url}?sslmode=verify-full&sslrootcert={}", ca.display()),
            None => url,
        }
    }

    /// Stops the server the way a crash does (`SIGQUIT`, immediate shutdown:
    /// clients are cut off, recovery runs on the next start).
    ///
    /// # Errors
    /// If the signal cannot be sent.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "QUIT")?;
            wait_exit(&mut child, Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// Starts the server again on the same port and data directory.
    ///
    /// # Errors
    /// If it does not come up.
    pub fn start_again(&mut self) -> Result<()> {
        if self.child.is_none() {
            self.launch()?;
        }
        Ok(())
    }

    /// [`stop`](Self::stop), then [`start_again`](Self::start_again).
    ///
    /// # Errors
    /// As either.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.start_again()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn pg_bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.join("postgres").is_file() && dir.join("initdb").is_file() {
            Ok(dir)
        } else {
            Err(Error::new(format!(
                "PG_BIN_DIR={} holds no `postgres` and `initdb`; {INSTALL_HINT}",
                dir.display()
            )))
        };
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .collect();
    versions.sort();
    let extra: Vec<PathBuf> = versions.into_iter().rev().map(|(_, p)| p).collect();
    let postgres = find_binary("postgres", &extra).ok_or_else(|| {
        Error::new(format!(
            "PostgreSQL server binaries not found; {INSTALL_HINT}"
        ))
    })?;
    let dir = postgres
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| Error::new("postgres binary has no parent directory"))?;
    // `postgres` may be a symlink on PATH; initdb must come from the same install.
    let dir = std::fs::canonicalize(&postgres)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .filter(|d| d.join("initdb").is_file())
        .unwrap_or(dir);
    if dir.join("initdb").is_file() {
        Ok(dir)
    } else {
        Err(Error::new(format!(
            "found {} but no initdb beside it; {INSTALL_HINT}",
            postgres.display()
        )))
    }
}

pub(crate) fn user_ids(user: &str) -> Result<(u32, u32)> {
    let id = |flag: &str| -> Result<u32> {
        let out = Command::new("id").args([flag, user]).output()?;
        if !out.status.success() {
            return Err(Error::new(format!(
                "PostgreSQL refuses to run as root and the user `{user}` does not exist: \
                 create it (`useradd --system postgres`, or install the `postgresql` package) \
                 or set OUTBOX_TEST_PG_USER"
            )));
        }
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|_| Error::new(format!("`id {flag} {user}` printed no number")))
    };
    Ok((id("-u")?, id("-g")?))
}

/// The server shared by every test of this process, started on first use and
/// never dropped: it stops when the process exits (its parent-death signal).
fn shared_server_url() -> Result<String> {
    static SHARED: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            PgServer::start()
                .map(|server| {
                    let url = server.url("postgres");
                    std::mem::forget(server);
                    url
                })
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Error::new)
}

/// A PostgreSQL server for a program: its own [`PgServer`], or the one at
/// `DATABASE_URL`.
#[derive(Debug)]
pub struct PgHandle {
    server: Option<PgServer>,
    url: String,
}

impl PgHandle {
    /// The connection URL (of the `postgres` database when the server is ours).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The owned server, for fault injection; `None` when `DATABASE_URL` is used.
    pub fn server(&mut self) -> Option<&mut PgServer> {
        self.server.as_mut()
    }

    /// Takes the owned server out (to restart it on a blocking thread), leaving
    /// the URL; give it back with [`PgHandle::put_server`].
    pub fn take_server(&mut self) -> Option<PgServer> {
        self.server.take()
    }

    /// Puts back a server taken with [`PgHandle::take_server`].
    pub fn put_server(&mut self, server: PgServer) {
        self.server = Some(server);
    }
}

/// The server at `DATABASE_URL` if set, else a new [`PgServer`] (started on a
/// blocking thread).
///
/// # Errors
/// As [`PgServer::start`].
pub async fn postgres() -> Result<PgHandle> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Ok(PgHandle { server: None, url }),
        _ => {
            let server = tokio::task::spawn_blocking(PgServer::start)
                .await
                .map_err(|e| Error::new(format!("postgres start-up task failed: {e}")))??;
            Ok(PgHandle {
                url: server.url("postgres"),
                server: Some(server),
            })
        }
    }
}

/// A freshly created and migrated database for one test.
#[derive(Debug)]
pub struct TestDb {
    /// A pool on the database.
    pub pool: PgPool,
    url: String,
    name: String,
}

impl TestDb {
    /// Creates a database on the server at `DATABASE_URL` if set, else on the
    /// test binary's shared server, and runs the migrations on it.
    ///
    /// # Errors
    /// If the server cannot be started or reached, or a migration fails.
    pub async fn new() -> Result<Self> {
        let admin_url = match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => url,
            _ => tokio::task::spawn_blocking(shared_server_url)
                .await
                .map_err(|e| Error::new(format!("postgres start-up task failed: {e}")))??,
        };
        Self::create(&admin_url).await
    }

    /// Creates a migrated database on `server` (for tests that restart it).
    ///
    /// # Errors
    /// If the server cannot be reached or a migration fails.
    pub async fn on(server: &PgServer) -> Result<Self> {
        Self::create(&server.url("postgres")).await
    }

    async fn create(admin_url: &str) -> Result<Self> {
        let name = format!("outbox_test_{}", uuid::Uuid::now_v7().simple());
        let url = create_database(admin_url, &name).await?;
        let options = PgConnectOptions::from_str(&url)?;
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await?;
        outbox_pg::migrate(&pool).await?;
        Ok(Self { pool, url, name })
    }

    /// The database's connection URL, for child processes.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Creates database `name` on the server of `admin_url` and returns its URL
/// (`admin_url` with the database replaced).
///
/// # Errors
/// If the server cannot be reached or the database exists already.
pub async fn create_database(admin_url: &str, name: &str) -> Result<String> {
    let mut admin = PgConnection::connect(admin_url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("create database \"{name}\"")))
        .execute(&mut admin)
        .await?;
    admin.close().await?;
    Ok(with_database(admin_url, name))
}

/// Replaces the database name in a `postgres://` URL.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{database}", &base[..path_start]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database_in_urls() {
        assert_eq!(
            with_database("postgres://u:p@h:5/db?sslmode=disable", "x"),
            "postgres://u:p@h:5/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
        assert_eq!(
            with_database("postgresql://h:1/", "x"),
            "postgresql://h:1/x"
        );
    }
}
