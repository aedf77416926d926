//! Services and their endpoints, for resolving a captured connection to a
//! Service's ClusterIP inside the proxy (capture happens before kube-proxy would
//! translate it).
//!
//! Built from `v1` Services (`spec.clusterIP`/`clusterIPs`, `spec.ports` with
//! `port`, `targetPort` by number or name, `protocol`) and `discovery.k8s.io/v1`
//! EndpointSlices (the `kubernetes.io/service-name` label, `endpoints[].addresses`,
//! `conditions.ready`/`serving`/`terminating`, `ports`), as the Kubernetes
//! documentation ("Services", "EndpointSlices") defines them:
//!
//! * An EndpointSlice port's `name` is the Service port's name, and its `port` the
//!   resolved target port, so a named `targetPort` is resolved per endpoint
//!   through its slice's ports.
//! * `conditions.ready` unset means ready; `terminating` unset means not
//!   terminating. Only ready, non-terminating endpoints get new connections.
//! * Headless Services (`clusterIP: None`) have no virtual address: clients
//!   connect to pod addresses, which need no resolution.
//! * Services without selectors work the same: their EndpointSlices are written
//!   by hand with the service-name label.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use crate::k8s::{EndpointSlice, IntOrString, Service};
use serde::Serialize;

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One endpoint of a Service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// Where to connect: the endpoint's address and the resolved target port.
    pub addr: SocketAddr,
    /// `conditions.ready` (unset: true) and not terminating.
    pub ready: bool,
    /// `conditions.terminating` (unset: false).
    pub terminating: bool,
}

/// One port of a Service's virtual address.
#[derive(Clone, Debug, Serialize)]
pub struct ServicePort {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The ClusterIP and `port`.
    pub vip: SocketAddr,
    /// `ports[].name`, if any.
    pub port_name: Option<String>,
    /// `targetPort` as written (number or name; `port` when unset).
    pub target_port: String,
    /// Endpoints whose target port could be resolved, from every slice of the
    /// Service.
    pub endpoints: Vec<Endpoint>,
    /// Whether any EndpointSlice names the Service.
    pub has_slices: bool,
}

impl ServicePort {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The endpoints that may get new connections.
    pub fn ready(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.endpoints
            .iter()
            .filter(|e| e.ready && !e.terminating)
            .map(|e| e.addr)
    }
}

/// Service ports by virtual address.
#[derive(Debug, Default)]
pub struct ServiceIndex {
    by_vip: HashMap<SocketAddr, Arc<ServicePort>>,
}

impl ServiceIndex {
    /// Builds the index; returns warnings (two Services claiming one address and
    /// port: the first by `namespace/name` keeps it).
    pub fn build<'a>(
        services: impl IntoIterator<Item = &'a Service>,
        slices: impl IntoIterator<Item = &'a EndpointSlice>,
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
            let slices = slices_of.get(&(namespace.clone(), name.clone()));
            for ip in cluster_ips(service) {
                for port in spec.ports.iter().flatten() {
                    if port.protocol.as_deref().is_some_and(|p| p != "TCP") {
                        continue;
                    }
                    let Ok(number) = u16::try_from(port.port) else {
                        continue;
                    };
                    let vip = SocketAddr::new(ip, number);
                    let target = port.target_port.clone();
                    let entry = ServicePort {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        vip,
                        port_name: port.name.clone().filter(|n| !n.is_empty()),
                        target_port: match &target {
                            Some(IntOrString::Int(n)) => n.to_string(),
                            Some(IntOrString::String(s)) => s.clone(),
                            None => number.to_string(),
                        },
                        endpoints: endpoints(
                            slices.map(Vec::as_slice).unwrap_or(&[]),
                            port.name.as_deref(),
                            &target,
                            number,
                        ),
                        has_slices: slices.is_some(),
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
                }
            }
        }
        (index, warnings)
    }

    /// The Service port at `vip`, if a Service has that address and port.
    pub fn lookup(&self, vip: SocketAddr) -> Option<&Arc<ServicePort>> {
        self.by_vip.get(&vip)
    }

    /// Whether `ip` is some Service's virtual address.
    pub fn is_vip(&self, ip: IpAddr) -> bool {
        self.by_vip.keys().any(|k| k.ip() == ip)
    }

    /// How many Services have a port in the index.
    pub fn service_count(&self) -> usize {
        let services: std::collections::HashSet<(&str, &str)> = self
            .by_vip
            .values()
            .map(|p| (p.namespace.as_str(), p.name.as_str()))
            .collect();
        services.len()
    }

    /// All service ports, by address.
    pub fn ports(&self) -> impl Iterator<Item = &Arc<ServicePort>> {
        let mut all: Vec<_> = self.by_vip.values().collect();
        all.sort_by_key(|p| (p.key(), p.vip));
        all.into_iter()
    }
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
            let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    out.push(Endpoint {
                        addr: SocketAddr::new(ip, resolved),
                        ready,
                        terminating,
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

    #[test]
    fn named_target_ports_resolve_through_the_slice() {
        let (index, warnings) = ServiceIndex::build([&service(WEB)], [&slice(WEB_SLICE)]);
        assert!(warnings.is_empty());
        let http = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert_eq!(http.key(), "shop/web");
        let ready: Vec<String> = http.ready().map(|a| a.to_string()).collect();
        // Unset ready counts as ready; not ready and terminating get nothing.
        assert_eq!(ready, ["10.244.1.2:8080", "10.244.2.2:8080"]);
        let admin = index.lookup("10.96.0.10:9000".parse().unwrap()).unwrap();
        assert!(admin.ready().all(|a| a.port() == 9090));
        // UDP ports and unknown ports are not resolved.
        assert!(index.lookup("10.96.0.10:53".parse().unwrap()).is_none());
        assert!(index.lookup("10.96.0.10:81".parse().unwrap()).is_none());
        assert!(index.is_vip("10.96.0.10".parse().unwrap()));
    }

    #[test]
    fn services_without_slices_and_headless_services() {
        let (index, _) = ServiceIndex::build([&service(WEB)], []);
        let http = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert!(!http.has_slices && http.ready().next().is_none());
        let headless = service(&WEB.replace("10.96.0.10", "None"));
        let (index, _) = ServiceIndex::build([&headless], [&slice(WEB_SLICE)]);
        assert_eq!(index.ports().count(), 0);
        // A named target port the slice does not list cannot be resolved.
        let other = slice(&WEB_SLICE.replace("name: http, port: 8080", "name: web, port: 8080"));
        let (index, _) = ServiceIndex::build([&service(WEB)], [&other]);
        let http = index.lookup("10.96.0.10:80".parse().unwrap()).unwrap();
        assert!(http.has_slices && http.endpoints.is_empty());
    }

    #[test]
    fn a_shared_address_is_kept_by_the_first() {
        let other = service(
            &WEB.replace("name: web,", "name: aaa,")
                .replace("name: web\n", "name: aaa\n"),
        );
        let (index, warnings) = ServiceIndex::build([&service(WEB), &other], []);
        assert_eq!(
            index.lookup("10.96.0.10:80".parse().unwrap()).unwrap().name,
            "aaa"
        );
        assert!(
            warnings[0].contains("both claim 10.96.0.10:80"),
            "{warnings:?}"
        );
    }
}
