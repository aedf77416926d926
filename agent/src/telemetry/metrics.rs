//! Prometheus metrics, served on `:15020/metrics` (ztunnel's and Istio's metrics
//! port) in the OpenMetrics text format, encoded by `prometheus-client`.
//!
//! Istio's standard TCP metrics (<https://istio.io/latest/docs/reference/config/metrics/>),
//! counted by the proxy as connections open, carry bytes and close:
//!
//! | metric | counts |
//! |---|---|
//! | `istio_tcp_connections_opened_total` | connections opened (counted when the proxy has accepted and identified the connection, before authorization) |
//! | `istio_tcp_connections_closed_total` | connections closed, whatever the result (denied and failed ones too) |
//! | `istio_tcp_received_bytes_total` | bytes from the client to the server (the request direction), counted as they flow |
//! | `istio_tcp_sent_bytes_total` | bytes from the server to the client (the response direction), counted as they flow |
//!
//! with Istio's labels ([`TcpLabels`]): `reporter` (`source` on the outbound side,
//! `destination` on the inbound side; a connection between two pods of one node
//! is reported by both), the source's and destination's `*_workload`,
//! `*_workload_namespace`, `*_principal`, `*_app`, `*_version`,
//! `*_canonical_service`, `*_canonical_revision`, `*_cluster`,
//! `destination_service*`, `request_protocol` (`tcp`), `response_flags` (`-`) and
//! `connection_security_policy` (`mutual_tls` over HBONE, `none` otherwise).
//! Values that are not known are `unknown`, as in Istio. A known pod's labels
//! are made once with its workload ([`crate::state::Workload`]), as istiod makes
//! them for ztunnel: `*_workload` is the workload the pod belongs to (the
//! Deployment of its ReplicaSet, its StatefulSet, DaemonSet, Job, CronJob, …, or
//! the pod's name for a pod without a controller: see
//! [`crate::state::workload::owning_workload`]), so that the pods of one Deployment make
//! one series; `*_canonical_service` and `*_canonical_revision` are Istio's
//! (labels `service.istio.io/canonical-name`, `app.kubernetes.io/name`, `app`,
//! else the workload's name; `service.istio.io/canonical-revision`,
//! `app.kubernetes.io/version`, `version`, else `latest`), and `*_app` and
//! `*_version` are the same two, as ztunnel reports them.
//! `destination_service*` name the Service of a connection to a ClusterIP, else
//! `unknown`.
//!
//! The DNS server's metrics, named as ztunnel's ([`DnsMetrics`]):
//!
//! | metric | type | labels | value |
//! |---|---|---|---|
//! | `istio_dns_requests_total` | counter | `request_query_type` (`A`, `AAAA`, …, `other`), `request_protocol` (`udp`, `tcp`), `source_workload`, `source_workload_namespace` | queries from enrolled pods, answered or not |
//! | `istio_dns_upstream_requests_total` | counter | `request_protocol` | queries forwarded to the resolver the pod asked (cache misses) |
//! | `istio_dns_upstream_failures_total` | counter | `request_protocol` | forwarded queries that got no answer in time, or were refused for want of an upstream slot: the pod got SERVFAIL |
//! | `istio_dns_upstream_request_duration_seconds` | histogram | `request_protocol` | time the resolver took to answer a forwarded query |
//!
//! podlink's own metrics:
//!
//! | metric | type | labels | value |
//! |---|---|---|---|
//! | `podlink_enrolled_pods` | gauge | | this node's enrolled pods that are captured |
//! | `podlink_bpf_map_entries` | gauge | `map` (`pods`, `pod_counters`, `captured_flows`) | entries in each map |
//! | `podlink_redirect_drops_total` | counter | `workload`, `workload_namespace`, `reason` | packets the TC programs dropped on the pod's host veth, by reason (the `dropped_*` fields of [`podlink_common::PodCounters`], summed over CPUs: `no_listener`, `bounce_miss`, `assign_failed`, `fragment`, `unparsable`, `ipv6`, `flow_gone`, `spoofed`) |
//! | `podlink_captured_connections_total` | counter | `workload`, `workload_namespace`, `listener` (`outbound`, `inbound_hbone`, `inbound_plaintext`) | new connections the programs assigned to a listener |
//! | `podlink_certificate_expiry_seconds` | gauge | `identity` (SPIFFE ID) | `notAfter` of the workload certificate in use, in seconds since the Unix epoch |
//! | `podlink_known_objects` | gauge | `kind` (`workloads`, `services`, `policies`) | objects the proxy's view holds |
//! | `podlink_authorization_denials_total` | counter | `policy` (`namespace/name` of an AuthorizationPolicy, or of a PeerAuthentication refusing plaintext; `allow-policies`, `unknown-policies`) | connections denied, by the policy that denied them |
//! | `podlink_connection_failures_total` | counter | `direction` (`outbound`, `inbound`), `kind` ([`FailureKind`]) | connections that failed, by kind |
//! | `podlink_repairs_total` | counter | `reason` ([`Reason`]) | discrepancies between the kernel and the agent's attachments that the self-audit found and repaired |
//! | `podlink_xds_*` | | | istiod's workload xDS stream: see [`crate::xds::XdsMetrics`] |
//!
//! The `podlink_*` metrics but the failures and repairs are read at scrape time
//! ([`super::scrape`]); the map-based ones from the dataplane's maps (a scrape
//! walks the maps' keys: at most [`podlink_common::MAX_CAPTURED_FLOWS`] lookups);
//! counters survive agent restarts with the pins, and a pod's counters end with
//! its map entry.

