//! `cargo xtask bench`: podlink against the direct path, measured in one run on
//! the two-node test bed (the figures and targets of issue 6).
//!
//! # The bed
//!
//! Two nodes (network namespaces on one machine, see `podlink_tests`). A pod pair
//! outside the mesh (namespace `direct`: the direct path) and an enrolled pod pair
//! (namespace `mesh`: captured at both host veths, HBONE between the nodes), each
//! with its client on node 1 and its server on node 2, and one more such pair per
//! path for the churn run, idle until then. The server pods run the test bed's
//! echo server and an `iperf3 -s`. Node 1 also holds idle enrolled pods, so that
//! it has 10 enrolled pods in all (the two podlink clients among them). All client
//! pods get the same port range and `tcp_tw_reuse`, so that neither path measures
//! its own port search.
//!
//! # The main table
//!
//! Each comparison is made in the same run: for every figure, the direct and the
//! podlink measurement follow each other (their order alternates between
//! repetitions, so that drift hits both alike), `--repeat` times; the table shows
//! the median with min and max of each path and compares the medians.
//!
//! * Single-stream throughput: `iperf3 -t 10`, bits per second received.
//! * 4-stream throughput: `iperf3 -P 4 -t 10`, the sum of the streams received.
//! * Request/response: on one open connection to the echo server (`TCP_NODELAY`),
//!   10,000 round trips of 1 byte, then of 1 KiB, after 100 to warm up; p50 and
//!   p99 of the round-trip times. The comparison is podlink's added µs.
//! * New connections per second: 1 and 16 client threads, each one after the
//!   other connecting, reading the greeting, sending 1 KiB, half-closing, reading
//!   the 1 KiB echo, closing, for 3 s; completions per second. The closed
//!   connections stay in TIME_WAIT for 60 s (in the client pod, and on the
//!   podlink path also in node 2's namespace, where the proxy's upstream
//!   connections close first), so later runs meet the state earlier ones left,
//!   as on a busy node. The one-client runs also time each connection's phases
//!   as the client sees them (connect; the greeting; sending 1 KiB, half-closing
//!   and reading the echo to its end): a table after the main one gives each
//!   phase's p50, the median over the repetitions, per path.
//! * Sustained churn: once per path, after the repetitions, on a pod pair of its
//!   own (made with the bed, idle until then, so that it starts without that
//!   state): 16 client threads as above for 60 s; completions per second, and the
//!   rate of the last 10 s over that of the first 10 s (the target is on
//!   podlink's; direct's is a reference).
//! * Agent memory: VmRSS of each agent. Idle: after the bed has settled, before
//!   any traffic (node 1's agent, with its 10 enrolled pods, is held to the
//!   target). During the throughput runs: sampled every 100 ms while the podlink
//!   throughput runs go; the maximum of both agents.
//! * eBPF program cost: `kernel.bpf_stats_enabled=1` (global; set in the root
//!   namespace, restored afterwards, also on error and Ctrl-C) from the first
//!   repetition to the end of the churn runs; `run_time_ns / run_cnt` of the
//!   difference of each program's counters over that span, summed over its
//!   instances (one per node agent). The programs are found by name in
//!   `bpftool prog show`, restricted to those the bed's link pins use, so that
//!   another test bed's programs do not count.
//! * Pod enrollment: after the traffic, pods are made on node 1 in an enrolled
//!   namespace by the CNI plugins first (not timed), then listed one at a time:
//!   the time from the start of the manifest's write (a file written, then
//!   renamed into place) until both TCX link pins of its host veth exist (polled every 100 µs; the agent writes
//!   the pods map entry before it attaches), and one dump of the pods map at the
//!   end confirms every entry. p50, p99 and max over the first 200 pods.
//! * DNS ([`dns`]): queries per second answered from the agent's own names (a
//!   Service name, 4 client threads, one UDP query after the other, for the
//!   connection runs' seconds), and the p50 of forwarded queries (each a name
//!   never asked before, one after the other: a round trip through the agent
//!   to the resolver), each against the pod asking the resolver (dnsmasq in a
//!   pod outside the mesh on node 2) itself.
//! * Fixed request rate ([`efficiency`]): 1,000 requests of 1 KiB per second,
//!   each echoed, over 16 keep-alive connections opened first, for 10 s; the
//!   p50 round trip of each path.
//! * Agent CPU: for every podlink run, the change of both agents' utime + stime
//!   over the run, summed; the table shows its median and range per figure.
//!
//! # The efficiency table
//!
//! From the same runs ([`efficiency`]): both agents' CPU seconds per GiB
//! received (1 and 4 streams), per 1,000 new connections (1 and 16 clients)
//! and per 1,000 requests at the fixed rate (vCPU per 1,000 requests/s), with
//! the eBPF programs' `run_time_ns` per the same unit as a column of its own,
//! beside ztunnel's figures measured on this kind of machine; the aims are
//! half ztunnel's CPU and added latency, twice its rates.
//!
//! # The scaling table
//!
//! With 1, 10 and 100 concurrent pod pairs (more pods made after the main table,
//! each pair its own client and server pod, per path): the sum of single-stream
//! iperf3 runs of 5 s, all pairs at once (each client waits in its pod until all
//! are ready, then all start; the table gives the seconds from that start to the
//! first and the last exit, which show how far the runs overlapped),
//! and the connection rate with one client thread per pair, all at once (3 s).
//! Then the enrollment of the pods above (one at a time, as before) summarized
//! over the first 10, 100 and 1,000: per-pod p50, p99 and max, and the time from
//! the first manifest write to the N-th pod's links, with the agents' CPU seconds
//! over it and how long making the pods through the CNI plugins took. The 200
//! pods of the main table are the first 200 of these.
//!
//! # The Kubernetes API at cluster scale
//!
//! After the two-node bed is gone: one agent watching the API server double
//! with 5,000 pods, 1,000 Services with their slices and 500 policies; the
//! time from a change at the API to the agent's view holding it, and the
//! agent's memory ([`api_watch`]).
//!
//! # istiod at cluster scale
//!
//! Then, on a bed of its own again: one agent in istiod mode fed by the delta
//! ADS double with 5,000 workloads (100 of them pods on its node), 1,000
//! services and 500 policies; the time from a push to the agent's view
//! holding it and to its ACK, and the agent's memory ([`xds_watch`]).
//!
//! # Flags
//!
//! `--repeat N` (default 5), `--json FILE` (the same data, and every raw sample),
//! `--markdown FILE` (the printed report as a Markdown page, then the ideas tried
//! and not kept, from `bench/tried.md`: see [`markdown`]),
//! `--quick` (one repetition, 2 s throughput runs, 1,000 round trips, 10 s of
//! churn compared over 3 s windows, 50 pods for the enrollment row, 1 and 10 pairs
//! and 10 and 100 pods for scaling): for development, never to judge the targets.
//! `--probe ROW` and its flags measure one figure on its own bed instead
//! ([`probe`]; `--probe api-watch` and `--probe xds-watch` run one of the
//! cluster-scale parts alone). `--soak [--minutes N]` runs the soak instead ([`soak`]).

