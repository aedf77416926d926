//! An enrolled pod on node 1 talks to an enrolled pod on node 2: captured in the
//! kernel on both ends, carried over HBONE, delivered with the client's address.
//! Concurrent connections share pooled HBONE connections (at most one per runtime worker of the agent).

use std::net::IpAddr;

use podlink_tests::{Capture, Cluster, PodSpec, app, contains_bytes, netns};

/// Concurrent connections from the client.
const CONNECTIONS: usize = 8;

#[test]
fn cross_node_traffic_is_tunnelled_with_the_client_address() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c
        .add_pod(PodSpec::new("client", "mesh", 0).service_account("client"))
        .unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    // Strict reverse-path filtering, as some distributions set it: the agent must
    // cope (bounced packets carry remote sources).
    netns::run(netns::command_in(&c.nodes[1].netns, "sysctl").args([
        "-q",
        "-w",
        "net.ipv4.conf.all.rp_filter=1",
    ]))
    .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    let exchanges: Vec<_> = (0..CONNECTIONS)
        .map(|i| {
            let netns = client.netns.clone();
            let dst = server.addr(8080);
            std::thread::spawn(move || {
                let payload = format!("secret-payload-{i}-").repeat(1000).into_bytes();
                let ex = app::exchange(&netns, dst, &payload);
                (payload, ex)
            })
        })
        .collect();
    for handle in exchanges {
        let (payload, ex) = handle.join().unwrap();
        let ex = ex.unwrap_or_else(|e| {
            panic!(
                "exchange failed: {e}\nnode1:\n{}\nnode2:\n{}",
                c.agent_log(0),
                c.agent_log(1)
            )
        });
        assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
        assert_eq!(ex.echoed, payload);
    }
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(echo.accepted(), CONNECTIONS);

    // On the underlay: TLS to port 15008 only, over pooled connections that
    // multiplex the streams (parallel ones spread over at most one per runtime
    // worker of the agent: one per core here); the payload never appears.
    let hbone_syns = lines
        .iter()
        .filter(|l| l.contains(&format!("> {}.15008: Flags [S]", server.ip)))
        .count();
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        (1..=workers.min(CONNECTIONS - 1)).contains(&hbone_syns),
        "{hbone_syns} HBONE connections for {CONNECTIONS} parallel streams, {workers} workers: {lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains(".8080:")), "{lines:#?}");
    assert!(
        !contains_bytes(&raw, b"secret-payload"),
        "plaintext on the underlay"
    );

    let client_counters = c.counters(&client).unwrap();
    let server_counters = c.counters(&server).unwrap();
    assert_eq!(
        client_counters["captured_outbound"], CONNECTIONS as u64,
        "{client_counters:?}"
    );
    // One capture per HBONE connection the tunnel counted above.
    assert_eq!(
        server_counters["captured_inbound_hbone"], hbone_syns as u64,
        "{server_counters:?}"
    );
    assert_eq!(
        server_counters["captured_inbound_plaintext"], 0,
        "{server_counters:?}"
    );
    assert!(c.agent_log(1).contains("rp_filter was 1 (strict)"));
}
