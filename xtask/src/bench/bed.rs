//! The bed: two nodes, a direct and an enrolled pod pair with their servers, a
//! churn pair per path, idle enrolled pods on node 1; and waiting for pods to be
//! enrolled (their link pins, then their pods map entries).

use std::{
    collections::HashSet,
    fs,
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{Cluster, Pod, PodSpec, app, dns::Resolver, netns};

use super::{
    ECHO_PORT, ENROLL_TIMEOUT, ENROLLED_ON_NODE1, IPERF_PORT, NODE1_EXTRA_RANGE, PROGRAMS, Path2,
};

/// Echo and iperf3 servers of the server pods; stopped on drop.
#[derive(Default)]
pub(super) struct Servers {
    pub(super) echo: Vec<app::EchoServer>,
    pub(super) iperf: Vec<Child>,
}

impl Servers {
    pub(super) fn serve(&mut self, pod: &Pod) -> Result<()> {
        self.echo
            .push(app::EchoServer::start(&pod.netns, pod.addr(ECHO_PORT))?);
        let child = netns::command_in(&pod.netns, "iperf3")
            .args(["-s", "-p", &IPERF_PORT.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3")?;
        netns::register(netns::Resource::Process(child.id()));
        self.iperf.push(child);
        Ok(())
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for child in &mut self.iperf {
            let _ = child.kill();
            let _ = child.wait();
            netns::unregister(&netns::Resource::Process(child.id()));
        }
    }
}

pub(super) struct Bed {
    // Dropped first: the servers stop before the cluster goes.
    pub(super) servers: Servers,
    /// The DNS rows' resolver pod and its dnsmasq ([`super::dns`]).
    pub(super) resolver: (Pod, Resolver),
    pub(super) cluster: Cluster,
    /// The pairs (client on node 1, server on node 2) of the main figures, by
    /// path.
    pub(super) pairs: [(Pod, Pod); 2],
    /// The pairs of the churn runs, by path: fresh when the churn starts.
    pub(super) churn_pairs: [(Pod, Pod); 2],
}

impl Bed {
    pub(super) fn pair(&self, path: Path2) -> &(Pod, Pod) {
        &self.pairs[path as usize]
    }

    /// The address of the DNS rows' resolver.
    pub(super) fn resolver_ip(&self) -> std::net::IpAddr {
        self.resolver.1.addr
    }
}

/// Gives a client pod the widest port range and `tcp_tw_reuse`, so that short
/// connections to one server port do not measure the port search.
pub(super) fn tune_client(pod: &Pod) -> Result<()> {
    netns::run(netns::command_in(&pod.netns, "sysctl").args([
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=1024 65535",
        "net.ipv4.tcp_tw_reuse=1",
    ]))?;
    Ok(())
}

/// Makes a client pod on node 1 and a server pod on node 2 in the path's namespace.
pub(super) fn add_pair(
    c: &mut Cluster,
    path: Path2,
    client: &str,
    server: &str,
) -> Result<(Pod, Pod)> {
    let ns = path.namespace();
    Ok((
        c.add_pod(PodSpec::new(client, ns, 0).service_account("client"))?,
        c.add_pod(PodSpec::new(server, ns, 1).service_account("server"))?,
    ))
}

pub(super) fn build_bed() -> Result<Bed> {
    // Dual stack, for the IPv6 single-stream row; every other figure is IPv4.
    let mut c = Cluster::dual_stack(2, &[])?;
    c.add_pod_range(0, NODE1_EXTRA_RANGE)?;
    c.add_namespace(Path2::Direct.namespace(), false)?;
    c.add_namespace(Path2::Podlink.namespace(), true)?;
    c.add_namespace("enroll", true)?;
    let pairs = [
        add_pair(&mut c, Path2::Direct, "dclient", "dserver")?,
        add_pair(&mut c, Path2::Podlink, "mclient", "mserver")?,
    ];
    let churn_pairs = [
        add_pair(&mut c, Path2::Direct, "dchurnc", "dchurns")?,
        add_pair(&mut c, Path2::Podlink, "mchurnc", "mchurns")?,
    ];
    // Node 1's enrolled pods: the two podlink clients and idle ones.
    let mut enrolled = vec![
        pairs[1].0.clone(),
        pairs[1].1.clone(),
        churn_pairs[1].0.clone(),
        churn_pairs[1].1.clone(),
    ];
    for i in 2..ENROLLED_ON_NODE1 {
        enrolled.push(c.add_pod(PodSpec::new(&format!("idle{i}"), "mesh", 0))?);
    }
    // Enrollment is measured with expedited RCU grace periods, as its target
    // (5 ms p99) assumes.
    c.start_agent_with(0, &["--expedite-attach"])?;
    c.start_agent_with(1, &["--expedite-attach"])?;
    wait_enrolled(&c, &enrolled)?;
    let mut servers = Servers::default();
    for (client, server) in pairs.iter().chain(&churn_pairs) {
        tune_client(client)?;
        servers.serve(server)?;
    }
    let resolver = super::dns::start_resolver(&mut c)?;
    Ok(Bed {
        servers,
        resolver,
        cluster: c,
        pairs,
        churn_pairs,
    })
}

/// The two link pins of a pod's host veth: `<pins>/links/<ifindex>_<program>`.
pub(super) fn link_pins(c: &Cluster, pod: &Pod) -> Result<(u32, [PathBuf; 2])> {
    let ifindex = c.host_ifindex(pod)?;
    let links = c.nodes[pod.node].pins().join("links");
    Ok((
        ifindex,
        PROGRAMS.map(|p| links.join(format!("{ifindex}_{p}"))),
    ))
}

/// Polls (every 100 µs) until both pins exist; false after `limit`.
pub(super) fn wait_pins(pins: &[PathBuf; 2], limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if pins.iter().all(|p| fs::metadata(p).is_ok()) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The keys (host ifindexes) of a node's pods map, by one `bpftool map dump`.
pub(super) fn pods_map_keys(c: &Cluster, node: usize) -> Result<HashSet<u32>> {
    Ok(c.dump_map(node, "pods")?
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["formatted"]["key"].as_u64())
        .map(|k| k as u32)
        .collect())
}

/// Waits until every pod is captured: its link pins, then (one map dump per node)
/// its pods map entry.
pub(super) fn wait_enrolled(c: &Cluster, pods: &[Pod]) -> Result<()> {
    let mut ifindexes = Vec::new();
    for pod in pods {
        let (ifindex, pins) = link_pins(c, pod)?;
        if !wait_pins(&pins, ENROLL_TIMEOUT) {
            bail!(
                "pod {} was not enrolled within {ENROLL_TIMEOUT:?}; agent log:\n{}",
                pod.name,
                c.agent_log(pod.node)
            );
        }
        ifindexes.push((pod, ifindex));
    }
    for node in 0..c.nodes.len() {
        let keys = pods_map_keys(c, node)?;
        if let Some((pod, _)) = ifindexes
            .iter()
            .find(|(pod, ifindex)| pod.node == node && !keys.contains(ifindex))
        {
            bail!("pod {} has its links but no pods map entry", pod.name);
        }
    }
    Ok(())
}
