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
//! The listeners are bound to 127.0.0.1 and, when the node has IPv6
//! ([`ipv6_enabled`](crate::dataplane::net::ipv6_enabled)), their IPv6 twins to
//! `::1` (`IPV6_V6ONLY`, same ports): nothing reaches them but connections that
//! the programs assigned to them, whose local address is the original destination.
//! Every address that enters the proxy (accepted connections' addresses, HBONE
//! authorities) is in canonical form ([`canonical`]): an IPv4-mapped IPv6 address
//! (`::ffff:10.1.2.3`) is the IPv4 flow it maps, so that workload lookups, policy,
//! pooling and metrics see one form of each address.
//!
//! An outbound connection to an address of the cluster that the agent does not
//! know yet waits briefly for it to be learned (`learning`).

mod carried;
pub mod copy;
pub mod hbone;
mod inbound;
mod inbound_plaintext;
mod learning;
mod limits;
mod outbound;
pub mod pool;
pub mod socket;
mod telemetry;
mod waypoint;

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use futures_util::future::join_all;
use tokio::{
    net::TcpListener,
    sync::{OwnedSemaphorePermit, watch},
};

#[doc(hidden)]
pub use self::inbound::serve_without_tls;
pub(crate) use self::limits::{Budget, Refusal, Share};
pub use self::{carried::CarriedFlows, limits::ConnectionLimits};
use crate::{
    authz::{self, Denial, DenialCounts, Request},
    error::Chain,
    identity::CertManager,
    state::{View, endpoint::EndpointLoad, view::DecisionInputs},
    telemetry::{
        logging::RateLimited,
        metrics::{Direction, Metrics},
    },
};

/// The proxy's settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Address the IPv4 listeners bind (127.0.0.1).
    pub listen_ip: Ipv4Addr,
    /// Address the IPv6 listeners bind (`::1`), or `None` when the node has IPv6
    /// off ([`ipv6_enabled`](crate::dataplane::net::ipv6_enabled)): then only the
    /// IPv4 ones are bound, and the proxy never fails for want of IPv6.
    pub listen_ip6: Option<Ipv6Addr>,
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
    /// An inbound HBONE connection with no stream for this long is closed
    /// (GOAWAY), and so is a CONNECT stream that carried no byte either way in
    /// this long after it opened.
    pub hbone_idle_timeout: Duration,
    /// Connections (accepted, inbound HBONE ones once their handshakes succeed,
    /// plus inbound HBONE streams) handled at once; more are refused. Handshakes
    /// under way have their own budget ([`ConnectionLimits::max_handshakes`]);
    /// one source address of the outbound and inbound plaintext listeners holds at
    /// most its share of them ([`ConnectionLimits::share`]).
    pub max_connections: usize,
    /// The cluster ID: the `source_cluster` and `destination_cluster` metric
    /// labels of known workloads.
    pub cluster_id: String,
    /// Proxy threads, each a runtime of its own serving the listeners (see
    /// [`serve`]); 0 is taken as one (tests that drive the handlers on their
    /// own runtime give 0).
    pub threads: usize,
}

/// `addr` with its address in canonical form: an IPv4-mapped IPv6 address
/// (`[::ffff:10.1.2.3]:80`) becomes the IPv4 address (`10.1.2.3:80`,
/// [`IpAddr::to_canonical`]); any other address is returned as it is.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => {
            SocketAddr::new(v6.ip().to_canonical(), v6.port())
        }
        addr => addr,
    }
}

