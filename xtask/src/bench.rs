//! `cargo xtask bench`: podlink against the direct path, measured in one run on
//! the two-node test bed.
//!
//! Two pod pairs, each client on node 1 and server on node 2: one pair in a
//! namespace outside the mesh (the direct path), one enrolled (podlink: captured at
//! both host veths, HBONE between the nodes). Each measurement is repeated and the
//! repetitions of the two paths are interleaved, so machine noise hits both alike;
//! the table shows medians with min and max.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{Cluster, Pod, PodSpec, app, netns};
use serde::Serialize;

/// Length of each throughput run (iperf3 `-t`).
const THROUGHPUT_SECONDS: u32 = 10;
/// Round trips per latency run.
const ROUND_TRIPS: usize = 10_000;
/// Length of each connection-rate run.
const CONNECT_SECONDS: f64 = 3.0;
const ECHO_PORT: u16 = 7777;
const IPERF_PORT: u16 = 5201;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path2 {
    Direct,
    Podlink,
}

#[derive(Serialize)]
struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(f64::total_cmp);
    Stats {
        median: v[v.len() / 2],
        min: v[0],
        max: v[v.len() - 1],
    }
}

#[derive(Serialize)]
struct Row {
    figure: String,
    unit: String,
    direct: Stats,
    podlink: Stats,
    /// podlink / direct for rates; podlink − direct for latencies.
    comparison: f64,
    comparison_kind: &'static str,
}

#[derive(Serialize)]
struct Report {
    cores: usize,
    kernel: String,
    repetitions: usize,
    rows: Vec<Row>,
    agent_rss_kib: Vec<u64>,
    agent_cpu_seconds: Vec<f64>,
}

struct Bed {
    cluster: Cluster,
    direct: (Pod, Pod),
    podlink: (Pod, Pod),
    _servers: Vec<app::EchoServer>,
    iperf: Vec<Child>,
}

