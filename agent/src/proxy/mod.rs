//! The node proxy: the transparent listeners the TC programs steer connections
//! into, and what happens to each connection.
//!
//! * [`outbound`] (15001): connections leaving an enrolled pod. To an enrolled pod
//!   on another node: HBONE; on this node: directly, no TLS hop; elsewhere: plain
//!   TCP. The upstream connection keeps the pod's address as its source.
//! * [`inbound`] (15008): HBONE connections to an enrolled pod on this node.
//! * [`inbound_plaintext`] (15006): plain connections to an enrolled pod on this
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
use tokio::{net::TcpListener, sync::watch};

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
}

impl ProxyState {
    /// State with no workloads yet.
    pub fn new(config: ProxyConfig, certs: CertManager) -> Self {
        Self {
            config,
            certs,
            pool: pool::Pool::default(),
            view: watch::Sender::new(View::default()),
        }
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
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(listener = name, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(handle(state.clone(), stream, peer, local));
    }
}
