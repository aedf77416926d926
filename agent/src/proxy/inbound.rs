//! HBONE connections to an enrolled pod on this node (listener 15008).
//!
//! The connection's local address is the destination pod's (`pod ip:15008`); the
//! proxy presents that pod's certificate and requires a client certificate of the
//! mesh. Each CONNECT stream must name that same pod: the tunnel is never an open
//! proxy to other addresses (another node's pod, the node itself, loopback).

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use super::{
    ProxyState, copy,
    hbone::{self, H2Stream},
    socket,
};
use crate::identity::{SpiffeId, tls::peer_identity};

/// Time allowed for the TLS and HTTP/2 handshakes.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handles one HBONE connection from `peer` to `local` (`pod ip:15008`).
pub async fn handle(state: Arc<ProxyState>, tcp: TcpStream, peer: SocketAddr, local: SocketAddr) {
    let Some(destination) = state.view().local_pod(local.ip()).cloned() else {
        tracing::info!(%peer, %local, "HBONE connection to an address that is not an enrolled pod of this node; closed");
        return;
    };
    let identity = match state.certs.identity(&destination.identity) {
        Ok(identity) => identity,
        Err(e) => {
            tracing::warn!(%peer, destination = %destination.key(), "no certificate to present: {e}");
            return;
        }
    };
    socket::set_liveness(&tcp);
    let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let tls = TlsAcceptor::from(identity.server.clone())
            .accept(tcp)
            .await
            .map_err(|e| format!("TLS handshake refused: {e}"))?;
        let client = peer_identity(tls.get_ref().1.peer_certificates())?;
        let conn = hbone::server_builder()
            .handshake::<_, Bytes>(tls)
            .await
            .map_err(|e| format!("HTTP/2 handshake failed: {e}"))?;
        Ok::<_, String>((client, conn))
    })
    .await
    .unwrap_or_else(|_| Err("handshake timed out".into()));
    let (client, mut conn) = match accepted {
        Ok(accepted) => accepted,
        Err(e) => {
            tracing::info!(%peer, destination = %destination.key(), "{e}");
            return;
        }
    };
    tracing::debug!(%peer, %client, destination = %destination.key(), "HBONE connection accepted");
    loop {
        let next = tokio::select! {
            next = conn.accept() => next,
            () = state.unenrolled(local.ip()) => {
                tracing::info!(%peer, destination = %destination.key(), "the pod left the mesh; closing its HBONE connection");
                break;
            }
        };
        let Some(next) = next else {
            break;
        };
        match next {
            Ok((req, respond)) => {
                tokio::spawn(serve_stream(
                    state.clone(),
                    req,
                    respond,
                    peer,
                    local.ip(),
                    destination.identity.clone(),
                    client.clone(),
                ));
            }
            Err(e) => {
                tracing::debug!(%peer, "HBONE connection ended: {e}");
                break;
            }
        }
    }
}

fn refuse(mut respond: SendResponse<Bytes>, status: StatusCode, peer: SocketAddr, why: &str) {
    tracing::info!(%peer, status = status.as_u16(), "HBONE request refused: {why}");
    let response = Response::builder()
        .status(status)
        .body(())
        .expect("a status-only response");
    let _ = respond.send_response(response, true);
}

/// Serves one CONNECT stream of a connection made to pod `pod_ip`, which presented
/// `pod_id`, by `client`.
async fn serve_stream(
    state: Arc<ProxyState>,
    req: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    peer: SocketAddr,
    pod_ip: IpAddr,
    pod_id: SpiffeId,
    client: SpiffeId,
) {
    let start = Instant::now();
    let target = match hbone::parse_connect(&req) {
        Ok(target) => target,
        Err(e) => return refuse(respond, e.status(), peer, &e.to_string()),
    };
    let view = state.view();
    let index = &view.workloads;
    // The connection's own pod, still enrolled here and still the identity the
    // connection presented (an address can be reused by another pod).
    let same_pod = view
        .local_pod(target.ip())
        .is_some_and(|w| w.identity == pod_id);
    if target.ip() != pod_ip || !same_pod {
        let why = format!(
            "destination {target} is not the enrolled pod {pod_ip} this connection was made to"
        );
        return refuse(respond, StatusCode::BAD_REQUEST, peer, &why);
    }
    // Keep the client's address only when it belongs to a workload whose identity
    // is the one the client proved; otherwise connect from the node's address.
    let source = index
        .by_ip(peer.ip())
        .filter(|w| w.identity == client)
        .map(|_| peer.ip());
    if source.is_none() {
        tracing::info!(%peer, %client, "client address does not belong to the client's identity; not preserving it");
    }
    drop(view);
    let connect = tokio::time::timeout(
        state.config.connect_timeout,
        socket::connect(source, target, state.config.proxy_mark),
    )
    .await
    .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
    let mut upstream = match connect {
        Ok(upstream) => upstream,
        Err(e) => {
            let why = format!("connecting to {target}: {e}");
            return refuse(respond, StatusCode::SERVICE_UNAVAILABLE, peer, &why);
        }
    };
    let send = match respond.send_response(Response::new(()), false) {
        Ok(send) => send,
        Err(e) => {
            tracing::debug!(%peer, "client went away before the tunnel opened: {e}");
            return;
        }
    };
    let mut stream = H2Stream::new(send, req.into_body());
    let result = tokio::select! {
        result = copy::bidirectional(&mut upstream, &mut stream) => result,
        () = state.unenrolled(pod_ip) => Err(std::io::Error::other("the pod left the mesh")),
    };
    match result {
        Ok((to_client, from_client)) => tracing::debug!(
            %peer, %client, %target, sent = from_client, received = to_client,
            duration_ms = start.elapsed().as_millis() as u64,
            "inbound HBONE stream closed"
        ),
        Err(e) => tracing::info!(%peer, %client, %target, "inbound HBONE stream failed: {e}"),
    }
}
