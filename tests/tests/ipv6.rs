//! IPv6 and dual-stack pods: the dual-stack test bed carries IPv6 between pods;
//! a dual-stack Service is reached over its IPv6 ClusterIP; a node with IPv6 off
//! keeps working for IPv4; an IPv6 socket connecting to an IPv4-mapped address
//! is an IPv4 flow. The scenarios IPv4 has are tested for both families in their
//! own files (`cross_node.rs`, `same_node.rs`, `inbound_plaintext.rs`,
//! `outside_mesh.rs`, `fail_closed.rs`, `enrollment.rs`, and IPv6 `ipBlocks` in
//! `authorization.rs`).

use std::net::{IpAddr, SocketAddr, SocketAddrV6};

use podlink_tests::{Cluster, Family, Pod, PodSpec, Source, app, contains_bytes, syns_to};

/// The HBONE port.
const HBONE: u16 = 15008;

// ---- Helpers shared by both families ----

/// `ip.port` as tcpdump prints an endpoint (`10.244.2.2.15008`,
/// `fd00:10:244:2::2.15008`).
fn tcpdump_endpoint(ip: IpAddr, port: u16) -> String {
    format!("{ip}.{port}")
}

/// One exchange from `from` to `dst` that must succeed, echo the payload and show
/// the server `from`'s address of `dst`'s family; fails with the agents' logs.
fn exchange_keeping_address(c: &Cluster, from: &Pod, dst: SocketAddr, payload: &[u8]) {
    let family = family_of(dst);
    let ex = app::exchange(&from.netns, dst, payload)
        .unwrap_or_else(|e| panic!("{} -> {dst} failed: {e}\n{}", from.name, c.agent_logs()));
    assert_eq!(
        ex.peer_seen.ip(),
        from.ip_of(family),
        "{} -> {dst}",
        from.name
    );
    assert_eq!(ex.echoed, payload, "{} -> {dst}", from.name);
}

/// The family of `addr`.
fn family_of(addr: SocketAddr) -> Family {
    if addr.is_ipv4() {
        Family::V4
    } else {
        Family::V6
    }
}

/// A pod's counter `field` (0 when absent).
fn counter(c: &Cluster, pod: &Pod, field: &str) -> u64 {
    c.counters(pod).unwrap().get(field).copied().unwrap_or(0)
}

// ---- The test bed itself ----

