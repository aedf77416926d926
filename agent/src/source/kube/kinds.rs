//! The kinds the Kubernetes source watches, in partial form: API metadata
//! (trimmed on arrival, [`trim`]) and podlink's own `spec`/`status` types
//! ([`crate::k8s`]), or for Istio's policies the spec as JSON, compiled later
//! so that one policy that cannot be read never fails a whole list.

use std::{
    borrow::Cow,
    hash::{Hash, Hasher},
};

use k8s_openapi::{
    ClusterResourceScope, NamespaceResourceScope,
    apimachinery::pkg::apis::meta::v1::ObjectMeta as ApiObjectMeta,
};
use kube::Resource;
use serde::Deserialize;

use super::{
    AUTHORIZATION_POLICIES, ENDPOINT_SLICES, NAMESPACES, NODES, PEER_AUTHENTICATIONS, PODS,
    REDIRECTION_ANNOTATION, SERVICES,
};
use crate::{k8s, state::workload::DNS_CAPTURE_ANNOTATION};

/// Implements [`Resource`] for a partial type, with the API group and plural
/// name of `$watched`, an entry of [`super::WATCHED`].
macro_rules! resource {
    ($ty:ident, $scope:ty, $kind:literal, $version:literal, $watched:expr) => {
        impl Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;
            fn kind(_: &()) -> Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> Cow<'_, str> {
                $watched.group.into()
            }
            fn version(_: &()) -> Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> Cow<'_, str> {
                $watched.resource.into()
            }
            fn meta(&self) -> &ApiObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ApiObjectMeta {
                &mut self.metadata
            }
        }
    };
}

/// A pod as watched: API metadata, podlink's partial spec and status.
#[derive(Clone, Debug, Deserialize)]
pub(super) struct ApiPod {
    pub metadata: ApiObjectMeta,
    pub spec: Option<k8s::PodSpec>,
    pub status: Option<k8s::PodStatus>,
}
resource!(ApiPod, NamespaceResourceScope, "Pod", "v1", PODS);

/// A namespace as watched: its metadata only.
#[derive(Clone, Debug, Deserialize)]
pub(super) struct ApiNamespace {
    pub metadata: ApiObjectMeta,
}
resource!(
    ApiNamespace,
    ClusterResourceScope,
    "Namespace",
    "v1",
    NAMESPACES
);

/// A `v1` Service as watched.
#[derive(Clone, Debug, Deserialize)]
pub(super) struct ApiService {
    pub metadata: ApiObjectMeta,
    pub spec: Option<k8s::ServiceSpec>,
}
resource!(
    ApiService,
    NamespaceResourceScope,
    "Service",
    "v1",
    SERVICES
);

/// A `discovery.k8s.io/v1` EndpointSlice as watched.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ApiEndpointSlice {
    pub metadata: ApiObjectMeta,
    #[serde(default)]
    pub address_type: String,
    pub endpoints: Option<Vec<k8s::Endpoint>>,
    pub ports: Option<Vec<k8s::EndpointPort>>,
}
resource!(
    ApiEndpointSlice,
    NamespaceResourceScope,
    "EndpointSlice",
    "v1",
    ENDPOINT_SLICES
);

/// A `v1` Node as watched: name, labels, pod ranges (not its status, which
/// changes with every heartbeat of the kubelet).
#[derive(Clone, Debug, Deserialize)]
pub(super) struct ApiNode {
    pub metadata: ApiObjectMeta,
    pub spec: Option<k8s::NodeSpec>,
}
resource!(ApiNode, ClusterResourceScope, "Node", "v1", NODES);

/// Declares an Istio `security.istio.io` kind in one API version: metadata and
/// the spec as JSON ([`crate::authz::spec`] reads it when compiling).
macro_rules! istio_kind {
    ($ty:ident, $kind:literal, $version:literal, $watched:expr) => {
        #[doc = concat!("A `security.istio.io/", $version, "` ", $kind, " as watched.")]
        #[derive(Clone, Debug, Deserialize)]
        pub(super) struct $ty {
            pub metadata: ApiObjectMeta,
            pub spec: Option<serde_json::Value>,
        }
        resource!($ty, NamespaceResourceScope, $kind, $version, $watched);
        impl IstioObject for $ty {
            fn parts(&self) -> (&ApiObjectMeta, Option<&serde_json::Value>) {
                (&self.metadata, self.spec.as_ref())
            }
        }
        impl Projection for $ty {
            fn projection(&self) -> u64 {
                fingerprint(&self.metadata, &self.spec)
            }
        }
    };
}

