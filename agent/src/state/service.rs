//! Services and their endpoints, for resolving a captured connection to a
//! Service's ClusterIP inside the proxy (capture happens before kube-proxy would
//! translate it), choosing among the endpoints as kube-proxy does.
//!
//! Built from `v1` Services (`spec.clusterIP`/`clusterIPs`, `spec.ports` with
//! `port`, `targetPort` by number or name, `protocol`, `sessionAffinity`,
//! `sessionAffinityConfig`, `internalTrafficPolicy`, `trafficDistribution`) and
//! `discovery.k8s.io/v1` EndpointSlices (the `kubernetes.io/service-name` label,
//! `endpoints[].addresses`, `conditions.ready`/`serving`/`terminating`,
//! `nodeName`, `zone`, `ports`), as the Kubernetes documentation ("Services",
//! "EndpointSlices", "Service Internal Traffic Policy", "Traffic
//! distribution") defines them:
//!
//! * An EndpointSlice port's `name` is the Service port's name, and its `port` the
//!   resolved target port, so a named `targetPort` is resolved per endpoint
//!   through its slice's ports.
//! * Conditions (KEP-1669): `ready` unset means ready, `terminating` unset means
//!   not terminating, `serving` unset means the value of `ready`. An endpoint is
//!   ready when `ready` holds and it is not terminating (the API never sets both
//!   for a pod). New connections go to ready endpoints; when none is ready, to
//!   the serving, terminating ones (kube-proxy's fallback, so that a rollout
//!   does not drop connections); never to one that is not serving.
//! * `internalTrafficPolicy: Local`: only the endpoints whose `nodeName` is this
//!   node (ready ones, else serving-terminating ones); none there means no
//!   endpoint, even when other nodes have some.
//! * `trafficDistribution` (`internalTrafficPolicy: Cluster` only), as
//!   kube-proxy applies the hints the EndpointSlice controller derives from
//!   each ready endpoint's `zone` and `nodeName`: `PreferSameNode` keeps the
//!   ready endpoints on this node, when every ready endpoint names its node and
//!   one is here; otherwise (and for `PreferClose` and `PreferSameZone`) the
//!   ready endpoints in this node's zone (its Node object's
//!   `topology.kubernetes.io/zone` label), when every ready endpoint names its
//!   zone and one is in this zone; otherwise every ready endpoint. Without this
//!   node's zone there is no zone preference. Other values are ignored.
//! * `sessionAffinity: ClientIP` keeps a client on its endpoint for
//!   `sessionAffinityConfig.clientIP.timeoutSeconds` (default 10800) after its
//!   last connection ([`super::endpoint`]).
//! * A virtual address gets the endpoints of its own address family.
//! * Headless Services (`clusterIP: None`) have no virtual address: clients
//!   connect to pod addresses, which need no resolution.
//! * Services without selectors work the same: their EndpointSlices are written
//!   by hand with the service-name label.
//!
//! Services istiod sends (workload xDS, [`MeshService`]) are laid over the
//! Kubernetes ones ([`ServiceIndex::lay_mesh`]): their endpoints are the
//! workloads that name them in their `services`, and istiod's load balancing
//! maps onto the same choices (see [`MeshBalancing`]). A ServiceEntry's CIDR
//! address is looked up by longest prefix.
//!
//! What can be decided before a connection comes is decided when the index is
//! built (made again when Services, EndpointSlices or this node's zone change):
//! each port carries the endpoints new connections go to.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use crate::k8s::{EndpointSlice, IntOrString, Service};
use serde::Serialize;

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// `sessionAffinityConfig.clientIP.timeoutSeconds` when unset, in seconds.
pub const DEFAULT_AFFINITY_SECONDS: u32 = 10_800;

/// The largest `timeoutSeconds` the API accepts, in seconds (one day).
const MAX_AFFINITY_SECONDS: u32 = 86_400;

/// Where this node is, for `internalTrafficPolicy` and `trafficDistribution`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Locality<'a> {
    /// This node's name (the endpoints' `nodeName`).
    pub node: &'a str,
    /// This node's zone (its Node object's `topology.kubernetes.io/zone`
    /// label), when known.
    pub zone: Option<&'a str>,
}

/// One endpoint of a Service port, with its conditions as the slice gives them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// Where to connect: the endpoint's address and the resolved target port.
    pub addr: SocketAddr,
    /// `conditions.ready` (unset: true).
    pub ready: bool,
    /// `conditions.serving` (unset: the value of `ready`).
    pub serving: bool,
    /// `conditions.terminating` (unset: false).
    pub terminating: bool,
    /// `nodeName`, if any.
    pub node_name: Option<String>,
    /// `zone`, if any.
    pub zone: Option<String>,
}

impl Endpoint {
    /// Ready for new connections: `ready` and not terminating.
    pub fn is_ready(&self) -> bool {
        self.ready && !self.terminating
    }

    /// Serving while terminating: used when no endpoint is ready.
    pub fn is_serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    fn on_node(&self, node: &str) -> bool {
        self.node_name.as_deref() == Some(node)
    }
}

/// Which endpoints of a Service port new connections from this node go to,
/// and why those.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Choice {
    /// Every ready endpoint.
    Ready,
    /// The ready endpoints on this node (`trafficDistribution:
    /// PreferSameNode`).
    SameNode,
    /// The ready endpoints in this node's zone (`trafficDistribution:
    /// PreferClose`, `PreferSameZone`, or `PreferSameNode` with none here).
    SameZone,
    /// No endpoint is ready: the serving, terminating ones.
    ServingTerminating,
    /// `internalTrafficPolicy: Local`: the ready endpoints on this node.
    Local,
    /// `internalTrafficPolicy: Local`, none ready on this node: the serving,
    /// terminating ones on this node.
    LocalServingTerminating,
    /// None: new connections are reset.
    None,
}

