//! The node proxy: the transparent listeners the TC programs steer connections
//! into, and what happens to each connection.
//!
//! * `outbound` (15001): connections leaving an enrolled pod. To an enrolled pod
//!   on another node: HBONE; on this node: directly, no TLS hop; elsewhere: plain
//!   TCP. The upstream connection keeps the pod's address as its source.
//! * `inbound` (15008): HBONE connections to an enrolled pod on this node.
//! * `inbound_plaintext` (15006): plain connections to an enrolled pod on this
//!   node, from outside the mesh.
//!
//! The listeners are bound to 127.0.0.1: nothing reaches them but connections that
//! the programs assigned to them, whose local address is the original destination.

pub mod copy;
pub mod hbone;
mod inbound;
mod inbound_plaintext;
mod outbound;
pub mod pool;
pub mod socket;

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::{
    net::TcpListener,
    sync::{OwnedSemaphorePermit, Semaphore, watch},
};

use crate::{
    authz::{self, Denial, DenialCounts, PolicySet, Request},
    identity::CertManager,
    state::service::{ServiceIndex, ServicePort},
    state::{Workload, WorkloadIndex},
    telemetry::metrics::{Direction, FailureKind, Metrics},
};

/// The proxy's settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Address the listeners bind (127.0.0.1).
    pub listen_ip: Ipv4Addr,
    /// Outbound capture port (15001).
    pub outbound_port: u16,
    /// Inbound plaintext capture port (15006).
    pub inbound_plaintext_port: u16,
    /// HBONE port (15008).
    pub hbone_port: u16,
    /// `SO_MARK` of every proxy socket.
    pub proxy_mark: u32,
    /// Time allowed for connecting upstream.
    pub connect_timeout: Duration,
    /// Connections (accepted, inbound HBONE ones once their handshakes succeed,
    /// plus inbound HBONE streams) handled at once; more are refused. Handshakes
    /// under way have their own budget ([`ProxyState::max_handshakes`]).
    pub max_connections: usize,
    /// The cluster ID: the `source_cluster` and `destination_cluster` metric
    /// labels of known workloads.
    pub cluster_id: String,
}

/// The proxy's view of the node: the workloads, and the addresses of the pods this
/// node captures (their host veth found and attached, or being attached).
#[derive(Clone, Default)]
pub struct View {
    /// All workloads of the cluster.
    pub workloads: Arc<WorkloadIndex>,
    /// Addresses of the pods captured on this node.
    pub captured: Arc<HashSet<IpAddr>>,
    /// The authorization policies of the mesh.
    pub policies: Arc<PolicySet>,
    /// The Services, by virtual address.
    pub services: Arc<ServiceIndex>,
}

impl View {
    /// The enrolled pod of this node at `ip`, when this node captures it. A workload
    /// that only claims to be here (its address has no host veth on this node) is
    /// not one: the proxy never connects to it as a local pod.
    pub fn local_pod(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.workloads
            .local_enrolled(ip)
            .filter(|_| self.captured.contains(&ip))
    }

