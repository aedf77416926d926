//! With the proxy stopped, the programs stay attached (pinned TCX links, or
//! `cls_bpf` filters): enrolled pods' new connections fail (nothing leaves in
//! plain text), over IPv4 and IPv6 (dual-stack pods), and they work again once an
//! agent is back on the same pins. Each scenario runs with the agents' default
//! attach mode and with `cls_bpf` filters.

use std::time::Duration;

use podlink_tests::{AttachMode, Capture, Cluster, Family, PodSpec, any_from, app};

#[test]
fn no_proxy_means_no_new_connections_and_no_plaintext() {
    no_proxy(Family::V4, AttachMode::Auto);
}

#[test]
fn ipv6_no_proxy_means_no_new_connections_and_no_plaintext() {
    no_proxy(Family::V6, AttachMode::Auto);
}

#[test]
fn no_proxy_means_no_new_connections_and_no_plaintext_with_cls_bpf() {
    no_proxy(Family::V4, AttachMode::ClsBpf);
}

#[test]
fn ipv6_no_proxy_means_no_new_connections_and_no_plaintext_with_cls_bpf() {
    no_proxy(Family::V6, AttachMode::ClsBpf);
}

fn no_proxy(family: Family, mode: AttachMode) {
    let mut c = Cluster::dual_stack(2, &[("mesh", true), ("legacy", false)])
        .unwrap()
        .attaching(mode);
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    let outsider = c.add_pod(PodSpec::new("outsider", "legacy", 0)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let dst = server.addr_of(family, 8000);
    let echo = app::EchoServer::start(&server.netns, dst).unwrap();
    app::exchange(&client.netns, dst, b"up").unwrap();
    assert_eq!(echo.accepted(), 1);

    c.stop_agent(0).unwrap();
    c.stop_agent(1).unwrap();
    // Pinned links and filters outlive the agents.
    assert!(c.is_captured(&client).unwrap());
    assert!(c.is_captured(&server).unwrap());
    if mode.on_this_kernel() == AttachMode::ClsBpf {
        for pod in [&client, &server] {
            assert_eq!(c.attachments(pod).unwrap().filters, ["from_pod", "to_pod"]);
        }
    }

    let capture = c.underlay_capture(0).unwrap();
    // Outbound from an enrolled pod: its SYN is dropped at its own host veth.
    let err = app::connect(&client.netns, dst, Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    // Inbound to an enrolled pod from outside the mesh: dropped at the server's veth.
    let err = app::connect(&outsider.netns, dst, Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    let (_, lines) = capture.stop().unwrap();
    assert_eq!(
        echo.accepted(),
        1,
        "a connection reached the server without the proxy"
    );
    // The client's SYNs never left its node.
    assert!(!any_from(&lines, client.ip_of(family)), "{lines:#?}");
    assert!(c.counters(&client).unwrap()["dropped_no_listener"] >= 1);
    assert!(c.counters(&server).unwrap()["dropped_no_listener"] >= 1);

    // A new agent adopts the pinned links (or filters) and maps; traffic flows
    // again.
    c.start_agents().unwrap();
    assert!(c.agent_log(0).contains(mode.adoption_log()));
    let ex = app::exchange(&client.netns, dst, b"back").unwrap();
    assert_eq!(ex.echoed, b"back");
    assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
    assert_eq!(echo.accepted(), 2);
    let ex = app::exchange(&outsider.netns, dst, b"plain back").unwrap();
    assert_eq!(ex.echoed, b"plain back");
}

/// A connection the proxy carried when the agent stopped: once the proxy's socket
/// is gone, the pod's further bytes are dropped at its host veth, never passed to
/// the network in plain text.
#[test]
fn proxied_flows_do_not_leak_after_the_proxy_is_gone() {
    proxied_flows_do_not_leak(AttachMode::Auto);
}

#[test]
fn proxied_flows_do_not_leak_after_the_proxy_is_gone_with_cls_bpf() {
    proxied_flows_do_not_leak(AttachMode::ClsBpf);
}

fn proxied_flows_do_not_leak(mode: AttachMode) {
    use std::io::Write;

    let mut c = Cluster::with_namespaces(2, &[("mesh", true)])
        .unwrap()
        .attaching(mode);
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    // Orphaned proxy sockets (FIN_WAIT2) go away after a second instead of a minute.
    podlink_tests::netns::run(
        podlink_tests::netns::command_in(&c.nodes[0].netns, "sysctl").args([
            "-q",
            "-w",
            "net.ipv4.tcp_fin_timeout=1",
        ]),
    )
    .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let mut conn = app::connect(&client.netns, server.addr(8000), Duration::from_secs(5)).unwrap();
    app::read_greeting(&conn).unwrap();
    assert_eq!(
        app::echo_round(&mut conn, b"while proxied").unwrap(),
        b"while proxied"
    );

    c.stop_agent(0).unwrap();
    // Let the proxy's orphaned socket for this flow expire.
    std::thread::sleep(Duration::from_secs(3));
    let before = c.counters(&client).unwrap()["dropped_flow_gone"];
    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    let _ = conn.write_all(b"must-not-leak");
    std::thread::sleep(Duration::from_millis(500));
    let (raw, _) = capture.stop().unwrap();
    assert!(
        !podlink_tests::contains_bytes(&raw, b"must-not-leak"),
        "a proxied flow's bytes left in plain text after the proxy stopped"
    );
    assert!(c.counters(&client).unwrap()["dropped_flow_gone"] > before);
}
