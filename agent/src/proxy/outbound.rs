//! Connections leaving an enrolled pod (listener 15001).

use std::{net::SocketAddr, sync::Arc, time::Instant};

use tokio::{net::TcpStream, sync::OwnedSemaphorePermit};

use super::{
    ProxyState, copy,
    hbone::Baggage,
    learning::{self, Awaited, LEARN_WAIT},
    pool::{HboneError, PoolKey},
    socket,
    telemetry::meta,
    waypoint,
};
use crate::{
    authz::Request,
    state::{View, Workload},
    telemetry::{
        connection::{ConnectionRecord, Endpoints, Failure, Outcome},
        metrics::{Direction, FailureKind, Reporter, SecurityPolicy},
    },
};

/// Where a captured outbound connection goes.
enum Route {
    /// An enrolled pod on another node: HBONE to its port 15008.
    Hbone(Arc<Workload>),
    /// An enrolled pod on this node: connect directly (policy still applies).
    Local,
    /// Outside the mesh: plain TCP.
    Passthrough,
    /// Through the destination's waypoint: HBONE to it, the original
    /// destination in the CONNECT.
    Waypoint(waypoint::Via),
}

impl Route {
    fn name(&self) -> &'static str {
        match self {
            Route::Hbone(_) => "hbone",
            Route::Local => "local",
            Route::Passthrough => "passthrough",
            Route::Waypoint(_) => "waypoint",
        }
    }
}

