//! `--exclude-port` and `--exclude-cidr`: connections to excluded destinations
//! (IPv4 or IPv6) bypass capture; everything else is still captured.

use std::net::IpAddr;

use podlink_tests::{Cluster, Family, PodSpec, app};

#[test]
fn excluded_ports_and_prefixes_bypass_capture() {
    let mut c = Cluster::dual_stack(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let plain = c.add_pod(PodSpec::new("plain", "legacy", 1)).unwrap();
    let other = c.add_pod(PodSpec::new("other", "legacy", 1)).unwrap();
    let cidr = format!("{}/32", other.ip);
    let cidr6 = format!("{}/128", other.ip_of(Family::V6));
    c.start_agent_with(
        0,
        &[
            "--exclude-port",
            "6000",
            "--exclude-cidr",
            &cidr,
            "--exclude-cidr",
            &cidr6,
        ],
    )
    .unwrap();
    c.wait_captured(&client, true).unwrap();
    let _a = app::EchoServer::start(&plain.netns, plain.addr(6000)).unwrap();
    let _b = app::EchoServer::start(&plain.netns, plain.addr(6001)).unwrap();
    let _c = app::EchoServer::start(&other.netns, other.addr(6001)).unwrap();
    let _b6 = app::EchoServer::start(&plain.netns, plain.addr6(6001)).unwrap();
    let _c6 = app::EchoServer::start(&other.netns, other.addr6(6001)).unwrap();

    let captured = |c: &Cluster| c.counters(&client).unwrap()["captured_outbound"];
    let start = captured(&c);
    // Excluded port.
    let ex = app::exchange(&client.netns, plain.addr(6000), b"port").unwrap();
    assert_eq!(ex.echoed, b"port");
    assert_eq!(
        captured(&c),
        start,
        "a connection to an excluded port was captured"
    );
    // Excluded prefix.
    let ex = app::exchange(&client.netns, other.addr(6001), b"cidr").unwrap();
    assert_eq!(ex.echoed, b"cidr");
    assert_eq!(
        captured(&c),
        start,
        "a connection to an excluded prefix was captured"
    );
    // Excluded IPv6 prefix.
    let ex = app::exchange(&client.netns, other.addr6(6001), b"cidr6").unwrap();
    assert_eq!(ex.echoed, b"cidr6");
    assert_eq!(
        captured(&c),
        start,
        "a connection to an excluded IPv6 prefix was captured"
    );
    // Anything else is captured, in both families.
    let ex = app::exchange(&client.netns, plain.addr(6001), b"captured").unwrap();
    assert_eq!(ex.echoed, b"captured");
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert_eq!(captured(&c), start + 1);
    let ex = app::exchange(&client.netns, plain.addr6(6001), b"captured6").unwrap();
    assert_eq!(ex.echoed, b"captured6");
    assert_eq!(ex.peer_seen.ip(), client.ip_of(Family::V6));
    assert_eq!(captured(&c), start + 2);

    // A new agent without the flags forgets them (the maps are pinned and reused).
    c.stop_agent(0).unwrap();
    c.start_agent(0).unwrap();
    let ex = app::exchange(&client.netns, plain.addr(6000), b"port again").unwrap();
    assert_eq!(ex.echoed, b"port again");
    assert_eq!(
        captured(&c),
        start + 3,
        "an exclusion outlived the agent that set it"
    );
}
