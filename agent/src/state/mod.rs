//! What the agent knows, whatever the source it came from.
//!
//! A source ([`crate::source`]) sends [`Delta`]s: the objects that changed and
//! how complete its view is. [`State`] keeps the objects and derives from them
//! what the proxy and the dataplane read: the workload index and the
//! enrollment decision ([`workload`]), the Services ([`service`], their
//! endpoints chosen for this node and its zone, from its Node object) and the
//! authorization policies, AuthorizationPolicy and PeerAuthentication
//! ([`crate::authz::PolicySet`]). It knows nothing of
//! where the objects came from; a [`PodLayer`] (podlink-cni's reported
//! addresses) is laid over the pods of whichever source runs. The proxy's
//! view of it is [`view`], its choice among a Service's endpoints
//! [`endpoint`], the cluster's address ranges [`ranges`].

pub mod delta;
pub mod endpoint;
mod keyed;
pub mod ranges;
pub mod service;
pub mod view;
pub mod workload;

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

pub use delta::{Completeness, Delta, Mesh, PoliciesUnknown};
pub use ranges::ClusterRanges;
pub use view::View;
pub(crate) use workload::is_finished;
pub use workload::{
    DATAPLANE_MODE_AMBIENT, DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE, Enrollment, MeshFacts,
    Workload, WorkloadIndex, enrollment,
};

use self::{
    keyed::Keyed,
    service::{Locality, ServiceIndex},
};
use crate::{
    authz::{MtlsPolicy, Policy, PolicySet},
    dns::names::{DEFAULT_CLUSTER_DOMAIN, DnsHost, NameTable},
    k8s::{EndpointSlice, Namespace, Node, Pod, Service, ZONE_LABEL},
    telemetry::logging::{HeldMessages, Severity},
};

/// A layer over the pods of the source: what the node learnt of a pod before
/// its object says it (podlink-cni's reported addresses, [`crate::cni`]).
pub trait PodLayer {
    /// `pod` with what the layer knows of it laid over (borrowed when nothing
    /// is).
    fn overlaid<'a>(&self, pod: &'a Pod) -> Cow<'a, Pod>;
}

/// No layer: the pods as the source has them.
pub struct NoLayer;

impl PodLayer for NoLayer {
    fn overlaid<'a>(&self, pod: &'a Pod) -> Cow<'a, Pod> {
        Cow::Borrowed(pod)
    }
}

/// What [`State::refresh`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refreshed {
    /// Some object, the completeness, or whether policies are known changed:
    /// the dataplane and the proxy's view are to be reconciled.
    pub changed: bool,
    /// Pods' or namespaces' enrollment labels may have changed (the enrollment
    /// snapshot podlink-cni reads when no agent answers is to be written).
    pub enrollment_labels: bool,
}

/// The objects of the source, and the indexes made from them.
pub struct State {
    node: String,
    trust_domain: String,
    root_namespace: String,
    /// Every pod's definitions, by `namespace/name`, in the source's order.
    pods: Keyed<Pod>,
    namespaces: Vec<Namespace>,
    services: Keyed<Service>,
    endpoint_slices: Keyed<EndpointSlice>,
    policy_objects: Vec<Arc<Policy>>,
    mtls_policies: Vec<Arc<MtlsPolicy>>,
    nodes: Vec<Node>,
    /// What istiod pushed, if it feeds this agent.
    mesh: Arc<Mesh>,
    /// Whether istiod feeds this agent (a delta carried [`Delta::mesh`]): it
    /// then decides which of this node's pods are mesh workloads.
    istiod: bool,
    /// The cluster's address ranges: the configured ones, the Nodes' pod
    /// ranges and the ones learned from the ClusterIPs.
    ranges: Arc<ClusterRanges>,
    /// This node's zone (its Node object's [`ZONE_LABEL`]), as the Service
    /// index was last built with.
    zone: Option<String>,
    completeness: Completeness,
    /// What the source has not read once yet ([`Delta::unlisted`]).
    unlisted: Vec<&'static str>,
    policies_unknown: Option<PoliciesUnknown>,
    /// Policies refused by the source, by namespace ([`Delta::policies_unknown_in`]).
    policies_unknown_in: BTreeMap<String, PoliciesUnknown>,
    /// Whether the policies were known at some refresh (their return is then
    /// logged as "known again").
    policies_were_known: bool,
    /// What the deltas applied since the last refresh left to derive.
    dirty: Dirty,
    /// Whether a refresh has made the indexes once.
    refreshed: bool,
    workloads: Arc<WorkloadIndex>,
    service_index: Arc<ServiceIndex>,
    policies: Arc<PolicySet>,
    /// The cluster domain (`--cluster-domain`) of the Services' DNS names.
    cluster_domain: String,
    /// Hosts the DNS server answers beside the Services ([`State::set_dns_hosts`]).
    dns_hosts: Vec<DnsHost>,
    /// The names the DNS server answers, made with the Service index.
    names: Arc<NameTable>,
    /// The workload index's warnings (address conflicts), the Service index's
    /// and the policies' (with their notes), and PeerAuthentications that
    /// select the same pods of this node, each logged once while it holds.
    index_messages: HeldMessages,
    service_messages: HeldMessages,
    policy_messages: HeldMessages,
    mtls_messages: HeldMessages,
}

