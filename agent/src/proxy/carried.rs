//! The connections the proxy carries for each pod of this node, by the pod's
//! address: a pod that leaves the mesh is detached once none is left
//! ([`crate::reconcile`] drains it meanwhile).

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

/// Open connections of the proxy by pod address: outbound ones by their source
/// pod, inbound ones (HBONE streams, plaintext connections) and connections
/// between two pods of this node by their destination pod too.
#[derive(Clone, Default)]
pub struct CarriedFlows {
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl CarriedFlows {
    /// Counts one connection of the pod at `ip` until the returned guard is
    /// dropped.
    pub fn carry(&self, ip: IpAddr) -> Carried {
        *self.lock().entry(ip).or_default() += 1;
        Carried {
            flows: self.clone(),
            ip,
        }
    }

    /// Whether the proxy carries a connection of the pod at `ip` now.
    pub fn carries(&self, ip: IpAddr) -> bool {
        self.lock().contains_key(&ip)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        // A panic while counting leaves a whole map behind: go on with it.
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One connection counted by [`CarriedFlows::carry`], until dropped.
pub struct Carried {
    flows: CarriedFlows,
    ip: IpAddr,
}

impl Drop for Carried {
    fn drop(&mut self) {
        let mut counts = self.flows.lock();
        if let Some(n) = counts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_carried_while_one_of_its_connections_is_open() {
        let flows = CarriedFlows::default();
        let pod: IpAddr = "10.244.1.5".parse().unwrap();
        let other: IpAddr = "fd00::5".parse().unwrap();
        assert!(!flows.carries(pod));
        let first = flows.carry(pod);
        let second = flows.carry(pod);
        let elsewhere = flows.carry(other);
        assert!(flows.carries(pod) && flows.carries(other));
        drop(first);
        assert!(flows.carries(pod));
        drop(second);
        assert!(!flows.carries(pod));
        assert!(flows.carries(other));
        drop(elsewhere);
        assert!(flows.lock().is_empty());
    }
}
