//! An enrolled pod on node 1 talks to an enrolled pod on node 2, over IPv4 and
//! over IPv6 (dual-stack pods): captured in the kernel on both ends, carried over
//! HBONE to the server pod's address of the same family, port 15008, delivered
//! with the client's address. Concurrent connections share pooled HBONE
//! connections (at most one per proxy thread of the agent).

use std::{net::IpAddr, time::Duration};

use podlink_tests::{Cluster, Family, PodSpec, Source, app, contains_bytes, netns, syns_to};

/// Concurrent connections from the client.
const CONNECTIONS: usize = 8;

/// The HBONE port.
const HBONE: u16 = 15008;

#[test]
fn cross_node_traffic_is_tunnelled_with_the_client_address() {
    cross_node_tunnel(Family::V4, Source::Manifests);
}

#[test]
fn ipv6_cross_node_traffic_is_tunnelled_with_the_client_address() {
    cross_node_tunnel(Family::V6, Source::Manifests);
}

/// The agents learn pods' IPv6 addresses from `status.podIPs` of the API.
#[test]
fn ipv6_cross_node_traffic_with_pods_from_the_kubernetes_api() {
    cross_node_tunnel(Family::V6, Source::Kubernetes);
}

/// Enrolled client on node 1, enrolled server on node 2, both dual-stack:
/// `CONNECTIONS` parallel connections of `family` are captured, carried over
/// pooled HBONE connections and delivered with the client's address; nothing in
/// clear on the underlay; both ends' access logs name the addresses.
fn cross_node_tunnel(family: Family, source: Source) {
    let mut c = Cluster::dual_stack_from(2, &[("mesh", true)], source).unwrap();
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
    c.assert_one_workload(0, &server);
    let dst = server.addr_of(family, 8080);
    let echo = app::EchoServer::start(&server.netns, dst).unwrap();

    let capture = c.underlay_capture(0).unwrap();
    let exchanges: Vec<_> = (0..CONNECTIONS)
        .map(|i| {
            let netns = client.netns.clone();
            std::thread::spawn(move || {
                let payload = format!("secret-payload-{i}-").repeat(1000).into_bytes();
                let ex = app::exchange(&netns, dst, &payload);
                (payload, ex)
            })
        })
        .collect();
    for handle in exchanges {
        let (payload, ex) = handle.join().unwrap();
        let ex = ex.unwrap_or_else(|e| panic!("exchange to {dst} failed: {e}\n{}", c.agent_logs()));
        assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
        assert_eq!(ex.echoed, payload);
    }
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(echo.accepted(), CONNECTIONS);

    // On the underlay: TLS to port 15008 only, over pooled connections that
    // multiplex the streams (parallel ones spread over at most one per proxy
    // thread of the agent: one per core here); the payload never appears.
    let syns = syns_to(&lines, server.ip_of(family), HBONE);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        (1..=workers.min(CONNECTIONS - 1)).contains(&syns),
        "{syns} HBONE connections to {} for {CONNECTIONS} parallel streams, {workers} workers: {lines:#?}",
        server.ip_of(family)
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
        server_counters["captured_inbound_hbone"], syns as u64,
        "{server_counters:?}"
    );
    assert_eq!(
        server_counters["captured_inbound_plaintext"], 0,
        "{server_counters:?}"
    );
    // Nothing of either pod was dropped.
    for counters in [&client_counters, &server_counters] {
        let dropped: u64 = counters
            .iter()
            .filter(|(name, _)| name.starts_with("dropped_"))
            .map(|(_, n)| n)
            .sum();
        assert_eq!(dropped, 0, "{counters:?}");
    }
    // The access logs of both ends: the addresses as sockets print them
    // (`[fd00:10:244:2::2]:8080`), so the CONNECT authority made it through.
    let src = match client.ip_of(family) {
        IpAddr::V4(ip) => format!("src.addr={ip}:"),
        IpAddr::V6(ip) => format!("src.addr=[{ip}]:"),
    };
    let dst_field = format!("dst.addr={dst}");
    let complete = "access: connection complete";
    for (node, needles) in [
        (0, [complete, "route=hbone", &src, &dst_field].as_slice()),
        (1, [complete, "route=inbound_hbone", &dst_field].as_slice()),
    ] {
        c.wait_log_lines(node, needles, CONNECTIONS, Duration::from_secs(10))
            .unwrap();
    }
    assert!(c.agent_log(1).contains("rp_filter was 1 (strict)"));
}

/// More connections between one pod pair than the pooled HBONE connections
/// may carry as streams at once (1,000 each, one connection per proxy thread, one
/// thread here): a further HBONE connection is made, and no connection waits
/// for another to end.
#[test]
fn streams_beyond_one_hbone_connections_limit_open_another() {
    const OPEN: usize = 1_200;
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agent_with(0, &["--worker-threads", "1"]).unwrap();
    c.start_agent(1).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let dst = server.addr(8080);
    let _echo = app::EchoServer::start(&server.netns, dst).unwrap();
    let mut open = Vec::with_capacity(OPEN);
    for i in 0..OPEN {
        let s = app::connect(&client.netns, dst, Duration::from_secs(5))
            .and_then(|s| app::read_greeting(&s).map(|_| s))
            .unwrap_or_else(|e| panic!("connection {i} of {OPEN}: {e}\n{}", c.agent_log(0)));
        open.push(s);
    }
    for (i, s) in open.iter_mut().enumerate().rev().take(10) {
        let payload = format!("stream {i}");
        assert_eq!(
            app::echo_round(s, payload.as_bytes()).unwrap(),
            payload.as_bytes()
        );
    }
    // Node 1's HBONE connections to the server pod: more than one.
    let out = netns::run(netns::command_in(&c.nodes[0].netns, "ss").args([
        "-Htn",
        "state",
        "established",
        "dst",
        &format!("{}:{HBONE}", server.ip),
    ]))
    .unwrap();
    let hbone = String::from_utf8_lossy(&out.stdout).lines().count();
    assert!(hbone >= 2, "{hbone} HBONE connection(s) for {OPEN} streams");
}
