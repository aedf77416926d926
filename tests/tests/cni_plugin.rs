//! podlink-cni driven as a container runtime drives it: the agent installs the
//! plugin (`--install-cni`) at the end of the node's conflist (`ptp` with
//! `host-local`, Debian's containernetworking-plugins), and the test runs that
//! list with libcni's semantics (tests/src/cni_runtime.rs). ADD returns once the
//! pod is captured, so its very first SYN goes through the proxy; pods that need
//! nothing pass untouched; with the agent down an ambient pod's ADD fails closed;
//! `podlink uninstall` takes the plugin out again.

use std::{
    fs,
    io::Write,
    net::{IpAddr, Ipv4Addr},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use podlink_tests::{
    CNI_BIN_DIR, Cluster, Pod, PodSpec, app,
    cni_runtime::{self, Sandbox},
    podlink_cni_bin,
};
use serde_json::{Value, json};

/// The other conflist, after ours in lexical order: never touched.
const OTHER: &str = r#"{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"bridge"}]}"#;

struct Bed {
    c: Cluster,
    conf: PathBuf,
    bin: PathBuf,
    ptp: Value,
}

/// One node, namespaces `mesh` (ambient) and `plain`; the node's conflist holds
/// `ptp` only until the agent adds itself.
fn bed() -> Bed {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true), ("plain", false)]).unwrap();
    let conf = c.dir.join("net.d");
    let bin = c.dir.join("cni-bin");
    fs::create_dir_all(&conf).unwrap();
    let ptp = json!({
        "type": "ptp",
        "ipMasq": false,
        "mtu": 1500,
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": format!("{}/24", c.nodes[0].pod_cidr)}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            // The test bed's own pods take addresses from the same store.
            "dataDir": c.dir.join("cni-ipam").join(&c.nodes[0].name),
        }
    });
    let list = json!({"cniVersion": "1.0.0", "name": "podlink-testbed", "plugins": [ptp]});
    fs::write(
        conf.join("10-podlink-testbed.conflist"),
        serde_json::to_string_pretty(&list).unwrap() + "\n",
    )
    .unwrap();
    fs::write(conf.join("20-other.conflist"), OTHER).unwrap();
    let plugin = podlink_cni_bin();
    assert!(
        plugin.exists(),
        "{} is missing: run `cargo xtask build`",
        plugin.display()
    );
    c.start_agent_with(
        0,
        &[
            "--install-cni",
            "--cni-plugin",
            plugin.to_str().unwrap(),
            "--cni-bin-dir",
            bin.to_str().unwrap(),
            "--cni-conf-dir",
            conf.to_str().unwrap(),
        ],
    )
    .unwrap();
    Bed { c, conf, bin, ptp }
}

impl Bed {
    /// The pod's sandbox parameters (and a new network namespace for it).
    fn sandbox(&mut self, name: &str, namespace: &str) -> (Sandbox, String) {
        let netns = self.c.add_pod_netns(name).unwrap();
        let sandbox = Sandbox::pod(
            &self.c.nodes[0].netns,
            &format!("{}-{name}", self.c.id),
            &netns,
            namespace,
            name,
            vec![PathBuf::from(CNI_BIN_DIR), self.bin.clone()],
        );
        (sandbox, netns)
    }

    fn list(&self) -> Value {
        cni_runtime::load_conflist(&self.conf).unwrap().1
    }
}

