//! Endpoint choice: which ready endpoint of a Service a new connection goes to,
//! by the open connections this proxy has to each.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use super::service::ServicePort;

/// Open connections from this proxy to each Service endpoint, for balancing.
/// Cloning gives another handle on the same counts.
#[derive(Clone, Default)]
pub struct EndpointLoad {
    open: Arc<Mutex<HashMap<SocketAddr, usize>>>,
}

impl EndpointLoad {
    /// Picks a ready endpoint of `service` by the "power of two choices"
    /// (Mitzenmacher, 2001): of two ready endpoints chosen at random, the one with
    /// fewer open connections from this proxy. The guard counts the connection
    /// as open on it until dropped. `None` when no endpoint is ready.
    pub fn pick(&self, service: &ServicePort) -> Option<EndpointGuard> {
        let ready: Vec<SocketAddr> = service.ready().collect();
        let mut load = self.open.lock().expect("endpoint load lock");
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
            load: self.open.clone(),
        })
    }
}

/// A connection to a Service endpoint, counted as open on it while it lives.
pub struct EndpointGuard {
    /// The endpoint (address and resolved target port).
    pub addr: SocketAddr,
    load: Arc<Mutex<HashMap<SocketAddr, usize>>>,
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
