//! Bad manifests are reported with file and line and change nothing else: the
//! agent keeps serving, a broken file keeps its last good objects, other files keep
//! being applied.

use std::time::Duration;

use podlink_tests::{Cluster, PodSpec, app};

#[test]
fn malformed_manifests_are_reported_and_tolerated() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let a = c.add_pod(PodSpec::new("a", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_captured(&a, true).unwrap();

    // A file that is not YAML at all.
    let broken = c.manifests.join("broken.yaml");
    std::fs::write(
        &broken,
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: [oops\n",
    )
    .unwrap();
    // A Pod with a bad address, in its own file.
    std::fs::write(
        c.manifests.join("bad-ip.yaml"),
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: bad\n  namespace: mesh\nspec:\n  containers: []\nstatus:\n  podIP: 10.0.0.999\n",
    )
    .unwrap();
    // A valid pod added after them is still enrolled.
    let b = c.add_pod(PodSpec::new("b", "mesh", 0)).unwrap();
    c.wait_captured(&b, true).unwrap();

    // Rewrite pod a's own manifest in place, broken: while it is written and once
    // it is found broken, pod a stays enrolled with its last good version.
    let a_manifest = c.manifests.join("pod-mesh-a.yaml");
    let good = std::fs::read_to_string(&a_manifest).unwrap();
    std::fs::write(&a_manifest, "").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    std::fs::write(&a_manifest, good.replace("spec:", "spec: [")).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(c.is_captured(&a).unwrap());

    let log = c.agent_log(0);
    let want = [
        format!("{}:5:", broken.display()),
        "status.podIP \"10.0.0.999\" is not an IP address".to_string(),
        format!("{}:", a_manifest.display()),
    ];
    for w in &want {
        assert!(log.contains(w.as_str()), "log lacks {w:?}:\n{log}");
    }

    // Traffic between the two still flows; the agent is alive.
    let _echo = app::EchoServer::start(&b.netns, b.addr(8000)).unwrap();
    let ex = app::exchange(&a.netns, b.addr(8000), b"still fine").unwrap();
    assert_eq!(ex.echoed, b"still fine");

    // A fixed version is applied: it opts pod a out, which shows.
    std::fs::write(
        &a_manifest,
        good.replace("labels: {}", "labels: {istio.io/dataplane-mode: none}"),
    )
    .unwrap();
    std::fs::remove_file(&broken).unwrap();
    c.wait_captured(&a, false).unwrap();
    let ex = app::exchange(&a.netns, b.addr(8000), b"fixed").unwrap();
    assert_eq!(ex.echoed, b"fixed");
}

/// An enrolled pod of this node that no veth leads to (a manifest with no
/// sandbox behind it) is reported once it has had no host route for 30 s, with
/// its address; it is not captured.
#[test]
fn an_enrolled_pod_without_a_veth_is_reported() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let a = c.add_pod(PodSpec::new("a", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_captured(&a, true).unwrap();
    let node = c.nodes[0].name.clone();
    let ip = std::net::Ipv4Addr::from(u32::from(c.nodes[0].pod_cidr) + 200);
    c.write_manifest(
        "ghost.yaml",
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: ghost\n  namespace: mesh\nspec:\n  nodeName: {node}\nstatus:\n  phase: Running\n  podIP: {ip}\n"
        ),
    )
    .unwrap();
    c.wait_log_lines(
        0,
        &[
            "has had no host route for 30 s",
            &ip.to_string(),
            "mesh/ghost",
        ],
        1,
        Duration::from_secs(60),
    )
    .unwrap();
    // The agent goes on serving the pods it has.
    assert!(c.is_captured(&a).unwrap());
}

/// A pod defined in two files is warned about once, naming both files, and not
/// again at each rebuild while it stays so; once fixed and broken again, it is
/// warned about again.
#[test]
fn a_pod_defined_twice_is_warned_about_once_while_it_is() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let a = c.add_pod(PodSpec::new("a", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_captured(&a, true).unwrap();
    // The copy carries a label of its own, so that the agent's view shows which
    // definition it uses: the copy's, since its file sorts first.
    let original = std::fs::read_to_string(c.manifests.join("pod-mesh-a.yaml")).unwrap();
    let copy = original.replace("labels: {}", "labels: {copy: \"yes\"}");
    assert_ne!(copy, original, "pod manifests changed shape: {original}");
    let needles = [
        "pod mesh/a is defined 2 times",
        "copy-of-a.yaml",
        "pod-mesh-a.yaml",
    ];
    let warnings = |c: &Cluster| c.log_lines(0, &needles);
    let copy_used = |c: &Cluster| {
        let dump = c.config_dump(0).unwrap();
        let a = dump["workloads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["namespace"] == "mesh" && w["name"] == "a")
            .cloned()
            .unwrap_or_else(|| panic!("no workload mesh/a in {dump}"));
        a["labels"]["copy"] == "yes"
    };
    c.write_manifest("copy-of-a.yaml", &copy).unwrap();
    c.wait_log_lines(0, &needles, 1, Duration::from_secs(10))
        .unwrap();
    assert!(copy_used(&c));

    // Two more pods: the workload index is updated for each while a stays
    // defined twice.
    for name in ["b", "d"] {
        let pod = c.add_pod(PodSpec::new(name, "mesh", 0)).unwrap();
        c.wait_captured(&pod, true).unwrap();
    }
    assert_eq!(warnings(&c), 1, "{}", c.agent_log(0));
    assert!(c.is_captured(&a).unwrap());

    // Fixed (the copy removed: applied once the agent uses the original
    // definition again), then defined twice again: a new warning.
    c.remove_manifest("copy-of-a.yaml").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while copy_used(&c) {
        assert!(
            std::time::Instant::now() < deadline,
            "the copy's removal was never applied:\n{}",
            c.agent_log(0)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(warnings(&c), 1, "{}", c.agent_log(0));
    c.write_manifest("copy-of-a.yaml", &copy).unwrap();
    c.wait_log_lines(0, &needles, 2, Duration::from_secs(10))
        .unwrap();
}