/// One port of a Service's virtual address.
#[derive(Clone, Debug, Serialize)]
pub struct ServicePort {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The host name metrics and access logs name the service by
    /// (`destination_service`, `dst.service`): a Kubernetes Service's
    /// `<name>.<namespace>.svc.<cluster domain>`, istiod's service's own
    /// (a ServiceEntry's host), as ztunnel names them.
    pub host: String,
    /// The ClusterIP and `port`.
    pub vip: SocketAddr,
    /// `ports[].name`, if any.
    pub port_name: Option<String>,
    /// `targetPort` as written (number or name; `port` when unset).
    pub target_port: String,
    /// Endpoints of the virtual address's family whose target port could be
    /// resolved, from every slice of the Service.
    pub endpoints: Vec<Endpoint>,
    /// Whether any EndpointSlice names the Service.
    pub has_slices: bool,
    /// `internalTrafficPolicy: Local`.
    pub local_only: bool,
    /// `trafficDistribution` as written, if set.
    pub traffic_distribution: Option<String>,
    /// `sessionAffinity: ClientIP`: how long a client keeps its endpoint after
    /// its last connection, in seconds; `None` without affinity.
    pub affinity_seconds: Option<u32>,
    /// Which endpoints new connections from this node go to.
    pub choice: Choice,
    /// Those endpoints, sorted, each once (empty for [`Choice::None`]).
    pub usable: Vec<SocketAddr>,
    /// The waypoints its connections go through, with their weights (a
    /// service from istiod, [`MeshService::waypoints`]); empty: none.
    pub waypoints: Vec<(super::workload::Waypoint, u32)>,
}

impl ServicePort {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The endpoints that may get new connections from this node.
    pub fn usable(&self) -> &[SocketAddr] {
        &self.usable
    }

    /// How long a client keeps its endpoint (`sessionAffinity: ClientIP`).
    pub fn affinity_timeout(&self) -> Option<Duration> {
        self.affinity_seconds
            .map(|s| Duration::from_secs(u64::from(s)))
    }

    /// Why no endpoint is usable, for the log line of a reset connection
    /// (`service <ns>/<name> <why>`).
    pub fn why_no_endpoint(&self) -> &'static str {
        if !self.has_slices {
            "has no EndpointSlice yet"
        } else if self.local_only
            && self
                .endpoints
                .iter()
                .any(|e| e.is_ready() || e.is_serving_terminating())
        {
            "has no endpoint on this node (internalTrafficPolicy: Local)"
        } else {
            "has no ready endpoint"
        }
    }
}

/// A service as istiod describes it (workload xDS `istio.workload.Service`,
/// Istio's `pkg/workloadapi/workload.proto`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MeshService {
    /// `namespace`.
    pub namespace: String,
    /// `name`.
    pub name: String,
    /// `hostname`: `<name>.<namespace>.svc.<cluster domain>` for a Kubernetes
    /// Service, the host of a ServiceEntry. Workloads name the service by
    /// `namespace/hostname`.
    pub hostname: String,
    /// `addresses`: single addresses (`/32`, `/128`) or a ServiceEntry's CIDRs.
    pub vips: Vec<ipnet::IpNet>,
    /// `ports`: (service port, target port); a target port 0 means each
    /// workload's own (its `services` entry).
    pub ports: Vec<(u16, u16)>,
    /// `load_balancing`.
    pub balancing: MeshBalancing,
    /// `waypoint`, or `weighted_waypoints` with their weights (a single
    /// waypoint has weight 1): connections to the service go through one,
    /// picked by weight per connection.
    pub waypoints: Vec<(super::workload::Waypoint, u32)>,
}

impl MeshService {
    /// `namespace/hostname`, as workloads name the service.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname)
    }
}

/// istiod's `LoadBalancing` of a service, as podlink applies it. podlink knows
/// localities as this node and its zone: `REGION`, `ZONE` and `SUBZONE` all
/// mean the zone; `CLUSTER` and `NETWORK` hold for every endpoint (one cluster,
/// one network).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MeshBalancing {
    /// `mode`.
    pub mode: BalancingMode,
    /// `routing_preference` names `NODE` first (before any zone scope).
    pub node_first: bool,
    /// `routing_preference` names `NODE`.
    pub node: bool,
    /// `routing_preference` names `REGION`, `ZONE` or `SUBZONE`.
    pub zone: bool,
    /// `health_policy: ALLOW_ALL`: unhealthy workloads get connections too.
    pub allow_unhealthy: bool,
}

/// `LoadBalancing.Mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BalancingMode {
    /// No preference (`UNSPECIFIED_MODE`, or no `load_balancing`).
    #[default]
    Any,
    /// `FAILOVER`: the closest endpoints by the routing preference, others
    /// when there are none (as `trafficDistribution`).
    Failover,
    /// `STRICT`: only endpoints that match every scope of the routing
    /// preference; none means no endpoint.
    Strict,
    /// `PASSTHROUGH`: the original destination, no endpoint chosen.
    Passthrough,
}