use std::{path::Path, time::Duration};

use anyhow::{Context, Result};
use podlink_tests::netns;
use serde::Serialize;

mod agents;
mod api_watch;
mod bed;
mod connections;
mod dns;
mod ebpf;
mod efficiency;
mod enrollment;
mod full;
mod machine;
mod main_table;
mod markdown;
mod memory;
mod print;
mod probe;
mod report;
mod round_trips;
mod scaling;
mod soak;
mod stats;
mod throughput;
mod xds_watch;

use ebpf::restore_bpf_stats;
use full::bench;
pub use probe::{Options as ProbeOptions, Row as ProbeRow};

/// Length of each throughput run of the main table (iperf3 `-t`).
const THROUGHPUT_SECONDS: u32 = 10;
/// Round trips per request/response run.
const ROUND_TRIPS: usize = 10_000;
/// Length of each connection-rate run.
const CONNECT_SECONDS: f64 = 3.0;
/// Client threads of the many-clients connection rate and of the churn.
const MANY_CLIENTS: usize = 16;
/// Length of the sustained-churn run.
const CHURN_SECONDS: u64 = 60;
/// The churn compares the rate of its last this-many seconds to its first.
const CHURN_WINDOW_SECONDS: u64 = 10;
/// Enrolled pods on node 1 while the idle memory is measured (the podlink client
/// among them).
const ENROLLED_ON_NODE1: usize = 10;
/// Pods of the enrollment row.
const ENROLLMENT_PODS: usize = 200;
/// Concurrent pod pairs of the scaling table.
const SCALING_PAIRS: &[usize] = &[1, 10, 100];
/// Pods enrolled one at a time for the scaling table (the enrollment row's pods
/// are the first of them).
const SCALING_PODS: &[usize] = &[10, 100, 1_000];
/// Length of each iperf3 run of the scaling table: 100 concurrent pairs on two
/// cores make 10 s runs long for little gain.
const SCALING_THROUGHPUT_SECONDS: u32 = 5;
/// How long a pod may take to be enrolled before the enrollment run stops.
const ENROLL_TIMEOUT: Duration = Duration::from_secs(10);
/// Addresses for node 1's pods beyond its /24 (the scaling table needs over
/// 1,000 pods there).
const NODE1_EXTRA_RANGE: &str = "10.245.0.0/21";
const ECHO_PORT: u16 = 7777;
const IPERF_PORT: u16 = 5201;
const PROGRAMS: [&str; 2] = ["from_pod", "to_pod"];

