//! The proxy's view of the node: the workloads, the addresses of the pods this
//! node captures, the authorization policies, the Services and the cluster's
//! address ranges and the DNS names, replaced as a whole each time the agent's state changes.

use std::{collections::HashSet, net::IpAddr, sync::Arc};

use super::{Workload, WorkloadIndex, ranges::ClusterRanges, service::ServiceIndex};
use crate::{authz::PolicySet, dns::names::NameTable, identity::SpiffeId};

/// The proxy's view of the node: the workloads, and the addresses of the pods this
/// node captures (their host veth found and attached, or being attached).
#[derive(Clone, Default)]
pub struct View {
    /// All workloads of the cluster.
    pub workloads: Arc<WorkloadIndex>,
    /// Addresses of the pods captured on this node.
    pub captured: Arc<HashSet<IpAddr>>,
    /// Addresses of this node's pods that left the mesh and drain: their
    /// connections through the proxy go on, new ones are not captured.
    pub draining: Arc<HashSet<IpAddr>>,
    /// The authorization policies of the mesh.
    pub policies: Arc<PolicySet>,
    /// The Services, by virtual address.
    pub services: Arc<ServiceIndex>,
    /// The cluster's pod and service ranges (`--cluster-cidrs`, and those
    /// learned from the Nodes and Services): an address in them that is not
    /// known yet is waited for briefly.
    pub ranges: Arc<ClusterRanges>,
    /// The names the DNS server answers ([`NameTable`]).
    pub names: Arc<NameTable>,
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

    /// What an authorization decision reads of this view: the workloads, the
    /// captured and draining addresses and the policies (the indexes
    /// themselves, shared).
    pub fn decision_inputs(&self) -> DecisionInputs {
        DecisionInputs {
            workloads: self.workloads.clone(),
            captured: self.captured.clone(),
            draining: self.draining.clone(),
            policies: self.policies.clone(),
        }
    }

    /// The identities of this node's captured pods, sorted, each once (the
    /// certificates the config dump and the metrics report).
    pub fn local_identities(&self) -> Vec<SpiffeId> {
        // From the captured addresses (this node's pods), not every workload
        // of the cluster: the metrics ask for these on every scrape.
        let mut ids: Vec<_> = self
            .captured
            .iter()
            .filter_map(|ip| self.local_pod(*ip))
            .map(|w| w.identity.clone())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

/// What an authorization decision reads of a [`View`]
/// ([`View::decision_inputs`]).
pub struct DecisionInputs {
    workloads: Arc<WorkloadIndex>,
    captured: Arc<HashSet<IpAddr>>,
    draining: Arc<HashSet<IpAddr>>,
    policies: Arc<PolicySet>,
}

impl DecisionInputs {
    /// Whether `view` holds these same indexes (not equal copies): whatever
    /// is decided from them alone is decided alike in it.
    pub fn same_in(&self, view: &View) -> bool {
        Arc::ptr_eq(&self.workloads, &view.workloads)
            && Arc::ptr_eq(&self.captured, &view.captured)
            && Arc::ptr_eq(&self.draining, &view.draining)
            && Arc::ptr_eq(&self.policies, &view.policies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_services_alone_decides_alike() {
        let view = View::default();
        let inputs = view.decision_inputs();
        let mut other = view.clone();
        other.services = Arc::new(ServiceIndex::default());
        other.ranges = Arc::new(ClusterRanges::default());
        assert!(inputs.same_in(&other));
        other.policies = Arc::new(PolicySet::default());
        assert!(!inputs.same_in(&other));
        // Pods leaving the mesh are read too.
        let mut leaving = view.clone();
        leaving.draining = Arc::new(HashSet::new());
        assert!(!inputs.same_in(&leaving));
    }
}