/// Service ports by virtual address.
#[derive(Debug, Default)]
pub struct ServiceIndex {
    by_vip: HashMap<SocketAddr, Arc<ServicePort>>,
    /// Service ports on CIDR addresses (ServiceEntries from istiod), longest
    /// prefix first.
    by_cidr: Vec<(ipnet::IpNet, Arc<ServicePort>)>,
    /// Services from istiod by `namespace/hostname`: their single virtual
    /// addresses (how a waypoint named by hostname is found).
    by_host: HashMap<String, Vec<IpAddr>>,
    /// The virtual addresses, whatever the port.
    vips: HashSet<IpAddr>,
    /// How many Services (`namespace/name`) have a port in the index.
    services: usize,
}

/// What a Service's spec says of how its endpoints are chosen.
struct Policy {
    local_only: bool,
    traffic_distribution: Option<String>,
    affinity_seconds: Option<u32>,
}

impl Policy {
    /// Reads `service`'s spec; unknown values are warned of and ignored.
    fn of(service: &Service, key: &str, warnings: &mut Vec<String>) -> Policy {
        let spec = service.spec.as_ref();
        let local_only = match spec.and_then(|s| s.internal_traffic_policy.as_deref()) {
            None | Some("Cluster") => false,
            Some("Local") => true,
            Some(other) => {
                warnings.push(format!(
                    "service {key}: internalTrafficPolicy {other:?} is neither Cluster nor Local; Cluster is used"
                ));
                false
            }
        };
        let traffic_distribution = spec.and_then(|s| s.traffic_distribution.clone());
        if let Some(other) = traffic_distribution
            .as_deref()
            .filter(|d| !matches!(*d, "PreferClose" | "PreferSameZone" | "PreferSameNode"))
        {
            warnings.push(format!(
                "service {key}: trafficDistribution {other:?} is not known (PreferClose, PreferSameZone, PreferSameNode); no preference is applied"
            ));
        }
        let affinity_seconds = match spec.and_then(|s| s.session_affinity.as_deref()) {
            None | Some("None") => None,
            Some("ClientIP") => {
                let written = spec
                    .and_then(|s| s.session_affinity_config.as_ref())
                    .and_then(|c| c.client_ip.as_ref())
                    .and_then(|c| c.timeout_seconds);
                Some(match written {
                    None => DEFAULT_AFFINITY_SECONDS,
                    Some(n) => match u32::try_from(n) {
                        Ok(n) if (1..=MAX_AFFINITY_SECONDS).contains(&n) => n,
                        _ => {
                            warnings.push(format!(
                                "service {key}: sessionAffinityConfig.clientIP.timeoutSeconds {n} is not within 1..=86400; {DEFAULT_AFFINITY_SECONDS} is used"
                            ));
                            DEFAULT_AFFINITY_SECONDS
                        }
                    },
                })
            }
            Some(other) => {
                warnings.push(format!(
                    "service {key}: sessionAffinity {other:?} is neither None nor ClientIP; no affinity is kept"
                ));
                None
            }
        };
        Policy {
            local_only,
            traffic_distribution,
            affinity_seconds,
        }
    }
}

