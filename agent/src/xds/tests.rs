use std::time::Duration;

use prost::Message;

use super::{
    proto::{
        discovery::{DeltaDiscoveryResponse, Resource},
        security::Authorization,
        workload::{Address, Workload, address},
    },
    *,
};

fn node() -> NodeIdentity {
    NodeIdentity {
        ip: "10.1.2.3".parse().unwrap(),
        pod_name: "podlink-x7k2p".into(),
        namespace: "istio-system".into(),
        node_name: "node-1".into(),
        network: String::new(),
    }
}

#[test]
fn node_id_is_ztunnel_shaped() {
    assert_eq!(
        node().id(),
        "ztunnel~10.1.2.3~podlink-x7k2p.istio-system~istio-system.svc.cluster.local"
    );
}

fn string_fields(node: &proto::core::Node) -> Vec<(String, String)> {
    let mut fields: Vec<_> = node
        .metadata
        .as_ref()
        .unwrap()
        .fields
        .iter()
        .map(|(k, v)| match &v.kind {
            Some(prost_types::value::Kind::StringValue(s)) => (k.clone(), s.clone()),
            other => panic!("{k}: not a string: {other:?}"),
        })
        .collect();
    fields.sort();
    fields
}

#[test]
fn node_metadata_is_what_ztunnel_sends() {
    let n = node().node("Kubernetes");
    assert_eq!(n.id, node().id());
    let want = |network: Option<&str>| {
        let mut want: Vec<(String, String)> = [
            ("CLUSTER_ID", "Kubernetes"),
            ("INSTANCE_IPS", "10.1.2.3"),
            ("NAME", "podlink-x7k2p"),
            ("NAMESPACE", "istio-system"),
            ("NODE_NAME", "node-1"),
        ]
        .into_iter()
        .chain(network.map(|n| ("NETWORK", n)))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        want.sort();
        want
    };
    assert_eq!(string_fields(&n), want(None));
    let mut with_network = node();
    with_network.network = "net-a".into();
    assert_eq!(
        string_fields(&with_network.node("Kubernetes")),
        want(Some("net-a"))
    );
}

#[test]
fn backoff_doubles_within_bounds_with_jitter() {
    let b = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(2),
    };
    assert_eq!(b.delay(0, 0.0), Duration::from_millis(50));
    assert_eq!(b.delay(0, 0.999_999).as_millis(), 99);
    assert_eq!(b.delay(1, 0.0), Duration::from_millis(100));
    assert_eq!(b.delay(3, 0.0), Duration::from_millis(400));
    // Bounded by max, even after very many failures.
    for failures in [5, 31, 32, 1000, u32::MAX] {
        assert_eq!(b.delay(failures, 0.0), Duration::from_secs(1), "{failures}");
        assert!(b.delay(failures, 1.0) <= b.max, "{failures}");
    }
}

#[test]
fn nack_message_names_each_refused_resource() {
    assert_eq!(
        nack_message(&[
            Refused::new("shop/web", "unknown load balancing mode 9"),
            Refused::new(
                "Kubernetes//Pod/shop/db-0",
                "does not decode: buffer underflow"
            ),
        ]),
        "shop/web: unknown load balancing mode 9; Kubernetes//Pod/shop/db-0: does not decode: buffer underflow"
    );
}

/// Records what it is handed; refuses the names in `refuse`.
#[derive(Default)]
struct Recorder {
    addresses: Vec<(Vec<String>, Vec<String>)>,
    authorizations: Vec<(Vec<String>, Vec<String>)>,
    refuse: Vec<String>,
}

impl Handler for Recorder {
    fn addresses(&mut self, updated: Vec<(String, Address)>, removed: Vec<String>) -> Vec<Refused> {
        let names: Vec<String> = updated.into_iter().map(|(n, _)| n).collect();
        let refused = names
            .iter()
            .filter(|n| self.refuse.contains(n))
            .map(|n| Refused::new(n.clone(), "refused by the handler"))
            .collect();
        self.addresses.push((names, removed));
        refused
    }

    fn authorizations(
        &mut self,
        updated: Vec<(String, Authorization)>,
        removed: Vec<String>,
    ) -> Vec<Refused> {
        self.authorizations
            .push((updated.into_iter().map(|(n, _)| n).collect(), removed));
        Vec::new()
    }
}

fn workload(uid: &str, version: &str) -> Resource {
    let message = Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid.into(),
            ..Default::default()
        })),
    };
    Resource {
        name: uid.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: proto::ADDRESS_TYPE_URL.into(),
            value: message.encode_to_vec(),
        }),
        ..Default::default()
    }
}

