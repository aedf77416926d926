//! An enrolled pod talks to a destination outside the mesh, over IPv4 and over
//! IPv6 (dual-stack pods): captured, then sent as plain TCP from the pod's own
//! address; its own node too; and the node's own connections to the pod (kubelet
//! probes) are not captured.

use std::net::IpAddr;

use podlink_tests::{Cluster, Family, PodSpec, any_from, app, contains_bytes};

#[test]
fn outside_the_mesh_destinations_get_plain_tcp_from_the_pod_address() {
    outside_mesh(Family::V4);
}

#[test]
fn ipv6_outside_the_mesh_destinations_get_plain_tcp_from_the_pod_address() {
    outside_mesh(Family::V6);
}

fn outside_mesh(family: Family) {
    let mut c = Cluster::dual_stack(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("plain", "legacy", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_captured(&client, true).unwrap();
    let dst = server.addr_of(family, 5432);
    let _echo = app::EchoServer::start(&server.netns, dst).unwrap();
    let exchange = |from: &str, dst, payload: &[u8]| {
        let ex = app::exchange(from, dst, payload).unwrap_or_else(|e| {
            panic!(
                "-> {dst} failed: {e}\n{:?}\n{}",
                c.counters(&client).unwrap(),
                c.agent_log(0)
            )
        });
        assert_eq!(ex.echoed, payload);
        ex
    };

    let capture = c.underlay_capture(0).unwrap();
    let payload = b"to-the-outside".repeat(100);
    let ex = exchange(&client.netns, dst, &payload);
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
    assert!(contains_bytes(&raw, b"to-the-outside"));
    assert!(!lines.iter().any(|l| l.contains(".15008")), "{lines:#?}");
    assert!(any_from(&lines, client.ip_of(family)), "{lines:#?}");
    let counters = c.counters(&client).unwrap();
    assert!(counters["captured_outbound"] >= 1, "{counters:?}");

    // The pod's own node is outside the mesh too (kubelet, node-local services):
    // the node's replies to the proxy's connection come back through the pod's
    // host veth and must reach the proxy, not the pod.
    let node_ip = match family {
        Family::V4 => IpAddr::V4(c.nodes[0].ip),
        Family::V6 => IpAddr::V6(c.nodes[0].ipv6.unwrap()),
    };
    let node_server = app::EchoServer::start(&c.nodes[0].netns, (node_ip, 7777).into()).unwrap();
    let ex = exchange(&client.netns, node_server.addr, b"hello node");
    assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
    c.wait_log(0, &["route=passthrough"]).unwrap();

    // The node to the enrolled pod (a kubelet probe): from one of the node's own
    // addresses, so not captured.
    let probed = app::EchoServer::start(&client.netns, client.addr_of(family, 8081)).unwrap();
    let before = c.counters(&client).unwrap()["captured_inbound_plaintext"];
    let ex = exchange(&c.nodes[0].netns, client.addr_of(family, 8081), b"probe");
    assert_eq!(probed.accepted(), 1);
    assert_eq!(
        c.counters(&client).unwrap()["captured_inbound_plaintext"],
        before,
        "a probe from the node's address {} was captured",
        ex.peer_seen.ip()
    );
}
