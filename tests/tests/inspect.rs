//! `podlink inspect` reads the pins and podlink's filters, with the agent running
//! and stopped: enrolled pods with their addresses, flags, links (or `cls_bpf`
//! filters) and counters, and what a pod deleted while no agent ran leaves: a
//! dangling link, or a pod entry without attachments (its filters went with its
//! veth).
//! `podlink preflight` reports the kernel as the agent found it at start.

use std::process::Command;

use podlink_tests::{AttachMode, Cluster, Pod, PodSpec, app, netns};
use serde_json::Value;

/// The `pods` entry of `pod` in an inspect report.
fn pod_entry<'a>(report: &'a Value, pod: &Pod) -> &'a Value {
    report["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["interface"] == pod.host_veth.as_str())
        .unwrap_or_else(|| panic!("{} missing from {report:#}", pod.name))
}

/// The link ids of `ifindex` in an inspect report, by program.
fn link_ids(report: &Value, ifindex: u32) -> Vec<(String, u64)> {
    let mut ids: Vec<(String, u64)> = report["links"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["ifindex"] == ifindex)
        .map(|l| {
            (
                l["program"].as_str().unwrap().to_string(),
                l["link_id"].as_u64().unwrap(),
            )
        })
        .collect();
    ids.sort();
    ids
}

