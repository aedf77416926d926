//! HBONE connections to an enrolled pod on this node (listener 15008).
//!
//! The connection's local address is the destination pod's (`pod ip:15008`); the
//! proxy presents that pod's certificate and requires a client certificate of the
//! mesh. Each CONNECT stream must name that same pod at that same address (so of
//! the connection's family: a dual-stack pod's IPv4 address is refused on a
//! connection made to its IPv6 one, and the other way round): the tunnel is never
//! an open proxy to other addresses (another node's pod, the node itself,
//! loopback). Authorities are `ip:port`, `[ipv6]:port` for IPv6
//! ([`hbone::parse_authority`]); a malformed one is a 400 naming what is wrong.
//! The connection to the pod keeps the client's address unless that address is
//! known to belong to another identity ([`learning::client_address`]).

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, LazyLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
    sync::{OwnedSemaphorePermit, watch},
};
use tokio_rustls::TlsAcceptor;

use super::{
    Budget, ProxyState, Refusal, copy,
    hbone::{self, ActiveStream, H2Stream},
    learning::{self, ClientAddress},
    limits::Share,
    socket,
    telemetry::meta,
    waypoint,
};
use crate::{
    authz,
    identity::{
        SpiffeId,
        tls::{ALPN_H2, peer_identity},
    },
    state::Workload,
    telemetry::{
        connection::{ConnectionRecord, Endpoints, Failure, Outcome},
        logging::RateLimited,
        metrics::{Direction, FailureKind, Reporter, SecurityPolicy},
    },
};

/// Time allowed for the TLS and HTTP/2 handshakes. A client whose handshake
/// is slower (a trickled or never finished ClientHello, no HTTP/2 preface) is
/// closed with a reset once it is up.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshake refusals, logged at a bounded rate (a flood of bad clients must not
/// flood the log).
static REFUSALS: LazyLock<RateLimited> = LazyLock::new(RateLimited::default);

/// Connections refused after their handshakes for want of a connection slot,
/// logged at a bounded rate.
static OVER_LIMIT: LazyLock<RateLimited> = LazyLock::new(RateLimited::default);

/// Connections and streams refused because their client address had its share
/// ([`ConnectionLimits::peer_handshakes`], [`ConnectionLimits::peer_connections`]),
/// logged at a bounded rate.
///
/// [`ConnectionLimits::peer_handshakes`]: super::ConnectionLimits::peer_handshakes
/// [`ConnectionLimits::peer_connections`]: super::ConnectionLimits::peer_connections
static OVER_SHARE: LazyLock<RateLimited> = LazyLock::new(RateLimited::default);

