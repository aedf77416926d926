//! The agent fed by istiod at cluster scale: one node's agent in istiod mode
//! (`--xds-address`, with the Istio CA double for its certificates), its
//! node's pods from the Kubernetes API double, and the delta ADS double
//! (`podlink_tests::xds_double`) as istiod, holding [`WORKLOADS`] workloads
//! (this node's [`LOCAL_PODS`] of them real pods made through the CNI
//! plugins, the rest of other nodes), [`SERVICES`] services (a VIP each;
//! every workload backs one of them, so each has [`ENDPOINTS_PER_SERVICE`]
//! endpoints) and [`POLICIES`] namespace-scoped ALLOW policies. The local
//! pods are as many as [`super::api_watch`] makes (the whole part takes about
//! half a minute).
//!
//! Measured as [`super::api_watch`] measures the Kubernetes source: the time
//! from the agent's start to its readiness (istiod's first responses of both
//! types applied); its VmRSS once settled and the most sampled during the
//! changes; and for each change pushed (a service, a workload of another
//! node, a policy: each added, then removed, in turn, one push each) the
//! time from the push being handed to the double's stream until the agent's
//! view holds it, read from its `podlink_known_objects` gauge (istiod's
//! objects are in the view it counts), polled every [`POLL`]: p50, p99 and
//! max. Also the time from the push to the agent's ACK of it, stamped by the
//! double as it reads the ACK (the agent ACKs once its handler took the
//! response in, before the agent reconciles), and the p50 of the agent's
//! reconciliation steps during the changes.

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_agent::xds::proto::{
    self,
    security::{Action, Authorization, Clause, Match, Rule, Scope, StringMatch, string_match},
    workload::{
        Address, NetworkAddress, Port, PortList, Service, TunnelProtocol, Workload, address,
    },
};
use podlink_tests::{
    Cluster, PodSpec, Source,
    ca_double::CaDouble,
    xds_double::{XdsDouble, istiod_agent_args},
};
use serde::Serialize;

use super::{
    api_watch::reconcile_steps,
    memory::{RssSampler, rss_kib, status_kib},
    stats::percentile,
};

/// Workloads istiod lists, this node's among them.
pub(super) const WORKLOADS: usize = 5_000;
/// Workloads on the agent's own node (real pods).
pub(super) const LOCAL_PODS: usize = 100;
/// Services, each with one VIP and port.
pub(super) const SERVICES: usize = 1_000;
/// Endpoints of each service: the workloads backing it.
const ENDPOINTS_PER_SERVICE: usize = WORKLOADS / SERVICES;
/// Authorization policies.
pub(super) const POLICIES: usize = 500;
/// Namespaces the objects of other nodes are spread over.
const NAMESPACES: usize = 50;
/// Changes timed (each one add and one remove).
pub(super) const CHANGES: usize = 150;
/// How often the gauge is read while a change is awaited.
const POLL: Duration = Duration::from_millis(2);
/// How long a change may take to show (and to be ACKed) before the run fails.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the agent may take to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const TOKEN: &str = "node-agent-token";
const CLUSTER_ID: &str = "bench-cluster";

#[derive(Debug, Serialize)]
pub(super) struct XdsWatch {
    pub(super) workloads: usize,
    pub(super) local_pods: usize,
    pub(super) services: usize,
    pub(super) policies: usize,
    /// Seconds from the agent's start to its readiness (istiod's view
    /// applied).
    pub(super) ready_seconds: f64,
    /// VmRSS (KiB) once settled, before the changes.
    pub(super) idle_rss_kib: u64,
    /// Of it, the anonymous part (KiB).
    pub(super) idle_rss_anon_kib: u64,
    /// The largest VmRSS (KiB) sampled during the changes.
    pub(super) max_rss_kib: u64,
    /// ms from each push to the agent's view holding it, by kind
    /// (`service`, `workload`, `policy`), adds and removes.
    pub(super) change_ms: Vec<(String, f64)>,
    /// ms from each push to the agent's ACK of it, in the same order.
    pub(super) ack_ms: Vec<f64>,
    /// p50 of one scrape of `/metrics` (ms).
    pub(super) scrape_p50_ms: f64,
    /// p50 of each step of the agent's reconciliations during the changes
    /// (µs): as [`super::api_watch::ApiWatch::reconcile_p50_us`].
    pub(super) reconcile_p50_us: [f64; 4],
}

