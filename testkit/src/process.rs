//! Child-process plumbing shared by both servers.

use std::future::Future;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Waits until `check` returns true, polling every 20 ms, for at most `timeout`.
///
/// # Errors
/// An error naming `what` if the deadline passes first.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::new(format!(
                "timed out after {timeout:?} waiting for {what}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free TCP port on 127.0.0.1 for a server to take, outside the kernel's
/// ephemeral range.
///
/// A port from `bind(:0)` comes from the ephemeral range, the same range
/// every outgoing connection's local port comes from: between the probe
/// releasing it and the server binding it (or while a killed server is
/// down, before its restart), a client socket elsewhere in the run can take
/// it, and the server fails with "address already in use". Ports below the
/// range are never handed out that way. Each port is handed out once per
/// process (several servers start at once in one test binary) and checked
/// free by binding it; the walk starts at a random offset, so two test
/// processes started together (their pids adjacent) start far apart. Two
/// processes can still pick one port between probe and bind: the servers'
/// start-ups take another port when theirs turns out taken
/// (`port_taken`).
///
/// # Errors
/// If no port in the range is free.
pub fn free_port() -> Result<u16> {
    static NEXT: Mutex<Option<u16>> = Mutex::new(None);
    let (low, high) = unassigned_ports();
    let span = high - low;
    let mut next = NEXT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let start = *next.get_or_insert_with(|| {
        use std::hash::{BuildHasher, Hasher};
        // A random per-process key; no random-number crate needed.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        low + u16::try_from(h.finish() % u64::from(span)).unwrap_or(0)
    });
    let mut port = start;
    for _ in 0..span {
        let candidate = port;
        port = if port + 1 >= high { low } else { port + 1 };
        if TcpListener::bind(("127.0.0.1", candidate)).is_ok() {
            *next = Some(port);
            return Ok(candidate);
        }
    }
    // Nothing free below the ephemeral range: take what the kernel gives.
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Whether a server's start-up failed because its port was taken: the
/// error carries the server's log tail, and both PostgreSQL and
/// nats-server say "address already in use" (in their own case).
pub(crate) fn port_taken(error: &Error) -> bool {
    error
        .to_string()
        .to_ascii_lowercase()
        .contains("address already in use")
}

/// Start-ups made of a port choice and a launch retry this many times when
/// the port turns out taken.
pub(crate) const PORT_ATTEMPTS: usize = 4;

/// `launch(server)`, and while it fails because its port was taken
/// (`port_taken`), `new_port(server, port)` with another free port and
/// `launch` again, up to [`PORT_ATTEMPTS`] in all.
pub(crate) fn launch_on_a_free_port<T>(
    server: &mut T,
    launch: impl Fn(&mut T) -> Result<()>,
    new_port: impl Fn(&mut T, u16),
) -> Result<()> {
    let mut attempt = 1;
    loop {
        match launch(server) {
            Ok(()) => return Ok(()),
            Err(e) if attempt < PORT_ATTEMPTS && port_taken(&e) => {
                new_port(server, free_port()?);
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The ports `[low, high)` the harness hands out: from 10000 to the start
/// of the ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), or
/// 10000..32768 where that cannot be read or leaves too little room.
fn unassigned_ports() -> (u16, u16) {
    const LOW: u16 = 10_000;
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral_start >= LOW + 1_000 {
        (LOW, ephemeral_start)
    } else {
        (LOW, 32_768)
    }
}

pub(crate) fn port_open(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

/// Blocks until `ready()` or `timeout`, failing early if the child exits.
pub(crate) fn wait_ready(
    what: &str,
    child: &mut Child,
    timeout: Duration,
    log: &Path,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            return Err(Error::new(format!(
                "{what} exited during start-up ({status}); its log ({}):\n{}",
                log.display(),
                tail(log)
            )));
        }
        if Instant::now() >= deadline {
            return Err(Error::new(format!(
                "{what} was not ready after {timeout:?}; its log ({}):\n{}",
                log.display(),
                tail(log)
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub(crate) fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Sends `signal` (a name such as `TERM`) to `pid`.
pub(crate) fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::new(format!("kill -{signal} {pid} failed: {status}")))
    }
}

/// Waits for `child` to exit, killing it after `timeout`.
pub(crate) fn wait_exit(child: &mut Child, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while child.try_wait()?.is_none() {
        if Instant::now() >= deadline {
            child.kill()?;
            child.wait()?;
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Finds `name` on `PATH`, then in `extra` directories.
pub(crate) fn find_binary(name: &str, extra: &[PathBuf]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(extra.iter().cloned())
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The effective user id, read from `/proc` (no `unsafe`).
pub(crate) fn current_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Whether `setpriv` (util-linux) is available, to tie a server's life to ours.
pub(crate) fn have_setpriv() -> bool {
    find_binary("setpriv", &[]).is_some()
}

/// Removes temp dirs left by harness processes that no longer exist.
pub(crate) fn remove_stale_dirs(prefix: &str) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `cmd` from one thread that lives as long as the process.
///
/// Servers are started with a parent-death signal (`setpriv --pdeathsig`),
/// which Linux sends when the *thread* that forked them exits. Spawning from a
/// test's thread or a blocking-pool thread would kill the server when that
/// thread ends; spawning from this thread ties it to the process instead.
pub(crate) fn spawn(cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        let started = std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            });
        if let Err(e) = started {
            eprintln!("testkit: cannot start the spawner thread: {e}");
        }
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner
        .lock()
        .map_err(|_| std::io::Error::other("spawner lock poisoned"))?
        .send((cmd, reply_tx))
        .map_err(|_| std::io::Error::other("spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| std::io::Error::other("spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let (low, high) = unassigned_ports();
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for port in ports {
            assert!((low..high).contains(&port), "{port} not in {low}..{high}");
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }

    #[test]
    fn a_taken_port_is_recognised_in_either_servers_words() {
        for log in [
            "LOG:  could not bind IPv4 address \"127.0.0.1\": Address already in use",
            "[FTL] Can't start monitoring: listen tcp 127.0.0.1:36441: bind: address already in use",
        ] {
            assert!(port_taken(&Error::new(format!(
                "x exited during start-up; its log:\n{log}"
            ))));
        }
        assert!(!port_taken(&Error::new("x was not ready after 30s")));
    }
}
