//! Istio AuthorizationPolicy between pods of the test bed: ALLOW, DENY and AUDIT
//! policies written to the manifests directory are enforced on inbound HBONE
//! (401), inbound plaintext (reset) and connections between pods of one node;
//! open connections are closed when a policy comes to deny them; a broken policy
//! file denies everything until it is fixed; `ipBlocks` with IPv6 prefixes
//! match IPv6 sources only.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use http::StatusCode;
use podlink_agent::identity::SpiffeId;
use podlink_tests::{Cluster, Family, Pod, PodSpec, Source, app};

mod common;
use common::{attempt, credentials};

/// Whether one exchange from `from` to `dst` goes through and is echoed.
fn allowed(from: &Pod, dst: SocketAddr) -> bool {
    let payload = format!("hello from {}", from.name).into_bytes();
    app::exchange(&from.netns, dst, &payload).is_ok_and(|ex| ex.echoed == payload)
}

/// Waits until `from` → `dst` is `allowed` (the agents apply a changed manifest
/// within a fraction of a second); fails with both agents' logs otherwise.
fn wait_until(c: &Cluster, from: &Pod, dst: SocketAddr, want: bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while allowed(from, dst) != want {
        assert!(
            Instant::now() < deadline,
            "{} -> {dst} never became {}\nnode1:\n{}\nnode2:\n{}",
            from.name,
            if want { "allowed" } else { "denied" },
            c.agent_log(0),
            c.agent_log(1)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Denials are logged at a bounded rate: makes denied attempts from `from` to
/// `dst` until node 2's agent has logged `needle`.
fn wait_denial_logged(c: &Cluster, from: &Pod, dst: SocketAddr, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.agent_log(1).contains(needle) {
        assert!(!allowed(from, dst), "{} -> {dst} is allowed", from.name);
        assert!(
            Instant::now() < deadline,
            "{needle:?} never logged:\n{}",
            c.agent_log(1)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn check(c: &Cluster, cases: &[(&Pod, SocketAddr, bool)]) {
    for (from, dst, want) in cases {
        assert_eq!(
            allowed(from, *dst),
            *want,
            "{} -> {dst}\nnode2:\n{}",
            from.name,
            c.agent_log(1)
        );
    }
}

const WEB_ALLOW: &str = "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: web-allow, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  action: ALLOW
  rules:
  - from: [{source: {namespaces: [shop]}}]
    to: [{operation: {ports: [\"8080\"]}}]
  - from: [{source: {namespaces: [bank]}}]
    to: [{operation: {methods: [GET]}}]
";

const DENY_FRONT: &str = "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-front, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {principals: [cluster.local/ns/shop/sa/front]}}]}]
";

const AUDIT: &str = "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: audit-shop, namespace: shop}
spec:
  action: AUDIT
  rules: [{from: [{source: {namespaces: [shop]}}]}]
";

const REQUIRE_MTLS: &str = "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: require-mtls, namespace: istio-system}
spec:
  action: DENY
  rules: [{from: [{source: {notPrincipals: [\"*\"]}}]}]
";

/// The pods of namespace `shop` the policies are about: `web` (`app: web`) and
/// `near` on node 2, `front` on node 1, each with a service account of its name.
fn shop_pods(c: &mut Cluster) -> [Pod; 3] {
    let web = PodSpec::new("web", "shop", 1)
        .service_account("web")
        .label("app", "web");
    let near = PodSpec::new("near", "shop", 1).service_account("near");
    let front = PodSpec::new("front", "shop", 0).service_account("front");
    [web, near, front].map(|spec| c.add_pod(spec).unwrap())
}

#[test]
fn allow_deny_and_audit_policies_between_pods() {
    policies_between_pods(Source::Manifests);
}

#[test]
fn allow_deny_and_audit_policies_from_the_kubernetes_api() {
    policies_between_pods(Source::Kubernetes);
}

fn policies_between_pods(source: Source) {
    let mut c = Cluster::with_namespaces_from(
        2,
        &[("shop", true), ("bank", true), ("outside", false)],
        source,
    )
    .unwrap();
    let [web, near, front] = shop_pods(&mut c);
    let teller = c
        .add_pod(PodSpec::new("teller", "bank", 0).service_account("teller"))
        .unwrap();
    let plain = c.add_pod(PodSpec::new("plain", "outside", 0)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&web, &near, &front, &teller])
        .unwrap();
    let _http = app::EchoServer::start(&web.netns, web.addr(8080)).unwrap();
    let _admin = app::EchoServer::start(&web.netns, web.addr(9090)).unwrap();
    let (http, admin) = (web.addr(8080), web.addr(9090));

    // No policy: everyone gets through.
    check(
        &c,
        &[
            (&front, http, true),
            (&teller, http, true),
            (&plain, http, true),
            (&near, http, true),
        ],
    );

    // ALLOW from namespace shop to port 8080; the rule for bank needs a method,
    // which a layer-4 proxy cannot see, so it never matches.
    c.write_manifest("policy-web-allow.yaml", WEB_ALLOW)
        .unwrap();
    wait_until(&c, &teller, http, false);
    check(
        &c,
        &[
            (&front, http, true),
            (&front, admin, false),
            // Between pods of one node, with no HBONE hop.
            (&near, http, true),
            (&near, admin, false),
            // Plaintext has no namespace.
            (&plain, http, false),
        ],
    );
    wait_denial_logged(
        &c,
        &teller,
        http,
        "denied: no ALLOW policy matched (policies shop/web-allow)",
    );
    // The config dump shows the policy, its scope, what layer 4 cannot enforce,
    // and the denials counted.
    let dump = c.config_dump(1).unwrap();
    let policy = &dump["policies"]["items"][0];
    assert_eq!(policy["name"], "web-allow", "{dump:#}");
    assert_eq!(policy["action"], "ALLOW");
    assert_eq!(policy["scope"]["selector"]["namespace"], "shop", "{dump:#}");
    assert_eq!(
        policy["scope"]["selector"]["labels"]["app"], "web",
        "{dump:#}"
    );
    let notes = policy["notes"].as_array().unwrap();
    assert!(
        notes.len() == 1
            && notes[0]
                .as_str()
                .unwrap()
                .contains("methods cannot be seen"),
        "{dump:#}"
    );
    assert!(
        dump["denials"]["allow-policies"].as_u64().unwrap() >= 1,
        "{dump:#}"
    );
    let web_entry = dump["workloads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == "web")
        .unwrap();
    assert_eq!(web_entry["captured"], true, "{dump:#}");
    let cert = dump["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["identity"] == "spiffe://cluster.local/ns/shop/sa/web")
        .unwrap_or_else(|| panic!("{dump:#}"));
    assert_eq!(cert["state"], "issued", "{dump:#}");
    assert!(cert["not_after"].as_str().unwrap() > cert["renew_at"].as_str().unwrap());
    assert_eq!(c.admin_get(1, "/nothing").unwrap().0, 404);
    // A denied HBONE stream gets 401, an allowed one 200 (a client speaking HBONE
    // itself, from outside the mesh, with a shop and a bank identity).
    let rt = tokio::runtime::Runtime::new().unwrap();
    let web_id = SpiffeId::new("cluster.local", "shop", "web");
    for (ns, sa, want) in [
        ("bank", "teller", StatusCode::UNAUTHORIZED),
        ("shop", "front", StatusCode::OK),
    ] {
        let (key, roots) = credentials(&c.ca_dir, &SpiffeId::new("cluster.local", ns, sa));
        let status = rt
            .block_on(attempt(
                &plain.netns,
                web.addr(15008),
                key,
                roots,
                web_id.clone(),
                http,
            ))
            .unwrap();
        assert_eq!(status, want, "{ns}/{sa}");
    }

    // DENY wins over ALLOW, and closes the open connections it denies.
    let mut open = app::connect(&front.netns, http, Duration::from_secs(5)).unwrap();
    app::read_greeting(&open).unwrap();
    assert_eq!(app::echo_round(&mut open, b"before").unwrap(), b"before");
    c.write_manifest("policy-deny-front.yaml", DENY_FRONT)
        .unwrap();
    wait_until(&c, &front, http, false);
    assert!(
        app::echo_round(&mut open, b"after").is_err(),
        "a connection the policy now denies stays open"
    );
    check(&c, &[(&near, http, true)]);
    wait_denial_logged(&c, &front, http, "denied: denied by policy shop/deny-front");
    let log = c.agent_log(1);
    assert!(
        log.contains("inbound HBONE stream failed: closed: denied by policy shop/deny-front"),
        "{log}"
    );

    // AUDIT reports and changes nothing.
    c.write_manifest("policy-audit.yaml", AUDIT).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c
        .agent_log(1)
        .lines()
        .any(|l| l.contains("AUDIT policy matched") && l.contains("shop/audit-shop"))
    {
        assert!(allowed(&near, http), "AUDIT changed an outcome");
        assert!(Instant::now() < deadline, "{}", c.agent_log(1));
        std::thread::sleep(Duration::from_millis(100));
    }

    // Mesh-wide (root namespace): refuse plaintext, allow any mTLS client.
    for file in [
        "policy-web-allow.yaml",
        "policy-deny-front.yaml",
        "policy-audit.yaml",
    ] {
        c.remove_manifest(file).unwrap();
    }
    c.write_manifest("policy-require-mtls.yaml", REQUIRE_MTLS)
        .unwrap();
    wait_until(&c, &front, http, true);
    wait_until(&c, &plain, http, false);
    check(&c, &[(&teller, admin, true), (&near, admin, true)]);

    // The note about the unenforceable method rule was logged once.
    let log = c.agent_log(1);
    let notes = log
        .matches("rules[1].to[0].operation: methods cannot be seen by a layer-4 proxy")
        .count();
    assert_eq!(notes, 1, "{log}");

    // A policy file broken from the start: its policies are unknown, so nothing
    // is allowed until it is fixed.
    c.write_manifest(
        "policy-broken.yaml",
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: x, namespace: shop}\nspec: {action: ALLOWW}\n",
    )
    .unwrap();
    wait_until(&c, &front, http, false);
    wait_denial_logged(&c, &front, http, "denied: authorization policies unknown");
    let log = c.agent_log(1);
    assert!(log.contains("spec.action \"ALLOWW\""), "{log}");
    // The agent stays ready: its lists are done, one policy is broken.
    assert_eq!(c.readiness(1).unwrap(), 200, "{log}");
    c.remove_manifest("policy-broken.yaml").unwrap();
    wait_until(&c, &front, http, true);
    c.wait_log(1, &["authorization policies are known again"])
        .unwrap();
}

const MESH_STRICT: &str = "apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: istio-system}
spec: {mtls: {mode: STRICT}}
";

const SHOP_STRICT: &str = "apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: shop}
spec: {mtls: {mode: STRICT}}
";

const WEB_ADMIN_PERMISSIVE: &str = "apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web-admin, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: UNSET}
  portLevelMtls: {\"9090\": {mode: PERMISSIVE}}
";

const WEB_DISABLE: &str = "apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web-disable, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: DISABLE}
";

const WEB_STRICT: &str = "apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web-strict, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: STRICT}
";

#[test]
fn peer_authentication_strict_refuses_plaintext() {
    peer_authentication(Source::Manifests);
}

#[test]
fn peer_authentication_from_the_kubernetes_api() {
    peer_authentication(Source::Kubernetes);
}

/// PeerAuthentication STRICT at the mesh, namespace and workload levels
/// refuses a plaintext client from outside the mesh (the 15006 path) while an
/// enrolled client still connects over HBONE; port-level PERMISSIVE inside a
/// STRICT namespace lets plaintext reach that port, and workload-level DISABLE
/// every port of the workload; removal restores plaintext.
fn peer_authentication(source: Source) {
    let mut c =
        Cluster::with_namespaces_from(2, &[("shop", true), ("outside", false)], source).unwrap();
    let web = c
        .add_pod(
            PodSpec::new("web", "shop", 1)
                .service_account("web")
                .label("app", "web"),
        )
        .unwrap();
    let other = c
        .add_pod(PodSpec::new("other", "shop", 1).service_account("other"))
        .unwrap();
    let front = c
        .add_pod(PodSpec::new("front", "shop", 0).service_account("front"))
        .unwrap();
    let plain = c.add_pod(PodSpec::new("plain", "outside", 0)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&web, &other, &front]).unwrap();
    let _http = app::EchoServer::start(&web.netns, web.addr(8080)).unwrap();
    let _admin = app::EchoServer::start(&web.netns, web.addr(9090)).unwrap();
    let _other = app::EchoServer::start(&other.netns, other.addr(8080)).unwrap();
    let (http, admin, other_http) = (web.addr(8080), web.addr(9090), other.addr(8080));
    check(&c, &[(&plain, http, true), (&plain, other_http, true)]);

    // Mesh-wide STRICT: plaintext is refused everywhere, HBONE goes on.
    c.write_manifest("pa-mesh.yaml", MESH_STRICT).unwrap();
    wait_until(&c, &plain, http, false);
    check(
        &c,
        &[
            (&plain, other_http, false),
            (&front, http, true),
            (&front, other_http, true),
        ],
    );
    wait_denial_logged(&c, &plain, http, "istio-system/default");
    let log = c.agent_log(1);
    assert!(
        log.lines()
            .any(|l| l.contains("access: connection complete")
                && l.contains("route=inbound_plaintext")
                && l.contains("result=denied")
                && l.contains("policy=\"istio-system/default\"")),
        "{log}"
    );
    let denials = c.metrics(1).unwrap();
    assert!(
        denials.sum(
            "podlink_authorization_denials_total",
            &[("policy", "istio-system/default")]
        ) > 0.0,
        "{}",
        denials.text
    );
    c.remove_manifest("pa-mesh.yaml").unwrap();
    wait_until(&c, &plain, http, true);

    // Namespace STRICT, with port 9090 of web PERMISSIVE.
    c.write_manifest("pa-shop.yaml", SHOP_STRICT).unwrap();
    c.write_manifest("pa-web-admin.yaml", WEB_ADMIN_PERMISSIVE)
        .unwrap();
    wait_until(&c, &plain, http, false);
    wait_until(&c, &plain, admin, true);
    check(&c, &[(&plain, other_http, false), (&front, http, true)]);
    wait_denial_logged(&c, &plain, http, "shop/default");

    // Workload DISABLE inside the STRICT namespace: web takes plaintext on
    // every port, the namespace's other pods still refuse it.
    c.remove_manifest("pa-web-admin.yaml").unwrap();
    c.write_manifest("pa-web-disable.yaml", WEB_DISABLE)
        .unwrap();
    wait_until(&c, &plain, http, true);
    check(
        &c,
        &[
            (&plain, admin, true),
            (&plain, other_http, false),
            (&front, http, true),
        ],
    );

    // Workload STRICT in a namespace that is not: only web is refused.
    c.remove_manifest("pa-shop.yaml").unwrap();
    c.remove_manifest("pa-web-disable.yaml").unwrap();
    c.write_manifest("pa-web.yaml", WEB_STRICT).unwrap();
    wait_until(&c, &plain, other_http, true);
    wait_until(&c, &plain, admin, false);
    check(&c, &[(&plain, http, false), (&front, admin, true)]);

    // Removed: plaintext again.
    c.remove_manifest("pa-web.yaml").unwrap();
    wait_until(&c, &plain, http, true);
    check(&c, &[(&plain, admin, true), (&front, http, true)]);
}

/// With the Kubernetes API: Istio's CRDs missing at start are not fatal (the
/// agent is ready, nothing is denied, each 404 is logged once), and
/// installing them later takes effect without a restart. Until the policies
/// have been listed once, the agent is not ready and inbound connections are
/// denied; until the EndpointSlices and the Nodes have, it is not ready. With
/// the Istio kinds served under `v1beta1` only, policies are enforced.
#[test]
fn istio_crds_missing_then_installed() {
    let mut c = Cluster::with_namespaces_from(2, &[("shop", true)], Source::Kubernetes).unwrap();
    let web = c
        .add_pod(PodSpec::new("web", "shop", 1).label("app", "web"))
        .unwrap();
    let front = c
        .add_pod(PodSpec::new("front", "shop", 0).service_account("front"))
        .unwrap();
    c.api().unwrap().set_istio_crds_installed(false);
    c.start_agents().unwrap();
    c.wait_all_captured(&[&web, &front]).unwrap();
    let _http = app::EchoServer::start(&web.netns, web.addr(8080)).unwrap();
    let http = web.addr(8080);
    wait_until(&c, &front, http, true);
    assert_eq!(c.readiness(1).unwrap(), 200, "{}", c.agent_log(1));
    // Past a retry of the lists: each missing resource was logged once.
    std::thread::sleep(Duration::from_secs(11));
    let log = c.agent_log(1);
    let missing: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("does not serve"))
        .map(|l| l.split_once("Z ").map_or(l, |(_, rest)| rest))
        .collect();
    assert!(!missing.is_empty(), "{log}");
    let mut distinct = missing.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), missing.len(), "{missing:#?}");
    assert!(
        missing.iter().any(|l| l.contains("authorizationpolicies"))
            && missing.iter().any(|l| l.contains("peerauthentications")),
        "{missing:#?}"
    );

    // Installed later: a DENY policy is enforced without a restart.
    c.api().unwrap().set_istio_crds_installed(true);
    c.write_manifest("policy-deny-front.yaml", DENY_FRONT)
        .unwrap();
    wait_until(&c, &front, http, false);
    c.wait_log(1, &["serves", "now"]).unwrap();
    // Edited into a policy that cannot be compiled: the last good version
    // stays in force, and the agent says so.
    let before = c.agent_log(1).len();
    c.write_manifest(
        "policy-deny-front.yaml",
        &DENY_FRONT.replace("action: DENY", "action: DENYY"),
    )
    .unwrap();
    c.wait_log(1, &["the previous one stays in force"]).unwrap();
    check(&c, &[(&front, http, false)]);
    let log = c.agent_log(1);
    assert!(
        !log[before..].contains("authorization policies unknown"),
        "{log}"
    );
    c.remove_manifest("policy-deny-front.yaml").unwrap();
    wait_until(&c, &front, http, true);

    // A restarted agent whose first lists of the policies, the EndpointSlices
    // and the Nodes fail serves with what it has, but is not ready until
    // every one has listed once; while the policies are not listed, it
    // denies inbound connections. The API serves the Istio kinds under
    // v1beta1 only, as Istio releases before 1.22 do.
    c.write_manifest(
        "service-web.yaml",
        &WEB_SERVICE.replace("WEB", &web.ip.to_string()),
    )
    .unwrap();
    c.api().unwrap().serve_istio_versions(&["v1beta1"]);
    for resource in ["authorizationpolicies", "endpointslices", "nodes"] {
        c.api().unwrap().fail(resource, 500);
    }
    let unlisted = ["has not listed everything the agent watches", "\"nodes\""];
    let warned = c.log_lines(1, &unlisted);
    let before = c.agent_log(1).len();
    c.stop_agent(1).unwrap();
    c.start_agent(1).unwrap();
    c.wait_log_lines(1, &unlisted, warned + 1, Duration::from_secs(30))
        .unwrap();
    wait_until(&c, &front, http, false);
    assert_eq!(c.readiness(1).unwrap(), 503, "{}", c.agent_log(1));
    c.api().unwrap().heal("authorizationpolicies");
    c.api().unwrap().heal("endpointslices");
    wait_until(&c, &front, http, true);
    // The EndpointSlices are in (node 2 knows web's endpoint): the Nodes
    // alone keep the agent not ready.
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.service_endpoints(1, "shop", "web") != 1 {
        assert!(Instant::now() < deadline, "{}", c.agent_log(1));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(c.readiness(1).unwrap(), 503, "{}", c.agent_log(1));
    c.api().unwrap().heal("nodes");
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.readiness(1).unwrap() != 200 {
        assert!(Instant::now() < deadline, "{}", c.agent_log(1));
        std::thread::sleep(Duration::from_millis(100));
    }
    c.wait_log(1, &["authorization policies are known"])
        .unwrap();
    // The policies come from v1beta1, v1 being not served: a DENY policy is
    // enforced.
    let log = c.agent_log(1);
    assert!(
        log[before..].contains("does not serve authorizationpolicies.security.istio.io/v1 "),
        "{log}"
    );
    c.write_manifest("policy-deny-front.yaml", DENY_FRONT)
        .unwrap();
    wait_until(&c, &front, http, false);
    c.remove_manifest("policy-deny-front.yaml").unwrap();
    wait_until(&c, &front, http, true);
}

/// Service `web` of namespace `shop` (10.96.0.40) with the one endpoint `WEB`.
const WEB_SERVICE: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.40
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [\"WEB\"]}]
";

/// An AuthorizationPolicy of `action` for `app: web` in `shop` whose one rule
/// matches sources in `blocks`.
fn ip_block_policy(action: &str, blocks: &[String]) -> String {
    let blocks: Vec<String> = blocks.iter().map(|b| format!("\"{b}\"")).collect();
    format!(
        "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: by-address, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: web}}}}
  action: {action}
  rules: [{{from: [{{source: {{ipBlocks: [{}]}}}}]}}]
",
        blocks.join(", ")
    )
}

/// `ipBlocks` with IPv6 CIDRs and addresses match the IPv6 source a client
/// connects from (over HBONE and between pods of one node), and never its IPv4
/// address.
#[test]
fn policies_match_ipv6_ip_blocks() {
    let mut c = Cluster::dual_stack(2, &[("shop", true)]).unwrap();
    let [web, near, front] = shop_pods(&mut c);
    c.start_agents().unwrap();
    c.wait_all_captured(&[&web, &near, &front]).unwrap();
    let (web4, web6) = (web.addr(8080), web.addr6(8080));
    let _echo4 = app::EchoServer::start(&web.netns, web4).unwrap();
    let _echo6 = app::EchoServer::start(&web.netns, web6).unwrap();
    // front's node's IPv6 pod range, e.g. fd00:10:244:1::/64.
    let front_range = c.nodes[0].pod_range6().unwrap();

    check(
        &c,
        &[
            (&front, web6, true),
            (&front, web4, true),
            (&near, web6, true),
        ],
    );

    // DENY front's IPv6 range: its IPv6 connections only.
    c.write_manifest(
        "policy-by-address.yaml",
        &ip_block_policy("DENY", std::slice::from_ref(&front_range)),
    )
    .unwrap();
    wait_until(&c, &front, web6, false);
    check(&c, &[(&front, web4, true), (&near, web6, true)]);

    // ALLOW that range and near's one IPv6 address: nothing else.
    let near6 = near.ip_of(Family::V6).to_string();
    c.write_manifest(
        "policy-by-address.yaml",
        &ip_block_policy("ALLOW", &[front_range, near6]),
    )
    .unwrap();
    wait_until(&c, &front, web6, true);
    check(
        &c,
        &[
            (&front, web4, false),
            (&near, web6, true),
            (&near, web4, false),
        ],
    );
}
