//! The names the agent answers itself: its name table.
//!
//! Made by the agent's state ([`crate::state::State`]) from the Services and
//! their EndpointSlices, and from the hosts another source gives it
//! ([`DnsHost`], the hook for istiod's ServiceEntries), each time they change;
//! read by the DNS server through the proxy's view ([`crate::state::View::names`]).
//!
//! * A Service with ClusterIPs: `<name>.<namespace>.svc.<cluster domain>` → its
//!   ClusterIPs (both families, `spec.clusterIPs`).
//! * A headless Service (`clusterIP: None`): the same name → the addresses of
//!   its ready endpoints (`conditions.ready`, unset counting as ready, as
//!   Kubernetes says), as CoreDNS answers them.
//! * A [`DnsHost`]: its name → its addresses.
//!
//! Names are kept in lower case without the final dot (RFC 4343: DNS names
//! compare without regard to ASCII case).

use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use crate::{
    k8s::{EndpointSlice, Service},
    state::service::SERVICE_NAME_LABEL,
};

/// The default cluster domain (`--cluster-domain`), as the kubelet's.
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";

/// A name with its addresses, from a source other than the Kubernetes objects:
/// the host names of istiod's services (Kubernetes Services and ServiceEntries,
/// with the addresses istiod gives them), which [`crate::state::State`] sets
/// when istiod feeds it ([`crate::state::State::set_dns_hosts`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsHost {
    /// The host name, without the final dot (any case).
    pub name: String,
    /// Its addresses, either family.
    pub addrs: Vec<IpAddr>,
}

/// The names the agent answers, with their addresses.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NameTable {
    /// The cluster domain, lower case, without dots at either end.
    domain: String,
    /// Name (lower case, no final dot) → addresses, sorted, each once.
    names: HashMap<String, Arc<[IpAddr]>>,
}

impl NameTable {
    /// The table of `services` (their EndpointSlices `slices` for the headless
    /// ones) under `domain` (`cluster.local`), and `hosts`. A name given twice
    /// has the addresses of both.
    pub fn build<'a>(
        domain: &str,
        services: impl IntoIterator<Item = &'a Service>,
        slices: impl IntoIterator<Item = &'a EndpointSlice>,
        hosts: &[DnsHost],
    ) -> Self {
        let domain = normalize(domain);
        let mut names: HashMap<String, BTreeSet<IpAddr>> = HashMap::new();
        let mut ready: HashMap<(String, String), BTreeSet<IpAddr>> = HashMap::new();
        for slice in slices {
            let Some(service) = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(SERVICE_NAME_LABEL))
            else {
                continue;
            };
            let key = (
                slice.metadata.namespace_or_default().to_string(),
                service.clone(),
            );
            for endpoint in slice.endpoints.iter().flatten() {
                if endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                    continue;
                }
                let addrs = endpoint
                    .addresses
                    .iter()
                    .filter_map(|a| a.parse::<IpAddr>().ok());
                ready.entry(key.clone()).or_default().extend(addrs);
            }
        }
        for service in services {
            let Some(spec) = &service.spec else { continue };
            let Some(name) = service.metadata.name.as_deref() else {
                continue;
            };
            let namespace = service.metadata.namespace_or_default();
            let fqdn = normalize(&format!("{name}.{namespace}.svc.{domain}"));
            let mut ips: Vec<&String> = spec.cluster_ips.iter().flatten().collect();
            if ips.is_empty() {
                ips.extend(spec.cluster_ip.as_ref());
            }
            let headless = ips.iter().any(|ip| ip.as_str() == "None");
            let addrs: BTreeSet<IpAddr> = if headless {
                ready
                    .get(&(namespace.to_string(), name.to_string()))
                    .cloned()
                    .unwrap_or_default()
            } else {
                ips.iter().filter_map(|ip| ip.parse().ok()).collect()
            };
            // A Service without addresses (ExternalName, or not allocated yet)
            // is the upstream's to answer.
            if !addrs.is_empty() {
                names.entry(fqdn).or_default().extend(addrs);
            }
        }
        for host in hosts {
            if !host.addrs.is_empty() {
                names
                    .entry(normalize(&host.name))
                    .or_default()
                    .extend(host.addrs.iter().copied());
            }
        }
        NameTable {
            domain,
            names: names
                .into_iter()
                .map(|(name, addrs)| (name, addrs.into_iter().collect()))
                .collect(),
        }
    }

    /// How many names the table holds.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether the table holds no name.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The addresses of `name` (lower case, no final dot), asked by a pod of
    /// `namespace` (`None`: not known), if the table knows it. A name the pod's
    /// search path made (`/etc/resolv.conf`'s `search <namespace>.svc.<domain>
    /// svc.<domain> <domain>`, which the kubelet writes) from a name the table
    /// knows is known too: `web.shop.<namespace>.svc.cluster.local` is
    /// `web.shop.svc.cluster.local` (the pod asked `web.shop`), so that the
    /// pod's first try is answered instead of failing through the search list.
    pub fn lookup(&self, name: &str, namespace: Option<&str>) -> Option<&Arc<[IpAddr]>> {
        if let Some(found) = self.names.get(name) {
            return Some(found);
        }
        let domain = &self.domain;
        let suffixes = [
            namespace.map(|ns| format!(".{ns}.svc.{domain}")),
            Some(format!(".svc.{domain}")),
            Some(format!(".{domain}")),
        ];
        for suffix in suffixes.iter().flatten() {
            let Some(asked) = name.strip_suffix(suffix.as_str()) else {
                continue;
            };
            // What the pod asked: a full name (with `ndots:5`, the search path
            // is tried first), `<svc>.<namespace>`, or `<svc>.<namespace>.svc`.
            for candidate in [
                asked.to_string(),
                format!("{asked}.svc.{domain}"),
                format!("{asked}.{domain}"),
            ] {
                if let Some(found) = self.names.get(&candidate) {
                    return Some(found);
                }
            }
        }
        None
    }
}

