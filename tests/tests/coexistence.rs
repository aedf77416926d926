//! Capture shares the host veth with other programs. Another program attached
//! before podlink — a TCX program where the agent attaches TCX links, a `cls_bpf`
//! filter at a later priority where it attaches `cls_bpf` filters — keeps running
//! on the packets podlink passes and stays attached when podlink detaches; a
//! `clsact` qdisc that was there before podlink, with its filters, outlives
//! podlink's attachments and `podlink uninstall`.

use std::{process::Command, time::Duration};

use aya::{
    Ebpf,
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        tc::{NlOptions, TcAttachOptions, TcHandle},
    },
};
use podlink_tests::{AttachMode, Cluster, PodSpec, app, netns};
use serde_json::Value;

/// The priority of the other program's filter: after podlink's.
const OTHER_PREF: u16 = 10;

/// Turns `kernel.bpf_stats_enabled` on (programs count their runs) and restores it.
struct BpfStats(String);

impl BpfStats {
    fn enable() -> Self {
        let old = std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").unwrap();
        std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1").unwrap();
        Self(old.trim().to_string())
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/kernel/bpf_stats_enabled", &self.0);
    }
}

fn tc(args: &[&str]) -> String {
    let out = netns::run(Command::new("tc").args(args)).unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The test bed's notion of podlink's filters is the agent's.
#[test]
fn the_test_beds_filter_place_is_the_agents() {
    use podlink_agent::dataplane::tc::{FILTER_HANDLE, FILTER_PRIORITY};
    assert_eq!(podlink_tests::FILTER_PREF, u64::from(FILTER_PRIORITY));
    assert_eq!(podlink_tests::FILTER_HANDLE, format!("{FILTER_HANDLE:#x}"));
}

#[test]
fn other_programs_on_the_host_veth_keep_working_and_outlive_capture() {
    other_programs_keep_working(AttachMode::Auto);
}

#[test]
fn other_filters_on_the_host_veth_keep_working_and_outlive_capture_with_cls_bpf() {
    other_programs_keep_working(AttachMode::ClsBpf);
}

fn other_programs_keep_working(mode: AttachMode) {
    let tcx = mode.on_this_kernel() == AttachMode::Tcx;
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)])
        .unwrap()
        .attaching(mode);
    let pod = c.add_pod(PodSpec::new("a", "mesh", 0)).unwrap();
    let server = c
        .add_pod(PodSpec::new("b", "mesh", 0).label("istio.io/dataplane-mode", "none"))
        .unwrap();
    let node = c.nodes[0].netns.clone();
    let veth = pod.host_veth.clone();

    // Someone else's classic tc filter, on a clsact qdisc of theirs.
    tc(&["-n", &node, "qdisc", "add", "dev", &veth, "clsact"]);
    for dir in ["ingress", "egress"] {
        tc(&[
            "-n",
            &node,
            "filter",
            "add",
            "dev",
            &veth,
            dir,
            "bpf",
            "bytecode",
            "1,6 0 0 0",
            "classid",
            "1:1",
        ]);
    }
    // Someone else's program at egress, last among TCX programs or as a filter at
    // a later priority than podlink's: podlink's own object loaded a second time
    // with empty maps of its own, so it passes every packet on (TC_ACT_UNSPEC:
    // TCX_NEXT, or the next filter).
    let _stats = BpfStats::enable();
    // Loaded and attached from inside the node namespace (interfaces are looked up
    // by name there); the object, which owns the link (a TCX link, or the filter,
    // deleted when the object goes), comes back to this thread.
    let other: Ebpf = {
        let veth = veth.clone();
        netns::in_netns(&node, move || {
            let mut other = Ebpf::load(podlink_agent::dataplane::ebpf_object())
                .map_err(std::io::Error::other)?;
            let program: &mut SchedClassifier = other
                .program_mut("to_pod")
                .expect("the object has to_pod")
                .try_into()
                .map_err(std::io::Error::other)?;
            program.load().map_err(std::io::Error::other)?;
            let options = if tcx {
                TcAttachOptions::TcxOrder(LinkOrder::last())
            } else {
                TcAttachOptions::Netlink(NlOptions {
                    priority: OTHER_PREF,
                    handle: TcHandle::new(0, 1),
                    classid: None,
                })
            };
            program
                .attach_with_options(&veth, TcAttachType::Egress, options)
                .map_err(std::io::Error::other)?;
            Ok(other)
        })
        .unwrap()
    };
    let other_id = {
        let p: &SchedClassifier = other.program("to_pod").unwrap().try_into().unwrap();
        p.info().unwrap().id()
    };
    let runs = |other: &Ebpf| -> u64 {
        let p: &SchedClassifier = other.program("to_pod").unwrap().try_into().unwrap();
        p.info().unwrap().run_count()
    };

    c.start_agent(0).unwrap();
    c.wait_captured(&pod, true).unwrap();
    // The programs at egress in the order they run: TCX programs, then the
    // filters by priority (by program id, or the classic filter's kind).
    let egress = |node: &str, veth: &str| -> Vec<String> {
        let mut order: Vec<String> = {
            let veth = veth.to_string();
            if tcx {
                netns::in_netns(node, move || {
                    let (_, programs) = SchedClassifier::query_tcx(&veth, TcAttachType::Egress)
                        .map_err(std::io::Error::other)?;
                    Ok(programs.iter().map(|p| format!("tcx {}", p.id())).collect())
                })
                .unwrap()
            } else {
                Vec::new()
            }
        };
        let shown: Value = serde_json::from_str(&tc(&[
            "-n", node, "-j", "filter", "show", "dev", veth, "egress",
        ]))
        .unwrap();
        order.extend(
            shown
                .as_array()
                .unwrap()
                .iter()
                // The priorities' heads carry no options.
                .filter(|f| f.get("options").is_some())
                .map(|f| match f["options"]["prog"]["id"].as_u64() {
                    Some(id) => format!("pref {} {id}", f["pref"]),
                    None => format!("pref {} classic", f["pref"]),
                }),
        );
        order
    };
    let order = egress(&node, &veth);
    let podlinks = |order: &[String]| -> Vec<String> {
        order
            .iter()
            .filter(|p| !p.contains("classic") && !p.ends_with(&format!(" {other_id}")))
            .cloned()
            .collect()
    };
    // podlink's program runs first, the other one next, the classic filter last.
    assert_eq!(order.len(), 3, "{order:?}");
    assert_eq!(podlinks(&order), order[..1], "{order:?}");
    assert!(order[1].ends_with(&format!(" {other_id}")), "{order:?}");
    assert!(order[2].ends_with("classic"), "{order:?}");
    if !tcx {
        assert!(order[0].starts_with("pref 1 "), "{order:?}");
        assert!(
            order[1].starts_with(&format!("pref {OTHER_PREF} ")),
            "{order:?}"
        );
    }

    // Captured traffic works, and the other program still sees what podlink passes
    // at egress (the proxy's packets to the pod).
    let before = runs(&other);
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let ex = app::exchange(&pod.netns, server.addr(8000), b"hi").unwrap();
    assert_eq!(ex.echoed, b"hi");
    assert!(c.counters(&pod).unwrap()["captured_outbound"] >= 1);
    assert!(runs(&other) > before, "the other program stopped running");

    // Un-enrolled: podlink's attachments go; the other program, the qdisc and
    // both classic filters stay.
    c.set_pod_labels(
        "a",
        [("istio.io/dataplane-mode".to_string(), "none".to_string())].into(),
    )
    .unwrap();
    c.wait_captured(&pod, false).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let stays = |c: &Cluster| {
        let order = egress(&node, &veth);
        assert!(podlinks(&order).is_empty(), "{order:?}");
        assert_eq!(order.len(), 2, "{order:?}");
        assert!(order[0].ends_with(&format!(" {other_id}")), "{order:?}");
        assert!(tc(&["-n", &node, "qdisc", "show", "dev", &veth]).contains("clsact"));
        for dir in ["ingress", "egress"] {
            assert!(
                tc(&["-n", &node, "filter", "show", "dev", &veth, dir]).contains("bytecode"),
                "the {dir} filter is gone"
            );
        }
        assert_eq!(c.attachments(&pod).unwrap(), Default::default());
    };
    stays(&c);

    // Uninstalled: the qdisc was there before podlink, it stays with what is on it.
    c.stop_agent(0).unwrap();
    let n = &c.nodes[0];
    let out = netns::run(
        c.podlink_command(0, &["uninstall", "--pin-dir"])
            .arg(&n.pin_dir)
            .arg("--state-dir")
            .arg(&n.state_dir)
            .arg("--cni-conf-dir")
            .arg(c.dir.join("no-cni"))
            .arg("--cni-socket")
            .arg(&n.cni_socket),
    )
    .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("qdisc"), "{said}");
    stays(&c);
    // A filter is deleted by interface index: in the namespace it is in.
    netns::in_netns(&node, move || {
        drop(other);
        Ok(())
    })
    .unwrap();
}
