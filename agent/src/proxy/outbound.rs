//! Connections leaving an enrolled pod (listener 15001).

use std::{net::SocketAddr, sync::Arc, time::Instant};

use tokio::net::TcpStream;

use super::{ProxyState, copy, pool::PoolKey, socket};
use crate::{authz::Request, workload::Workload};

/// Where a captured outbound connection goes.
enum Route {
    /// An enrolled pod on another node: HBONE to its port 15008.
    Hbone(Arc<Workload>),
    /// An enrolled pod on this node: connect directly (policy still applies).
    Local,
    /// Outside the mesh: plain TCP.
    Passthrough,
}

impl Route {
    fn name(&self) -> &'static str {
        match self {
            Route::Hbone(_) => "hbone",
            Route::Local => "local",
            Route::Passthrough => "passthrough",
        }
    }
}

/// Handles one connection from pod `src` to its original destination `dst`.
pub async fn handle(state: Arc<ProxyState>, mut tcp: TcpStream, src: SocketAddr, dst: SocketAddr) {
    let start = Instant::now();
    let view = state.view();
    let index = &view.workloads;
    let Some(source) = view.local_pod(src.ip()).cloned() else {
        // Only enrolled pods' connections are steered here; anything else (a pod
        // that was just un-enrolled) is refused rather than guessed at.
        tracing::info!(%src, %dst, "outbound connection from an address that is not an enrolled pod of this node; reset");
        socket::reset_on_close(&tcp);
        return;
    };
    let route = match index.by_ip(dst.ip()).filter(|w| w.enrollment.is_enrolled()) {
        Some(_) if view.local_pod(dst.ip()).is_some() => Route::Local,
        Some(w) if index.is_local(w) => {
            // A workload that says it is here but has no host veth here: not
            // something to connect to in plain text.
            tracing::warn!(%src, %dst, destination = %w.key(), "destination claims to be an enrolled pod of this node but has no host veth here; reset");
            socket::reset_on_close(&tcp);
            return;
        }
        Some(w) => Route::Hbone(w.clone()),
        None if index.conflict(dst.ip()).is_some() => {
            tracing::warn!(%src, %dst, "destination address is claimed by several pods; reset");
            socket::reset_on_close(&tcp);
            return;
        }
        None => Route::Passthrough,
    };
    // Between two pods of this node there is no inbound proxy hop: the
    // destination's policies are checked here, with the source pod's identity
    // (its address is its own: the programs drop spoofed packets).
    let local = matches!(route, Route::Local).then(|| Request {
        source_ip: src.ip(),
        source: Some(&source.identity),
        destination_ip: dst.ip(),
        destination_port: dst.port(),
    });
    if let Some(req) = &local
        && !state.authorize(&view, req, "connection between pods of this node")
    {
        socket::reset_on_close(&tcp);
        return;
    }
    drop(view);
    let route_name = route.name();
    let revoked = async {
        match &local {
            Some(req) => {
                state
                    .revoked(req, "connection between pods of this node")
                    .await
            }
            None => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        result = proxy(&state, &mut tcp, route, &source, src, dst) => result,
        () = state.unenrolled(src.ip()) => Err(std::io::Error::other("the pod left the mesh")),
        why = revoked => Err(std::io::Error::other(why)),
    };
    match result {
        Ok((sent, received)) => tracing::debug!(
            %src, %dst, source = %source.key(), route = %route_name, sent, received,
            duration_ms = start.elapsed().as_millis() as u64,
            "outbound connection closed"
        ),
        Err(e) => {
            socket::reset_on_close(&tcp);
            tracing::info!(%src, %dst, source = %source.key(), route = %route_name, "outbound connection failed: {e}");
        }
    }
}

/// Connects upstream along `route` and copies until both sides are done.
async fn proxy(
    state: &ProxyState,
    tcp: &mut TcpStream,
    route: Route,
    source: &Workload,
    src: SocketAddr,
    dst: SocketAddr,
) -> std::io::Result<(u64, u64)> {
    let mark = state.config.proxy_mark;
    match route {
        Route::Hbone(dst_workload) => {
            let key = PoolKey {
                src_id: source.identity.clone(),
                src_ip: src.ip(),
                dst_id: dst_workload.identity.clone(),
                dst: SocketAddr::new(dst.ip(), state.config.hbone_port),
            };
            let stream = tokio::time::timeout(
                state.config.connect_timeout,
                state.pool.connect(&key, dst, &state.certs, mark),
            )
            .await;
            match stream {
                Ok(Ok(mut stream)) => copy::bidirectional(tcp, &mut stream).await,
                Ok(Err(e)) => Err(std::io::Error::other(e.to_string())),
                Err(_) => Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("HBONE to {} timed out", key.dst),
                )),
            }
        }
        Route::Local | Route::Passthrough => {
            let connect = tokio::time::timeout(
                state.config.connect_timeout,
                socket::connect(Some(src.ip()), dst, mark),
            )
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
            match connect {
                Ok(mut upstream) => copy::bidirectional(tcp, &mut upstream).await,
                Err(e) => Err(e),
            }
        }
    }
}
