//! `podlink uninstall` leaves nothing of podlink's on a node — no TCX program, no
//! link, no `cls_bpf` filter, no `clsact` qdisc it added, no pin, no policy
//! routing, sysctls as they were, no `podlink-cni` in the CNI configuration — and
//! pods talk directly again, while someone else's `clsact` qdisc and filters stay.
//! It refuses while an agent runs, an agent refused by the pin directory's lock
//! changes nothing, and running it twice is harmless. It runs with the agents'
//! default attach mode and with `cls_bpf` filters.

use std::{fs, net::IpAddr, process::Command};

use podlink_tests::{AttachMode, Capture, Cluster, Family, PodSpec, app, contains_bytes, netns};
use serde_json::Value;

const CONFLIST: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "k8s-pod-network",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "subnet": "10.244.1.0/24"
      }
    },
    {
      "type": "podlink-cni",
      "socket": "/run/podlink/cni.sock"
    },
    {
      "type": "portmap",
      "capabilities": {
        "portMappings": true
      }
    }
  ]
}
"#;

const OTHER_CONFLIST: &str =
    r#"{"cniVersion": "1.0.0", "name": "other", "plugins": [{"type": "bridge"}]}"#;

fn sysctl(netns_name: &str, name: &str) -> String {
    let out = netns::run(netns::command_in(netns_name, "sysctl").args(["-n", name])).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn in_node(netns_name: &str, program: &str, args: &[&str]) -> String {
    let out = netns::run(netns::command_in(netns_name, program).args(args)).unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn uninstall_removes_every_trace_and_pods_talk_directly() {
    uninstall_removes_every_trace(AttachMode::Auto);
}

#[test]
fn uninstall_removes_every_trace_and_pods_talk_directly_with_cls_bpf() {
    uninstall_removes_every_trace(AttachMode::ClsBpf);
}

fn uninstall_removes_every_trace(mode: AttachMode) {
    let filters_mode = mode.on_this_kernel() == AttachMode::ClsBpf;
    // Dual stack: the IPv6 twins of the rule and route go too.
    let mut c = Cluster::dual_stack(2, &[("mesh", true)])
        .unwrap()
        .attaching(mode);
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    let node = c.nodes[0].clone();
    // Someone else's clsact qdisc on the server's veth, with a filter after
    // podlink's priority: both stay.
    let server_node = c.nodes[1].netns.clone();
    let tc = |netns_name: &str, args: &[&str]| in_node(netns_name, "tc", args);
    tc(
        &server_node,
        &["qdisc", "add", "dev", &server.host_veth, "clsact"],
    );
    tc(
        &server_node,
        &[
            "filter",
            "add",
            "dev",
            &server.host_veth,
            "ingress",
            "pref",
            "5",
            "bpf",
            "bytecode",
            "1,6 0 0 0",
        ],
    );
    // A strict reverse-path filter, which the agent relaxes to loose.
    netns::run(netns::command_in(&node.netns, "sysctl").args([
        "-q",
        "-w",
        "net.ipv4.conf.all.rp_filter=1",
    ]))
    .unwrap();
    let names = [
        "net.ipv4.tcp_early_demux".to_string(),
        "net.ipv4.ip_forward".to_string(),
        "net.ipv4.conf.all.rp_filter".to_string(),
        format!("net.ipv4.conf.{}.rp_filter", client.host_veth),
        format!("net.ipv4.conf.{}.accept_local", client.host_veth),
    ];
    let original: Vec<String> = names.iter().map(|n| sysctl(&node.netns, n)).collect();
    let cni_dir = c.dir.join("node1-cni");
    fs::create_dir_all(&cni_dir).unwrap();
    fs::write(cni_dir.join("10-k8s.conflist"), CONFLIST).unwrap();
    fs::write(cni_dir.join("20-other.conflist"), OTHER_CONFLIST).unwrap();

    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    app::exchange(&client.netns, server.addr(8000), b"meshed").unwrap();
    assert!(c.counters(&client).unwrap()["captured_outbound"] >= 1);
    // The agent did change things the uninstall must undo.
    let changed: Vec<String> = names.iter().map(|n| sysctl(&node.netns, n)).collect();
    assert_ne!(changed, original);
    assert!(in_node(&node.netns, "ip", &["rule"]).contains("lookup 1339"));
    assert!(in_node(&node.netns, "ip", &["-6", "rule"]).contains("lookup 1339"));
    assert!(
        in_node(&node.netns, "ip", &["-6", "route", "show", "table", "1339"])
            .contains("local default dev lo")
    );
    let report = c.inspect(0).unwrap();
    let link_ids: Vec<u64> = report["links"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["link_id"].as_u64().unwrap())
        .collect();
    let filters = report["filters"].as_array().unwrap().len();
    if filters_mode {
        assert_eq!((link_ids.len(), filters), (0, 2), "{report:#}");
        assert!(tc(&node.netns, &["qdisc", "show", "dev", &client.host_veth]).contains("clsact"));
    } else {
        assert_eq!((link_ids.len(), filters), (2, 0), "{report:#}");
    }
    assert_eq!(
        c.attachments(&server).unwrap().filters.len(),
        if filters_mode { 2 } else { 0 }
    );

    let uninstall = |c: &Cluster, node: usize, cni_dir: &std::path::Path| {
        let mut cmd = c.podlink_command(node, &["uninstall", "--pin-dir"]);
        cmd.arg(&c.nodes[node].pin_dir)
            .arg("--state-dir")
            .arg(&c.nodes[node].state_dir)
            .arg("--cni-conf-dir")
            .arg(cni_dir)
            .arg("--cni-socket")
            .arg(&c.nodes[node].cni_socket);
        cmd.output().unwrap()
    };

    // Refused while the agent runs; nothing is touched.
    let refused = uninstall(&c, 0, &cni_dir);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("agent is running"), "{stderr}");
    assert!(
        stderr.contains(&node.pin_dir.display().to_string()),
        "{stderr}"
    );
    assert!(c.is_captured(&client).unwrap());
    assert_eq!(
        fs::read_to_string(cni_dir.join("10-k8s.conflist")).unwrap(),
        CONFLIST
    );

    c.stop_agent(0).unwrap();
    c.stop_agent(1).unwrap();
    // An agent that starts while the pin directory is locked (as uninstall locks
    // it) is refused before it changes the node: early demux, which it turns off,
    // stays on.
    let demux = "net.ipv4.tcp_early_demux";
    netns::run(netns::command_in(&node.netns, "sysctl").args(["-q", "-w", &format!("{demux}=1")]))
        .unwrap();
    let dir = fs::File::open(&node.pin_dir).unwrap();
    // SAFETY: flock(2) on a descriptor this test owns; released when it is closed.
    let locked = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    assert_eq!(locked, 0, "{}", std::io::Error::last_os_error());
    let started = c.start_agent(0);
    drop(dir);
    let error = format!(
        "{:#}",
        started.expect_err("started on a locked pin directory")
    );
    assert!(error.contains("agent is running"), "{error}");
    assert_eq!(sysctl(&node.netns, demux), "1");
    // Back to the agent's value, which uninstall puts back to the original.
    netns::run(netns::command_in(&node.netns, "sysctl").args(["-q", "-w", &format!("{demux}=0")]))
        .unwrap();
    // The marker an agent killed inside an expedited-RCU window leaves: removed.
    // Planted only while the knob is 0, so that uninstall has no 1 to put back:
    // the machine's own setting is not the test's to change.
    if fs::read_to_string("/sys/kernel/rcu_expedited")
        .unwrap()
        .trim()
        == "0"
    {
        fs::write(node.state_dir.join("rcu_expedited.set"), "left\n").unwrap();
    }
    // The enrollment snapshot the agent kept beside its CNI socket, and the socket
    // file an agent that was killed leaves behind: both removed.
    let snapshot = node.cni_socket.with_file_name("enrollment.json");
    assert!(snapshot.is_file(), "{}", snapshot.display());
    if !node.cni_socket.exists() {
        drop(std::os::unix::net::UnixListener::bind(&node.cni_socket).unwrap());
    }
    let no_cni = c.dir.join("node2-cni");
    let mut said = String::new();
    for (n, dir) in [(0, &cni_dir), (1, &no_cni)] {
        let out = uninstall(&c, n, dir);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        said += &String::from_utf8_lossy(&out.stdout);
    }
    if filters_mode {
        // The qdisc podlink added to the client's veth goes; the server's, which
        // was someone else's, stays with their filter.
        for line in [
            format!(
                "removed the cls_bpf filter from_pod at ingress of {}",
                client.host_veth
            ),
            format!(
                "removed the cls_bpf filter to_pod at egress of {}",
                server.host_veth
            ),
            format!(
                "removed the clsact qdisc of {} (podlink added it)",
                client.host_veth
            ),
        ] {
            assert!(said.contains(&line), "{line:?} not in {said}");
        }
    }
    assert!(
        !said.contains(&format!("qdisc of {}", server.host_veth)),
        "{said}"
    );
    assert!(!tc(&node.netns, &["qdisc", "show", "dev", &client.host_veth]).contains("clsact"));
    assert!(tc(&server_node, &["qdisc", "show", "dev", &server.host_veth]).contains("clsact"));
    let left = tc(
        &server_node,
        &["filter", "show", "dev", &server.host_veth, "ingress"],
    );
    assert!(
        left.contains("pref 5 bpf") && left.contains("bytecode"),
        "{left}"
    );
    assert!(!left.contains("pref 1 "), "{left}");
    for pod in [&client, &server] {
        assert_eq!(c.attachments(pod).unwrap(), Default::default());
    }

    // No TCX program nor filter of podlink's on the node's interfaces, no link,
    // no rule, no route.
    let net = in_node(&node.netns, "bpftool", &["-j", "net", "show"]);
    assert!(
        !net.contains("from_pod") && !net.contains("to_pod"),
        "{net}"
    );
    let links: Value = serde_json::from_slice(
        &netns::run(Command::new("bpftool").args(["-j", "link", "show"]))
            .unwrap()
            .stdout,
    )
    .unwrap();
    for id in &link_ids {
        assert!(
            !links.as_array().unwrap().iter().any(|l| l["id"] == *id),
            "link {id} is still there: {links:#}"
        );
    }
    for family in ["-4", "-6"] {
        let rules = in_node(&node.netns, "ip", &[family, "rule"]);
        assert!(
            !rules.contains("1339") && !rules.contains("0x1000"),
            "{family}: {rules}"
        );
        let routes = netns::command_in(&node.netns, "ip")
            .args([family, "route", "show", "table", "1339"])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&routes.stdout).trim().is_empty(),
            "{family}: {routes:?}"
        );
    }
    // No pins; the state is gone; the sysctls are as they were.
    assert!(!node.pin_dir.exists(), "{}", node.pin_dir.display());
    assert!(!node.state_dir.exists());
    assert!(!snapshot.exists() && !node.cni_socket.exists());
    let restored: Vec<String> = names.iter().map(|n| sysctl(&node.netns, n)).collect();
    assert_eq!(restored, original, "{names:?}");
    // The conflist lost podlink-cni and nothing else; the other one is untouched.
    let mut expected: Value = serde_json::from_str(CONFLIST).unwrap();
    expected["plugins"].as_array_mut().unwrap().remove(1);
    let edited = fs::read_to_string(cni_dir.join("10-k8s.conflist")).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&edited).unwrap(), expected);
    assert_eq!(
        edited,
        CONFLIST.replace(
            "    {\n      \"type\": \"podlink-cni\",\n      \"socket\": \"/run/podlink/cni.sock\"\n    },\n",
            ""
        )
    );
    assert_eq!(
        fs::read_to_string(cni_dir.join("20-other.conflist")).unwrap(),
        OTHER_CONFLIST
    );
    assert_eq!(fs::read_dir(&cni_dir).unwrap().count(), 2);

    // Pods talk directly: plain TCP on the underlay, from the client's address.
    let capture = Capture::start(&node.netns, "eth0", &c.dir, "underlay").unwrap();
    let ex = app::exchange(&client.netns, server.addr(8000), b"direct-after-uninstall").unwrap();
    let (raw, lines) = capture.stop().unwrap();
    assert_eq!(ex.echoed, b"direct-after-uninstall");
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert!(
        contains_bytes(&raw, b"direct-after-uninstall"),
        "{lines:#?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains(".15008")),
        "no HBONE: {lines:#?}"
    );
    assert_eq!(echo.accepted(), 2);
    // And over IPv6.
    let _echo6 = app::EchoServer::start(&server.netns, server.addr6(8000)).unwrap();
    let ex = app::exchange(&client.netns, server.addr6(8000), b"direct-over-ipv6").unwrap();
    assert_eq!(ex.echoed, b"direct-over-ipv6");
    assert_eq!(ex.peer_seen.ip(), client.ip_of(Family::V6));

    // Twice is harmless.
    for (n, dir) in [(0, &cni_dir), (1, &no_cni)] {
        let out = uninstall(&c, n, dir);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("nothing of podlink's was left"));
    }
    assert_eq!(
        fs::read_to_string(cni_dir.join("10-k8s.conflist")).unwrap(),
        edited
    );
}
