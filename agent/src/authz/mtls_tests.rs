//! PeerAuthentication: compilation, the mode in effect at each level, and the
//! refusal of plaintext where it is `STRICT`.

use std::{collections::BTreeMap, sync::Arc};

use super::{spec::PeerAuthentication, *};
use crate::identity::SpiffeId;

const ROOT: &str = DEFAULT_ROOT_NAMESPACE;

/// Compiles `yaml`; the error is its message (YAML's or the compiler's).
fn compile(yaml: &str) -> Result<MtlsPolicy, String> {
    let object: PeerAuthentication = serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())?;
    MtlsPolicy::compile(&object).map_err(|e| e.to_string())
}

/// A PeerAuthentication `ns/name` with the YAML `spec` (a flow mapping).
fn pa(ns: &str, name: &str, spec: &str) -> Arc<MtlsPolicy> {
    Arc::new(
        compile(&format!(
            "metadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
        ))
        .unwrap(),
    )
}

fn set(policies: &[&Arc<MtlsPolicy>]) -> PolicySet {
    let (set, warnings) = PolicySet::build(ROOT, [], policies.iter().map(|p| Arc::clone(p)));
    assert_eq!(warnings, []);
    set
}

fn web() -> BTreeMap<String, String> {
    BTreeMap::from([("app".to_string(), "web".to_string())])
}

/// Decides a request from `source` (`None`: plaintext) to port `port` of a
/// workload in `ns` labelled `app=web`: `None` when allowed, else the name it is
/// counted under.
fn decide_in(set: &PolicySet, ns: &str, source: Option<&SpiffeId>, port: u16) -> Option<String> {
    let req = Request {
        source_ip: "10.0.1.5".parse().unwrap(),
        source,
        destination_ip: "10.0.2.9".parse().unwrap(),
        destination_port: port,
    };
    set.evaluate(ns, &web(), &[], &req)
        .denied_by()
        .map(|d| d.policy().to_string())
}

/// A plaintext request to `shop`'s `app=web` on `port`.
fn plaintext(set: &PolicySet, port: u16) -> Option<String> {
    decide_in(set, "shop", None, port)
}

fn client() -> SpiffeId {
    SpiffeId::new("cluster.local", "shop", "front")
}

#[test]
fn nothing_set_is_permissive() {
    let set = set(&[]);
    assert_eq!(plaintext(&set, 80), None);
    let eff = set.mtls().effective("shop", &web(), 80);
    assert_eq!(eff.mode, MtlsMode::Permissive);
    assert_eq!(eff.set_by, None);
}

#[test]
fn strict_at_each_level_refuses_plaintext() {
    let mesh = pa(ROOT, "default", "{mtls: {mode: STRICT}}");
    assert_eq!(
        plaintext(&set(&[&mesh]), 80).as_deref(),
        Some("istio-system/default")
    );
    // Mesh-wide applies to every namespace, the root one too.
    assert_eq!(
        decide_in(&set(&[&mesh]), ROOT, None, 80).as_deref(),
        Some("istio-system/default")
    );
    let ns = pa("shop", "default", "{mtls: {mode: STRICT}}");
    assert_eq!(plaintext(&set(&[&ns]), 80).as_deref(), Some("shop/default"));
    // Another namespace's policy does not apply.
    assert_eq!(decide_in(&set(&[&ns]), "bank", None, 80), None);
    let workload = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}}",
    );
    assert_eq!(
        plaintext(&set(&[&workload]), 80).as_deref(),
        Some("shop/web")
    );
    let other = pa(
        "shop",
        "db",
        "{selector: {matchLabels: {app: db}}, mtls: {mode: STRICT}}",
    );
    assert_eq!(plaintext(&set(&[&other]), 80), None);
    // A selector only selects in its own namespace.
    assert_eq!(decide_in(&set(&[&workload]), "bank", None, 80), None);
}

