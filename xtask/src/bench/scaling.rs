//! The scaling table: 1, 10 and 100 pod pairs at once per path, throughput and
//! connection rate.

use std::{net::SocketAddr, time::Instant};

use anyhow::Result;
use podlink_tests::{Pod, PodSpec};
use serde::Serialize;

use super::{
    ECHO_PORT, Path2, Settings,
    agents::agents_cpu,
    bed::{Bed, tune_client, wait_enrolled},
    connections::run_clients,
    enrollment::EnrollmentSummary,
    throughput::throughput_concurrent,
};

#[derive(Serialize)]
pub(super) struct ScalingRun {
    pub(super) pairs: usize,
    pub(super) path: Path2,
    /// Sum of the pairs' single-stream iperf3 results.
    pub(super) throughput_gbps: f64,
    pub(super) throughput_failures: usize,
    /// From the start of the concurrent iperf3 runs (all at once, see
    /// `throughput_concurrent`) to the first one's exit.
    pub(super) throughput_first_exit_seconds: f64,
    /// From the start of the concurrent iperf3 runs to the last one's exit
    /// (before the clients started together, `throughput_batch_seconds`,
    /// from the first client's start).
    pub(super) throughput_last_exit_seconds: f64,
    pub(super) throughput_agent_cpu_seconds: f64,
    pub(super) connections_per_second: f64,
    pub(super) connection_failures: u64,
    pub(super) connections_agent_cpu_seconds: f64,
}

#[derive(Serialize)]
pub(super) struct Scaling {
    /// Time to make the pairs' pods (CNI) and get the enrolled ones captured.
    pub(super) pairs_setup_seconds: f64,
    pub(super) runs: Vec<ScalingRun>,
    pub(super) enrollment: Vec<EnrollmentSummary>,
}

/// The scaling table's traffic: makes the pairs, then runs each size on both
/// paths. Returns the setup time and the runs.
pub(super) fn scaling(bed: &mut Bed, s: &Settings) -> Result<(f64, Vec<ScalingRun>)> {
    let most = s.scaling_pairs.iter().copied().max().unwrap_or(0);
    let (pairs, setup) = scaling_pairs(bed, most)?;
    let mut runs = Vec::new();
    for &n in &s.scaling_pairs {
        for path in [Path2::Direct, Path2::Podlink] {
            runs.push(scaling_run(
                bed,
                &pairs[path as usize][..n],
                path,
                s.scaling_throughput_seconds,
                s.connect_seconds,
            )?);
        }
    }
    Ok((setup, runs))
}

/// Pod pairs (client on node 1, server on node 2) by [`Path2`].
pub(super) type PairsByPath = [Vec<(Pod, Pod)>; 2];

/// Makes `n` more pod pairs per path, waits until the podlink ones are
/// enrolled and starts their servers. Returns them and the time it took (s).
pub(super) fn scaling_pairs(bed: &mut Bed, n: usize) -> Result<(PairsByPath, f64)> {
    eprintln!("bench: scaling: making {n} pod pairs per path");
    let t = Instant::now();
    let mut pairs = PairsByPath::default();
    for (p, path) in [Path2::Direct, Path2::Podlink].into_iter().enumerate() {
        for i in 0..n {
            let ns = path.namespace();
            let client = bed
                .cluster
                .add_pod(PodSpec::new(&format!("s{p}c{i}"), ns, 0))?;
            let server = bed
                .cluster
                .add_pod(PodSpec::new(&format!("s{p}s{i}"), ns, 1))?;
            pairs[p].push((client, server));
        }
    }
    let enrolled: Vec<Pod> = pairs[1]
        .iter()
        .flat_map(|(c, s)| [c.clone(), s.clone()])
        .collect();
    wait_enrolled(&bed.cluster, &enrolled)?;
    for (client, server) in pairs.iter().flatten() {
        tune_client(client)?;
        bed.servers.serve(server)?;
    }
    Ok((pairs, t.elapsed().as_secs_f64()))
}

/// One size of the scaling table on one path: iperf3 on every pair at once for
/// `throughput_seconds`, then one connecting client per pair for
/// `connect_seconds`.
pub(super) fn scaling_run(
    bed: &Bed,
    pairs: &[(Pod, Pod)],
    path: Path2,
    throughput_seconds: u32,
    connect_seconds: f64,
) -> Result<ScalingRun> {
    let n = pairs.len();
    eprintln!("bench: scaling: {n} pairs, {path:?}");
    let cpu = agents_cpu(&bed.cluster);
    let batch = throughput_concurrent(pairs, throughput_seconds)?;
    let tput_cpu = agents_cpu(&bed.cluster) - cpu;
    let targets: Vec<(&Pod, SocketAddr)> =
        pairs.iter().map(|(c, s)| (c, s.addr(ECHO_PORT))).collect();
    let cpu = agents_cpu(&bed.cluster);
    let conns = run_clients(&targets, 1, connect_seconds, false)?;
    Ok(ScalingRun {
        pairs: n,
        path,
        throughput_gbps: batch.gbps,
        throughput_failures: batch.failures,
        throughput_first_exit_seconds: batch.first_exit_seconds,
        throughput_last_exit_seconds: batch.last_exit_seconds,
        throughput_agent_cpu_seconds: tput_cpu,
        connections_per_second: conns.rate(),
        connection_failures: conns.failed,
        connections_agent_cpu_seconds: agents_cpu(&bed.cluster) - cpu,
    })
}