/// Handles one connection from pod `src` to its original destination `dst`,
/// holding the proxy's connection slot `_slot` until it ends.
pub async fn handle(
    state: Arc<ProxyState>,
    mut tcp: TcpStream,
    src: SocketAddr,
    dst: SocketAddr,
    _slot: OwnedSemaphorePermit,
) {
    let view = state.view();
    let refuse = |tcp: &TcpStream| {
        state
            .metrics
            .failed(Direction::Outbound, FailureKind::NotEnrolled);
        socket::reset_on_close(tcp);
    };
    let Some(source) = view.local_pod(src.ip()).cloned() else {
        // Only enrolled pods' connections are steered here; anything else (a pod
        // that was just un-enrolled) is refused rather than guessed at.
        tracing::info!(%src, %dst, "outbound connection from an address that is not an enrolled pod of this node; reset");
        refuse(&tcp);
        return;
    };
    // A destination the agent may not know yet (a pod or Service created a
    // moment ago): wait briefly for it rather than go in plain text.
    let view = match learning::awaited(&view, dst) {
        Some(awaited) => learn(&state, view, (src, dst), awaited).await,
        None => view,
    };
    let index = &view.workloads;
    // A Service's virtual address: the proxy picks one of its ready endpoints and
    // connects to it (HBONE when it is an enrolled pod elsewhere), as ztunnel does;
    // the original destination stays the one logged.
    let service = view.services.lookup(dst).cloned();
    // A waypoint the destination names gets the connection (it chooses the
    // endpoint), unless this is the waypoint's own connection.
    let via = match waypoint::choose(
        &view,
        &state.endpoints,
        service.as_deref(),
        dst,
        (&source, src.ip()),
        fastrand::f64(),
    ) {
        Ok(via) => via,
        Err(why) => {
            state.service_log.warn(|n| {
                format!(
                    "outbound connection from {src} ({}) to {dst}: {why}; reset ({n} such)",
                    source.key()
                )
            });
            state
                .metrics
                .failed(Direction::Outbound, FailureKind::NoWaypoint);
            socket::reset_on_close(&tcp);
            return;
        }
    };
    let endpoint = match &service {
        _ if via.is_some() => None,
        None => None,
        Some(svc) => match state.endpoints.pick(svc, src.ip()) {
            Some(endpoint) => Some(endpoint),
            None => {
                let why = svc.why_no_endpoint();
                state.service_log.warn(|n| {
                    format!("outbound connection from {src} ({}) to {dst}: service {} {why}; reset ({n} such)", source.key(), svc.key())
                });
                state
                    .metrics
                    .failed(Direction::Outbound, FailureKind::NoEndpoint);
                socket::reset_on_close(&tcp);
                return;
            }
        },
    };
    let upstream = endpoint.as_ref().map_or(dst, |e| e.addr);
    let route = match index
        .by_ip(upstream.ip())
        .filter(|w| w.enrollment.is_enrolled())
    {
        _ if via.is_some() => Route::Waypoint(via.expect("checked")),
        Some(_) if view.local_pod(upstream.ip()).is_some() => Route::Local,
        Some(w) if index.is_local(w) => {
            // A workload that says it is here but has no host veth here: not
            // something to connect to in plain text.
            tracing::warn!(%src, %dst, destination = %w.key(), "destination claims to be an enrolled pod of this node but has no host veth here; reset");
            refuse(&tcp);
            return;
        }
        Some(w) => Route::Hbone(w.clone()),
        None if index.conflict(upstream.ip()).is_some() => {
            tracing::warn!(%src, %dst, "destination address is claimed by several pods; reset");
            refuse(&tcp);
            return;
        }
        None => Route::Passthrough,
    };
    let route_name = route.name();
    // A destination outside the mesh may still be a known pod (its labels name
    // it), but has no identity here.
    let dst_workload = index.by_ip(upstream.ip()).cloned();
    let dst_identity = match &route {
        Route::Passthrough => None,
        Route::Hbone(_) | Route::Local => dst_workload.as_ref().map(|w| w.identity.clone()),
        Route::Waypoint(via) => Some(via.workload.identity.clone()),
    };
    let (reporters, security): (&[Reporter], _) = match route {
        Route::Hbone(_) | Route::Waypoint(_) => (&[Reporter::Source], SecurityPolicy::MutualTls),
        // No inbound hop reports it: this proxy is both sides.
        Route::Local => (
            &[Reporter::Source, Reporter::Destination],
            SecurityPolicy::None,
        ),
        Route::Passthrough => (&[Reporter::Source], SecurityPolicy::None),
    };
    let record = ConnectionRecord::open(
        &state.metrics,
        Direction::Outbound,
        reporters,
        security,
        Endpoints {
            route: route_name,
            src,
            dst,
            src_workload: Some(meta(source.clone())),
            dst_workload: dst_workload.map(meta),
            src_identity: Some(source.identity.clone()),
            dst_identity,
            service: service
                .as_ref()
                .map(|s| (s.namespace.clone(), s.name.clone(), s.host.clone())),
        },
    );
    // Between two pods of this node there is no inbound proxy hop: the
    // destination's policies are checked here, with the source pod's identity
    // (its address is its own: the programs drop spoofed packets).
    let local = matches!(route, Route::Local).then(|| Request {
        source_ip: src.ip(),
        source: Some(&source.identity),
        destination_ip: upstream.ip(),
        destination_port: upstream.port(),
    });
    if let Some(req) = &local
        && let Err(denial) = state.authorize(&view, req, "connection between pods of this node")
    {
        socket::reset_on_close(&tcp);
        record.finish(Outcome::Denied(denial.policy().to_string()));
        return;
    }
    drop(view);
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
    // Counted for the pods it comes from and (between two pods of this node)
    // goes to: a pod leaving the mesh drains until none is left.
    let _carried = state.carried.carry(src.ip());
    let _carried_to = local.is_some().then(|| state.carried.carry(upstream.ip()));
    let result = tokio::select! {
        result = proxy(&state, &mut tcp, route, &source, (src, upstream), &record) => result,
        () = state.unenrolled(src.ip()) => Err(Failure::new(FailureKind::Revoked, "the pod left the mesh")),
        why = revoked => Err(Failure::new(FailureKind::Revoked, why)),
    };
    match result {
        Ok(()) => record.finish(Outcome::Ok),
        Err(e) => {
            socket::reset_on_close(&tcp);
            tracing::info!(%src, %dst, %upstream, source = %source.key(), route = %route_name, "outbound connection failed: {e}");
            record.finish(Outcome::Failed(e));
        }
    }
}

