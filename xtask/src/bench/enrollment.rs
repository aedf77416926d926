//! Pod enrollment: pods made through the CNI plugins, then listed one at a time,
//! each timed from its manifest's write to both its link pins.

use std::time::Instant;

use anyhow::Result;
use podlink_tests::{Cluster, PodSpec};
use serde::Serialize;

use super::{
    ENROLL_TIMEOUT,
    agents::agents_cpu,
    bed::{link_pins, pods_map_keys, wait_pins},
    stats::percentile,
};

#[derive(Debug, Serialize)]
pub(super) struct Enrollment {
    /// Pods made through the CNI plugins for the enrollment runs, and how long
    /// that took (not part of the enrollment times).
    pub(super) pods_created: usize,
    pub(super) creation_seconds: f64,
    /// Per pod, in order: ms from its manifest being in place to both its link
    /// pins existing.
    pub(super) per_pod_ms: Vec<f64>,
    /// Per pod: seconds from the first manifest write to its links.
    pub(super) cumulative_seconds: Vec<f64>,
    /// The pod (index) that was not enrolled within the timeout; the run stopped
    /// there.
    pub(super) timed_out_at: Option<usize>,
    /// Pods with links but no pods map entry in the dump at the end.
    pub(super) missing_map_entries: usize,
    pub(super) agent_cpu_seconds: f64,
}

impl Enrollment {
    /// p50, p99 and max (ms) over the first `n` pods, and the time to the n-th
    /// pod's links (s); `None` if fewer were enrolled.
    pub(super) fn summary(&self, n: usize) -> Option<EnrollmentSummary> {
        if self.per_pod_ms.len() < n || n == 0 {
            return None;
        }
        let mut v = self.per_pod_ms[..n].to_vec();
        v.sort_by(f64::total_cmp);
        Some(EnrollmentSummary {
            pods: n,
            p50_ms: percentile(&v, 0.5),
            p99_ms: percentile(&v, 0.99),
            max_ms: v[n - 1],
            total_seconds: self.cumulative_seconds[n - 1],
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct EnrollmentSummary {
    pub(super) pods: usize,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    pub(super) total_seconds: f64,
}

/// Makes `count` pods on node 1 in the enrolled namespace `enroll` (CNI only),
/// then lists them one at a time, timing each one's enrollment.
pub(super) fn enrollment(c: &mut Cluster, count: usize) -> Result<Enrollment> {
    eprintln!("bench: making {count} pods through the CNI plugins");
    let t = Instant::now();
    let mut made = Vec::with_capacity(count);
    for i in 0..count {
        made.push(c.add_pod_unlisted(PodSpec::new(&format!("e{i}"), "enroll", 0))?);
        if (i + 1) % 100 == 0 {
            eprintln!("bench:   {} pods", i + 1);
        }
    }
    let creation_seconds = t.elapsed().as_secs_f64();
    let mut pods = Vec::with_capacity(count);
    for pod in made {
        let (ifindex, pins) = link_pins(c, &pod)?;
        pods.push((pod, ifindex, pins));
    }
    eprintln!("bench: enrolling {count} pods one at a time");
    let cpu = agents_cpu(c);
    let mut per_pod_ms = Vec::with_capacity(count);
    let mut cumulative_seconds = Vec::with_capacity(count);
    let mut timed_out_at = None;
    let start = Instant::now();
    for (i, (pod, _, pins)) in pods.iter().enumerate() {
        // Timed from before the write: the agent, woken by the rename, may
        // run before this thread returns from it.
        let t = Instant::now();
        c.list_pod(pod)?;
        if !wait_pins(pins, ENROLL_TIMEOUT) {
            eprintln!(
                "bench: pod {} was not enrolled within {ENROLL_TIMEOUT:?}; stopping the enrollment run",
                pod.name
            );
            timed_out_at = Some(i);
            break;
        }
        per_pod_ms.push(t.elapsed().as_secs_f64() * 1e3);
        cumulative_seconds.push(start.elapsed().as_secs_f64());
    }
    let agent_cpu_seconds = agents_cpu(c) - cpu;
    let keys = pods_map_keys(c, 0)?;
    let missing_map_entries = pods[..per_pod_ms.len()]
        .iter()
        .filter(|(_, ifindex, _)| !keys.contains(ifindex))
        .count();
    Ok(Enrollment {
        pods_created: count,
        creation_seconds,
        per_pod_ms,
        cumulative_seconds,
        timed_out_at,
        missing_map_entries,
        agent_cpu_seconds,
    })
}
