//! IPv6 and dual-stack pods: the dual-stack test bed carries IPv6 between pods,
//! and enrolled pods' IPv6 TCP is captured, carried over HBONE (to the
//! destination pod's `[ipv6]:15008`) and delivered with the client's IPv6
//! address, as IPv4 is (cross_node.rs, same_node.rs, inbound_plaintext.rs,
//! outside_mesh.rs, fail_closed.rs, enrollment.rs, authorization.rs,
//! services.rs); a node with IPv6 off keeps working for IPv4, and an IPv6
//! socket connecting to an IPv4-mapped address is an IPv4 flow.

use std::net::{IpAddr, SocketAddr};

use podlink_tests::{Capture, Cluster, Family, Pod, PodSpec, app, contains_bytes};

/// `ip.port` as tcpdump prints an endpoint (`10.244.2.2.15008`,
/// `fd00:10:244:2::2.15008`).
fn tcpdump_endpoint(ip: IpAddr, port: u16) -> String {
    format!("{ip}.{port}")
}

/// One exchange from `from` to `dst` that must succeed, echo the payload and show
/// the server `from`'s address of `dst`'s family; fails with the agents' logs.
fn exchange_keeping_address(c: &Cluster, from: &Pod, dst: SocketAddr, payload: &[u8]) {
    let family = if dst.is_ipv4() { Family::V4 } else { Family::V6 };
    let ex = app::exchange(&from.netns, dst, payload).unwrap_or_else(|e| {
        panic!(
            "{} -> {dst} failed: {e}\n{}",
            from.name,
            agent_logs(c)
        )
    });
    assert_eq!(ex.peer_seen.ip(), from.ip_of(family), "{} -> {dst}", from.name);
    assert_eq!(ex.echoed, payload, "{} -> {dst}", from.name);
}

/// Every node agent's log, for failure messages.
fn agent_logs(c: &Cluster) -> String {
    (0..c.nodes.len())
        .map(|n| format!("node{}:\n{}", n + 1, c.agent_log(n)))
        .collect::<Vec<_>>()
        .join("\n")
}

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
        assert_eq!(v6.segments()[..4], net[..4], "{v6} in node{}'s range", node + 1);
    }
    assert_eq!(c.nodes[1].ipv6, Some("fd00::2".parse().unwrap()));
    assert_eq!(
        c.nodes[0].pod_range6().as_deref(),
        Some("fd00:10:244:1::/64")
    );
    let manifest =
        std::fs::read_to_string(c.manifests.join("pod-apps-far.yaml")).unwrap();
    assert!(
        manifest.contains(&format!("- ip: \"{}\"", far.ip))
            && manifest.contains(&format!("- ip: \"{}\"", far.ipv6.unwrap())),
        "{manifest}"
    );

    let _far_echo = app::EchoServer::start(&far.netns, far.addr6(8080)).unwrap();
    let _near_echo = app::EchoServer::start(&near.netns, near.addr6(8080)).unwrap();
    let _far_echo4 = app::EchoServer::start(&far.netns, far.addr(8080)).unwrap();

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
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
}
