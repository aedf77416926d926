//! The cluster's address ranges: where pods and Services get their addresses.
//!
//! The proxy uses them to tell an address it does not know *yet* (a pod created
//! a moment ago, a Service whose object has not arrived) from one outside the
//! cluster: an outbound connection to an unknown address inside a range waits
//! briefly for the state to learn it (see `proxy::learning`).
//!
//! They come from three places:
//!
//! * `--cluster-cidrs`: the operator's list (the cluster's pod and service
//!   ranges, e.g. kube-controller-manager's `--cluster-cidr` and
//!   kube-apiserver's `--service-cluster-ip-range`), IPv4 and IPv6;
//! * the Node objects' `spec.podCIDRs` (or `spec.podCIDR`), each node's share
//!   of the pod range as the node IPAM controller assigned it (CNIs that
//!   allocate on their own, e.g. Calico IP pools, may leave them unset or not
//!   use them: give the pools with the flag);
//! * the Services' ClusterIPs: per family, the smallest prefix that covers every
//!   ClusterIP seen, when it has at most [`SERVICE_RANGE_MAX_HOST_BITS`] host
//!   bits. kube-apiserver allocates ClusterIPs from one service range per family,
//!   which holds at most 2^20 addresses (`--service-cluster-ip-range`: "for
//!   32-bit addresses, the mask must be >= 12", and >= 108 for 128-bit ones), so
//!   that prefix lies inside the range: nothing outside the cluster is taken
//!   for a Service. It can be narrower than the range (a Service created later
//!   may get an address outside it: give the service range with the flag for the
//!   whole of it). Several service ranges of one family (`ServiceCIDR` objects)
//!   may make the covering prefix wider than each; past 2^20 addresses nothing
//!   is learned. The `default/kubernetes` Service's ClusterIP is the first
//!   address of the range, but says nothing of its length, so it is not used
//!   on its own.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::k8s::Node;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// The most host bits a learned service range may have: kube-apiserver refuses
/// a `--service-cluster-ip-range` with more (1,048,576 addresses).
pub const SERVICE_RANGE_MAX_HOST_BITS: u8 = 20;

/// A `--cluster-cidrs` entry that is not a CIDR.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// Not `address/length`, or the length is past the family's bits.
    #[error(
        "{0:?} is not a CIDR (an IPv4 or IPv6 address, a slash and a prefix length, e.g. 10.244.0.0/16 or fd00:10:244::/56)"
    )]
    Syntax(String),
    /// Bits set after the prefix length: a typo more often than a range.
    #[error("{given} has address bits set past its prefix length: the range is {range}")]
    HostBits {
        /// The entry as written.
        given: String,
        /// The range its prefix length names.
        range: IpNet,
    },
}

/// Parses one CIDR (`10.244.0.0/16`, `fd00:10:244::/56`); surrounding spaces
/// are ignored.
///
/// # Errors
/// [`CidrError`]: not a CIDR, or bits set past the prefix length.
pub fn parse_cidr(s: &str) -> Result<IpNet, CidrError> {
    let given = s.trim();
    let net: IpNet = given
        .parse()
        .map_err(|_| CidrError::Syntax(given.to_string()))?;
    if net.trunc() != net {
        return Err(CidrError::HostBits {
            given: given.to_string(),
            range: net.trunc(),
        });
    }
    Ok(net)
}

/// The cluster's pod and service ranges, configured and learned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterRanges {
    /// `--cluster-cidrs`, as given (aggregated).
    configured: Vec<IpNet>,
    /// From the Node objects' pod CIDRs (aggregated).
    nodes: Vec<IpNet>,
    /// Covering the Services' ClusterIPs, at most one per family.
    services: Vec<IpNet>,
}

impl ClusterRanges {
    /// The operator's ranges (`--cluster-cidrs`), nothing learned yet.
    pub fn configured(cidrs: &[IpNet]) -> Self {
        ClusterRanges {
            configured: IpNet::aggregate(&cidrs.to_vec()),
            ..Default::default()
        }
    }