use std::fmt::{self, Write as _};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder, text},
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};

use crate::{dataplane::audit::Reason, identity::SpiffeId, xds::XdsMetrics};

/// The default address of the metrics endpoint (all addresses of the node's
/// network namespace, port 15020 as ztunnel).
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:15020";

/// The content type of the metrics page (OpenMetrics text 1.0.0).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Label value for what is not known, as Istio writes it.
pub const UNKNOWN: &str = "unknown";

/// Writes a label value from its `as_str`.
macro_rules! label_value {
    ($t:ty) => {
        impl EncodeLabelValue for $t {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), fmt::Error> {
                encoder.write_str(self.as_str())
            }
        }
    };
}

/// Which proxy reports a connection (Istio's `reporter` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reporter {
    /// The client's proxy (outbound).
    Source,
    /// The server's proxy (inbound).
    Destination,
}

impl Reporter {
    /// `source` or `destination`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reporter::Source => "source",
            Reporter::Destination => "destination",
        }
    }
}
label_value!(Reporter);

/// Istio's `connection_security_policy` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SecurityPolicy {
    /// Carried over HBONE (mutual TLS).
    MutualTls,
    /// Plain TCP: to or from outside the mesh, and between two pods of one node
    /// (no TLS hop; the source's identity is known from its address, which the
    /// programs verify).
    None,
}

impl SecurityPolicy {
    /// `mutual_tls` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            SecurityPolicy::MutualTls => "mutual_tls",
            SecurityPolicy::None => "none",
        }
    }
}
label_value!(SecurityPolicy);

/// Which side of the proxy a connection came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Leaving an enrolled pod of this node (listener 15001).
    Outbound,
    /// Entering an enrolled pod of this node (HBONE 15008 or plaintext 15006).
    Inbound,
}

impl Direction {
    /// `outbound` or `inbound`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::Inbound => "inbound",
        }
    }
}
label_value!(Direction);

/// Why a connection failed: the `kind` label of
/// `podlink_connection_failures_total` and the `result` of its access log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The source or destination is not an enrolled pod of this node, or the
    /// destination cannot be told apart (an address claimed twice).
    NotEnrolled,
    /// Connecting to the destination timed out.
    ConnectTimeout,
    /// Connecting to the destination failed (refused, unreachable).
    ConnectFailed,
    /// The outbound HBONE tunnel could not be opened (TLS, HTTP/2, or the peer
    /// answered the CONNECT with an error status).
    Hbone,
    /// No workload certificate for the identity the connection needs.
    Identity,
    /// An inbound HBONE connection's TLS or HTTP/2 handshake was refused.
    Handshake,
    /// An inbound HBONE request was malformed or named another destination (400).
    BadRequest,
    /// The proxy was at its connection limit.
    ConnectionLimit,
    /// The proxy had as many inbound HBONE handshakes under way as it allows.
    HandshakeLimit,
    /// The connection's source address held its share of the proxy's connection
    /// slots (`ConnectionLimits::share`).
    ShareLimit,
    /// An I/O error (a reset) while carrying the connection's bytes.
    Io,
    /// Closed by the proxy: a changed policy now denies it, or a pod left the mesh.
    Revoked,
    /// A connection to a Service with no ready endpoint (or no EndpointSlice).
    NoEndpoint,
    /// The destination names a waypoint the agent does not know, or one with
    /// no ready endpoint: refused rather than sent around it.
    NoWaypoint,
}

