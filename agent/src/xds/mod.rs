//! A client of istiod's workload xDS: the workloads, services and authorization
//! policies istiod serves to ztunnel, received as ztunnel receives them, over
//! Envoy's incremental (delta) aggregated discovery service.
//!
//! Protocol (Envoy's "xDS REST and gRPC protocol" document, sections "Aggregated
//! Discovery Service" and "Incremental xDS"; Istio's ztunnel `src/xds/client.rs`
//! for what istiod expects):
//! * One gRPC bidirectional stream,
//!   `/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources`,
//!   over TLS to istiod (port 15012), verified against the mesh's root
//!   certificates; the call's metadata carries `authorization: Bearer <token>` and
//!   `clusterid` ([`crate::istiod`]).
//! * On the new stream, one request per type ([`ResourceType`]): the node
//!   ([`NodeIdentity`]), the type URL, no names (a wildcard subscription: every
//!   resource of the type), and `initial_resource_versions`: the name and version
//!   of every resource held from earlier streams, so that istiod sends only what
//!   changed (and `removed_resources` for what is gone).
//! * Each response carries added or changed resources (`Any` whose value is an
//!   `istio.workload.Address` or `istio.security.Authorization`) and removed names;
//!   it is answered by a request with its nonce: an ACK, or a NACK with
//!   `error_detail` when some resource was refused (one that does not decode, or
//!   that the [`Handler`] refused). The others are applied all the same, as
//!   ztunnel does; a refused resource keeps the version held before, if any.
//! * Ready once a response of each type was answered, ACKed or NACKed (its
//!   other resources applied) ([`XdsClient::ready`]): ztunnel waits for an
//!   ACK of each, but one resource podlink refuses must not keep the agent
//!   unready.
//! * A lost stream is opened again after a bounded, jittered exponential backoff
//!   ([`Backoff`]); what was received stays applied meanwhile.

mod client;
mod metrics;
pub mod proto;

use std::{net::IpAddr, path::PathBuf, time::Duration};

pub use client::{Answer, Held, XdsClient, handle_response};
pub use metrics::XdsMetrics;

/// The two resource types podlink subscribes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResourceType {
    /// `istio.workload.Address`: a workload or a service; named by the workload's
    /// `uid` or the service's `namespace/hostname`.
    Address,
    /// `istio.security.Authorization`: a policy; named `namespace/name`.
    Authorization,
}

impl ResourceType {
    /// Both, in the order they are subscribed.
    pub const ALL: [ResourceType; 2] = [ResourceType::Address, ResourceType::Authorization];

    /// The type URL (`type.googleapis.com/<message's full name>`).
    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Address => proto::ADDRESS_TYPE_URL,
            ResourceType::Authorization => proto::AUTHORIZATION_TYPE_URL,
        }
    }

    /// The type of `type_url`, if it is one of the two.
    pub fn of_url(type_url: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.type_url() == type_url)
    }

    fn index(self) -> usize {
        match self {
            ResourceType::Address => 0,
            ResourceType::Authorization => 1,
        }
    }
}

/// Receives what istiod pushes. Called on the client's task, one response at a
/// time, in the order istiod sent them.
pub trait Handler: Send + 'static {
    /// Resources added or changed (`updated`: xDS name and the decoded resource)
    /// and removed (`removed`: names) by one response. Returns the resources it
    /// refused (not applied), which are NACKed; the rest count as applied.
    fn addresses(
        &mut self,
        updated: Vec<(String, proto::workload::Address)>,
        removed: Vec<String>,
    ) -> Vec<Refused>;

    /// As [`Handler::addresses`], for authorization policies.
    fn authorizations(
        &mut self,
        updated: Vec<(String, proto::security::Authorization)>,
        removed: Vec<String>,
    ) -> Vec<Refused>;

    /// The connection's state changed: called when a stream is up, and once when
    /// it is lost or cannot be opened (not on every retry). For logs and
    /// readiness decisions; what was received stays applied.
    fn connection(&mut self, _state: &ConnectionState) {}
}

/// A resource refused: not applied, named in the NACK.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The resource's xDS name.
    pub name: String,
    /// Why, as a sentence fragment.
    pub why: String,
}

impl Refused {
    /// `name` refused because `why`.
    pub fn new(name: impl Into<String>, why: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            why: why.into(),
        }
    }
}

/// The state of the stream to istiod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectionState {
    /// A stream is up (istiod answered the call).
    Connected {
        /// istiod's address.
        address: String,
    },
    /// The stream was lost, or could not be opened; retrying.
    Lost {
        /// Why, as a sentence fragment (the gRPC status, the transport error, or
        /// the file that could not be read).
        why: String,
    },
}

