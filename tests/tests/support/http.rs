//! Talking to a binary's ops endpoint as a scraper or a probe does.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free loopback address for a binary's `--metrics-addr`.
pub(crate) fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], outbox_testkit::free_port().unwrap()))
}

/// A plain HTTP/1.0 GET: the status and the body, or `None` if no answer
/// came within `timeout`.
pub(crate) async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Option<(u16, String)> {
    let exchange = async {
        let mut conn = tokio::net::TcpStream::connect(addr).await.ok()?;
        conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut response = Vec::new();
        conn.read_to_end(&mut response).await.ok()?;
        let response = String::from_utf8_lossy(&response).into_owned();
        let (head, body) = response.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, body.to_owned()))
    };
    tokio::time::timeout(timeout, exchange).await.ok().flatten()
}