/// Handles one HBONE connection from `peer` to `local` (`pod ip:15008`). It holds
/// the handshake permit `handshake` ([`ConnectionLimits::max_handshakes`](super::ConnectionLimits::max_handshakes)) and
/// one of its client address's share of them
/// ([`ConnectionLimits::peer_handshakes`](super::ConnectionLimits::peer_handshakes)) during its TLS and HTTP/2
/// handshakes, then one of the proxy's connection slots and one of the address's
/// share of them ([`ConnectionLimits::peer_connections`](super::ConnectionLimits::peer_connections)) for as long as it is
/// open; without either it is refused (reset).
pub async fn handle(
    state: Arc<ProxyState>,
    tcp: TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    handshake: OwnedSemaphorePermit,
) {
    // Until the handshakes succeed, a close is a RST: a refused or silent client
    // leaves no TIME_WAIT socket behind to collide with its next connection.
    socket::reset_on_close(&tcp);
    let refusal = |after_handshakes| Refusal {
        listener: "inbound HBONE",
        direction: Direction::Inbound,
        peer,
        after_handshakes,
    };
    let Some(peer_handshake) = state.limits.peer_handshake(peer.ip()) else {
        let refusal = refusal(false);
        state
            .limits
            .refused_over_share(&state.metrics, &OVER_SHARE, Share::Handshakes, &refusal);
        return;
    };
    // A second descriptor of the socket, for the lingering close at the end.
    let lingering = socket2::SockRef::from(&tcp).try_clone().ok();
    let failed = |kind| state.metrics.failed(Direction::Inbound, kind);
    let Some(destination) = state.view().local_pod(local.ip()).cloned() else {
        tracing::info!(%peer, %local, "HBONE connection to an address that is not an enrolled pod of this node; closed");
        failed(FailureKind::NotEnrolled);
        return;
    };
    let server = match state.certs.identity(&destination.identity).await {
        Ok(identity) => state.certs.server_config(&identity),
        Err(e) => Err(e),
    };
    let server = match server {
        Ok(server) => server,
        Err(e) => {
            tracing::warn!(%peer, destination = %destination.key(), "no certificate to present: {e}");
            failed(FailureKind::Identity);
            return;
        }
    };
    socket::set_liveness(&tcp);
    let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let mut tls = TlsAcceptor::from(server)
            .accept(tcp)
            .await
            .map_err(|e| format!("TLS handshake refused: {e}"))?;
        hbone::take_whole_frames(tls.get_mut().1);
        if tls.get_ref().1.alpn_protocol() != Some(ALPN_H2) {
            return Err("TLS handshake refused: the client did not negotiate ALPN h2".into());
        }
        let client = peer_identity(tls.get_ref().1.peer_certificates())?;
        socket::close_gracefully(tls.get_ref().0);
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
            let destination = destination.key();
            REFUSALS.warn(|n| format!("from {peer} to {destination}: {e} ({n} such)"));
            failed(FailureKind::Handshake);
            return;
        }
    };
    drop((handshake, peer_handshake));
    let Some(_slot) = state.limits.connection_slot() else {
        state.limits.refused_at_limit(
            &state.metrics,
            &OVER_LIMIT,
            Budget::Connection,
            &refusal(true),
        );
        return;
    };
    let Some(_peer_slot) = state.limits.peer_connection(peer.ip()) else {
        state.limits.refused_over_share(
            &state.metrics,
            &OVER_SHARE,
            Share::Connections,
            &refusal(true),
        );
        return;
    };
    tracing::debug!(%peer, %client, destination = %destination.key(), "HBONE connection accepted");
    if serve_connection(&state, &mut conn, peer, local, &destination, client).await {
        drop(conn);
        if let Some(socket) = lingering {
            lingering_close(socket).await;
        }
    }
}

/// Serves the CONNECT streams of an HBONE connection from `peer` to `local` (the
/// enrolled pod `destination`) whose handshakes are done, by `client`, until it
/// ends. Returns whether it ended cleanly (no more streams, the open ones
/// finished), when the caller may close it lingering; `false` when it failed or
/// the pod left the mesh.
async fn serve_connection<T>(
    state: &Arc<ProxyState>,
    conn: &mut h2::server::Connection<T, Bytes>,
    peer: SocketAddr,
    local: SocketAddr,
    destination: &Workload,
    client: SpiffeId,
) -> bool
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    // Streams end when their connection does (the client went away, or the pod
    // left the mesh): they watch this channel, whose sender goes with this task.
    let (_connection_alive, alive) = watch::channel(());
    let active = Arc::new(AtomicUsize::new(0));
    let idle_timeout = state.config.hbone_idle_timeout;
    let mut idle_check = tokio::time::interval(idle_timeout / 4);
    // When the trust changes, the client is asked to go (GOAWAY; open streams
    // finish) and to handshake again: no connection outlives the roots it was
    // verified under.
    let mut ca_changes = state.certs.ca_changes();
    let mut going_away = false;
    let mut last_active = Instant::now();
    let mut goaway_sent = false;
    loop {
        let next = tokio::select! {
            next = conn.accept() => next,
            // Draining: no new streams; the connection closes once its open
            // streams end.
            () = state.limits.draining(), if !goaway_sent => {
                tracing::debug!(%peer, "draining: GOAWAY to the HBONE client");
                conn.graceful_shutdown();
                goaway_sent = true;
                continue;
            }
            () = state.unenrolled(local.ip()) => {
                tracing::info!(%peer, destination = %destination.key(), "the pod left the mesh; closing its HBONE connection");
                return false;
            }
            Ok(()) = ca_changes.changed(), if !going_away => {
                tracing::debug!(%peer, "the CA changed; asking the client to reconnect");
                conn.graceful_shutdown();
                going_away = true;
                continue;
            }
            _ = idle_check.tick() => {
                if active.load(Ordering::Relaxed) > 0 {
                    last_active = Instant::now();
                } else if last_active.elapsed() >= idle_timeout {
                    tracing::debug!(%peer, "HBONE connection idle; closing it");
                    conn.graceful_shutdown();
                }
                continue;
            }
        };
        match next {
            Some(Ok((req, respond))) => {
                last_active = Instant::now();
                let guard = ActiveStream::new(active.clone());
                tokio::spawn(serve_stream(
                    state.clone(),
                    req,
                    respond,
                    peer,
                    local.ip(),
                    destination.identity.clone(),
                    client.clone(),
                    (alive.clone(), guard),
                ));
            }
            Some(Err(e)) => {
                tracing::debug!(%peer, "HBONE connection ended: {e}");
                return false;
            }
            None => break,
        }
    }
    // No more streams (the client sent GOAWAY, or idled out): drive the connection
    // until the open ones finish.
    let _ = std::future::poll_fn(|cx| conn.poll_closed(cx)).await;
    true
}