/// What one run measures; `--quick` shortens everything.
#[derive(Clone, Debug, Serialize)]
struct Settings {
    quick: bool,
    repetitions: usize,
    throughput_seconds: u32,
    round_trips: usize,
    connect_seconds: f64,
    churn_seconds: u64,
    churn_window_seconds: u64,
    enrollment_pods: usize,
    scaling_pairs: Vec<usize>,
    scaling_pods: Vec<usize>,
    scaling_throughput_seconds: u32,
}

impl Settings {
    fn new(quick: bool, repeat: Option<usize>) -> Self {
        if quick {
            Self {
                quick,
                repetitions: repeat.unwrap_or(1),
                throughput_seconds: 2,
                round_trips: 1_000,
                connect_seconds: CONNECT_SECONDS,
                churn_seconds: 10,
                churn_window_seconds: 3,
                enrollment_pods: 50,
                scaling_pairs: vec![1, 10],
                scaling_pods: vec![10, 100],
                scaling_throughput_seconds: 2,
            }
        } else {
            Self {
                quick,
                repetitions: repeat.unwrap_or(5),
                throughput_seconds: THROUGHPUT_SECONDS,
                round_trips: ROUND_TRIPS,
                connect_seconds: CONNECT_SECONDS,
                churn_seconds: CHURN_SECONDS,
                churn_window_seconds: CHURN_WINDOW_SECONDS,
                enrollment_pods: ENROLLMENT_PODS,
                scaling_pairs: SCALING_PAIRS.to_vec(),
                scaling_pods: SCALING_PODS.to_vec(),
                scaling_throughput_seconds: SCALING_THROUGHPUT_SECONDS,
            }
        }
    }

    /// Pods made for the enrollment measurements: enough for the row and the
    /// largest scaling figure.
    fn enrollment_total(&self) -> usize {
        self.scaling_pods
            .iter()
            .copied()
            .chain([self.enrollment_pods])
            .max()
            .unwrap_or(0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Path2 {
    Direct,
    Podlink,
}

impl Path2 {
    /// Both paths in the order of repetition `rep`: which goes first
    /// alternates, so that drift hits both alike.
    fn order(rep: usize) -> [Path2; 2] {
        if rep.is_multiple_of(2) {
            [Path2::Direct, Path2::Podlink]
        } else {
            [Path2::Podlink, Path2::Direct]
        }
    }

    fn namespace(self) -> &'static str {
        match self {
            Path2::Direct => "direct",
            Path2::Podlink => "mesh",
        }
    }
}

/// The full bench, or with `probe` one measurement of it ([`probe`]). The full
/// bench's report is printed, and written as JSON to `json` and as a Markdown
/// page to `markdown` when given.
pub fn run(
    repeat: Option<usize>,
    quick: bool,
    json: Option<&Path>,
    markdown: Option<&Path>,
    probe: Option<ProbeOptions>,
) -> Result<()> {
    // `--repeat 0` and the probe's flags were refused before setup (main).
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: cleaning up");
        probe::stop_hook();
        restore_bpf_stats();
        netns::cleanup();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    let result = match probe {
        Some(o) => probe::probe(&o),
        None => bench(Settings::new(quick, repeat), json, markdown),
    };
    restore_bpf_stats();
    netns::cleanup();
    result
}

/// The soak's echo server, run by the soak as a process of its own
/// (`xtask soak-server`).
pub fn soak_server(netns_name: &str, addr: std::net::SocketAddr) -> Result<()> {
    soak::serve(netns_name, addr)
}

/// The soak ([`soak`]): `minutes` long (default 10), its section written to
/// `markdown` when given.
pub fn run_soak(minutes: Option<u64>, markdown: Option<&Path>) -> Result<()> {
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: cleaning up");
        netns::cleanup();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    let result = soak::soak(minutes.unwrap_or(soak::DEFAULT_MINUTES), markdown);
    netns::cleanup();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_alternate_which_goes_first() {
        assert_eq!(Path2::order(0), [Path2::Direct, Path2::Podlink]);
        assert_eq!(Path2::order(1), [Path2::Podlink, Path2::Direct]);
        assert_eq!(Path2::order(2), Path2::order(0));
    }
}
