//! A pod that leaves the mesh drains: the connections the proxy carries for it
//! go on through the proxy until they close, new ones go direct, and enrolling
//! it again disturbs neither kind. Once none is left (or `--leave-drain` has
//! passed) the pod is detached.

use std::{
    collections::BTreeMap,
    net::{IpAddr, TcpStream},
    time::Duration,
};

use podlink_tests::{Cluster, Pod, PodSpec, app};

/// Labels that take a pod out of the mesh (`none`), or leave it to its
/// namespace (empty).
fn labels(out: bool) -> BTreeMap<String, String> {
    if out {
        [("istio.io/dataplane-mode".to_string(), "none".to_string())].into()
    } else {
        BTreeMap::new()
    }
}

/// Whether `podlink inspect` shows the pod's entry flagged `draining`; `None`
/// when it has no entry.
fn draining(c: &Cluster, pod: &Pod) -> Option<bool> {
    let report = c.inspect(pod.node).unwrap();
    let entry = report["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["interface"] == pod.host_veth.as_str())?;
    let flags = entry["flags"].as_array().unwrap();
    Some(flags.iter().any(|f| f == "draining"))
}

/// Waits until the pod's entry is flagged draining (`Some(true)`), enrolled
/// without the flag (`Some(false)`) or gone (`None`).
fn wait_draining(c: &Cluster, pod: &Pod, wanted: Option<bool>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let now = draining(c, pod);
        if now == wanted {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{}: draining is {now:?}, not {wanted:?}; agent log:\n{}",
            pod.name,
            c.agent_log(pod.node)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each open connection still echoes.
fn all_echo(open: &mut [(&str, TcpStream)], round: &str) {
    for (name, stream) in open.iter_mut() {
        let payload = format!("{name} {round}");
        assert_eq!(
            app::echo_round(stream, payload.as_bytes())
                .unwrap_or_else(|e| panic!("{name} broke at {round}: {e}")),
            payload.as_bytes(),
            "{name} at {round}"
        );
    }
}

/// A new connection from `client` to `server`, checked to go through the
/// client's proxy (`captured`) or direct, by its outbound capture counter.
fn open_new(c: &Cluster, client: &Pod, server: &Pod, captured: bool) -> TcpStream {
    let before = c.counters(client).unwrap()["captured_outbound"];
    let stream = app::connect(&client.netns, server.addr(8000), Duration::from_secs(5)).unwrap();
    assert_eq!(
        app::read_greeting(&stream).unwrap().ip(),
        IpAddr::V4(client.ip),
        "the server sees the client's address"
    );
    let after = c.counters(client).unwrap()["captured_outbound"];
    assert_eq!(
        after > before,
        captured,
        "captured_outbound {before} → {after}"
    );
    stream
}

#[test]
fn leaving_the_mesh_drains_carried_connections_across_label_flips() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let meshed = open_new(&c, &client, &server, true);
    let mut open = vec![("meshed", meshed)];
    all_echo(&mut open, "enrolled");

    // Out: the client drains, its carried connection goes on, a new one is direct.
    let client = c.set_pod_labels("client", labels(true)).unwrap();
    wait_draining(&c, &client, Some(true));
    all_echo(&mut open, "left once");
    let direct = open_new(&c, &client, &server, false);
    open.push(("direct", direct));
    all_echo(&mut open, "left once");

    // In again: both go on; a new one is captured.
    let client = c.set_pod_labels("client", labels(false)).unwrap();
    wait_draining(&c, &client, Some(false));
    all_echo(&mut open, "enrolled again");
    open.push(("meshed again", open_new(&c, &client, &server, true)));
    all_echo(&mut open, "enrolled again");

    // Out again, and the server leaves too: every connection goes on.
    let client = c.set_pod_labels("client", labels(true)).unwrap();
    let server = c.set_pod_labels("server", labels(true)).unwrap();
    wait_draining(&c, &client, Some(true));
    wait_draining(&c, &server, Some(true));
    all_echo(&mut open, "both left");
    open.push(("direct both out", open_new(&c, &client, &server, false)));
    // In again, both: still every connection goes on.
    let client = c.set_pod_labels("client", labels(false)).unwrap();
    let server = c.set_pod_labels("server", labels(false)).unwrap();
    wait_draining(&c, &client, Some(false));
    wait_draining(&c, &server, Some(false));
    all_echo(&mut open, "both back");

    // Out for good: once the carried connections close, both are detached.
    let client = c.set_pod_labels("client", labels(true)).unwrap();
    let server = c.set_pod_labels("server", labels(true)).unwrap();
    wait_draining(&c, &client, Some(true));
    all_echo(&mut open, "last");
    drop(open);
    wait_draining(&c, &client, None);
    wait_draining(&c, &server, None);
    c.wait_captured(&client, false).unwrap();
    c.wait_captured(&server, false).unwrap();
    assert!(
        c.agent_log(0)
            .contains("drained: the proxy carries none of its connections")
    );
    // The direct path works with nothing attached.
    let ex = app::exchange(&client.netns, server.addr(8000), b"plain").unwrap();
    assert_eq!(ex.echoed, b"plain");
}

#[test]
fn a_leaving_pods_connections_are_closed_when_its_drain_bound_passes() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agent_with(0, &["--leave-drain", "3s"]).unwrap();
    c.start_agent(1).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let mut meshed = open_new(&c, &client, &server, true);

    let client = c.set_pod_labels("client", labels(true)).unwrap();
    wait_draining(&c, &client, Some(true));
    assert_eq!(
        app::echo_round(&mut meshed, b"draining").unwrap(),
        b"draining"
    );
    // The bound passes with the connection open: closed, the pod detached.
    c.wait_log(0, &["closing its remaining connections through the proxy"])
        .unwrap();
    c.wait_captured(&client, false).unwrap();
    meshed
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(
        app::echo_round(&mut meshed, b"after").is_err(),
        "the connection outlived the drain bound"
    );
}
