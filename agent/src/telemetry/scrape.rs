//! podlink's metrics read at scrape time: from the proxy (enrolled pods,
//! certificates, denials: what [`ScrapeSource`] gives) and from the dataplane's
//! pinned maps (entries, per-pod drops and captures, summed over CPUs). See
//! [`super::metrics`] for the list.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

use aya::maps::{HashMap as BpfHashMap, MapData, MapError, PerCpuHashMap};
use podlink_common::{
    FlowKey, MAP_CAPTURED_FLOWS, MAP_COUNTERS, MAP_PODS, POD_HAS_IPV4, POD_HAS_IPV6, PodCounters,
    PodInfo,
};
use prometheus_client::{
    encoding::{EncodeLabelSet, text},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Registry, Unit},
};

use super::metrics::{Metrics, UNKNOWN};
use crate::{
    dataplane::{self, Dataplane},
    error::Chain,
};

/// What the metrics page reads of the proxy at scrape time. The proxy's state
/// implements it; telemetry knows nothing more of the proxy.
pub trait ScrapeSource {
    /// The metrics kept as connections go (`istio_tcp_*`, failures), written
    /// first on the page.
    fn live_metrics(&self) -> &Metrics;

    /// Enrolled pods of this node that are captured.
    fn enrolled_pods(&self) -> usize;

    /// The name and namespace of the workload at `ip`, when one is known.
    fn workload_at(&self, ip: IpAddr) -> Option<(String, String)>;

    /// The end of validity (notAfter) of the cached workload certificate of each
    /// of this node's identities that has one: the SPIFFE ID and the time.
    fn certificate_expiries(&self) -> Vec<(String, SystemTime)>;

    /// Connections denied by authorization policies so far, by the policy that
    /// denied them (`namespace/name`, `allow-policies`, `unknown-policies`).
    fn denials(&self) -> Vec<(String, u64)>;