impl ServiceIndex {
    /// Builds the index for the node at `here`, naming Services by their host
    /// in `cluster_domain` ([`ServicePort::host`]); returns warnings (two Services
    /// claiming one address and port: the first by `namespace/name` keeps it;
    /// values of `internalTrafficPolicy`, `trafficDistribution`,
    /// `sessionAffinity` and its timeout that are not known or out of range).
    pub fn build<'a>(
        cluster_domain: &str,
        services: impl IntoIterator<Item = &'a Service>,
        slices: impl IntoIterator<Item = &'a EndpointSlice>,
        here: Locality<'_>,
    ) -> (Self, Vec<String>) {
        let mut slices_of: BTreeMap<(String, String), Vec<&EndpointSlice>> = BTreeMap::new();
        for slice in slices {
            let namespace = slice.metadata.namespace_or_default().to_string();
            if let Some(service) = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(SERVICE_NAME_LABEL))
            {
                slices_of
                    .entry((namespace, service.clone()))
                    .or_default()
                    .push(slice);
            }
        }
        let mut services: Vec<&Service> = services.into_iter().collect();
        services.sort_by_key(|s| (s.metadata.namespace.clone(), s.metadata.name.clone()));
        let mut index = ServiceIndex::default();
        let mut warnings = Vec::new();
        for service in services {
            let namespace = service.metadata.namespace_or_default().to_string();
            let name = service.metadata.name.clone().unwrap_or_default();
            let Some(spec) = &service.spec else { continue };
            // Counted once, with its first port in the index.
            let mut counted = false;
            let ips = cluster_ips(service);
            if ips.is_empty() {
                continue;
            }
            let policy = Policy::of(service, &format!("{namespace}/{name}"), &mut warnings);
            let slices = slices_of.get(&(namespace.clone(), name.clone()));
            for port in spec.ports.iter().flatten() {
                if port.protocol.as_deref().is_some_and(|p| p != "TCP") {
                    continue;
                }
                let Ok(number) = u16::try_from(port.port) else {
                    continue;
                };
                let target = port.target_port.clone();
                let all = endpoints(
                    slices.map(Vec::as_slice).unwrap_or(&[]),
                    port.name.as_deref(),
                    &target,
                    number,
                );
                for &ip in &ips {
                    let vip = SocketAddr::new(ip, number);
                    let endpoints: Vec<Endpoint> = all
                        .iter()
                        .filter(|e| e.addr.is_ipv4() == ip.is_ipv4())
                        .cloned()
                        .collect();
                    let (choice, usable) = choose(&endpoints, &policy, here);
                    let entry = ServicePort {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        host: format!("{name}.{namespace}.svc.{cluster_domain}"),
                        vip,
                        port_name: port.name.clone().filter(|n| !n.is_empty()),
                        target_port: match &target {
                            Some(IntOrString::Int(n)) => n.to_string(),
                            Some(IntOrString::String(s)) => s.clone(),
                            None => number.to_string(),
                        },
                        endpoints,
                        has_slices: slices.is_some(),
                        local_only: policy.local_only,
                        traffic_distribution: policy.traffic_distribution.clone(),
                        affinity_seconds: policy.affinity_seconds,
                        choice,
                        usable,
                        waypoints: Vec::new(),
                    };
                    if let Some(other) = index.by_vip.get(&vip) {
                        warnings.push(format!(
                            "services {} and {namespace}/{name} both claim {vip}; {} keeps it",
                            other.key(),
                            other.key()
                        ));
                        continue;
                    }
                    index.by_vip.insert(vip, Arc::new(entry));
                    index.vips.insert(vip.ip());
                    if !counted {
                        counted = true;
                        index.services += 1;
                    }
                }
            }
        }
        (index, warnings)
    }

    /// The Service port at `vip`, if a Service has that address and port, or a
    /// CIDR holding the address (the longest prefix) and that port.
    pub fn lookup(&self, vip: SocketAddr) -> Option<&Arc<ServicePort>> {
        self.by_vip.get(&vip).or_else(|| {
            self.by_cidr
                .iter()
                .find(|(net, port)| port.vip.port() == vip.port() && net.contains(&vip.ip()))
                .map(|(_, port)| port)
        })
    }

    /// The virtual addresses of istiod's service `namespace/hostname`.
    pub fn host(&self, key: &str) -> &[IpAddr] {
        self.by_host.get(key).map_or(&[], Vec::as_slice)
    }

    /// Lays istiod's services over the Kubernetes ones: each port of each
    /// virtual address, with the workloads of `workloads` that back it as
    /// endpoints (those of the address's family); the node at `here` chooses
    /// among them by the service's [`MeshBalancing`]. A `PASSTHROUGH` service
    /// is not indexed (its connections go to their original destination). An
    /// address and port a Kubernetes Service has keeps it. Returns warnings.
    pub fn lay_mesh<'a>(
        &mut self,
        services: impl IntoIterator<Item = &'a Arc<MeshService>>,
        workloads: &super::WorkloadIndex,
        here: Locality<'_>,
    ) -> Vec<String> {
        let mut warnings = Vec::new();
        let mut backing: HashMap<&str, Vec<&Arc<super::Workload>>> = HashMap::new();
        for w in workloads.workloads() {
            for key in w.mesh.iter().flat_map(|m| m.services.keys()) {
                backing.entry(key.as_str()).or_default().push(w);
            }
        }
        for service in services {
            if service.balancing.mode == BalancingMode::Passthrough {
                continue;
            }
            let key = service.key();
            let backers = backing.get(key.as_str()).map_or(&[][..], Vec::as_slice);
            let policy = Policy {
                local_only: service.balancing.mode == BalancingMode::Strict
                    && service.balancing.node,
                traffic_distribution: match service.balancing {
                    MeshBalancing {
                        mode: BalancingMode::Failover,
                        node_first: true,
                        ..
                    } => Some("PreferSameNode".to_string()),
                    MeshBalancing {
                        mode: BalancingMode::Failover,
                        zone: true,
                        ..
                    } => Some("PreferClose".to_string()),
                    _ => None,
                },
                affinity_seconds: None,
            };
            let strict_zone = service.balancing.mode == BalancingMode::Strict
                && service.balancing.zone
                && !service.balancing.node;
            let mut counted = false;
            for &(port, target) in &service.ports {
                for net in &service.vips {
                    let vip = SocketAddr::new(net.network(), port);
                    let endpoints: Vec<Endpoint> = backers
                        .iter()
                        .filter_map(|w| {
                            let facts = w.mesh.as_ref()?;
                            let ip = *w.ips.iter().find(|ip| ip.is_ipv4() == vip.is_ipv4())?;
                            let target = facts.target_port(&key, port, target)?;
                            let ready = facts.healthy || service.balancing.allow_unhealthy;
                            Some(Endpoint {
                                addr: SocketAddr::new(ip, target),
                                ready,
                                serving: ready,
                                terminating: w.terminating,
                                node_name: w.node.clone(),
                                zone: facts.zone.clone(),
                            })
                        })
                        .filter(|e| {
                            !strict_zone || (here.zone.is_some() && e.zone.as_deref() == here.zone)
                        })
                        .collect();
                    let (choice, usable) = choose(&endpoints, &policy, here);
                    let entry = Arc::new(ServicePort {
                        namespace: service.namespace.clone(),
                        name: service.name.clone(),
                        host: service.hostname.clone(),
                        vip,
                        port_name: None,
                        target_port: target.to_string(),
                        endpoints,
                        has_slices: true,
                        local_only: policy.local_only,
                        traffic_distribution: policy.traffic_distribution.clone(),
                        affinity_seconds: None,
                        choice,
                        usable,
                        waypoints: service.waypoints.clone(),
                    });
                    let single = net.prefix_len() == net.max_prefix_len();
                    if single {
                        if let Some(other) = self.by_vip.get(&vip) {
                            warnings.push(format!(
                                "services {} and {}/{} (from istiod) both claim {vip}; {} keeps it",
                                other.key(),
                                service.namespace,
                                service.name,
                                other.key()
                            ));
                            continue;
                        }
                        self.by_vip.insert(vip, entry);
                        self.vips.insert(vip.ip());
                        let addrs = self.by_host.entry(key.clone()).or_default();
                        if !addrs.contains(&vip.ip()) {
                            addrs.push(vip.ip());
                        }
                    } else {
                        self.by_cidr.push((net.trunc(), entry));
                    }
                    if !counted {
                        counted = true;
                        self.services += 1;
                    }
                }
            }
        }
        self.by_cidr
            .sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
        warnings
    }

    /// Whether `ip` is some Service's virtual address.
    pub fn is_vip(&self, ip: IpAddr) -> bool {
        self.vips.contains(&ip)
    }

    /// Every Service's virtual addresses, each once, in no order.
    pub fn vips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.vips.iter().copied()
    }

    /// How many Services have a port in the index.
    pub fn service_count(&self) -> usize {
        self.services
    }

    /// All service ports, by address.
    pub fn ports(&self) -> impl Iterator<Item = &Arc<ServicePort>> {
        let mut all: Vec<_> = self.by_vip.values().collect();
        all.sort_by_key(|p| (p.key(), p.vip));
        all.into_iter()
    }
}

