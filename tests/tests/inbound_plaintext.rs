//! A pod outside the mesh talks to an enrolled pod, over IPv4 and over IPv6
//! (dual-stack pods): the connection is captured at the destination's host veth
//! into the plaintext listener and delivered with the client's address; on the
//! underlay it is plain, as it was sent.

use podlink_tests::{Cluster, Family, PodSpec, any_from, app, contains_bytes};

#[test]
fn plaintext_from_outside_the_mesh_is_captured_at_the_destination() {
    plaintext_inbound(Family::V4);
}

#[test]
fn ipv6_plaintext_from_outside_the_mesh_is_captured_at_the_destination() {
    plaintext_inbound(Family::V6);
}

fn plaintext_inbound(family: Family) {
    let mut c = Cluster::dual_stack(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("outsider", "legacy", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_captured(&server, true).unwrap();
    assert!(!c.is_captured(&client).unwrap());
    let dst = server.addr_of(family, 9000);
    let _echo = app::EchoServer::start(&server.netns, dst).unwrap();

    let capture = c.underlay_capture(0).unwrap();
    let payload = b"plain-payload-abcdef".repeat(100);
    let ex = app::exchange(&client.netns, dst, &payload)
        .unwrap_or_else(|e| panic!("{dst}: {e}\n{}", c.agent_logs()));
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
    assert_eq!(ex.echoed, payload);
    // Not in the mesh, so not encrypted: the capture sees the bytes, from the
    // client's own address.
    assert!(contains_bytes(&raw, b"plain-payload-abcdef"));
    assert!(any_from(&lines, client.ip_of(family)), "{lines:#?}");

    let counters = c.counters(&server).unwrap();
    assert!(counters["captured_inbound_plaintext"] >= 1, "{counters:?}");
    assert_eq!(counters["captured_inbound_hbone"], 0, "{counters:?}");
    assert!(c.counters(&client).unwrap().is_empty());
}