#[test]
fn the_most_specific_level_wins() {
    let mesh = pa(ROOT, "default", "{mtls: {mode: STRICT}}");
    let ns = pa("shop", "default", "{mtls: {mode: PERMISSIVE}}");
    let workload = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}}",
    );
    assert_eq!(plaintext(&set(&[&mesh, &ns]), 80), None);
    assert_eq!(
        plaintext(&set(&[&mesh, &ns, &workload]), 80).as_deref(),
        Some("shop/web")
    );
    let relaxed = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: PERMISSIVE}}",
    );
    let strict_ns = pa("shop", "default", "{mtls: {mode: STRICT}}");
    assert_eq!(plaintext(&set(&[&strict_ns, &relaxed]), 80), None);
}

#[test]
fn unset_inherits() {
    let mesh = pa(ROOT, "default", "{mtls: {mode: STRICT}}");
    // UNSET (written or absent) at the namespace and the workload: the mesh's.
    let ns = pa("shop", "default", "{mtls: {mode: UNSET}}");
    let workload = pa("shop", "web", "{selector: {matchLabels: {app: web}}}");
    let all = set(&[&mesh, &ns, &workload]);
    assert_eq!(plaintext(&all, 80).as_deref(), Some("istio-system/default"));
    let eff = all.mtls().effective("shop", &web(), 80);
    assert_eq!(eff.mode, MtlsMode::Strict);
    assert_eq!(
        eff.set_by.map(ToString::to_string).as_deref(),
        Some("istio-system/default")
    );
    // A namespace set STRICT, the workload UNSET: the namespace's.
    let strict_ns = pa("shop", "default", "{mtls: {mode: STRICT}}");
    assert_eq!(
        plaintext(&set(&[&strict_ns, &workload]), 80).as_deref(),
        Some("shop/default")
    );
    // Everything UNSET: PERMISSIVE.
    let unset_mesh = pa(ROOT, "default", "{mtls: {}}");
    assert_eq!(plaintext(&set(&[&unset_mesh, &ns, &workload]), 80), None);
    // A port-level UNSET inherits from the workload's mode.
    let ports = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}, portLevelMtls: {8080: {mode: UNSET}}}",
    );
    assert_eq!(
        plaintext(&set(&[&ports]), 8080).as_deref(),
        Some("shop/web")
    );
}

#[test]
fn port_level_permissive_inside_a_strict_namespace() {
    let ns = pa("shop", "default", "{mtls: {mode: STRICT}}");
    let ports = pa(
        "shop",
        "web-metrics",
        "{selector: {matchLabels: {app: web}}, portLevelMtls: {9090: {mode: PERMISSIVE}, 9091: {mode: DISABLE}}}",
    );
    let set = set(&[&ns, &ports]);
    assert_eq!(plaintext(&set, 9090), None);
    assert_eq!(plaintext(&set, 9091), None);
    // Other ports keep the namespace's STRICT, named by the namespace's policy.
    assert_eq!(plaintext(&set, 80).as_deref(), Some("shop/default"));
    // Another workload of the namespace is not selected.
    let req = Request {
        source_ip: "10.0.1.5".parse().unwrap(),
        source: None,
        destination_ip: "10.0.2.8".parse().unwrap(),
        destination_port: 9090,
    };
    let db = BTreeMap::from([("app".to_string(), "db".to_string())]);
    assert_eq!(
        set.evaluate("shop", &db, &[], &req).into_result(),
        Err(Denial::MtlsStrict("shop/default".into()))
    );
}

#[test]
fn port_level_strict_in_a_permissive_namespace() {
    let ns = pa("shop", "default", "{mtls: {mode: PERMISSIVE}}");
    let ports = pa(
        "shop",
        "web-admin",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: PERMISSIVE}, portLevelMtls: {8443: {mode: STRICT}}}",
    );
    let set = set(&[&ns, &ports]);
    assert_eq!(plaintext(&set, 8443).as_deref(), Some("shop/web-admin"));
    assert_eq!(plaintext(&set, 80), None);
}

#[test]
fn disable_accepts_plaintext() {
    let mesh = pa(ROOT, "default", "{mtls: {mode: STRICT}}");
    let ns = pa("shop", "default", "{mtls: {mode: DISABLE}}");
    let set = set(&[&mesh, &ns]);
    assert_eq!(plaintext(&set, 80), None);
    assert_eq!(
        set.mtls().effective("shop", &web(), 80).mode,
        MtlsMode::Disable
    );
    // And HBONE is still accepted.
    assert_eq!(decide_in(&set, "shop", Some(&client()), 80), None);
}

