//! The parts of Kubernetes objects podlink reads, and nothing more; the name
//! rules objects follow are in [`names`].
//!
//! Field names and shapes follow the Kubernetes API reference (`core/v1` Pod,
//! Namespace and Service; `discovery.k8s.io/v1` EndpointSlice) and the Rust names
//! of `k8s-openapi`. Fields podlink does not use are skipped while parsing, not
//! kept: a node agent holds every pod of the cluster, and the code generated for
//! the full types is most of a binary's size (issue 6 measures the agent's
//! resident memory). A field that is read must have the type the API gives it.

pub mod names;

use std::collections::BTreeMap;

use serde::Deserialize;

/// `metadata`: what identifies an object and selects it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// `metadata.name`.
    pub name: Option<String>,
    /// `metadata.namespace`; `default` when unset.
    pub namespace: Option<String>,
    /// `metadata.labels`.
    pub labels: Option<BTreeMap<String, String>>,
    /// `metadata.annotations` (from the Kubernetes API, only those podlink reads).
    pub annotations: Option<BTreeMap<String, String>>,
    /// `metadata.deletionTimestamp` (RFC 3339), set once the object is being
    /// deleted.
    pub deletion_timestamp: Option<String>,
    /// `metadata.ownerReferences` (from the Kubernetes API, only the
    /// controller's): what made the object, e.g. the ReplicaSet of a pod.
    pub owner_references: Option<Vec<OwnerReference>>,
}

/// An entry of `metadata.ownerReferences`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReference {
    /// `apiVersion` of the owner, e.g. `apps/v1`.
    pub api_version: String,
    /// `kind` of the owner, e.g. `ReplicaSet`.
    pub kind: String,
    /// `name` of the owner.
    pub name: String,
    /// `controller`: the owner is the object's managing controller.
    pub controller: Option<bool>,
}

impl ObjectMeta {
    /// `metadata.namespace`, or `default` when unset (as the API server fills it).
    pub fn namespace_or_default(&self) -> &str {
        self.namespace.as_deref().unwrap_or("default")
    }
}

/// A `v1` Pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Pod {
    /// `metadata`.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `spec`.
    pub spec: Option<PodSpec>,
    /// `status`.
    pub status: Option<PodStatus>,
}

impl Pod {
    /// `namespace/name` (the namespace defaulted), the key podlink knows a pod
    /// by; `None` without a name.
    pub fn key(&self) -> Option<String> {
        let name = self.metadata.name.as_deref()?;
        Some(format!("{}/{name}", self.metadata.namespace_or_default()))
    }
}

/// `Pod.spec`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    /// `spec.nodeName`: the node the pod is scheduled on.
    pub node_name: Option<String>,
    /// `spec.serviceAccountName`: the pod's identity (`default` when unset).
    pub service_account_name: Option<String>,
    /// `spec.hostNetwork`: the pod uses its node's network namespace.
    pub host_network: Option<bool>,
}

/// `Pod.status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
pub struct PodStatus {
    /// `status.phase`: `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    pub phase: Option<String>,
    /// `status.podIP`.
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    /// `status.podIPs`, IPv4 and IPv6.
    #[serde(rename = "podIPs")]
    pub pod_ips: Option<Vec<PodIP>>,
}

/// An entry of `status.podIPs`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
pub struct PodIP {
    /// The address.
    pub ip: String,
}

/// A `v1` Namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Namespace {
    /// `metadata`.
    #[serde(default)]
    pub metadata: ObjectMeta,
}

/// A `v1` Service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Service {
    /// `metadata`.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `spec`.
    pub spec: Option<ServiceSpec>,
}

/// `Service.spec`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
pub struct ServiceSpec {
    /// `spec.clusterIP`: the virtual address, `None` for a headless Service.
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    /// `spec.clusterIPs`: the virtual addresses of each family.
    #[serde(rename = "clusterIPs")]
    pub cluster_ips: Option<Vec<String>>,
    /// `spec.ports`.
    pub ports: Option<Vec<ServicePort>>,
    /// `spec.sessionAffinity`: `None` (default) or `ClientIP`.
    #[serde(rename = "sessionAffinity")]
    pub session_affinity: Option<String>,
    /// `spec.sessionAffinityConfig`.
    #[serde(rename = "sessionAffinityConfig")]
    pub session_affinity_config: Option<SessionAffinityConfig>,
    /// `spec.internalTrafficPolicy`: `Cluster` (default) or `Local`.
    #[serde(rename = "internalTrafficPolicy")]
    pub internal_traffic_policy: Option<String>,
    /// `spec.trafficDistribution`: `PreferClose`, `PreferSameZone` or
    /// `PreferSameNode` (Kubernetes 1.31+).
    #[serde(rename = "trafficDistribution")]
    pub traffic_distribution: Option<String>,
}