/// What changed since the last [`State::refresh`].
#[derive(Debug, Default)]
struct Dirty {
    /// Pods (`namespace/name`) whose definitions changed.
    pods: BTreeSet<String>,
    /// Every workload is to be made again (all pods replaced, or a Namespace
    /// changed).
    all_pods: bool,
    services: bool,
    policies: bool,
    nodes: bool,
    /// istiod's workloads, services or policies changed ([`Delta::mesh`]).
    mesh_workloads: bool,
    mesh_services: bool,
    mesh_policies: bool,
    enrollment_labels: bool,
    /// The completeness or whether policies are known changed.
    completeness: bool,
}

/// Puts `new` in `slot` when it is given and differs; returns whether it did.
fn replaced<T: PartialEq>(slot: &mut T, new: Option<T>) -> bool {
    match new {
        Some(new) if new != *slot => {
            *slot = new;
            true
        }
        _ => false,
    }
}

/// Whether one of `definitions` carries [`DATAPLANE_MODE_LABEL`].
fn labelled(definitions: &[Pod]) -> bool {
    definitions.iter().any(|p| {
        p.metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(DATAPLANE_MODE_LABEL))
    })
}

impl State {
    /// An empty state for node `node`, making SPIFFE IDs in `trust_domain`;
    /// policies of `root_namespace` apply mesh-wide.
    pub fn new(node: &str, trust_domain: &str, root_namespace: &str) -> Self {
        State {
            node: node.to_string(),
            trust_domain: trust_domain.to_string(),
            root_namespace: root_namespace.to_string(),
            pods: Keyed::default(),
            namespaces: Vec::new(),
            services: Keyed::default(),
            endpoint_slices: Keyed::default(),
            policy_objects: Vec::new(),
            mtls_policies: Vec::new(),
            nodes: Vec::new(),
            mesh: Arc::new(Mesh::default()),
            istiod: false,
            zone: None,
            ranges: Arc::new(ClusterRanges::default()),
            completeness: Completeness::Incomplete,
            unlisted: Vec::new(),
            policies_unknown: None,
            policies_unknown_in: BTreeMap::new(),
            policies_were_known: false,
            dirty: Dirty::default(),
            refreshed: false,
            workloads: Arc::new(WorkloadIndex::default()),
            service_index: Arc::new(ServiceIndex::default()),
            policies: Arc::new(PolicySet::default()),
            cluster_domain: DEFAULT_CLUSTER_DOMAIN.to_string(),
            dns_hosts: Vec::new(),
            names: Arc::new(NameTable::default()),
            index_messages: HeldMessages::default(),
            service_messages: HeldMessages::default(),
            policy_messages: HeldMessages::default(),
            mtls_messages: HeldMessages::default(),
        }
    }

    /// This state with the cluster's ranges `cidrs` given (`--cluster-cidrs`),
    /// beside those it learns.
    #[must_use]
    pub fn with_cluster_cidrs(mut self, cidrs: &[ipnet::IpNet]) -> Self {
        self.ranges = Arc::new(ClusterRanges::configured(cidrs));
        self
    }

    /// This state with the Services' DNS names under `domain` (`cluster.local`,
    /// `--cluster-domain`).
    #[must_use]
    pub fn with_cluster_domain(mut self, domain: &str) -> Self {
        self.cluster_domain = domain.to_string();
        self
    }

    /// Replaces the hosts the DNS server answers beside the Services: the hook
    /// for istiod's ServiceEntry hosts and their addresses (each with the
    /// addresses istiod allocated or the entry lists). The next
    /// [`State::refresh`] makes the name table again and reports a change.
    pub fn set_dns_hosts(&mut self, hosts: Vec<DnsHost>) {
        if hosts != self.dns_hosts {
            self.dns_hosts = hosts;
            self.dirty.services = true;
        }
    }