impl XdsWatch {
    /// p50 and p99 of the change times of `kind` (ms).
    pub(super) fn by_kind(&self, kind: &str) -> [f64; 2] {
        let mut v: Vec<f64> = self
            .change_ms
            .iter()
            .filter(|(k, _)| k == kind)
            .map(|(_, ms)| *ms)
            .collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return [0.0; 2];
        }
        [percentile(&v, 0.5), percentile(&v, 0.99)]
    }

    /// p50, p99 and max of all change times (ms).
    pub(super) fn summary(&self) -> [f64; 3] {
        summary(self.change_ms.iter().map(|(_, ms)| *ms).collect())
    }

    /// p50, p99 and max of the ACK times (ms).
    pub(super) fn ack_summary(&self) -> [f64; 3] {
        summary(self.ack_ms.clone())
    }
}

fn summary(mut v: Vec<f64>) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return [0.0; 3];
    }
    [percentile(&v, 0.5), percentile(&v, 0.99), v[v.len() - 1]]
}

fn namespace(i: usize) -> String {
    format!("ns{}", i % NAMESPACES)
}

/// The address of workload `i` of the other nodes: 10.250.0.0/16.
fn remote_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// The key workloads name service `j` by: `namespace/hostname`.
fn service_key(j: usize) -> String {
    format!("{ns}/svc{j}.{ns}.svc.cluster.local", ns = namespace(j))
}

/// A workload at `ip` on `node`, backing service `backs` (port 80 to 8080).
fn workload(name: &str, namespace: &str, ip: Ipv4Addr, node: &str, backs: usize) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: format!("{CLUSTER_ID}//Pod/{namespace}/{name}"),
            name: name.to_string(),
            namespace: namespace.to_string(),
            addresses: vec![ip.octets().to_vec()],
            tunnel_protocol: TunnelProtocol::Hbone as i32,
            service_account: format!("app{backs}"),
            node: node.to_string(),
            canonical_name: format!("app{backs}"),
            services: [(
                service_key(backs),
                PortList {
                    ports: vec![Port {
                        service_port: 80,
                        target_port: 8080,
                        app_protocol: 0,
                    }],
                },
            )]
            .into(),
            ..Default::default()
        })),
    }
}

/// Workload `i` of the other nodes (49 of them); it backs a service after
/// those the local pods back, in turn.
fn remote_workload(i: usize) -> Address {
    workload(
        &format!("r{i}"),
        &namespace(i),
        remote_ip(i),
        &format!("remote{}", i % 49 + 2),
        (LOCAL_PODS + i) % SERVICES,
    )
}

/// Service `j`: VIP 10.96.x.y, port 80 to 8080.
fn service(j: usize) -> Address {
    let ns = namespace(j);
    Address {
        r#type: Some(address::Type::Service(Service {
            name: format!("svc{j}"),
            namespace: ns.clone(),
            hostname: format!("svc{j}.{ns}.svc.cluster.local"),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vec![10, 96, (j / 250) as u8, (j % 250 + 1) as u8],
                length: None,
            }],
            ports: vec![Port {
                service_port: 80,
                target_port: 8080,
                app_protocol: 0,
            }],
            ..Default::default()
        })),
    }
}

/// Policy `k`: ALLOW to port 8080 of its namespace's workloads from that
/// namespace and `bench`.
fn policy(k: usize) -> Authorization {
    let ns = namespace(k);
    let exact = |s: &str| StringMatch {
        match_type: Some(string_match::MatchType::Exact(s.to_string())),
    };
    Authorization {
        name: format!("allow-app{k}"),
        namespace: ns.clone(),
        scope: Scope::Namespace as i32,
        action: Action::Allow as i32,
        rules: vec![Rule {
            clauses: vec![
                Clause {
                    matches: vec![Match {
                        namespaces: vec![exact(&ns), exact("bench")],
                        ..Default::default()
                    }],
                },
                Clause {
                    matches: vec![Match {
                        destination_ports: vec![8080],
                        ..Default::default()
                    }],
                },
            ],
        }],
        ..Default::default()
    }
}