impl FailureKind {
    /// Every kind, in a fixed order.
    pub const ALL: [FailureKind; 14] = [
        FailureKind::NotEnrolled,
        FailureKind::ConnectTimeout,
        FailureKind::ConnectFailed,
        FailureKind::Hbone,
        FailureKind::Identity,
        FailureKind::Handshake,
        FailureKind::BadRequest,
        FailureKind::ConnectionLimit,
        FailureKind::HandshakeLimit,
        FailureKind::ShareLimit,
        FailureKind::Io,
        FailureKind::Revoked,
        FailureKind::NoEndpoint,
        FailureKind::NoWaypoint,
    ];

    /// The label value: `not_enrolled`, `connect_timeout`, `connect_failed`,
    /// `hbone`, `identity`, `handshake`, `bad_request`, `connection_limit`,
    /// `handshake_limit`, `share_limit`, `io`, `revoked`, `no_endpoint`,
    /// `no_waypoint`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::NotEnrolled => "not_enrolled",
            FailureKind::ConnectTimeout => "connect_timeout",
            FailureKind::ConnectFailed => "connect_failed",
            FailureKind::Hbone => "hbone",
            FailureKind::Identity => "identity",
            FailureKind::Handshake => "handshake",
            FailureKind::BadRequest => "bad_request",
            FailureKind::ConnectionLimit => "connection_limit",
            FailureKind::HandshakeLimit => "handshake_limit",
            FailureKind::ShareLimit => "share_limit",
            FailureKind::Io => "io",
            FailureKind::Revoked => "revoked",
            FailureKind::NoEndpoint => "no_endpoint",
            FailureKind::NoWaypoint => "no_waypoint",
        }
    }

    /// The kind of a failed upstream connect.
    pub fn of_connect(e: &std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::TimedOut {
            FailureKind::ConnectTimeout
        } else {
            FailureKind::ConnectFailed
        }
    }
}
label_value!(FailureKind);

/// What the metric labels and the access log read of a pod: its name and
/// namespace, and the names telemetry reports it by, made once with the
/// workload. The agent's workloads have it (`state::Workload`, whose
/// implementation is in the proxy's `telemetry` module).
pub trait WorkloadMeta: std::fmt::Debug + Send + Sync {
    /// The pod's name (the access log's `src.workload` and `dst.workload`, as
    /// ztunnel's).
    fn name(&self) -> &str;
    /// The pod's namespace.
    fn namespace(&self) -> &str;
    /// The name of the workload the pod belongs to (its Deployment's,
    /// StatefulSet's, …, or the pod's own): the `*_workload` label.
    fn workload_name(&self) -> &str;
    /// Istio's canonical service: the `*_canonical_service` and `*_app` labels.
    fn canonical_service(&self) -> &str;
    /// Istio's canonical revision: the `*_canonical_revision` and `*_version`
    /// labels.
    fn canonical_revision(&self) -> &str;
    /// The value of the pod's label `key`, if it has it.
    fn label(&self, key: &str) -> Option<&str>;
}

/// One side of a connection, as the labels describe it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Peer<'a> {
    /// The pod, when its address belongs to a known workload.
    pub workload: Option<&'a dyn WorkloadMeta>,
    /// The identity it proved (or, for a pod of this node, the one of its address).
    pub identity: Option<&'a SpiffeId>,
}