/// Authorization against the policies in the view (the proxy's part of [`View`]).
impl View {
    /// Checks `req` against the policies that apply to its destination, an
    /// enrolled pod of this node (denied when it is not one any more). AUDIT
    /// policies that match are logged when `audit` is set.
    ///
    /// # Errors
    /// The [`Denial`] ([`authz::PolicySet::decide`]).
    pub fn authorize(&self, req: &Request<'_>, audit: bool) -> Result<(), Denial> {
        let pod = self.local_pod(req.destination_ip);
        let destination = pod.map(|w| authz::Destination {
            namespace: &w.namespace,
            labels: &w.labels,
            named: w.mesh.as_ref().map_or(&[][..], |m| &m.policies),
        });
        let decision = self.policies.decide(destination, req);
        if let Some(pod) = pod.filter(|_| audit) {
            for outcome in &decision.dry_run {
                tracing::info!(
                    source_ip = %req.source_ip,
                    source = %req.source.map_or("(plaintext)".to_string(), ToString::to_string),
                    destination = %pod.key(),
                    destination_port = req.destination_port,
                    "dry-run policy {outcome}; not enforced"
                );
            }
        }
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
    /// Connection slots, the handshake budget, open listeners and the drain.
    pub limits: ConnectionLimits,
    /// Open connections to each Service endpoint, for balancing.
    pub endpoints: EndpointLoad,
    /// Open connections by pod of this node: a pod that left the mesh drains
    /// until none is left.
    pub carried: CarriedFlows,
    view: watch::Sender<View>,
    /// Connections denied, by the policy that denied them ([`Denial::policy`]).
    denials: DenialCounts,
    /// Denials logged at a bounded rate.
    denial_log: RateLimited,
    /// Connections to Services without a ready endpoint, logged at a bounded rate.
    pub service_log: RateLimited,
    /// Addresses that stayed unknown through a wait, not waited for again for
    /// a while.
    unlearned: learning::Unlearned,
}

impl ProxyState {
    /// State with no workloads yet.
    pub fn new(config: ProxyConfig, certs: CertManager) -> Self {
        Self {
            certs,
            pool: pool::Pool::default(),
            metrics: Arc::new(Metrics::new(&config.cluster_id)),
            limits: ConnectionLimits::new(config.max_connections),
            endpoints: EndpointLoad::default(),
            carried: CarriedFlows::default(),
            view: watch::Sender::new(View::default()),
            denials: Default::default(),
            denial_log: RateLimited::default(),
            service_log: RateLimited::default(),
            unlearned: learning::Unlearned::default(),
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

    /// Counts and logs a denial.
    fn denied(&self, denial: &Denial, connection: &str, what: &str) {
        let total = self.denials.count(denial);
        self.denial_log.warn(|n| {
            format!("{what} from {connection} denied: {denial} ({total} denied by it so far; {n} denials since the last such line)")
        });
    }

    /// Connections denied so far, by policy (an AuthorizationPolicy's or a
    /// PeerAuthentication's `namespace/name`, or `allow-policies` when no ALLOW
    /// policy matched, or `unknown-policies`).
    pub fn denials(&self) -> Vec<(String, u64)> {
        self.denials.by_policy()
    }

    /// Resolves, with the reason, once the pod at `req.destination_ip` leaves the
    /// mesh or the policies (or the pod's labels) change so that `req` is denied;
    /// such a denial is counted and logged. Open connections do not outlive the
    /// permission they were made with.
    ///
    /// A view that changed only in what this decision does not read (the
    /// Services, the cluster's ranges) is not decided again: an EndpointSlice
    /// change anywhere in the cluster costs open connections nothing.
    pub async fn revoked(&self, req: &Request<'_>, what: &str) -> String {
        let mut rx = self.view.subscribe();
        let mut decided = None;
        loop {
            'decide: {
                let view = rx.borrow_and_update();
                if decided
                    .as_ref()
                    .is_some_and(|d: &DecisionInputs| d.same_in(&view))
                {
                    break 'decide;
                }
                decided = Some(view.decision_inputs());
                if view.local_pod(req.destination_ip).is_none() {
                    if view.draining.contains(&req.destination_ip) {
                        // Its connections go on as they were permitted until
                        // the drain ends.
                        break 'decide;
                    }
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

    /// The view once it knows what a connection to `dst` needs
    /// ([`learning::awaited`]), or once `bound` has passed (at once when it knows
    /// it now). Woken by each [`ProxyState::update`]; holds no view and no lock
    /// while it waits.
    async fn learned(&self, dst: SocketAddr, bound: Duration) -> View {
        let deadline = tokio::time::Instant::now() + bound;
        let mut rx = self.view.subscribe();
        loop {
            {
                let view = rx.borrow_and_update();
                if learning::awaited(&view, dst).is_none() {
                    return view.clone();
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                // Timed out (the sender goes only with `self`).
                Ok(Err(_)) | Err(_) => return rx.borrow().clone(),
            }
        }
    }

    /// Resolves once `ip` is neither a captured pod of this node nor one that
    /// left the mesh and drains (at once if it is neither now).
    pub async fn unenrolled(&self, ip: IpAddr) {
        let mut rx = self.view.subscribe();
        loop {
            let carried_on = {
                let view = rx.borrow_and_update();
                view.local_pod(ip).is_some() || view.draining.contains(&ip)
            };
            if !carried_on {
                return;
            }
            if rx.changed().await.is_err() {
                // The state is gone with the agent: nothing changes any more.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A transparent listener could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("binding the transparent listener {addr}: {}", Chain(error))]
pub struct BindError {
    /// The listener: `outbound`, `inbound plaintext` or `inbound HBONE`.
    pub listener: &'static str,
    /// The address it binds.
    pub addr: SocketAddr,
    /// The system call's error: the port taken (`EADDRINUSE`), or
    /// `IP_TRANSPARENT`/`IPV6_TRANSPARENT` not permitted (`EPERM`, without
    /// `CAP_NET_ADMIN`), or `EADDRNOTAVAIL` for `::1` on a node whose loopback
    /// has no IPv6 address.
    pub error: io::Error,
}

impl ProxyConfig {
    /// The addresses the listeners bind, by listener (`outbound`, `inbound
    /// plaintext`, `inbound HBONE`): the IPv4 one, then the IPv6 one when
    /// [`ProxyConfig::listen_ip6`] is set.
    pub fn listen_addrs(&self) -> [(&'static str, Vec<SocketAddr>); 3] {
        let addrs = |port: u16| {
            let mut addrs = vec![SocketAddr::from((self.listen_ip, port))];
            addrs.extend(self.listen_ip6.map(|ip| SocketAddr::from((ip, port))));
            addrs
        };
        [
            ("outbound", addrs(self.outbound_port)),
            ("inbound plaintext", addrs(self.inbound_plaintext_port)),
            ("inbound HBONE", addrs(self.hbone_port)),
        ]
    }
}

/// The bound listeners: each kind's IPv4 listener, and its IPv6 twin when the node
/// has IPv6.
pub struct Listeners<L = TcpListener> {
    outbound: Vec<L>,
    inbound_plaintext: Vec<L>,
    hbone: Vec<L>,
}

impl Listeners {
    /// The listeners out of this runtime, for proxy threads to share.
    fn into_std(self) -> io::Result<Listeners<std::net::TcpListener>> {
        let each = |v: Vec<TcpListener>| -> io::Result<Vec<_>> {
            v.into_iter().map(TcpListener::into_std).collect()
        };
        Ok(Listeners {
            outbound: each(self.outbound)?,
            inbound_plaintext: each(self.inbound_plaintext)?,
            hbone: each(self.hbone)?,
        })
    }

    /// `shared`'s listeners on this thread's runtime.
    fn from_std(shared: Listeners<std::net::TcpListener>) -> io::Result<Self> {
        let each = |v: Vec<std::net::TcpListener>| -> io::Result<Vec<_>> {
            v.into_iter().map(TcpListener::from_std).collect()
        };
        Ok(Listeners {
            outbound: each(shared.outbound)?,
            inbound_plaintext: each(shared.inbound_plaintext)?,
            hbone: each(shared.hbone)?,
        })
    }
}

impl Listeners<std::net::TcpListener> {
    /// Another descriptor of each listener (`dup`), for one more proxy thread.
    fn try_clone(&self) -> io::Result<Self> {
        let each = |v: &[std::net::TcpListener]| -> io::Result<Vec<_>> {
            v.iter().map(std::net::TcpListener::try_clone).collect()
        };
        Ok(Listeners {
            outbound: each(&self.outbound)?,
            inbound_plaintext: each(&self.inbound_plaintext)?,
            hbone: each(&self.hbone)?,
        })
    }
}

impl Listeners {
    /// Binds the transparent listeners at [`ProxyConfig::listen_addrs`].
    ///
    /// # Errors
    /// [`BindError`]: when a port is taken or `IP_TRANSPARENT` is not permitted,
    /// for either family.
    pub fn bind(config: &ProxyConfig) -> Result<Self, BindError> {
        let mut bound = Vec::with_capacity(3);
        for (listener, addrs) in config.listen_addrs() {
            let listeners = addrs
                .into_iter()
                .map(|addr| {
                    socket::transparent_listener(addr, config.proxy_mark).map_err(|error| {
                        BindError {
                            listener,
                            addr,
                            error,
                        }
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            bound.push(listeners);
        }
        let [outbound, inbound_plaintext, hbone]: [Vec<TcpListener>; 3] =
            bound.try_into().expect("three kinds of listener");
        Ok(Self {
            outbound,
            inbound_plaintext,
            hbone,
        })
    }
}

/// Serves the listeners until the task is dropped, on [`ProxyConfig::threads`]
/// proxy threads (at least one), each a single-threaded runtime accepting on
/// all the listeners (the kernel wakes one of them per connection or all, and
/// the first to accept takes it). A connection's tasks then stay on the
/// thread that accepted it: its HBONE connections are that thread's own
/// ([`pool::set_thread`]), so no chunk is handed between threads. The proxy
/// threads outlive this task (the connections they carry finish while the
/// agent drains) and end with the process.
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
    let threads = state.config.threads.max(1);
    let shared = match listeners.into_std() {
        Ok(shared) => shared,
        Err(e) => {
            tracing::error!("the proxy's listeners could not be handed to its threads: {e}");
            return;
        }
    };
    for index in 0..threads {
        let state = state.clone();
        let mine = match shared.try_clone() {
            Ok(mine) => mine,
            Err(e) => {
                tracing::error!("proxy thread {index}: duplicating the listeners: {e}");
                continue;
            }
        };
        let started = std::thread::Builder::new()
            .name(format!("proxy-{index}"))
            .spawn(move || {
                pool::set_thread(index);
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        tracing::error!("proxy thread {index}: no runtime: {e}");
                        return;
                    }
                };
                runtime.block_on(async move {
                    match Listeners::from_std(mine) {
                        Ok(listeners) => accept_all(state, listeners).await,
                        Err(e) => tracing::error!("proxy thread {index}: its listeners: {e}"),
                    }
                    // Drained: the connections on this runtime finish.
                    std::future::pending::<()>().await
                });
            });
        if let Err(e) = started {
            tracing::error!("proxy thread {index} could not start: {e}");
        }
    }
    // The threads hold the listeners now: each closes once every thread's
    // accept loop has let go of it.
    drop(shared);
    sweeper.await;
}

/// One accept loop per listener, both families alike, until the proxy drains.
async fn accept_all(state: Arc<ProxyState>, listeners: Listeners) {
    let outbound = join_all(listeners.outbound.into_iter().map(|listener| {
        accept_loop(
            ("outbound", Direction::Outbound, Budget::Connection),
            listener,
            state.clone(),
            outbound::handle,
        )
    }));
    let inbound_plaintext = join_all(listeners.inbound_plaintext.into_iter().map(|listener| {
        accept_loop(
            ("inbound plaintext", Direction::Inbound, Budget::Connection),
            listener,
            state.clone(),
            inbound_plaintext::handle,
        )
    }));
    let hbone = join_all(listeners.hbone.into_iter().map(|listener| {
        accept_loop(
            ("inbound HBONE", Direction::Inbound, Budget::Handshake),
            listener,
            state.clone(),
            inbound::handle,
        )
    }));
    tokio::join!(outbound, inbound_plaintext, hbone);
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

/// Accepts connections on `listener` and hands each to `handle` with its peer
/// and local addresses in canonical form ([`canonical`]) and the permit of
/// `budget` (refusing it when there is none, or when `budget` is the connection
/// slots and its peer's address holds its share of them), until the proxy
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
    state.limits.listener_opened();
    let addr = listener.local_addr().ok();
    let accept_failed = RateLimited::default();
    let over_limit = RateLimited::default();
    let over_share = RateLimited::default();
    let mut close_by = None;
    loop {
        let accepted = match close_by {
            None => tokio::select! {
                accepted = listener.accept() => accepted,
                () = state.limits.draining() => {
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
            Ok((stream, peer)) => (stream, canonical(peer)),
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                accept_failed.warn(|n| format!("{name} listener: accept failed: {e} ({n} times)"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let taken = match budget {
            Budget::Connection => state.limits.connection_slot(),
            Budget::Handshake => state.limits.start_handshake(),
        };
        let Some(permit) = taken else {
            let refusal = Refusal {
                listener: name,
                direction,
                peer,
                after_handshakes: false,
            };
            state
                .limits
                .refused_at_limit(&state.metrics, &over_limit, budget, &refusal);
            socket::reset_on_close(&stream);
            continue;
        };
        // A connection slot is also one of its source address's share
        // ([`ConnectionLimits::share`]), held as long.
        let share = match budget {
            Budget::Connection => match state.limits.take_share(peer.ip()) {
                Some(share) => Some(share),
                None => {
                    let refusal = Refusal {
                        listener: name,
                        direction,
                        peer,
                        after_handshakes: false,
                    };
                    state.limits.refused_over_share(
                        &state.metrics,
                        &over_share,
                        Share::Slots,
                        &refusal,
                    );
                    socket::reset_on_close(&stream);
                    continue;
                }
            },
            Budget::Handshake => None,
        };
        let Ok(local) = stream.local_addr().map(canonical) else {
            continue;
        };
        // `TCP_NODELAY` comes from the listener (`socket::transparent_listener`).
        let handled = handle(state.clone(), stream, peer, local, permit);
        tokio::spawn(async move {
            handled.await;
            drop(share);
        });
    }
    drop(listener);
    state.limits.listener_closed();
    match addr {
        Some(addr) => tracing::info!(%addr, "{name} listener closed"),
        None => tracing::info!("{name} listener closed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::{
        net::ipv6_enabled,
        testing::{in_new_network_namespace, ip},
    };

    fn config(port: u16, listen_ip6: Option<Ipv6Addr>) -> ProxyConfig {
        ProxyConfig {
            listen_ip: Ipv4Addr::LOCALHOST,
            listen_ip6,
            outbound_port: port,
            inbound_plaintext_port: port + 5,
            hbone_port: port + 7,
            proxy_mark: 0,
            connect_timeout: Duration::from_secs(1),
            hbone_idle_timeout: Duration::from_secs(300),
            threads: 0,
            max_connections: 1,
            cluster_id: "Kubernetes".into(),
        }
    }

    /// A listener that cannot be bound (its port taken, or `IP_TRANSPARENT`
    /// not permitted) is named, with its address and the system call's error.
    #[tokio::test]
    async fn a_listener_that_cannot_be_bound_is_named() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let config = ProxyConfig {
            inbound_plaintext_port: port,
            hbone_port: port,
            ..config(port, None)
        };
        let Err(error) = Listeners::bind(&config) else {
            panic!("a taken port was bound");
        };
        assert_eq!(error.listener, "outbound");
        assert_eq!(error.addr, SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        assert_eq!(
            error.to_string(),
            format!(
                "binding the transparent listener 127.0.0.1:{port}: {}",
                error.error
            )
        );
    }

    /// With IPv6 on, each listener has an IPv6 twin on `::1` at the same port;
    /// with it off, none is bound.
    #[test]
    fn ipv6_listeners_only_when_the_node_has_ipv6() {
        let off = config(15001, None);
        for (name, addrs) in off.listen_addrs() {
            assert_eq!(addrs.len(), 1, "{name}");
            assert!(addrs[0].is_ipv4(), "{name}: {addrs:?}");
        }
        let on = config(15001, Some(Ipv6Addr::LOCALHOST));
        let want = |port| {
            vec![
                format!("127.0.0.1:{port}").parse::<SocketAddr>().unwrap(),
                format!("[::1]:{port}").parse().unwrap(),
            ]
        };
        assert_eq!(
            on.listen_addrs(),
            [
                ("outbound", want(15001)),
                ("inbound plaintext", want(15006)),
                ("inbound HBONE", want(15008)),
            ]
        );
    }

    /// IPv4-mapped addresses are the IPv4 flow; others stay as they are.
    #[test]
    fn mapped_addresses_are_canonical() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(canonical(addr("[::ffff:10.1.2.3]:80")), addr("10.1.2.3:80"));
        assert_eq!(canonical(addr("10.1.2.3:80")), addr("10.1.2.3:80"));
        assert_eq!(canonical(addr("[fd00::3]:80")), addr("[fd00::3]:80"));
        // IPv4-compatible (deprecated) addresses are IPv6, as `to_canonical` says.
        assert_eq!(canonical(addr("[::10.1.2.3]:80")), addr("[::10.1.2.3]:80"));
    }

    /// In a network namespace of its own: the IPv6 listeners are transparent,
    /// IPv6-only and accept on `::1` beside the IPv4 ones; a taken IPv6 port is an
    /// error naming the IPv6 address; with IPv6 off nothing IPv6 is bound.
    #[test]
    #[ignore = "needs root"]
    fn ipv6_twins_accept_on_loopback() {
        in_new_network_namespace(|| async {
            ip("link set lo up");
            assert!(
                ipv6_enabled(),
                "needs IPv6 (net.ipv6.conf.all.disable_ipv6 is 1, or the kernel has none)"
            );
            let listeners = Listeners::bind(&config(15001, Some(Ipv6Addr::LOCALHOST)))
                .expect("the listeners of both families");
            let local = |listeners: &[TcpListener]| -> Vec<SocketAddr> {
                listeners.iter().map(|l| l.local_addr().unwrap()).collect()
            };
            assert_eq!(
                local(&listeners.hbone),
                vec![
                    "127.0.0.1:15008".parse::<SocketAddr>().unwrap(),
                    "[::1]:15008".parse().unwrap()
                ]
            );
            for listener in [&listeners.outbound[1], &listeners.hbone[1]] {
                let sock = socket2::SockRef::from(listener);
                assert!(sock.only_v6().unwrap(), "IPV6_V6ONLY");
                assert!(sock.ip_transparent_v6().unwrap(), "IPV6_TRANSPARENT");
            }
            let client = tokio::net::TcpStream::connect("[::1]:15001").await.unwrap();
            let (accepted, peer) = listeners.outbound[1].accept().await.unwrap();
            assert_eq!(peer, client.local_addr().unwrap());
            assert_eq!(
                canonical(accepted.local_addr().unwrap()),
                "[::1]:15001".parse().unwrap()
            );
            drop(listeners);

            // A taken IPv6 port fails as a taken IPv4 one does.
            let taken = std::net::TcpListener::bind("[::1]:15106").unwrap();
            let Err(error) = Listeners::bind(&config(15101, Some(Ipv6Addr::LOCALHOST))) else {
                panic!("a taken IPv6 port was bound");
            };
            drop(taken);
            assert_eq!(error.listener, "inbound plaintext");
            assert_eq!(error.addr, "[::1]:15106".parse().unwrap());
            assert!(
                error
                    .to_string()
                    .starts_with("binding the transparent listener [::1]:15106: "),
                "{error}"
            );

            // IPv6 off: the IPv4 listeners alone.
            let listeners = Listeners::bind(&config(15201, None)).unwrap();
            for (name, kind) in [
                ("outbound", &listeners.outbound),
                ("inbound plaintext", &listeners.inbound_plaintext),
                ("inbound HBONE", &listeners.hbone),
            ] {
                let addrs = local(kind);
                assert!(addrs.iter().all(SocketAddr::is_ipv4), "{name}: {addrs:?}");
                assert_eq!(addrs.len(), 1, "{name}");
            }
            assert!(tokio::net::TcpStream::connect("[::1]:15201").await.is_err());
        });
    }
}
