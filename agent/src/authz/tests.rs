//! The policy/request table: each field, its `not*` form, wildcards, empty rules,
//! scopes and the order of actions.

use std::{collections::BTreeMap, sync::Arc};

use super::{compile::label_problem, spec::AuthorizationPolicy, *};
use crate::identity::SpiffeId;

const ROOT: &str = DEFAULT_ROOT_NAMESPACE;

/// Compiles `yaml`; the error is its message (YAML's or the compiler's).
fn compile(yaml: &str) -> Result<Policy, String> {
    let object: AuthorizationPolicy = serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())?;
    Policy::compile(&object).map_err(|e| e.to_string())
}

fn set(yamls: &[&str]) -> PolicySet {
    PolicySet::build(
        ROOT,
        yamls.iter().map(|y| Arc::new(compile(y).unwrap())),
        [],
    )
    .0
}

/// A policy named `name` in `ns` with `action` and the YAML `rules` (a flow
/// sequence, or "" for none).
fn pol(ns: &str, name: &str, action: &str, rules: &str) -> String {
    let rules = if rules.is_empty() {
        String::new()
    } else {
        format!("  rules: {rules}\n")
    };
    format!("metadata: {{name: {name}, namespace: {ns}}}\nspec:\n  action: {action}\n{rules}")
}

struct Client {
    ip: &'static str,
    id: Option<SpiffeId>,
}

fn mtls(ns: &str, sa: &str, ip: &'static str) -> Client {
    Client {
        ip,
        id: Some(SpiffeId::new("cluster.local", ns, sa)),
    }
}

fn plain(ip: &'static str) -> Client {
    Client { ip, id: None }
}

/// Evaluates `client` → `10.0.2.9:port` of a workload in namespace `shop` labelled
/// `app=web`; returns `None` when allowed, else the policy counted.
fn decide(policies: &PolicySet, client: &Client, port: u16) -> Option<String> {
    let labels = BTreeMap::from([("app".to_string(), "web".to_string())]);
    let req = Request {
        source_ip: client.ip.parse().unwrap(),
        source: client.id.as_ref(),
        destination_ip: "10.0.2.9".parse().unwrap(),
        destination_port: port,
    };
    policies
        .evaluate("shop", &labels, &[], &req)
        .denied_by()
        .map(|d| d.policy().to_string())
}

const DENIED: Option<&str> = Some("allow-policies");