/// An Istio object of any version: its metadata and spec.
pub(super) trait IstioObject {
    fn parts(&self) -> (&ApiObjectMeta, Option<&serde_json::Value>);
}

istio_kind!(
    ApiAuthorizationPolicyV1,
    "AuthorizationPolicy",
    "v1",
    AUTHORIZATION_POLICIES
);
istio_kind!(
    ApiAuthorizationPolicyV1beta1,
    "AuthorizationPolicy",
    "v1beta1",
    AUTHORIZATION_POLICIES
);
istio_kind!(
    ApiPeerAuthenticationV1,
    "PeerAuthentication",
    "v1",
    PEER_AUTHENTICATIONS
);
istio_kind!(
    ApiPeerAuthenticationV1beta1,
    "PeerAuthentication",
    "v1beta1",
    PEER_AUTHENTICATIONS
);

/// What podlink reads of a watched object, as a fingerprint: an event that
/// changes none of it (status conditions, container statuses, a resourceVersion
/// bump) does not make the agent rebuild its view.
pub(super) trait Projection {
    fn projection(&self) -> u64;
}

/// The fingerprint of what podlink reads of `meta` (after [`trim`]) and `rest`.
pub(super) fn fingerprint(meta: &ApiObjectMeta, rest: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    meta.labels.hash(&mut h);
    meta.annotations.hash(&mut h);
    meta.deletion_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .hash(&mut h);
    owner_references(meta).hash(&mut h);
    rest.hash(&mut h);
    h.finish()
}

impl Projection for ApiPod {
    fn projection(&self) -> u64 {
        fingerprint(&self.metadata, (&self.spec, &self.status))
    }
}

impl Projection for ApiNamespace {
    fn projection(&self) -> u64 {
        fingerprint(&self.metadata, ())
    }
}

impl Projection for ApiService {
    fn projection(&self) -> u64 {
        fingerprint(&self.metadata, &self.spec)
    }
}

impl Projection for ApiEndpointSlice {
    fn projection(&self) -> u64 {
        fingerprint(
            &self.metadata,
            (&self.address_type, &self.endpoints, &self.ports),
        )
    }
}

impl Projection for ApiNode {
    fn projection(&self) -> u64 {
        fingerprint(&self.metadata, &self.spec)
    }
}

/// Keeps of an object's metadata what podlink reads: of the annotations only
/// [`REDIRECTION_ANNOTATION`] and [`DNS_CAPTURE_ANNOTATION`], of the owner references only the controller's
/// (`controller: true`, at most one per object); no managed fields, no
/// finalizers.
pub(super) fn trim(meta: &mut ApiObjectMeta) {
    meta.managed_fields = None;
    meta.finalizers = None;
    if let Some(owners) = meta.owner_references.as_mut() {
        owners.retain(|o| o.controller == Some(true));
        if owners.is_empty() {
            meta.owner_references = None;
        }
    }
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| k == REDIRECTION_ANNOTATION || k == DNS_CAPTURE_ANNOTATION);
        if annotations.is_empty() {
            meta.annotations = None;
        }
    }
}

/// The owner references of `meta` as podlink keeps them (after [`trim`], the
/// controller's).
fn owner_references(meta: &ApiObjectMeta) -> Option<Vec<k8s::OwnerReference>> {
    meta.owner_references.as_ref().map(|owners| {
        owners
            .iter()
            .map(|o| k8s::OwnerReference {
                api_version: o.api_version.clone(),
                kind: o.kind.clone(),
                name: o.name.clone(),
                controller: o.controller,
            })
            .collect()
    })
}