impl Bed {
    fn pair(&self, path: Path2) -> &(Pod, Pod) {
        match path {
            Path2::Direct => &self.direct,
            Path2::Podlink => &self.podlink,
        }
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for child in &mut self.iperf {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn build_bed() -> Result<Bed> {
    let mut c = Cluster::new(2)?;
    c.add_namespace("direct", false)?;
    c.add_namespace("mesh", true)?;
    let direct = (
        c.add_pod(PodSpec::new("dclient", "direct", 0))?,
        c.add_pod(PodSpec::new("dserver", "direct", 1))?,
    );
    let podlink = (
        c.add_pod(PodSpec::new("mclient", "mesh", 0).service_account("client"))?,
        c.add_pod(PodSpec::new("mserver", "mesh", 1).service_account("server"))?,
    );
    c.start_agent_with(0, &[])?;
    c.start_agent_with(1, &[])?;
    c.wait_captured(&podlink.0, true)?;
    c.wait_captured(&podlink.1, true)?;
    // The clients open tens of thousands of short connections to one server port:
    // give both the same room so that neither measures its own port search.
    for client in [&direct.0, &podlink.0] {
        for setting in [
            "net.ipv4.ip_local_port_range=1024 65535",
            "net.ipv4.tcp_tw_reuse=1",
        ] {
            netns::run(netns::command_in(&client.netns, "sysctl").args(["-q", "-w", setting]))?;
        }
    }
    let mut servers = Vec::new();
    let mut iperf = Vec::new();
    for server in [&direct.1, &podlink.1] {
        servers.push(app::EchoServer::start(
            &server.netns,
            server.addr(ECHO_PORT),
        )?);
        let child = netns::command_in(&server.netns, "iperf3")
            .args(["-s", "-p", &IPERF_PORT.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3")?;
        netns::register(netns::Resource::Process(child.id()));
        iperf.push(child);
    }
    std::thread::sleep(Duration::from_millis(300));
    Ok(Bed {
        cluster: c,
        direct,
        podlink,
        _servers: servers,
        iperf,
    })
}

/// iperf3 single stream, bits per second.
fn throughput(client: &Pod, server: &Pod) -> Result<f64> {
    let out = netns::command_in(&client.netns, "iperf3")
        .args(["-c", &server.ip.to_string(), "-p", &IPERF_PORT.to_string()])
        .args(["-t", &THROUGHPUT_SECONDS.to_string(), "-J"])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("iperf3 output: {}", String::from_utf8_lossy(&out.stdout)))?;
    if let Some(e) = v.get("error") {
        bail!("iperf3: {e}");
    }
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 reported no throughput")
}

/// Round-trip times (µs) of `size`-byte messages on one connection: p50 and p99.
fn latency(client: &Pod, server: SocketAddr, size: usize) -> Result<(f64, f64)> {
    let mut stream = app::connect(&client.netns, server, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    app::read_greeting(&stream)?;
    let msg = vec![0x5a; size];
    let mut back = vec![0; size];
    // Warm up.
    for _ in 0..100 {
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
    }
    let mut rtts = Vec::with_capacity(ROUND_TRIPS);
    for _ in 0..ROUND_TRIPS {
        let t = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    rtts.sort_by(f64::total_cmp);
    Ok((rtts[rtts.len() / 2], rtts[rtts.len() * 99 / 100]))
}

/// New connections per second (connect, 1 KiB each way, close) with `clients`
/// concurrent clients.
fn connection_rate(client: &Pod, server: SocketAddr, clients: usize) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for _ in 0..clients {
        let (done, stop, failed) = (done.clone(), stop.clone(), failed.clone());
        let handle = netns::spawn_in_netns(&client.netns, move || {
            let payload = [0x42u8; 1024];
            while !stop.load(Ordering::Relaxed) {
                let one = || -> std::io::Result<()> {
                    let mut s =
                        std::net::TcpStream::connect_timeout(&server, Duration::from_secs(5))?;
                    s.set_read_timeout(Some(Duration::from_secs(5)))?;
                    app::read_greeting(&s)?;
                    s.write_all(&payload)?;
                    s.shutdown(Shutdown::Write)?;
                    let mut back = Vec::with_capacity(1024);
                    s.read_to_end(&mut back)?;
                    if back.len() != payload.len() {
                        return Err(std::io::Error::other("short echo"));
                    }
                    Ok(())
                };
                match one() {
                    Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })?;
        threads.push(handle);
    }
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(CONNECT_SECONDS));
    let count = done.load(Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let failures = failed.load(Ordering::Relaxed);
    if failures > 0 {
        eprintln!("bench: {failures} failed connections during the rate run");
    }
    Ok(count as f64 / elapsed)
}

/// Resident memory (KiB) and CPU seconds of a process.
fn process_usage(pid: u32) -> (u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum::<f64>() / ticks)
        .unwrap_or(0.0);
    (rss, cpu)
}

pub fn run(repeat: usize, json: Option<&Path>) -> Result<()> {
    if repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    ctrlc::set_handler(|| {
        netns::cleanup();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    let result = bench(repeat, json);
    netns::cleanup();
    result
}

fn bench(repeat: usize, json: Option<&Path>) -> Result<()> {
    eprintln!("bench: building the two-node test bed");
    let bed = build_bed()?;
    let paths = [Path2::Direct, Path2::Podlink];
    // figure -> path -> samples
    let mut samples: Vec<(String, String, bool, [Vec<f64>; 2])> = vec![
        (
            "single-stream throughput (iperf3, 10 s)".into(),
            "Gbit/s".into(),
            true,
            Default::default(),
        ),
        (
            "request/response 1 B, p50".into(),
            "µs".into(),
            false,
            Default::default(),
        ),
        (
            "request/response 1 B, p99".into(),
            "µs".into(),
            false,
            Default::default(),
        ),
        (
            "request/response 1 KiB, p50".into(),
            "µs".into(),
            false,
            Default::default(),
        ),
        (
            "request/response 1 KiB, p99".into(),
            "µs".into(),
            false,
            Default::default(),
        ),
        (
            "new connections/s, 1 client".into(),
            "conn/s".into(),
            true,
            Default::default(),
        ),
        (
            "new connections/s, 16 clients".into(),
            "conn/s".into(),
            true,
            Default::default(),
        ),
    ];
    for rep in 0..repeat {
        eprintln!("bench: repetition {}/{repeat}", rep + 1);
        for (i, path) in paths.iter().enumerate() {
            let (client, server) = bed.pair(*path);
            let echo = server.addr(ECHO_PORT);
            samples[0].3[i].push(throughput(client, server)? / 1e9);
            let (p50, p99) = latency(client, echo, 1)?;
            samples[1].3[i].push(p50);
            samples[2].3[i].push(p99);
            let (p50, p99) = latency(client, echo, 1024)?;
            samples[3].3[i].push(p50);
            samples[4].3[i].push(p99);
            samples[5].3[i].push(connection_rate(client, echo, 1)?);
            samples[6].3[i].push(connection_rate(client, echo, 16)?);
        }
    }
    let rows: Vec<Row> = samples
        .into_iter()
        .map(|(figure, unit, is_rate, [d, p])| {
            let direct = stats(d);
            let podlink = stats(p);
            let (comparison, kind) = if is_rate {
                (podlink.median / direct.median, "ratio")
            } else {
                (podlink.median - direct.median, "added")
            };
            Row {
                figure,
                unit,
                direct,
                podlink,
                comparison,
                comparison_kind: kind,
            }
        })
        .collect();
    let usage: Vec<(u64, f64)> = (0..bed.cluster.nodes.len())
        .filter_map(|n| bed.cluster.agent_pid(n))
        .map(process_usage)
        .collect();
    let kernel = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let report = Report {
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel,
        repetitions: repeat,
        rows,
        agent_rss_kib: usage.iter().map(|u| u.0).collect(),
        agent_cpu_seconds: usage.iter().map(|u| u.1).collect(),
    };
    print_table(&report);
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        eprintln!("bench: wrote {}", path.display());
    }
    drop(bed);
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "podlink bench: {} cores, kernel {}, {} interleaved repetitions; pod on node 1 -> pod on node 2",
        r.cores, r.kernel, r.repetitions
    );
    println!(
        "{:<50} {:>26} {:>26} {:>18}",
        "figure", "direct median [min-max]", "podlink median [min-max]", "podlink vs direct"
    );
    let fmt = |s: &Stats| {
        let p = if s.median >= 100.0 { 0 } else { 2 };
        format!("{:.p$} [{:.p$}-{:.p$}]", s.median, s.min, s.max)
    };
    for row in &r.rows {
        let cmp = match row.comparison_kind {
            "ratio" => format!("{:.2} x", row.comparison),
            _ => format!("+{:.0} {}", row.comparison, row.unit),
        };
        println!(
            "{:<50} {:>26} {:>26} {:>18}",
            format!("{} ({})", row.figure, row.unit),
            fmt(&row.direct),
            fmt(&row.podlink),
            cmp
        );
    }
    let rss: Vec<String> = r
        .agent_rss_kib
        .iter()
        .map(|k| format!("{:.1} MiB", *k as f64 / 1024.0))
        .collect();
    let cpu: Vec<String> = r
        .agent_cpu_seconds
        .iter()
        .map(|s| format!("{s:.1} s"))
        .collect();
    println!("agent resident memory after the runs: {}", rss.join(", "));
    println!("agent CPU time over the whole bench: {}", cpu.join(", "));
}
