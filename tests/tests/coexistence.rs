//! Capture shares the host veth with other programs. A TCX program attached before
//! podlink keeps running on the packets podlink passes and stays attached when
//! podlink detaches; a `clsact` qdisc with its filters outlives podlink's links (the
//! qdisc is never deleted).

use std::{process::Command, time::Duration};

use aya::{
    Ebpf,
    programs::{LinkOrder, SchedClassifier, TcAttachType, tc::TcAttachOptions},
};
use podlink_tests::{Cluster, PodSpec, app, netns};

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

#[test]
fn other_programs_on_the_host_veth_keep_working_and_outlive_capture() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
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
    // Someone else's TCX program at egress: podlink's own object loaded a second
    // time with empty maps of its own, so it passes every packet on (TCX_NEXT).
    let _stats = BpfStats::enable();
    // Loaded and attached from inside the node namespace (interfaces are looked up
    // by name there); the object, which owns the link, comes back to this thread.
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
            program
                .attach_with_options(
                    &veth,
                    TcAttachType::Egress,
                    TcAttachOptions::TcxOrder(LinkOrder::last()),
                )
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
    let attached = |node: &str, veth: &str| -> Vec<u32> {
        let veth = veth.to_string();
        netns::in_netns(node, move || {
            let (_, programs) = SchedClassifier::query_tcx(&veth, TcAttachType::Egress)
                .map_err(std::io::Error::other)?;
            Ok(programs.iter().map(|p| p.id()).collect())
        })
        .unwrap()
    };
    let order = attached(&node, &veth);
    assert_eq!(order.len(), 2, "{order:?}");
    assert_eq!(
        order.last(),
        Some(&other_id),
        "podlink's program runs first: {order:?}"
    );

    // Captured traffic works, and the other program still sees what podlink passes
    // at egress (the proxy's packets to the pod).
    let before = runs(&other);
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    let ex = app::exchange(&pod.netns, server.addr(8000), b"hi").unwrap();
    assert_eq!(ex.echoed, b"hi");
    assert!(c.counters(&pod).unwrap()["captured_outbound"] >= 1);
    assert!(runs(&other) > before, "the other program stopped running");

    // Un-enrolled: podlink's links go; the other program, the qdisc and both
    // filters stay.
    c.set_pod_labels(
        "a",
        [("istio.io/dataplane-mode".to_string(), "none".to_string())].into(),
    )
    .unwrap();
    c.wait_captured(&pod, false).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(attached(&node, &veth), vec![other_id]);
    assert!(tc(&["-n", &node, "qdisc", "show", "dev", &veth]).contains("clsact"));
    for dir in ["ingress", "egress"] {
        assert!(
            tc(&["-n", &node, "filter", "show", "dev", &veth, dir]).contains("bytecode"),
            "the {dir} filter is gone"
        );
    }
    drop(other);
}