/// An HBONE connection over `io` from `peer` to `local` as [`handle`] serves it
/// once its TLS handshake is done, `client` standing for the identity the
/// client's certificate carries: the HTTP/2 handshake (the same settings, within
/// the same time), a connection slot, then its streams until it ends. For the
/// fuzz target of `fuzz/`, which sends a client's bytes through memory; the agent
/// serves every HBONE connection with [`handle`].
///
/// # Errors
/// Why the connection was refused before its streams: `local` is not an
/// enrolled pod of this node, the HTTP/2 handshake failed or timed out, or the
/// proxy is at its connection limit.
pub async fn serve_without_tls<T>(
    state: Arc<ProxyState>,
    io: T,
    client: SpiffeId,
    peer: SocketAddr,
    local: SocketAddr,
) -> Result<(), String>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let destination = state
        .view()
        .local_pod(local.ip())
        .cloned()
        .ok_or_else(|| format!("{local} is not an enrolled pod of this node"))?;
    let mut conn = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        hbone::server_builder().handshake::<_, Bytes>(io),
    )
    .await
    .map_err(|_| "handshake timed out".to_string())?
    .map_err(|e| format!("HTTP/2 handshake failed: {e}"))?;
    let _slot = state
        .limits
        .connection_slot()
        .ok_or("the proxy is at its connection limit")?;
    let _peer_slot = state
        .limits
        .peer_connection(peer.ip())
        .ok_or("the client address is at its share of the connection limit")?;
    serve_connection(&state, &mut conn, peer, local, &destination, client).await;
    Ok(())
}

/// How long a closed HBONE connection waits for the client's end.
const LINGER: Duration = Duration::from_secs(2);