#[test]
fn the_table() {
    let front = mtls("shop", "front", "10.0.1.5");
    let other_ns = mtls("bank", "teller", "10.0.1.6");
    let outside = plain("192.168.7.7");
    // (policies, client, port, expected denial)
    let allow = "ALLOW";
    let cases: Vec<(Vec<String>, &Client, u16, Option<&str>)> = vec![
        // No policy: allowed.
        (vec![], &front, 80, None),
        // ALLOW without rules allows nothing; `{}` allows everything.
        (vec![pol("shop", "nothing", allow, "")], &front, 80, DENIED),
        (vec![pol("shop", "all", allow, "[{}]")], &outside, 80, None),
        // principals, exact, prefix, suffix, presence, spiffe:// prefix.
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [cluster.local/ns/shop/sa/front]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [cluster.local/ns/shop/sa/front]}}]}]",
            )],
            &other_ns,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [\"spiffe://cluster.local/ns/shop/sa/front\"]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [\"cluster.local/ns/shop/*\"]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [\"cluster.local/ns/shop/*\"]}}]}]",
            )],
            &other_ns,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [\"*/sa/teller\"]}}]}]",
            )],
            &other_ns,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [\"*\"]}}]}]",
            )],
            &other_ns,
            80,
            None,
        ),
        // Plaintext has no principal: principals never match it, even `*`.
        (
            vec![pol(
                "shop",
                "p",
                allow,
                "[{from: [{source: {principals: [\"*\"]}}]}]",
            )],
            &outside,
            80,
            DENIED,
        ),
        // notPrincipals.
        (
            vec![pol(
                "shop",
                "np",
                allow,
                "[{from: [{source: {notPrincipals: [cluster.local/ns/shop/sa/front]}}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "np",
                allow,
                "[{from: [{source: {notPrincipals: [cluster.local/ns/shop/sa/front]}}]}]",
            )],
            &other_ns,
            80,
            None,
        ),
        // The Istio idiom that refuses plaintext: DENY notPrincipals ["*"].
        (
            vec![pol(
                "shop",
                "require-mtls",
                "DENY",
                "[{from: [{source: {notPrincipals: [\"*\"]}}]}]",
            )],
            &outside,
            80,
            Some("shop/require-mtls"),
        ),
        (
            vec![pol(
                "shop",
                "require-mtls",
                "DENY",
                "[{from: [{source: {notPrincipals: [\"*\"]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        // namespaces / notNamespaces, with wildcards.
        (
            vec![pol(
                "shop",
                "n",
                allow,
                "[{from: [{source: {namespaces: [shop]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "n",
                allow,
                "[{from: [{source: {namespaces: [shop]}}]}]",
            )],
            &other_ns,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "n",
                allow,
                "[{from: [{source: {namespaces: [\"ba*\"]}}]}]",
            )],
            &other_ns,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "n",
                allow,
                "[{from: [{source: {namespaces: [\"*\"]}}]}]",
            )],
            &outside,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "nn",
                "DENY",
                "[{from: [{source: {notNamespaces: [shop]}}]}]",
            )],
            &other_ns,
            80,
            Some("shop/nn"),
        ),
        (
            vec![pol(
                "shop",
                "nn",
                "DENY",
                "[{from: [{source: {notNamespaces: [shop]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        // serviceAccounts.
        (
            vec![pol(
                "shop",
                "sa",
                allow,
                "[{from: [{source: {serviceAccounts: [bank/teller]}}]}]",
            )],
            &other_ns,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "sa",
                allow,
                "[{from: [{source: {serviceAccounts: [bank/teller]}}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        // ipBlocks / notIpBlocks / remoteIpBlocks: addresses and CIDR blocks.
        (
            vec![pol(
                "shop",
                "ip",
                allow,
                "[{from: [{source: {ipBlocks: [192.168.0.0/16]}}]}]",
            )],
            &outside,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "ip",
                allow,
                "[{from: [{source: {ipBlocks: [10.0.1.5]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "ip",
                allow,
                "[{from: [{source: {ipBlocks: [10.0.1.5]}}]}]",
            )],
            &other_ns,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "ip",
                "DENY",
                "[{from: [{source: {notIpBlocks: [10.0.0.0/8]}}]}]",
            )],
            &outside,
            80,
            Some("shop/ip"),
        ),
        (
            vec![pol(
                "shop",
                "ip",
                "DENY",
                "[{from: [{source: {notIpBlocks: [10.0.0.0/8]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "ip",
                allow,
                "[{from: [{source: {remoteIpBlocks: [192.168.7.0/24]}}]}]",
            )],
            &outside,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "ip",
                allow,
                "[{from: [{source: {notRemoteIpBlocks: [192.168.7.0/24]}}]}]",
            )],
            &outside,
            80,
            DENIED,
        ),
        // ports / notPorts.
        (
            vec![pol(
                "shop",
                "port",
                allow,
                "[{to: [{operation: {ports: [\"80\", \"443\"]}}]}]",
            )],
            &front,
            443,
            None,
        ),
        (
            vec![pol(
                "shop",
                "port",
                allow,
                "[{to: [{operation: {ports: [\"80\"]}}]}]",
            )],
            &front,
            8080,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "port",
                "DENY",
                "[{to: [{operation: {notPorts: [\"80\"]}}]}]",
            )],
            &front,
            8080,
            Some("shop/port"),
        ),
        (
            vec![pol(
                "shop",
                "port",
                "DENY",
                "[{to: [{operation: {notPorts: [\"80\"]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        // Fields of one entry are ANDed; entries and rules are ORed.
        (
            vec![pol(
                "shop",
                "and",
                allow,
                "[{from: [{source: {namespaces: [shop], ipBlocks: [10.0.9.0/24]}}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "or",
                allow,
                "[{from: [{source: {namespaces: [bank]}}, {source: {ipBlocks: [10.0.1.0/24]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "rules",
                allow,
                "[{to: [{operation: {ports: [\"1\"]}}]}, {from: [{source: {namespaces: [shop]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "fromto",
                allow,
                "[{from: [{source: {namespaces: [shop]}}], to: [{operation: {ports: [\"81\"]}}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        // when conditions on each layer-4 key, values and notValues.
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: source.ip, values: [10.0.1.0/24]}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: source.ip, notValues: [10.0.1.0/24]}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: source.namespace, values: [bank]}]}]",
            )],
            &other_ns,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: source.namespace, values: [bank]}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: source.principal, values: [\"*/sa/front\"]}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: source.principal, notValues: [\"*/sa/front\"]}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: destination.ip, values: [10.0.2.9]}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: destination.ip, values: [10.0.3.0/24]}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: destination.port, values: [\"80\"]}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "w",
                allow,
                "[{when: [{key: destination.port, values: [\"80\"], notValues: [\"80\"]}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        // Request attributes: never match in ALLOW; dropped (deny more) in DENY.
        (
            vec![pol(
                "shop",
                "l7",
                allow,
                "[{to: [{operation: {methods: [GET]}}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "l7",
                allow,
                "[{to: [{operation: {methods: [GET]}}, {operation: {ports: [\"80\"]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "l7",
                allow,
                "[{when: [{key: \"request.headers[x-user]\", values: [admin]}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "l7",
                allow,
                "[{from: [{source: {requestPrincipals: [\"*\"]}}]}]",
            )],
            &front,
            80,
            DENIED,
        ),
        (
            vec![pol(
                "shop",
                "l7",
                "DENY",
                "[{to: [{operation: {paths: [/admin]}}]}]",
            )],
            &front,
            80,
            Some("shop/l7"),
        ),
        (
            vec![pol(
                "shop",
                "l7",
                "DENY",
                "[{to: [{operation: {paths: [/admin], ports: [\"9\"]}}]}]",
            )],
            &front,
            80,
            None,
        ),
        (
            vec![pol(
                "shop",
                "l7",
                "DENY",
                "[{from: [{source: {requestPrincipals: [\"*\"]}}], when: [{key: \"request.auth.claims[iss]\", values: [x]}]}]",
            )],
            &front,
            80,
            Some("shop/l7"),
        ),
        // CUSTOM is enforced as DENY on its layer-4 parts.
        (
            vec![pol(
                "shop",
                "ext",
                "CUSTOM",
                "[{to: [{operation: {ports: [\"80\"]}}]}]",
            )],
            &front,
            80,
            Some("shop/ext"),
        ),
        (
            vec![pol(
                "shop",
                "ext",
                "CUSTOM",
                "[{to: [{operation: {ports: [\"80\"]}}]}]",
            )],
            &front,
            81,
            None,
        ),
        // DENY without rules matches nothing.
        (vec![pol("shop", "d", "DENY", "")], &front, 80, None),
        // Order: DENY wins over a matching ALLOW; AUDIT changes nothing.
        (
            vec![
                pol("shop", "a", allow, "[{}]"),
                pol(
                    "shop",
                    "d",
                    "DENY",
                    "[{from: [{source: {namespaces: [shop]}}]}]",
                ),
            ],
            &front,
            80,
            Some("shop/d"),
        ),
        (
            vec![pol("shop", "audit", "AUDIT", "[{}]")],
            &front,
            80,
            None,
        ),
        (
            vec![
                pol("shop", "audit", "AUDIT", "[{}]"),
                pol("shop", "nothing", allow, ""),
            ],
            &front,
            80,
            DENIED,
        ),
        // One of several ALLOW policies suffices.
        (
            vec![
                pol(
                    "shop",
                    "a1",
                    allow,
                    "[{from: [{source: {namespaces: [bank]}}]}]",
                ),
                pol(
                    "shop",
                    "a2",
                    allow,
                    "[{from: [{source: {namespaces: [shop]}}]}]",
                ),
            ],
            &front,
            80,
            None,
        ),
        // Scopes: another namespace's policy does not apply; the root namespace's does.
        (vec![pol("bank", "nothing", allow, "")], &front, 80, None),
        (
            vec![pol(
                ROOT,
                "mesh-deny",
                "DENY",
                "[{from: [{source: {namespaces: [bank]}}]}]",
            )],
            &other_ns,
            80,
            Some("istio-system/mesh-deny"),
        ),
        (
            vec![pol(ROOT, "mesh-nothing", allow, "")],
            &front,
            80,
            DENIED,
        ),
    ];
    for (i, (policies, client, port, want)) in cases.iter().enumerate() {
        let refs: Vec<&str> = policies.iter().map(String::as_str).collect();
        let got = decide(&set(&refs), client, *port);
        assert_eq!(got.as_deref(), *want, "case {i}: {policies:?}");
    }
}