    /// Takes in a source's delta. The indexes are made again by the next
    /// [`State::refresh`], once for all the deltas applied before it.
    pub fn apply(&mut self, delta: Delta) {
        if let Some(all) = delta.all_pods
            && self.pods.replace_all(all)
        {
            self.dirty.all_pods = true;
            self.dirty.enrollment_labels = true;
        }
        for (key, definitions) in delta.pods {
            if let Some(before) = self.pods.set(key.clone(), definitions) {
                self.dirty.enrollment_labels |= labelled(&before) || labelled(self.pods.get(&key));
                self.dirty.pods.insert(key);
            }
        }
        if replaced(&mut self.namespaces, delta.namespaces) {
            self.dirty.all_pods = true;
            self.dirty.enrollment_labels = true;
        }
        self.dirty.services |= self.services.apply(delta.services, delta.changed_services);
        self.dirty.services |= self
            .endpoint_slices
            .apply(delta.endpoint_slices, delta.changed_endpoint_slices);
        self.dirty.policies |= replaced(&mut self.policy_objects, delta.policies);
        self.dirty.policies |= replaced(&mut self.mtls_policies, delta.mtls_policies);
        self.dirty.nodes |= replaced(&mut self.nodes, delta.nodes);
        if delta.completeness != self.completeness {
            self.completeness = delta.completeness;
            self.dirty.completeness = true;
        }
        if delta.policies_unknown != self.policies_unknown {
            self.policies_unknown = delta.policies_unknown;
            self.dirty.policies = true;
            self.dirty.completeness = true;
        }
        if delta.policies_unknown_in != self.policies_unknown_in {
            self.policies_unknown_in = delta.policies_unknown_in;
            self.dirty.policies = true;
        }
        self.unlisted = delta.unlisted;
        if let Some(mesh) = delta.mesh
            && (!self.istiod || !Arc::ptr_eq(&mesh, &self.mesh))
        {
            // A kind the push did not change is the same map as before.
            let first = !self.istiod;
            self.istiod = true;
            self.dirty.mesh_workloads |=
                first || !Arc::ptr_eq(&mesh.workloads, &self.mesh.workloads);
            self.dirty.mesh_policies |= first || !Arc::ptr_eq(&mesh.policies, &self.mesh.policies);
            let services_changed = first || !Arc::ptr_eq(&mesh.services, &self.mesh.services);
            self.dirty.mesh_services |= services_changed;
            if services_changed {
                // istiod's services (Kubernetes Services and ServiceEntries)
                // are answered by their host names.
                let hosts = mesh
                    .services
                    .values()
                    .map(|s| DnsHost {
                        name: s.hostname.clone(),
                        addrs: s
                            .vips
                            .iter()
                            .filter(|v| v.prefix_len() == v.max_prefix_len())
                            .map(ipnet::IpNet::addr)
                            .collect(),
                    })
                    .filter(|h| !h.addrs.is_empty())
                    .collect();
                self.set_dns_hosts(hosts);
            }
            self.mesh = mesh;
        }
    }