    /// What the proxy's view holds, by kind: `workloads` (pods of the whole
    /// source), `services` (Services with a virtual address), `policies`
    /// (AuthorizationPolicies).
    fn known_objects(&self) -> Vec<(&'static str, usize)>;
}

/// Second handles on the dataplane's maps, read at scrape time.
pub struct DataplaneMaps {
    pods: BpfHashMap<MapData, u32, PodInfo>,
    counters: PerCpuHashMap<MapData, u32, PodCounters>,
    captured_flows: BpfHashMap<MapData, FlowKey, u32>,
}

/// Why the dataplane's maps cannot be read at scrape time.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MapsError {
    /// A map is missing from the object or its descriptor cannot be
    /// duplicated.
    #[error(transparent)]
    Handle(#[from] dataplane::Error),
    /// A map is not of the type expected. The message is aya's error and its
    /// causes, `: `-separated.
    #[error("{}", Chain(error))]
    Type {
        /// The map's name.
        map: &'static str,
        /// aya's error.
        error: MapError,
    },
}

impl DataplaneMaps {
    /// Handles on the pods, counters and captured-flows maps of `dataplane`.
    ///
    /// # Errors
    /// A map is missing or its descriptor cannot be duplicated
    /// ([`MapsError::Handle`]), or it is not of the type expected
    /// ([`MapsError::Type`]).
    pub fn new(dataplane: &Dataplane) -> Result<Self, MapsError> {
        use aya::maps::Map;
        let of = |map: &'static str| move |error| MapsError::Type { map, error };
        Ok(Self {
            pods: BpfHashMap::try_from(Map::HashMap(dataplane.map_handle(MAP_PODS)?))
                .map_err(of(MAP_PODS))?,
            counters: PerCpuHashMap::try_from(Map::PerCpuHashMap(
                dataplane.map_handle(MAP_COUNTERS)?,
            ))
            .map_err(of(MAP_COUNTERS))?,
            captured_flows: BpfHashMap::try_from(Map::LruHashMap(
                dataplane.map_handle(MAP_CAPTURED_FLOWS)?,
            ))
            .map_err(of(MAP_CAPTURED_FLOWS))?,
        })
    }
}

/// A pod's counters summed over CPUs, with the pod's address when the pods map
/// has one for its host veth: its IPv4 address, or an IPv6-only pod's IPv6.
fn pod_totals(maps: &DataplaneMaps) -> Vec<(Option<IpAddr>, PodCounters)> {
    let mut totals = Vec::new();
    for entry in maps.counters.iter() {
        let Ok((ifindex, per_cpu)) = entry else {
            continue;
        };
        let mut sum = PodCounters::default();
        for c in per_cpu.iter() {
            sum.add(c);
        }
        let addr = maps.pods.get(&ifindex, 0).ok().and_then(|p| pod_addr(&p));
        totals.push((addr, sum));
    }
    totals
}

/// The address a pods-map entry names its pod by: IPv4 first (`POD_HAS_*`).
fn pod_addr(pod: &PodInfo) -> Option<IpAddr> {
    if pod.flags & POD_HAS_IPV4 != 0 {
        let [.., a, b, c, d] = pod.ipv4;
        Some(Ipv4Addr::new(a, b, c, d).into())
    } else if pod.flags & POD_HAS_IPV6 != 0 {
        Some(Ipv6Addr::from(pod.ipv6).into())
    } else {
        None
    }
}

/// The drop reasons of [`PodCounters`]: the `reason` label and the count.
pub fn drop_reasons(c: &PodCounters) -> [(&'static str, u64); 7] {
    [
        ("no_listener", c.dropped_no_listener),
        ("bounce_miss", c.dropped_bounce_miss),
        ("assign_failed", c.dropped_assign_failed),
        ("fragment", c.dropped_fragment),
        ("unparsable", c.dropped_unparsable),
        ("flow_gone", c.dropped_flow_gone),
        ("spoofed", c.dropped_spoofed),
    ]
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PodLabels {
    workload: String,
    workload_namespace: String,
    reason: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CaptureLabels {
    workload: String,
    workload_namespace: String,
    listener: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MapLabels {
    map: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct IdentityLabels {
    identity: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

/// The metrics page: the live metrics of `proxy`, and podlink's metrics read now
/// from the proxy and (when given) the dataplane's maps. Map read errors leave
/// the series out.
pub fn encode(proxy: &impl ScrapeSource, maps: Option<&Mutex<DataplaneMaps>>) -> String {
    let mut scrape = Registry::default();

    let enrolled = Gauge::<i64>::default();
    enrolled.set(proxy.enrolled_pods() as i64);
    scrape.register(
        "podlink_enrolled_pods",
        "Enrolled pods of this node that are captured",
        enrolled,
    );

    if let Some(maps) = maps {
        let maps = maps.lock().expect("dataplane maps lock");
        let entries = Family::<MapLabels, Gauge>::default();
        let count = |keys: usize, map| entries.get_or_create(&MapLabels { map }).set(keys as i64);
        count(maps.pods.keys().filter(Result::is_ok).count(), MAP_PODS);
        count(
            maps.counters.keys().filter(Result::is_ok).count(),
            MAP_COUNTERS,
        );
        count(
            maps.captured_flows.keys().filter(Result::is_ok).count(),
            MAP_CAPTURED_FLOWS,
        );
        scrape.register(
            "podlink_bpf_map_entries",
            "Entries in the dataplane's BPF maps",
            entries,
        );

        let drops = Family::<PodLabels, Counter>::default();
        let captured = Family::<CaptureLabels, Counter>::default();
        for (addr, totals) in pod_totals(&maps) {
            let (name, namespace) = addr
                .and_then(|ip| proxy.workload_at(ip))
                .unwrap_or_else(|| (UNKNOWN.to_string(), UNKNOWN.to_string()));
            for (reason, n) in drop_reasons(&totals) {
                drops
                    .get_or_create(&PodLabels {
                        workload: name.clone(),
                        workload_namespace: namespace.clone(),
                        reason,
                    })
                    .inc_by(n);
            }
            for (listener, n) in [
                ("outbound", totals.captured_outbound),
                ("inbound_hbone", totals.captured_inbound_hbone),
                ("inbound_plaintext", totals.captured_inbound_plaintext),
                ("dns", totals.captured_dns),
            ] {
                captured
                    .get_or_create(&CaptureLabels {
                        workload: name.clone(),
                        workload_namespace: namespace.clone(),
                        listener,
                    })
                    .inc_by(n);
            }
        }
        scrape.register(
            "podlink_redirect_drops",
            "Packets dropped by the TC programs on enrolled pods' host veths, by reason",
            drops,
        );
        scrape.register(
            "podlink_captured_connections",
            "New connections the TC programs assigned to a proxy listener",
            captured,
        );
    }

    let expiry = Family::<IdentityLabels, Gauge>::default();
    for (identity, not_after) in proxy.certificate_expiries() {
        let secs = not_after
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        expiry
            .get_or_create(&IdentityLabels { identity })
            .set(i64::try_from(secs).unwrap_or(i64::MAX));
    }
    scrape.register_with_unit(
        "podlink_certificate_expiry",
        "Expiry (notAfter) of the workload certificate in use, Unix time",
        Unit::Seconds,
        expiry,
    );

    let denials = Family::<PolicyLabels, Counter>::default();
    for (policy, n) in proxy.denials() {
        denials.get_or_create(&PolicyLabels { policy }).inc_by(n);
    }
    scrape.register(
        "podlink_authorization_denials",
        "Connections denied by authorization policies (or, plaintext, by a STRICT PeerAuthentication), by the policy that denied them",
        denials,
    );

    let known = Family::<KindLabels, Gauge>::default();
    for (kind, n) in proxy.known_objects() {
        known
            .get_or_create(&KindLabels { kind })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    scrape.register(
        "podlink_known_objects",
        "Objects the proxy's view holds, by kind (workloads, services, policies)",
        known,
    );

    let mut page = String::new();
    proxy
        .live_metrics()
        .encode_live(&mut page)
        .and_then(|()| text::encode_registry(&mut page, &scrape))
        .and_then(|()| text::encode_eof(&mut page))
        .expect("writing to a String does not fail");
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_named_by_its_ipv4_address_else_its_ipv6() {
        let v6: Ipv6Addr = "fd00:10:244:1::5".parse().unwrap();
        let mut pod = PodInfo {
            ipv4: podlink_common::ipv4_mapped([10, 244, 1, 5]),
            ipv6: v6.octets(),
            flags: POD_HAS_IPV4 | POD_HAS_IPV6,
            ..Default::default()
        };
        assert_eq!(pod_addr(&pod), Some(Ipv4Addr::new(10, 244, 1, 5).into()));
        pod.flags = POD_HAS_IPV6;
        assert_eq!(pod_addr(&pod), Some(v6.into()));
        pod.flags = 0;
        assert_eq!(pod_addr(&pod), None);
    }

    #[test]
    fn drop_reasons_cover_every_dropped_field() {
        let c = PodCounters {
            dropped_no_listener: 1,
            dropped_bounce_miss: 2,
            dropped_assign_failed: 3,
            dropped_fragment: 4,
            dropped_unparsable: 5,
            dropped_flow_gone: 6,
            dropped_spoofed: 7,
            ..Default::default()
        };
        let total: u64 = drop_reasons(&c).iter().map(|(_, n)| n).sum();
        assert_eq!(total, 28);
        let mut sum = PodCounters::default();
        sum.add(&c);
        sum.add(&c);
        assert_eq!(sum.dropped_spoofed, 14);
    }
}