/// Istio's labels of the `istio_tcp_*` metrics (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
#[allow(missing_docs)]
pub struct TcpLabels {
    pub reporter: Reporter,
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub source_app: String,
    pub source_version: String,
    pub source_cluster: String,
    pub destination_service: String,
    pub destination_service_namespace: String,
    pub destination_service_name: String,
    pub destination_workload: String,
    pub destination_canonical_service: String,
    pub destination_canonical_revision: String,
    pub destination_workload_namespace: String,
    pub destination_principal: String,
    pub destination_app: String,
    pub destination_version: String,
    pub destination_cluster: String,
    pub request_protocol: &'static str,
    pub response_flags: &'static str,
    pub connection_security_policy: SecurityPolicy,
}

/// The label values of one side: workload, canonical service, canonical revision,
/// namespace, principal, app, version, cluster.
fn side(peer: Peer<'_>, cluster: &str) -> [String; 8] {
    let principal = peer
        .identity
        .map_or(UNKNOWN.to_string(), |id| id.to_string());
    match peer.workload {
        // `*_app` and `*_version` are the canonical service and revision, as
        // ztunnel reports them.
        Some(w) => [
            w.workload_name().to_string(),
            w.canonical_service().to_string(),
            w.canonical_revision().to_string(),
            w.namespace().to_string(),
            principal,
            w.canonical_service().to_string(),
            w.canonical_revision().to_string(),
            cluster.to_string(),
        ],
        None => {
            let mut values = std::array::from_fn(|_| UNKNOWN.to_string());
            values[4] = principal;
            values
        }
    }
}

impl TcpLabels {
    /// Names the destination Service (a connection to its ClusterIP):
    /// `destination_service` is its host name `host`
    /// ([`crate::state::service::ServicePort::host`]).
    pub fn with_service(mut self, namespace: &str, name: &str, host: &str) -> Self {
        self.destination_service = host.to_string();
        self.destination_service_namespace = namespace.to_string();
        self.destination_service_name = name.to_string();
        self
    }

    /// The labels of a connection from `source` to `destination` as `reporter`
    /// sees it; `cluster` is the cluster ID of known workloads.
    pub fn new(
        reporter: Reporter,
        source: Peer<'_>,
        destination: Peer<'_>,
        security: SecurityPolicy,
        cluster: &str,
    ) -> Self {
        let [sw, scs, scr, sns, sp, sa, sv, sc] = side(source, cluster);
        let [dw, dcs, dcr, dns, dp, da, dv, dc] = side(destination, cluster);
        Self {
            reporter,
            source_workload: sw,
            source_canonical_service: scs,
            source_canonical_revision: scr,
            source_workload_namespace: sns,
            source_principal: sp,
            source_app: sa,
            source_version: sv,
            source_cluster: sc,
            destination_service: UNKNOWN.to_string(),
            destination_service_namespace: UNKNOWN.to_string(),
            destination_service_name: UNKNOWN.to_string(),
            destination_workload: dw,
            destination_canonical_service: dcs,
            destination_canonical_revision: dcr,
            destination_workload_namespace: dns,
            destination_principal: dp,
            destination_app: da,
            destination_version: dv,
            destination_cluster: dc,
            request_protocol: "tcp",
            response_flags: "-",
            connection_security_policy: security,
        }
    }
}

label_value!(Reason);

/// Labels of `podlink_repairs_total`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RepairLabels {
    reason: Reason,
}

/// Labels of `podlink_connection_failures_total`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FailureLabels {
    direction: Direction,
    kind: FailureKind,
}

/// The labels of `istio_dns_requests_total`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DnsRequestLabels {
    /// The question's type (`A`, `AAAA`, …), `other` for types without a
    /// name (so that the series stay few).
    pub request_query_type: &'static str,
    /// `udp` or `tcp`.
    pub request_protocol: &'static str,
    /// The asking pod's workload ([`crate::state::Workload::workload_name`]),
    /// `unknown` when the agent does not know the pod.
    pub source_workload: String,
    /// The asking pod's namespace, `unknown` when not known.
    pub source_workload_namespace: String,
}

/// The labels of the upstream DNS metrics.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DnsUpstreamLabels {
    /// `udp` or `tcp`.
    pub request_protocol: &'static str,
}

