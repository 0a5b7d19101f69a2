//! The baselines: the same blocks over plain TCP and over TLS-over-TCP (tokio-rustls, mutual
//! TLS with the cluster certificates, TLS13_AES_128_GCM_SHA256 as for QUIC). Each block is an
//! 8-byte length and the body, received into a freshly allocated buffer like a QUIC block.
use super::BenchError;
use crate::certs::ClusterCa;
use crate::quic::tls::{client_config, server_config};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const ALPN: &[u8] = b"trellis-bench";

fn io(e: std::io::Error) -> BenchError {
    BenchError(format!("tcp: {e}"))
}

async fn receive<R: AsyncRead + Unpin>(mut r: R, blocks: usize) -> std::io::Result<u64> {
    let mut total = 0;
    for _ in 0..blocks {
        let len = r.read_u64_le().await? as usize;
        let mut buf = vec![0u8; len];
        r.read_exact(&mut buf).await?;
        total += len as u64;
    }
    Ok(total)
}

async fn send<W: AsyncWrite + Unpin>(mut w: W, body: &[u8], blocks: usize) -> std::io::Result<()> {
    for _ in 0..blocks {
        w.write_u64_le(body.len() as u64).await?;
        w.write_all(body).await?;
    }
    w.flush().await?;
    w.shutdown().await
}

/// Seconds to move `blocks` copies of `body`, connection set-up excluded.
pub(super) async fn tcp(
    body: Arc<[u8]>,
    blocks: usize,
    tls: Option<&ClusterCa>,
) -> Result<Duration, BenchError> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let acceptor = match tls {
        Some(ca) => {
            let cfg = server_config(&ca.issue_identity(2)?, ALPN)?;
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))
        }
        None => None,
    };
    let server = tokio::spawn(async move {
        let (sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        match acceptor {
            Some(a) => {
                let mut s = a.accept(sock).await?;
                s.write_all(&[1]).await?;
                s.flush().await?;
                receive(s, blocks).await
            }
            None => receive(sock, blocks).await,
        }
    });
    let sock = TcpStream::connect(addr).await.map_err(io)?;
    sock.set_nodelay(true).map_err(io)?;
    let elapsed = match tls {
        Some(ca) => {
            let cfg = client_config(&ca.cert_der(), Some(&ca.issue_identity(1)?), ALPN)?;
            let name = rustls::pki_types::ServerName::try_from(crate::certs::node_server_name(2))
                .map_err(|e| BenchError(e.to_string()))?;
            let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect(name, sock)
                .await
                .map_err(io)?;
            // Wait for the server's first byte: the handshake (client certificate included) is done.
            s.read_u8().await.map_err(io)?;
            let start = Instant::now();
            send(&mut s, &body, blocks).await.map_err(io)?;
            server
                .await
                .map_err(|e| BenchError(e.to_string()))?
                .map_err(io)?;
            start.elapsed()
        }
        None => {
            let start = Instant::now();
            send(sock, &body, blocks).await.map_err(io)?;
            server
                .await
                .map_err(|e| BenchError(e.to_string()))?
                .map_err(io)?;
            start.elapsed()
        }
    };
    Ok(elapsed)
}