/// The filters of `ifindex` in an inspect report: program, direction, priority,
/// handle and the name of the program it runs.
fn filters(report: &Value, ifindex: u32) -> Vec<(String, String, u64, String, String)> {
    report["filters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["ifindex"] == ifindex)
        .map(|f| {
            (
                f["program"].as_str().unwrap().to_string(),
                f["direction"].as_str().unwrap().to_string(),
                f["priority"].as_u64().unwrap(),
                f["handle"].as_str().unwrap().to_string(),
                f["program_name"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[test]
fn inspect_shows_pods_links_counters_and_dangling_links() {
    inspect_shows(AttachMode::Auto);
}

#[test]
fn inspect_shows_pods_filters_counters_and_what_a_deleted_pod_leaves_with_cls_bpf() {
    inspect_shows(AttachMode::ClsBpf);
}

fn inspect_shows(mode: AttachMode) {
    let tcx = mode.on_this_kernel() == AttachMode::Tcx;
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)])
        .unwrap()
        .attaching(mode);
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    app::exchange(&client.netns, server.addr(8000), b"counted").unwrap();

    // With the agent running.
    let seen_by_bpftool = c.counters(&client).unwrap();
    let report = c.inspect(0).unwrap();
    assert_eq!(
        report["layout"],
        format!("v{}", podlink_common::LAYOUT_VERSION),
        "{report:#}"
    );
    assert_eq!(report["problems"], serde_json::json!([]), "{report:#}");
    let kernel_links: Value = serde_json::from_slice(
        &netns::run(Command::new("bpftool").args(["-j", "link", "show"]))
            .unwrap()
            .stdout,
    )
    .unwrap();
    for pod in [&client, &server] {
        let entry = pod_entry(&report, pod);
        let ifindex = c.host_ifindex(pod).unwrap();
        assert_eq!(entry["ifindex"], ifindex);
        assert_eq!(entry["ipv4"], pod.ip.to_string());
        assert_eq!(
            entry["flags"],
            serde_json::json!(["enrolled", "has_ipv4", "dns_capture"])
        );
        if !tcx {
            // podlink's filters, running its programs; no link.
            assert_eq!(
                filters(&report, ifindex),
                [
                    (
                        "from_pod".into(),
                        "ingress".into(),
                        1,
                        "0x53b".into(),
                        "from_pod".into()
                    ),
                    (
                        "to_pod".into(),
                        "egress".into(),
                        1,
                        "0x53b".into(),
                        "to_pod".into()
                    ),
                ],
                "{report:#}"
            );
            assert!(link_ids(&report, ifindex).is_empty(), "{report:#}");
            continue;
        }
        assert!(filters(&report, ifindex).is_empty(), "{report:#}");
        let links = link_ids(&report, ifindex);
        assert_eq!(
            links.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
            ["from_pod", "to_pod"],
            "{report:#}"
        );
        // The ids are the kernel's links, running podlink's programs.
        for (program, id) in &links {
            let link = report["links"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["link_id"] == *id)
                .unwrap();
            assert_eq!(link["program_name"], program.as_str());
            let kernel = kernel_links
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["id"] == *id)
                .unwrap_or_else(|| panic!("link {id} not in bpftool link show"));
            assert_eq!(kernel["prog_id"], link["program_id"]);
        }
    }
    for pod in [&client, &server] {
        let entry = pod_entry(&report, pod);
        let total: u64 = entry["counters"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert!(total > 0, "{entry:#}");
    }
    // Counters are bpftool's per-CPU values summed (they only grow).
    let counters = pod_entry(&report, &client)["counters"].as_object().unwrap();
    assert_eq!(counters.len(), seen_by_bpftool.len());
    for (name, value) in &seen_by_bpftool {
        assert!(counters[name].as_u64().unwrap() >= *value, "{name}");
    }
    assert!(counters["captured_outbound"].as_u64().unwrap() >= 1);

    // With the agent stopped, the same pins read the same.
    c.stop_agent(0).unwrap();
    let stopped = c.inspect(0).unwrap();
    assert_eq!(stopped["problems"], serde_json::json!([]), "{stopped:#}");
    assert_eq!(stopped["links"], report["links"]);
    assert_eq!(stopped["filters"], report["filters"]);
    assert_eq!(stopped["pods"].as_array().unwrap().len(), 2);

    // The server pod goes (CNI DEL removes its veth) while no agent runs.
    let gone = c.host_ifindex(&server).unwrap();
    c.remove_pod("server").unwrap();
    let after = c.inspect(0).unwrap();
    let problems: Vec<(&str, u64)> = after["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["kind"].as_str().unwrap(), p["ifindex"].as_u64().unwrap()))
        .collect();
    let gone = u64::from(gone);
    assert!(
        problems.contains(&("pod_interface_gone", gone)),
        "{after:#}"
    );
    assert!(
        problems.iter().all(|(_, i)| *i == gone),
        "only the deleted pod is inconsistent: {after:#}"
    );
    if tcx {
        assert!(
            problems
                .iter()
                .filter(|p| **p == ("link_interface_gone", gone))
                .count()
                == 2,
            "{after:#}"
        );
        // Inspecting changed nothing: the dangling links are still pinned.
        assert_eq!(after["links"].as_array().unwrap().len(), 4);
        for program in ["from_pod", "to_pod"] {
            assert!(
                c.nodes[0]
                    .pins()
                    .join("links")
                    .join(format!("{gone}_{program}"))
                    .exists()
            );
        }
    } else {
        // The filters went with the veth; the pod's entry is left without any.
        assert!(problems.contains(&("pod_without_links", gone)), "{after:#}");
        assert_eq!(after["filters"].as_array().unwrap().len(), 2, "{after:#}");
    }
    // The table says it too.
    let out = netns::run(
        c.podlink_command(0, &["inspect", "--pin-dir"])
            .arg(&c.nodes[0].pin_dir),
    )
    .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    if tcx {
        assert!(table.contains("link_interface_gone"), "{table}");
    } else {
        assert!(table.contains("pod_without_links"), "{table}");
        assert!(table.contains("FILTERS (cls_bpf)"), "{table}");
        assert!(table.contains("0x53b"), "{table}");
    }
    assert!(table.contains(&client.host_veth), "{table}");
    assert!(table.contains(&client.ip.to_string()), "{table}");
}

/// The agent logs the preflight's summary at start: the line `podlink preflight
/// --json` gives, for this kernel, which lacks nothing; and it attaches the way
/// the preflight says (TCX links pinned, or none with cls_bpf).
#[test]
fn preflight_summary_is_logged_at_start_as_the_command_reports_it() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let pod = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_all_captured(&[&pod]).unwrap();

    let report = c.preflight(0).unwrap();
    assert_eq!(report["missing"], serde_json::json!([]), "{report:#}");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(report["release"], release.trim(), "{report:#}");
    let summary = report["summary"].as_str().unwrap();
    assert!(
        summary.starts_with(&format!("kernel {}", release.trim())),
        "{summary}"
    );
    let log = c.agent_log(0);
    assert!(
        log.lines()
            .any(|l| l.contains(" INFO ") && l.ends_with(&format!("preflight: {summary}"))),
        "no preflight summary \"{summary}\" in the agent's log:\n{log}"
    );
    // Every helper the programs call was probed and found.
    let helpers: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["what"].as_str())
        .filter(|w| w.starts_with("bpf_"))
        .collect();
    assert!(helpers.contains(&"bpf_sk_assign"), "{report:#}");

    let links = link_ids(&c.inspect(0).unwrap(), c.host_ifindex(&pod).unwrap());
    match report["attach"].as_str() {
        Some("tcx") => assert_eq!(links.len(), 2, "{links:?}"),
        Some("cls_bpf") => assert_eq!(links, [], "cls_bpf filters are not pinned"),
        other => panic!("attach {other:?}: {report:#}"),
    }
}
