//! Plain connections to an enrolled pod on this node from outside the mesh
//! (listener 15006). Authorization policies apply with no source principal, and
//! a PeerAuthentication that makes mutual TLS `STRICT` on the pod's port
//! refuses them; a denied connection is reset.

use std::{net::SocketAddr, sync::Arc};

use tokio::{net::TcpStream, sync::OwnedSemaphorePermit};

use super::{ProxyState, copy, socket, telemetry::meta};
use crate::{
    authz::Request,
    telemetry::{
        connection::{ConnectionRecord, Endpoints, Failure, Outcome},
        metrics::{Direction, FailureKind, Reporter, SecurityPolicy},
    },
};

/// Handles one connection from `src` to the pod address `dst`, holding the
/// proxy's connection slot `_slot` until it ends.
pub async fn handle(
    state: Arc<ProxyState>,
    mut tcp: TcpStream,
    src: SocketAddr,
    dst: SocketAddr,
    _slot: OwnedSemaphorePermit,
) {
    let view = state.view();
    let Some(destination) = view.local_pod(dst.ip()).cloned() else {
        tracing::info!(%src, %dst, "plaintext connection to an address that is not an enrolled pod of this node; reset");
        state
            .metrics
            .failed(Direction::Inbound, FailureKind::NotEnrolled);
        socket::reset_on_close(&tcp);
        return;
    };
    // The client may be a known pod outside the mesh; it has no identity here.
    let source = view.workloads.by_ip(src.ip()).cloned();
    let record = ConnectionRecord::open(
        &state.metrics,
        Direction::Inbound,
        &[Reporter::Destination],
        SecurityPolicy::None,
        Endpoints {
            route: "inbound_plaintext",
            src,
            dst,
            src_workload: source.clone().map(meta),
            dst_workload: Some(destination.clone()),
            src_identity: None,
            dst_identity: Some(destination.identity.clone()),
            service: None,
        },
    );
    let req = Request {
        source_ip: src.ip(),
        source: None,
        destination_ip: dst.ip(),
        destination_port: dst.port(),
    };
    if let Err(denial) = state.authorize(&view, &req, "plaintext connection") {
        socket::reset_on_close(&tcp);
        record.finish(Outcome::Denied(denial.policy().to_string()));
        return;
    }
    drop(view);
    // Counted for the pod: a pod leaving the mesh drains until none is left.
    let _carried = state.carried.carry(dst.ip());
    // The client's address is what the network delivered: keep it.
    let proxy = async {
        let mut upstream = tokio::time::timeout(
            state.config.connect_timeout,
            socket::connect(Some(src.ip()), dst, state.config.proxy_mark),
        )
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        .map_err(|e| Failure::new(FailureKind::of_connect(&e), format!("connecting: {e}")))?;
        copy::bidirectional(&mut record.meter(&mut tcp), &mut upstream)
            .await
            .map_err(|e| Failure::new(FailureKind::Io, e))
    };
    let result = tokio::select! {
        result = proxy => result,
        why = state.revoked(&req, "plaintext connection") => Err(Failure::new(FailureKind::Revoked, why)),
    };
    match result {
        Ok(_) => record.finish(Outcome::Ok),
        Err(e) => {
            socket::reset_on_close(&tcp);
            tracing::info!(%src, %dst, destination = %destination.key(), "inbound plaintext connection failed: {e}");
            record.finish(Outcome::Failed(e));
        }
    }
}
