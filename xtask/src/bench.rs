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
//! * Agent CPU: for every podlink run, the change of both agents' utime + stime
//!   over the run, summed; the table shows its median and range per figure.
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
//! # Flags
//!
//! `--repeat N` (default 5), `--json FILE` (the same data, and every raw sample),
//! `--quick` (one repetition, 2 s throughput runs, 1,000 round trips, 10 s of
//! churn compared over 3 s windows, 50 pods for the enrollment row, 1 and 10 pairs
//! and 10 and 100 pods for scaling): for development, never to judge the targets.
//! `--probe ROW` and its flags measure one figure on its own bed instead
//! ([`probe`]).

use std::{
    collections::HashSet,
    fs,
    io::{Read, Write},
    net::{Shutdown, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{Cluster, Pod, PodSpec, app, netns};
use serde::Serialize;
use serde_json::Value;

mod probe;
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
const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";
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

// ---------------------------------------------------------------------------
// Statistics

#[derive(Clone, Debug, Serialize)]
struct Stats {
    median: f64,
    min: f64,
    max: f64,
    samples: Vec<f64>,
}

fn stats(samples: &[f64]) -> Stats {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Stats {
        median,
        min: v[0],
        max: v[n - 1],
        samples: samples.to_vec(),
    }
}

/// The nearest-rank percentile `q` (0..=1) of sorted values.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A number with as many decimals as its size deserves.
fn num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn fmt_stats(s: &Stats) -> String {
    if s.samples.len() == 1 {
        num(s.median)
    } else {
        format!("{} [{}-{}]", num(s.median), num(s.min), num(s.max))
    }
}

// ---------------------------------------------------------------------------
// Agent processes: memory and CPU time

/// VmRSS of a process, KiB (0 once it is gone).
fn rss_kib(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// utime + stime of a process, seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields = proc_stat(&stat).map(|(_, f)| f).unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum::<f64>() / ticks)
        .unwrap_or(0.0)
}

fn agent_pids(c: &Cluster) -> Vec<u32> {
    (0..c.nodes.len()).filter_map(|n| c.agent_pid(n)).collect()
}

/// CPU seconds both agents have used so far.
fn agents_cpu(c: &Cluster) -> f64 {
    agent_pids(c).into_iter().map(cpu_seconds).sum()
}

/// Samples the agents' VmRSS every 100 ms until stopped; keeps each one's maximum.
struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<u64>>,
}

impl RssSampler {
    fn start(pids: Vec<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut max = vec![0; pids.len()];
                loop {
                    for (m, pid) in max.iter_mut().zip(&pids) {
                        *m = (*m).max(rss_kib(*pid));
                    }
                    if stop.load(Ordering::Relaxed) {
                        return max;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        Self { stop, thread }
    }

    fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------
// The bed

/// Echo and iperf3 servers of the server pods; stopped on drop.
#[derive(Default)]
struct Servers {
    echo: Vec<app::EchoServer>,
    iperf: Vec<Child>,
}

impl Servers {
    fn serve(&mut self, pod: &Pod) -> Result<()> {
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

struct Bed {
    // Dropped first: the servers stop before the cluster goes.
    servers: Servers,
    cluster: Cluster,
    /// The pairs (client on node 1, server on node 2) of the main figures, by
    /// path.
    pairs: [(Pod, Pod); 2],
    /// The pairs of the churn runs, by path: fresh when the churn starts.
    churn_pairs: [(Pod, Pod); 2],
}

impl Bed {
    fn pair(&self, path: Path2) -> &(Pod, Pod) {
        &self.pairs[path as usize]
    }
}

/// Gives a client pod the widest port range and `tcp_tw_reuse`, so that short
/// connections to one server port do not measure the port search.
fn tune_client(pod: &Pod) -> Result<()> {
    netns::run(netns::command_in(&pod.netns, "sysctl").args([
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=1024 65535",
        "net.ipv4.tcp_tw_reuse=1",
    ]))?;
    Ok(())
}

/// Makes a client pod on node 1 and a server pod on node 2 in the path's namespace.
fn add_pair(c: &mut Cluster, path: Path2, client: &str, server: &str) -> Result<(Pod, Pod)> {
    let ns = path.namespace();
    Ok((
        c.add_pod(PodSpec::new(client, ns, 0).service_account("client"))?,
        c.add_pod(PodSpec::new(server, ns, 1).service_account("server"))?,
    ))
}

fn build_bed() -> Result<Bed> {
    let mut c = Cluster::new(2)?;
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
    c.start_agent_with(0, &[])?;
    c.start_agent_with(1, &[])?;
    wait_enrolled(&c, &enrolled)?;
    let mut servers = Servers::default();
    for (client, server) in pairs.iter().chain(&churn_pairs) {
        tune_client(client)?;
        servers.serve(server)?;
    }
    Ok(Bed {
        servers,
        cluster: c,
        pairs,
        churn_pairs,
    })
}

/// The two link pins of a pod's host veth: `<pins>/links/<ifindex>_<program>`.
fn link_pins(c: &Cluster, pod: &Pod) -> Result<(u32, [PathBuf; 2])> {
    let ifindex = c.host_ifindex(pod)?;
    let links = c.nodes[pod.node].pins().join("links");
    Ok((
        ifindex,
        PROGRAMS.map(|p| links.join(format!("{ifindex}_{p}"))),
    ))
}

/// Polls (every 100 µs) until both pins exist; false after `limit`.
fn wait_pins(pins: &[PathBuf; 2], limit: Duration) -> bool {
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
fn pods_map_keys(c: &Cluster, node: usize) -> Result<HashSet<u32>> {
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
fn wait_enrolled(c: &Cluster, pods: &[Pod]) -> Result<()> {
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

// ---------------------------------------------------------------------------
// Workloads

fn iperf3_command(client: &Pod, server: &Pod, seconds: u32, streams: usize) -> Command {
    let mut cmd = netns::command_in(&client.netns, "iperf3");
    cmd.args(iperf3_args(server, seconds, streams));
    cmd
}

fn iperf3_args(server: &Pod, seconds: u32, streams: usize) -> Vec<String> {
    [
        "-c",
        &server.ip.to_string(),
        "-p",
        &IPERF_PORT.to_string(),
        "-t",
        &seconds.to_string(),
        "-P",
        &streams.to_string(),
        "--connect-timeout",
        "5000",
        "-J",
    ]
    .map(String::from)
    .to_vec()
}

/// Bits per second received, from iperf3's JSON (all streams summed).
fn iperf3_received(stdout: &[u8]) -> Result<f64> {
    let v: Value = serde_json::from_slice(stdout)
        .with_context(|| format!("iperf3 output: {}", String::from_utf8_lossy(stdout)))?;
    if let Some(e) = v.get("error") {
        bail!("iperf3: {e}");
    }
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 reported no throughput")
}

/// One iperf3 run of `streams` streams: Gbit/s received.
fn throughput(client: &Pod, server: &Pod, seconds: u32, streams: usize) -> Result<f64> {
    let out = iperf3_command(client, server, seconds, streams).output()?;
    Ok(iperf3_received(&out.stdout)? / 1e9)
}

/// What [`throughput_concurrent`] measured.
struct Concurrent {
    /// The sum of what each run received (Gbit/s).
    gbps: f64,
    failures: usize,
    /// From the runs' start to the first and the last exit of those that
    /// measured something (s; 0 if none did).
    first_exit_seconds: f64,
    last_exit_seconds: f64,
}

/// iperf3 single stream on every pair at once, for `seconds`.
///
/// Each client first waits in its pod for a line on its standard input, and the
/// line goes to all of them once every one waits: starting 100 `ip netns exec`
/// processes takes seconds on a loaded machine, and would spread the runs apart
/// so that their rates' sum measured runs that did not overlap. How far the
/// runs' exits lie apart shows how well they did.
fn throughput_concurrent(pairs: &[(Pod, Pod)], seconds: u32) -> Result<Concurrent> {
    let mut children = pairs
        .iter()
        .map(|(client, server)| {
            netns::command_in(&client.netns, "sh")
                .args(["-c", r#"read -r _ && exec iperf3 "$@""#, "sh"])
                .args(iperf3_args(server, seconds, 1))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .context("starting iperf3")
        })
        .collect::<Result<Vec<Child>>>()?;
    wait_reading(&mut children)?;
    let start = Instant::now();
    for child in &mut children {
        // A client gone since it waited prints nothing: counted as failed.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"go\n");
        }
    }
    let ends: Vec<(f64, std::io::Result<std::process::Output>)> = std::thread::scope(|scope| {
        let waits: Vec<_> = children
            .into_iter()
            .map(|child| {
                scope.spawn(move || {
                    let out = child.wait_with_output();
                    (start.elapsed().as_secs_f64(), out)
                })
            })
            .collect();
        waits
            .into_iter()
            .map(|w| w.join().expect("waiting for iperf3 panicked"))
            .collect()
    });
    let mut c = Concurrent {
        gbps: 0.0,
        failures: 0,
        first_exit_seconds: f64::INFINITY,
        last_exit_seconds: 0.0,
    };
    // The exits of the runs that measured something: a failed one may have
    // ended at once.
    for (exit, out) in ends {
        match iperf3_received(&out?.stdout) {
            Ok(bps) => {
                c.gbps += bps / 1e9;
                c.first_exit_seconds = c.first_exit_seconds.min(exit);
                c.last_exit_seconds = c.last_exit_seconds.max(exit);
            }
            Err(e) => {
                c.failures += 1;
                eprintln!("bench: {e:#}");
            }
        }
    }
    if c.first_exit_seconds.is_infinite() {
        c.first_exit_seconds = 0.0;
    }
    Ok(c)
}

/// A `/proc/PID/stat` line ("pid (comm) state ...", proc(5)): the command name
/// and the fields after it, from field 3 (the state). The name may hold spaces
/// and parentheses; the fields follow its last closing parenthesis.
fn proc_stat(stat: &str) -> Option<(&str, Vec<&str>)> {
    let (comm, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
    Some((comm, rest.split_whitespace().collect()))
}

/// Whether a `/proc/PID/stat` line is a shell's that sleeps.
fn is_sleeping_shell(stat: &str) -> bool {
    proc_stat(stat).is_some_and(|(comm, fields)| comm == "sh" && fields.first() == Some(&"S"))
}

/// Waits until every child is the shell of [`throughput_concurrent`], asleep
/// (in its `read`), 60 s at most.
///
/// # Errors
/// A child that exited (its `ip netns exec` failed, say), or one not waiting
/// after 60 s.
fn wait_reading(children: &mut [Child]) -> Result<()> {
    let limit = Instant::now() + Duration::from_secs(60);
    for child in children {
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "iperf3 client {} exited before its start: {status}",
                    child.id()
                );
            }
            // Unreadable once it exited: the next try_wait tells how.
            let stat = fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap_or_default();
            if is_sleeping_shell(&stat) {
                break;
            }
            if Instant::now() > limit {
                bail!(
                    "iperf3 client {} was not waiting after 60 s: {stat}",
                    child.id()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

/// Round-trip times (µs) of `size`-byte messages on one connection: p50 and p99.
fn latency(client: &Pod, server: SocketAddr, size: usize, round_trips: usize) -> Result<[f64; 2]> {
    let mut stream = app::connect(&client.netns, server, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    app::read_greeting(&stream)?;
    let msg = vec![0x5a; size];
    let mut back = vec![0; size];
    for _ in 0..100 {
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
    }
    let mut rtts = Vec::with_capacity(round_trips);
    for _ in 0..round_trips {
        let t = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    rtts.sort_by(f64::total_cmp);
    Ok([percentile(&rtts, 0.5), percentile(&rtts, 0.99)])
}

/// What a run of connecting clients did.
#[derive(Clone, Debug, Serialize)]
struct ClientRun {
    /// Connections completed in each second of the run.
    per_second: Vec<u64>,
    completed: u64,
    failed: u64,
    seconds: f64,
    /// Where a completed connection's time went, p50 of each phase (when asked
    /// for, and some connection completed).
    phases: Option<Phases>,
}

/// The phases of a connection as its client sees them (µs): `connect()` until it
/// returns (once the kernel completed the handshake on the listening socket: on
/// the podlink path the outbound proxy's, before the proxy accepts it), then
/// until the server's greeting is read, then sending 1 KiB, half-closing and
/// reading the echo to the end of the stream; and the whole. On the podlink
/// path the greeting waits for the proxy's accept, the HBONE CONNECT, the
/// upstream connection to the server pod and the greeting's way back through
/// both proxies; the echo and the close cross both proxies there and back.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Phases {
    connect_us: f64,
    greeting_us: f64,
    echo_close_us: f64,
    total_us: f64,
}

impl Phases {
    /// The p50 of each phase over `samples` (one per connection: the phases'
    /// seconds, then the whole's); `None` without samples.
    fn p50(samples: &[[f64; 4]]) -> Option<Phases> {
        if samples.is_empty() {
            return None;
        }
        let at = |i: usize| {
            let mut v: Vec<f64> = samples.iter().map(|s| s[i] * 1e6).collect();
            v.sort_by(f64::total_cmp);
            percentile(&v, 0.5)
        };
        Some(Phases {
            connect_us: at(0),
            greeting_us: at(1),
            echo_close_us: at(2),
            total_us: at(3),
        })
    }

    /// Each field's median over `runs` (as the main table's medians); `None`
    /// without runs.
    fn median(runs: &[Phases]) -> Option<Phases> {
        if runs.is_empty() {
            return None;
        }
        let of = |f: fn(&Phases) -> f64| stats(&runs.iter().map(f).collect::<Vec<_>>()).median;
        Some(Phases {
            connect_us: of(|p| p.connect_us),
            greeting_us: of(|p| p.greeting_us),
            echo_close_us: of(|p| p.echo_close_us),
            total_us: of(|p| p.total_us),
        })
    }
}

impl ClientRun {
    fn rate(&self) -> f64 {
        self.completed as f64 / self.seconds
    }

    /// Connections per second over the first (`last == false`) or last `window`
    /// seconds.
    fn window_rate(&self, window: u64, last: bool) -> f64 {
        let n = self.per_second.len();
        let w = (window as usize).min(n);
        let slice = if last {
            &self.per_second[n - w..]
        } else {
            &self.per_second[..w]
        };
        slice.iter().sum::<u64>() as f64 / w as f64
    }
}

/// `per_target` client threads for each (client pod, echo server) target, each
/// opening one connection after the other (connect, greeting, 1 KiB each way,
/// close) for `seconds`. Completions are counted in the second they end in; with
/// `phases`, each completed connection's phases are timed too ([`Phases`]).
fn run_clients(
    targets: &[(&Pod, SocketAddr)],
    per_target: usize,
    seconds: f64,
    phases: bool,
) -> Result<ClientRun> {
    let length = Duration::from_secs_f64(seconds);
    let buckets: Arc<Vec<AtomicU64>> = Arc::new(
        (0..seconds.ceil() as usize)
            .map(|_| AtomicU64::new(0))
            .collect(),
    );
    let failed = Arc::new(AtomicU64::new(0));
    let timed = phases;
    let phases = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let mut threads = Vec::new();
    for (client, server) in targets {
        for _ in 0..per_target {
            let (buckets, failed, phases, server) =
                (buckets.clone(), failed.clone(), phases.clone(), *server);
            threads.push(netns::spawn_in_netns(&client.netns, move || {
                let payload = [0x42u8; 1024];
                let mut mine: Vec<[f64; 4]> = Vec::new();
                while start.elapsed() < length {
                    let one = || -> std::io::Result<[f64; 4]> {
                        let begin = Instant::now();
                        let mut s =
                            std::net::TcpStream::connect_timeout(&server, Duration::from_secs(5))?;
                        let connected = Instant::now();
                        s.set_read_timeout(Some(Duration::from_secs(5)))?;
                        app::read_greeting(&s)?;
                        let greeted = Instant::now();
                        s.write_all(&payload)?;
                        s.shutdown(Shutdown::Write)?;
                        let mut back = Vec::with_capacity(1024);
                        s.read_to_end(&mut back)?;
                        if back.len() != payload.len() {
                            return Err(std::io::Error::other("short echo"));
                        }
                        let end = Instant::now();
                        Ok([
                            (connected - begin).as_secs_f64(),
                            (greeted - connected).as_secs_f64(),
                            (end - greeted).as_secs_f64(),
                            (end - begin).as_secs_f64(),
                        ])
                    };
                    let result = one();
                    let at = start.elapsed();
                    match result {
                        Ok(phases) if at < length => {
                            buckets[at.as_secs() as usize].fetch_add(1, Ordering::Relaxed);
                            if timed {
                                mine.push(phases);
                            }
                        }
                        Ok(_) => {}
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                phases.lock().unwrap().append(&mut mine);
            })?);
        }
    }
    for t in threads {
        let _ = t.join();
    }
    let phases = Phases::p50(&phases.lock().unwrap());
    let per_second: Vec<u64> = buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
    let failed = failed.load(Ordering::Relaxed);
    if failed > 0 {
        eprintln!("bench: {failed} connections failed during a connection run");
    }
    Ok(ClientRun {
        completed: per_second.iter().sum(),
        per_second,
        failed,
        seconds,
        phases,
    })
}

// ---------------------------------------------------------------------------
// eBPF program statistics

/// The value of `kernel.bpf_stats_enabled` to restore, while the bench has it on.
static BPF_STATS_PREVIOUS: Mutex<Option<String>> = Mutex::new(None);

/// `kernel.bpf_stats_enabled=1` while alive; the previous value comes back on drop
/// (and from the Ctrl-C handler, through [`restore_bpf_stats`]).
struct BpfStatsOn;

impl BpfStatsOn {
    fn enable() -> Result<Self> {
        let previous = fs::read_to_string(BPF_STATS_SYSCTL)
            .with_context(|| format!("reading {BPF_STATS_SYSCTL}"))?;
        *BPF_STATS_PREVIOUS.lock().unwrap() = Some(previous.trim().to_string());
        fs::write(BPF_STATS_SYSCTL, "1").with_context(|| format!("writing {BPF_STATS_SYSCTL}"))?;
        Ok(Self)
    }
}

impl Drop for BpfStatsOn {
    fn drop(&mut self) {
        restore_bpf_stats();
    }
}

fn restore_bpf_stats() {
    if let Some(previous) = BPF_STATS_PREVIOUS.lock().unwrap().take() {
        let _ = fs::write(BPF_STATS_SYSCTL, previous);
    }
}

/// One loaded program's counters.
#[derive(Clone, Debug, Serialize)]
struct ProgCounters {
    name: String,
    id: u64,
    node: usize,
    run_time_ns: u64,
    run_cnt: u64,
}

/// The counters of the podlink programs the bed's link pins use (one instance of
/// each program per node agent), found by name in `bpftool prog show`.
fn program_counters(c: &Cluster, pods: [&Pod; 2]) -> Result<Vec<ProgCounters>> {
    let mut wanted = Vec::new();
    for pod in pods {
        let (_, pins) = link_pins(c, pod)?;
        for (name, pin) in PROGRAMS.iter().zip(&pins) {
            let out = netns::run(
                Command::new("bpftool")
                    .args(["-j", "link", "show", "pinned"])
                    .arg(pin),
            )?;
            let link: Value = serde_json::from_slice(&out.stdout)?;
            let id = link["prog_id"]
                .as_u64()
                .with_context(|| format!("no prog_id for {}: {link}", pin.display()))?;
            wanted.push((*name, id, pod.node));
        }
    }
    let out = netns::run(Command::new("bpftool").args(["-j", "prog", "show"]))?;
    let progs: Value = serde_json::from_slice(&out.stdout)?;
    let progs = progs.as_array().cloned().unwrap_or_default();
    wanted
        .into_iter()
        .map(|(name, id, node)| {
            let prog = progs
                .iter()
                .find(|p| p["id"].as_u64() == Some(id) && p["name"].as_str() == Some(name))
                .with_context(|| format!("bpftool prog show lists no {name} with id {id}"))?;
            Ok(ProgCounters {
                name: name.to_string(),
                id,
                node,
                // bpftool leaves both out while they are zero.
                run_time_ns: prog["run_time_ns"].as_u64().unwrap_or(0),
                run_cnt: prog["run_cnt"].as_u64().unwrap_or(0),
            })
        })
        .collect()
}

/// The eBPF counters over each kind of podlink run, for profiling: which
/// workload the per-packet cost comes from.
#[derive(Debug, Default, Serialize)]
struct EbpfByWorkload {
    /// Per kind of run and program, summed over nodes and runs.
    runs: Vec<WorkloadCounters>,
}

#[derive(Debug, Serialize)]
struct WorkloadCounters {
    workload: String,
    program: String,
    run_time_ns: u64,
    run_cnt: u64,
}

impl EbpfByWorkload {
    /// Runs `run`; for a podlink run, adds the change of the counters of the
    /// programs `pods` use over it to `workload` (the direct path runs none).
    fn measure<T>(
        &mut self,
        c: &Cluster,
        pods: [&Pod; 2],
        workload: &str,
        path: Path2,
        run: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if path != Path2::Podlink {
            return run();
        }
        let before = program_counters(c, pods)?;
        let value = run()?;
        let after = program_counters(c, pods)?;
        for d in counters_delta(&before, &after) {
            match self
                .runs
                .iter_mut()
                .find(|r| r.workload == workload && r.program == d.name)
            {
                Some(r) => {
                    r.run_time_ns += d.run_time_ns;
                    r.run_cnt += d.run_cnt;
                }
                None => self.runs.push(WorkloadCounters {
                    workload: workload.into(),
                    program: d.name,
                    run_time_ns: d.run_time_ns,
                    run_cnt: d.run_cnt,
                }),
            }
        }
        Ok(value)
    }

    /// "workload: from_pod N ns (runs), to_pod N ns (runs)" lines.
    fn lines(&self) -> Vec<String> {
        let mut workloads: Vec<&str> = Vec::new();
        for r in &self.runs {
            if !workloads.contains(&r.workload.as_str()) {
                workloads.push(&r.workload);
            }
        }
        workloads
            .into_iter()
            .map(|w| {
                let parts: Vec<String> = self
                    .runs
                    .iter()
                    .filter(|r| r.workload == w)
                    .map(|r| {
                        let ns = if r.run_cnt > 0 {
                            r.run_time_ns as f64 / r.run_cnt as f64
                        } else {
                            0.0
                        };
                        format!("{} {} ns ({} runs)", r.program, num(ns), r.run_cnt)
                    })
                    .collect();
                format!("{w}: {}", parts.join(", "))
            })
            .collect()
    }
}

/// The counters' change from `before` to `after`.
fn counters_delta(before: &[ProgCounters], after: &[ProgCounters]) -> Vec<ProgCounters> {
    after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.id == a.id && b.node == a.node);
            ProgCounters {
                run_time_ns: a.run_time_ns - b.map_or(0, |b| b.run_time_ns),
                run_cnt: a.run_cnt - b.map_or(0, |b| b.run_cnt),
                ..a.clone()
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Enrollment

#[derive(Debug, Serialize)]
struct Enrollment {
    /// Pods made through the CNI plugins for the enrollment runs, and how long
    /// that took (not part of the enrollment times).
    pods_created: usize,
    creation_seconds: f64,
    /// Per pod, in order: ms from its manifest being in place to both its link
    /// pins existing.
    per_pod_ms: Vec<f64>,
    /// Per pod: seconds from the first manifest write to its links.
    cumulative_seconds: Vec<f64>,
    /// The pod (index) that was not enrolled within the timeout; the run stopped
    /// there.
    timed_out_at: Option<usize>,
    /// Pods with links but no pods map entry in the dump at the end.
    missing_map_entries: usize,
    agent_cpu_seconds: f64,
}

impl Enrollment {
    /// p50, p99 and max (ms) over the first `n` pods, and the time to the n-th
    /// pod's links (s); `None` if fewer were enrolled.
    fn summary(&self, n: usize) -> Option<EnrollmentSummary> {
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
struct EnrollmentSummary {
    pods: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    total_seconds: f64,
}

/// Makes `count` pods on node 1 in the enrolled namespace `enroll` (CNI only),
/// then lists them one at a time, timing each one's enrollment.
fn enrollment(c: &mut Cluster, count: usize) -> Result<Enrollment> {
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

// ---------------------------------------------------------------------------
// The report

/// A figure's samples: each path's value per repetition, and the agents' CPU
/// seconds of each podlink run.
#[derive(Default)]
struct Series {
    direct: Vec<f64>,
    podlink: Vec<f64>,
    cpu: Vec<f64>,
}

impl Series {
    fn push(&mut self, path: Path2, value: f64, cpu: f64) {
        match path {
            Path2::Direct => self.direct.push(value),
            Path2::Podlink => {
                self.podlink.push(value);
                self.cpu.push(cpu);
            }
        }
    }
}

/// The target of a row comparing the paths.
#[derive(Clone, Copy)]
enum Compare {
    /// podlink / direct at least this.
    RatioAtLeast(f64),
    /// podlink − direct at most this.
    AddedAtMost(f64),
}

/// The target of a row of podlink's own value.
#[derive(Clone, Copy)]
enum Limit {
    AtMost(f64),
    AtLeast(f64),
}

#[derive(Serialize)]
struct Row {
    figure: String,
    unit: String,
    direct: Option<Stats>,
    podlink: Option<Stats>,
    /// What the table prints in place of the stats, when they do not say it all.
    direct_text: Option<String>,
    podlink_text: Option<String>,
    /// podlink / direct ("ratio"), podlink − direct ("added"), or none.
    comparison: Option<f64>,
    comparison_kind: &'static str,
    target: String,
    met: Option<bool>,
    /// Both agents' CPU seconds per podlink run.
    agent_cpu_seconds: Option<Stats>,
}

impl Row {
    /// A row comparing the two paths' medians.
    fn compared(figure: &str, unit: &str, series: &Series, target: Compare) -> Self {
        let direct = stats(&series.direct);
        let podlink = stats(&series.podlink);
        let (comparison, kind, met, target) = match target {
            Compare::RatioAtLeast(t) => {
                let r = podlink.median / direct.median;
                (r, "ratio", r >= t, format!(">= {t} x"))
            }
            Compare::AddedAtMost(t) => {
                let a = podlink.median - direct.median;
                (a, "added", a <= t, format!("+{t} {unit} max"))
            }
        };
        Row {
            figure: figure.into(),
            unit: unit.into(),
            direct: Some(direct),
            podlink: Some(podlink),
            direct_text: None,
            podlink_text: None,
            comparison: Some(comparison),
            comparison_kind: kind,
            target,
            met: Some(met),
            agent_cpu_seconds: (!series.cpu.is_empty()).then(|| stats(&series.cpu)),
        }
    }

    /// A row of podlink's own value (no direct counterpart).
    fn own(figure: &str, unit: &str, value: Option<f64>, text: String, target: Limit) -> Self {
        let (met, target) = match target {
            Limit::AtMost(t) => (value.map(|v| v <= t), format!("<= {t} {unit}")),
            Limit::AtLeast(t) => (value.map(|v| v >= t), format!(">= {t}")),
        };
        Row {
            figure: figure.into(),
            unit: unit.into(),
            direct: None,
            podlink: value.map(|v| stats(&[v])),
            direct_text: None,
            podlink_text: Some(text),
            comparison: None,
            comparison_kind: "none",
            target,
            met,
            agent_cpu_seconds: None,
        }
    }
}

#[derive(Serialize)]
struct Machine {
    cores: usize,
    cpu_model: String,
    kernel: String,
    /// /proc/loadavg when the bench started and when its measurements ended (the
    /// machine may be shared).
    load_average_at_start: String,
    load_average_at_end: String,
    /// How an idle CPU waits: the cpuidle driver and governor, and the guest
    /// halt-polling window of the `haltpoll` driver in ns, e.g. "cpuidle
    /// haltpoll/haltpoll, guest_halt_poll_ns=0" (empty where sysfs has neither).
    /// On a virtual machine a vCPU that halts at once is woken by an interrupt
    /// through the host, so the setting moves every figure whose threads sleep
    /// between events (kernel Documentation/virt/guest-halt-polling.rst).
    cpu_idle: String,
}

/// The 1, 5 and 15 minute load averages.
fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn machine() -> Machine {
    let cpu_model = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_string())
        .unwrap_or_default();
    Machine {
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model,
        kernel,
        load_average_at_start: load_average(),
        load_average_at_end: String::new(),
        cpu_idle: cpu_idle(),
    }
}

/// The idle policy for [`Machine::cpu_idle`], read from sysfs.
fn cpu_idle() -> String {
    cpu_idle_from(|p| fs::read_to_string(p).map(|v| v.trim().to_string()).ok())
}

/// [`cpu_idle`] with `read` for sysfs (a file's trimmed contents, `None` where
/// it cannot be read).
fn cpu_idle_from(read: impl Fn(&str) -> Option<String>) -> String {
    let mut parts = Vec::new();
    if let Some(driver) = read("/sys/devices/system/cpu/cpuidle/current_driver") {
        let governor = read("/sys/devices/system/cpu/cpuidle/current_governor")
            .or_else(|| read("/sys/devices/system/cpu/cpuidle/current_governor_ro"))
            .unwrap_or_default();
        parts.push(format!("cpuidle {driver}/{governor}"));
    }
    if let Some(ns) = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        parts.push(format!("guest_halt_poll_ns={ns}"));
    }
    parts.join(", ")
}

#[derive(Serialize)]
struct Churn {
    direct: ClientRun,
    podlink: ClientRun,
    podlink_agent_cpu_seconds: f64,
}

#[derive(Serialize)]
struct Memory {
    /// VmRSS (KiB) of the agents of node 1 and node 2 after the bed settled.
    idle_kib: Vec<u64>,
    /// Their largest VmRSS (KiB) sampled during the podlink throughput runs.
    throughput_max_kib: Vec<u64>,
}

#[derive(Serialize)]
struct ScalingRun {
    pairs: usize,
    path: Path2,
    /// Sum of the pairs' single-stream iperf3 results.
    throughput_gbps: f64,
    throughput_failures: usize,
    /// From the start of the concurrent iperf3 runs (all at once, see
    /// `throughput_concurrent`) to the first one's exit.
    throughput_first_exit_seconds: f64,
    /// From the start of the concurrent iperf3 runs to the last one's exit
    /// (before the clients started together, `throughput_batch_seconds`,
    /// from the first client's start).
    throughput_last_exit_seconds: f64,
    throughput_agent_cpu_seconds: f64,
    connections_per_second: f64,
    connection_failures: u64,
    connections_agent_cpu_seconds: f64,
}

/// The phases of the one-client connection runs: each run's p50s, and their
/// medians over the runs, per path (`None` if no run completed a connection).
#[derive(Serialize)]
struct OneClientPhases {
    direct: Option<Phases>,
    podlink: Option<Phases>,
    runs: [Vec<Phases>; 2],
}

impl OneClientPhases {
    fn new(runs: [Vec<Phases>; 2]) -> Self {
        OneClientPhases {
            direct: Phases::median(&runs[Path2::Direct as usize]),
            podlink: Phases::median(&runs[Path2::Podlink as usize]),
            runs,
        }
    }
}

#[derive(Serialize)]
struct Scaling {
    /// Time to make the pairs' pods (CNI) and get the enrolled ones captured.
    pairs_setup_seconds: f64,
    runs: Vec<ScalingRun>,
    enrollment: Vec<EnrollmentSummary>,
}

#[derive(Serialize, Default)]
struct Timings {
    bed_seconds: f64,
    main_table_seconds: f64,
    scaling_seconds: f64,
    enrollment_seconds: f64,
    cleanup_seconds: f64,
    total_seconds: f64,
}

#[derive(Serialize)]
struct Report {
    machine: Machine,
    settings: Settings,
    rows: Vec<Row>,
    churn: Churn,
    memory: Memory,
    /// Each program instance's counters over the measured span.
    ebpf: Vec<ProgCounters>,
    /// The same counters by kind of run.
    ebpf_by_workload: EbpfByWorkload,
    /// Where the time of a new connection goes, one client.
    one_client_phases: OneClientPhases,
    enrollment: Enrollment,
    scaling: Scaling,
    timings: Timings,
}

// ---------------------------------------------------------------------------
// The run

/// The full bench, or with `probe` one measurement of it ([`probe`]).
pub fn run(
    repeat: Option<usize>,
    quick: bool,
    json: Option<&Path>,
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
        None => bench(Settings::new(quick, repeat), json),
    };
    restore_bpf_stats();
    netns::cleanup();
    result
}

fn bench(s: Settings, json: Option<&Path>) -> Result<()> {
    let started = Instant::now();
    let mut machine = machine();
    let mut timings = Timings::default();

    eprintln!("bench: building the two-node test bed");
    let mut bed = build_bed()?;
    // Let the agents finish what enrollment started before memory is read.
    std::thread::sleep(Duration::from_secs(2));
    let idle_kib: Vec<u64> = agent_pids(&bed.cluster).into_iter().map(rss_kib).collect();
    timings.bed_seconds = started.elapsed().as_secs_f64();

    let t = Instant::now();
    let stats_on = BpfStatsOn::enable()?;
    let prog_pods = [&bed.pair(Path2::Podlink).0, &bed.pair(Path2::Podlink).1];
    let counters_before = program_counters(&bed.cluster, prog_pods)?;
    let mut ebpf_by_workload = EbpfByWorkload::default();
    let mut throughput_max_kib = vec![0; idle_kib.len()];
    let mut t1 = Series::default();
    let mut t4 = Series::default();
    let mut rr = [(); 4].map(|_| Series::default()); // 1 B p50, p99, 1 KiB p50, p99
    let mut one_client_phases: [Vec<Phases>; 2] = Default::default();
    let mut c1 = Series::default();
    let mut c16 = Series::default();
    for rep in 0..s.repetitions {
        eprintln!("bench: repetition {}/{}", rep + 1, s.repetitions);
        let order = Path2::order(rep);
        let pids = agent_pids(&bed.cluster);
        for (series, streams) in [(&mut t1, 1), (&mut t4, 4)] {
            for path in order {
                let (client, server) = bed.pair(path);
                let sampler = (path == Path2::Podlink).then(|| RssSampler::start(pids.clone()));
                let cpu = agents_cpu(&bed.cluster);
                let workload = if streams == 1 {
                    "single-stream throughput"
                } else {
                    "4-stream throughput"
                };
                let v =
                    ebpf_by_workload.measure(&bed.cluster, prog_pods, workload, path, || {
                        throughput(client, server, s.throughput_seconds, streams)
                    })?;
                series.push(path, v, agents_cpu(&bed.cluster) - cpu);
                if let Some(sampler) = sampler {
                    for (m, v) in throughput_max_kib.iter_mut().zip(sampler.stop()) {
                        *m = (*m).max(v);
                    }
                }
            }
        }
        for (i, size) in [1, 1024].into_iter().enumerate() {
            for path in order {
                let (client, server) = bed.pair(path);
                let cpu = agents_cpu(&bed.cluster);
                let [p50, p99] = ebpf_by_workload.measure(
                    &bed.cluster,
                    prog_pods,
                    "request/response",
                    path,
                    || latency(client, server.addr(ECHO_PORT), size, s.round_trips),
                )?;
                let cpu = agents_cpu(&bed.cluster) - cpu;
                rr[2 * i].push(path, p50, cpu);
                rr[2 * i + 1].push(path, p99, cpu);
            }
        }
        for (series, clients) in [(&mut c1, 1), (&mut c16, MANY_CLIENTS)] {
            for path in order {
                let (client, server) = bed.pair(path);
                let cpu = agents_cpu(&bed.cluster);
                let run = ebpf_by_workload.measure(
                    &bed.cluster,
                    prog_pods,
                    "new connections",
                    path,
                    || {
                        run_clients(
                            &[(client, server.addr(ECHO_PORT))],
                            clients,
                            s.connect_seconds,
                            clients == 1,
                        )
                    },
                )?;
                series.push(path, run.rate(), agents_cpu(&bed.cluster) - cpu);
                if let Some(phases) = run.phases {
                    one_client_phases[path as usize].push(phases);
                }
            }
        }
    }

    eprintln!(
        "bench: sustained churn, {} s per path, {MANY_CLIENTS} clients",
        s.churn_seconds
    );
    let churn_run = |path: Path2| {
        let (client, server) = &bed.churn_pairs[path as usize];
        run_clients(
            &[(client, server.addr(ECHO_PORT))],
            MANY_CLIENTS,
            s.churn_seconds as f64,
            false,
        )
    };
    let direct_churn = churn_run(Path2::Direct)?;
    let cpu = agents_cpu(&bed.cluster);
    let podlink_churn =
        ebpf_by_workload.measure(&bed.cluster, prog_pods, "churn", Path2::Podlink, || {
            churn_run(Path2::Podlink)
        })?;
    let churn = Churn {
        direct: direct_churn,
        podlink: podlink_churn,
        podlink_agent_cpu_seconds: agents_cpu(&bed.cluster) - cpu,
    };
    let counters_after = program_counters(&bed.cluster, prog_pods)?;
    drop(stats_on);
    let ebpf = counters_delta(&counters_before, &counters_after);
    timings.main_table_seconds = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let scaling_runs = scaling(&mut bed, &s)?;
    timings.scaling_seconds = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let enrollment = enrollment(&mut bed.cluster, s.enrollment_total())?;
    timings.enrollment_seconds = t.elapsed().as_secs_f64();
    let scaling = Scaling {
        pairs_setup_seconds: scaling_runs.0,
        runs: scaling_runs.1,
        enrollment: s
            .scaling_pods
            .iter()
            .filter_map(|n| enrollment.summary(*n))
            .collect(),
    };

    let memory = Memory {
        idle_kib,
        throughput_max_kib,
    };
    let rows = main_rows(
        &s,
        [&t1, &t4],
        &rr,
        [&c1, &c16],
        &churn,
        &memory,
        &ebpf,
        &enrollment,
    );

    machine.load_average_at_end = load_average();
    eprintln!("bench: removing the test bed");
    let t = Instant::now();
    drop(bed);
    netns::cleanup();
    timings.cleanup_seconds = t.elapsed().as_secs_f64();
    timings.total_seconds = started.elapsed().as_secs_f64();

    let report = Report {
        machine,
        settings: s,
        rows,
        churn,
        memory,
        ebpf,
        ebpf_by_workload,
        one_client_phases: OneClientPhases::new(one_client_phases),
        enrollment,
        scaling,
        timings,
    };
    print_report(&report);
    if let Some(path) = json {
        fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

/// The scaling table's traffic: makes the pairs, then runs each size on both
/// paths. Returns the setup time and the runs.
fn scaling(bed: &mut Bed, s: &Settings) -> Result<(f64, Vec<ScalingRun>)> {
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
type PairsByPath = [Vec<(Pod, Pod)>; 2];

/// Makes `n` more pod pairs per path, waits until the podlink ones are
/// enrolled and starts their servers. Returns them and the time it took (s).
fn scaling_pairs(bed: &mut Bed, n: usize) -> Result<(PairsByPath, f64)> {
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
fn scaling_run(
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

#[allow(clippy::too_many_arguments)]
fn main_rows(
    s: &Settings,
    throughput: [&Series; 2],
    rr: &[Series; 4],
    conn: [&Series; 2],
    churn: &Churn,
    memory: &Memory,
    ebpf: &[ProgCounters],
    enrollment: &Enrollment,
) -> Vec<Row> {
    let secs = s.throughput_seconds;
    let trips = s.round_trips;
    let mut rows = vec![
        Row::compared(
            &format!("single-stream throughput, iperf3 -t {secs}"),
            "Gbit/s",
            throughput[0],
            Compare::RatioAtLeast(0.6),
        ),
        Row::compared(
            &format!("4-stream throughput, iperf3 -P 4 -t {secs}"),
            "Gbit/s",
            throughput[1],
            Compare::RatioAtLeast(0.35),
        ),
    ];
    for (i, (size, q)) in [
        ("1 B", "p50"),
        ("1 B", "p99"),
        ("1 KiB", "p50"),
        ("1 KiB", "p99"),
    ]
    .into_iter()
    .enumerate()
    {
        let limit = if q == "p50" { 85.0 } else { 650.0 };
        rows.push(Row::compared(
            &format!("request/response {size}, {trips} round trips, {q}"),
            "µs",
            &rr[i],
            Compare::AddedAtMost(limit),
        ));
    }
    for (series, clients) in [(conn[0], "1 client"), (conn[1], "16 clients")] {
        rows.push(Row::compared(
            &format!("new connections/s, {clients}"),
            "conn/s",
            series,
            Compare::RatioAtLeast(0.45),
        ));
    }

    let w = s.churn_window_seconds;
    let churn_text = |r: &ClientRun| {
        let (first, last) = (r.window_rate(w, false), r.window_rate(w, true));
        (
            last / first,
            format!(
                "{:.2} ({} -> {}/s{})",
                last / first,
                num(first),
                num(last),
                if r.failed > 0 {
                    format!(", {} failed", r.failed)
                } else {
                    String::new()
                }
            ),
        )
    };
    let (direct_ratio, direct_text) = churn_text(&churn.direct);
    let (podlink_ratio, podlink_text) = churn_text(&churn.podlink);
    let mut row = Row::own(
        &format!(
            "churn {} s, {MANY_CLIENTS} clients: rate last {w} s / first {w} s",
            s.churn_seconds
        ),
        "",
        Some(podlink_ratio),
        podlink_text,
        Limit::AtLeast(0.9),
    );
    row.direct = Some(stats(&[direct_ratio]));
    row.direct_text = Some(direct_text);
    row.agent_cpu_seconds = Some(stats(&[churn.podlink_agent_cpu_seconds]));
    rows.push(row);

    let mib = |k: u64| k as f64 / 1024.0;
    let idle = memory.idle_kib.iter().map(|k| mib(*k)).collect::<Vec<_>>();
    rows.push(Row::own(
        &format!("agent RSS idle, {ENROLLED_ON_NODE1} enrolled pods (node 1)"),
        "MiB",
        idle.first().copied(),
        format!(
            "{} (node 2: {})",
            num(idle.first().copied().unwrap_or(0.0)),
            num(idle.get(1).copied().unwrap_or(0.0))
        ),
        Limit::AtMost(10.0),
    ));
    let busy = memory
        .throughput_max_kib
        .iter()
        .map(|k| mib(*k))
        .collect::<Vec<_>>();
    let busy_max = busy.iter().copied().fold(0.0, f64::max);
    rows.push(Row::own(
        "agent RSS during throughput runs (max)",
        "MiB",
        Some(busy_max),
        format!(
            "{} (node 1: {}, node 2: {})",
            num(busy_max),
            num(busy.first().copied().unwrap_or(0.0)),
            num(busy.get(1).copied().unwrap_or(0.0))
        ),
        Limit::AtMost(20.0),
    ));

    for name in PROGRAMS {
        let (ns, cnt) = ebpf
            .iter()
            .filter(|p| p.name == name)
            .fold((0, 0), |(t, c), p| (t + p.run_time_ns, c + p.run_cnt));
        let per_packet = (cnt > 0).then(|| ns as f64 / cnt as f64);
        rows.push(Row::own(
            &format!("eBPF {name} cost per packet"),
            "ns",
            per_packet,
            match per_packet {
                Some(v) => format!("{} ({cnt} runs)", num(v)),
                None => "no runs counted".into(),
            },
            Limit::AtMost(150.0),
        ));
    }

    let n = s.enrollment_pods;
    let summary = enrollment.summary(n);
    let mut text = match &summary {
        Some(e) => format!(
            "{} (p50 {}, max {})",
            num(e.p99_ms),
            num(e.p50_ms),
            num(e.max_ms)
        ),
        None => format!("only {} pods enrolled", enrollment.per_pod_ms.len()),
    };
    if enrollment.missing_map_entries > 0 {
        text += &format!("; {} without map entry", enrollment.missing_map_entries);
    }
    let mut row = Row::own(
        &format!("pod enrollment over {n} pods, p99"),
        "ms",
        summary.as_ref().map(|e| e.p99_ms),
        text,
        Limit::AtMost(5.0),
    );
    if enrollment.missing_map_entries > 0 {
        row.met = Some(false);
    }
    rows.push(row);
    rows
}

// ---------------------------------------------------------------------------
// Printing

/// Prints rows of cells as aligned columns.
fn print_grid(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    line(widths.iter().map(|w| "-".repeat(*w)).collect());
    for row in rows {
        line(row.clone());
    }
}

fn print_report(r: &Report) {
    let m = &r.machine;
    let s = &r.settings;
    println!();
    if s.quick {
        println!(
            "QUICK RUN (--quick): shortened runs for development; these figures do not judge the targets"
        );
    }
    println!(
        "podlink bench: {} cores, {}, kernel {}{}; load average {} at the start, {} at the end",
        m.cores,
        m.cpu_model,
        m.kernel,
        if m.cpu_idle.is_empty() {
            String::new()
        } else {
            format!(" ({})", m.cpu_idle)
        },
        m.load_average_at_start,
        m.load_average_at_end
    );
    println!(
        "pod on node 1 -> pod on node 2; {} interleaved repetition(s): median [min-max]; agent CPU = both agents' utime+stime per podlink run",
        s.repetitions
    );
    println!();
    let rows: Vec<Vec<String>> = r
        .rows
        .iter()
        .map(|row| {
            let cell = |text: &Option<String>, stats: &Option<Stats>| match (text, stats) {
                (Some(t), _) => t.clone(),
                (None, Some(s)) => fmt_stats(s),
                (None, None) => "-".into(),
            };
            let figure = if row.unit.is_empty() {
                row.figure.clone()
            } else {
                format!("{} ({})", row.figure, row.unit)
            };
            let comparison = match (row.comparison_kind, row.comparison) {
                ("ratio", Some(c)) => format!("{c:.2} x"),
                ("added", Some(c)) => format!("{c:+.0} {}", row.unit),
                _ => "-".into(),
            };
            vec![
                figure,
                cell(&row.direct_text, &row.direct),
                cell(&row.podlink_text, &row.podlink),
                comparison,
                row.target.clone(),
                match row.met {
                    Some(true) => "ok".into(),
                    Some(false) => "MISSED".into(),
                    None => "-".into(),
                },
                row.agent_cpu_seconds.as_ref().map_or("-".into(), fmt_stats),
            ]
        })
        .collect();
    print_grid(
        &[
            "figure",
            "direct",
            "podlink",
            "vs direct",
            "target",
            "met",
            "agent CPU s",
        ],
        &rows,
    );

    println!();
    println!("eBPF cost per packet by kind of podlink run (for profiling):");
    for line in r.ebpf_by_workload.lines() {
        println!("  {line}");
    }

    println!();
    println!(
        "new connections, 1 client: where a connection's time goes (µs; each run's p50, median of the runs)"
    );
    if let (Some(d), Some(p)) = (&r.one_client_phases.direct, &r.one_client_phases.podlink) {
        let row = |name: &str, x: &Phases| {
            vec![
                name.to_string(),
                num(x.connect_us),
                num(x.greeting_us),
                num(x.echo_close_us),
                num(x.total_us),
            ]
        };
        let added = |a: f64, b: f64| format!("{:+.0}", b - a);
        print_grid(
            &["path", "connect", "greeting", "echo and close", "total"],
            &[
                row("direct", d),
                row("podlink", p),
                vec![
                    "added".into(),
                    added(d.connect_us, p.connect_us),
                    added(d.greeting_us, p.greeting_us),
                    added(d.echo_close_us, p.echo_close_us),
                    added(d.total_us, p.total_us),
                ],
            ],
        );
    } else {
        println!("  (no connection completed on one of the paths)");
    }

    println!();
    println!(
        "scaling: concurrent pod pairs (node 1 -> node 2, each pair its own pods), one run each; iperf3 single stream per pair for {} s{}, summed; connections with 1 client thread per pair for {} s",
        s.scaling_throughput_seconds,
        if s.scaling_throughput_seconds < s.throughput_seconds {
            " (shorter than the main table's runs)"
        } else {
            ""
        },
        s.connect_seconds
    );
    let run = |n: usize, path: Path2| {
        r.scaling
            .runs
            .iter()
            .find(|x| x.pairs == n && x.path == path)
    };
    let rows: Vec<Vec<String>> = s
        .scaling_pairs
        .iter()
        .filter_map(|&n| {
            let (d, p) = (run(n, Path2::Direct)?, run(n, Path2::Podlink)?);
            let fails = |f: usize| {
                if f > 0 {
                    format!(" ({f} failed)")
                } else {
                    String::new()
                }
            };
            Some(vec![
                n.to_string(),
                format!("{}{}", num(d.throughput_gbps), fails(d.throughput_failures)),
                format!("{}{}", num(p.throughput_gbps), fails(p.throughput_failures)),
                format!("{:.2} x", p.throughput_gbps / d.throughput_gbps),
                format!(
                    "{:.1}-{:.1}/{:.1}-{:.1}",
                    d.throughput_first_exit_seconds,
                    d.throughput_last_exit_seconds,
                    p.throughput_first_exit_seconds,
                    p.throughput_last_exit_seconds
                ),
                num(d.connections_per_second),
                num(p.connections_per_second),
                format!(
                    "{:.2} x",
                    p.connections_per_second / d.connections_per_second
                ),
                format!(
                    "{:.1}/{:.1}",
                    p.throughput_agent_cpu_seconds, p.connections_agent_cpu_seconds
                ),
            ])
        })
        .collect();
    print_grid(
        &[
            "pairs",
            "direct Gbit/s",
            "podlink Gbit/s",
            "ratio",
            "iperf3 exits s (d/p)",
            "direct conn/s",
            "podlink conn/s",
            "ratio",
            "agent CPU s (tput/conn)",
        ],
        &rows,
    );
    println!(
        "(pairs set up in {:.1} s; \"iperf3 exits\": from the runs' common start, each client waiting for it in its pod, to the first and the last exit, direct/podlink)",
        r.scaling.pairs_setup_seconds
    );

    println!();
    let e = &r.enrollment;
    println!(
        "enrollment: {} pods made on node 1 by the ptp + host-local CNI plugins in {:.1} s ({:.0} ms per pod, not timed below), then listed one at a time; time from the manifest's write (by rename) to both link pins",
        e.pods_created,
        e.creation_seconds,
        e.creation_seconds * 1e3 / e.pods_created.max(1) as f64
    );
    let rows: Vec<Vec<String>> = s
        .scaling_pods
        .iter()
        .map(|&n| match e.summary(n) {
            Some(x) => vec![
                n.to_string(),
                num(x.p50_ms),
                num(x.p99_ms),
                num(x.max_ms),
                format!("{:.1}", x.total_seconds),
            ],
            None => vec![n.to_string(), "not reached".into()],
        })
        .collect();
    print_grid(
        &[
            "pods",
            "p50 ms",
            "p99 ms",
            "max ms",
            "total s (first write to last links)",
        ],
        &rows,
    );
    println!(
        "(agents' CPU over the enrollment of {} pods: {:.2} s{}{})",
        e.per_pod_ms.len(),
        e.agent_cpu_seconds,
        match e.timed_out_at {
            Some(i) =>
                format!("; pod {i} was not enrolled within {ENROLL_TIMEOUT:?} and the run stopped"),
            None => String::new(),
        },
        if e.missing_map_entries > 0 {
            format!(
                "; {} pods had links but no pods map entry",
                e.missing_map_entries
            )
        } else {
            String::new()
        }
    );

    println!();
    let t = &r.timings;
    println!(
        "bench time: {:.0} s (bed {:.0} s, main table {:.0} s, scaling {:.0} s, enrollment {:.0} s, cleanup {:.0} s; the build before it not counted)",
        t.total_seconds,
        t.bed_seconds,
        t.main_table_seconds,
        t.scaling_seconds,
        t.enrollment_seconds,
        t.cleanup_seconds
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_idle_names_driver_governor_and_polling() {
        let haltpoll = |p: &str| {
            Some(
                match p.rsplit('/').next()? {
                    "current_driver" => "haltpoll",
                    "current_governor" => "haltpoll",
                    "guest_halt_poll_ns" => "0",
                    _ => return None,
                }
                .to_string(),
            )
        };
        assert_eq!(
            cpu_idle_from(haltpoll),
            "cpuidle haltpoll/haltpoll, guest_halt_poll_ns=0"
        );
        // An older kernel names the governor only in the read-only file, and
        // without the haltpoll module there is no polling window.
        let acpi = |p: &str| {
            Some(
                match p.rsplit('/').next()? {
                    "current_driver" => "acpi_idle",
                    "current_governor_ro" => "menu",
                    _ => return None,
                }
                .to_string(),
            )
        };
        assert_eq!(cpu_idle_from(acpi), "cpuidle acpi_idle/menu");
        assert_eq!(cpu_idle_from(|_| None), "");
    }

    #[test]
    fn sleeping_shell_read_from_proc_stat() {
        assert!(is_sleeping_shell("4242 (sh) S 4200 4242 1 0 -1"));
        // Still `ip`, or the shell already running iperf3.
        assert!(!is_sleeping_shell("4242 (ip) S 4200 4242 1 0 -1"));
        assert!(!is_sleeping_shell("4242 (iperf3) S 4200 4242 1 0 -1"));
        assert!(!is_sleeping_shell("4242 (sh) R 4200 4242 1 0 -1"));
        // A name with ") S " in it is not taken for a sleeping shell.
        assert!(!is_sleeping_shell("4242 (sh) S (x) R 4200 4242 1 0 -1"));
        assert!(!is_sleeping_shell(""));
    }

    #[test]
    fn paths_alternate_which_goes_first() {
        assert_eq!(Path2::order(0), [Path2::Direct, Path2::Podlink]);
        assert_eq!(Path2::order(1), [Path2::Podlink, Path2::Direct]);
        assert_eq!(Path2::order(2), Path2::order(0));
    }
}
