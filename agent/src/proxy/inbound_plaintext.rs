//! Plain connections to an enrolled pod on this node from outside the mesh
//! (listener 15006). Authorization policies apply with no source principal; a
//! denied connection is reset.

use std::{net::SocketAddr, sync::Arc, time::Instant};

use tokio::net::TcpStream;

use super::{ProxyState, copy, socket};
use crate::authz::Request;

/// Handles one connection from `src` to the pod address `dst`.
pub async fn handle(state: Arc<ProxyState>, mut tcp: TcpStream, src: SocketAddr, dst: SocketAddr) {
    let start = Instant::now();
    let Some(destination) = state.view().local_pod(dst.ip()).cloned() else {
        tracing::info!(%src, %dst, "plaintext connection to an address that is not an enrolled pod of this node; reset");
        socket::reset_on_close(&tcp);
        return;
    };
    let req = Request {
        source_ip: src.ip(),
        source: None,
        destination_ip: dst.ip(),
        destination_port: dst.port(),
    };
    if !state.authorize(&state.view(), &req, "plaintext connection") {
        socket::reset_on_close(&tcp);
        return;
    }
    // The client's address is what the network delivered: keep it.
    let proxy = async {
        let mut upstream = tokio::time::timeout(
            state.config.connect_timeout,
            socket::connect(Some(src.ip()), dst, state.config.proxy_mark),
        )
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))?;
        copy::bidirectional(&mut tcp, &mut upstream).await
    };
    let result = tokio::select! {
        result = proxy => result,
        why = state.revoked(&req, "plaintext connection") => Err(std::io::Error::other(why)),
    };
    match result {
        Ok((sent, received)) => tracing::debug!(
            %src, %dst, destination = %destination.key(), sent, received,
            duration_ms = start.elapsed().as_millis() as u64,
            "inbound plaintext connection closed"
        ),
        Err(e) => {
            socket::reset_on_close(&tcp);
            tracing::info!(%src, %dst, destination = %destination.key(), "inbound plaintext connection failed: {e}");
        }
    }
}
