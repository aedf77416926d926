//! An enrolled pod talks to a destination outside the mesh: captured, then sent as
//! plain TCP from the pod's own address.

use std::net::IpAddr;

use podlink_tests::{Capture, Cluster, PodSpec, app, contains_bytes};

#[test]
fn outside_the_mesh_destinations_get_plain_tcp_from_the_pod_address() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("plain", "legacy", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_captured(&client, true).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(5432)).unwrap();

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    let payload = b"to-the-outside".repeat(100);
    let ex = app::exchange(&client.netns, server.addr(5432), &payload).unwrap();
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert_eq!(ex.echoed, payload);
    assert!(contains_bytes(&raw, b"to-the-outside"));
    assert!(!lines.iter().any(|l| l.contains(".15008")), "{lines:#?}");

    let counters = c.counters(&client).unwrap();
    assert!(counters["captured_outbound"] >= 1, "{counters:?}");

    // The pod's own node is outside the mesh too (kubelet, node-local services):
    // the node's replies to the proxy's connection come back through the pod's
    // host veth and must reach the proxy, not the pod.
    let node_server =
        app::EchoServer::start(&c.nodes[0].netns, (c.nodes[0].ip, 7777).into()).unwrap();
    let ex = app::exchange(&client.netns, node_server.addr, b"hello node").unwrap_or_else(|e| {
        panic!(
            "pod -> node failed: {e}\n{:?}\n{}",
            c.counters(&client).unwrap(),
            c.agent_log(0)
        )
    });
    assert_eq!(ex.echoed, b"hello node");
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    c.wait_log(0, &["route=passthrough"]).unwrap();
}
