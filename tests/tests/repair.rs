//! The agent's self-audit: each invariant of a captured pod is broken by hand —
//! a pinned TCX link detached (`bpftool link detach`) or unpinned, the pod's
//! pods-map entry deleted or overwritten, its host veth deleted and made again
//! under the same name (a new ifindex), its host route moved to another veth,
//! podlink's `cls_bpf` filter deleted (`tc filter del`), a stray pods-map entry
//! and link pin left behind — and the agent repairs it, names it in a warning and
//! counts it in `podlink_repairs_total{reason}`; traffic is then captured again
//! (the client's `captured_outbound` counter grows with a connection through the
//! proxy).

use std::{fs, net::SocketAddr, path::PathBuf, process::Command};

use podlink_tests::{AttachMode, Cluster, Pod, PodSpec, app, kernel_has_tcx, netns};
use serde_json::Value;

/// The echo server's port on the server pod.
const PORT: u16 = 7000;

/// A one-node cluster with a client and a server pod, both captured, the agent
/// attaching in `mode`, and an echo server on the server pod.
struct Bed {
    c: Cluster,
    client: Pod,
    server: Pod,
    _echo: app::EchoServer,
}

impl Bed {
    fn new(mode: AttachMode) -> Self {
        if mode == AttachMode::Tcx {
            assert!(
                kernel_has_tcx(),
                "this test needs TCX links (Linux 6.6 or later)"
            );
        }
        let mut c = Cluster::with_namespaces(1, &[("mesh", true)])
            .unwrap()
            .attaching(mode);
        let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
        let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
        c.start_agent(0).unwrap();
        c.wait_all_captured(&[&client, &server]).unwrap();
        let echo = app::EchoServer::start(&server.netns, server.addr(PORT)).unwrap();
        let bed = Bed {
            c,
            client,
            server,
            _echo: echo,
        };
        bed.assert_captured_traffic();
        bed
    }

    fn node_netns(&self) -> &str {
        &self.c.nodes[0].netns
    }

    /// The pin of the client's link for `program`.
    fn link_pin(&self, program: &str) -> PathBuf {
        let ifindex = self.c.host_ifindex(&self.client).unwrap();
        self.c.nodes[0]
            .pins()
            .join("links")
            .join(format!("{ifindex}_{program}"))
    }

    /// `podlink_repairs_total{reason}`.
    fn repairs(&self, reason: &str) -> f64 {
        self.c
            .metrics(0)
            .unwrap()
            .sum("podlink_repairs_total", &[("reason", reason)])
    }

    /// Waits until `podlink_repairs_total{reason}` is above `before`, and for the
    /// warning naming it.
    fn wait_repaired(&self, reason: &str, before: f64) {
        self.c
            .wait_metrics(0, &format!("a repair for {reason}"), |m| {
                m.sum("podlink_repairs_total", &[("reason", reason)]) > before
            })
            .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", self.c.agent_log(0)));
        self.c
            .wait_log_lines(
                0,
                &["audit:", &format!("reason={reason}"), "repairing"],
                1,
                std::time::Duration::from_secs(10),
            )
            .unwrap();
    }

    /// A connection from the client to the server goes through the proxy: the
    /// echo works and the client's `captured_outbound` counter grows by one.
    fn assert_captured_traffic(&self) {
        let before = self.c.counters(&self.client).unwrap();
        let before = before.get("captured_outbound").copied().unwrap_or(0);
        let dst: SocketAddr = self.server.addr(PORT);
        let ex = app::exchange(&self.client.netns, dst, b"repaired")
            .unwrap_or_else(|e| panic!("{dst}: {e}\n{}", self.c.agent_log(0)));
        assert_eq!(ex.echoed, b"repaired");
        let after = self.c.counters(&self.client).unwrap()["captured_outbound"];
        assert_eq!(
            after,
            before + 1,
            "the connection was not captured\n{}",
            self.c.agent_log(0)
        );
    }

    /// The keys of the node's pods map.
    fn pods_map_keys(&self) -> Vec<u64> {
        self.c
            .dump_map(0, "pods")
            .unwrap()
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["formatted"]["key"].as_u64())
            .collect()
    }
}

/// `key` as the bytes bpftool takes (`0x05 0x00 0x00 0x00`, little-endian).
fn key_bytes(key: u32) -> Vec<String> {
    key.to_le_bytes()
        .iter()
        .map(|b| format!("0x{b:02x}"))
        .collect()
}

/// Runs `bpftool args`.
fn bpftool(args: &[&str]) {
    netns::run(Command::new("bpftool").args(args)).unwrap();
}

/// A pods-map value of zeroes (`PodInfo`: two 16-byte addresses, flags,
/// workload id).
fn zero_pod_info() -> Vec<String> {
    vec!["0x00".to_string(); size_of::<podlink_common::PodInfo>()]
}

