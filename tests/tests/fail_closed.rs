//! With the proxy stopped, the pinned programs stay attached: enrolled pods' new
//! connections fail (nothing leaves in plain text), and they work again once an
//! agent is back on the same pins.

use std::time::Duration;

use podlink_tests::{Capture, Cluster, PodSpec, app};

#[test]
fn no_proxy_means_no_new_connections_and_no_plaintext() {
    let mut c = Cluster::new(2).unwrap();
    c.add_namespace("mesh", true).unwrap();
    c.add_namespace("legacy", false).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    let outsider = c.add_pod(PodSpec::new("outsider", "legacy", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.start_agent(1).unwrap();
    c.wait_captured(&client, true).unwrap();
    c.wait_captured(&server, true).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    app::exchange(&client.netns, server.addr(8000), b"up").unwrap();
    assert_eq!(echo.accepted(), 1);

    c.stop_agent(0).unwrap();
    c.stop_agent(1).unwrap();
    // Pins outlive the agents.
    assert!(c.is_captured(&client).unwrap());
    assert!(c.is_captured(&server).unwrap());

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    // Outbound from an enrolled pod: its SYN is dropped at its own host veth.
    let err = app::connect(&client.netns, server.addr(8000), Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    // Inbound to an enrolled pod from outside the mesh: dropped at the server's veth.
    let err = app::connect(&outsider.netns, server.addr(8000), Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    let (_, lines) = capture.stop().unwrap();
    assert_eq!(
        echo.accepted(),
        1,
        "a connection reached the server without the proxy"
    );
    // The client's SYNs never left its node.
    let from_client = format!("{}.", client.ip);
    assert!(
        !lines.iter().any(|l| l.contains(&from_client)),
        "{lines:#?}"
    );
    assert!(c.counters(&client).unwrap()["dropped_no_listener"] >= 1);
    assert!(c.counters(&server).unwrap()["dropped_no_listener"] >= 1);

    // A new agent adopts the pinned links and maps; traffic flows again.
    c.start_agent(0).unwrap();
    c.start_agent(1).unwrap();
    assert!(c.agent_log(0).contains("adopted pinned link"));
    let ex = app::exchange(&client.netns, server.addr(8000), b"back").unwrap();
    assert_eq!(ex.echoed, b"back");
    assert_eq!(echo.accepted(), 2);
    let ex = app::exchange(&outsider.netns, server.addr(8000), b"plain back").unwrap();
    assert_eq!(ex.echoed, b"plain back");
}
