//! A real 3-node JetStream cluster on loopback.
//!
//! Each node is its own `nats-server` process with its own client port,
//! cluster (route) port, monitoring port, `server_name` and JetStream store
//! directory, configured by a file:
//!
//! ```text
//! server_name: n1
//! listen: 127.0.0.1:<client>
//! http: 127.0.0.1:<monitoring>
//! jetstream { store_dir: "<dir>/n1/jetstream" }
//! cluster { name: outbox-test, listen: 127.0.0.1:<route>, routes: [ <every node's route> ] }
//! ```
//!
//! The nodes start together; [`NatsCluster::start`] returns once the cluster
//! is healthy ([`NatsCluster::wait_healthy`]: a JetStream meta leader elected
//! and every running node's `/healthz` answering 200, which nats-server gives
//! only when the node knows the meta leader and its stream and consumer
//! replicas are current). [`kill`](NatsCluster::kill) is `kill -9` of one
//! node; [`restart`](NatsCluster::restart) starts it again on the same ports
//! with the same store, so it rejoins and catches up as a real node does.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::nats::nats_server_bin;
use crate::process::{
    PORT_ATTEMPTS, free_port, have_setpriv, port_open, port_taken, remove_stale_dirs, signal,
    spawn, tail, wait_exit,
};

const DIR_PREFIX: &str = "outbox-testkit-cluster-";
const CLUSTER_NAME: &str = "outbox-test";
/// Nodes in the cluster: the smallest that keeps a quorum with one node down.
const NODES: usize = 3;
/// How long one node may take to print "Server is ready".
const START_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct Node {
    name: String,
    client_port: u16,
    http_port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Length of the log when this node was last launched: readiness is
    /// judged on what the current start wrote.
    log_offset: u64,
}

/// Three `nats-server -js` processes forming one JetStream cluster on
/// loopback, each with its own store directory. Killed and removed on drop.
#[derive(Debug)]
pub struct NatsCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    nodes: Vec<Node>,
}

impl NatsCluster {
    /// Starts the three nodes together and waits until the cluster is
    /// healthy (see [`wait_healthy`](Self::wait_healthy)), for at most a
    /// minute.
    ///
    /// # Errors
    /// If `nats-server` is missing (the message says how to install it), a
    /// node does not come up (its log tail is in the message), or the
    /// cluster elects no JetStream meta leader in time.
    pub async fn start() -> Result<Self> {
        remove_stale_dirs(DIR_PREFIX);
        let mut attempt = 1;
        loop {
            // A node whose port turned out taken: all three again, on new ports
            // (each node's routes name the others' ports).
            match Self::start_once().await {
                Err(e) if attempt < PORT_ATTEMPTS && port_taken(&e) => attempt += 1,
                result => return result,
            }
        }
    }