#[test]
fn the_audit_repairs_a_detached_and_an_unpinned_tcx_link() {
    let bed = Bed::new(AttachMode::Tcx);
    let pin = bed.link_pin("from_pod");
    let before = bed.repairs("link_detached");
    bpftool(&["link", "detach", "pinned", pin.to_str().unwrap()]);
    bed.wait_repaired("link_detached", before);
    bed.c.wait_captured(&bed.client, true).unwrap();
    bed.assert_captured_traffic();

    // A link whose pin is gone would go with the agent: pinned anew.
    let before = bed.repairs("link_unpinned");
    fs::remove_file(&pin).unwrap();
    bed.wait_repaired("link_unpinned", before);
    bed.c.wait_captured(&bed.client, true).unwrap();
    bed.assert_captured_traffic();
}

#[test]
fn the_audit_repairs_a_deleted_or_overwritten_map_entry() {
    let bed = Bed::new(AttachMode::Auto);
    let pods = bed.c.nodes[0].pins().join("pods");
    let pods = pods.to_str().unwrap();
    let ifindex = bed.c.host_ifindex(&bed.client).unwrap();
    let key = key_bytes(ifindex);
    let key: Vec<&str> = key.iter().map(String::as_str).collect();

    let before = bed.repairs("map_entry_missing");
    let mut args = vec!["map", "delete", "pinned", pods, "key"];
    args.extend(&key);
    bpftool(&args);
    bed.wait_repaired("map_entry_missing", before);
    bed.c.wait_captured(&bed.client, true).unwrap();
    bed.assert_captured_traffic();

    let before = bed.repairs("map_entry_wrong");
    let value = zero_pod_info();
    let mut args = vec!["map", "update", "pinned", pods, "key"];
    args.extend(&key);
    args.push("value");
    args.extend(value.iter().map(String::as_str));
    bpftool(&args);
    bed.wait_repaired("map_entry_wrong", before);
    bed.assert_captured_traffic();
}

#[test]
fn the_audit_repairs_a_deleted_cls_bpf_filter() {
    let bed = Bed::new(AttachMode::ClsBpf);
    let before = bed.repairs("filter_missing");
    netns::run(netns::command_in(bed.node_netns(), "tc").args([
        "filter",
        "del",
        "dev",
        &bed.client.host_veth,
        "ingress",
        "pref",
        "1",
        "handle",
        podlink_tests::FILTER_HANDLE,
        "bpf",
    ]))
    .unwrap();
    bed.wait_repaired("filter_missing", before);
    bed.c.wait_captured(&bed.client, true).unwrap();
    assert_eq!(
        bed.c.attachments(&bed.client).unwrap().filters,
        ["from_pod", "to_pod"]
    );
    bed.assert_captured_traffic();
}

#[test]
fn the_audit_repairs_stray_map_entries_and_link_pins() {
    let bed = Bed::new(AttachMode::Tcx);
    let pins = bed.c.nodes[0].pins();
    // An entry for an interface where nothing is captured.
    let stray: u32 = 4242;
    let before = bed.repairs("stale_map_entry");
    let key = key_bytes(stray);
    let value = zero_pod_info();
    let pods = pins.join("pods");
    let mut args = vec!["map", "update", "pinned", pods.to_str().unwrap(), "key"];
    args.extend(key.iter().map(String::as_str));
    args.push("value");
    args.extend(value.iter().map(String::as_str));
    bpftool(&args);
    bed.wait_repaired("stale_map_entry", before);
    assert!(!bed.pods_map_keys().contains(&u64::from(stray)));

    // A second pin of the client's link, named for another interface.
    let before = bed.repairs("stale_link");
    let stray_pin = pins.join("links").join(format!("{stray}_from_pod"));
    let link: Value = serde_json::from_slice(
        &netns::run(
            Command::new("bpftool")
                .args(["-j", "link", "show", "pinned"])
                .arg(bed.link_pin("from_pod")),
        )
        .unwrap()
        .stdout,
    )
    .unwrap();
    let id = link["id"].as_u64().unwrap().to_string();
    bpftool(&["link", "pin", "id", &id, stray_pin.to_str().unwrap()]);
    bed.wait_repaired("stale_link", before);
    assert!(!stray_pin.exists());
    // The pod's own link is untouched.
    bed.c.wait_captured(&bed.client, true).unwrap();
    bed.assert_captured_traffic();
}