#[test]
fn selectors() {
    let front = mtls("shop", "front", "10.0.1.5");
    let selected = |ns: &str, labels: &str| {
        format!(
            "metadata: {{name: sel, namespace: {ns}}}\nspec:\n  selector: {{matchLabels: {labels}}}\n"
        )
    };
    // Matching labels: the ALLOW-nothing policy applies.
    for (ns, labels, applies) in [
        ("shop", "{app: web}", true),
        ("shop", "{app: db}", false),
        ("shop", "{app: web, tier: x}", false),
        ("shop", "{}", true),
        ("bank", "{app: web}", false),
        (ROOT, "{app: web}", true),
        (ROOT, "{app: db}", false),
    ] {
        let got = decide(&set(&[&selected(ns, labels)]), &front, 80);
        assert_eq!(got.is_some(), applies, "{ns} {labels}");
    }
    // targetRef: attached elsewhere, applies to no workload.
    let targeted = "metadata: {name: t, namespace: shop}\nspec:\n  targetRefs: [{kind: Service, group: \"\", name: web}]\n";
    let p = compile(targeted).unwrap();
    assert_eq!(p.scope(ROOT), Scope::Targeted);
    assert_eq!(p.notes, [Note::Targeted]);
    assert!(p.notes[0].to_string().contains("targetRef"));
    assert_eq!(decide(&set(&[targeted]), &front, 80), None);
}