#[test]
fn removal_restores_plaintext() {
    let ns = pa("shop", "default", "{mtls: {mode: STRICT}}");
    assert_eq!(plaintext(&set(&[&ns]), 80).as_deref(), Some("shop/default"));
    assert_eq!(plaintext(&set(&[]), 80), None);
}

#[test]
fn peer_identities_are_never_refused() {
    let mesh = pa(ROOT, "default", "{mtls: {mode: STRICT}}");
    let ports = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, portLevelMtls: {8443: {mode: STRICT}}}",
    );
    let set = set(&[&mesh, &ports]);
    // An HBONE stream's certificate identity, or a pod of this node's identity:
    // both are `source`.
    let id = client();
    for port in [80, 8443] {
        assert_eq!(decide_in(&set, "shop", Some(&id), port), None);
    }
}

#[test]
fn strict_comes_before_authorization_policies() {
    let ns = pa("shop", "default", "{mtls: {mode: STRICT}}");
    let deny: super::spec::AuthorizationPolicy = serde_yaml_ng::from_str(
        "metadata: {name: deny-all, namespace: shop}\nspec: {action: DENY, rules: [{}]}\n",
    )
    .unwrap();
    let audit: super::spec::AuthorizationPolicy = serde_yaml_ng::from_str(
        "metadata: {name: audit, namespace: shop}\nspec: {action: AUDIT, rules: [{}]}\n",
    )
    .unwrap();
    let (set, _) = PolicySet::build(
        ROOT,
        [deny, audit]
            .iter()
            .map(|p| Arc::new(Policy::compile(p).unwrap())),
        [ns],
    );
    let req = Request {
        source_ip: "10.0.1.5".parse().unwrap(),
        source: None,
        destination_ip: "10.0.2.9".parse().unwrap(),
        destination_port: 80,
    };
    let decision = set.evaluate("shop", &web(), &[], &req);
    assert_eq!(
        decision.denied_by(),
        Some(&Denial::MtlsStrict("shop/default".into()))
    );
    // AUDIT matches are still reported.
    assert_eq!(decision.audited, ["shop/audit"]);
    // With a peer identity the DENY policy decides.
    let id = client();
    let req = Request {
        source: Some(&id),
        ..req
    };
    assert_eq!(
        set.evaluate("shop", &web(), &[], &req).denied_by(),
        Some(&Denial::Policy("shop/deny-all".into()))
    );
}

#[test]
fn unknown_policies_still_deny_everything() {
    let mut set = set(&[]);
    set.deny_all_unknown("/m/p.yaml is broken".into());
    assert_eq!(plaintext(&set, 80).as_deref(), Some("unknown-policies"));
}

#[test]
fn the_denial_is_counted_and_displayed() {
    let denial = Denial::MtlsStrict("shop/default".into());
    assert_eq!(denial.policy(), "shop/default");
    assert_eq!(
        denial.to_string(),
        "plaintext refused: mTLS is STRICT (PeerAuthentication shop/default)"
    );
    let counts = DenialCounts::default();
    assert_eq!(counts.count(&denial), 1);
    assert_eq!(counts.count(&denial), 2);
    assert_eq!(counts.by_policy(), [("shop/default".to_string(), 2)]);
}

#[test]
fn several_policies_at_one_level_take_the_first_by_name() {
    let b = pa("shop", "b", "{mtls: {mode: PERMISSIVE}}");
    let a = pa("shop", "a", "{mtls: {mode: STRICT}}");
    let (set, warnings) = PolicySet::build(ROOT, [], [b.clone(), a.clone()]);
    assert_eq!(plaintext(&set, 80).as_deref(), Some("shop/a"));
    assert_eq!(
        warnings,
        [SetWarning::MtlsOverlap {
            level: "to namespace shop".into(),
            policies: vec!["shop/a".into(), "shop/b".into()],
        }]
    );
    let text = warnings[0].to_string();
    assert!(
        text.starts_with("PeerAuthentications shop/a, shop/b all apply to namespace shop; shop/a is enforced, the first by name"),
        "{text}"
    );
    assert!(set.mtls().in_effect(&a));
    assert!(!set.mtls().in_effect(&b));
    // Mesh-wide too.
    let m1 = pa(ROOT, "z", "{mtls: {mode: STRICT}}");
    let m2 = pa(ROOT, "default", "{mtls: {mode: PERMISSIVE}}");
    let (set, warnings) = PolicySet::build(ROOT, [], [m1, m2]);
    assert_eq!(plaintext(&set, 80), None);
    assert_eq!(
        warnings,
        [SetWarning::MtlsOverlap {
            level: "mesh-wide".into(),
            policies: vec!["istio-system/default".into(), "istio-system/z".into()],
        }]
    );
}