    /// These ranges with the Nodes' pod ranges learned again from `nodes`
    /// (entries that are not CIDRs are skipped).
    #[must_use]
    pub fn with_nodes(&self, nodes: &[Node]) -> Self {
        let cidrs: Vec<IpNet> = nodes
            .iter()
            .filter_map(|n| n.spec.as_ref())
            .flat_map(|spec| {
                // `podCIDRs` when set (its first entry is `podCIDR`), else `podCIDR`.
                match &spec.pod_cidrs {
                    Some(all) if !all.is_empty() => all.clone(),
                    _ => spec.pod_cidr.iter().cloned().collect(),
                }
            })
            .filter_map(|s| s.trim().parse::<IpNet>().ok().map(|n| n.trunc()))
            .collect();
        ClusterRanges {
            nodes: IpNet::aggregate(&cidrs),
            ..self.clone()
        }
    }

    /// These ranges with the service ranges learned again from the
    /// ClusterIPs `cluster_ips` (see the module's doc for the rule).
    #[must_use]
    pub fn with_cluster_ips(&self, cluster_ips: impl IntoIterator<Item = IpAddr>) -> Self {
        let mut v4: Option<(Ipv4Addr, Ipv4Addr)> = None;
        let mut v6: Option<(Ipv6Addr, Ipv6Addr)> = None;
        for ip in cluster_ips {
            match ip {
                IpAddr::V4(ip) => {
                    let (lo, hi) = v4.get_or_insert((ip, ip));
                    *lo = (*lo).min(ip);
                    *hi = (*hi).max(ip);
                }
                IpAddr::V6(ip) => {
                    let (lo, hi) = v6.get_or_insert((ip, ip));
                    *lo = (*lo).min(ip);
                    *hi = (*hi).max(ip);
                }
            }
        }
        let mut services = Vec::new();
        if let Some((lo, hi)) = v4 {
            let len = (u32::from(lo) ^ u32::from(hi)).leading_zeros() as u8;
            if 32 - len <= SERVICE_RANGE_MAX_HOST_BITS {
                services.push(IpNet::V4(
                    Ipv4Net::new(lo, len)
                        .expect("a length of at most 32")
                        .trunc(),
                ));
            }
        }
        if let Some((lo, hi)) = v6 {
            let len = (u128::from(lo) ^ u128::from(hi)).leading_zeros() as u8;
            if 128 - len <= SERVICE_RANGE_MAX_HOST_BITS {
                services.push(IpNet::V6(
                    Ipv6Net::new(lo, len)
                        .expect("a length of at most 128")
                        .trunc(),
                ));
            }
        }
        ClusterRanges {
            services,
            ..self.clone()
        }
    }

