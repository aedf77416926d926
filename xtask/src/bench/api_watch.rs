//! The agent as a Kubernetes API client at cluster scale: one node's agent
//! watching the API server double (`podlink_tests::api_double`) that holds
//! [`PODS`] pods (its own node [`LOCAL_PODS`] of them, real pods made through
//! the CNI plugins), [`SERVICES`] Services with one EndpointSlice each
//! ([`ENDPOINTS_PER_SLICE`] endpoints) and [`POLICIES`] AuthorizationPolicies.
//!
//! Measured: the time from the agent's start to its readiness (its first
//! view of all of it); its VmRSS once settled and the most sampled during the
//! changes; and for each change at the API (a Service with its slice, a pod of
//! another node, a policy: each added, then deleted, in turn) the time from
//! the change being stored in the API server until the agent's view holds it,
//! read from the agent's `podlink_known_objects` gauge, polled every
//! [`POLL`]: p50, p99 and max. Each poll is one scrape of `/metrics`; their
//! p50 is reported, as it bounds how finely the times are seen.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use podlink_tests::{Cluster, PodSpec, Source};
use serde::Serialize;

use super::{
    memory::{RssSampler, rss_kib, status_kib},
    stats::percentile,
};

/// Pods in the API, this node's among them.
pub(super) const PODS: usize = 5_000;
/// Pods on the agent's own node.
pub(super) const LOCAL_PODS: usize = 100;
/// Services, each with one EndpointSlice.
pub(super) const SERVICES: usize = 1_000;
/// Endpoints of each Service's slice (pods of other nodes).
pub(super) const ENDPOINTS_PER_SLICE: usize = 5;
/// AuthorizationPolicies.
pub(super) const POLICIES: usize = 500;
/// Namespaces the objects are spread over.
const NAMESPACES: usize = 50;
/// Changes timed (each one add and one delete).
pub(super) const CHANGES: usize = 150;
/// How often the gauge is read while a change is awaited.
const POLL: Duration = Duration::from_millis(2);
/// How long a change may take to show before the run fails.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// The aims the issue sets: p99 of the change times (ms) and VmRSS (MiB).
pub(super) const AIM_P99_MS: f64 = 50.0;
pub(super) const AIM_RSS_MIB: f64 = 64.0;

#[derive(Debug, Serialize)]
pub(super) struct ApiWatch {
    pub(super) pods: usize,
    pub(super) local_pods: usize,
    pub(super) services: usize,
    pub(super) policies: usize,
    /// Seconds from the agent's start to `agent running` (its first view).
    pub(super) first_view_seconds: f64,
    /// VmRSS (KiB) once settled, before the changes.
    pub(super) idle_rss_kib: u64,
    /// The largest VmRSS (KiB) sampled during the changes.
    pub(super) max_rss_kib: u64,
    /// ms from each change stored in the API server to the agent's view
    /// holding it, by kind (`service`, `pod`, `policy`), adds and deletes.
    pub(super) change_ms: Vec<(String, f64)>,
    /// p50 of one scrape of `/metrics` (ms).
    pub(super) scrape_p50_ms: f64,
    /// Of the settled VmRSS, the anonymous part (KiB): the heap, not the
    /// mapped binary.
    pub(super) idle_rss_anon_kib: u64,
    /// p50 of each step of the agent's reconciliations during the changes
    /// (its `reconciled` debug lines, µs): refreshing the state's indexes,
    /// reading the node's network, planning (and publishing the proxy's
    /// view), applying.
    pub(super) reconcile_p50_us: [f64; 4],
}

/// The p50 of each step of the `reconciled` lines of `log` (µs).
pub(super) fn reconcile_steps(log: &str) -> [f64; 4] {
    let mut steps: [Vec<f64>; 4] = Default::default();
    for line in log.lines().filter(|l| l.contains("reconciled")) {
        for (i, key) in ["read_us=", "network_us=", "plan_us=", "apply_us="]
            .iter()
            .enumerate()
        {
            if let Some(v) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse().ok())
            {
                steps[i].push(v);
            }
        }
    }
    steps.map(|mut v| {
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            0.0
        } else {
            percentile(&v, 0.5)
        }
    })
}

impl ApiWatch {
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
        let mut v: Vec<f64> = self.change_ms.iter().map(|(_, ms)| *ms).collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return [0.0; 3];
        }
        [percentile(&v, 0.5), percentile(&v, 0.99), v[v.len() - 1]]
    }
}

fn namespace(i: usize) -> String {
    format!("ns{}", i % NAMESPACES)
}

/// The address of pod `i` of the other nodes: 10.250.0.0/16.
fn remote_ip(i: usize) -> String {
    format!("10.250.{}.{}", i / 250, i % 250 + 1)
}

fn remote_pod(i: usize) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: r{i}
  namespace: {ns}
  labels: {{app: app{app}}}
  ownerReferences: [{{apiVersion: apps/v1, kind: ReplicaSet, name: app{app}-5d9c7b8f4, uid: u{app}, controller: true}}]
spec: {{nodeName: remote{node}, serviceAccountName: app{app}}}
status: {{phase: Running, podIP: \"{ip}\", podIPs: [{{ip: \"{ip}\"}}]}}
",
        ns = namespace(i),
        app = i % SERVICES,
        node = i % 49 + 2,
        ip = remote_ip(i),
    )
}