/// The test bed's view of a pod wired by the conflist, from the list's result.
fn pod_of(result: &Value, name: &str, namespace: &str, netns: &str, sandbox: &Sandbox) -> Pod {
    let host_veth = result["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i.get("sandbox").is_none())
        .and_then(|i| i["name"].as_str())
        .unwrap()
        .to_string();
    let ip: Ipv4Addr = result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .unwrap()
        .parse()
        .unwrap();
    Pod {
        name: name.into(),
        namespace: namespace.into(),
        node: 0,
        netns: netns.into(),
        ip,
        ipv6: None,
        host_veth,
        labels: Default::default(),
        annotations: Default::default(),
        service_account: "default".into(),
        owner: None,
        container_id: sandbox.container_id.clone(),
    }
}

/// Runs podlink-cni directly with `stdin` and the environment of an ADD (minus
/// `without`); returns its exit success and its stdout parsed.
fn run_plugin(stdin: &[u8], without: &str) -> (bool, Value) {
    let mut cmd = Command::new(podlink_cni_bin());
    for (k, v) in [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c-direct"),
        ("CNI_NETNS", "/run/netns/none"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=direct"),
    ] {
        if k != without {
            cmd.env(k, v);
        }
    }
    let mut child = cmd
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "podlink-cni printed no JSON ({e}): {} / {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), stdout)
}

fn wait_no_map_entry(c: &Cluster, ifindex: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pods = c.dump_map(0, "pods").unwrap();
        if !pods
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["formatted"]["key"].as_u64() == Some(u64::from(ifindex)))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "entry for {ifindex} left: {pods}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn add_captures_the_first_syn_and_leaves_other_pods_untouched() {
    let mut bed = bed();
    let socket = bed.c.nodes[0].cni_socket.clone();

    // The agent installed itself: the binary, and an entry last in the first
    // conflist, the rest of which is as it was; the other conflist untouched.
    let (path, list) = cni_runtime::load_conflist(&bed.conf).unwrap();
    assert!(path.ends_with("10-podlink-testbed.conflist"));
    assert_eq!(
        list["plugins"],
        json!([bed.ptp, {"type": "podlink-cni", "socket": socket}]),
        "{list}"
    );
    assert_eq!(
        fs::read_to_string(bed.conf.join("20-other.conflist")).unwrap(),
        OTHER
    );
    let installed = bed.bin.join("podlink-cni");
    assert_eq!(
        fs::read(&installed).unwrap(),
        fs::read(podlink_cni_bin()).unwrap()
    );
    assert_eq!(
        fs::metadata(&installed).unwrap().permissions().mode() & 0o777,
        0o755
    );
    let snapshot: Value =
        serde_json::from_slice(&fs::read(socket.with_file_name("enrollment.json")).unwrap())
            .unwrap();
    assert_eq!(snapshot["ambientNamespaces"], json!(["mesh"]), "{snapshot}");

    // An enrolled server on the same node (made the test bed's way).
    let server = bed.c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    bed.c.wait_captured(&server, true).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();

    // The client's object is known (scheduled, no address yet) when the runtime
    // runs the list; ADD returns once the pod is captured.
    bed.c
        .list_pending(&PodSpec::new("client", "mesh", 0))
        .unwrap();
    let (sandbox, netns) = bed.sandbox("client", "mesh");
    let list = bed.list();
    let started = Instant::now();
    let results = cni_runtime::add(&list, &sandbox)
        .unwrap()
        .unwrap_or_else(|(_, f)| panic!("ADD failed: {f:?}\n{}", bed.c.agent_log(0)));
    eprintln!("ADD of an enrolled pod took {:?}", started.elapsed());
    // podlink-cni hands prevResult on unchanged.
    assert_eq!(results.len(), 2);
    assert_eq!(results[1], results[0]);
    let client = pod_of(&results[1], "client", "mesh", &netns, &sandbox);
    // Its very first connection is captured.
    assert!(bed.c.is_captured(&client).unwrap());
    let ex = app::exchange(&client.netns, server.addr(8000), b"first syn").unwrap();
    assert_eq!(ex.echoed, b"first syn");
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    let counters = bed.c.counters(&client).unwrap();
    assert_eq!(counters["captured_outbound"], 1, "{counters:?}");
    // Nothing of it was dropped or passed uncaptured from the pod's side.
    assert_eq!(counters["dropped_no_listener"], 0, "{counters:?}");
    bed.c
        .wait_log(0, &["CNI answered"])
        .expect("the agent logs its answer");

    // CHECK: attached.
    cni_runtime::check(&list, &sandbox, &results[1])
        .unwrap()
        .unwrap_or_else(|f| panic!("CHECK failed: {f:?}"));

    // A pod whose object reaches the agent only after ADD started: ADD waits.
    let (late_sandbox, late_netns) = bed.sandbox("late", "mesh");
    let late_add = std::thread::spawn({
        let list = list.clone();
        let sandbox = late_sandbox.clone();
        move || cni_runtime::add(&list, &sandbox)
    });
    std::thread::sleep(Duration::from_millis(500));
    bed.c
        .list_pending(&PodSpec::new("late", "mesh", 0))
        .unwrap();
    let late_results = late_add
        .join()
        .unwrap()
        .unwrap()
        .unwrap_or_else(|(_, f)| panic!("late ADD failed: {f:?}\n{}", bed.c.agent_log(0)));
    let late = pod_of(&late_results[1], "late", "mesh", &late_netns, &late_sandbox);
    assert!(bed.c.is_captured(&late).unwrap());

    // Pods that need nothing pass untouched: a plain namespace, an opted-out pod.
    for (name, spec) in [
        ("plain", PodSpec::new("plain", "plain", 0)),
        (
            "optout",
            PodSpec::new("optout", "mesh", 0).label("istio.io/dataplane-mode", "none"),
        ),
    ] {
        bed.c.list_pending(&spec).unwrap();
        let (sandbox, netns) = bed.sandbox(name, &spec.namespace);
        let results = cni_runtime::add(&list, &sandbox)
            .unwrap()
            .unwrap_or_else(|(_, f)| panic!("ADD of {name} failed: {f:?}"));
        assert_eq!(results[1], results[0]);
        let pod = pod_of(&results[1], name, &spec.namespace, &netns, &sandbox);
        assert_eq!(bed.c.capture_state(&pod).unwrap(), Some(false), "{name}");
        cni_runtime::check(&list, &sandbox, &results[1])
            .unwrap()
            .unwrap_or_else(|f| panic!("CHECK of {name} failed: {f:?}"));
    }

    // DEL, twice: both succeed; the pod's entry goes.
    let ifindex = bed.c.host_ifindex(&client).unwrap();
    for _ in 0..2 {
        cni_runtime::del(&list, &sandbox, Some(&results[1])).unwrap();
    }
    wait_no_map_entry(&bed.c, ifindex);
    // DEL of a pod never added is fine too.
    let (unknown, _) = bed.sandbox("never", "mesh");
    cni_runtime::del(&list, &unknown, None).unwrap();

    // Malformed input: the spec's error object, a non-zero exit, no panic.
    let (ok, error) = run_plugin(b"{not json", "");
    assert!(!ok);
    assert_eq!(error["code"], 6, "{error}");
    assert!(
        error["msg"].as_str().unwrap().contains("not JSON"),
        "{error}"
    );
    let config = |version: &str| {
        json!({"cniVersion": version, "name": "n", "type": "podlink-cni",
               "socket": socket, "prevResult": results[0]})
        .to_string()
    };
    let (ok, error) = run_plugin(config("9.9.9").as_bytes(), "");
    assert!(!ok);
    assert_eq!(error["code"], 1, "{error}");
    let (ok, error) = run_plugin(config("1.0.0").as_bytes(), "CNI_NETNS");
    assert!(!ok);
    assert_eq!(error["code"], 4, "{error}");
    assert!(
        error["msg"].as_str().unwrap().contains("CNI_NETNS"),
        "{error}"
    );
    // VERSION.
    let mut version = Command::new(podlink_cni_bin())
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    version
        .stdin
        .take()
        .unwrap()
        .write_all(br#"{"cniVersion":"1.0.0"}"#)
        .unwrap();
    let out = version.wait_with_output().unwrap();
    assert!(out.status.success());
    let versions: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        versions["supportedVersions"]
            .as_array()
            .unwrap()
            .contains(&json!("1.0.0"))
    );
    // The primary plugin rewrites its conflist without podlink-cni: the agent
    // adds itself again.
    let (path, _) = cni_runtime::load_conflist(&bed.conf).unwrap();
    let original = json!({"cniVersion": "1.0.0", "name": "podlink-testbed", "plugins": [bed.ptp]});
    fs::write(&path, original.to_string()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while bed.list()["plugins"].as_array().unwrap().len() != 2 {
        assert!(
            Instant::now() < deadline,
            "podlink-cni not added again:\n{}",
            bed.c.agent_log(0)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(bed.list()["plugins"][1]["type"], "podlink-cni");
}

#[test]
fn add_fails_closed_while_the_agent_is_down_and_uninstall_removes_the_plugin() {
    let mut bed = bed();
    let socket = bed.c.nodes[0].cni_socket.clone();
    assert!(socket.exists());
    bed.c.stop_agent(0).unwrap();
    // The socket goes with the agent; the snapshot stays.
    assert!(!socket.exists());
    assert!(socket.with_file_name("enrollment.json").exists());
    let list = bed.list();

    // An ambient pod: the plugin fails, naming the namespace and the socket.
    let (sandbox, _) = bed.sandbox("meshed", "mesh");
    let (before, failure) = cni_runtime::add(&list, &sandbox)
        .unwrap()
        .expect_err("ADD must fail closed");
    assert_eq!(failure.plugin, "podlink-cni");
    assert_eq!(failure.error["code"], 11, "{failure:?}");
    let msg = failure.error["msg"].as_str().unwrap();
    assert!(msg.contains("namespace mesh"), "{msg}");
    assert!(msg.contains(&socket.display().to_string()), "{msg}");
    assert_eq!(failure.error["cniVersion"], "1.0.0");
    // The runtime then deletes what the earlier plugins made.
    cni_runtime::del(&list, &sandbox, before.last()).unwrap();

    // A pod that needs nothing starts.
    let (sandbox, _) = bed.sandbox("bystander", "plain");
    let results = cni_runtime::add(&list, &sandbox)
        .unwrap()
        .unwrap_or_else(|(_, f)| panic!("ADD failed: {f:?}"));
    assert_eq!(results[1], results[0]);

    // Uninstall: the entry and the binary go, the rest of the list stays.
    let node = bed.c.nodes[0].clone();
    let out = bed
        .c
        .podlink_command(0, &["uninstall", "--pin-dir"])
        .arg(&node.pin_dir)
        .arg("--state-dir")
        .arg(&node.state_dir)
        .arg("--cni-conf-dir")
        .arg(&bed.conf)
        .arg("--cni-bin-dir")
        .arg(&bed.bin)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let after = bed.list();
    assert_eq!(after["plugins"], json!([bed.ptp]), "{after}");
    assert_eq!(after["name"], "podlink-testbed");
    assert!(!Path::new(&bed.bin.join("podlink-cni")).exists());
    assert_eq!(
        fs::read_to_string(bed.conf.join("20-other.conflist")).unwrap(),
        OTHER
    );
    // The pod is deleted with the list as it is now.
    cni_runtime::del(&after, &sandbox, Some(&results[1])).unwrap();
}