/// `name` in lower case without dots at either end.
fn normalize(name: &str) -> String {
    name.trim_matches('.').to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(yaml: &str) -> Service {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn table() -> NameTable {
        let services = [
            service(
                "metadata: {name: web, namespace: shop}\nspec: {clusterIPs: [10.96.0.10, 'fd00::10']}",
            ),
            service("metadata: {name: db, namespace: shop}\nspec: {clusterIP: None}"),
            service("metadata: {name: ext, namespace: shop}\nspec: {type: ExternalName}"),
        ];
        let slice: EndpointSlice = serde_yaml_ng::from_str(
            "metadata: {name: db-1, namespace: shop, labels: {kubernetes.io/service-name: db}}\naddressType: IPv4\nendpoints:\n- {addresses: [10.244.1.2]}\n- {addresses: [10.244.1.3], conditions: {ready: true}}\n- {addresses: [10.244.1.4], conditions: {ready: false}}\n",
        )
        .unwrap();
        NameTable::build(
            "Cluster.Local.",
            &services,
            [&slice],
            &[DnsHost {
                name: "API.Example.com.".into(),
                addrs: vec!["240.240.0.1".parse().unwrap()],
            }],
        )
    }

    fn ips(found: Option<&Arc<[IpAddr]>>) -> Vec<String> {
        found
            .map(|a| a.iter().map(ToString::to_string).collect())
            .unwrap_or_default()
    }

    #[test]
    fn services_headless_services_and_hosts() {
        let t = table();
        assert_eq!(t.len(), 3);
        assert_eq!(
            ips(t.lookup("web.shop.svc.cluster.local", None)),
            ["10.96.0.10", "fd00::10"]
        );
        assert_eq!(
            ips(t.lookup("db.shop.svc.cluster.local", None)),
            ["10.244.1.2", "10.244.1.3"]
        );
        assert_eq!(ips(t.lookup("api.example.com", None)), ["240.240.0.1"]);
        assert!(t.lookup("ext.shop.svc.cluster.local", None).is_none());
        assert!(t.lookup("web.other.svc.cluster.local", None).is_none());
    }

    /// The names a pod of namespace `app`'s search path makes of what it asked.
    #[test]
    fn names_the_search_path_made() {
        let t = table();
        for (asked, ns) in [
            ("web.shop.app.svc.cluster.local", Some("app")),
            ("web.shop.svc.app.svc.cluster.local", Some("app")),
            (
                "web.shop.svc.cluster.local.app.svc.cluster.local",
                Some("app"),
            ),
            ("web.shop.svc.svc.cluster.local", None),
            ("web.shop.svc.cluster.local.cluster.local", None),
            ("web.shop.svc.cluster.local", Some("shop")),
        ] {
            assert_eq!(ips(t.lookup(asked, ns)).len(), 2, "{asked}");
        }
        // Another namespace's search path does not make `web.shop` of it.
        assert!(
            t.lookup("web.shop.app.svc.cluster.local", Some("other"))
                .is_none()
        );
        assert!(t.lookup("web.app.svc.cluster.local", Some("app")).is_none());
    }
}