/// Waits, for at most [`LEARN_WAIT`], for the view to learn what a connection
/// from `src` to `dst` lacks (`awaited`); returns the view then. `view` is let
/// go meanwhile. An address that stayed unknown through a wait is not waited
/// for again for a while ([`learning::UNLEARNED_FOR`]).
async fn learn(
    state: &ProxyState,
    view: View,
    (src, dst): (SocketAddr, SocketAddr),
    awaited: Awaited,
) -> View {
    let started = Instant::now();
    if state.unlearned.recent(dst.ip(), started) {
        return view;
    }
    drop(view);
    let view = state.learned(dst, LEARN_WAIT).await;
    let waited_ms = started.elapsed().as_millis();
    if learning::awaited(&view, dst).is_none() {
        tracing::debug!(%src, %dst, waited_ms, "outbound connection to {}: learned it", awaited.describe());
    } else {
        state.unlearned.note(dst.ip(), Instant::now());
        tracing::debug!(%src, %dst, waited_ms, "outbound connection to {}: still not known; going on with what is known", awaited.describe());
    }
    view
}

/// Connects upstream along `route` and copies until both sides are done,
/// counting the bytes in `record`.
async fn proxy(
    state: &ProxyState,
    tcp: &mut TcpStream,
    route: Route,
    source: &Workload,
    (src, dst): (SocketAddr, SocketAddr),
    record: &ConnectionRecord,
) -> Result<(), Failure> {
    let mark = state.config.proxy_mark;
    let copy_failed = |e: std::io::Error| Failure::new(FailureKind::Io, e);
    let hbone = match &route {
        Route::Hbone(dst_workload) => Some((
            dst_workload.identity.clone(),
            SocketAddr::new(dst.ip(), state.config.hbone_port),
        )),
        Route::Waypoint(via) => Some((via.workload.identity.clone(), via.addr)),
        Route::Local | Route::Passthrough => None,
    };
    match hbone {
        Some((dst_id, peer)) => {
            let baggage = Baggage::of(&state.config.cluster_id, source);
            let key = PoolKey {
                src_id: source.identity.clone(),
                src_ip: src.ip(),
                dst_id,
                dst: peer,
            };
            let stream = tokio::time::timeout(
                state.config.connect_timeout,
                state
                    .pool
                    .connect(&key, dst, baggage.as_ref(), &state.certs, mark),
            )
            .await;
            match stream {
                Ok(Ok(mut stream)) => copy::bidirectional(&mut record.meter(tcp), &mut stream)
                    .await
                    .map(drop)
                    .map_err(copy_failed),
                Ok(Err(e)) => {
                    let kind = match &e {
                        HboneError::Identity(_) => FailureKind::Identity,
                        HboneError::Connect { source, .. } => FailureKind::of_connect(source),
                        _ => FailureKind::Hbone,
                    };
                    Err(Failure::new(kind, e))
                }
                Err(_) => Err(Failure::new(
                    FailureKind::ConnectTimeout,
                    format!("HBONE to {} timed out", key.dst),
                )),
            }
        }
        None => {
            let connect = tokio::time::timeout(
                state.config.connect_timeout,
                socket::connect(Some(src.ip()), dst, mark),
            )
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
            match connect {
                Ok(mut upstream) => copy::bidirectional(&mut record.meter(tcp), &mut upstream)
                    .await
                    .map(drop)
                    .map_err(copy_failed),
                Err(e) => Err(Failure::new(
                    FailureKind::of_connect(&e),
                    format!("connecting to {dst}: {e}"),
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::proxy::learning::tests::{pod, proxy_state, view};

    /// An address that stayed unknown through a whole wait ([`LEARN_WAIT`]) is
    /// not waited for again; once known, it is routed without a wait.
    #[tokio::test]
    async fn an_address_that_stayed_unknown_is_not_waited_for_again() {
        let (state, _ca) = proxy_state(view(&[], true));
        let src: SocketAddr = "10.244.1.5:40000".parse().unwrap();
        let dst: SocketAddr = "10.244.2.9:80".parse().unwrap();
        let started = Instant::now();
        let learned = learn(&state, state.view(), (src, dst), Awaited::Address).await;
        let waited = started.elapsed();
        assert!(learning::awaited(&learned, dst).is_some());
        assert!(
            waited >= LEARN_WAIT && waited < LEARN_WAIT * 3,
            "{waited:?}"
        );
        let started = Instant::now();
        let _ = learn(&state, state.view(), (src, dst), Awaited::Address).await;
        assert!(started.elapsed() < Duration::from_millis(500));
        // Known now: nothing to wait for.
        state.update(view(&[pod("new", "new", "10.244.2.9")], true));
        assert!(learning::awaited(&state.view(), dst).is_none());
    }
}