#[test]
fn notes_record_what_layer_4_cannot_enforce() {
    let p = compile(&pol(
        "shop",
        "l7",
        "ALLOW",
        "[{to: [{operation: {methods: [GET], paths: [/x]}}]}]",
    ))
    .unwrap();
    assert_eq!(
        p.notes,
        [Note::Unseen {
            at: "rules[0].to[0].operation".into(),
            fields: "methods, paths".into(),
            widened: false,
        }]
    );
    let note = p.notes[0].to_string();
    assert!(
        note.contains("rules[0].to[0].operation: methods, paths"),
        "{note}"
    );
    assert!(note.contains("never matches"), "{note}");
    let p = compile(&pol(
        "shop",
        "l7",
        "DENY",
        "[{when: [{key: \"request.headers[x]\", values: [y]}]}]",
    ))
    .unwrap();
    assert!(
        p.notes[0].to_string().contains("denies more"),
        "{:?}",
        p.notes
    );
    let p = compile(&pol(
        "shop",
        "ok",
        "ALLOW",
        "[{from: [{source: {namespaces: [a]}}]}]",
    ))
    .unwrap();
    assert!(p.notes.is_empty());
}

#[test]
fn malformed_policies_are_refused_with_the_field() {
    for (yaml, want) in [
        (pol("shop", "x", "PERMIT", ""), "spec.action \"PERMIT\""),
        (
            pol(
                "shop",
                "x",
                "ALLOW",
                "[{from: [{source: {ipBlocks: [10.0.0.300/8]}}]}]",
            ),
            "spec.rules[0].from[0].source.ipBlocks: \"10.0.0.300/8\" is not an IP address",
        ),
        (
            pol(
                "shop",
                "x",
                "ALLOW",
                "[{to: [{operation: {ports: [http]}}]}]",
            ),
            "spec.rules[0].to[0].operation.ports: \"http\" is not a port",
        ),
        (
            pol(
                "shop",
                "x",
                "ALLOW",
                "[{to: [{operation: {notPorts: [\"70000\"]}}]}]",
            ),
            "notPorts: \"70000\"",
        ),
        (
            pol("shop", "x", "ALLOW", "[{when: [{key: source.ip}]}]"),
            "neither values nor notValues",
        ),
        (
            pol(
                "shop",
                "x",
                "ALLOW",
                "[{when: [{key: destination.port, values: [x]}]}]",
            ),
            "spec.rules[0].when[0].values: \"x\" is not a port",
        ),
        (
            pol(
                "shop",
                "x",
                "ALLOW",
                "[{from: [{source: {serviceAccounts: [a/b/c]}}]}]",
            ),
            "not of the form [<namespace>/]<service account>",
        ),
        (
            "metadata: {namespace: shop}\nspec: {}\n".to_string(),
            "no metadata.name",
        ),
        // Blank or empty entries would otherwise match everything (ALLOW) or
        // nothing (DENY); Istio's validation refuses them too.
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  rules:\n  -\n".to_string(),
            "spec.rules[0] is empty",
        ),
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  rules:\n  - from:\n    - source:\n        # principals: [a]\n".to_string(),
            "spec.rules[0].from[0].source is missing",
        ),
        (pol("shop", "x", "ALLOW", "[{from: []}]"), "rules[0].from is an empty list"),
        (pol("shop", "x", "ALLOW", "[{to: []}]"), "rules[0].to is an empty list"),
        (pol("shop", "x", "ALLOW", "[{from: [{source: {}}]}]"), "rules[0].from[0].source has no fields"),
        (pol("shop", "x", "ALLOW", "[{from: [{source: {principals: }}]}]"), "source has no fields"),
        (pol("shop", "x", "ALLOW", "[{to: [{operation: {}}]}]"), "operation has no fields"),
        (pol("shop", "x", "ALLOW", "[{to: [{}]}]"), "rules[0].to[0].operation is missing"),
        (pol("shop", "x", "DENY", "[{from: [{source: {principals: [], namespaces: [shop]}}]}]"), "source.principals is an empty list"),
        (pol("shop", "x", "DENY", "[{from: [{source: {principals: [\"\"]}}]}]"), "source.principals[0] is empty"),
        (pol("shop", "x", "DENY", "[{from: [{source: {ipBlocks: []}}]}]"), "ipBlocks is an empty list"),
        (pol("shop", "x", "DENY", "[{to: [{operation: {ports: []}}]}]"), "ports is an empty list"),
        (pol("shop", "x", "DENY", "[{to: [{operation: {methods: []}}]}]"), "methods is an empty list"),
        (pol("shop", "x", "DENY", "[{when: [{key: source.ip, values: [], notValues: [1.2.3.4]}]}]"), "when[0].values is an empty list"),
        (pol("shop", "x", "DENY", "[{when: [{key: \"request.headers[a]\", values: []}]}]"), "when[0].values is an empty list"),
        (pol("shop", "x", "DENY", "[{from: [{source: {ipBlocks: [\"::ffff:10.1.2.3\"]}}]}]"), "IPv4-mapped"),
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  targetRef: {}\n".to_string(),
            "need a kind and a name",
        ),
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  selector: {matchLabels: {app: web}}\n  targetRefs: [{kind: Service, name: web}]\n".to_string(),
            "cannot both be set",
        ),
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  selector: {matchLabels: {\"bad key!\": web}}\n".to_string(),
            "spec.selector.matchLabels: the label key \"bad key!\" is not a valid label key",
        ),
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  selector: {matchLabels: {Example.com/app: web}}\n".to_string(),
            "is not a valid label key",
        ),
        (
            format!("metadata: {{name: x, namespace: shop}}\nspec:\n  selector: {{matchLabels: {{{}.example.com/app: web}}}}\n", "a".repeat(250)),
            "is not a valid label key",
        ),
        (
            "metadata: {name: x, namespace: shop}\nspec:\n  selector: {matchLabels: {app: \"-web\"}}\n".to_string(),
            "the value \"-web\" of label \"app\" is not a valid label value",
        ),
    ] {
        let err = compile(&yaml).unwrap_err();
        assert!(err.contains(want), "{yaml}: {err}");
    }
    // A misspelt field is refused, not ignored (ignoring it would widen the rule).
    let err = compile(&pol(
        "shop",
        "x",
        "ALLOW",
        "[{from: [{source: {principal: [a]}}]}]",
    ))
    .unwrap_err();
    assert!(err.contains("unknown field `principal`"), "{err}");
}