    /// Makes the indexes again from what the deltas since the last refresh
    /// changed, with `layer` laid over the pods; `relayered` are the pods
    /// (`namespace/name`) whose layer changed since. The workload index is
    /// updated pod by pod (each a lookup of its definitions and a few map
    /// steps), and made again whole (keeping the workloads that did not change)
    /// only when every workload may have changed: the first refresh, all pods
    /// replaced, a Namespace changed. Warnings are logged once while they hold.
    pub fn refresh(&mut self, layer: &dyn PodLayer, relayered: BTreeSet<String>) -> Refreshed {
        let dirty = std::mem::take(&mut self.dirty);
        let first = !self.refreshed;
        self.refreshed = true;
        let pods_changed = dirty.all_pods
            || dirty.mesh_workloads
            || !dirty.pods.is_empty()
            || !relayered.is_empty();
        // istiod's workloads are laid over the pods whole: a pod changed one by
        // one could lose what istiod says of it.
        let has_mesh = self.istiod;
        if first || pods_changed {
            if !first && !dirty.all_pods && !has_mesh {
                let mut index = WorkloadIndex::clone(&self.workloads);
                for key in dirty.pods.iter().chain(relayered.difference(&dirty.pods)) {
                    self.update_workload(&mut index, layer, key);
                }
                self.workloads = Arc::new(index);
            } else {
                let pods: Vec<Cow<'_, Pod>> = self.pods.iter().map(|p| layer.overlaid(p)).collect();
                let (mut index, _) = self.workloads.rebuild(
                    &self.node,
                    &self.trust_domain,
                    pods.iter().map(|p| &**p),
                    &self.namespaces,
                );
                if self.istiod {
                    index.lay_mesh(self.mesh.workloads.values());
                }
                self.workloads = Arc::new(index);
            }
            self.index_messages.log(
                self.workloads
                    .warnings()
                    .into_iter()
                    .map(|w| (Severity::Warn, w))
                    .collect(),
            );
        }
        // The Service index depends on the Node objects only through this
        // node's zone.
        let mut zone_changed = false;
        if first || dirty.nodes {
            let zone = self.node_zone();
            zone_changed = zone != self.zone;
            self.zone = zone;
        }
        if first
            || dirty.services
            || zone_changed
            || (has_mesh && pods_changed)
            || dirty.mesh_services
        {
            let here = Locality {
                node: &self.node,
                zone: self.zone.as_deref(),
            };
            let (mut services, mut warnings) = ServiceIndex::build(
                &self.cluster_domain,
                self.services.iter(),
                self.endpoint_slices.iter(),
                here,
            );
            warnings.extend(services.lay_mesh(self.mesh.services.values(), &self.workloads, here));
            self.service_messages
                .log(warnings.into_iter().map(|w| (Severity::Warn, w)).collect());
            self.service_index = Arc::new(services);
        }
        if first || dirty.services {
            let names = NameTable::build(
                &self.cluster_domain,
                self.services.iter(),
                self.endpoint_slices.iter(),
                &self.dns_hosts,
            );
            if names != *self.names {
                self.names = Arc::new(names);
            }
        }
        if first || dirty.nodes || dirty.services || dirty.mesh_services {
            let ranges = self
                .ranges
                .with_nodes(&self.nodes)
                .with_cluster_ips(self.service_index.vips());
            if ranges != *self.ranges {
                self.ranges = Arc::new(ranges);
            }
        }
        if first || dirty.policies || dirty.mesh_policies {
            self.policies = Arc::new(self.policy_set());
        }
        if first || pods_changed || dirty.policies {
            self.log_mtls_overlaps();
        }
        Refreshed {
            changed: first
                || pods_changed
                || dirty.services
                || dirty.policies
                || dirty.nodes
                || dirty.mesh_services
                || dirty.mesh_policies
                || dirty.completeness,
            enrollment_labels: first || dirty.enrollment_labels,
        }
    }

    /// This node's zone: the [`ZONE_LABEL`] of its Node object (the last of
    /// that name), if the source has one and the label is not empty.
    fn node_zone(&self) -> Option<String> {
        self.nodes
            .iter()
            .rfind(|n| n.metadata.name.as_deref() == Some(self.node.as_str()))
            .and_then(|n| n.metadata.labels.as_ref()?.get(ZONE_LABEL))
            .filter(|z| !z.is_empty())
            .cloned()
    }

    /// Updates pod `key`'s (`namespace/name`) workload in `index` from its
    /// definitions, with `layer` laid over them.
    fn update_workload(&self, index: &mut WorkloadIndex, layer: &dyn PodLayer, key: &str) {
        let Some((namespace, _)) = key.split_once('/') else {
            return;
        };
        let definitions: Vec<Cow<'_, Pod>> = self
            .pods
            .get(key)
            .iter()
            .map(|p| layer.overlaid(p))
            .collect();
        // The last of that name, as a rebuild's lookup keeps.
        let namespace_object = self
            .namespaces
            .iter()
            .rfind(|ns| ns.metadata.name.as_deref() == Some(namespace));
        index.update(
            &self.trust_domain,
            key,
            definitions.iter().map(|p| &**p),
            namespace_object,
        );
    }