/// podlink's view of watched metadata.
pub(super) fn meta_of(meta: &ApiObjectMeta) -> k8s::ObjectMeta {
    k8s::ObjectMeta {
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        labels: meta.labels.clone(),
        annotations: meta.annotations.clone(),
        deletion_timestamp: meta.deletion_timestamp.as_ref().map(|t| t.0.to_string()),
        owner_references: owner_references(meta),
    }
}

/// podlink's view of a watched pod.
pub(super) fn pod_of(pod: &ApiPod) -> k8s::Pod {
    k8s::Pod {
        metadata: meta_of(&pod.metadata),
        spec: pod.spec.clone(),
        status: pod.status.clone(),
    }
}

/// podlink's view of a watched Service.
pub(super) fn service_of(s: &ApiService) -> k8s::Service {
    k8s::Service {
        metadata: meta_of(&s.metadata),
        spec: s.spec.clone(),
    }
}

/// podlink's view of a watched EndpointSlice.
pub(super) fn endpoint_slice_of(s: &ApiEndpointSlice) -> k8s::EndpointSlice {
    k8s::EndpointSlice {
        metadata: meta_of(&s.metadata),
        address_type: s.address_type.clone(),
        endpoints: s.endpoints.clone(),
        ports: s.ports.clone(),
    }
}