#[test]
fn compile_errors_name_the_policy_and_the_field() {
    let yaml = pol(
        "shop",
        "x",
        "ALLOW",
        "[{to: [{operation: {ports: [http]}}]}]",
    );
    let object: AuthorizationPolicy = serde_yaml_ng::from_str(&yaml).unwrap();
    let err = Policy::compile(&object).unwrap_err();
    assert_eq!(
        err,
        CompileError::Field {
            policy: "shop/x".into(),
            problem: FieldError::NotAPort {
                field: "spec.rules[0].to[0].operation.ports".into(),
                value: "http".into(),
            },
        }
    );
    assert_eq!(
        err.to_string(),
        "AuthorizationPolicy shop/x: spec.rules[0].to[0].operation.ports: \"http\" is not a port number (1-65535)"
    );
    let object: AuthorizationPolicy =
        serde_yaml_ng::from_str("metadata: {namespace: shop}\nspec: {}\n").unwrap();
    assert_eq!(Policy::compile(&object).unwrap_err(), CompileError::NoName);
}

#[test]
fn unknown_policies_deny_everything() {
    let mut policies = set(&[]);
    policies.deny_all_unknown("policies.yaml is broken".into());
    let got = decide(&policies, &mtls("shop", "front", "10.0.1.5"), 80);
    assert_eq!(got.as_deref(), Some("unknown-policies"));
}