    async fn start_once() -> Result<Self> {
        let bin = nats_server_bin()?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        let ports: Vec<(u16, u16, u16)> = (0..NODES)
            .map(|_| Ok((free_port()?, free_port()?, free_port()?)))
            .collect::<Result<_>>()?;
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, route, _)| format!("nats-route://127.0.0.1:{route}"))
            .collect();
        let mut nodes = Vec::with_capacity(NODES);
        for (i, (client, route, http)) in ports.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let node_dir = dir.path().join(&name);
            std::fs::create_dir_all(&node_dir)?;
            let store = node_dir.join("jetstream");
            let config = node_dir.join("nats.conf");
            std::fs::write(
                &config,
                format!(
                    "server_name: {name}\n\
                     listen: 127.0.0.1:{client}\n\
                     http: 127.0.0.1:{http}\n\
                     jetstream {{ store_dir: {store:?} }}\n\
                     cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{route}\n  routes: [\n    {}\n  ]\n}}\n",
                    routes.join("\n    "),
                ),
            )?;
            nodes.push(Node {
                name,
                client_port: *client,
                http_port: *http,
                config,
                log: node_dir.join("nats.log"),
                child: None,
                log_offset: 0,
            });
        }
        let mut cluster = Self { dir, bin, nodes };
        for i in 0..NODES {
            cluster.launch(i)?;
        }
        for i in 0..NODES {
            cluster.wait_ready(i)?;
        }
        cluster.wait_healthy(Duration::from_secs(60)).await?;
        Ok(cluster)
    }

    fn node(&self, i: usize) -> Result<&Node> {
        self.nodes.get(i).ok_or_else(|| {
            Error::new(format!(
                "the cluster has nodes 0..{}, not {i}",
                self.nodes.len()
            ))
        })
    }

    fn node_mut(&mut self, i: usize) -> Result<&mut Node> {
        let len = self.nodes.len();
        self.nodes
            .get_mut(i)
            .ok_or_else(|| Error::new(format!("the cluster has nodes 0..{len}, not {i}")))
    }

    fn launch(&mut self, i: usize) -> Result<()> {
        let bin = self.bin.clone();
        let node = self.node_mut(i)?;
        node.log_offset = std::fs::metadata(&node.log).map_or(0, |m| m.len());
        let log = File::options().create(true).append(true).open(&node.log)?;
        let mut cmd = if have_setpriv() {
            let mut cmd = Command::new("setpriv");
            cmd.args(["--pdeathsig", "KILL"]).arg(&bin);
            cmd
        } else {
            Command::new(&bin)
        };
        cmd.arg("-c")
            .arg(&node.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn(cmd).map_err(|e| {
            Error::new(format!(
                "cannot run {}: {e}; {}",
                bin.display(),
                crate::nats::INSTALL_HINT
            ))
        })?;
        node.child = Some(child);
        Ok(())
    }

    /// Blocks until node `i` says "Server is ready" and takes connections.
    fn wait_ready(&mut self, i: usize) -> Result<()> {
        let node = self.node_mut(i)?;
        let what = format!("nats-server {}", node.name);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let text = std::fs::read(&node.log).unwrap_or_default();
            let new = text.get(node.log_offset as usize..).unwrap_or_default();
            if String::from_utf8_lossy(new).contains("Server is ready")
                && port_open(node.client_port)
            {
                return Ok(());
            }
            let Some(child) = node.child.as_mut() else {
                return Err(Error::new(format!("{what} is not running")));
            };
            if let Some(status) = child.try_wait()? {
                node.child = None;
                return Err(Error::new(format!(
                    "{what} exited during start-up ({status}); its log ({}):\n{}",
                    node.log.display(),
                    tail(&node.log)
                )));
            }
            if Instant::now() >= deadline {
                return Err(Error::new(format!(
                    "{what} was not ready after {START_TIMEOUT:?}; its log ({}):\n{}",
                    node.log.display(),
                    tail(&node.log)
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every node's client URL, comma-separated
    /// (`nats://127.0.0.1:a,nats://127.0.0.1:b,nats://127.0.0.1:c`), as
    /// `--nats-url` / `NATS_URL` take it.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node `i`'s client URL alone.
    ///
    /// # Errors
    /// If `i` is not a node index (0, 1 or 2).
    pub fn node_url(&self, i: usize) -> Result<String> {
        Ok(format!("nats://127.0.0.1:{}", self.node(i)?.client_port))
    }

    /// The number of nodes (3).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always false: a cluster has nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`'s `server_name` (`n1`, `n2`, `n3`), as stream info names leaders.
    ///
    /// # Errors
    /// If `i` is not a node index.
    pub fn server_name(&self, i: usize) -> Result<&str> {
        Ok(&self.node(i)?.name)
    }

    /// The index of the node whose `server_name` is `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// Whether node `i` is running (not killed or stopped).
    pub fn is_running(&self, i: usize) -> bool {
        self.node(i).is_ok_and(|n| n.child.is_some())
    }

    /// `kill -9` of node `i`: it vanishes mid-flight, its store as it was.
    ///
    /// # Errors
    /// If `i` is not a node index or the process cannot be killed.
    pub fn kill(&mut self, i: usize) -> Result<()> {
        if let Some(mut child) = self.node_mut(i)?.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Graceful stop (`SIGTERM`) of node `i`, waiting for it to exit.
    ///
    /// # Errors
    /// If `i` is not a node index or the signal cannot be sent.
    pub fn stop(&mut self, i: usize) -> Result<()> {
        if let Some(mut child) = self.node_mut(i)?.child.take() {
            signal(child.id(), "TERM")?;
            wait_exit(&mut child, Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// Starts node `i` again on the same ports with the same store
    /// directory (nothing if it runs). It rejoins the cluster; wait with
    /// [`wait_healthy`](Self::wait_healthy) for it to catch up.
    ///
    /// # Errors
    /// If `i` is not a node index or the node does not come up.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        if self.node(i)?.child.is_none() {
            self.launch(i)?;
            self.wait_ready(i)?;
        }
        Ok(())
    }

    /// Waits until a JetStream meta leader is elected and every running
    /// node reports itself healthy: `GET /healthz` on its monitoring port
    /// answers 200, which nats-server gives once the node knows the meta
    /// leader and its stream and consumer replicas are current (a restarted
    /// node has caught up).
    ///
    /// # Errors
    /// If the deadline passes first; the message names each node's last
    /// answer.
    pub async fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut unhealthy = Vec::new();
            let mut meta_leader = None;
            for node in self.nodes.iter().filter(|n| n.child.is_some()) {
                match http_get(node.http_port, "/healthz").await {
                    Ok((200, _)) => {}
                    Ok((status, body)) => {
                        unhealthy.push(format!("{}: {status} {}", node.name, body.trim()));
                    }
                    Err(e) => unhealthy.push(format!("{}: {e}", node.name)),
                }
                if meta_leader.is_none()
                    && let Ok((200, body)) = http_get(node.http_port, "/jsz").await
                {
                    meta_leader = meta_leader_of(&body);
                }
            }
            if meta_leader.is_none() {
                unhealthy.push("no JetStream meta leader".to_owned());
            }
            if unhealthy.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::new(format!(
                    "the NATS cluster was not healthy after {timeout:?}: {}; logs in {}",
                    unhealthy.join("; "),
                    self.dir.path().display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The index of the node leading `stream` (its stream info's
    /// `cluster.leader`, a `server_name`), waiting up to `timeout` for one to
    /// be elected.
    ///
    /// # Errors
    /// If no leader is reported in time (the last error is named).
    pub async fn stream_leader(
        &self,
        js: &async_nats::jetstream::Context,
        stream: &str,
        timeout: Duration,
    ) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match js.get_stream(stream).await {
                Ok(mut s) => match s.info().await {
                    Ok(info) => {
                        let leader = info.cluster.as_ref().and_then(|c| c.leader.clone());
                        match leader.as_deref().and_then(|name| self.index_of(name)) {
                            Some(i) if self.is_running(i) => return Ok(i),
                            _ => format!("leader {leader:?}"),
                        }
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(Error::new(format!(
                    "no leader of stream `{stream}` among the running nodes after {timeout:?} ({last})"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The running node a client named `name` (its `CONNECT` name, as
    /// `async_nats::ConnectOptions::name` sets it) is connected to, from each
    /// node's `/connz`; `None` if no running node has such a client.
    ///
    /// # Errors
    /// If a running node's monitoring endpoint does not answer.
    pub async fn client_node(&self, name: &str) -> Result<Option<usize>> {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.child.is_none() {
                continue;
            }
            let (status, body) = http_get(node.http_port, "/connz").await?;
            if status != 200 {
                return Err(Error::new(format!(
                    "{}: GET /connz answered {status}",
                    node.name
                )));
            }
            if connz_has_client(&body, name) {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// Node `i`'s log, for a failure report.
    ///
    /// # Errors
    /// If `i` is not a node index.
    pub fn log_path(&self, i: usize) -> Result<&Path> {
        Ok(&self.node(i)?.log)
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The `meta_cluster.leader` of a `/jsz` answer, if one is named.
fn meta_leader_of(jsz: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(jsz).ok()?;
    let leader = value.get("meta_cluster")?.get("leader")?.as_str()?;
    (!leader.is_empty()).then(|| leader.to_owned())
}

/// Whether a `/connz` answer lists a connection named `name`.
fn connz_has_client(connz: &str, name: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(connz)
        .ok()
        .and_then(|v| v.get("connections")?.as_array().cloned())
        .is_some_and(|connections| {
            connections
                .iter()
                .any(|c| c.get("name").and_then(serde_json::Value::as_str) == Some(name))
        })
}

/// `GET path` on 127.0.0.1:`port` over HTTP/1.0: the status and the body,
/// bounded to two seconds.
async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .map_err(|_| Error::new(format!("GET {path} on port {port} timed out")))??;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::new(format!("GET {path} on port {port}: no HTTP status")))?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meta_leader_is_read_from_jsz() {
        assert_eq!(
            meta_leader_of(r#"{"meta_cluster":{"name":"c","leader":"n2"}}"#).as_deref(),
            Some("n2")
        );
        assert_eq!(meta_leader_of(r#"{"meta_cluster":{"leader":""}}"#), None);
        assert_eq!(meta_leader_of(r#"{"config":{}}"#), None);
    }

    #[test]
    fn clients_are_found_by_name_in_connz() {
        let connz =
            r#"{"connections":[{"cid":4,"name":"billing"},{"cid":5,"name":"outbox-relay"}]}"#;
        assert!(connz_has_client(connz, "outbox-relay"));
        assert!(!connz_has_client(connz, "outboxctl"));
        assert!(!connz_has_client(r#"{"connections":null}"#, "billing"));
    }
}
