//! Addresses the agent does not know yet.
//!
//! A pod's first connection can be made before the agent has learned of its
//! peer: a pod created a moment ago whose object (or manifest) is still on its
//! way, a Service whose EndpointSlice has not arrived. Treated as outside the
//! mesh, such a connection would go in plain text, or be reset; ztunnel has the
//! same window. Instead, an outbound connection to an address that is in one of
//! the cluster's ranges ([`ClusterRanges`](crate::state::ClusterRanges)) and
//! known as neither a workload nor a Service, or to a Service port without an
//! EndpointSlice yet, waits for the view to learn it, for at most
//! [`LEARN_WAIT`], woken by each view update, then goes on with what is known
//! then. Connections to addresses outside the ranges never wait.
//!
//! An address that stayed unknown is remembered for [`UNLEARNED_FOR`]: further
//! connections to it go on at once (a gateway address inside a pod range, a
//! pod that is gone, cost one wait per that time, not one per connection).
//!
//! On the receiving side, [`client_address`] decides which source address an
//! inbound HBONE stream's connection to the pod keeps.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    identity::SpiffeId,
    state::{View, WorkloadIndex},
};

/// The longest an outbound connection waits for the agent to learn its
/// destination.
pub const LEARN_WAIT: Duration = Duration::from_secs(1);

/// How long an address that stayed unknown through a wait is not waited for
/// again.
pub const UNLEARNED_FOR: Duration = Duration::from_secs(10);

/// How many addresses that stayed unknown are remembered at most (expired ones
/// are dropped when it is reached; past it, none is added).
const UNLEARNED_MAX: usize = 4096;

/// What an outbound connection's destination waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Awaited {
    /// An address in a cluster range that is neither a workload's nor a
    /// Service's.
    Address,
    /// A Service port that no EndpointSlice names yet.
    ServiceEndpoints,
}

impl Awaited {
    /// As logs name it.
    pub fn describe(self) -> &'static str {
        match self {
            Awaited::Address => "an address in the cluster's ranges not known yet",
            Awaited::ServiceEndpoints => "a Service without an EndpointSlice yet",
        }
    }
}

/// What `view` lacks to route a connection to `dst`, if anything: nothing for a
/// known workload (enrolled or not, or an address claimed by several), a
/// Service port with an EndpointSlice, another port of a Service's address, or
/// an address outside the cluster's ranges.
pub fn awaited(view: &View, dst: SocketAddr) -> Option<Awaited> {
    if let Some(service) = view.services.lookup(dst) {
        return (!service.has_slices).then_some(Awaited::ServiceEndpoints);
    }
    let ip = dst.ip();
    let known = view.workloads.by_ip(ip).is_some() || view.workloads.conflict(ip).is_some();
    (!known && view.ranges.contains(ip) && !view.services.is_vip(ip)).then_some(Awaited::Address)
}

/// Addresses that stayed unknown through a wait, and since when.
#[derive(Debug, Default)]
pub struct Unlearned {
    since: Mutex<HashMap<IpAddr, Instant>>,
}

impl Unlearned {
    /// Whether `ip` stayed unknown through a wait that ended less than
    /// [`UNLEARNED_FOR`] before `now`.
    pub fn recent(&self, ip: IpAddr, now: Instant) -> bool {
        let since = self.since.lock().unwrap_or_else(|e| e.into_inner());
        since
            .get(&ip)
            .is_some_and(|t| now.saturating_duration_since(*t) < UNLEARNED_FOR)
    }

    /// Notes that `ip` stayed unknown through a wait that ended at `now`.
    pub fn note(&self, ip: IpAddr, now: Instant) {
        let mut since = self.since.lock().unwrap_or_else(|e| e.into_inner());
        if since.len() >= UNLEARNED_MAX && !since.contains_key(&ip) {
            since.retain(|_, t| now.saturating_duration_since(*t) < UNLEARNED_FOR);
            if since.len() >= UNLEARNED_MAX {
                return;
            }
        }
        since.insert(ip, now);
    }
}

/// Which address an inbound HBONE stream's connection to the pod is made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAddress {
    /// The client's: a workload of the client's identity has it.
    Known(IpAddr),
    /// The client's: no workload is known to have it (yet). It is the HBONE
    /// connection's own source, and the client's certificate is valid.
    Unknown(IpAddr),
    /// The node's: the address is known to belong to a workload of another
    /// identity, or is claimed by several pods.
    NotKept,
}

impl ClientAddress {
    /// The source address to bind, `None` for the node's.
    pub fn source(self) -> Option<IpAddr> {
        match self {
            ClientAddress::Known(ip) | ClientAddress::Unknown(ip) => Some(ip),
            ClientAddress::NotKept => None,
        }
    }
}