#[test]
fn selectors_on_one_workload_take_the_first_by_name_and_warn() {
    let web_strict = pa(
        "shop",
        "web-b",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}}",
    );
    let web_loose = pa(
        "shop",
        "web-a",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: PERMISSIVE}}",
    );
    let set = set(&[&web_strict, &web_loose]);
    assert_eq!(plaintext(&set, 80), None);
    let labels = web();
    let db = BTreeMap::from([("app".to_string(), "db".to_string())]);
    let warnings = set.mtls().overlaps([
        ("shop", &labels),
        ("shop", &labels),
        ("shop", &db),
        ("bank", &labels),
    ]);
    // Once, however many pods they select together.
    assert_eq!(
        warnings,
        [SetWarning::MtlsOverlap {
            level: "to the same pods of this node".into(),
            policies: vec!["shop/web-a".into(), "shop/web-b".into()],
        }]
    );
    assert_eq!(set.mtls().overlaps([("shop", &db)]), []);
}

#[test]
fn a_selector_in_the_root_namespace_applies_to_no_workload() {
    let root_selector = pa(
        ROOT,
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}}",
    );
    let (set, warnings) = PolicySet::build(ROOT, [], [root_selector.clone()]);
    assert_eq!(plaintext(&set, 80), None);
    assert_eq!(decide_in(&set, ROOT, None, 80), None);
    assert_eq!(
        warnings,
        [SetWarning::MtlsRootSelector {
            policy: "istio-system/web".into()
        }]
    );
    assert_eq!(root_selector.scope(ROOT), MtlsScope::Ignored);
    assert!(!set.mtls().in_effect(&root_selector));
}

#[test]
fn a_name_defined_twice_enforces_the_strictest_mode_with_a_warning() {
    let warned = [SetWarning::MtlsDuplicate {
        policy: "shop/default".into(),
    }];
    // The stricter second.
    let permissive = pa("shop", "default", "{mtls: {mode: PERMISSIVE}}");
    let strict = pa("shop", "default", "{mtls: {mode: STRICT}}");
    for order in [[&permissive, &strict], [&strict, &permissive]] {
        let (set, warnings) = PolicySet::build(ROOT, [], order.map(Arc::clone));
        assert_eq!(plaintext(&set, 80).as_deref(), Some("shop/default"));
        assert_eq!(warnings, warned);
        assert_eq!(set.mtls().policies().count(), 1);
        assert!(set.mtls().in_effect(set.mtls().policies().next().unwrap()));
    }
    // UNSET gives way to DISABLE, which accepts plaintext.
    let unset = pa("shop", "default", "{mtls: {mode: UNSET}}");
    let disable = pa("shop", "default", "{mtls: {mode: DISABLE}}");
    let mesh_strict = pa(ROOT, "default", "{mtls: {mode: STRICT}}");
    let (set, _) = PolicySet::build(ROOT, [], [unset.clone(), disable, mesh_strict.clone()]);
    assert_eq!(plaintext(&set, 80), None);
    let (set, _) = PolicySet::build(ROOT, [], [unset.clone(), unset, mesh_strict]);
    assert_eq!(plaintext(&set, 80).as_deref(), Some("istio-system/default"));
    // Per port: the strictest of each port, the mode of a port only one names.
    let a = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: STRICT}, portLevelMtls: {\"8080\": {mode: PERMISSIVE}, \"9090\": {mode: STRICT}}}",
    );
    let b = pa(
        "shop",
        "web",
        "{selector: {matchLabels: {app: web}}, mtls: {mode: PERMISSIVE}, portLevelMtls: {\"8080\": {mode: STRICT}, \"7070\": {mode: DISABLE}}}",
    );
    let (set, warnings) = PolicySet::build(ROOT, [], [a, b]);
    assert_eq!(warnings.len(), 1);
    let merged = set.mtls().policies().next().unwrap();
    assert_eq!(merged.mode, MtlsMode::Strict);
    assert_eq!(
        merged.port_modes,
        BTreeMap::from([
            (7070, MtlsMode::Disable),
            (8080, MtlsMode::Strict),
            (9090, MtlsMode::Strict)
        ])
    );
    assert_eq!(plaintext(&set, 7070), None);
    assert_eq!(plaintext(&set, 8080).as_deref(), Some("shop/web"));
    // Different selectors: both kept, each at its level.
    let ns_level = pa("shop", "twice", "{mtls: {mode: STRICT}}");
    let other = pa(
        "shop",
        "twice",
        "{selector: {matchLabels: {app: db}}, mtls: {mode: PERMISSIVE}}",
    );
    let (set, warnings) = PolicySet::build(ROOT, [], [ns_level, other]);
    assert_eq!(warnings.len(), 1);
    assert_eq!(set.mtls().policies().count(), 2);
    assert_eq!(plaintext(&set, 80).as_deref(), Some("shop/twice"));
}