/// The endpoints of `endpoints` new connections from the node at `here` go
/// to under `policy`, as kube-proxy's `CategorizeEndpoints` chooses them.
fn choose(
    endpoints: &[Endpoint],
    policy: &Policy,
    here: Locality<'_>,
) -> (Choice, Vec<SocketAddr>) {
    let pick = |choice: Choice, keep: &dyn Fn(&Endpoint) -> bool| {
        let mut usable: Vec<SocketAddr> = endpoints
            .iter()
            .filter(|e| keep(e))
            .map(|e| e.addr)
            .collect();
        usable.sort_unstable();
        usable.dedup();
        if usable.is_empty() {
            None
        } else {
            Some((choice, usable))
        }
    };
    let chosen = if policy.local_only {
        // Topology does not apply: the endpoints are here already.
        pick(Choice::Local, &|e| e.is_ready() && e.on_node(here.node)).or_else(|| {
            pick(Choice::LocalServingTerminating, &|e| {
                e.is_serving_terminating() && e.on_node(here.node)
            })
        })
    } else {
        let ready = || endpoints.iter().filter(|e| e.is_ready());
        let distribution = policy.traffic_distribution.as_deref();
        let same_node = (distribution == Some("PreferSameNode")
            && ready().all(|e| e.node_name.is_some())
            && ready().any(|e| e.on_node(here.node)))
        .then(|| pick(Choice::SameNode, &|e| e.is_ready() && e.on_node(here.node)))
        .flatten();
        let in_zone = |e: &Endpoint| here.zone.is_some() && e.zone.as_deref() == here.zone;
        let same_zone = || {
            (matches!(
                distribution,
                Some("PreferClose" | "PreferSameZone" | "PreferSameNode")
            ) && ready().all(|e| e.zone.is_some())
                && ready().any(in_zone))
            .then(|| pick(Choice::SameZone, &|e| e.is_ready() && in_zone(e)))
            .flatten()
        };
        same_node
            .or_else(same_zone)
            .or_else(|| pick(Choice::Ready, &Endpoint::is_ready))
            // No endpoint ready anywhere: topology is not considered.
            .or_else(|| {
                pick(
                    Choice::ServingTerminating,
                    &Endpoint::is_serving_terminating,
                )
            })
    };
    chosen.unwrap_or((Choice::None, Vec::new()))
}

/// A Service's virtual addresses (`clusterIPs`, else `clusterIP`); none for a
/// headless Service.
fn cluster_ips(service: &Service) -> Vec<IpAddr> {
    let Some(spec) = &service.spec else {
        return Vec::new();
    };
    let mut ips: Vec<&String> = spec.cluster_ips.iter().flatten().collect();
    if ips.is_empty() {
        ips.extend(spec.cluster_ip.as_ref());
    }
    ips.into_iter().filter_map(|ip| ip.parse().ok()).collect()
}