    /// Whether `ip` lies in one of the ranges.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.all().any(|net| net.contains(&ip))
    }

    /// Whether there is no range at all (no address is then waited for).
    pub fn is_empty(&self) -> bool {
        self.all().next().is_none()
    }

    /// Every range: the configured ones, then those of the Nodes, then those of
    /// the Services.
    pub fn all(&self) -> impl Iterator<Item = &IpNet> {
        self.configured
            .iter()
            .chain(&self.nodes)
            .chain(&self.services)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn node(yaml: &str) -> Node {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn cidrs_parse_in_both_families_and_bad_ones_are_named() {
        assert_eq!(
            parse_cidr(" 10.244.0.0/16").unwrap(),
            "10.244.0.0/16".parse::<IpNet>().unwrap()
        );
        assert_eq!(
            parse_cidr("fd00:10:96::/108").unwrap().to_string(),
            "fd00:10:96::/108"
        );
        for bad in ["10.244.0.0", "10.244.0.0/33", "10.244/16", "fd00::/129", ""] {
            let err = parse_cidr(bad).unwrap_err();
            assert_eq!(err, CidrError::Syntax(bad.to_string()));
            assert!(err.to_string().contains("is not a CIDR"), "{err}");
        }
        let err = parse_cidr("10.244.1.0/8").unwrap_err();
        assert_eq!(
            err.to_string(),
            "10.244.1.0/8 has address bits set past its prefix length: the range is 10.0.0.0/8"
        );
    }

    #[test]
    fn configured_ranges_contain_their_addresses_only() {
        let ranges = ClusterRanges::configured(&[
            parse_cidr("10.244.0.0/16").unwrap(),
            parse_cidr("fd00:10:244::/56").unwrap(),
        ]);
        assert!(ranges.contains(ip("10.244.3.7")));
        assert!(ranges.contains(ip("fd00:10:244::9")));
        assert!(!ranges.contains(ip("10.245.0.1")));
        assert!(!ranges.contains(ip("8.8.8.8")));
        assert!(!ranges.contains(ip("fd00:10:245::1")));
        assert!(ClusterRanges::default().is_empty());
        assert!(!ranges.is_empty());
    }

    #[test]
    fn node_pod_ranges_are_learned_and_replaced() {
        let nodes = [
            node(
                "metadata: {name: a}\nspec: {podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24, 'fd00:10:244::/64']}\n",
            ),
            node("metadata: {name: b}\nspec: {podCIDR: 10.244.1.0/24}\n"),
            node("metadata: {name: c}\nspec: {podCIDR: not-a-cidr}\n"),
            node("metadata: {name: d}\n"),
        ];
        let configured = ClusterRanges::configured(&[parse_cidr("10.96.0.0/12").unwrap()]);
        let ranges = configured.with_nodes(&nodes);
        assert!(ranges.contains(ip("10.244.1.200")));
        assert!(ranges.contains(ip("fd00:10:244::5")));
        assert!(ranges.contains(ip("10.96.0.10")), "the flag's stay");
        assert!(!ranges.contains(ip("10.244.2.1")));
        // Adjacent node ranges are merged, their union unchanged.
        assert_eq!(
            ranges.nodes,
            vec![
                "10.244.0.0/23".parse::<IpNet>().unwrap(),
                "fd00:10:244::/64".parse().unwrap()
            ]
        );
        // Learning again replaces what was learned, not what was given.
        let ranges = ranges.with_nodes(&nodes[1..2]);
        assert!(!ranges.contains(ip("10.244.0.1")));
        assert!(ranges.contains(ip("10.96.0.10")));
    }

    #[test]
    fn service_ranges_cover_the_cluster_ips_seen_within_the_widest_range() {
        let ranges = ClusterRanges::default().with_cluster_ips(
            [
                "10.96.0.1",
                "10.96.0.10",
                "10.96.143.7",
                "fd00:10:96::1",
                "fd00:10:96::a",
            ]
            .map(ip),
        );
        assert_eq!(
            ranges.services,
            vec![
                "10.96.0.0/16".parse::<IpNet>().unwrap(),
                "fd00:10:96::/124".parse().unwrap()
            ]
        );
        assert!(ranges.contains(ip("10.96.200.1")));
        assert!(!ranges.contains(ip("10.97.0.1")));
        // ClusterIPs too far apart for one service range: nothing learned for
        // that family (10.96.0.1 and 10.112.0.1 need a /11).
        let ranges = ClusterRanges::default().with_cluster_ips(["10.96.0.1", "10.112.0.1"].map(ip));
        assert!(ranges.is_empty());
        // A /12 is the widest taken.
        let ranges =
            ClusterRanges::default().with_cluster_ips(["10.96.0.1", "10.111.255.254"].map(ip));
        assert_eq!(
            ranges.services,
            vec!["10.96.0.0/12".parse::<IpNet>().unwrap()]
        );
        // No Services: nothing.
        assert!(ClusterRanges::default().with_cluster_ips([]).is_empty());
    }
}