fn service(j: usize, remote: usize) -> String {
    let mut endpoints = String::new();
    for k in 0..ENDPOINTS_PER_SLICE {
        let pod = (j * ENDPOINTS_PER_SLICE + k) % remote;
        endpoints.push_str(&format!(
            "- addresses: [\"{}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: remote{}\n  zone: zone-{}\n",
            remote_ip(pod),
            pod % 49 + 2,
            pod % 3
        ));
    }
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: svc{j}, namespace: {ns}}}
spec:
  clusterIP: 10.96.{a}.{b}
  clusterIPs: [10.96.{a}.{b}]
  ports: [{{name: http, port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: svc{j}-abcde
  namespace: {ns}
  labels: {{kubernetes.io/service-name: svc{j}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
{endpoints}",
        ns = namespace(j),
        a = j / 250,
        b = j % 250 + 1,
    )
}

fn policy(k: usize) -> String {
    format!(
        "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: allow-app{k}, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: app{k}}}}}
  action: ALLOW
  rules:
  - from: [{{source: {{namespaces: [{ns}, bench]}}}}]
    to: [{{operation: {{ports: [\"8080\"]}}}}]
",
        ns = namespace(k),
    )
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

/// Builds the one-node bed with its API server double and runs the
/// measurement.
pub(super) fn api_watch() -> Result<ApiWatch> {
    let remote = PODS - LOCAL_PODS;
    let mut c = Cluster::with_source(1, Source::Kubernetes)?;
    c.add_namespace("bench", true)?;
    for n in 0..NAMESPACES {
        c.add_namespace(&format!("ns{n}"), true)?;
    }
    eprintln!("bench: api-watch: making {LOCAL_PODS} pods through the CNI plugins");
    let mut local = Vec::with_capacity(LOCAL_PODS);
    for i in 0..LOCAL_PODS {
        local.push(c.add_pod(PodSpec::new(&format!("l{i}"), "bench", 0))?);
    }
    eprintln!(
        "bench: api-watch: {remote} pods of other nodes, {SERVICES} Services and slices, {POLICIES} policies"
    );
    let text: String = (0..remote)
        .map(|i| format!("{}---\n", remote_pod(i)))
        .collect();
    c.write_manifest("remote-pods.yaml", &text)?;
    let text: String = (0..SERVICES)
        .map(|j| format!("{}---\n", service(j, remote)))
        .collect();
    c.write_manifest("services.yaml", &text)?;
    let text: String = (0..POLICIES)
        .map(|k| format!("{}---\n", policy(k)))
        .collect();
    c.write_manifest("policies.yaml", &text)?;

    let t = Instant::now();
    c.start_agent(0)?;
    let first_view_seconds = t.elapsed().as_secs_f64();
    let refs: Vec<_> = local.iter().collect();
    c.wait_all_captured(&refs)?;
    std::thread::sleep(Duration::from_secs(2));
    let pid = c.agent_pid(0).context("the agent is not running")?;
    let idle_rss_kib = rss_kib(pid);
    let idle_rss_anon_kib = status_kib(pid, "RssAnon:");
    let log_start = c.agent_log(0).len();

    eprintln!("bench: api-watch: {CHANGES} changes, each added then deleted");
    let sampler = RssSampler::start(vec![pid]);
    let mut change_ms = Vec::with_capacity(2 * CHANGES);
    let mut scrapes = Vec::new();
    for i in 0..CHANGES {
        let (what, gauge, file, text) = match i % 3 {
            0 => (
                "service",
                "services",
                "change-service.yaml",
                service(SERVICES + i, remote),
            ),
            1 => (
                "pod",
                "workloads",
                "change-pod.yaml",
                remote_pod(remote + i),
            ),
            _ => (
                "policy",
                "policies",
                "change-policy.yaml",
                policy(POLICIES + i),
            ),
        };
        let (before, _) = known(&c, gauge)?;
        for (add, want) in [(true, before + 1.0), (false, before)] {
            let t = Instant::now();
            if add {
                c.write_manifest(file, &text)?;
            } else {
                c.remove_manifest(file)?;
            }
            loop {
                let (now, ms) = known(&c, gauge)?;
                scrapes.push(ms);
                if now == want {
                    break;
                }
                if t.elapsed() > CHANGE_TIMEOUT {
                    bail!(
                        "the agent's {gauge} stayed {now} (not {want}) {CHANGE_TIMEOUT:?} after a {what} change"
                    );
                }
                std::thread::sleep(POLL);
            }
            change_ms.push((what.to_string(), t.elapsed().as_secs_f64() * 1e3));
        }
    }
    let max_rss_kib = sampler.stop().into_iter().max().unwrap_or(0);
    let reconcile_p50_us = reconcile_steps(c.agent_log(0).get(log_start..).unwrap_or(""));
    scrapes.sort_by(f64::total_cmp);
    Ok(ApiWatch {
        pods: PODS,
        local_pods: LOCAL_PODS,
        services: SERVICES,
        policies: POLICIES,
        first_view_seconds,
        idle_rss_kib,
        max_rss_kib,
        change_ms,
        scrape_p50_ms: if scrapes.is_empty() {
            0.0
        } else {
            percentile(&scrapes, 0.5)
        },
        idle_rss_anon_kib,
        reconcile_p50_us,
    })
}
