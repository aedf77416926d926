//! A waypoint double: the HBONE side of an L7 waypoint (Istio's waypoint
//! proxy), for the tests of podlink's waypoint routing. It does no L7 work.
//!
//! It serves HBONE (HTTP/2 CONNECT over mutual TLS 1.3, ALPN `h2`) on an
//! address of a test network namespace, presenting a certificate of its own
//! SPIFFE identity and requiring a client certificate of the mesh (the agent's
//! own rustls configurations, `podlink_agent::identity::tls`). Each CONNECT is
//! recorded ([`Connect`]: the authority, the client's verified SPIFFE ID, the
//! headers) and forwarded as a waypoint does: the original destination (the
//! authority, a Service's virtual address) is mapped to an endpoint by the
//! routes the test gives, and the stream goes over HBONE to that endpoint's
//! node (TCP from the double's own address to `<pod ip>:15008`, the double's
//! certificate presented, the pod's identity required, CONNECT to the pod's
//! `ip:port`), so that the destination's agent serves a connection from its
//! waypoint. The bytes are then copied both ways. A CONNECT with no route is
//! answered 503; a refusal by the destination is answered with its status.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use podlink_agent::{
    identity::{SpiffeId, tls},
    proxy::hbone::{self, H2Stream},
};
use rustls::{RootCertStore, pki_types::ServerName, sign::CertifiedKey};

use crate::netns;

/// The HBONE port of pods (`<pod ip>:15008`), as the agents serve it.
const HBONE_PORT: u16 = 15008;

/// One CONNECT as the double saw it.
#[derive(Clone, Debug)]
pub struct Connect {
    /// The TCP peer of its HBONE connection (the client pod's address).
    pub peer: SocketAddr,
    /// The client's SPIFFE ID, from its verified certificate.
    pub client: String,
    /// The `:authority`: the original destination, as the client's agent
    /// wrote it.
    pub authority: String,
    /// The request headers, names lower-case, in order.
    pub headers: Vec<(String, String)>,
    /// The status the destination's agent answered the forwarded CONNECT
    /// with (`None`: not forwarded, no route or no connection).
    pub forwarded: Option<u16>,
}

/// Where a CONNECT to an original destination is forwarded: a pod's
/// `ip:port`, and the identity its agent presents for it.
#[derive(Clone, Debug)]
pub struct Route {
    /// The pod's address and target port.
    pub endpoint: SocketAddr,
    /// The pod's SPIFFE ID.
    pub identity: SpiffeId,
}

struct Config {
    /// The double's own address: forwarded connections come from it.
    addr: SocketAddr,
    key: Arc<CertifiedKey>,
    roots: Arc<RootCertStore>,
    routes: HashMap<SocketAddr, Route>,
    connects: Mutex<Vec<Connect>>,
}

