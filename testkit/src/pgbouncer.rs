//! A real PgBouncer in front of a PostgreSQL server: the connection pooler
//! most deployments put between services and the database.

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::pg::user_ids;
use crate::process::{
    current_uid, find_binary, free_port, have_setpriv, port_open, remove_stale_dirs, signal, spawn,
    wait_exit, wait_ready,
};

const DIR_PREFIX: &str = "outbox-testkit-pgbouncer-";
const INSTALL_HINT: &str = "install PgBouncer (Debian: `apt-get install pgbouncer`; \
     scripts/setup does) or set PGBOUNCER_BIN to the binary";

/// How PgBouncer hands server sessions to clients (`pool_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A server session per client connection, for as long as it lasts.
    Session,
    /// A server session per transaction: what most deployments run.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Transaction => "transaction",
        }
    }
}

/// A PgBouncer process on a free loopback port, pooling every database of the
/// PostgreSQL server on `upstream_port` (`* = host=127.0.0.1 port=…`), with
/// `auth_type = trust` for the users it is told of. Stopped on drop.
///
/// It ignores the `extra_float_digits` startup parameter sqlx sends, as
/// deployments behind it configure (`ignore_startup_parameters`): without it
/// every sqlx connection is refused with "unsupported startup parameter".
#[derive(Debug)]
pub struct PgBouncer {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl PgBouncer {
    /// Starts PgBouncer in `mode` for `users` (each must exist on the server;
    /// `postgres` is always allowed).
    ///
    /// # Errors
    /// If the binary is missing (the message says how to install it), the
    /// unprivileged user it runs as does not exist, or it does not come up.
    pub fn start(upstream_port: u16, mode: PoolMode, users: &[&str]) -> Result<Self> {
        remove_stale_dirs(DIR_PREFIX);
        let binary = std::env::var_os("PGBOUNCER_BIN")
            .map(PathBuf::from)
            .or_else(|| find_binary("pgbouncer", &[PathBuf::from("/usr/sbin")]))
            .ok_or_else(|| Error::new(format!("pgbouncer not found; {INSTALL_HINT}")))?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let port = free_port()?;
        let mut auth = String::from("\"postgres\" \"\"\n");
        for user in users {
            auth.push_str(&format!("\"{user}\" \"\"\n"));
        }
        let users_file = dir.path().join("users.txt");
        std::fs::write(&users_file, auth)?;
        let log = dir.path().join("pgbouncer.log");
        let config = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={upstream_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {users}\n\
             pool_mode = {mode}\n\
             ignore_startup_parameters = extra_float_digits\n\
             max_client_conn = 1000\n\
             default_pool_size = 20\n\
             pidfile = {pid}\n\
             admin_users = postgres\n",
            users = users_file.display(),
            mode = mode.as_str(),
            pid = dir.path().join("pgbouncer.pid").display(),
        );
        let config_file = dir.path().join("pgbouncer.ini");
        std::fs::write(&config_file, config)?;
        // PgBouncer refuses to run as root, like PostgreSQL.
        let run_as = (current_uid() == Some(0))
            .then(|| std::env::var("OUTBOX_TEST_PG_USER").unwrap_or_else(|_| "postgres".into()));
        if let Some(user) = &run_as {
            let (uid, gid) = user_ids(user)?;
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
            for file in [&users_file, &config_file] {
                std::os::unix::fs::chown(file, Some(uid), Some(gid))?;
            }
        }
        let mut cmd = if run_as.is_some() || have_setpriv() {
            let mut cmd = Command::new("setpriv");
            if let Some(user) = &run_as {
                cmd.args(["--reuid", user, "--regid", user, "--init-groups"]);
            }
            cmd.args(["--pdeathsig", "TERM"]).arg(&binary);
            cmd
        } else {
            Command::new(&binary)
        };
        let log_file = File::options().create(true).append(true).open(&log)?;
        cmd.arg(&config_file)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        let mut child = spawn(cmd)
            .map_err(|e| Error::new(format!("cannot start pgbouncer: {e}; {INSTALL_HINT}")))?;
        wait_ready(
            "pgbouncer",
            &mut child,
            Duration::from_secs(30),
            &log,
            || port_open(port),
        )?;
        Ok(Self {
            dir,
            port,
            child: Some(child),
        })
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for `database` through the pooler, as `user`.
    pub fn url(&self, user: &str, database: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal(child.id(), "INT");
            let _ = wait_exit(&mut child, Duration::from_secs(5));
        }
    }
}