/// podlink's view of a watched Node.
pub(super) fn node_of(n: &ApiNode) -> k8s::Node {
    k8s::Node {
        metadata: meta_of(&n.metadata),
        spec: n.spec.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_pod(json: serde_json::Value) -> ApiPod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_watched_pod_keeps_only_what_podlink_reads() {
        let mut pod = api_pod(serde_json::json!({
            "metadata": {
                "name": "web-1", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                "labels": {"app": "web", "istio.io/dataplane-mode": "ambient"},
                "annotations": {REDIRECTION_ANNOTATION: "enabled", "kubectl.kubernetes.io/last-applied-configuration": "{...}"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}],
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f", "uid": "u-0", "controller": true},
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "u-2"},
                    {"apiVersion": "v1", "kind": "Thing", "name": "x", "uid": "u-3", "controller": false},
                ],
                "finalizers": ["x/y"],
                "deletionTimestamp": "2026-11-30T18:00:00Z",
            },
            "spec": {"nodeName": "node1", "serviceAccountName": "web", "containers": [{"name": "app", "image": "x"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}], "conditions": []},
        }));
        trim(&mut pod.metadata);
        assert!(pod.metadata.managed_fields.is_none());
        assert!(pod.metadata.finalizers.is_none());
        assert_eq!(pod.metadata.owner_references.as_ref().unwrap().len(), 1);
        let meta = meta_of(&pod.metadata);
        assert_eq!(meta.name.as_deref(), Some("web-1"));
        assert_eq!(meta.namespace.as_deref(), Some("shop"));
        assert_eq!(meta.labels.as_ref().unwrap()["app"], "web");
        assert_eq!(
            meta.annotations,
            Some([(REDIRECTION_ANNOTATION.to_string(), "enabled".to_string())].into())
        );
        assert_eq!(
            meta.owner_references,
            Some(vec![k8s::OwnerReference {
                api_version: "apps/v1".into(),
                kind: "ReplicaSet".into(),
                name: "web-5d8f".into(),
                controller: Some(true),
            }])
        );
        assert!(
            meta.deletion_timestamp
                .as_deref()
                .unwrap()
                .starts_with("2026-11-30")
        );
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node1"));
        assert_eq!(spec.service_account_name.as_deref(), Some("web"));
        assert_eq!(pod.status.unwrap().pod_ip.as_deref(), Some("10.0.0.5"));
    }

    #[test]
    fn other_annotations_and_owners_alone_leave_none() {
        let mut pod = api_pod(serde_json::json!({
            "metadata": {"name": "a", "namespace": "b", "annotations": {"other": "x"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "u"}]},
        }));
        trim(&mut pod.metadata);
        let meta = meta_of(&pod.metadata);
        assert_eq!(meta.annotations, None);
        assert_eq!(meta.owner_references, None);
    }

    #[test]
    fn only_what_podlink_reads_changes_the_fingerprint() {
        let pod = |rv: &str, ready: bool, phase: &str| {
            api_pod(serde_json::json!({
                "metadata": {"name": "a", "namespace": "b", "resourceVersion": rv},
                "spec": {"nodeName": "n1"},
                "status": {"phase": phase, "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": ready.to_string()}]},
            }))
        };
        let base = pod("1", false, "Running").projection();
        assert_eq!(pod("2", true, "Running").projection(), base);
        assert_ne!(pod("3", true, "Succeeded").projection(), base);
    }

    /// A new controller (a pod adopted by another ReplicaSet) is a change; a
    /// new owner that is not the controller is not.
    #[test]
    fn an_owner_change_is_a_change() {
        let pod = |owners: serde_json::Value| {
            let mut p = api_pod(serde_json::json!({
                "metadata": {"name": "a", "namespace": "b", "ownerReferences": owners},
            }));
            trim(&mut p.metadata);
            p.projection()
        };
        let rs = |name: &str, controller: bool| serde_json::json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": name, "controller": controller});
        let base = pod(serde_json::json!([rs("web-1", true)]));
        assert_eq!(
            pod(serde_json::json!([rs("web-1", true), rs("other", false)])),
            base
        );
        assert_ne!(pod(serde_json::json!([rs("web-2", true)])), base);
        assert_ne!(pod(serde_json::json!([])), base);
    }

    #[test]
    fn services_slices_and_nodes_keep_what_podlink_reads() {
        let service: ApiService = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "3"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "targetPort": "http"}],
                "sessionAffinity": "ClientIP", "type": "ClusterIP"},
            "status": {"loadBalancer": {}},
        }))
        .unwrap();
        let s = service_of(&service);
        assert_eq!(
            s.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("10.96.0.10")
        );
        assert_eq!(
            s.spec.as_ref().unwrap().session_affinity.as_deref(),
            Some("ClientIP")
        );
        let slice: ApiEndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-x", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.1.2"], "nodeName": "n1", "zone": "a", "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }))
        .unwrap();
        let s = endpoint_slice_of(&slice);
        assert_eq!(s.address_type, "IPv4");
        assert_eq!(
            s.endpoints.as_ref().unwrap()[0].node_name.as_deref(),
            Some("n1")
        );
        let node = |heartbeat: &str, cidr: &str| -> ApiNode {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n1", "labels": {k8s::ZONE_LABEL: "a"}},
                "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
                "status": {"conditions": [{"type": "Ready", "lastHeartbeatTime": heartbeat}]},
            }))
            .unwrap()
        };
        let n = node_of(&node("t1", "10.244.1.0/24"));
        assert_eq!(
            n.spec.unwrap().pod_cidrs,
            Some(vec!["10.244.1.0/24".to_string()])
        );
        assert_eq!(
            node("t1", "10.244.1.0/24").projection(),
            node("t2", "10.244.1.0/24").projection()
        );
        assert_ne!(
            node("t1", "10.244.1.0/24").projection(),
            node("t1", "10.244.2.0/24").projection()
        );
    }

    #[test]
    fn resources_name_their_api_paths() {
        assert_eq!(
            ApiPod::url_path(&(), Some("shop")),
            "/api/v1/namespaces/shop/pods"
        );
        assert_eq!(ApiNamespace::url_path(&(), None), "/api/v1/namespaces");
        assert_eq!(ApiNode::url_path(&(), None), "/api/v1/nodes");
        assert_eq!(ApiService::url_path(&(), None), "/api/v1/services");
        assert_eq!(
            ApiEndpointSlice::url_path(&(), None),
            "/apis/discovery.k8s.io/v1/endpointslices"
        );
        assert_eq!(
            ApiAuthorizationPolicyV1::url_path(&(), None),
            "/apis/security.istio.io/v1/authorizationpolicies"
        );
        assert_eq!(
            ApiPeerAuthenticationV1beta1::url_path(&(), Some("shop")),
            "/apis/security.istio.io/v1beta1/namespaces/shop/peerauthentications"
        );
    }
}