/// The DNS server's metrics (`istio_dns_*`, as ztunnel names them).
#[derive(Debug)]
pub struct DnsMetrics {
    /// `istio_dns_requests_total`.
    pub requests: Family<DnsRequestLabels, Counter>,
    /// `istio_dns_upstream_requests_total`.
    pub upstream_requests: Family<DnsUpstreamLabels, Counter>,
    /// `istio_dns_upstream_failures_total`.
    pub upstream_failures: Family<DnsUpstreamLabels, Counter>,
    /// `istio_dns_upstream_request_duration_seconds`.
    pub upstream_duration: Family<DnsUpstreamLabels, Histogram, fn() -> Histogram>,
}

/// Buckets of `istio_dns_upstream_request_duration_seconds`, in seconds.
const DNS_DURATION_BUCKETS: [f64; 9] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

fn dns_duration_histogram() -> Histogram {
    Histogram::new(DNS_DURATION_BUCKETS)
}

impl DnsMetrics {
    fn new(registry: &mut Registry) -> Self {
        let m = DnsMetrics {
            requests: Family::default(),
            upstream_requests: Family::default(),
            upstream_failures: Family::default(),
            upstream_duration: Family::new_with_constructor(dns_duration_histogram),
        };
        registry.register(
            "istio_dns_requests",
            "Total number of DNS requests",
            m.requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream",
            m.upstream_requests.clone(),
        );
        registry.register(
            "istio_dns_upstream_failures",
            "Total number of DNS requests forwarded to upstream that failed",
            m.upstream_failures.clone(),
        );
        registry.register(
            "istio_dns_upstream_request_duration_seconds",
            "Time the upstream took to answer a forwarded DNS request",
            m.upstream_duration.clone(),
        );
        m
    }
}

/// The proxy's live metrics: the `istio_tcp_*` families and the failure counts.
/// Cloning a family shares its series.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `istio_tcp_connections_opened_total`.
    pub opened: Family<TcpLabels, Counter>,
    /// `istio_tcp_connections_closed_total`.
    pub closed: Family<TcpLabels, Counter>,
    /// `istio_tcp_sent_bytes_total` (server to client).
    pub sent_bytes: Family<TcpLabels, Counter>,
    /// `istio_tcp_received_bytes_total` (client to server).
    pub received_bytes: Family<TcpLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    repairs: Family<RepairLabels, Counter>,
    /// The workload xDS client's (`podlink_xds_*`).
    pub xds: XdsMetrics,
    /// The DNS server's `istio_dns_*`.
    pub dns: DnsMetrics,
    cluster_id: String,
}

impl Metrics {
    /// Empty metrics; `cluster_id` is the `*_cluster` label of known workloads.
    pub fn new(cluster_id: &str) -> Self {
        let mut registry = Registry::default();
        let opened = Family::<TcpLabels, Counter>::default();
        let closed = Family::<TcpLabels, Counter>::default();
        let sent_bytes = Family::<TcpLabels, Counter>::default();
        let received_bytes = Family::<TcpLabels, Counter>::default();
        let failures = Family::<FailureLabels, Counter>::default();
        let repairs = Family::<RepairLabels, Counter>::default();
        registry.register(
            "istio_tcp_connections_opened",
            "Total TCP connections opened",
            opened.clone(),
        );
        registry.register(
            "istio_tcp_connections_closed",
            "Total TCP connections closed",
            closed.clone(),
        );
        registry.register(
            "istio_tcp_sent_bytes",
            "Bytes sent from the server to the client (response direction)",
            sent_bytes.clone(),
        );
        registry.register(
            "istio_tcp_received_bytes",
            "Bytes received from the client for the server (request direction)",
            received_bytes.clone(),
        );
        registry.register(
            "podlink_connection_failures",
            "Connections that failed, by direction and kind",
            failures.clone(),
        );
        registry.register(
            "podlink_repairs",
            "Discrepancies between the kernel and the agent's attachments found by the self-audit and repaired, by reason",
            repairs.clone(),
        );
        let xds = XdsMetrics::default();
        xds.register(&mut registry);
        let dns = DnsMetrics::new(&mut registry);
        // Every kind and reason is present from the start, so that rates need no
        // absent series.
        for reason in Reason::ALL {
            drop(repairs.get_or_create(&RepairLabels { reason }));
        }
        for direction in [Direction::Outbound, Direction::Inbound] {
            for kind in FailureKind::ALL {
                drop(failures.get_or_create(&FailureLabels { direction, kind }));
            }
        }
        Self {
            registry,
            opened,
            closed,
            sent_bytes,
            received_bytes,
            failures,
            repairs,
            xds,
            dns,
            cluster_id: cluster_id.to_string(),
        }
    }