/// The bed alone, no agent: pods on two nodes, and two on one node, talk IPv6
/// TCP to each other, and the server sees the client's IPv6 address; IPv4 works
/// beside it; `status.podIPs` lists both families.
#[test]
fn dual_stack_bed_carries_ipv6_between_pods() {
    let mut c = Cluster::dual_stack(2, &[("apps", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "apps", 0)).unwrap();
    let near = c.add_pod(PodSpec::new("near", "apps", 0)).unwrap();
    let far = c.add_pod(PodSpec::new("far", "apps", 1)).unwrap();
    for (pod, node) in [(&client, 0), (&near, 0), (&far, 1)] {
        let v6 = pod.ipv6.expect("a dual-stack pod has an IPv6 address");
        let net = c.nodes[node].pod_cidr6.unwrap().segments();
        assert_eq!(
            v6.segments()[..4],
            net[..4],
            "{v6} in node{}'s range",
            node + 1
        );
    }
    assert_eq!(c.nodes[1].ipv6, Some("fd00::2".parse().unwrap()));
    assert_eq!(
        c.nodes[0].pod_range6().as_deref(),
        Some("fd00:10:244:1::/64")
    );
    let manifest = std::fs::read_to_string(c.manifests.join("pod-apps-far.yaml")).unwrap();
    assert!(
        manifest.contains(&format!("- ip: \"{}\"", far.ip))
            && manifest.contains(&format!("- ip: \"{}\"", far.ipv6.unwrap())),
        "{manifest}"
    );

    let _far_echo = app::EchoServer::start(&far.netns, far.addr6(8080)).unwrap();
    let _near_echo = app::EchoServer::start(&near.netns, near.addr6(8080)).unwrap();
    let _far_echo4 = app::EchoServer::start(&far.netns, far.addr(8080)).unwrap();

    let capture = c.underlay_capture(0).unwrap();
    for i in 0..3 {
        let payload = format!("ipv6-payload-{i}-").repeat(300).into_bytes();
        exchange_keeping_address(&c, &client, far.addr6(8080), &payload);
        exchange_keeping_address(&c, &client, near.addr6(8080), &payload);
    }
    exchange_keeping_address(&c, &client, far.addr(8080), b"ipv4 beside");
    let (raw, lines) = capture.stop().unwrap();
    // Across nodes, IPv6 crosses the underlay as it was sent (no agent here).
    let to_far = format!("> {}:", tcpdump_endpoint(far.ip_of(Family::V6), 8080));
    assert!(lines.iter().any(|l| l.contains(&to_far)), "{lines:#?}");
    assert!(contains_bytes(&raw, b"ipv6-payload-"));

    // The API server double holds both addresses too, IPv4 first.
    let mut k = Cluster::dual_stack_from(1, &[("apps", false)], Source::Kubernetes).unwrap();
    let pod = k.add_pod(PodSpec::new("p", "apps", 0)).unwrap();
    let want: Vec<String> = pod.ips().iter().map(IpAddr::to_string).collect();
    for object in [
        k.api().unwrap().pod("apps", "p").unwrap(),
        podlink_tests::api_double::pod_object(&k, &pod),
    ] {
        let status = &object["status"];
        let listed: Vec<&str> = status["podIPs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|ip| ip["ip"].as_str())
            .collect();
        assert_eq!(listed, want, "{object:#}");
        assert_eq!(
            status["podIP"].as_str(),
            Some(want[0].as_str()),
            "{object:#}"
        );
    }
}

// ---- IPv6 Services, nodes without IPv6, IPv4-mapped addresses ----

/// A dual-stack Service: ClusterIPs of both families, one EndpointSlice per
/// family. An enrolled client reaches it over either, the endpoints over HBONE
/// (or directly on its own node), each with the client's address of that family.
#[test]
fn a_dual_stack_service_is_reached_over_its_ipv6_cluster_ip() {
    const VIP4: &str = "10.96.0.10:80";
    const VIP6: &str = "[fd00:10:96::10]:80";
    let mut c = Cluster::dual_stack(2, &[("shop", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "shop", 0)).unwrap();
    let far = c
        .add_pod(PodSpec::new("web-a", "shop", 1).label("app", "web"))
        .unwrap();
    let near = c
        .add_pod(PodSpec::new("web-b", "shop", 0).label("app", "web"))
        .unwrap();
    let slice = |family: &str, name: &str, ips: [IpAddr; 2]| {
        format!(
            "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: shop
  labels: {{kubernetes.io/service-name: web}}
addressType: {family}
ports:
- {{name: http, port: 8080, protocol: TCP}}
endpoints:
- addresses: [\"{}\"]
  conditions: {{ready: true, serving: true, terminating: false}}
- addresses: [\"{}\"]
  conditions: {{ready: true, serving: true, terminating: false}}
",
            ips[0], ips[1]
        )
    };
    c.write_manifest(
        "service-web.yaml",
        "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, \"fd00:10:96::10\"]
  ports:
  - {name: http, port: 80, targetPort: http}
",
    )
    .unwrap();
    c.write_manifest(
        "slice-web.yaml",
        &[
            slice(
                "IPv4",
                "web-v4",
                [far.ip_of(Family::V4), near.ip_of(Family::V4)],
            ),
            slice(
                "IPv6",
                "web-v6",
                [far.ip_of(Family::V6), near.ip_of(Family::V6)],
            ),
        ]
        .join("---\n"),
    )
    .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &far, &near]).unwrap();
    let servers6: Vec<app::EchoServer> = [&far, &near]
        .iter()
        .map(|p| app::EchoServer::start(&p.netns, p.addr6(8080)).unwrap())
        .collect();
    let servers4: Vec<app::EchoServer> = [&far, &near]
        .iter()
        .map(|p| app::EchoServer::start(&p.netns, p.addr(8080)).unwrap())
        .collect();

    let capture = c.underlay_capture(0).unwrap();
    for i in 0..20 {
        let payload = format!("service-payload-{i}-").repeat(20).into_bytes();
        exchange_keeping_address(&c, &client, VIP6.parse().unwrap(), &payload);
    }
    let (raw, lines) = capture.stop().unwrap();
    let counts: Vec<usize> = servers6.iter().map(app::EchoServer::accepted).collect();
    assert!(counts.iter().all(|&n| n > 0), "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), 20);
    assert!(
        servers4.iter().all(|s| s.accepted() == 0),
        "an IPv6 ClusterIP went to IPv4 endpoints"
    );
    assert!(
        !contains_bytes(&raw, b"service-payload"),
        "plaintext on the underlay"
    );
    assert!(
        syns_to(&lines, far.ip_of(Family::V6), HBONE) >= 1,
        "{lines:#?}"
    );
    assert!(counter(&c, &far, "captured_inbound_hbone") > 0);
    assert!(counter(&c, &client, "captured_outbound") >= 20);

    // The IPv4 ClusterIP of the same Service goes to the IPv4 endpoints.
    for _ in 0..4 {
        exchange_keeping_address(&c, &client, VIP4.parse().unwrap(), b"over ipv4");
    }
    assert_eq!(
        servers4
            .iter()
            .map(app::EchoServer::accepted)
            .sum::<usize>(),
        4
    );
    assert_eq!(
        servers6
            .iter()
            .map(app::EchoServer::accepted)
            .sum::<usize>(),
        20
    );
}

/// A node whose kernel has IPv6 off (`disable_ipv6=1` before the agent starts):
/// its agent starts, says once that IPv6 is off, and captures and tunnels IPv4
/// in both directions.
#[test]
fn a_node_with_ipv6_off_keeps_capturing_ipv4() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    c.disable_ipv6(0).unwrap();
    let here = c.add_pod(PodSpec::new("here", "mesh", 0)).unwrap();
    let there = c.add_pod(PodSpec::new("there", "mesh", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&here, &there]).unwrap();
    let _echo_there = app::EchoServer::start(&there.netns, there.addr(8080)).unwrap();
    let _echo_here = app::EchoServer::start(&here.netns, here.addr(8080)).unwrap();

    let capture = c.underlay_capture(0).unwrap();
    exchange_keeping_address(&c, &here, there.addr(8080), &b"out-of-v4-node".repeat(50));
    exchange_keeping_address(&c, &there, here.addr(8080), &b"into-v4-node".repeat(50));
    let (raw, lines) = capture.stop().unwrap();
    assert!(
        syns_to(&lines, IpAddr::V4(there.ip), HBONE) >= 1,
        "{lines:#?}"
    );
    assert!(
        syns_to(&lines, IpAddr::V4(here.ip), HBONE) >= 1,
        "{lines:#?}"
    );
    assert!(
        !contains_bytes(&raw, b"-v4-node"),
        "plaintext on the underlay"
    );
    assert_eq!(counter(&c, &here, "captured_outbound"), 1);
    assert!(counter(&c, &here, "captured_inbound_hbone") >= 1);

    // Said once, by that node only, even as more pods come.
    let later = c.add_pod(PodSpec::new("later", "mesh", 0)).unwrap();
    c.wait_all_captured(&[&later]).unwrap();
    exchange_keeping_address(&c, &later, there.addr(8080), b"later");
    assert_eq!(c.log_lines(0, &["IPv6 is off"]), 1, "{}", c.agent_log(0));
    assert_eq!(c.log_lines(1, &["IPv6 is off"]), 0, "{}", c.agent_log(1));
}

/// An IPv6 socket connecting to an IPv4-mapped address (`::ffff:10.244.2.2`)
/// sends IPv4: it is captured and tunnelled as the IPv4 flow, and the server
/// sees the client's IPv4 address.
#[test]
fn an_ipv4_mapped_destination_is_carried_as_ipv4() {
    let mut c = Cluster::dual_stack(2, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();

    let mapped = SocketAddr::V6(SocketAddrV6::new(server.ip.to_ipv6_mapped(), 8080, 0, 0));
    let capture = c.underlay_capture(0).unwrap();
    let payload = b"mapped-payload".repeat(100);
    let ex = app::exchange(&client.netns, mapped, &payload)
        .unwrap_or_else(|e| panic!("{mapped} failed: {e}\n{}", c.agent_logs()));
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert_eq!(ex.echoed, payload);
    assert_eq!(echo.accepted(), 1);
    assert!(
        syns_to(&lines, IpAddr::V4(server.ip), HBONE) >= 1,
        "{lines:#?}"
    );
    assert!(
        !contains_bytes(&raw, b"mapped-payload"),
        "plaintext on the underlay"
    );
    assert_eq!(counter(&c, &client, "captured_outbound"), 1);
    assert!(counter(&c, &server, "captured_inbound_hbone") >= 1);
}
