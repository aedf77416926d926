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
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::{net::TcpListener, sync::watch};

use crate::{identity::CertManager, workload::WorkloadIndex};

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

/// What every connection handler reads.
pub struct ProxyState {
    /// The proxy's settings.
    pub config: ProxyConfig,
    /// Workload certificates.
    pub certs: CertManager,
    /// Pooled HBONE connections.
    pub pool: pool::Pool,
    workloads: watch::Sender<Arc<WorkloadIndex>>,
}

impl ProxyState {
    /// State with no workloads yet.
    pub fn new(config: ProxyConfig, certs: CertManager) -> Self {
        Self {
            config,
            certs,
            pool: pool::Pool::default(),
            workloads: watch::Sender::new(Arc::new(WorkloadIndex::default())),
        }
    }

    /// The current workloads.
    pub fn workloads(&self) -> Arc<WorkloadIndex> {
        self.workloads.borrow().clone()
    }

    /// Replaces the workloads. Pooled HBONE connections of pods that left the mesh
    /// are released, and the connections of such pods are closed (see
    /// [`ProxyState::unenrolled`]): without capture their packets no longer reach
    /// the proxy, so those connections could only linger half-broken.
    pub fn set_workloads(&self, index: Arc<WorkloadIndex>) {
        self.pool
            .retain(|key| index.local_enrolled(key.src_ip).is_some());
        self.workloads.send_replace(index);
    }

    /// Resolves once `ip` is no longer an enrolled pod of this node (at once if it
    /// is not one now).
    pub async fn unenrolled(&self, ip: IpAddr) {
        let mut rx = self.workloads.subscribe();
        loop {
            if rx.borrow_and_update().local_enrolled(ip).is_none() {
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