/// A running waypoint double; stops when dropped.
pub struct WaypointDouble {
    config: Arc<Config>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl WaypointDouble {
    /// Starts a double on `addr` (its HBONE port, normally 15008) in network
    /// namespace `netns_name`, presenting `key` (a certificate of its SPIFFE
    /// identity), accepting clients of `trust_domain` whose certificates chain
    /// to `roots`, and requiring the same of the pods it forwards to;
    /// `routes` maps original destinations to endpoints.
    ///
    /// # Errors
    /// Entering the namespace, binding the address, a TLS configuration.
    pub fn start(
        netns_name: &str,
        addr: SocketAddr,
        key: Arc<CertifiedKey>,
        roots: Arc<RootCertStore>,
        trust_domain: &str,
        routes: HashMap<SocketAddr, Route>,
    ) -> Result<Self> {
        let server = tls::server_config(key.clone(), roots.clone(), trust_domain)
            .context("the waypoint double's server configuration")?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let config = Arc::new(Config {
            addr,
            key,
            roots,
            routes,
            connects: Mutex::new(Vec::new()),
        });
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let (bound, bound_rx) = std::sync::mpsc::channel();
        let shared = config.clone();
        // The whole runtime runs in the namespace: the forwarded connections'
        // sockets are made there too.
        let thread = netns::spawn_in_netns(netns_name, move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the waypoint double");
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::bind(addr).await {
                    Ok(listener) => {
                        let _ = bound.send(Ok(()));
                        listener
                    }
                    Err(e) => {
                        let _ = bound.send(Err(e));
                        return;
                    }
                };
                loop {
                    let (tcp, peer) = tokio::select! {
                        accepted = listener.accept() => match accepted {
                            Ok(accepted) => accepted,
                            Err(_) => continue,
                        },
                        _ = &mut stopped => break,
                    };
                    let (acceptor, config) = (acceptor.clone(), shared.clone());
                    tokio::spawn(async move {
                        if let Err(e) = serve_connection(acceptor, tcp, peer, config).await {
                            eprintln!("waypoint double: connection from {peer}: {e}");
                        }
                    });
                }
            });
        })
        .with_context(|| format!("entering {netns_name}"))?;
        bound_rx
            .recv()
            .map_err(|_| anyhow!("the waypoint double's thread ended before binding"))?
            .with_context(|| format!("binding the waypoint double to {addr} in {netns_name}"))?;
        Ok(Self {
            config,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The CONNECTs so far, oldest first.
    pub fn connects(&self) -> Vec<Connect> {
        self.config.connects.lock().unwrap().clone()
    }
}

impl Drop for WaypointDouble {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve_connection(
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    config: Arc<Config>,
) -> Result<()> {
    let tls = acceptor.accept(tcp).await.context("TLS handshake")?;
    let client = tls::peer_identity(tls.get_ref().1.peer_certificates())
        .map_err(|e| anyhow!("client identity: {e}"))?;
    let mut conn = h2::server::handshake(tls)
        .await
        .context("HTTP/2 handshake")?;
    while let Some(next) = conn.accept().await {
        let (req, respond) = next.context("accepting a stream")?;
        let (config, client) = (config.clone(), client.to_string());
        tokio::spawn(async move {
            if let Err(e) = serve_stream(&config, req, respond, peer, client).await {
                eprintln!("waypoint double: stream from {peer}: {e}");
            }
        });
    }
    // No more streams: drive the connection until the open ones finish.
    let _ = std::future::poll_fn(|cx| conn.poll_closed(cx)).await;
    Ok(())
}

fn status_only(status: StatusCode) -> Response<()> {
    Response::builder()
        .status(status)
        .body(())
        .expect("a status-only response")
}

/// Records one CONNECT and forwards it.
async fn serve_stream(
    config: &Config,
    req: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    peer: SocketAddr,
    client: String,
) -> Result<()> {
    let authority = req
        .uri()
        .authority()
        .map(ToString::to_string)
        .unwrap_or_default();
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
        .collect();
    let index = {
        let mut connects = config.connects.lock().unwrap();
        connects.push(Connect {
            peer,
            client,
            authority,
            headers,
            forwarded: None,
        });
        connects.len() - 1
    };
    let route = hbone::parse_connect(&req)
        .ok()
        .and_then(|dst| config.routes.get(&dst));
    let Some(route) = route else {
        let _ = respond.send_response(status_only(StatusCode::SERVICE_UNAVAILABLE), true);
        return Err(anyhow!("no route for {}", req.uri()));
    };
    let (status, upstream) = match forward(config, route, peer).await {
        Ok(forwarded) => forwarded,
        Err(e) => {
            let _ = respond.send_response(status_only(StatusCode::SERVICE_UNAVAILABLE), true);
            return Err(e);
        }
    };
    config.connects.lock().unwrap()[index].forwarded = Some(status.as_u16());
    let Some(mut upstream) = upstream else {
        let _ = respond.send_response(status_only(status), true);
        return Ok(());
    };
    let send = respond
        .send_response(status_only(StatusCode::OK), false)
        .context("answering the client")?;
    let mut downstream = H2Stream::new(send, req.into_body());
    tokio::io::copy_bidirectional(&mut downstream, &mut upstream)
        .await
        .context("copying")?;
    Ok(())
}

/// Opens HBONE to `route`'s pod from the double's address and sends the
/// CONNECT (with `forwarded: for=<client>`); returns the status answered and,
/// on 200, the stream.
async fn forward(
    config: &Config,
    route: &Route,
    client: SocketAddr,
) -> Result<(StatusCode, Option<H2Stream>)> {
    let node = SocketAddr::new(route.endpoint.ip(), HBONE_PORT);
    let socket = match node {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }?;
    socket.bind(SocketAddr::new(config.addr.ip(), 0))?;
    let tcp = socket
        .connect(node)
        .await
        .with_context(|| format!("connecting to {node}"))?;
    let client_config = tls::client_config(
        config.key.clone(),
        config.roots.clone(),
        route.identity.clone(),
    )?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client_config))
        .connect(ServerName::IpAddress(node.ip().into()), tcp)
        .await
        .with_context(|| format!("TLS to {node}"))?;
    let (sender, conn) = hbone::client_builder()
        .handshake(tls)
        .await
        .context("HTTP/2 handshake")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut sender = sender.ready().await.context("HTTP/2 connection")?;
    let (response, send) = sender
        .send_request(
            hbone::connect_request(route.endpoint, client.ip(), None),
            false,
        )
        .context("sending the CONNECT")?;
    let response = response.await.context("the CONNECT's response")?;
    let status = response.status();
    let stream = (status == StatusCode::OK).then(|| H2Stream::new(send, response.into_body()));
    Ok((status, stream))
}