#[test]
fn compile_checks_modes_ports_and_selectors() {
    let p = compile(
        "metadata: {name: web, namespace: shop}\nspec: {selector: {matchLabels: {app: web}}, mtls: {mode: PERMISSIVE}, portLevelMtls: {\"8080\": {mode: STRICT}}}\n",
    )
    .unwrap();
    assert_eq!(p.mode, MtlsMode::Permissive);
    assert_eq!(p.port_modes, BTreeMap::from([(8080, MtlsMode::Strict)]));
    assert_eq!(
        p.scope(ROOT),
        MtlsScope::Workload {
            namespace: "shop".into(),
            labels: web()
        }
    );
    // No namespace: `default`; no spec: UNSET.
    let p = compile("metadata: {name: x}\n").unwrap();
    assert_eq!((p.namespace.as_str(), p.mode), ("default", MtlsMode::Unset));
    assert_eq!(p.scope(ROOT), MtlsScope::Namespace("default".into()));
    // A selector without labels is none: namespace-wide.
    let p = compile("metadata: {name: x, namespace: shop}\nspec: {selector: {matchLabels: {}}}\n")
        .unwrap();
    assert_eq!(p.selector, None);
    let err = compile(
        "metadata: {name: x, namespace: shop}\nspec: {selector: {}, portLevelMtls: {80: {mode: STRICT}}}\n",
    )
    .unwrap_err();
    assert_eq!(
        err,
        "PeerAuthentication shop/x: spec.portLevelMtls needs spec.selector"
    );
    let err = compile("metadata: {name: x, namespace: shop}\nspec: {mtls: {mode: strict}}\n")
        .unwrap_err();
    assert!(
        err.contains("spec.mtls.mode \"strict\" is not one of"),
        "{err}"
    );
    let err = compile(
        "metadata: {name: x, namespace: shop}\nspec: {selector: {matchLabels: {app: web}}, portLevelMtls: {\"0\": {mode: STRICT}}}\n",
    )
    .unwrap_err();
    assert!(
        err.contains("spec.portLevelMtls key \"0\" is not a port number"),
        "{err}"
    );
    let err = compile("metadata: {namespace: shop}\n").unwrap_err();
    assert_eq!(err, "PeerAuthentication has no metadata.name");
}

#[test]
fn modes_serialize_as_istio_writes_them() {
    assert_eq!(serde_json::to_value(MtlsMode::Strict).unwrap(), "STRICT");
    assert_eq!(serde_json::to_value(MtlsMode::Unset).unwrap(), "UNSET");
    assert_eq!(serde_json::to_value(MtlsScope::Mesh).unwrap(), "mesh");
    let scope = pa("shop", "web", "{selector: {matchLabels: {app: web}}}").scope(ROOT);
    assert_eq!(
        serde_json::to_value(scope).unwrap(),
        serde_json::json!({"workload": {"namespace": "shop", "labels": {"app": "web"}}})
    );
}
