//! `cargo xtask demo`: a two-node cluster of network namespaces, podlink agents on
//! both nodes, and the evidence that enrolled pods' traffic is captured in the
//! kernel and carried over HBONE, while a pod outside the mesh talks in plain text.

use std::{net::IpAddr, process::Command};

use anyhow::{Context, Result, bail};
use podlink_tests::{Capture, Cluster, Family, PodSpec, app, contains_bytes, netns};

fn section(title: &str) {
    println!("\n== {title}");
}

pub fn run() -> Result<()> {
    // Ctrl-C: remove every namespace, mount and process made so far, then exit.
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: cleaning up");
        netns::cleanup();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    let result = demo();
    netns::cleanup();
    result
}

fn demo() -> Result<()> {
    section("building a two-node cluster of network namespaces");
    let mut c = Cluster::dual_stack(2, &[])?;
    for node in &c.nodes {
        println!(
            "{}: namespace {}, underlay {} and {}, pods {}/24 and {}",
            node.name,
            node.netns,
            node.ip,
            node.ipv6.map_or("-".into(), |ip| ip.to_string()),
            node.pod_cidr,
            node.pod_range6().unwrap_or_default()
        );
    }
    c.add_namespace("shop", true)?;
    c.add_namespace("legacy", false)?;
    println!(
        "Kubernetes namespace 'shop' has istio.io/dataplane-mode=ambient; 'legacy' has no label"
    );
    let client = c.add_pod(PodSpec::new("frontend", "shop", 0).service_account("frontend"))?;
    let server = c.add_pod(PodSpec::new("backend", "shop", 1).service_account("backend"))?;
    let outsider = c.add_pod(PodSpec::new("batch", "legacy", 0))?;
    for pod in [&client, &server, &outsider] {
        println!(
            "pod {}/{} on {}: {} and {} (host veth {}, wired by the ptp + host-local CNI plugins)",
            pod.namespace,
            pod.name,
            c.nodes[pod.node].name,
            pod.ip,
            pod.ipv6.map_or("-".into(), |ip| ip.to_string()),
            pod.host_veth
        );
    }

    section("starting podlink agents");
    c.start_agent(0)?;
    c.start_agent(1)?;
    c.wait_captured(&client, true)?;
    c.wait_captured(&server, true)?;
    println!(
        "agents running; TCX links pinned under {} and {}",
        c.nodes[0].pin_dir.display(),
        c.nodes[1].pin_dir.display()
    );
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080))?;
    println!("backend serves an echo app on {}", server.addr(8080));

    section("frontend (enrolled, node1) -> backend (enrolled, node2)");
    let secret = b"order #1234: card 4111-1111-1111-1111";
    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "mesh")?;
    let ex = app::exchange(&client.netns, server.addr(8080), secret)?;
    let (raw, lines) = capture.stop()?;
    println!(
        "backend saw the connection come from {} (frontend's pod address: {})",
        ex.peer_seen.ip(),
        client.ip
    );
    if ex.peer_seen.ip() != IpAddr::V4(client.ip) || ex.echoed != secret {
        bail!("the mesh path did not deliver as expected: {ex:?}");
    }
    let hbone = lines.iter().filter(|l| l.contains(".15008")).count();
    let app_port = lines.iter().filter(|l| l.contains(".8080")).count();
    println!(
        "underlay capture on node1 eth0: {hbone} packets to/from port 15008 (HBONE), {app_port} to/from port 8080"
    );
    println!(
        "payload visible on the underlay: {}",
        if contains_bytes(&raw, b"4111-1111") {
            "YES"
        } else {
            "no (inside TLS 1.3)"
        }
    );
    for line in lines.iter().take(6) {
        println!("  {line}");
    }
    if let Some(line) = c
        .agent_log(1)
        .lines()
        .find(|l| l.contains("HBONE connection accepted"))
    {
        let client_id = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("client="))
            .unwrap_or("?");
        println!("node2's proxy verified the client certificate over mutual TLS 1.3: {client_id}");
    }

    section("the same over IPv6: frontend -> backend's IPv6 address");
    let _echo6 = app::EchoServer::start(&server.netns, server.addr6(8080))?;
    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "mesh6")?;
    let ex = app::exchange(&client.netns, server.addr6(8080), secret)?;
    let (raw, lines) = capture.stop()?;
    let client6 = client.ip_of(Family::V6);
    println!(
        "backend saw the connection come from {} (frontend's IPv6 pod address: {client6})",
        ex.peer_seen.ip()
    );
    if ex.peer_seen.ip() != client6 || ex.echoed != secret {
        bail!("the mesh path did not deliver over IPv6 as expected: {ex:?}");
    }
    let hbone6 = format!("{}.15008", server.ip_of(Family::V6));
    println!(
        "underlay capture on node1 eth0: {} packets to/from {hbone6} (HBONE over IPv6), {} to/from port 8080; payload visible: {}",
        lines.iter().filter(|l| l.contains(&hbone6)).count(),
        lines.iter().filter(|l| l.contains(".8080")).count(),
        if contains_bytes(&raw, b"4111-1111") {
            "YES"
        } else {
            "no (inside TLS 1.3)"
        }
    );

    section("batch (legacy, not enrolled, node1) -> backend (enrolled, node2)");
    let plaintext = |c: &Cluster| -> Result<u64> {
        Ok(c.counters(&server)?
            .get("captured_inbound_plaintext")
            .copied()
            .unwrap_or(0))
    };
    let plaintext_before = plaintext(&c)?;
    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "plain")?;
    let ex = app::exchange(
        &outsider.netns,
        server.addr(8080),
        b"nightly report, in the clear",
    )?;
    let (raw, lines) = capture.stop()?;
    let captured = plaintext(&c)?.saturating_sub(plaintext_before);
    println!(
        "backend saw {} (batch's pod address: {}); connections captured at backend's host veth for the plaintext listener: {captured}",
        ex.peer_seen.ip(),
        outsider.ip
    );
    if captured == 0 {
        bail!("backend's host veth did not capture the plaintext connection for the proxy");
    }
    let app_port = lines.iter().filter(|l| l.contains(".8080")).count();
    println!(
        "underlay capture: {app_port} packets to/from port 8080; payload visible: {}",
        if contains_bytes(&raw, b"nightly report") {
            "yes (plain TCP, as sent)"
        } else {
            "no"
        }
    );

    let pods_map = c.nodes[0].pins().join("pods");
    section(&format!(
        "bpftool map dump pinned {} (node1; key: the host veth's ifindex; ipv4: IPv4-mapped IPv6)",
        pods_map.display()
    ));
    let out = Command::new("bpftool")
        .args(["map", "dump", "pinned"])
        .arg(&pods_map)
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));

    section("packet counters per pod (pinned per-CPU map pod_counters, summed)");
    for pod in [&client, &server] {
        let counters = c.counters(pod)?;
        let nonzero: Vec<String> = counters
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!("{}/{}: {}", pod.namespace, pod.name, nonzero.join(" "));
    }

    section("cleaning up");
    drop(c);
    println!("namespaces, links, pins and mounts removed");
    Ok(())
}
