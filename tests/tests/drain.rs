//! SIGTERM drains the agent: its listeners close at once (enrolled pods' new
//! connections fail closed), open connections go on within the grace period, the
//! agent exits 0 once they end (or the grace period does), and the pins stay, so a
//! new agent adopts them and traffic resumes.

use std::time::Duration;

use podlink_tests::{Cluster, PodSpec, app, netns};

#[test]
fn sigterm_drains_open_connections_then_exits_leaving_the_pins() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agent_with(0, &["--drain-grace", "10m"]).unwrap();
    c.start_agent(1).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let mut open = app::connect(&client.netns, server.addr(8000), Duration::from_secs(5)).unwrap();
    app::read_greeting(&open).unwrap();
    assert_eq!(app::echo_round(&mut open, b"before").unwrap(), b"before");
    assert_eq!(c.readiness(0).unwrap(), 200);
    let drops_before = c.counters(&client).unwrap()["dropped_no_listener"];

    c.signal_agent(0, libc::SIGTERM).unwrap();
    c.wait_log(0, &["outbound listener closed"]).unwrap();
    // The listening sockets themselves are gone (every proxy thread let go of
    // them), not merely unused.
    let listening = || {
        let out = netns::run(
            netns::command_in(&c.nodes[0].netns, "ss").args(["-Hltn", "sport = :15001"]),
        )
        .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !listening().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(listening(), "", "the outbound listener is still open");
    assert_eq!(c.readiness(0).unwrap(), 503);
    // The open connection keeps working while the agent drains.
    assert_eq!(
        app::echo_round(&mut open, b"while draining").unwrap(),
        b"while draining"
    );
    // A new one fails closed: the programs find no listener and drop its SYN.
    let err = app::connect(&client.netns, server.addr(8000), Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    assert!(c.counters(&client).unwrap()["dropped_no_listener"] > drops_before);
    assert!(
        c.agent_running(0),
        "the agent exited with a connection open:\n{}",
        c.agent_log(0)
    );
    assert_eq!(echo.accepted(), 1);

    // Closing it ends the drain: the agent exits 0, before its grace period.
    drop(open);
    let status = c.wait_agent_exit(0, Duration::from_secs(30)).unwrap();
    assert!(status.success(), "{status}\n{}", c.agent_log(0));
    let log = c.agent_log(0);
    assert!(log.contains("drained: no connection open"), "{log}");
    assert!(c.is_captured(&client).unwrap(), "pins removed on exit");

    // A new agent adopts the pins; traffic resumes, and the drops counted while
    // no agent listened are in its metrics (the counters live in the pinned maps).
    c.start_agent(0).unwrap();
    assert!(c.agent_log(0).contains(c.attach_mode().adoption_log()));
    let ex = app::exchange(&client.netns, server.addr(8000), b"back").unwrap();
    assert_eq!(ex.echoed, b"back");
    let m = c.metrics(0).unwrap();
    let drops = m.sum(
        "podlink_redirect_drops_total",
        &[("workload", "client"), ("reason", "no_listener")],
    );
    assert!(drops >= 1.0, "{}", m.text);
    assert_eq!(
        drops,
        c.counters(&client).unwrap()["dropped_no_listener"] as f64
    );
}

#[test]
fn the_grace_period_bounds_the_drain() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    c.start_agent_with(0, &["--drain-grace", "1s"]).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let mut open = app::connect(&client.netns, server.addr(8000), Duration::from_secs(5)).unwrap();
    app::read_greeting(&open).unwrap();
    assert_eq!(app::echo_round(&mut open, b"idle").unwrap(), b"idle");

    c.signal_agent(0, libc::SIGTERM).unwrap();
    // The connection stays open; the agent leaves anyway once the grace is over.
    let status = c.wait_agent_exit(0, Duration::from_secs(30)).unwrap();
    assert!(status.success(), "{status}\n{}", c.agent_log(0));
    let log = c.agent_log(0);
    assert!(
        log.contains("grace period over; closing the open connections"),
        "{log}"
    );
    assert!(c.is_captured(&client).unwrap());
}