/// The agent's `podlink_known_objects` gauge of `kind`, and how long the
/// scrape took (ms).
fn known(c: &Cluster, kind: &str) -> Result<(f64, f64)> {
    let t = Instant::now();
    let metrics = c.metrics(0)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !metrics.has("podlink_known_objects", &[("kind", kind)]) {
        bail!("the agent has no podlink_known_objects{{kind=\"{kind}\"}} gauge");
    }
    Ok((metrics.sum("podlink_known_objects", &[("kind", kind)]), ms))
}

/// How long after `pushed` the agent answered the double's last response
/// (ms), waiting for the answer up to [`CHANGE_TIMEOUT`].
///
/// # Errors
/// No response was sent, the answer is a NACK, or none came in time.
fn ack_ms(xds: &XdsDouble, pushed: Instant) -> Result<f64> {
    let nonce = xds
        .responses()
        .last()
        .map(|r| r.nonce.clone())
        .context("the double sent no response")?;
    let requests = xds.wait_requests(CHANGE_TIMEOUT, |rs| {
        rs.iter().any(|r| r.request.response_nonce == nonce)
    })?;
    let answer = requests
        .iter()
        .find(|r| r.request.response_nonce == nonce)
        .context("the answer")?;
    if let Some(why) = answer.nack() {
        bail!("the agent NACKed push {nonce}: {why}");
    }
    Ok(answer.received.duration_since(pushed).as_secs_f64() * 1e3)
}