/// `Service.spec.sessionAffinityConfig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionAffinityConfig {
    /// `clientIP`.
    #[serde(rename = "clientIP")]
    pub client_ip: Option<ClientIpConfig>,
}

/// `Service.spec.sessionAffinityConfig.clientIP`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientIpConfig {
    /// `timeoutSeconds`: how long a client sticks to its endpoint, in seconds
    /// (1 to 86400, default 10800).
    pub timeout_seconds: Option<i32>,
}

/// An entry of `Service.spec.ports`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    /// `name`; required when a Service has more than one port.
    pub name: Option<String>,
    /// `port`: the port of the virtual address.
    pub port: i32,
    /// `protocol`: `TCP` (the default), `UDP` or `SCTP`.
    pub protocol: Option<String>,
    /// `targetPort`: the endpoints' port, by number or by the container port's
    /// name; `port` when unset.
    pub target_port: Option<IntOrString>,
}

/// A value that is a number or a name (`targetPort`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(untagged)]
pub enum IntOrString {
    /// A number.
    Int(i32),
    /// A name.
    String(String),
}

/// A `discovery.k8s.io/v1` EndpointSlice.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    /// `metadata`; the `kubernetes.io/service-name` label names the Service.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `addressType`: `IPv4`, `IPv6` or `FQDN`.
    pub address_type: String,
    /// `endpoints`.
    pub endpoints: Option<Vec<Endpoint>>,
    /// `ports`.
    pub ports: Option<Vec<EndpointPort>>,
}

/// An entry of `EndpointSlice.endpoints`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// `addresses`, of the slice's address type.
    pub addresses: Vec<String>,
    /// `conditions`.
    pub conditions: Option<EndpointConditions>,
    /// `nodeName`: the node the endpoint is on.
    pub node_name: Option<String>,
    /// `zone`: the zone the endpoint is in.
    pub zone: Option<String>,
}

/// `Endpoint.conditions`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
pub struct EndpointConditions {
    /// `ready`; unset means ready.
    pub ready: Option<bool>,
    /// `serving`.
    pub serving: Option<bool>,
    /// `terminating`; unset means not terminating.
    pub terminating: Option<bool>,
}

/// A `v1` Node: its name, labels (`topology.kubernetes.io/zone`) and pod
/// address ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Node {
    /// `metadata`.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `spec`.
    pub spec: Option<NodeSpec>,
}

/// The label naming a node's zone (Kubernetes "Well-Known Labels").
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// `Node.spec`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
pub struct NodeSpec {
    /// `spec.podCIDR`.
    #[serde(rename = "podCIDR")]
    pub pod_cidr: Option<String>,
    /// `spec.podCIDRs`, one per family.
    #[serde(rename = "podCIDRs")]
    pub pod_cidrs: Option<Vec<String>>,
}

/// An entry of `EndpointSlice.ports`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
pub struct EndpointPort {
    /// `name`: the Service port's name (empty when unnamed).
    pub name: Option<String>,
    /// `port`: the endpoints' port number.
    pub port: Option<i32>,
    /// `protocol`.
    pub protocol: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_fields_keep_their_api_shapes_and_others_are_skipped() {
        let pod: Pod = serde_yaml_ng::from_str(
            "metadata: {name: web, labels: {app: web}, managedFields: [{manager: kubectl}]}\n\
             spec: {nodeName: n1, hostNetwork: false, containers: [{name: app, image: x}]}\n\
             status: {phase: Running, podIP: 10.0.0.1, podIPs: [{ip: 10.0.0.1}, {ip: 'fd00::1'}]}\n",
        )
        .unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("web"));
        assert_eq!(pod.spec.unwrap().node_name.as_deref(), Some("n1"));
        let status = pod.status.unwrap();
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(status.pod_ips.unwrap()[1].ip, "fd00::1");

        let service: Service = serde_yaml_ng::from_str(
            "metadata: {name: web}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80, targetPort: http}, {port: 81, targetPort: 8081}]}\n",
        )
        .unwrap();
        let ports = service.spec.unwrap().ports.unwrap();
        assert_eq!(
            ports[0].target_port,
            Some(IntOrString::String("http".into()))
        );
        assert_eq!(ports[1].target_port, Some(IntOrString::Int(8081)));

        // A field that is read with the wrong type is refused, naming it.
        let err = serde_yaml_ng::from_str::<Pod>("spec: {hostNetwork: [1]}\n").unwrap_err();
        assert!(err.to_string().contains("hostNetwork"), "{err}");
    }
}
