use std::collections::BTreeMap;

use super::*;

fn pod(ns: &str, name: &str, ip: &str, label: Option<&str>) -> Pod {
    let labels = label.map_or(String::new(), |v| {
        format!(", labels: {{istio.io/dataplane-mode: {v}}}")
    });
    serde_yaml_ng::from_str(&format!(
        "metadata: {{name: {name}, namespace: {ns}{labels}}}\nspec: {{nodeName: n1}}\nstatus: {{podIP: {ip}}}"
    ))
    .unwrap()
}

fn namespace(name: &str, ambient: bool) -> Namespace {
    let labels = if ambient {
        ", labels: {istio.io/dataplane-mode: ambient}"
    } else {
        ""
    };
    serde_yaml_ng::from_str(&format!("metadata: {{name: {name}{labels}}}")).unwrap()
}

fn state() -> State {
    State::new("n1", "cluster.local", "istio-system")
}

/// The workloads of `state`, in key order, for comparison.
fn workloads(state: &State) -> Vec<Workload> {
    state
        .workloads()
        .workloads()
        .map(|w| Workload::clone(w))
        .collect()
}

fn complete(delta: Delta) -> Delta {
    Delta {
        completeness: Completeness::Complete,
        ..delta
    }
}

/// Pod by pod, the deltas of a source make the workloads a whole read of the
/// same pods makes, and say when an enrollment label is involved.
#[test]
fn pod_deltas_make_what_a_whole_read_makes() {
    let mut s = state();
    s.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        namespaces: Some(vec![namespace("a", true)]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    let mut objects: BTreeMap<String, Pod> = BTreeMap::new();
    // Each step: pods written (`Some`) or deleted (`None`), and whether an
    // enrollment label is involved.
    type Step = (Vec<(&'static str, Option<Pod>)>, bool);
    let steps: Vec<Step> = vec![
        (
            vec![("b/web", Some(pod("b", "web", "10.0.0.2", None)))],
            false,
        ),
        (
            vec![
                ("a/z", Some(pod("a", "z", "10.0.0.1", Some("ambient")))),
                ("c/a", Some(pod("c", "a", "10.0.0.3", None))),
            ],
            true,
        ),
        (
            vec![("b/web", Some(pod("b", "web", "10.0.0.9", None)))],
            false,
        ),
        (
            vec![("b/web", Some(pod("b", "web", "10.0.0.9", Some("none"))))],
            true,
        ),
        (vec![("a/z", None), ("b/web", None)], true),
        (vec![("a/a", Some(pod("a", "a", "10.0.0.5", None)))], false),
    ];
    for (n, (writes, labels)) in steps.into_iter().enumerate() {
        let mut delta = complete(Delta::default());
        for (key, object) in writes {
            match &object {
                Some(p) => objects.insert(key.to_string(), p.clone()),
                None => objects.remove(key),
            };
            delta
                .pods
                .push((key.to_string(), object.into_iter().collect()));
        }
        s.apply(delta);
        let refreshed = s.refresh(&NoLayer, BTreeSet::new());
        assert!(refreshed.changed, "step {n}");
        assert_eq!(refreshed.enrollment_labels, labels, "step {n}");
        let mut whole = state();
        whole.apply(complete(Delta {
            all_pods: Some(objects.values().cloned().collect()),
            namespaces: Some(vec![namespace("a", true)]),
            ..Delta::default()
        }));
        whole.refresh(&NoLayer, BTreeSet::new());
        assert_eq!(workloads(&s), workloads(&whole), "step {n}");
    }
}

/// A delta that changes nothing (a pod reported by two watches) changes
/// nothing to reconcile, and keeps the index.
#[test]
fn an_unchanged_delta_changes_nothing() {
    let mut s = state();
    let web = pod("a", "web", "10.0.0.2", None);
    s.apply(complete(Delta {
        all_pods: Some(vec![web.clone()]),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    let before = s.workloads().clone();
    s.apply(complete(Delta {
        pods: vec![("a/web".into(), vec![web.clone()])],
        ..Delta::default()
    }));
    s.apply(complete(Delta {
        all_pods: Some(vec![web]),
        ..Delta::default()
    }));
    assert_eq!(s.refresh(&NoLayer, BTreeSet::new()), Refreshed::default());
    assert!(Arc::ptr_eq(&before, s.workloads()));
}

/// A namespace's label enrolls its pods; completeness is the last delta's.
#[test]
fn a_namespace_change_remakes_its_pods() {
    let mut s = state();
    s.apply(Delta {
        all_pods: Some(vec![pod("a", "web", "10.0.0.2", None)]),
        namespaces: Some(vec![namespace("a", false)]),
        ..Delta::default()
    });
    s.refresh(&NoLayer, BTreeSet::new());
    assert_eq!(s.completeness(), Completeness::Incomplete);
    assert_eq!(s.workloads().captured().count(), 0);
    s.apply(complete(Delta {
        namespaces: Some(vec![namespace("a", true)]),
        ..Delta::default()
    }));
    let refreshed = s.refresh(&NoLayer, BTreeSet::new());
    assert!(refreshed.changed && refreshed.enrollment_labels);
    assert_eq!(s.completeness(), Completeness::Complete);
    assert_eq!(s.workloads().captured().count(), 1);
    assert!(s.has_namespace("a") && !s.has_namespace("b"));
}

/// A layer that gives a pod its address: the pod is made again when the
/// layer changes for it.
#[test]
fn a_layer_gives_pods_addresses() {
    struct Give(&'static str);
    impl PodLayer for Give {
        fn overlaid<'a>(&self, pod: &'a Pod) -> Cow<'a, Pod> {
            let mut pod = pod.clone();
            pod.status.get_or_insert_with(Default::default).pod_ip = Some(self.0.into());
            Cow::Owned(pod)
        }
    }
    let mut s = state();
    let bare: Pod =
        serde_yaml_ng::from_str("metadata: {name: web, namespace: a}\nspec: {nodeName: n1}")
            .unwrap();
    s.apply(complete(Delta {
        all_pods: Some(vec![bare]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert!(s.workloads().get("a/web").unwrap().ips.is_empty());
    let refreshed = s.refresh(&Give("10.0.0.7"), BTreeSet::from(["a/web".to_string()]));
    assert!(refreshed.changed);
    assert_eq!(
        s.workloads().get("a/web").unwrap().ips,
        ["10.0.0.7".parse::<std::net::IpAddr>().unwrap()]
    );
}

/// Policies that cannot be known deny everything until they are known again.
#[test]
fn unknown_policies_deny_until_known() {
    let mut s = state();
    s.apply(Delta {
        all_pods: Some(Vec::new()),
        policies_unknown: Some(PoliciesUnknown {
            what: "/m/p.yaml".into(),
            why: "line 3: bad".into(),
        }),
        ..Delta::default()
    });
    s.refresh(&NoLayer, BTreeSet::new());
    assert_eq!(s.policies().unknown(), Some("/m/p.yaml is broken"));
    assert!(!s.policies_known());
    assert!(!s.policies_were_known, "never known yet");
    s.apply(complete(Delta::default()));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert_eq!(s.policies().unknown(), None);
    assert!(s.policies_known());
    // Known from now on: a return after another break is "known again".
    assert!(s.policies_were_known);
}

/// Policies refused in a namespace deny that namespace's pods only, and do
/// not make the view less than whole; gone, the policies are known again.
#[test]
fn refused_policies_of_a_namespace_deny_it_only() {
    let mut s = state();
    s.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert!(s.policies_were_known);
    let refused = PoliciesUnknown {
        what: "AuthorizationPolicy shop/x".into(),
        why: "spec.action \"ALLOWW\" is not one of ALLOW, DENY, AUDIT, CUSTOM".into(),
    };
    s.apply(complete(Delta {
        policies_unknown_in: BTreeMap::from([("shop".to_string(), refused)]),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert!(s.policies_known(), "the view stays whole");
    assert_eq!(s.policies().unknown(), None);
    assert_eq!(
        s.policies().unknown_for("shop"),
        Some("AuthorizationPolicy shop/x cannot be compiled")
    );
    assert_eq!(s.policies().unknown_for("bank"), None);
    s.apply(complete(Delta::default()));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert!(s.policies().unknown_namespaces().is_empty());
    assert_eq!(s.policies().unknown_for("shop"), None);
}

/// PeerAuthentications from a delta reach the policy set; a change of them
/// alone is a change, and removing them restores plaintext.
#[test]
fn peer_authentications_reach_the_policy_set() {
    use crate::authz::{MtlsPolicy, Request, spec::PeerAuthentication};
    let strict: PeerAuthentication = serde_yaml_ng::from_str(
        "metadata: {name: default, namespace: a}\nspec: {mtls: {mode: STRICT}}",
    )
    .unwrap();
    let mut s = state();
    s.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    s.apply(complete(Delta {
        mtls_policies: Some(vec![Arc::new(MtlsPolicy::compile(&strict).unwrap())]),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert_eq!(s.policies().mtls().policies().count(), 1);
    let req = Request {
        source_ip: "10.0.1.5".parse().unwrap(),
        source: None,
        destination_ip: "10.0.0.7".parse().unwrap(),
        destination_port: 80,
    };
    let labels = BTreeMap::new();
    assert_eq!(
        s.policies()
            .evaluate("a", &labels, &[], &req)
            .denied_by()
            .map(|d| d.policy().to_string()),
        Some("a/default".to_string())
    );
    s.apply(complete(Delta {
        mtls_policies: Some(Vec::new()),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert!(s.policies().evaluate("a", &labels, &[], &req).allowed());
}

/// The Services are chosen for this node's zone, from its Node object: made
/// again when that zone changes, kept when other nodes change.
#[test]
fn this_nodes_zone_chooses_the_services_endpoints() {
    use crate::state::service::Choice;
    fn node(name: &str, zone: Option<&str>) -> Node {
        let labels = zone.map_or(String::new(), |z| {
            format!(", labels: {{topology.kubernetes.io/zone: {z}}}")
        });
        serde_yaml_ng::from_str(&format!("metadata: {{name: {name}{labels}}}")).unwrap()
    }
    let service: Service = serde_yaml_ng::from_str(
        "metadata: {name: api, namespace: a}
spec: {clusterIP: 10.96.0.20, trafficDistribution: PreferClose, ports: [{port: 80}]}",
    )
    .unwrap();
    let slice: EndpointSlice = serde_yaml_ng::from_str(
        "metadata: {name: api-1, namespace: a, labels: {kubernetes.io/service-name: api}}
addressType: IPv4
endpoints:
- {addresses: [10.0.1.1], nodeName: n2, zone: z1}
- {addresses: [10.0.2.1], nodeName: n3, zone: z2}",
    )
    .unwrap();
    let vip = "10.96.0.20:80".parse().unwrap();
    let usable = |s: &State| {
        let port = s.services().lookup(vip).unwrap();
        (port.choice, port.usable().len())
    };
    let mut s = state();
    s.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        services: Some(vec![service]),
        endpoint_slices: Some(vec![slice]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    // No Node object: no zone, no preference.
    assert_eq!(usable(&s), (Choice::Ready, 2));
    s.apply(complete(Delta {
        nodes: Some(vec![node("n1", Some("z2")), node("n2", Some("z1"))]),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert_eq!(usable(&s), (Choice::SameZone, 1));
    let before = s.services().clone();
    s.apply(complete(Delta {
        nodes: Some(vec![node("n1", Some("z2")), node("n3", Some("z2"))]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert!(Arc::ptr_eq(&before, s.services()));
    s.apply(complete(Delta {
        nodes: Some(vec![node("n1", None)]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert_eq!(usable(&s), (Choice::Ready, 2));
}

/// The cluster's ranges are the configured ones with the Nodes' pod ranges
/// and those of the ClusterIPs added; a refresh that changes neither keeps
/// the same index.
#[test]
fn the_ranges_keep_the_configured_and_learn_nodes_and_services() {
    let configured = ranges::parse_cidr("10.96.0.0/12").unwrap();
    let mut s = state().with_cluster_cidrs(&[configured]);
    let node: Node =
        serde_yaml_ng::from_str("metadata: {name: n2}\nspec: {podCIDR: 10.244.2.0/24}").unwrap();
    s.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        nodes: Some(vec![node]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    let ip = |a: &str| a.parse::<std::net::IpAddr>().unwrap();
    assert!(s.ranges().contains(ip("10.100.0.1")));
    assert!(s.ranges().contains(ip("10.244.2.9")));
    assert!(!s.ranges().contains(ip("10.244.3.9")));
    let before = s.ranges().clone();
    s.apply(complete(Delta {
        pods: vec![("a/p".into(), vec![pod("a", "p", "10.244.2.5", None)])],
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert!(Arc::ptr_eq(&before, s.ranges()));
    s.apply(complete(Delta {
        nodes: Some(Vec::new()),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert!(!s.ranges().contains(ip("10.244.2.9")));
    assert!(s.ranges().contains(ip("10.100.0.1")));
}

/// Services and EndpointSlices changed one by one make the index a whole set
/// makes; an unchanged object changes nothing, a deleted one leaves it.
#[test]
fn services_change_one_by_one_as_a_whole_set_would() {
    let service = |name: &str, ip: &str| -> Service {
        serde_yaml_ng::from_str(&format!(
            "metadata: {{name: {name}, namespace: a}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}"
        ))
        .unwrap()
    };
    let slice = |name: &str, ip: &str| -> EndpointSlice {
        serde_yaml_ng::from_str(&format!(
            "metadata: {{name: {name}-1, namespace: a, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
endpoints:
- {{addresses: [{ip}]}}"
        ))
        .unwrap()
    };
    let ports = |s: &State| -> Vec<(String, Vec<std::net::SocketAddr>)> {
        s.services()
            .ports()
            .map(|p| (p.vip.to_string(), p.usable().to_vec()))
            .collect()
    };
    let mut whole = state();
    whole.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        services: Some(vec![
            service("api", "10.96.0.1"),
            service("web", "10.96.0.2"),
        ]),
        endpoint_slices: Some(vec![slice("api", "10.0.0.1"), slice("web", "10.0.0.2")]),
        ..Delta::default()
    }));
    whole.refresh(&NoLayer, BTreeSet::new());

    let mut one_by_one = state();
    one_by_one.apply(complete(Delta {
        all_pods: Some(Vec::new()),
        services: Some(vec![service("api", "10.96.0.1")]),
        endpoint_slices: Some(vec![slice("api", "10.0.0.1")]),
        ..Delta::default()
    }));
    one_by_one.refresh(&NoLayer, BTreeSet::new());
    one_by_one.apply(complete(Delta {
        changed_services: vec![("a/web".into(), Some(service("web", "10.96.0.2")))],
        changed_endpoint_slices: vec![("a/web-1".into(), Some(slice("web", "10.0.0.2")))],
        ..Delta::default()
    }));
    assert!(one_by_one.refresh(&NoLayer, BTreeSet::new()).changed);
    assert_eq!(ports(&one_by_one), ports(&whole));
    assert_eq!(ports(&whole).len(), 2);

    // The same object again changes nothing.
    one_by_one.apply(complete(Delta {
        changed_services: vec![("a/web".into(), Some(service("web", "10.96.0.2")))],
        ..Delta::default()
    }));
    assert!(!one_by_one.refresh(&NoLayer, BTreeSet::new()).changed);

    // Deleted: the Service's port leaves the index.
    one_by_one.apply(complete(Delta {
        changed_services: vec![("a/web".into(), None)],
        ..Delta::default()
    }));
    assert!(one_by_one.refresh(&NoLayer, BTreeSet::new()).changed);
    assert_eq!(ports(&one_by_one), ports(&whole)[..1].to_vec());
}

/// istiod's workloads, services and policies laid over the pods: a pod of this
/// node keeps its enrollment and gets istiod's facts; a remote workload is a
/// destination; a service's endpoints are the workloads that name it; a policy
/// istiod selected for the pod applies to it.
#[test]
fn istiods_view_is_laid_over_the_pods() {
    use crate::{
        authz::{IstiodScope, from_istiod},
        source::xds::convert,
        xds::proto::{security, workload as xds},
    };
    let mut s = state();
    s.apply(complete(Delta {
        all_pods: Some(vec![pod("a", "web", "10.0.1.5", None)]),
        namespaces: Some(vec![namespace("a", true)]),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    let before = s.workloads().get("a/web").unwrap().clone();
    assert!(before.mesh.is_none());

    let port = |p: u32, t: u32| xds::Port {
        service_port: p,
        target_port: t,
        app_protocol: 0,
    };
    let backs = |ports| {
        [(
            "a/api.a.svc.cluster.local".to_string(),
            xds::PortList { ports },
        )]
        .into()
    };
    let local = xds::Workload {
        name: "web".into(),
        namespace: "a".into(),
        addresses: vec![vec![10, 0, 1, 5]],
        tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
        node: "n1".into(),
        authorization_policies: vec!["a/only-b".into()],
        ..Default::default()
    };
    let remote = xds::Workload {
        name: "api-0".into(),
        namespace: "a".into(),
        addresses: vec![vec![10, 0, 2, 7]],
        tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
        node: "n2".into(),
        services: backs(vec![port(80, 9090)]),
        ..Default::default()
    };
    let service = xds::Service {
        name: "api".into(),
        namespace: "a".into(),
        hostname: "api.a.svc.cluster.local".into(),
        addresses: vec![xds::NetworkAddress {
            network: String::new(),
            address: vec![10, 96, 0, 20],
            length: None,
        }],
        ports: vec![port(80, 8080)],
        ..Default::default()
    };
    let policy = security::Authorization {
        name: "only-b".into(),
        namespace: "a".into(),
        scope: security::Scope::WorkloadSelector as i32,
        action: security::Action::Allow as i32,
        rules: vec![security::Rule {
            clauses: vec![security::Clause {
                matches: vec![security::Match {
                    namespaces: vec![security::StringMatch {
                        match_type: Some(security::string_match::MatchType::Exact("b".into())),
                    }],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    };
    let mut mesh = Mesh::default();
    for (name, w) in [("local", &local), ("remote", &remote)] {
        Arc::make_mut(&mut mesh.workloads).insert(
            name.to_string(),
            convert::workload(w, "cluster.local").unwrap(),
        );
    }
    Arc::make_mut(&mut mesh.services).insert("svc".into(), convert::service(&service).unwrap());
    let compiled = from_istiod(&policy).unwrap();
    assert_eq!(compiled.istiod_scope, Some(IstiodScope::WorkloadSelector));
    Arc::make_mut(&mut mesh.policies).insert("p".into(), Arc::new(compiled));
    s.apply(complete(Delta {
        mesh: Some(Arc::new(mesh)),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);

    let web = s.workloads().get("a/web").unwrap();
    assert_eq!(web.enrollment, before.enrollment, "the pod decides");
    assert_eq!(web.mesh.as_ref().unwrap().policies, ["a/only-b"]);
    let api = s.workloads().by_ip("10.0.2.7".parse().unwrap()).unwrap();
    assert_eq!(api.key(), "a/api-0");
    assert!(api.enrollment.is_enrolled());
    let vip = s
        .services()
        .lookup("10.96.0.20:80".parse().unwrap())
        .unwrap();
    assert_eq!(vip.usable(), ["10.0.2.7:9090".parse().unwrap()]);
    assert_eq!(vip.host, service.hostname, "metrics name istiod's host");
    // The selected ALLOW applies to the pod istiod named it for.
    let b = crate::identity::SpiffeId::new("cluster.local", "b", "x");
    let c = crate::identity::SpiffeId::new("cluster.local", "c", "x");
    let req = |source| crate::authz::Request {
        source_ip: "10.0.3.1".parse().unwrap(),
        source: Some(source),
        destination_ip: "10.0.1.5".parse().unwrap(),
        destination_port: 80,
    };
    let named = &web.mesh.as_ref().unwrap().policies;
    assert!(
        s.policies()
            .evaluate("a", &web.labels, named, &req(&b))
            .allowed()
    );
    assert!(
        !s.policies()
            .evaluate("a", &web.labels, named, &req(&c))
            .allowed()
    );
    assert!(
        s.policies()
            .evaluate("a", &web.labels, &[], &req(&c))
            .allowed()
    );

    // istiod removes everything: the pod is no longer a mesh workload.
    s.apply(complete(Delta {
        mesh: Some(Arc::new(Mesh::default())),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    let web = s.workloads().get("a/web").unwrap();
    assert!(web.mesh.is_none());
    assert_eq!(
        web.enrollment,
        Enrollment::NotEnrolled("istiod does not list it as a mesh workload")
    );
    assert_eq!(s.workloads().captured().count(), 0);
    assert!(s.workloads().by_ip("10.0.2.7".parse().unwrap()).is_none());
    assert!(
        s.services()
            .lookup("10.96.0.20:80".parse().unwrap())
            .is_none()
    );
}

/// A push that changes one kind of istiod's resources makes again only what
/// depends on it: a policy leaves the workload and service indexes as they
/// were, a service the workload index.
#[test]
fn an_istiod_push_makes_again_only_what_its_kinds_change() {
    use crate::{authz::from_istiod, xds::proto::security};
    let mut s = state();
    let mut mesh = Mesh::default();
    s.apply(complete(Delta {
        all_pods: Some(vec![pod("a", "web", "10.0.1.5", None)]),
        namespaces: Some(vec![namespace("a", true)]),
        mesh: Some(Arc::new(mesh.clone())),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    let (workloads, services, policies) = (
        s.workloads().clone(),
        s.services().clone(),
        s.policies().clone(),
    );

    let policy = security::Authorization {
        name: "deny-all".into(),
        namespace: "a".into(),
        scope: security::Scope::Namespace as i32,
        action: security::Action::Deny as i32,
        ..Default::default()
    };
    Arc::make_mut(&mut mesh.policies).insert("p".into(), Arc::new(from_istiod(&policy).unwrap()));
    s.apply(complete(Delta {
        mesh: Some(Arc::new(mesh.clone())),
        ..Delta::default()
    }));
    assert!(s.refresh(&NoLayer, BTreeSet::new()).changed);
    assert!(Arc::ptr_eq(s.workloads(), &workloads));
    assert!(Arc::ptr_eq(s.services(), &services));
    assert!(!Arc::ptr_eq(s.policies(), &policies));
    assert_eq!(s.policies().policies().count(), 1);

    let policies = s.policies().clone();
    Arc::make_mut(&mut mesh.services).clear();
    s.apply(complete(Delta {
        mesh: Some(Arc::new(mesh)),
        ..Delta::default()
    }));
    s.refresh(&NoLayer, BTreeSet::new());
    assert!(Arc::ptr_eq(s.workloads(), &workloads));
    assert!(!Arc::ptr_eq(s.services(), &services));
    assert!(Arc::ptr_eq(s.policies(), &policies));
}