/// Builds the one-node bed with the API server, CA and xDS doubles and runs
/// the measurement; `hook`, when given, runs with the agent's process id
/// from the settled view to the end of the changes
/// ([`super::probe`]'s `--hook`).
pub(super) fn xds_watch(hook: Option<&str>) -> Result<XdsWatch> {
    let remote = WORKLOADS - LOCAL_PODS;
    let mut c = Cluster::with_source(1, Source::Kubernetes)?;
    c.add_namespace("bench", true)?;
    eprintln!("bench: xds-watch: making {LOCAL_PODS} pods through the CNI plugins");
    let mut local = Vec::with_capacity(LOCAL_PODS);
    for i in 0..LOCAL_PODS {
        local.push(c.add_pod(PodSpec::new(&format!("l{i}"), "bench", 0))?);
    }
    let ca_ip = c.add_underlay_host(254)?;
    let ca = CaDouble::start(&c.underlay, SocketAddr::from((ca_ip, 15012)), TOKEN)?;
    let xds_ip = c.add_underlay_host(253)?;
    let xds = XdsDouble::start(Some(&c.underlay), SocketAddr::from((xds_ip, 15012)), TOKEN)?;
    eprintln!(
        "bench: xds-watch: istiod's view: {WORKLOADS} workloads ({remote} of other nodes), {SERVICES} services, {POLICIES} policies"
    );
    let node = c.nodes[0].name.clone();
    // This node's pods back the first services, the others' the rest in
    // turn: each service has ENDPOINTS_PER_SERVICE.
    for (i, pod) in local.iter().enumerate() {
        xds.set_address(
            &format!("local/{}", pod.name),
            &workload(&pod.name, &pod.namespace, pod.ip, &node, i % SERVICES),
        );
    }
    for i in 0..remote {
        xds.set_address(&format!("r{i}"), &remote_workload(i));
    }
    for j in 0..SERVICES {
        xds.set_address(&format!("svc{j}"), &service(j));
    }
    for k in 0..POLICIES {
        xds.set_authorization(&format!("allow-app{k}"), &policy(k));
    }
    let args = istiod_agent_args(&c, 0, &ca, &xds, TOKEN, CLUSTER_ID, "")?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    let t = Instant::now();
    c.start_agent_with(0, &args)?;
    while c.readiness(0).ok() != Some(200) {
        if t.elapsed() > READY_TIMEOUT {
            bail!(
                "the agent was not ready {READY_TIMEOUT:?} after its start:\n{}",
                c.agent_log(0)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ready_seconds = t.elapsed().as_secs_f64();
    let refs: Vec<_> = local.iter().collect();
    c.wait_all_captured(&refs)?;
    for (kind, want) in [
        ("workloads", WORKLOADS),
        ("services", SERVICES),
        ("policies", POLICIES),
    ] {
        let (n, _) = known(&c, kind)?;
        if n != want as f64 {
            bail!(
                "the agent's view holds {n} {kind}, not istiod's {want}:\n{}",
                c.agent_log(0)
            );
        }
    }
    for j in [0, SERVICES - 1] {
        let n = c.service_endpoints(0, &namespace(j), &format!("svc{j}"));
        if n != ENDPOINTS_PER_SERVICE {
            bail!("the agent knows {n} endpoints of svc{j}, not {ENDPOINTS_PER_SERVICE}");
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let pid = c.agent_pid(0).context("the agent is not running")?;
    let idle_rss_kib = rss_kib(pid);
    let idle_rss_anon_kib = status_kib(pid, "RssAnon:");
    let log_start = c.agent_log(0).len();
    if let Some(hook) = hook {
        super::probe::start_hook(&[pid], hook)?;
    }

    eprintln!("bench: xds-watch: {CHANGES} changes, each added then removed");
    let sampler = RssSampler::start(vec![pid]);
    let mut change_ms = Vec::with_capacity(2 * CHANGES);
    let mut ack_times = Vec::with_capacity(2 * CHANGES);
    let mut scrapes = Vec::new();
    for i in 0..CHANGES {
        let (what, gauge, type_url, name) = match i % 3 {
            0 => (
                "service",
                "services",
                proto::ADDRESS_TYPE_URL,
                format!("svc{}", SERVICES + i),
            ),
            1 => (
                "workload",
                "workloads",
                proto::ADDRESS_TYPE_URL,
                format!("r{}", remote + i),
            ),
            _ => (
                "policy",
                "policies",
                proto::AUTHORIZATION_TYPE_URL,
                format!("allow-app{}", POLICIES + i),
            ),
        };
        let (before, _) = known(&c, gauge)?;
        for (add, want) in [(true, before + 1.0), (false, before)] {
            match (add, i % 3) {
                (false, _) => xds.remove(type_url, &name),
                (true, 0) => xds.set_address(&name, &service(SERVICES + i)),
                (true, 1) => xds.set_address(&name, &remote_workload(remote + i)),
                (true, _) => xds.set_authorization(&name, &policy(POLICIES + i)),
            }
            let t = Instant::now();
            xds.push();
            loop {
                let (now, ms) = known(&c, gauge)?;
                scrapes.push(ms);
                if now == want {
                    break;
                }
                if t.elapsed() > CHANGE_TIMEOUT {
                    bail!(
                        "the agent's {gauge} stayed {now} (not {want}) {CHANGE_TIMEOUT:?} after a {what} push"
                    );
                }
                std::thread::sleep(POLL);
            }
            change_ms.push((what.to_string(), t.elapsed().as_secs_f64() * 1e3));
            ack_times.push(ack_ms(&xds, t)?);
        }
    }
    let max_rss_kib = sampler.stop().into_iter().max().unwrap_or(0);
    if hook.is_some() {
        super::probe::stop_hook();
    }
    let reconcile_p50_us = reconcile_steps(c.agent_log(0).get(log_start..).unwrap_or(""));
    scrapes.sort_by(f64::total_cmp);
    Ok(XdsWatch {
        workloads: WORKLOADS,
        local_pods: LOCAL_PODS,
        services: SERVICES,
        policies: POLICIES,
        ready_seconds,
        idle_rss_kib,
        idle_rss_anon_kib,
        max_rss_kib,
        change_ms,
        ack_ms: ack_times,
        scrape_p50_ms: if scrapes.is_empty() {
            0.0
        } else {
            percentile(&scrapes, 0.5)
        },
        reconcile_p50_us,
    })
}