/// The endpoints of the Service port named `port_name` (number `port`, target
/// `target`) across `slices`.
fn endpoints(
    slices: &[&EndpointSlice],
    port_name: Option<&str>,
    target: &Option<IntOrString>,
    port: u16,
) -> Vec<Endpoint> {
    let mut out = Vec::new();
    for slice in slices {
        // The slice's port for this Service port: same name ("" when unnamed).
        let slice_port = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref().unwrap_or("") == port_name.unwrap_or(""))
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok());
        let resolved = match (slice_port, target) {
            (Some(p), _) => p,
            (None, Some(IntOrString::Int(n))) => match u16::try_from(*n) {
                Ok(n) => n,
                Err(_) => continue,
            },
            // A named target port with no matching slice port cannot be resolved.
            (None, Some(IntOrString::String(_))) => continue,
            (None, None) => port,
        };
        for endpoint in slice.endpoints.iter().flatten() {
            let conditions = endpoint.conditions.as_ref();
            let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
            let serving = conditions.and_then(|c| c.serving).unwrap_or(ready);
            let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    out.push(Endpoint {
                        addr: SocketAddr::new(ip, resolved),
                        ready,
                        serving,
                        terminating,
                        node_name: endpoint.node_name.clone().filter(|n| !n.is_empty()),
                        zone: endpoint.zone.clone().filter(|z| !z.is_empty()),
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(yaml: &str) -> Service {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn slice(yaml: &str) -> EndpointSlice {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    /// Node `n1` in zone `z1`.
    const HERE: Locality<'static> = Locality {
        node: "n1",
        zone: Some("z1"),
    };

    const WEB: &str = "metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: http}
  - {name: admin, port: 9000, targetPort: 9090}
  - {name: dns, port: 53, protocol: UDP}
";

    const WEB_SLICE: &str = "metadata:
  name: web-abc
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, port: 8080}
- {name: admin, port: 9090}
endpoints:
- addresses: [10.244.1.2]
  conditions: {ready: true}
- addresses: [10.244.2.2]
- addresses: [10.244.2.3]
  conditions: {ready: false}
- addresses: [10.244.2.4]
  conditions: {ready: true, serving: true, terminating: true}
";

    fn usable(port: &ServicePort) -> Vec<String> {
        port.usable().iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn named_target_ports_resolve_through_the_slice() {
        let (index, warnings) =
            ServiceIndex::build("cluster.local", [&service(WEB)], [&slice(WEB_SLICE)], HERE);
        assert!(warnings.is_empty());
        let http = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert_eq!(http.key(), "shop/web");
        assert_eq!(http.host, "web.shop.svc.cluster.local");
        let (other_domain, _) = ServiceIndex::build("corp.example", [&service(WEB)], [], HERE);
        let port = other_domain.lookup("10.96.0.10:80".parse().unwrap());
        assert_eq!(port.unwrap().host, "web.shop.svc.corp.example");
        // Unset ready counts as ready; not ready and terminating get nothing
        // while some endpoint is ready.
        assert_eq!(usable(http), ["10.244.1.2:8080", "10.244.2.2:8080"]);
        assert_eq!(http.choice, Choice::Ready);
        assert_eq!(http.affinity_timeout(), None);
        let admin = index.lookup("10.96.0.10:9000".parse().unwrap()).unwrap();
        assert!(admin.usable().iter().all(|a| a.port() == 9090));
        // UDP ports and unknown ports are not resolved.
        assert!(index.lookup("10.96.0.10:53".parse().unwrap()).is_none());
        assert!(index.lookup("10.96.0.10:81".parse().unwrap()).is_none());
        assert!(index.is_vip("10.96.0.10".parse().unwrap()));
        assert_eq!(index.service_count(), 1);
    }

    #[test]
    fn services_without_slices_and_headless_services() {
        let (index, _) = ServiceIndex::build("cluster.local", [&service(WEB)], [], HERE);
        let http = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert!(!http.has_slices && http.usable().is_empty());
        assert_eq!(http.choice, Choice::None);
        assert_eq!(http.why_no_endpoint(), "has no EndpointSlice yet");
        // Headless: no virtual address, clients connect to the pods as they
        // are, whatever the rest of the spec says.
        let headless = service(
            &WEB.replace("10.96.0.10", "None")
                .replace("  ports:", "  sessionAffinity: Bogus\n  ports:"),
        );
        let (index, warnings) =
            ServiceIndex::build("cluster.local", [&headless], [&slice(WEB_SLICE)], HERE);
        assert_eq!(index.ports().count(), 0);
        assert!(!index.is_vip("10.244.1.2".parse().unwrap()));
        assert!(warnings.is_empty(), "{warnings:?}");
        // A named target port the slice does not list cannot be resolved.
        let other = slice(&WEB_SLICE.replace("name: http, port: 8080", "name: web, port: 8080"));
        let (index, _) = ServiceIndex::build("cluster.local", [&service(WEB)], [&other], HERE);
        let http = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert!(http.has_slices && http.endpoints.is_empty());
        assert_eq!(http.why_no_endpoint(), "has no ready endpoint");
    }

    #[test]
    fn every_cluster_ip_gets_the_endpoints_of_its_family() {
        let dual = service(
            "metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, 'fd00:96::10']
  ports: [{port: 80, targetPort: 8080}]
",
        );
        let v6 = slice(
            "metadata: {name: web-v6, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{port: 8080}]
endpoints: [{addresses: ['fd00:244::2']}]
",
        );
        let v4 = slice(&WEB_SLICE.replace("name: http, port: 8080", "port: 8080"));
        let (index, _) = ServiceIndex::build("cluster.local", [&dual], [&v4, &v6], HERE);
        let four = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert_eq!(usable(four), ["10.244.1.2:8080", "10.244.2.2:8080"]);
        let six = index.lookup("[fd00:96::10]:80".parse().unwrap()).unwrap();
        assert_eq!(usable(six), ["[fd00:244::2]:8080"]);
        assert_eq!(six.endpoints.len(), 1);
        assert!(index.is_vip("fd00:96::10".parse().unwrap()));
    }

    #[test]
    fn a_shared_address_is_kept_by_the_first() {
        let other = service(
            &WEB.replace("name: web,", "name: aaa,")
                .replace("name: web\n", "name: aaa\n"),
        );
        let (index, warnings) =
            ServiceIndex::build("cluster.local", [&service(WEB), &other], [], HERE);
        assert_eq!(
            index.lookup("10.96.0.10:80".parse().unwrap()).unwrap().name,
            "aaa"
        );
        assert!(
            warnings[0].contains("both claim 10.96.0.10:80"),
            "{warnings:?}"
        );
    }

    /// Service `shop/api` at 10.96.0.20:80, with `spec` lines added.
    fn api(spec: &str) -> Service {
        service(&format!(
            "metadata: {{name: api, namespace: shop}}
spec:
  clusterIP: 10.96.0.20
  ports: [{{port: 80, targetPort: 8080}}]
{spec}"
        ))
    }

    /// Its slice: endpoints as (address, nodeName, zone, conditions), empty
    /// strings leaving a field out.
    fn api_slice(endpoints: &[(&str, &str, &str, &str)]) -> EndpointSlice {
        let mut yaml = String::from(
            "metadata: {name: api-1, namespace: shop, labels: {kubernetes.io/service-name: api}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
",
        );
        for (addr, node, zone, conditions) in endpoints {
            yaml.push_str(&format!("- addresses: [{addr}]\n"));
            for (field, value) in [
                ("nodeName", node),
                ("zone", zone),
                ("conditions", conditions),
            ] {
                if !value.is_empty() {
                    yaml.push_str(&format!("  {field}: {value}\n"));
                }
            }
        }
        slice(&yaml)
    }

    /// The choice for `api` with `spec` and `endpoints`, seen from `here`, and
    /// the chosen addresses (without the port).
    fn chosen(
        spec: &str,
        endpoints: &[(&str, &str, &str, &str)],
        here: Locality<'_>,
    ) -> (Choice, Vec<String>, &'static str) {
        let (index, warnings) =
            ServiceIndex::build("cluster.local", [&api(spec)], [&api_slice(endpoints)], here);
        assert!(warnings.is_empty(), "{warnings:?}");
        let port = index.lookup("10.96.0.20:80".parse().unwrap()).unwrap();
        let addrs = port.usable().iter().map(|a| a.ip().to_string()).collect();
        (port.choice, addrs, port.why_no_endpoint())
    }

    const TERMINATING: &str = "{ready: false, serving: true, terminating: true}";

    #[test]
    fn serving_terminating_endpoints_only_when_none_is_ready() {
        let endpoints = [
            ("10.0.0.1", "", "", "{ready: true}"),
            ("10.0.0.2", "", "", TERMINATING),
            (
                "10.0.0.3",
                "",
                "",
                "{ready: false, serving: false, terminating: true}",
            ),
            // `serving` unset is `ready`: false.
            ("10.0.0.4", "", "", "{ready: false, terminating: true}"),
            ("10.0.0.5", "", "", "{ready: false}"),
        ];
        let (choice, addrs, _) = chosen("", &endpoints, HERE);
        assert_eq!(
            (choice, addrs),
            (Choice::Ready, vec!["10.0.0.1".to_string()])
        );
        let (choice, addrs, _) = chosen("", &endpoints[1..], HERE);
        assert_eq!(
            (choice, addrs),
            (Choice::ServingTerminating, vec!["10.0.0.2".to_string()])
        );
        // Not serving: never.
        let (choice, addrs, why) = chosen("", &endpoints[2..], HERE);
        assert_eq!((choice, addrs.len()), (Choice::None, 0));
        assert_eq!(why, "has no ready endpoint");
        // `ready` written with terminating is not ready (the API never sets
        // both for a pod), but it is serving (`serving` unset is `ready`).
        let (choice, addrs, _) = chosen(
            "",
            &[("10.0.0.6", "", "", "{ready: true, terminating: true}")],
            HERE,
        );
        assert_eq!(
            (choice, addrs),
            (Choice::ServingTerminating, vec!["10.0.0.6".to_string()])
        );
    }

    /// On this node (n1, zone z1), elsewhere in its zone, in another zone.
    const SPREAD: [(&str, &str, &str, &str); 3] = [
        ("10.0.1.1", "n1", "z1", ""),
        ("10.0.2.1", "n2", "z1", ""),
        ("10.0.3.1", "n3", "z2", ""),
    ];

    fn strings(addrs: &[&str]) -> Vec<String> {
        addrs.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn internal_traffic_policy_local_keeps_this_nodes_endpoints() {
        let local = "  internalTrafficPolicy: Local\n";
        let (choice, addrs, _) = chosen(local, &SPREAD, HERE);
        assert_eq!((choice, addrs), (Choice::Local, strings(&["10.0.1.1"])));
        // None here: none at all, though other nodes have some.
        let (choice, addrs, why) = chosen(local, &SPREAD[1..], HERE);
        assert_eq!((choice, addrs.len()), (Choice::None, 0));
        assert_eq!(
            why,
            "has no endpoint on this node (internalTrafficPolicy: Local)"
        );
        // Serving-terminating here, ready elsewhere: the local terminating one.
        let mut endpoints = SPREAD;
        endpoints[0].3 = TERMINATING;
        let (choice, addrs, _) = chosen(local, &endpoints, HERE);
        assert_eq!(
            (choice, addrs),
            (Choice::LocalServingTerminating, strings(&["10.0.1.1"]))
        );
        // Topology does not apply to Local; Cluster is the default.
        let (choice, _, _) = chosen(
            "  internalTrafficPolicy: Local\n  trafficDistribution: PreferSameZone\n",
            &SPREAD,
            HERE,
        );
        assert_eq!(choice, Choice::Local);
        let (choice, addrs, _) = chosen("  internalTrafficPolicy: Cluster\n", &SPREAD, HERE);
        assert_eq!((choice, addrs.len()), (Choice::Ready, 3));
        // No endpoint anywhere: the usual reason.
        let (_, _, why) = chosen(local, &[("10.0.1.1", "n1", "", "{ready: false}")], HERE);
        assert_eq!(why, "has no ready endpoint");
    }

    #[test]
    fn prefer_close_and_same_zone_keep_this_zones_endpoints() {
        for value in ["PreferClose", "PreferSameZone"] {
            let spec = format!("  trafficDistribution: {value}\n");
            let (choice, addrs, _) = chosen(&spec, &SPREAD, HERE);
            assert_eq!(
                (choice, addrs),
                (Choice::SameZone, strings(&["10.0.1.1", "10.0.2.1"])),
                "{value}"
            );
            // None in this zone: every ready endpoint.
            let (choice, addrs, _) = chosen(&spec, &SPREAD[2..], HERE);
            assert_eq!((choice, addrs), (Choice::Ready, strings(&["10.0.3.1"])));
            // This zone's only endpoint not ready: the others, not the
            // terminating one.
            let mut endpoints = SPREAD;
            endpoints[0].3 = TERMINATING;
            endpoints[1].3 = "{ready: false}";
            let (choice, addrs, _) = chosen(&spec, &endpoints, HERE);
            assert_eq!((choice, addrs), (Choice::Ready, strings(&["10.0.3.1"])));
            // No zone known for this node: no preference.
            let nowhere = Locality {
                node: "n1",
                zone: None,
            };
            let (choice, addrs, _) = chosen(&spec, &SPREAD, nowhere);
            assert_eq!((choice, addrs.len()), (Choice::Ready, 3));
            // A ready endpoint without a zone: no hints, no preference (as
            // kube-proxy does).
            let mut endpoints = SPREAD;
            endpoints[2].2 = "";
            let (choice, addrs, _) = chosen(&spec, &endpoints, HERE);
            assert_eq!((choice, addrs.len()), (Choice::Ready, 3));
        }
        // Without trafficDistribution: no preference.
        let (choice, addrs, _) = chosen("", &SPREAD, HERE);
        assert_eq!((choice, addrs.len()), (Choice::Ready, 3));
    }

    #[test]
    fn prefer_same_node_then_same_zone_then_any() {
        let spec = "  trafficDistribution: PreferSameNode\n";
        let (choice, addrs, _) = chosen(spec, &SPREAD, HERE);
        assert_eq!((choice, addrs), (Choice::SameNode, strings(&["10.0.1.1"])));
        // None on this node: this zone's.
        let (choice, addrs, _) = chosen(spec, &SPREAD[1..], HERE);
        assert_eq!((choice, addrs), (Choice::SameZone, strings(&["10.0.2.1"])));
        // None in this zone either: any.
        let (choice, addrs, _) = chosen(spec, &SPREAD[2..], HERE);
        assert_eq!((choice, addrs), (Choice::Ready, strings(&["10.0.3.1"])));
        // No zone known: this node's still, then any.
        let nowhere = Locality {
            node: "n1",
            zone: None,
        };
        let (choice, _, _) = chosen(spec, &SPREAD, nowhere);
        assert_eq!(choice, Choice::SameNode);
        let (choice, addrs, _) = chosen(spec, &SPREAD[1..], nowhere);
        assert_eq!((choice, addrs.len()), (Choice::Ready, 2));
        // This node's endpoint terminating: not preferred.
        let mut endpoints = SPREAD;
        endpoints[0].3 = TERMINATING;
        let (choice, addrs, _) = chosen(spec, &endpoints, HERE);
        assert_eq!((choice, addrs), (Choice::SameZone, strings(&["10.0.2.1"])));
    }

    #[test]
    fn session_affinity_and_unknown_values() {
        let (index, _) = ServiceIndex::build(
            "cluster.local",
            [&api("  sessionAffinity: ClientIP\n")],
            [],
            HERE,
        );
        let port = index.lookup("10.96.0.20:80".parse().unwrap()).unwrap();
        assert_eq!(port.affinity_timeout(), Some(Duration::from_secs(10_800)));
        let spec = "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 30}}\n";
        let (index, _) = ServiceIndex::build("cluster.local", [&api(spec)], [], HERE);
        let port = index.lookup("10.96.0.20:80".parse().unwrap()).unwrap();
        assert_eq!(port.affinity_timeout(), Some(Duration::from_secs(30)));
        let (index, _) = ServiceIndex::build(
            "cluster.local",
            [&api("  sessionAffinity: None\n")],
            [],
            HERE,
        );
        let port = index.lookup("10.96.0.20:80".parse().unwrap()).unwrap();
        assert_eq!(port.affinity_timeout(), None);

        let spec = "  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}
  internalTrafficPolicy: Nearby
  trafficDistribution: PreferMoon
";
        let (index, warnings) =
            ServiceIndex::build("cluster.local", [&api(spec)], [&api_slice(&SPREAD)], HERE);
        let port = index.lookup("10.96.0.20:80".parse().unwrap()).unwrap();
        assert_eq!(port.affinity_timeout(), Some(Duration::from_secs(10_800)));
        assert_eq!((port.choice, port.usable().len()), (Choice::Ready, 3));
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(warnings[0].contains("shop/api: internalTrafficPolicy \"Nearby\""));
        assert!(warnings[1].contains("trafficDistribution \"PreferMoon\" is not known"));
        assert!(warnings[2].contains("timeoutSeconds 0 is not within 1..=86400"));
    }
}