/// Closes an HBONE connection whose streams are all done without losing what the
/// client has not read yet: a plain close would answer the client's late frames
/// (window updates after the last data) with a RST, which makes its kernel
/// discard the last response bytes it holds. Sends FIN, then reads and drops
/// until the client closes too, for at most [`LINGER`] ("lingering close", as
/// HTTP servers do).
async fn lingering_close(socket: socket2::Socket) {
    use tokio::io::AsyncReadExt;
    let _ = socket.shutdown(std::net::Shutdown::Write);
    let std: std::net::TcpStream = socket.into();
    if std.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(mut tcp) = TcpStream::from_std(std) else {
        return;
    };
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(n) = tcp.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// What a stream keeps of its connection: a receiver that fails once the
/// connection is gone, and its place in the active-stream count.
type StreamContext = (watch::Receiver<()>, ActiveStream);

/// Answers a stream with an error `status`.
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
#[expect(
    clippy::too_many_arguments,
    reason = "a stream's whole context, each part used once"
)]
async fn serve_stream(
    state: Arc<ProxyState>,
    req: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    peer: SocketAddr,
    pod_ip: IpAddr,
    pod_id: SpiffeId,
    client: SpiffeId,
    (mut alive, _active): StreamContext,
) {
    let bad_request = |respond, status, why: &str| {
        state
            .metrics
            .failed(Direction::Inbound, FailureKind::BadRequest);
        refuse(respond, status, peer, why);
    };
    let target = match hbone::parse_connect(&req) {
        Ok(target) => target,
        Err(e) => return bad_request(respond, e.status(), &e.to_string()),
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
        return bad_request(respond, StatusCode::BAD_REQUEST, &why);
    }
    // Keep the client's address unless it is known to belong to another
    // identity (then connect from the node's address). An address not known yet
    // is kept: it is the HBONE connection's own source, whose client proved its
    // certificate (docs/architecture.md, "HBONE").
    let kept = learning::client_address(index, peer.ip(), &client);
    match kept {
        ClientAddress::Known(_) => {}
        ClientAddress::Unknown(_) => {
            tracing::debug!(%peer, %client, "client address not known yet; preserving it (the HBONE connection's own source)");
        }
        ClientAddress::NotKept => {
            tracing::info!(%peer, %client, "client address does not belong to the client's identity; not preserving it");
        }
    }
    let source = kept.source();
    // The client's workload: the one its address names here, else the one
    // its `baggage` names (a workload of another cluster or network).
    let source_workload = source
        .and_then(|ip| index.by_ip(ip))
        .cloned()
        .map(meta)
        .or_else(|| {
            hbone::Baggage::parse(req.headers())
                .map(|b| Arc::new(b) as Arc<dyn crate::telemetry::metrics::WorkloadMeta>)
        });
    let destination = view.local_pod(target.ip()).cloned();
    // From the destination's waypoint (its address and proven identity): served
    // as any client, its identity the policies' source, as ztunnel does.
    let from_waypoint = destination
        .as_ref()
        .is_some_and(|d| waypoint::serves(&view, d, &client, peer.ip()));
    if from_waypoint {
        tracing::debug!(%peer, %client, %target, "HBONE stream from the destination's waypoint");
    }
    // The 200 names the destination's workload, as ztunnel's does.
    let answer_baggage = destination
        .as_ref()
        .and_then(|w| hbone::Baggage::of(&state.config.cluster_id, w));
    let record = ConnectionRecord::open(
        &state.metrics,
        Direction::Inbound,
        &[Reporter::Destination],
        SecurityPolicy::MutualTls,
        Endpoints {
            route: if from_waypoint {
                "inbound_waypoint"
            } else {
                "inbound_hbone"
            },
            src: peer,
            dst: target,
            src_workload: source_workload,
            dst_workload: destination.map(meta),
            src_identity: Some(client.clone()),
            dst_identity: Some(pod_id.clone()),
            service: None,
        },
    );
    let access = authz::Request {
        source_ip: peer.ip(),
        source: Some(&client),
        destination_ip: target.ip(),
        destination_port: target.port(),
    };
    if let Err(denial) = state.authorize(&view, &access, "HBONE stream") {
        // The denial is logged (at a bounded rate) and counted; 401 as ztunnel
        // answers it.
        let response = Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .body(())
            .expect("a status-only response");
        let _ = respond.send_response(response, true);
        record.finish(Outcome::Denied(denial.policy().to_string()));
        return;
    }
    drop(view);
    let Some(_slot) = state.limits.connection_slot() else {
        let why = "the proxy is at its connection limit";
        refuse(respond, StatusCode::SERVICE_UNAVAILABLE, peer, why);
        return record.finish(Outcome::Failed(Failure::new(
            FailureKind::ConnectionLimit,
            why,
        )));
    };
    // Counted for the pod: a pod leaving the mesh drains until none is left.
    let _carried = state.carried.carry(pod_ip);
    let Some(_peer_slot) = state.limits.peer_connection(peer.ip()) else {
        let why = "the client address is at its share of the connection limit";
        state.limits.refused_over_share(
            &state.metrics,
            &OVER_SHARE,
            Share::Connections,
            &Refusal {
                listener: "inbound HBONE",
                direction: Direction::Inbound,
                peer,
                after_handshakes: true,
            },
        );
        let response = Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(())
            .expect("a status-only response");
        let _ = respond.send_response(response, true);
        return record.finish(Outcome::Failed(Failure::new(
            FailureKind::ConnectionLimit,
            why,
        )));
    };
    let connect = tokio::time::timeout(
        state.config.connect_timeout,
        socket::connect(source, target, state.config.proxy_mark),
    );
    // A stream the client resets while the proxy connects (a rapid reset,
    // CVE-2023-44487) gives its slots and its connection back at once.
    let connect = tokio::select! {
        connect = connect => connect.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
        reason = std::future::poll_fn(|cx| respond.poll_reset(cx)) => {
            let why = match reason {
                Ok(reason) => format!("the client reset the stream ({reason:?}) before the tunnel opened"),
                Err(e) => format!("the client went away before the tunnel opened: {e}"),
            };
            tracing::debug!(%peer, "{why}");
            return record.finish(Outcome::Failed(Failure::new(FailureKind::Io, why)));
        }
    };
    let mut upstream = match connect {
        Ok(upstream) => upstream,
        Err(e) => {
            let why = format!("connecting to {target}: {e}");
            refuse(respond, StatusCode::SERVICE_UNAVAILABLE, peer, &why);
            return record.finish(Outcome::Failed(Failure::new(
                FailureKind::of_connect(&e),
                why,
            )));
        }
    };
    let mut ok = Response::new(());
    if let Some(baggage) = answer_baggage {
        ok.headers_mut().insert(hbone::BAGGAGE, baggage);
    }
    let send = match respond.send_response(ok, false) {
        Ok(send) => send,
        Err(e) => {
            tracing::debug!(%peer, "client went away before the tunnel opened: {e}");
            return record.finish(Outcome::Failed(Failure::new(
                FailureKind::Io,
                format!("the client went away before the tunnel opened: {e}"),
            )));
        }
    };
    let mut stream = H2Stream::new(send, req.into_body());
    let mut metered = record.meter(&mut stream);
    let unused = never_used(&record, state.config.hbone_idle_timeout);
    let result = tokio::select! {
        result = copy::bidirectional(&mut upstream, &mut metered) => {
            result.map_err(|e| Failure::new(FailureKind::Io, e))
        }
        () = unused => Err(Failure::new(
            FailureKind::Io,
            "the tunnel carried no byte either way within the idle timeout",
        )),
        why = state.revoked(&access, "HBONE stream") => Err(Failure::new(FailureKind::Revoked, why)),
        // The HBONE connection is gone: nothing can reach the client any more.
        _ = alive.changed() => Err(Failure::new(FailureKind::Io, "the HBONE connection closed")),
    };
    match result {
        Ok(_) => record.finish(Outcome::Ok),
        Err(e) => {
            socket::reset_on_close(&upstream);
            tracing::info!(%peer, %client, %target, "inbound HBONE stream failed: {e}");
            record.finish(Outcome::Failed(e));
        }
    }
}

