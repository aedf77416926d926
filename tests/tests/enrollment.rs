//! Enrollment changes while traffic flows: flows that predate enrollment survive
//! it (IPv4 and IPv6), new pods are attached and deleted ones detached, un-enrolling restores the
//! direct path, and opted-out pods are left alone.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{IpAddr, Shutdown},
    time::{Duration, Instant},
};

use podlink_tests::{Capture, Cluster, Family, PodSpec, app, contains_bytes};

#[test]
fn a_flow_established_before_enrollment_survives_it() {
    flow_before_enrollment(Family::V4);
}

#[test]
fn an_ipv6_flow_established_before_enrollment_survives_it() {
    flow_before_enrollment(Family::V6);
}

fn flow_before_enrollment(family: Family) {
    let mut c = Cluster::dual_stack(2, &[("apps", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "apps", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "apps", 1)).unwrap();
    c.start_agents().unwrap();
    let dst = server.addr_of(family, 8000);
    let _echo = app::EchoServer::start(&server.netns, dst).unwrap();

    let mut old = app::connect(&client.netns, dst, Duration::from_secs(5)).unwrap();
    assert_eq!(app::read_greeting(&old).unwrap().ip(), client.ip_of(family));
    assert_eq!(app::echo_round(&mut old, b"before").unwrap(), b"before");

    // Enroll the whole namespace.
    c.add_namespace("apps", true).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();

    // The old flow keeps working, untouched by the proxy.
    for i in 0..5 {
        let msg = format!("during {i}");
        assert_eq!(
            app::echo_round(&mut old, msg.as_bytes()).unwrap(),
            msg.as_bytes()
        );
    }
    // A new flow is captured and tunnelled.
    let ex = app::exchange(&client.netns, dst, b"new flow").unwrap();
    assert_eq!(ex.peer_seen.ip(), client.ip_of(family));
    assert_eq!(ex.echoed, b"new flow");
    assert!(c.counters(&client).unwrap()["captured_outbound"] >= 1);
    assert!(c.counters(&server).unwrap()["captured_inbound_hbone"] >= 1);
    // And the old one still does, to its end.
    assert_eq!(app::echo_round(&mut old, b"after").unwrap(), b"after");
    old.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    old.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    // Its packets were passed, not captured.
    assert!(c.counters(&client).unwrap()["passed"] >= 5);
}

const KNOB: &str = "/sys/kernel/rcu_expedited";

fn rcu_knob() -> String {
    std::fs::read_to_string(KNOB).unwrap().trim().to_string()
}

/// Waits for the RCU knob to show `value`: agents of other tests may be inside
/// their windows of about 0.1 ms when it is read. Panics after 10 s.
fn wait_rcu_knob(value: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rcu_knob() != value {
        assert!(
            Instant::now() < deadline,
            "{KNOB} stayed at {} instead of {value}",
            rcu_knob()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pods_are_attached_on_creation_and_detached_on_deletion() {
    // The value between windows (other tests' agents may be in one now): 0
    // unless the machine has it at 1.
    let knob_before = {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let v = rcu_knob();
            if v == "0" || Instant::now() > deadline {
                break v;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    c.start_agent_with(0, &["--expedite-attach"]).unwrap();

    let start = Instant::now();
    let pod = c.add_pod(PodSpec::new("late", "mesh", 0)).unwrap();
    c.wait_captured(&pod, true).unwrap();
    eprintln!(
        "pod captured {:?} after its manifest was written",
        start.elapsed()
    );
    let ifindex = c.host_ifindex(&pod).unwrap();
    let pods = c.dump_map(0, "pods").unwrap();
    assert_eq!(pods.as_array().unwrap().len(), 1, "{pods}");
    let entry = &pods[0]["formatted"];
    assert_eq!(entry["key"].as_u64(), Some(u64::from(ifindex)), "{pods}");
    // The address is stored IPv4-mapped in 16 bytes.
    let ipv4: Vec<u64> = entry["value"]["ipv4"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    let octets: Vec<u64> = pod.ip.octets().iter().map(|&o| u64::from(o)).collect();
    assert_eq!(&ipv4[10..12], &[255, 255]);
    assert_eq!(&ipv4[12..], &octets[..]);

    // Deleting the pod (manifest and CNI DEL) removes links and map entries.
    let links = c.nodes[0].pins().join("links");
    c.remove_pod("late").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pods = c.dump_map(0, "pods").unwrap();
        let counters = c.dump_map(0, "pod_counters").unwrap();
        let pins = std::fs::read_dir(&links).unwrap().count();
        if pods.as_array().unwrap().is_empty()
            && counters.as_array().unwrap().is_empty()
            && pins == 0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "entries left: {pods} {counters}, {pins} pins"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Attaching with expedited grace periods put the RCU knob back and left its
    // marker released: first byte `0`, or no marker at all where no window was
    // opened (the knob was at 1, the machine's or another test bed's agent's).
    wait_rcu_knob(&knob_before);
    assert!(!podlink_agent::dataplane::rcu::marker_held(&c.nodes[0].state_dir).unwrap());
    assert!(
        !c.agent_log(0).contains("cannot be used"),
        "{}",
        c.agent_log(0)
    );
}

#[test]
fn unenrolling_restores_the_direct_path_and_opted_out_pods_are_left_alone() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    let opted_out = c
        .add_pod(PodSpec::new("optout", "mesh", 0).label("istio.io/dataplane-mode", "none"))
        .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    assert!(!c.is_captured(&opted_out).unwrap());
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    assert_eq!(
        app::exchange(&client.netns, server.addr(8000), b"meshed")
            .unwrap()
            .echoed,
        b"meshed"
    );

    // Opt both pods out: programs detached, entries gone, traffic plain and direct.
    let none: BTreeMap<String, String> =
        [("istio.io/dataplane-mode".to_string(), "none".to_string())].into();
    let client = c.set_pod_labels("client", none.clone()).unwrap();
    let server = c.set_pod_labels("server", none).unwrap();
    c.wait_captured(&client, false).unwrap();
    c.wait_captured(&server, false).unwrap();
    assert!(c.counters(&client).unwrap().is_empty());
    assert!(c.counters(&server).unwrap().is_empty());

    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    let ex = app::exchange(&client.netns, server.addr(8000), b"direct-again").unwrap();
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert!(contains_bytes(&raw, b"direct-again"));
    // No new tunnel was opened. (Tunnels of the enrolled era may still be seen
    // closing: the agents close the connections of pods that leave the mesh.)
    assert!(
        !lines.iter().any(|l| l.contains(".15008: Flags [S]")),
        "{lines:#?}"
    );

    // The opted-out pod's own traffic was never touched.
    let mut s = app::connect(&opted_out.netns, server.addr(8000), Duration::from_secs(5)).unwrap();
    assert_eq!(
        app::read_greeting(&s).unwrap().ip(),
        IpAddr::V4(opted_out.ip)
    );
    s.write_all(b"x").unwrap();
}