    /// The identities of this node's captured pods, sorted, each once (the
    /// certificates the config dump and the metrics report).
    pub fn local_identities(&self) -> Vec<crate::identity::SpiffeId> {
        let mut ids: Vec<_> = self
            .workloads
            .workloads()
            .filter(|w| w.ips.iter().any(|ip| self.local_pod(*ip).is_some()))
            .map(|w| w.identity.clone())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Checks `req` against the policies that apply to its destination, an
    /// enrolled pod of this node (denied when it is not one any more). AUDIT
    /// policies that match are logged when `audit` is set.
    ///
    /// # Errors
    /// The [`Denial`] ([`PolicySet::decide`]).
    pub fn authorize(&self, req: &Request<'_>, audit: bool) -> Result<(), Denial> {
        let pod = self.local_pod(req.destination_ip);
        let destination = pod.map(|w| authz::Destination {
            namespace: &w.namespace,
            labels: &w.labels,
        });
        let decision = self.policies.decide(destination, req);
        if let Some(pod) = pod.filter(|_| audit) {
            for policy in &decision.audited {
                tracing::info!(
                    policy = %policy,
                    source_ip = %req.source_ip,
                    source = %req.source.map_or("(plaintext)".to_string(), ToString::to_string),
                    destination = %pod.key(),
                    destination_port = req.destination_port,
                    "AUDIT policy matched"
                );
            }
        }
        decision.into_result()
    }
}

/// A connection as access and denial logs name it ([`Request::describe`]):
/// `source (identity) to pod port N`.
pub fn describe(req: &Request<'_>, view: &View) -> String {
    req.describe(view.local_pod(req.destination_ip).map(|w| w.key()))
}

/// What every connection handler reads.
pub struct ProxyState {
    /// The proxy's settings.
    pub config: ProxyConfig,
    /// Workload certificates.
    pub certs: CertManager,
    /// Pooled HBONE connections.
    pub pool: pool::Pool,
    /// Istio's TCP metrics and the failure counts.
    pub metrics: Arc<Metrics>,
    view: watch::Sender<View>,
    /// Set once the agent drains: the listeners finish their queue and close,
    /// inbound HBONE connections are sent GOAWAY.
    draining: watch::Sender<bool>,
    /// Listeners not yet closed.
    listeners_open: std::sync::atomic::AtomicUsize,
    /// One permit per accepted connection and per inbound HBONE stream (each
    /// holds a socket or two): bounds the file descriptors clients can make the
    /// proxy hold.
    connections: Arc<Semaphore>,
    /// One permit per inbound HBONE connection whose TLS and HTTP/2 handshakes
    /// are under way ([`ProxyState::max_handshakes`]). Such connections take no
    /// connection permit until their handshakes succeed, so that clients which
    /// never finish one cannot use up the connections of every listener.
    handshakes: Arc<Semaphore>,
    /// Open connections to each Service endpoint, for balancing.
    endpoint_load: Arc<std::sync::Mutex<HashMap<SocketAddr, usize>>>,
    /// Connections denied, by the policy that denied them ([`Denial::policy`]).
    denials: DenialCounts,
    /// Denials logged at a bounded rate.
    denial_log: RateLimited,
    /// Connections to Services without a ready endpoint, logged at a bounded rate.
    pub service_log: RateLimited,
}

/// A connection refused at a limit, for [`ProxyState::refused_at_limit`].
pub(crate) struct Refusal {
    /// The listener that accepted it ("outbound", "inbound HBONE", …).
    pub listener: &'static str,
    pub direction: Direction,
    pub peer: SocketAddr,
    /// Refused once its TLS and HTTP/2 handshakes succeeded, not at accept.
    pub after_handshakes: bool,
}

/// See [`ProxyState::max_handshakes`].
fn max_handshakes(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}

/// Warnings given at most [`RateLimited::BURST`] times a second; the next one
/// given counts those left out.
#[derive(Default)]
pub struct RateLimited {
    /// Start of the current second, warnings given in it, occurrences left out.
    state: std::sync::Mutex<(Option<std::time::Instant>, u32, u64)>,
}

impl RateLimited {
    /// Warnings given per second.
    pub const BURST: u32 = 10;

    /// Counts one occurrence; logs `message(n)`, `n` being this occurrence and those
    /// left out before it, unless this second's warnings are used up.
    pub fn warn(&self, message: impl FnOnce(u64) -> String) {
        let mut state = self.state.lock().expect("rate limiter lock");
        let now = std::time::Instant::now();
        if state
            .0
            .is_none_or(|start| now.duration_since(start) >= Duration::from_secs(1))
        {
            state.0 = Some(now);
            state.1 = 0;
        }
        state.2 += 1;
        if state.1 < Self::BURST {
            state.1 += 1;
            tracing::warn!("{}", message(state.2));
            state.2 = 0;
        }
    }
}

impl ProxyState {
    /// State with no workloads yet.
    pub fn new(config: ProxyConfig, certs: CertManager) -> Self {
        Self {
            certs,
            // As many HBONE connections per pod pair as the runtime has workers.
            pool: pool::Pool::new(
                tokio::runtime::Handle::try_current().map_or(1, |rt| rt.metrics().num_workers()),
            ),
            metrics: Arc::new(Metrics::new(&config.cluster_id)),
            view: watch::Sender::new(View::default()),
            draining: watch::Sender::new(false),
            listeners_open: Default::default(),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            handshakes: Arc::new(Semaphore::new(max_handshakes(config.max_connections))),
            denials: Default::default(),
            endpoint_load: Default::default(),
            denial_log: RateLimited::default(),
            service_log: RateLimited::default(),
            config,
        }
    }