/// Decides whether the connection to the pod keeps `peer`, the source address
/// of an HBONE connection whose client proved `client` (see
/// `docs/architecture.md`, "HBONE", for why an unknown address is kept).
pub fn client_address(index: &WorkloadIndex, peer: IpAddr, client: &SpiffeId) -> ClientAddress {
    match index.by_ip(peer) {
        Some(w) if w.identity == *client => ClientAddress::Known(peer),
        Some(_) => ClientAddress::NotKept,
        None if index.conflict(peer).is_some() => ClientAddress::NotKept,
        None => ClientAddress::Unknown(peer),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        k8s::{EndpointSlice, Namespace, Pod, Service},
        proxy::{ProxyConfig, ProxyState},
        state::{ClusterRanges, ranges::parse_cidr, service::ServiceIndex},
    };

    pub(in crate::proxy) fn pod(name: &str, sa: &str, ip: &str) -> Pod {
        serde_yaml_ng::from_str(&format!(
            "metadata: {{name: {name}, namespace: shop}}\n\
             spec: {{nodeName: n2, serviceAccountName: {sa}}}\n\
             status: {{podIP: {ip}}}\n"
        ))
        .unwrap()
    }

    fn index(pods: &[Pod]) -> WorkloadIndex {
        let ns: Namespace = serde_yaml_ng::from_str(
            "metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}\n",
        )
        .unwrap();
        WorkloadIndex::build("n1", "cluster.local", pods, &[ns]).0
    }

    fn id(sa: &str) -> SpiffeId {
        SpiffeId::new("cluster.local", "shop", sa)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A view with `pods` (namespace `shop`, on node n2; this node is n1), the
    /// Service shop/web at 10.96.0.10:80 (with an EndpointSlice when
    /// `with_slice`), and the ranges 10.244.0.0/16 and 10.96.0.0/12.
    pub(in crate::proxy) fn view(pods: &[Pod], with_slice: bool) -> View {
        let service: Service = serde_yaml_ng::from_str(
            "metadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n",
        )
        .unwrap();
        let slice: EndpointSlice = serde_yaml_ng::from_str(
            "metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\n\
             addressType: IPv4\nendpoints: [{addresses: [10.244.1.5]}]\n",
        )
        .unwrap();
        let slices = if with_slice { vec![&slice] } else { vec![] };
        View {
            workloads: Arc::new(index(pods)),
            services: Arc::new(
                ServiceIndex::build(
                    "cluster.local",
                    [&service],
                    slices,
                    crate::state::service::Locality {
                        node: "node1",
                        zone: None,
                    },
                )
                .0,
            ),
            ranges: Arc::new(ClusterRanges::configured(&[
                parse_cidr("10.244.0.0/16").unwrap(),
                parse_cidr("10.96.0.0/12").unwrap(),
            ])),
            ..View::default()
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A proxy state with a local CA (in the returned directory) and `view`.
    pub(in crate::proxy) fn proxy_state(view: View) -> (Arc<ProxyState>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        crate::identity::ca::init(dir.path()).unwrap();
        let certs = crate::identity::CertManager::new(
            crate::identity::CertSource::Local {
                dir: dir.path().to_path_buf(),
            },
            "cluster.local",
            Duration::from_secs(3600),
        )
        .unwrap();
        let config = ProxyConfig {
            listen_ip: std::net::Ipv4Addr::LOCALHOST,
            listen_ip6: None,
            outbound_port: 0,
            inbound_plaintext_port: 0,
            hbone_port: 15008,
            proxy_mark: 0,
            connect_timeout: Duration::from_secs(1),
            hbone_idle_timeout: Duration::from_secs(300),
            threads: 0,
            max_connections: 16,
            cluster_id: "Kubernetes".into(),
        };
        let state = Arc::new(ProxyState::new(config, certs));
        state.update(view);
        (state, dir)
    }

    /// The wait ends when an update makes the address known, long before its
    /// bound; updates that do not leave it unknown.
    #[tokio::test]
    async fn the_wait_is_woken_by_the_update_that_makes_the_address_known() {
        let (state, _ca) = proxy_state(view(&[], true));
        let dst = addr("10.244.2.9:80");
        let waiting = tokio::spawn({
            let state = state.clone();
            async move {
                let started = Instant::now();
                let view = state.learned(dst, Duration::from_secs(30)).await;
                (view, started.elapsed())
            }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        // Another pod: still unknown, still waiting.
        state.update(view(&[pod("other", "other", "10.244.2.10")], true));
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!waiting.is_finished());
        state.update(view(&[pod("new", "new", "10.244.2.9")], true));
        let (view, waited) = waiting.await.unwrap();
        assert_eq!(view.workloads.by_ip(dst.ip()).unwrap().name, "new");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[tokio::test]
    async fn the_wait_ends_at_its_bound_with_the_address_still_unknown() {
        let (state, _ca) = proxy_state(view(&[], true));
        let dst = addr("10.244.2.9:80");
        let started = Instant::now();
        let view = state.learned(dst, Duration::from_millis(100)).await;
        let waited = started.elapsed();
        assert_eq!(awaited(&view, dst), Some(Awaited::Address));
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[tokio::test]
    async fn no_wait_for_known_addresses_or_addresses_outside_the_ranges() {
        let (state, _ca) = proxy_state(view(&[pod("a", "a", "10.244.1.5")], true));
        for dst in ["192.168.1.1:80", "10.244.1.5:80", "10.96.0.10:80"] {
            let started = Instant::now();
            let _ = state.learned(addr(dst), Duration::from_secs(30)).await;
            assert!(started.elapsed() < Duration::from_secs(5), "{dst} waited");
        }
    }

    /// A Service whose EndpointSlice arrives during the wait is resolved.
    #[tokio::test]
    async fn the_wait_for_a_service_ends_with_its_endpoint_slice() {
        let (state, _ca) = proxy_state(view(&[], false));
        let dst = addr("10.96.0.10:80");
        let waiting = tokio::spawn({
            let state = state.clone();
            async move { state.learned(dst, Duration::from_secs(30)).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        state.update(view(&[], true));
        let view = waiting.await.unwrap();
        assert!(view.services.lookup(dst).unwrap().has_slices);
    }

    #[test]
    fn only_unknown_addresses_in_the_ranges_are_awaited() {
        let view = view(&[pod("a", "a", "10.244.1.5")], true);
        assert_eq!(
            awaited(&view, addr("10.244.2.9:80")),
            Some(Awaited::Address)
        );
        // Known: a workload, a Service port, another port of a Service's address.
        assert_eq!(awaited(&view, addr("10.244.1.5:80")), None);
        assert_eq!(awaited(&view, addr("10.96.0.10:80")), None);
        assert_eq!(awaited(&view, addr("10.96.0.10:81")), None);
        // Outside the ranges: never.
        assert_eq!(awaited(&view, addr("192.168.1.1:80")), None);
        assert_eq!(awaited(&view, addr("[fd00::1]:80")), None);
        // No ranges: never.
        let no_ranges = View {
            ranges: Arc::default(),
            ..view.clone()
        };
        assert_eq!(awaited(&no_ranges, addr("10.244.2.9:80")), None);
        // An address two pods claim is known (and refused as it is today).
        let claimed = super::tests::view(
            &[pod("a", "a", "10.244.1.5"), pod("b", "b", "10.244.1.5")],
            true,
        );
        assert_eq!(awaited(&claimed, addr("10.244.1.5:80")), None);
    }

    #[test]
    fn a_service_port_without_a_slice_is_awaited_anywhere() {
        let view = view(&[], false);
        assert_eq!(
            awaited(&view, addr("10.96.0.10:80")),
            Some(Awaited::ServiceEndpoints)
        );
        let outside = View {
            ranges: Arc::default(),
            ..view
        };
        assert_eq!(
            awaited(&outside, addr("10.96.0.10:80")),
            Some(Awaited::ServiceEndpoints)
        );
    }

    #[test]
    fn unlearned_addresses_are_remembered_for_a_while() {
        let unlearned = Unlearned::default();
        let t0 = Instant::now();
        assert!(!unlearned.recent(ip("10.244.2.9"), t0));
        unlearned.note(ip("10.244.2.9"), t0);
        assert!(unlearned.recent(ip("10.244.2.9"), t0 + UNLEARNED_FOR / 2));
        assert!(!unlearned.recent(ip("10.244.2.9"), t0 + UNLEARNED_FOR));
        assert!(!unlearned.recent(ip("10.244.2.10"), t0));
        // Full: expired entries make room, live ones are kept.
        for i in 0..UNLEARNED_MAX {
            let ip = IpAddr::from(u32::try_from(i).unwrap().to_be_bytes());
            unlearned.note(ip, t0);
        }
        unlearned.note(ip("10.244.3.1"), t0 + UNLEARNED_FOR / 2);
        assert!(!unlearned.recent(ip("10.244.3.1"), t0 + UNLEARNED_FOR / 2));
        unlearned.note(ip("10.244.3.1"), t0 + UNLEARNED_FOR);
        assert!(unlearned.recent(ip("10.244.3.1"), t0 + UNLEARNED_FOR));
    }

    #[test]
    fn the_client_address_is_kept_unless_known_as_another_identity() {
        let index = index(&[
            pod("a", "a", "10.244.1.5"),
            pod("b", "b", "10.244.1.6"),
            pod("c", "c", "10.244.1.6"),
        ]);
        assert_eq!(
            client_address(&index, ip("10.244.1.5"), &id("a")),
            ClientAddress::Known(ip("10.244.1.5"))
        );
        // Another identity's address: the node's.
        assert_eq!(
            client_address(&index, ip("10.244.1.5"), &id("b")),
            ClientAddress::NotKept
        );
        // Claimed by several pods: the node's.
        assert_eq!(
            client_address(&index, ip("10.244.1.6"), &id("b")),
            ClientAddress::NotKept
        );
        // Not known yet: the client's own.
        let unknown = client_address(&index, ip("10.244.2.9"), &id("a"));
        assert_eq!(unknown, ClientAddress::Unknown(ip("10.244.2.9")));
        assert_eq!(unknown.source(), Some(ip("10.244.2.9")));
        assert_eq!(ClientAddress::NotKept.source(), None);
    }
}
