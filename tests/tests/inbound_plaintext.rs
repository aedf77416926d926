//! A pod outside the mesh talks to an enrolled pod: the connection is captured at
//! the destination's host veth into the plaintext listener and delivered with the
//! client's address; on the underlay it is plain, as it was sent.

use std::net::IpAddr;

use podlink_tests::{Capture, Cluster, PodSpec, app, contains_bytes};

#[test]
fn plaintext_from_outside_the_mesh_is_captured_at_the_destination() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("outsider", "legacy", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_captured(&server, true).unwrap();
    assert!(!c.is_captured(&client).unwrap());
    let _echo = app::EchoServer::start(&server.netns, server.addr(9000)).unwrap();

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    let payload = b"plain-payload-abcdef".repeat(100);
    let ex = app::exchange(&client.netns, server.addr(9000), &payload).unwrap();
    let (raw, _) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert_eq!(ex.echoed, payload);
    // Not in the mesh, so not encrypted: the capture sees the bytes.
    assert!(contains_bytes(&raw, b"plain-payload-abcdef"));

    let counters = c.counters(&server).unwrap();
    assert!(counters["captured_inbound_plaintext"] >= 1, "{counters:?}");
    assert_eq!(counters["captured_inbound_hbone"], 0, "{counters:?}");
    assert!(c.counters(&client).unwrap().is_empty());
}
