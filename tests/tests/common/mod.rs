//! An HBONE client for the tests, built from the agent's own identity and HBONE
//! pieces, connecting from inside a test pod's network namespace.

#![allow(dead_code, reason = "each test file uses some of the helpers")]

pub mod frames;

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, StatusCode};
use podlink_agent::{
    identity::{SpiffeId, ca::CertificateAuthority, tls},
    proxy::hbone::{self, H2Stream},
};
use podlink_tests::app;
use rustls::{pki_types::ServerName, sign::CertifiedKey};
use tokio::io::AsyncReadExt;

/// A client certificate for `id` from the CA in `ca_dir`, and that CA's roots.
pub fn credentials(
    ca_dir: &Path,
    id: &SpiffeId,
) -> (Arc<CertifiedKey>, Arc<rustls::RootCertStore>) {
    let ca = CertificateAuthority::load(ca_dir).unwrap();
    let cert = ca.issue(id, Duration::from_secs(600)).unwrap();
    let key = tls::provider()
        .key_provider
        .load_private_key(cert.key)
        .unwrap();
    (
        Arc::new(CertifiedKey::new(cert.chain, key)),
        tls::root_store(ca.roots()).unwrap(),
    )
}

/// Opens TLS (ALPN `h2`, the client certificate `key`) from network namespace
/// `netns` to `hbone` (pod:15008), for a client that writes its own HTTP/2.
pub async fn tls_connect(
    netns: &str,
    hbone: SocketAddr,
    key: Arc<CertifiedKey>,
    roots: Arc<rustls::RootCertStore>,
    server_id: SpiffeId,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let std = app::connect(netns, hbone, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    std.set_nonblocking(true).unwrap();
    let tcp = tokio::net::TcpStream::from_std(std).unwrap();
    let config = tls::client_config(key, roots, server_id).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::IpAddress(hbone.ip().into()), tcp)
        .await
        .map_err(|e| e.to_string())
}

/// Opens TLS + HTTP/2 from network namespace `netns` to `hbone` (pod:15008).
pub async fn hbone_connect(
    netns: &str,
    hbone: SocketAddr,
    key: Arc<CertifiedKey>,
    roots: Arc<rustls::RootCertStore>,
    server_id: SpiffeId,
) -> Result<h2::client::SendRequest<Bytes>, String> {
    let tls = tls_connect(netns, hbone, key, roots, server_id).await?;
    let (sender, conn) = hbone::client_builder()
        .handshake(tls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// Sends one request; returns the status and, on 200, the stream.
pub async fn request(
    sender: &mut h2::client::SendRequest<Bytes>,
    req: Request<()>,
) -> (StatusCode, Option<H2Stream>) {
    let ready = sender.clone().ready().await.unwrap();
    *sender = ready;
    let (response, send) = sender.send_request(req, false).unwrap();
    let response = response.await.unwrap();
    let status = response.status();
    let stream = (status == StatusCode::OK).then(|| H2Stream::new(send, response.into_body()));
    (status, stream)
}

/// Connects and sends one CONNECT to the server pod; any failure is an error.
pub async fn attempt(
    netns: &str,
    hbone: SocketAddr,
    key: Arc<CertifiedKey>,
    roots: Arc<rustls::RootCertStore>,
    server_id: SpiffeId,
    target: SocketAddr,
) -> Result<StatusCode, String> {
    let sender = hbone_connect(netns, hbone, key, roots, server_id).await?;
    let mut sender = sender.ready().await.map_err(|e| e.to_string())?;
    let (response, _send) = sender
        .send_request(hbone::connect_request(target, hbone.ip(), None), false)
        .map_err(|e| e.to_string())?;
    let response = response.await.map_err(|e| e.to_string())?;
    Ok(response.status())
}

/// Reads the echo server's greeting from a tunnel.
pub async fn greeting(stream: &mut H2Stream) -> SocketAddr {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\n") {
        assert_eq!(
            stream.read(&mut byte).await.unwrap(),
            1,
            "tunnel closed early"
        );
        line.push(byte[0]);
    }
    let text = String::from_utf8(line).unwrap();
    text.trim().strip_prefix("peer=").unwrap().parse().unwrap()
}