/// Resolves once a tunnel opened `idle_timeout` ago has carried no byte either
/// way (a CONNECT that never sends data, to a pod that does not speak first);
/// never once it has carried one: from then on it is a TCP connection, whose
/// idle time is its applications' business.
async fn never_used(record: &ConnectionRecord, idle_timeout: Duration) {
    tokio::time::sleep(idle_timeout).await;
    if record.bytes() == (0, 0) {
        return;
    }
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::{
        dataplane::testing::{add_ipv6_address, in_new_network_namespace, ip},
        k8s::{Namespace, Pod},
        proxy::{
            canonical,
            pool::{HboneError, PoolKey},
        },
        state::{View, WorkloadIndex},
    };

    /// A pod of namespace `shop` (enrolled) on `node` with addresses `ips`.
    fn pod(name: &str, node: &str, ips: &[&str]) -> Pod {
        serde_yaml_ng::from_str(&format!(
            "metadata: {{name: {name}, namespace: shop}}\n\
             spec: {{nodeName: {node}, serviceAccountName: {name}}}\n\
             status: {{podIP: \"{}\", podIPs: [{}]}}\n",
            ips[0],
            ips.iter()
                .map(|ip| format!("{{ip: \"{ip}\"}}"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .unwrap()
    }

    /// A proxy state on node n1 with the dual-stack pods `client` (on n2) and
    /// `server` (on n1, captured), and a local CA.
    fn dual_stack_state() -> (Arc<ProxyState>, tempfile::TempDir) {
        let ns: Namespace = serde_yaml_ng::from_str(
            "metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}\n",
        )
        .unwrap();
        let pods = [
            pod("client", "n2", &["10.244.2.1", "fd00:1::1"]),
            pod("server", "n1", &["10.244.1.2", "fd00:2::2"]),
        ];
        let workloads = WorkloadIndex::build("n1", "cluster.local", &pods, &[ns]).0;
        let captured: HashSet<IpAddr> = ["10.244.1.2", "fd00:2::2"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect();
        crate::proxy::learning::tests::proxy_state(View {
            workloads: Arc::new(workloads),
            captured: Arc::new(captured),
            ..View::default()
        })
    }

    /// HBONE between two pods' IPv6 addresses: the outer connection goes from
    /// the client pod's address to `[server]:15008`, the CONNECT names
    /// `[server]:8080`, and the server pod sees the client pod's IPv6 address.
    /// A port 0 or another pod in the authority is a 400. In a network namespace
    /// of its own (the programs' part is left out: the HBONE port is bound on the
    /// pod's address); needs root.
    #[test]
    #[ignore = "needs root"]
    fn hbone_over_ipv6_keeps_the_client_address() {
        in_new_network_namespace(|| async {
            ip("link set lo up");
            assert!(
                crate::dataplane::net::ipv6_enabled(),
                "needs IPv6 (net.ipv6.conf.all.disable_ipv6 is 1, or the kernel has none)"
            );
            add_ipv6_address("fd00:1::1/128", "lo");
            add_ipv6_address("fd00:2::2/128", "lo");
            let (state, _ca) = dual_stack_state();
            let app = tokio::net::TcpListener::bind("[fd00:2::2]:8080")
                .await
                .unwrap();
            let echo = tokio::spawn(async move {
                let (mut tcp, peer) = app.accept().await.unwrap();
                let mut buf = [0u8; 5];
                tcp.read_exact(&mut buf).await.unwrap();
                tcp.write_all(&buf).await.unwrap();
                peer
            });
            let hbone = tokio::net::TcpListener::bind("[fd00:2::2]:15008")
                .await
                .unwrap();
            let server = state.clone();
            tokio::spawn(async move {
                loop {
                    let (tcp, peer) = hbone.accept().await.unwrap();
                    let local = canonical(tcp.local_addr().unwrap());
                    let permit = server.limits.start_handshake().unwrap();
                    tokio::spawn(handle(server.clone(), tcp, canonical(peer), local, permit));
                }
            });

            let id = |sa: &str| SpiffeId::new("cluster.local", "shop", sa);
            let key = PoolKey {
                src_id: id("client"),
                src_ip: "fd00:1::1".parse().unwrap(),
                dst_id: id("server"),
                dst: "[fd00:2::2]:15008".parse().unwrap(),
            };
            let connect = |target: &str| {
                let target: SocketAddr = target.parse().unwrap();
                let (state, key) = (state.clone(), key.clone());
                async move {
                    state
                        .pool
                        .connect(&key, target, None, &state.certs, 0)
                        .await
                }
            };
            let mut stream = connect("[fd00:2::2]:8080").await.unwrap();
            stream.write_all(b"hello").await.unwrap();
            let mut back = [0u8; 5];
            stream.read_exact(&mut back).await.unwrap();
            assert_eq!(&back, b"hello");
            assert_eq!(
                echo.await.unwrap().ip(),
                "fd00:1::1".parse::<IpAddr>().unwrap(),
                "the server pod sees the client pod's IPv6 address"
            );

            for target in ["[fd00:2::2]:0", "[fd00:1::1]:8080", "10.244.1.2:8080"] {
                match connect(target).await {
                    Err(HboneError::Status { status, .. }) => {
                        assert_eq!(status, StatusCode::BAD_REQUEST, "{target}");
                    }
                    other => panic!("{target}: {:?}", other.map(|_| ())),
                }
            }
        });
    }
}
