//! An enrolled pod on node 1 talks to an enrolled pod on node 2: captured in the
//! kernel on both ends, carried over HBONE, delivered with the client's address.

use podlink_tests::{Capture, Cluster, PodSpec, app, contains_bytes};

#[test]
fn cross_node_traffic_is_tunnelled_with_the_client_address() {
    let mut c = Cluster::new(2).unwrap();
    c.add_namespace("mesh", true).unwrap();
    let client = c
        .add_pod(PodSpec::new("client", "mesh", 0).service_account("client"))
        .unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    c.start_agent(0).unwrap();
    c.start_agent(1).unwrap();
    c.wait_captured(&client, true).unwrap();
    c.wait_captured(&server, true).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    let payload = b"secret-payload-0123456789".repeat(1000);
    let ex = app::exchange(&client.netns, server.addr(8080), &payload).unwrap_or_else(|e| {
        panic!(
            "exchange failed: {e}\nnode1:\n{}\nnode2:\n{}",
            c.agent_log(0),
            c.agent_log(1)
        )
    });
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), std::net::IpAddr::V4(client.ip));
    assert_eq!(ex.echoed, payload);

    // On the underlay: TLS to port 15008 only; the payload never appears.
    let to_hbone = format!("> {}.15008:", server.ip);
    assert!(lines.iter().any(|l| l.contains(&to_hbone)), "{lines:#?}");
    assert!(!lines.iter().any(|l| l.contains(".8080")), "{lines:#?}");
    assert!(
        !contains_bytes(&raw, b"secret-payload"),
        "plaintext on the underlay"
    );

    let client_counters = c.counters(&client).unwrap();
    let server_counters = c.counters(&server).unwrap();
    assert!(
        client_counters["captured_outbound"] >= 1,
        "{client_counters:?}"
    );
    assert!(
        server_counters["captured_inbound_hbone"] >= 1,
        "{server_counters:?}"
    );
    assert_eq!(
        server_counters["captured_inbound_plaintext"], 0,
        "{server_counters:?}"
    );
}