    /// The policies; all requests are denied while they cannot be known,
    /// those to a namespace's pods while its policies cannot be (all requests
    /// for the root namespace's). Warnings and notes on how a policy is enforced at layer 4 are logged
    /// once while they hold, and the policies' return once they are known
    /// again.
    fn policy_set(&mut self) -> PolicySet {
        let (mut set, warnings) = PolicySet::build(
            &self.root_namespace,
            self.policy_objects
                .iter()
                .chain(self.mesh.policies.values())
                .cloned(),
            self.mtls_policies.iter().cloned(),
        );
        let mut messages: Vec<(Severity, String)> = warnings
            .into_iter()
            .map(|w| (Severity::Warn, w.to_string()))
            .collect();
        for policy in set.policies() {
            for n in &policy.notes {
                messages.push((Severity::Warn, format!("AuthorizationPolicy {policy}: {n}")));
            }
        }
        let were_unknown =
            self.policies.unknown().is_some() || !self.policies.unknown_namespaces().is_empty();
        for (namespace, unknown) in &self.policies_unknown_in {
            let pods = if *namespace == self.root_namespace {
                "every inbound connection to this node's pods is denied (the root namespace's policies apply mesh-wide)".to_string()
            } else {
                format!(
                    "inbound connections to this node's pods in namespace {namespace} are denied"
                )
            };
            messages.push((
                Severity::Error,
                format!(
                    "authorization policies of namespace {namespace} cannot be known while {} cannot be compiled ({}): {pods} until it is fixed or removed",
                    unknown.what, unknown.why
                ),
            ));
            set.deny_namespace_unknown(namespace, format!("{} cannot be compiled", unknown.what));
        }
        let now_known = self.policies_unknown.is_none() && self.policies_unknown_in.is_empty();
        if let Some(unknown) = &self.policies_unknown {
            messages.push((
                Severity::Error,
                format!(
                    "authorization policies cannot be known while {} is broken ({}): every inbound connection to this node's pods is denied until it is fixed",
                    unknown.what, unknown.why
                ),
            ));
            set.deny_all_unknown(format!("{} is broken", unknown.what));
        } else if now_known && were_unknown && self.policies_were_known {
            tracing::info!(
                "authorization policies are known again: inbound connections are authorized by them"
            );
        } else if now_known && were_unknown {
            tracing::info!(
                "authorization policies are known: inbound connections are authorized by them"
            );
        }
        self.policies_were_known |= now_known;
        self.policy_messages.log(messages);
        set
    }

    /// Warns, once while it holds, of each set of workload-level
    /// PeerAuthentications that select one of this node's enrolled pods
    /// together (the first by name is enforced).
    fn log_mtls_overlaps(&mut self) {
        let workloads = &self.workloads;
        let local = workloads
            .workloads()
            .filter(|w| w.enrollment.is_enrolled() && workloads.is_local(w))
            .map(|w| (w.namespace.as_str(), &w.labels));
        let warnings = self.policies.mtls().overlaps(local);
        self.mtls_messages.log(
            warnings
                .into_iter()
                .map(|w| (Severity::Warn, w.to_string()))
                .collect(),
        );
    }

    /// The workload index as last refreshed.
    pub fn workloads(&self) -> &Arc<WorkloadIndex> {
        &self.workloads
    }

    /// The cluster's address ranges as last refreshed: the configured ones
    /// ([`State::with_cluster_cidrs`]), the Nodes' pod ranges and those
    /// learned from the ClusterIPs.
    pub fn ranges(&self) -> &Arc<ClusterRanges> {
        &self.ranges
    }

    /// The Services as last refreshed.
    pub fn services(&self) -> &Arc<ServiceIndex> {
        &self.service_index
    }

    /// The names the DNS server answers, as last refreshed.
    pub fn names(&self) -> &Arc<NameTable> {
        &self.names
    }

    /// The authorization policies as last refreshed.
    pub fn policies(&self) -> &Arc<PolicySet> {
        &self.policies
    }

    /// Every PeerAuthentication the source has.
    pub fn mtls_policies(&self) -> &[Arc<MtlsPolicy>] {
        &self.mtls_policies
    }

    /// Every Node object the source has.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Whether the policies are known, as the source's last delta said: all
    /// but those of namespaces with refused policies
    /// ([`Delta::policies_unknown_in`]), which do not count here (the view is
    /// whole without them).
    pub fn policies_known(&self) -> bool {
        self.policies_unknown.is_none()
    }

    /// How complete the source's view is, as its last delta said.
    pub fn completeness(&self) -> Completeness {
        self.completeness
    }

    /// What the source has not read once yet, as its last delta said
    /// ([`Delta::unlisted`]).
    pub fn unlisted(&self) -> &[&'static str] {
        &self.unlisted
    }

    /// Every pod definition the source has (without the layer), by
    /// `namespace/name`.
    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.iter()
    }

    /// Every Namespace object the source has.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    /// Whether the source has a Namespace object named `name`.
    pub fn has_namespace(&self, name: &str) -> bool {
        self.namespaces
            .iter()
            .any(|ns| ns.metadata.name.as_deref() == Some(name))
    }
}

#[cfg(test)]
mod tests;