    /// Authorizes `req` with the current policies; counts and logs a denial with
    /// the policy that made it (`what` names the kind of connection).
    ///
    /// # Errors
    /// The denial.
    pub fn authorize(&self, view: &View, req: &Request<'_>, what: &str) -> Result<(), Denial> {
        view.authorize(req, true).inspect_err(|denial| {
            self.denied(denial, &describe(req, view), what);
        })
    }

    /// Starts draining: the listeners accept what is queued on them and close
    /// (the programs already hand them nothing new: [`Dataplane::set_draining`]),
    /// inbound HBONE connections are sent GOAWAY so that they close once their
    /// streams end. Open connections go on.
    ///
    /// [`Dataplane::set_draining`]: crate::dataplane::Dataplane::set_draining
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    /// Resolves once the proxy drains (at once if it does).
    pub async fn draining(&self) {
        let mut rx = self.draining.subscribe();
        // The sender lives as long as `self`.
        let _ = rx.wait_for(|draining| *draining).await;
    }

    /// Listeners still open: 0 once a draining proxy has closed them all.
    pub fn listeners_open(&self) -> usize {
        self.listeners_open
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Inbound HBONE handshakes under way at once: a quarter of
    /// [`ProxyConfig::max_connections`], at least one. More are refused (reset).
    pub fn max_handshakes(&self) -> usize {
        max_handshakes(self.config.max_connections)
    }

    /// Counts a connection refused because `budget` had no permit left (as a
    /// `connection_limit` or `handshake_limit` failure) and warns of it through
    /// `log`, at its bounded rate.
    pub(crate) fn refused_at_limit(&self, log: &RateLimited, budget: Budget, refusal: &Refusal) {
        let kind = match budget {
            Budget::Connection => FailureKind::ConnectionLimit,
            Budget::Handshake => FailureKind::HandshakeLimit,
        };
        self.metrics.failed(refusal.direction, kind);
        let Refusal {
            listener,
            peer,
            after_handshakes,
            ..
        } = refusal;
        // Worded only when the warning is given, not for each refusal.
        log.warn(|n| {
            let limit = match budget {
                Budget::Connection => format!("{} connections", self.config.max_connections),
                Budget::Handshake => format!("{} handshakes under way", self.max_handshakes()),
            };
            let when = if *after_handshakes {
                " after its handshakes"
            } else {
                ""
            };
            format!("{listener} listener: at the limit of {limit}; refused {n} (from {peer} and others){when}")
        });
    }

    /// Takes a permit for an inbound HBONE handshake; `None` at the limit.
    pub(crate) fn start_handshake(&self) -> Option<OwnedSemaphorePermit> {
        self.handshakes.clone().try_acquire_owned().ok()
    }

    /// Connections open now: accepted downstream connections (inbound HBONE
    /// connections whose handshakes succeeded included) and inbound HBONE streams.
    pub fn open_connections(&self) -> usize {
        self.config
            .max_connections
            .saturating_sub(self.connections.available_permits())
    }

    /// Picks a ready endpoint of `service` by the "power of two choices"
    /// (Mitzenmacher, 2001): of two ready endpoints chosen at random, the one with
    /// fewer open connections from this proxy. The guard counts the connection
    /// as open on it until dropped. `None` when no endpoint is ready.
    pub fn pick_endpoint(&self, service: &ServicePort) -> Option<EndpointGuard> {
        let ready: Vec<SocketAddr> = service.ready().collect();
        let mut load = self.endpoint_load.lock().expect("endpoint load lock");
        let chosen = match ready.len() {
            0 => return None,
            1 => ready[0],
            n => {
                let i = fastrand::usize(..n);
                let mut j = fastrand::usize(..n - 1);
                if j >= i {
                    j += 1;
                }
                let open = |a: &SocketAddr| load.get(a).copied().unwrap_or(0);
                if open(&ready[j]) < open(&ready[i]) {
                    ready[j]
                } else {
                    ready[i]
                }
            }
        };
        *load.entry(chosen).or_default() += 1;
        Some(EndpointGuard {
            addr: chosen,
            load: self.endpoint_load.clone(),
        })
    }

    /// Counts and logs a denial.
    fn denied(&self, denial: &Denial, connection: &str, what: &str) {
        let total = self.denials.count(denial);
        self.denial_log.warn(|n| {
            format!("{what} from {connection} denied: {denial} ({total} denied by it so far; {n} denials since the last such line)")
        });
    }

    /// Connections denied so far, by policy (`namespace/name`, or
    /// `allow-policies` when no ALLOW policy matched, or `unknown-policies`).
    pub fn denials(&self) -> Vec<(String, u64)> {
        self.denials.by_policy()
    }

    /// Resolves, with the reason, once the pod at `req.destination_ip` leaves the
    /// mesh or the policies (or the pod's labels) change so that `req` is denied;
    /// such a denial is counted and logged. Open connections do not outlive the
    /// permission they were made with.
    pub async fn revoked(&self, req: &Request<'_>, what: &str) -> String {
        let mut rx = self.view.subscribe();
        loop {
            {
                let view = rx.borrow_and_update();
                if view.local_pod(req.destination_ip).is_none() {
                    return "the pod left the mesh".into();
                }
                if let Err(denial) = view.authorize(req, false) {
                    let connection = describe(req, &view);
                    self.denied(&denial, &connection, what);
                    return format!("closed: {denial}");
                }
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Takes one of the proxy's connection slots for an upstream connection, if
    /// one is free.
    pub fn connection_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.connections.clone().try_acquire_owned().ok()
    }

    /// The current view.
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    /// Replaces the workloads, the captured addresses and the policies (open
    /// connections are checked again, see [`ProxyState::revoked`]). Pooled HBONE connections
    /// of pods that are no longer captured here are released, and such pods'
    /// connections are closed (see [`ProxyState::unenrolled`]): without capture
    /// their packets no longer reach the proxy, so those connections could only
    /// linger half-broken.
    pub fn update(&self, view: View) {
        self.pool.retain(|key| view.local_pod(key.src_ip).is_some());
        self.view.send_replace(view);
    }

    /// Resolves once `ip` is no longer a captured pod of this node (at once if it is
    /// not one now).
    pub async fn unenrolled(&self, ip: IpAddr) {
        let mut rx = self.view.subscribe();
        loop {
            if rx.borrow_and_update().local_pod(ip).is_none() {
                return;
            }
            if rx.changed().await.is_err() {
                // The state is gone with the agent: nothing changes any more.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A connection to a Service endpoint, counted as open on it while it lives.
pub struct EndpointGuard {
    /// The endpoint (address and resolved target port).
    pub addr: SocketAddr,
    load: Arc<std::sync::Mutex<HashMap<SocketAddr, usize>>>,
}

impl Drop for EndpointGuard {
    fn drop(&mut self) {
        let mut load = self.load.lock().expect("endpoint load lock");
        if let Some(n) = load.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                load.remove(&self.addr);
            }
        }
    }
}

/// The bound listeners.
pub struct Listeners {
    outbound: TcpListener,
    inbound_plaintext: TcpListener,
    hbone: TcpListener,
}

impl Listeners {
    /// Binds the three transparent listeners.
    ///
    /// # Errors
    /// When a port is taken or `IP_TRANSPARENT` is not permitted.
    pub fn bind(config: &ProxyConfig) -> Result<Self> {
        let bind = |port: u16| {
            let addr = SocketAddr::from((config.listen_ip, port));
            socket::transparent_listener(addr, config.proxy_mark)
                .with_context(|| format!("binding the transparent listener {addr}"))
        };
        Ok(Self {
            outbound: bind(config.outbound_port)?,
            inbound_plaintext: bind(config.inbound_plaintext_port)?,
            hbone: bind(config.hbone_port)?,
        })
    }
}

/// Serves the listeners until the task is dropped.
pub async fn serve(state: Arc<ProxyState>, listeners: Listeners) {
    let sweeper = {
        let state = state.clone();
        async move {
            let mut tick = tokio::time::interval(pool::IDLE_TIMEOUT / 3);
            loop {
                tick.tick().await;
                state.pool.sweep(pool::IDLE_TIMEOUT);
            }
        }
    };
    tokio::join!(
        accept_loop(
            ("outbound", Direction::Outbound, Budget::Connection),
            listeners.outbound,
            state.clone(),
            outbound::handle
        ),
        accept_loop(
            ("inbound plaintext", Direction::Inbound, Budget::Connection),
            listeners.inbound_plaintext,
            state.clone(),
            inbound_plaintext::handle
        ),
        accept_loop(
            ("inbound HBONE", Direction::Inbound, Budget::Handshake),
            listeners.hbone,
            state.clone(),
            inbound::handle
        ),
        sweeper,
    );
}

/// How long a draining listener goes on accepting after its last connection:
/// the handshakes the programs handed it before they stopped ([`CONFIG_DRAINING`])
/// complete within a round trip, or after one retransmission (TCP's initial
/// retransmission timeout is 1 s, RFC 6298).
///
/// [`CONFIG_DRAINING`]: podlink_common::CONFIG_DRAINING
const DRAIN_QUIET: Duration = Duration::from_millis(1200);
/// The longest a draining listener stays open.
const DRAIN_ACCEPT_MAX: Duration = Duration::from_secs(3);

/// The budget an accepted connection takes a permit from before it is handled.
#[derive(Clone, Copy)]
pub(crate) enum Budget {
    /// A connection slot ([`ProxyConfig::max_connections`]), held until the
    /// connection ends.
    Connection,
    /// A handshake permit ([`ProxyState::max_handshakes`]), which the handler
    /// trades for a connection slot once the handshakes succeed (inbound HBONE).
    Handshake,
}

/// Accepts connections on `listener` and hands each to `handle`, until the proxy
/// drains. The agent has then stopped the programs from handing it new
/// connections (enrolled pods' new connections fail closed); the listener goes
/// on accepting the handshakes already under way until none came for
/// [`DRAIN_QUIET`], then closes. Closing it earlier would reset the connections
/// waiting in its queue.
async fn accept_loop<F, Fut>(
    (name, direction, budget): (&'static str, Direction, Budget),
    listener: TcpListener,
    state: Arc<ProxyState>,
    handle: F,
) where
    F: Fn(
        Arc<ProxyState>,
        tokio::net::TcpStream,
        SocketAddr,
        SocketAddr,
        OwnedSemaphorePermit,
    ) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    state
        .listeners_open
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let accept_failed = RateLimited::default();
    let over_limit = RateLimited::default();
    let mut close_by = None;
    loop {
        let accepted = match close_by {
            None => tokio::select! {
                accepted = listener.accept() => accepted,
                () = state.draining() => {
                    close_by = Some(tokio::time::Instant::now() + DRAIN_ACCEPT_MAX);
                    continue;
                }
            },
            Some(close_by) => {
                let quiet = tokio::time::sleep(DRAIN_QUIET);
                tokio::select! {
                    accepted = listener.accept() => accepted,
                    () = quiet => break,
                    () = tokio::time::sleep_until(close_by) => break,
                }
            }
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                accept_failed.warn(|n| format!("{name} listener: accept failed: {e} ({n} times)"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let taken = match budget {
            Budget::Connection => state.connection_slot(),
            Budget::Handshake => state.start_handshake(),
        };
        let Some(permit) = taken else {
            let refusal = Refusal {
                listener: name,
                direction,
                peer,
                after_handshakes: false,
            };
            state.refused_at_limit(&over_limit, budget, &refusal);
            socket::reset_on_close(&stream);
            continue;
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        // `TCP_NODELAY` comes from the listener (`socket::transparent_listener`).
        tokio::spawn(handle(state.clone(), stream, peer, local, permit));
    }
    drop(listener);
    state
        .listeners_open
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    tracing::info!("{name} listener closed");
}
