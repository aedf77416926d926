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

mod copy;
pub mod hbone;
mod inbound;
mod inbound_plaintext;
mod outbound;
pub mod pool;
pub mod socket;

use std::{
    collections::HashSet,
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
    identity::CertManager,
    workload::{Workload, WorkloadIndex},
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
    /// Connections (accepted, plus inbound HBONE streams) handled at once; more
    /// are refused.
    pub max_connections: usize,
}

/// The proxy's view of the node: the workloads, and the addresses of the pods this
/// node captures (their host veth found and attached, or being attached).
#[derive(Clone, Default)]
pub struct View {
    /// All workloads of the cluster.
    pub workloads: Arc<WorkloadIndex>,
    /// Addresses of the pods captured on this node.
    pub captured: Arc<HashSet<IpAddr>>,
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
}

/// What every connection handler reads.
pub struct ProxyState {
    /// The proxy's settings.
    pub config: ProxyConfig,
    /// Workload certificates.
    pub certs: CertManager,
    /// Pooled HBONE connections.
    pub pool: pool::Pool,
    view: watch::Sender<View>,
    /// One permit per accepted connection and per inbound HBONE stream (each
    /// holds a socket or two): bounds the file descriptors clients can make the
    /// proxy hold.
    connections: Arc<Semaphore>,
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
            pool: pool::Pool::default(),
            view: watch::Sender::new(View::default()),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            config,
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

    /// Replaces the workloads and the captured addresses. Pooled HBONE connections
    /// of pods that are no longer captured here are released, and such pods'
    /// connections are closed (see [`ProxyState::unenrolled`]): without capture
    /// their packets no longer reach the proxy, so those connections could only
    /// linger half-broken.
    pub fn update(&self, workloads: Arc<WorkloadIndex>, captured: Arc<HashSet<IpAddr>>) {
        let view = View {
            workloads,
            captured,
        };
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
            "outbound",
            listeners.outbound,
            state.clone(),
            outbound::handle
        ),
        accept_loop(
            "inbound plaintext",
            listeners.inbound_plaintext,
            state.clone(),
            inbound_plaintext::handle
        ),
        accept_loop(
            "inbound HBONE",
            listeners.hbone,
            state.clone(),
            inbound::handle
        ),
        sweeper,
    );
}

async fn accept_loop<F, Fut>(
    name: &'static str,
    listener: TcpListener,
    state: Arc<ProxyState>,
    handle: F,
) where
    F: Fn(Arc<ProxyState>, tokio::net::TcpStream, SocketAddr, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let accept_failed = RateLimited::default();
    let over_limit = RateLimited::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                accept_failed.warn(|n| format!("{name} listener: accept failed: {e} ({n} times)"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = state.connections.clone().try_acquire_owned() else {
            over_limit.warn(|n| {
                format!("{name} listener: at the limit of {} connections; refused {n} (from {peer} and others)", state.config.max_connections)
            });
            socket::reset_on_close(&stream);
            continue;
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let connection = handle(state.clone(), stream, peer, local);
        tokio::spawn(async move {
            connection.await;
            drop(permit);
        });
    }
}