    /// The cluster ID the labels carry.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// Counts a failed connection.
    pub fn failed(&self, direction: Direction, kind: FailureKind) {
        self.failures
            .get_or_create(&FailureLabels { direction, kind })
            .inc();
    }

    /// Counts a repair made by the self-audit.
    pub fn repaired(&self, reason: Reason) {
        self.repairs.get_or_create(&RepairLabels { reason }).inc();
    }

    /// Repairs made so far for `reason`.
    pub fn repairs(&self, reason: Reason) -> u64 {
        self.repairs.get_or_create(&RepairLabels { reason }).get()
    }

    /// Writes the live metrics in the OpenMetrics text format, without the
    /// closing `# EOF` (see [`super::scrape::encode`]).
    ///
    /// # Errors
    /// Those of `out`.
    pub fn encode_live(&self, out: &mut impl fmt::Write) -> fmt::Result {
        text::encode_registry(out, &self.registry)
    }

    /// Connections that failed so far with this direction and kind.
    pub fn failures(&self, direction: Direction, kind: FailureKind) -> u64 {
        self.failures
            .get_or_create(&FailureLabels { direction, kind })
            .get()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(crate::identity::istio_ca::DEFAULT_CLUSTER_ID)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        k8s::{ObjectMeta, OwnerReference, Pod, PodSpec, PodStatus},
        state::{Workload, WorkloadIndex},
    };