/// `ip -j <args>` in namespace `netns`, parsed.
fn ip_json(netns: &str, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["-n", netns, "-j"];
    all.extend(args);
    let out = netns::ip(&all).unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The IPv4 addresses of `dev` in `netns` (`address/prefix`).
fn ipv4_addrs(netns: &str, dev: &str) -> Vec<String> {
    ip_json(netns, &["-4", "addr", "show", "dev", dev])
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

/// The IPv4 routes of `dev` in `netns` the kernel did not add itself, as
/// arguments of `ip route add` (without the device), those with a gateway last.
fn ipv4_routes(netns: &str, dev: &str) -> Vec<Vec<String>> {
    let mut routes: Vec<Vec<String>> = ip_json(netns, &["-4", "route", "show", "dev", dev])
        .iter()
        .filter(|r| r["protocol"] != "kernel")
        .map(|r| {
            let mut args = vec![r["dst"].as_str().unwrap().to_string()];
            if let Some(gw) = r["gateway"].as_str() {
                args.extend(["via".to_string(), gw.to_string()]);
            }
            if let Some(scope) = r["scope"].as_str() {
                args.extend(["scope".to_string(), scope.to_string()]);
            }
            if let Some(src) = r["prefsrc"].as_str() {
                args.extend(["src".to_string(), src.to_string()]);
            }
            args
        })
        .collect();
    routes.sort_by_key(|r| r.iter().any(|a| a == "via"));
    routes
}

/// Gives `dev` in `netns` the `addrs` and `routes` read before, and sets it up.
fn configure(netns: &str, dev: &str, addrs: &[String], routes: &[Vec<String>]) {
    netns::ip(&["-n", netns, "link", "set", dev, "up"]).unwrap();
    for addr in addrs {
        netns::ip(&["-n", netns, "addr", "add", addr, "dev", dev]).unwrap();
    }
    for route in routes {
        let mut args = vec!["-n", netns, "route", "replace"];
        args.extend(route.iter().map(String::as_str));
        args.extend(["dev", dev]);
        netns::ip(&args).unwrap();
    }
}

#[test]
fn the_audit_repairs_a_host_veth_made_again_under_its_name() {
    let bed = Bed::new(AttachMode::Auto);
    let (node, pod_ns, veth) = (
        bed.node_netns().to_string(),
        bed.client.netns.clone(),
        bed.client.host_veth.clone(),
    );
    let old = bed.c.host_ifindex(&bed.client).unwrap();
    let host = (ipv4_addrs(&node, &veth), ipv4_routes(&node, &veth));
    let inside = (ipv4_addrs(&pod_ns, "eth0"), ipv4_routes(&pod_ns, "eth0"));
    let before = bed.repairs("veth_replaced");
    // The agent sees the replacement at once (not the pod without a veth in
    // between, which is a pod leaving, not a repair): it is stopped meanwhile.
    bed.c.signal_agent(0, libc::SIGSTOP).unwrap();
    let replaced = std::panic::catch_unwind(|| {
        netns::ip(&["-n", &node, "link", "del", &veth]).unwrap();
        netns::ip(&[
            "-n", &node, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns",
            &pod_ns,
        ])
        .unwrap();
        configure(&pod_ns, "eth0", &inside.0, &inside.1);
        configure(&node, &veth, &host.0, &host.1);
    });
    bed.c.signal_agent(0, libc::SIGCONT).unwrap();
    if let Err(panic) = replaced {
        std::panic::resume_unwind(panic);
    }
    let new = bed.c.host_ifindex(&bed.client).unwrap();
    assert_ne!(new, old);
    bed.wait_repaired("veth_replaced", before);
    bed.c.wait_captured(&bed.client, true).unwrap();
    // Nothing left for the old interface.
    assert!(!bed.pods_map_keys().contains(&u64::from(old)));
    let links = bed.c.nodes[0].pins().join("links");
    for program in ["from_pod", "to_pod"] {
        assert!(!links.join(format!("{old}_{program}")).exists());
    }
    bed.assert_captured_traffic();
}

#[test]
fn the_audit_repairs_a_moved_host_route() {
    let bed = Bed::new(AttachMode::Auto);
    let node = bed.node_netns().to_string();
    let veth = bed.client.host_veth.clone();
    let old = bed.c.host_ifindex(&bed.client).unwrap();
    // Another veth, not a pod's.
    let spare = "plspare0";
    netns::ip(&[
        "-n", &node, "link", "add", spare, "type", "veth", "peer", "name", "plspare1",
    ])
    .unwrap();
    for dev in [spare, "plspare1"] {
        netns::ip(&["-n", &node, "link", "set", dev, "up"]).unwrap();
    }
    let spare_index: Value = ip_json(&node, &["link", "show", spare])[0]["ifindex"].clone();
    let spare_index = spare_index.as_u64().unwrap();
    let host_route = format!("{}/32", bed.client.ip);

    let before = bed.repairs("route_moved");
    netns::ip(&["-n", &node, "route", "replace", &host_route, "dev", spare]).unwrap();
    bed.wait_repaired("route_moved", before);
    // Captured where the route leads; nothing left on the old veth.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !bed.pods_map_keys().contains(&spare_index) {
        assert!(
            std::time::Instant::now() < deadline,
            "not captured on the veth the route leads to\n{}",
            bed.c.agent_log(0)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!bed.pods_map_keys().contains(&u64::from(old)));
    assert_eq!(bed.c.capture_state(&bed.client).unwrap(), Some(false));

    // Back: captured on its own veth again.
    let before = bed.repairs("route_moved");
    netns::ip(&["-n", &node, "route", "replace", &host_route, "dev", &veth]).unwrap();
    bed.wait_repaired("route_moved", before);
    bed.c.wait_captured(&bed.client, true).unwrap();
    assert!(!bed.pods_map_keys().contains(&spare_index));
    bed.assert_captured_traffic();
}