fn response(
    t: ResourceType,
    nonce: &str,
    resources: Vec<Resource>,
    removed: &[&str],
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: t.type_url().into(),
        nonce: nonce.into(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[test]
fn a_good_response_is_acked_and_held() {
    let mut held = Held::default();
    let mut h = Recorder::default();
    let answer = handle_response(
        &mut held,
        &mut h,
        response(
            ResourceType::Address,
            "n1",
            vec![workload("a", "1"), workload("b", "1")],
            &[],
        ),
    );
    assert!(answer.is_ack());
    assert_eq!(answer.request.response_nonce, "n1");
    assert_eq!(answer.request.type_url, proto::ADDRESS_TYPE_URL);
    assert_eq!(answer.resource_type, Some(ResourceType::Address));
    assert_eq!(h.addresses, vec![(vec!["a".into(), "b".into()], vec![])]);
    assert_eq!(held.versions(ResourceType::Address).len(), 2);
    let answer = handle_response(
        &mut held,
        &mut h,
        response(
            ResourceType::Address,
            "n2",
            vec![workload("a", "2")],
            &["b"],
        ),
    );
    assert!(answer.is_ack());
    assert_eq!(h.addresses[1], (vec!["a".into()], vec!["b".into()]));
    let versions = held.versions(ResourceType::Address);
    assert_eq!(versions.len(), 1);
    assert_eq!(versions["a"], "2");
}

#[test]
fn refused_resources_are_nacked_by_name_and_the_rest_applied() {
    let mut held = Held::default();
    let mut h = Recorder::default();
    handle_response(
        &mut held,
        &mut h,
        response(
            ResourceType::Address,
            "n1",
            vec![workload("bad-mode", "1")],
            &[],
        ),
    );
    h.refuse = vec!["bad-mode".into()];
    let mut garbage = workload("garbage", "1");
    garbage.resource.as_mut().unwrap().value = vec![0xff, 0xff, 0xff];
    let answer = handle_response(
        &mut held,
        &mut h,
        response(
            ResourceType::Address,
            "n2",
            vec![workload("good", "1"), garbage, workload("bad-mode", "2")],
            &[],
        ),
    );
    assert!(!answer.is_ack());
    assert_eq!(answer.request.response_nonce, "n2");
    let detail = answer.request.error_detail.unwrap();
    assert!(
        detail.message.starts_with("garbage: does not decode: "),
        "{}",
        detail.message
    );
    assert!(
        detail
            .message
            .ends_with("; bad-mode: refused by the handler"),
        "{}",
        detail.message
    );
    // The handler saw what decoded; the good one is held, the refused one keeps
    // its earlier version, the undecodable one is not held.
    assert_eq!(
        h.addresses[1].0,
        vec!["good".to_string(), "bad-mode".to_string()]
    );
    let versions = held.versions(ResourceType::Address);
    assert_eq!(versions["good"], "1");
    assert_eq!(versions["bad-mode"], "1");
    assert!(!versions.contains_key("garbage"));
}

#[test]
fn resources_without_body_or_of_another_type_are_refused() {
    let mut held = Held::default();
    let mut h = Recorder::default();
    let mut empty = workload("empty", "1");
    empty.resource = None;
    let mut other = workload("other", "1");
    other.resource.as_mut().unwrap().type_url = proto::AUTHORIZATION_TYPE_URL.into();
    let answer = handle_response(
        &mut held,
        &mut h,
        response(ResourceType::Address, "n", vec![empty, other], &[]),
    );
    let message = answer.request.error_detail.unwrap().message;
    assert!(message.contains("empty: no resource in it"), "{message}");
    assert!(message.contains("other: a type.googleapis.com/istio.security.Authorization in a response of type.googleapis.com/istio.workload.Address"), "{message}");
}

#[test]
fn an_unsubscribed_type_is_nacked_without_the_handler() {
    let mut held = Held::default();
    let mut h = Recorder::default();
    let mut r = response(ResourceType::Address, "n", vec![workload("a", "1")], &[]);
    r.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    let answer = handle_response(&mut held, &mut h, r);
    assert_eq!(answer.resource_type, None);
    assert!(!answer.is_ack());
    assert!(h.addresses.is_empty() && h.authorizations.is_empty());
}

#[test]
fn authorizations_go_to_their_handler() {
    let mut held = Held::default();
    let mut h = Recorder::default();
    let policy = Authorization {
        name: "deny".into(),
        namespace: "shop".into(),
        dry_run: true,
        ..Default::default()
    };
    let resource = Resource {
        name: "shop/deny".into(),
        version: "7".into(),
        resource: Some(prost_types::Any {
            type_url: proto::AUTHORIZATION_TYPE_URL.into(),
            value: policy.encode_to_vec(),
        }),
        ..Default::default()
    };
    let answer = handle_response(
        &mut held,
        &mut h,
        response(ResourceType::Authorization, "n", vec![resource], &[]),
    );
    assert!(answer.is_ack());
    assert_eq!(h.authorizations, vec![(vec!["shop/deny".into()], vec![])]);
    assert_eq!(held.versions(ResourceType::Authorization)["shop/deny"], "7");
    assert!(held.versions(ResourceType::Address).is_empty());
}

#[test]
fn metrics_are_named_as_documented() {
    let metrics = XdsMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut page = String::new();
    prometheus_client::encoding::text::encode(&mut page, &registry).unwrap();
    for line in [
        "podlink_xds_connected 0",
        "podlink_xds_pushes_total{type=\"address\"} 0",
        "podlink_xds_nacks_total{type=\"authorization\"} 0",
        "podlink_xds_resources{type=\"address\"} 0",
        "podlink_xds_reconnects_total 0",
    ] {
        assert!(page.lines().any(|l| l == line), "{line}:\n{page}");
    }
}