#[test]
fn unknown_policies_of_a_namespace_deny_its_workloads_only() {
    let labels = BTreeMap::new();
    let client = mtls("shop", "front", "10.0.1.5");
    let request = Request {
        source_ip: client.ip.parse().unwrap(),
        source: client.id.as_ref(),
        destination_ip: "10.0.2.9".parse().unwrap(),
        destination_port: 80,
    };
    let req = |_: &Client| request;
    let mut policies = set(&[]);
    policies.deny_namespace_unknown("shop", "AuthorizationPolicy shop/x is refused".into());
    let denied = policies.evaluate("shop", &labels, &[], &req(&client));
    assert_eq!(
        denied.denied_by(),
        Some(&Denial::Unknown(
            "AuthorizationPolicy shop/x is refused".into()
        ))
    );
    assert_eq!(
        denied.denied_by().unwrap().to_string(),
        "authorization policies unknown: AuthorizationPolicy shop/x is refused"
    );
    assert!(
        policies
            .evaluate("bank", &labels, &[], &req(&client))
            .allowed()
    );
    assert_eq!(policies.unknown(), None);
    assert_eq!(policies.unknown_namespaces().len(), 1);
    // The root namespace's policies may apply anywhere.
    policies.deny_namespace_unknown(ROOT, "PeerAuthentication istio-system/m is refused".into());
    assert_eq!(
        policies.unknown_for("bank"),
        Some("PeerAuthentication istio-system/m is refused")
    );
    assert!(
        !policies
            .evaluate("bank", &labels, &[], &req(&client))
            .allowed()
    );
}

#[test]
fn duplicates_are_all_enforced() {
    let (set, warnings) = PolicySet::build(
        ROOT,
        [
            pol("shop", "a", "DENY", "[{}]"),
            pol("shop", "a", "ALLOW", "[{}]"),
        ]
        .iter()
        .map(|y| Arc::new(compile(y).unwrap())),
        [],
    );
    // Both are enforced: a second definition cannot cancel a DENY.
    assert_eq!(set.policies().count(), 2);
    assert_eq!(
        warnings,
        [SetWarning::Duplicate {
            policy: "shop/a".into()
        }]
    );
    assert!(
        warnings[0]
            .to_string()
            .contains("shop/a is defined more than once; every definition is enforced")
    );
    assert_eq!(
        decide(&set, &mtls("shop", "front", "10.0.1.5"), 80).as_deref(),
        Some("shop/a")
    );
}