/// Who the client is, for istiod: the node agent's pod and node. istiod reads the
/// node type from the ID's prefix and serves a `ztunnel` node the workload xDS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeIdentity {
    /// The agent pod's IP (ztunnel's `INSTANCE_IP`).
    pub ip: IpAddr,
    /// The agent pod's name.
    pub pod_name: String,
    /// The agent pod's namespace.
    pub namespace: String,
    /// The Kubernetes node's name: istiod uses it to decide which workloads are
    /// this node's.
    pub node_name: String,
    /// The node's network (Istio's multi-network); empty for the default network,
    /// then not sent.
    pub network: String,
}

impl NodeIdentity {
    /// The node ID: `ztunnel~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local`
    /// (ztunnel's `src/xds/client.rs`; istiod's `model.ParseServiceNodeWithMetadata`
    /// reads the type before the first `~`).
    pub fn id(&self) -> String {
        format!(
            "ztunnel~{}~{}.{}~{}.svc.cluster.local",
            self.ip, self.pod_name, self.namespace, self.namespace
        )
    }

    /// The `Node` sent on each subscription: the ID and the metadata ztunnel sends,
    /// `NAME`, `NAMESPACE`, `INSTANCE_IPS`, `NODE_NAME` (its `src/xds/client.rs`),
    /// `CLUSTER_ID` and, when set, `NETWORK` (ztunnel's `ISTIO_META_*` settings,
    /// which its chart sets), all strings.
    pub fn node(&self, cluster_id: &str) -> proto::core::Node {
        let mut fields = vec![
            ("NAME", self.pod_name.clone()),
            ("NAMESPACE", self.namespace.clone()),
            ("INSTANCE_IPS", self.ip.to_string()),
            ("NODE_NAME", self.node_name.clone()),
            ("CLUSTER_ID", cluster_id.to_string()),
        ];
        if !self.network.is_empty() {
            fields.push(("NETWORK", self.network.clone()));
        }
        proto::core::Node {
            id: self.id(),
            metadata: Some(prost_types::Struct {
                fields: fields
                    .into_iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            prost_types::Value {
                                kind: Some(prost_types::value::Kind::StringValue(v)),
                            },
                        )
                    })
                    .collect(),
            }),
            user_agent_name: "podlink".into(),
            user_agent_version_type: Some(
                proto::core::node::UserAgentVersionType::UserAgentVersion(
                    env!("CARGO_PKG_VERSION").into(),
                ),
            ),
            ..Default::default()
        }
    }
}

/// The delays between attempts to open a stream: doubling from `initial` up to
/// `max`, each drawn at random in its upper half ("equal jitter"), so that the
/// node agents of a cluster do not return to istiod all at once. Reset once a
/// stream was up and received a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay's bound.
    pub initial: Duration,
    /// The largest delay.
    pub max: Duration,
}

impl Default for Backoff {
    /// 200 ms up to 15 s (ztunnel: 10 ms up to 15 s, without jitter).
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(15),
        }
    }
}

impl Backoff {
    /// The delay before attempt `failures + 1` after `failures` failed ones, with
    /// `random` in `[0, 1)`: in `[bound / 2, bound)`, `bound` =
    /// `min(max, initial × 2^failures)`.
    pub fn delay(&self, failures: u32, random: f64) -> Duration {
        let bound = self
            .initial
            .saturating_mul(1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX))
            .min(self.max);
        bound / 2 + bound.mul_f64(random.clamp(0.0, 1.0) / 2.0)
    }
}

/// How to reach istiod's workload xDS.
#[derive(Clone, Debug)]
pub struct XdsConfig {
    /// `https://host:port` of istiod (port 15012).
    pub address: String,
    /// PEM bundle of the mesh's root certificates (`--ca-root-cert`): verifies
    /// istiod's certificate. Read again for every stream.
    pub root_cert: PathBuf,
    /// File of the bearer token (the Istio CA's token), read for every stream.
    pub token_file: PathBuf,
    /// Sent as the `clusterid` header and the `CLUSTER_ID` metadata.
    pub cluster_id: String,
    /// Who the client is.
    pub node: NodeIdentity,
    /// The delays between attempts.
    pub backoff: Backoff,
}

/// Why the client cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error("istiod xDS address {address:?}: {what}")]
    /// The address is not `https://host:port`.
    Address {
        /// The address given.
        address: String,
        /// What is wrong.
        what: String,
    },
}

/// The `error_detail` message of a NACK: each refused resource and why,
/// `name: why; name: why`.
pub fn nack_message(refused: &[Refused]) -> String {
    refused
        .iter()
        .map(|r| format!("{}: {}", r.name, r.why))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests;
