//! Two enrolled pods on one node, over IPv4 and over IPv6 (dual-stack pods): the
//! proxy connects them directly (no TLS hop), with the client's address, and the
//! destination's programs let the proxy's marked connection through.

use podlink_tests::{Cluster, Family, PodSpec, app};

#[test]
fn same_node_traffic_goes_through_the_proxy_without_a_tunnel() {
    same_node(Family::V4);
}

#[test]
fn ipv6_same_node_traffic_goes_through_the_proxy_without_a_tunnel() {
    same_node(Family::V6);
}

fn same_node(family: Family) {
    let mut c = Cluster::dual_stack(1, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("a", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("b", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let dst = server.addr_of(family, 7000);
    let echo = app::EchoServer::start(&server.netns, dst).unwrap();

    for i in 0..3 {
        let payload = format!("round {i}").repeat(500).into_bytes();
        let ex = app::exchange(&client.netns, dst, &payload)
            .unwrap_or_else(|e| panic!("{dst}: {e}\n{}", c.agent_logs()));
        assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
        assert_eq!(ex.echoed, payload);
    }
    assert_eq!(echo.accepted(), 3);

    let client_counters = c.counters(&client).unwrap();
    let server_counters = c.counters(&server).unwrap();
    assert_eq!(
        client_counters["captured_outbound"], 3,
        "{client_counters:?}"
    );
    // The proxy's own connection to the server is marked and passes uncaptured.
    assert_eq!(
        server_counters["captured_inbound_hbone"], 0,
        "{server_counters:?}"
    );
    assert_eq!(
        server_counters["captured_inbound_plaintext"], 0,
        "{server_counters:?}"
    );
    assert!(server_counters["passed"] > 0, "{server_counters:?}");
    // The proxy took the same-node route.
    c.wait_log(0, &["route=local"]).unwrap();
}