#[test]
fn service_accounts_and_ipv6_blocks() {
    let front = mtls("shop", "front", "10.0.1.5");
    let other_ns = mtls("bank", "teller", "10.0.1.6");
    // A bare service account is in the policy's namespace.
    let bare = pol(
        "shop",
        "sa",
        "ALLOW",
        "[{from: [{source: {serviceAccounts: [front]}}]}]",
    );
    assert_eq!(decide(&set(&[&bare]), &front, 80), None);
    let bare = pol(
        "shop",
        "sa",
        "ALLOW",
        "[{from: [{source: {serviceAccounts: [teller]}}]}]",
    );
    assert_eq!(decide(&set(&[&bare]), &other_ns, 80).as_deref(), DENIED);
    // IPv6 blocks never match IPv4 traffic.
    let v6 = pol(
        "shop",
        "ip6",
        "ALLOW",
        "[{from: [{source: {ipBlocks: [\"::/0\"]}}]}]",
    );
    assert_eq!(decide(&set(&[&v6]), &front, 80).as_deref(), DENIED);
}

/// The syntax itself is tested in `k8s::names`; this checks what the refusal
/// names.
#[test]
fn label_problems_name_the_key_or_value() {
    assert_eq!(label_problem("app.kubernetes.io/name", "web-1.x_y"), None);
    assert_eq!(label_problem("app", ""), None);
    let key = label_problem("Example.com/app", "web").unwrap();
    assert_eq!(
        key,
        LabelProblem::Key {
            key: "Example.com/app".into()
        }
    );
    let key = key.to_string();
    assert!(key.contains("label key \"Example.com/app\""), "{key}");
    let value = label_problem("app", "web_").unwrap();
    assert_eq!(
        value,
        LabelProblem::Value {
            key: "app".into(),
            value: "web_".into()
        }
    );
    let value = value.to_string();
    assert!(value.contains("value \"web_\" of label \"app\""), "{value}");
}

#[test]
fn a_destination_not_enrolled_here_is_denied() {
    let policies = set(&[]);
    let id = SpiffeId::new("cluster.local", "shop", "front");
    let req = Request {
        source_ip: "10.0.1.5".parse().unwrap(),
        source: Some(&id),
        destination_ip: "10.0.2.9".parse().unwrap(),
        destination_port: 80,
    };
    assert_eq!(
        policies.decide(None, &req).into_result(),
        Err(Denial::Unknown(
            "10.0.2.9 is not an enrolled pod of this node".into()
        ))
    );
    let labels = BTreeMap::new();
    let shop = Destination {
        namespace: "shop",
        labels: &labels,
        named: &[],
    };
    assert_eq!(policies.decide(Some(shop), &req).into_result(), Ok(()));
}

#[test]
fn requests_are_described_for_the_logs() {
    let id = SpiffeId::new("cluster.local", "shop", "front");
    let mut req = Request {
        source_ip: "10.0.1.5".parse().unwrap(),
        source: Some(&id),
        destination_ip: "10.0.2.9".parse().unwrap(),
        destination_port: 80,
    };
    assert_eq!(
        req.describe(Some("shop/web")),
        "10.0.1.5 (spiffe://cluster.local/ns/shop/sa/front) to shop/web port 80"
    );
    req.source = None;
    assert_eq!(
        req.describe(None),
        "10.0.1.5 (plaintext) to 10.0.2.9 port 80"
    );
}

#[test]
fn denials_are_counted_by_policy() {
    let counts = DenialCounts::default();
    assert_eq!(counts.count(&Denial::Policy("shop/deny".into())), 1);
    assert_eq!(
        counts.count(&Denial::NoAllowMatch(vec!["shop/a".into()])),
        1
    );
    assert_eq!(counts.count(&Denial::Policy("shop/deny".into())), 2);
    assert_eq!(
        counts.by_policy(),
        [
            ("allow-policies".to_string(), 1),
            ("shop/deny".to_string(), 2)
        ]
    );
}
