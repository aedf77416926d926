//! Restarting the agents under load: a client keeps opening connections across
//! nodes while the client's node agent, then the server's, is restarted on the
//! same pins. Connections opened while no proxy listens wait (their SYNs are
//! dropped at the host veth, as the pod counters show, and retried) and succeed
//! once the new agent is up; connections open at SIGTERM finish; nothing crosses
//! the underlay in plain text. Each scenario runs with the agents' default attach
//! mode and with `cls_bpf` filters (which the new agent finds on the host veths
//! and gives its programs in place).

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use podlink_tests::{AttachMode, Capture, Cluster, Pod, PodSpec, app, contains_bytes};

/// Connect timeout: long enough for the SYN retries (1 s, 3 s, 7 s, …) that span
/// a restart.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

/// One exchange with a connect timeout that covers a restart.
fn exchange(netns: &str, dst: SocketAddr, payload: &[u8]) -> std::io::Result<()> {
    let mut stream = app::connect(netns, dst, CONNECT_TIMEOUT)?;
    app::read_greeting(&stream)?;
    stream.write_all(payload)?;
    stream.shutdown(Shutdown::Write)?;
    let mut echoed = Vec::new();
    stream.read_to_end(&mut echoed)?;
    if echoed != payload {
        return Err(std::io::Error::other("echo differs"));
    }
    Ok(())
}

/// Restarting the client's node: its outbound listener must not reset the
/// connections queued on it when it closes.
#[test]
fn restarting_the_client_nodes_agent_under_load_loses_nothing() {
    restart_under_load(&[0], AttachMode::Auto, AttachMode::Auto);
}

/// As above, restarting the server's node.
#[test]
fn restarting_the_server_nodes_agent_under_load_loses_nothing() {
    restart_under_load(&[1], AttachMode::Auto, AttachMode::Auto);
}

/// Restarting the client's node, its pods captured by `cls_bpf` filters.
#[test]
fn restarting_the_client_nodes_agent_under_load_loses_nothing_with_cls_bpf() {
    restart_under_load(&[0], AttachMode::ClsBpf, AttachMode::ClsBpf);
}

/// Restarting the server's node, its pods captured by `cls_bpf` filters.
#[test]
fn restarting_the_server_nodes_agent_under_load_loses_nothing_with_cls_bpf() {
    restart_under_load(&[1], AttachMode::ClsBpf, AttachMode::ClsBpf);
}

/// Restarting both nodes from TCX links to `cls_bpf` filters: the new agents take
/// the pods over from the links (their own filters first, then the links
/// removed), so none is uncaptured meanwhile or left with both. Without TCX (below
/// 6.6) no agent can attach TCX links: `--attach-mode tcx` is refused, clearly,
/// and the pods stay captured by their filters.
#[test]
fn restarting_from_tcx_links_to_cls_bpf_under_load_loses_nothing() {
    if podlink_tests::kernel_has_tcx() {
        restart_under_load(&[0, 1], AttachMode::Tcx, AttachMode::ClsBpf);
    } else {
        tcx_is_refused();
    }
}

/// As above, from `cls_bpf` filters to TCX links.
#[test]
fn restarting_from_cls_bpf_to_tcx_links_under_load_loses_nothing() {
    if podlink_tests::kernel_has_tcx() {
        restart_under_load(&[0, 1], AttachMode::ClsBpf, AttachMode::Tcx);
    } else {
        tcx_is_refused();
    }
}

/// On a kernel without TCX: an agent started with `--attach-mode tcx` exits,
/// saying why, and leaves the pods captured by the previous agent's filters.
fn tcx_is_refused() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let pod = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_captured(&pod, true).unwrap();
    c.stop_agent(0).unwrap();
    c.set_attach_mode(AttachMode::Tcx);
    let error = format!("{:#}", c.start_agent(0).unwrap_err());
    assert!(
        error.contains("--attach-mode tcx needs TCX links, which came with Linux 6.6"),
        "{error}"
    );
    assert_eq!(c.attachments(&pod).unwrap().filters, ["from_pod", "to_pod"]);
    assert!(c.is_captured(&pod).unwrap());
}