    /// The workload of pod `shop/<name>` with `labels`, made by the controller
    /// `owner` (`kind`, `name`) if any, as the index makes it.
    fn owned(name: &str, labels: &[(&str, &str)], owner: Option<(&str, &str)>) -> Arc<Workload> {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("shop".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                owner_references: owner.map(|(kind, name)| {
                    vec![OwnerReference {
                        api_version: "apps/v1".into(),
                        kind: kind.into(),
                        name: name.into(),
                        controller: Some(true),
                    }]
                }),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node1".into()),
                service_account_name: Some("web".into()),
                host_network: None,
            }),
            status: Some(PodStatus {
                pod_ip: Some("10.244.1.2".into()),
                ..Default::default()
            }),
        };
        let (index, _) = WorkloadIndex::build("node1", "cluster.local", [&pod], []);
        index.get(&format!("shop/{name}")).unwrap().clone()
    }

    fn workload(name: &str, labels: &[(&str, &str)]) -> Arc<Workload> {
        owned(name, labels, None)
    }

    fn to(server: &Workload) -> TcpLabels {
        TcpLabels::new(
            Reporter::Destination,
            Peer::default(),
            Peer {
                workload: Some(server),
                identity: Some(&server.identity),
            },
            SecurityPolicy::MutualTls,
            "Kubernetes",
        )
    }

    /// The pods of one Deployment (through its ReplicaSet) make one series,
    /// named by the Deployment; `*_app` and `*_version` are the canonical
    /// service and revision, as ztunnel's; a bare pod is named by its name.
    #[test]
    fn the_pods_of_one_deployment_make_one_series() {
        let hash = [("pod-template-hash", "5d8f9c7b6"), ("app", "reviews")];
        let a = owned(
            "reviews-5d8f9c7b6-x2x9q",
            &hash,
            Some(("ReplicaSet", "reviews-5d8f9c7b6")),
        );
        let b = owned(
            "reviews-5d8f9c7b6-k7j4z",
            &hash,
            Some(("ReplicaSet", "reviews-5d8f9c7b6")),
        );
        let metrics = Metrics::new("Kubernetes");
        for w in [&a, &b] {
            metrics.opened.get_or_create(&to(w)).inc();
        }
        let labels = to(&a);
        assert_eq!(labels, to(&b));
        assert_eq!(metrics.opened.get_or_create(&labels).get(), 2);
        assert_eq!(labels.destination_workload, "reviews");
        assert_eq!(labels.destination_canonical_service, "reviews");
        assert_eq!(labels.destination_app, "reviews");
        assert_eq!(labels.destination_canonical_revision, "latest");
        assert_eq!(labels.destination_version, "latest");

        let bare = workload("web-0", &[]);
        let labels = to(&bare);
        assert_eq!(labels.destination_workload, "web-0");
        assert_eq!(labels.destination_canonical_service, "web-0");
        assert_eq!(labels.destination_app, "web-0");
        assert_eq!(labels.destination_version, "latest");

        let db = owned("db-1", &[("version", "v2")], Some(("StatefulSet", "db")));
        let labels = to(&db);
        assert_eq!(labels.destination_workload, "db");
        assert_eq!(labels.destination_canonical_service, "db");
        assert_eq!(labels.destination_canonical_revision, "v2");
        assert_eq!(labels.destination_version, "v2");
    }

    #[test]
    fn unknown_peers_are_unknown_but_keep_their_principal() {
        let server = workload("web-0", &[("app", "web")]);
        let client_id = SpiffeId::new("cluster.local", "bank", "teller");
        let labels = TcpLabels::new(
            Reporter::Destination,
            Peer {
                workload: None,
                identity: Some(&client_id),
            },
            Peer {
                workload: Some(server.as_ref()),
                identity: Some(&server.identity),
            },
            SecurityPolicy::MutualTls,
            "Kubernetes",
        );
        assert_eq!(labels.source_workload, UNKNOWN);
        assert_eq!(labels.source_workload_namespace, UNKNOWN);
        assert_eq!(labels.source_cluster, UNKNOWN);
        assert_eq!(
            labels.source_principal,
            "spiffe://cluster.local/ns/bank/sa/teller"
        );
        assert_eq!(labels.destination_workload, "web-0");
        assert_eq!(labels.destination_app, "web");
        assert_eq!(labels.destination_version, "latest");
        assert_eq!(labels.destination_cluster, "Kubernetes");
    }

    /// The page is OpenMetrics text: counters get `_total`, labels are Istio's,
    /// every failure kind is present, and it ends with `# EOF`.
    #[test]
    fn page_has_istio_names_and_labels() {
        let metrics = Metrics::new("Kubernetes");
        let server = workload("web-0", &[]);
        let labels = TcpLabels::new(
            Reporter::Source,
            Peer::default(),
            Peer {
                workload: Some(server.as_ref()),
                identity: Some(&server.identity),
            },
            SecurityPolicy::None,
            metrics.cluster_id(),
        );
        metrics.opened.get_or_create(&labels).inc();
        metrics.sent_bytes.get_or_create(&labels).inc_by(42);
        metrics.failed(Direction::Outbound, FailureKind::ConnectTimeout);
        let mut page = String::new();
        text::encode(&mut page, &metrics.registry).unwrap();
        let opened = page
            .lines()
            .find(|l| l.starts_with("istio_tcp_connections_opened_total{"))
            .unwrap_or_else(|| panic!("{page}"));
        for needle in [
            "reporter=\"source\"",
            "source_workload=\"unknown\"",
            "destination_workload=\"web-0\"",
            "destination_workload_namespace=\"shop\"",
            "destination_principal=\"spiffe://cluster.local/ns/shop/sa/web\"",
            "connection_security_policy=\"none\"",
            "request_protocol=\"tcp\"",
        ] {
            assert!(opened.contains(needle), "{needle} missing from {opened}");
        }
        assert!(opened.ends_with(" 1"), "{opened}");
        assert!(
            page.lines()
                .any(|l| l.starts_with("istio_tcp_sent_bytes_total{") && l.ends_with(" 42")),
            "{page}"
        );
        assert!(page.contains(
            "podlink_connection_failures_total{direction=\"outbound\",kind=\"connect_timeout\"} 1"
        ));
        assert!(
            page.contains("podlink_connection_failures_total{direction=\"inbound\",kind=\"io\"} 0")
        );
        metrics.repaired(Reason::LinkDetached);
        let mut page = String::new();
        text::encode(&mut page, &metrics.registry).unwrap();
        assert!(page.contains("podlink_repairs_total{reason=\"link_detached\"} 1"));
        assert!(page.contains("podlink_repairs_total{reason=\"stale_map_entry\"} 0"));
        assert!(page.ends_with("# EOF\n"), "{page}");
    }
}
