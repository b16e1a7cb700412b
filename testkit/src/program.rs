//! Child programs (a service, a relay, a consumer replica) run as a user runs
//! them: started, watched for a readiness line, killed and restarted.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

/// One program run as a child process: a service, a relay or a consumer
/// replica. Its stdout and stderr go to `<log dir>/<name>.log`; it is killed
/// when dropped.
#[derive(Debug)]
pub struct Program {
    /// The name it is logged and reported under.
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    ready: Option<String>,
    log: PathBuf,
    child: Option<Child>,
    /// Times the process died on its own and was started again.
    pub crashes: u32,
}

impl Program {
    /// `program`, logging to `log_dir/<name>.log`; not started yet.
    pub fn new(name: &str, program: PathBuf, log_dir: &Path) -> Self {
        Self {
            name: name.to_owned(),
            program,
            args: Vec::new(),
            env: Vec::new(),
            ready: None,
            log: log_dir.join(format!("{name}.log")),
            child: None,
            crashes: 0,
        }
    }

    /// Adds an argument.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments.
    #[must_use]
    pub fn args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable.
    #[must_use]
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.push((key.to_owned(), value.into()));
        self
    }

    /// The value after `flag` in the arguments, if there is one.
    pub fn arg_after(&self, flag: &str) -> Option<&str> {
        let at = self.args.iter().position(|a| a == flag)?;
        self.args.get(at + 1).map(String::as_str)
    }

    /// Replaces the value after `flag` (for the next start), or adds both.
    pub fn set_arg(&mut self, flag: &str, value: impl Into<String>) {
        match self.args.iter().position(|a| a == flag) {
            Some(at) if at + 1 < self.args.len() => self.args[at + 1] = value.into(),
            _ => self.args.extend([flag.to_owned(), value.into()]),
        }
    }

    /// Waits, at start, for a line on stdout containing `marker`.
    #[must_use]
    pub fn ready_when(mut self, marker: &str) -> Self {
        self.ready = Some(marker.to_owned());
        self
    }

    /// Starts the process; returns its readiness line, if one was asked for.
    ///
    /// # Errors
    /// A message naming the program if it cannot start, or does not print its
    /// readiness line within 60 s.
    pub async fn start(&mut self) -> Result<Option<String>, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: cannot open log {}: {e}", self.name, self.log.display()))?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            format!(
                "{}: cannot start {}: {e} (build it first: cargo build --workspace --bins)",
                self.name,
                self.program.display()
            )
        })?;
        let stdout = child.stdout.take();
        let (ready_tx, ready_rx) = oneshot::channel();
        let marker = self.ready.clone();
        let log_path = self.log.clone();
        tokio::spawn(async move {
            let Some(stdout) = stdout else { return };
            let mut lines = BufReader::new(stdout).lines();
            let mut file = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .await
                .ok();
            let mut ready_tx = Some(ready_tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(f) = file.as_mut() {
                    let _ = f.write_all(format!("{line}\n").as_bytes()).await;
                }
                if marker.as_deref().is_some_and(|m| line.contains(m))
                    && let Some(tx) = ready_tx.take()
                {
                    let _ = tx.send(line);
                }
            }
        });
        self.child = Some(child);
        if self.ready.is_none() {
            return Ok(None);
        }
        match tokio::time::timeout(Duration::from_secs(60), ready_rx).await {
            Ok(Ok(line)) => Ok(Some(line)),
            _ => Err(format!(
                "{} did not become ready; see {}",
                self.name,
                self.log.display()
            )),
        }
    }

    /// `kill -9`.
    pub async fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// SIGTERM, then waits (bounded) for the exit.
    pub async fn terminate(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(20), child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => {
                let _ = child.kill().await;
                None
            }
        }
    }

    /// Waits (bounded) for the process to exit on its own: its exit code, or
    /// `None` if it was ended by a signal or did not exit in time (it is
    /// killed then).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        match tokio::time::timeout(timeout, child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => {
                let _ = child.kill().await;
                None
            }
        }
    }

    /// Sends `signal` (a `kill` name such as `STOP` or `CONT`) to the process.
    pub async fn signal(&self, signal: &str) {
        if let Some(pid) = self.child.as_ref().and_then(tokio::process::Child::id) {
            let _ = Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status()
                .await;
        }
    }

    /// Whether the process died on its own since the last check.
    pub fn died(&mut self) -> bool {
        let Some(child) = self.child.as_mut() else {
            return false;
        };
        match child.try_wait() {
            Ok(Some(_)) => {
                self.child = None;
                true
            }
            _ => false,
        }
    }

    /// Whether it was started and has not been seen to die.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}