/// Restarts the agents of `nodes` (0: the client's node, 1: the server's), one
/// after the other, while the client keeps opening connections; the agents attach
/// in `first` mode, those started again in `then` mode.
fn restart_under_load(nodes: &[usize], first: AttachMode, then: AttachMode) {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)])
        .unwrap()
        .attaching(first);
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let load = {
        let (stop, done) = (stop.clone(), done.clone());
        let (netns, dst) = (client.netns.clone(), server.addr(8080));
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let payload = format!("restart-payload-{i}-").repeat(50).into_bytes();
                if let Err(e) = exchange(&netns, dst, &payload) {
                    failures.push(format!("connection {i}: {e}"));
                }
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            failures
        })
    };
    let wait_for = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while done.load(Ordering::Relaxed) < n {
            assert!(Instant::now() < deadline, "the load stalled at {n}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // Restarts node `node`'s agent once the load has met the missing proxy: a SYN
    // dropped at `pod`'s host veth (fail closed), to be retried by the client.
    let restart = |c: &mut Cluster, node: usize, pod: &Pod| {
        let dropped = |c: &Cluster| c.counters(pod).unwrap()["dropped_no_listener"];
        let before = dropped(c);
        c.stop_agent(node).unwrap();
        // Pinned links and filters outlive the agent: the pod stays captured.
        assert!(c.is_captured(pod).unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        while dropped(c) == before {
            assert!(Instant::now() < deadline, "no SYN met the stopped proxy");
            std::thread::sleep(Duration::from_millis(20));
        }
        c.set_attach_mode(then);
        c.start_agent(node).unwrap();
        // Captured all along, then by the new agent's kind only.
        c.wait_captured(pod, true).unwrap();
    };

    wait_for(20);
    for &node in nodes {
        let before = done.load(Ordering::Relaxed);
        // The server's side: the client's node dials HBONE to a node without a
        // proxy.
        let pod = if node == 0 { &client } else { &server };
        restart(&mut c, node, pod);
        wait_for(before + 20);
    }
    stop.store(true, Ordering::Relaxed);
    let failures = load.join().unwrap();
    let (raw, lines) = capture.stop().unwrap();

    assert!(
        failures.is_empty(),
        "{} of {} connections failed: {failures:#?}\nnode1:\n{}\nnode2:\n{}",
        failures.len(),
        done.load(Ordering::Relaxed),
        c.agent_log(0),
        c.agent_log(1)
    );
    assert_eq!(echo.accepted(), done.load(Ordering::Relaxed));
    // Only HBONE on the underlay, before, during and after the restarts (port
    // 8080 as tcpdump prints it, `addr.8080:`, not in a timestamp).
    assert!(
        !lines.iter().any(|l| l.contains(".8080:")),
        "plain TCP to the server on the underlay: {lines:#?}"
    );
    assert!(
        !contains_bytes(&raw, b"restart-payload"),
        "payload in plain text on the underlay"
    );
    // The second agent of each restarted node adopted the first one's links or
    // filters, and the pods are captured as before.
    for &node in nodes {
        let log = c.agent_log(node);
        assert!(log.matches("agent running").count() >= 2, "{log}");
        assert!(log.contains(first.adoption_log()), "{log}");
        if first.on_this_kernel() != then.on_this_kernel() {
            assert!(log.contains("moved from a previous agent's"), "{log}");
        }
    }
    for (node, pod) in [(0, &client), (1, &server)] {
        let mode = if nodes.contains(&node) { then } else { first };
        let attachments = c.attachments(pod).unwrap();
        let attached = match mode.on_this_kernel() {
            AttachMode::ClsBpf => (&attachments.filters, &attachments.links),
            _ => (&attachments.links, &attachments.filters),
        };
        assert_eq!(*attached.0, ["from_pod", "to_pod"], "{attachments:?}");
        assert!(attached.1.is_empty(), "{attachments:?}");
    }
}
