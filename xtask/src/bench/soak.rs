//! `cargo xtask bench --soak [--minutes N]`: load without growth.
//!
//! On a two-node bed of its own (enrolled namespace `mesh`): 10,000 idle
//! connections held through the mesh across the nodes (from four client pods on
//! node 1, 2,500 each, to one server pod on node 2), and meanwhile 1,000 new
//! connections per second (from two more client pods to the same server), each
//! a small exchange: connect, read the greeting, send 100 bytes, half-close,
//! read the echo to its end, close. The server speaks the test bed's echo
//! protocol without its read timeout, one thread per connection, in a process
//! of its own (the soak's sockets exceed one process's open-file limit).
//!
//! Every minute, and at the start and the end, it samples each agent's VmRSS
//! and open descriptors, each node's sockets in TIME_WAIT, the connections
//! completed and failed in that minute, and checks 100 of the idle connections
//! with an echo round (all of them at the end). The first minute is warm-up:
//! the run passes when no connection failed and no later sample of an agent's
//! VmRSS exceeds its end-of-warm-up sample by more than [`RSS_GROWTH`] plus
//! [`RSS_SLACK_KIB`], nor its descriptors by more than [`FD_SLACK`].

use std::{
    fmt::Write as _,
    fs,
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::{Child, Command},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{Cluster, Pod, PodSpec, netns};

use super::{agents::agent_pids, bed::tune_client, memory::rss_kib};

/// Idle connections held through the mesh.
pub(super) const IDLE_CONNECTIONS: usize = 10_000;
/// New connections per second, each a small exchange.
pub(super) const NEW_PER_SECOND: u64 = 1_000;
/// The agents' `--max-connections`: room for the idle connections and the
/// new ones (the machine's open-file limit, 20,000 here, bounds it).
const MAX_CONNECTIONS: usize = 15_000;
/// Default length of the run, minutes.
pub(super) const DEFAULT_MINUTES: u64 = 10;
/// Allowed growth of an agent's VmRSS after warm-up: a fraction of it…
const RSS_GROWTH: f64 = 0.10;
/// … plus this (KiB).
const RSS_SLACK_KIB: u64 = 16 * 1024;
/// Allowed growth of an agent's open descriptors after warm-up.
const FD_SLACK: u64 = 256;
/// Idle connections checked with an echo round at each sample.
const IDLE_CHECKED: usize = 100;
/// Client pods holding the idle connections: each may hold a quarter of
/// [`MAX_CONNECTIONS`] (the proxy's per-pod share).
const IDLE_PODS: usize = 4;
/// Client pods opening the new connections.
const CHURN_PODS: usize = 2;
/// Threads opening the new connections, per churn client pod.
const CHURN_THREADS: usize = 8;
/// The server's port.
const PORT: u16 = 7780;
/// Bytes each new connection sends and reads back.
const EXCHANGE_BYTES: usize = 100;

/// One sample of the soak.
#[derive(Clone, Debug, serde::Serialize)]
pub(super) struct Sample {
    /// Seconds since the load started.
    pub(super) at_s: u64,
    /// Each agent's VmRSS, KiB (node 1, node 2).
    pub(super) rss_kib: Vec<u64>,
    /// Each agent's open descriptors.
    pub(super) fds: Vec<u64>,
    /// Sockets in TIME_WAIT in each node's network namespace.
    pub(super) time_wait: Vec<u64>,
    /// New connections completed since the last sample.
    pub(super) completed: u64,
    /// New connections failed since the last sample.
    pub(super) failed: u64,
    /// Idle connections that failed their echo round (checked ones).
    pub(super) idle_failed: u64,
}

/// Runs the soak for `minutes` and prints its samples; with `markdown`, writes
/// them as the `## Soak` section of that page (the rest kept).
///
/// # Errors
/// The bed could not be made, or the run did not pass (after printing it).
pub(super) fn soak(minutes: u64, markdown: Option<&Path>) -> Result<()> {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)])?;
    let idle: Vec<Pod> = (0..IDLE_PODS)
        .map(|i| c.add_pod(PodSpec::new(&format!("idle{i}"), "mesh", 0)))
        .collect::<Result<_>>()?;
    let churn: Vec<Pod> = (0..CHURN_PODS)
        .map(|i| c.add_pod(PodSpec::new(&format!("churn{i}"), "mesh", 0)))
        .collect::<Result<_>>()?;
    let server = c.add_pod(PodSpec::new("server", "mesh", 1))?;
    // Each agent holds a socket per idle connection (the client's proxy the
    // accepted one, the server's its upstream one): more than the default
    // slots, a third of the open-file limit.
    for node in 0..2 {
        c.start_agent_with(node, &["--max-connections", &MAX_CONNECTIONS.to_string()])?;
    }
    let all: Vec<&Pod> = idle.iter().chain(&churn).chain([&server]).collect();
    c.wait_all_captured(&all)?;
    for pod in idle.iter().chain(&churn) {
        tune_client(pod)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut echo_server = start_server(&server.netns, server.addr(PORT))?;
    let target = server.addr(PORT);

    println!(
        "soak: opening {IDLE_CONNECTIONS} idle connections through the mesh ({} client pods)",
        idle.len()
    );
    let mut held = Vec::with_capacity(IDLE_CONNECTIONS);
    for pod in &idle {
        held.extend(open_idle(pod, target, IDLE_CONNECTIONS / idle.len())?);
    }
    let captured: u64 = idle
        .iter()
        .map(|p| c.counters(p).map(|k| k["captured_outbound"]))
        .sum::<Result<u64>>()?;
    if (captured as usize) < held.len() {
        bail!(
            "only {captured} of the {} idle connections were captured",
            held.len()
        );
    }

    println!("soak: {NEW_PER_SECOND} new connections/s for {minutes} min; a sample each minute");
    let completed = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let churners = start_churn(&churn, target, &completed, &failed, &stop)?;
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut last = (0, 0);
    let mut take = |held: &mut [TcpStream], all_idle: bool| -> Sample {
        let (done, fail) = (
            completed.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed),
        );
        let checked = if all_idle {
            held.len()
        } else {
            IDLE_CHECKED.min(held.len())
        };
        let sample = Sample {
            at_s: start.elapsed().as_secs(),
            rss_kib: agent_pids(&c).into_iter().map(rss_kib).collect(),
            fds: agent_pids(&c).into_iter().map(open_fds).collect(),
            time_wait: (0..c.nodes.len())
                .map(|n| time_wait(&c.nodes[n].netns))
                .collect(),
            completed: done - last.0,
            failed: fail - last.1,
            idle_failed: check_idle(&mut held[..checked]),
        };
        last = (done, fail);
        print_sample(&sample);
        sample
    };
    samples.push(take(&mut held, false));
    for _ in 0..minutes {
        std::thread::sleep(Duration::from_secs(60));
        samples.push(take(&mut held, false));
    }
    stop.store(true, Ordering::Relaxed);
    for t in churners {
        let _ = t.join();
    }
    let last_sample = take(&mut held, true);
    samples.push(last_sample);
    let verdict = judge(&samples);
    println!(
        "soak: {}",
        verdict
            .as_ref()
            .err()
            .map_or("passed".to_string(), |e| e.clone())
    );
    if let Some(path) = markdown {
        write_markdown(path, minutes, &samples, &verdict)?;
    }
    drop(held);
    let _ = echo_server.kill();
    let _ = echo_server.wait();
    netns::unregister(&netns::Resource::Process(echo_server.id()));
    verdict.map_err(anyhow::Error::msg)
}

/// Serves the echo protocol without a read timeout in `netns_name` on `addr`
/// until killed: a greeting `peer=<addr>\n`, then every byte echoed until the
/// client half-closes. One thread per connection (64 KiB stacks).
///
/// # Errors
/// The address cannot be bound.
pub(super) fn serve(netns_name: &str, addr: SocketAddr) -> Result<()> {
    let listener = netns::in_netns(netns_name, move || TcpListener::bind(addr))
        .with_context(|| format!("binding {addr} in {netns_name}"))?;
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                let _ = std::thread::Builder::new()
                    .stack_size(64 * 1024)
                    .spawn(move || {
                        let _ = echo(stream, peer);
                    });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Starts [`serve`] as a process of its own (this program's hidden
/// `soak-server` command), registered for clean-up; waits until it accepts.
fn start_server(netns_name: &str, addr: SocketAddr) -> Result<Child> {
    let child = Command::new(std::env::current_exe()?)
        .args(["soak-server", netns_name, &addr.to_string()])
        .spawn()
        .context("starting the soak's echo server")?;
    netns::register(netns::Resource::Process(child.id()));
    let deadline = Instant::now() + Duration::from_secs(10);
    let probe = netns_name.to_string();
    while netns::in_netns(&probe, move || TcpStream::connect(addr)).is_err() {
        if Instant::now() > deadline {
            bail!("the soak's echo server did not listen on {addr} within 10 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

fn echo(mut stream: TcpStream, peer: SocketAddr) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.write_all(format!("peer={peer}\n").as_bytes())?;
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
    }
    stream.shutdown(Shutdown::Write)
}

/// Opens `count` connections from `pod` to `target`, each read to its
/// greeting.
fn open_idle(pod: &Pod, target: SocketAddr, count: usize) -> Result<Vec<TcpStream>> {
    let name = pod.name.clone();
    netns::in_netns(&pod.netns, move || {
        let mut held = Vec::with_capacity(count);
        for i in 0..count {
            let s = TcpStream::connect_timeout(&target, Duration::from_secs(10))
                .map_err(|e| std::io::Error::other(format!("{name}: connection {i}: {e}")))?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            read_greeting(&s)
                .map_err(|e| std::io::Error::other(format!("{name}: connection {i}: {e}")))?;
            held.push(s);
        }
        Ok(held)
    })
    .context("opening the idle connections")
}

fn read_greeting(mut s: &TcpStream) -> std::io::Result<()> {
    let mut byte = [0u8; 1];
    loop {
        if s.read(&mut byte)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            return Ok(());
        }
    }
}

/// One echo round on each of `held`; the number that failed.
fn check_idle(held: &mut [TcpStream]) -> u64 {
    let mut failed = 0;
    for s in held {
        let mut back = [0u8; 4];
        let ok =
            s.write_all(b"ping").is_ok() && s.read_exact(&mut back).is_ok() && back == *b"ping";
        failed += u64::from(!ok);
    }
    failed
}

/// Starts the threads opening new connections, paced to [`NEW_PER_SECOND`]
/// in all, until `stop`.
fn start_churn(
    pods: &[Pod],
    target: SocketAddr,
    completed: &Arc<AtomicU64>,
    failed: &Arc<AtomicU64>,
    stop: &Arc<AtomicBool>,
) -> Result<Vec<std::thread::JoinHandle<()>>> {
    let threads = (pods.len() * CHURN_THREADS) as u64;
    let interval = Duration::from_secs_f64(threads as f64 / NEW_PER_SECOND as f64);
    let mut handles = Vec::new();
    for pod in pods {
        for _ in 0..CHURN_THREADS {
            let (completed, failed, stop) = (completed.clone(), failed.clone(), stop.clone());
            handles.push(netns::spawn_in_netns(&pod.netns, move || {
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                    next += interval;
                    let counter = if exchange(target).is_ok() {
                        &completed
                    } else {
                        &failed
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })?);
        }
    }
    Ok(handles)
}

/// One small exchange on a new connection.
fn exchange(target: SocketAddr) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    read_greeting(&s)?;
    s.write_all(&[b'x'; EXCHANGE_BYTES])?;
    s.shutdown(Shutdown::Write)?;
    let mut back = Vec::with_capacity(EXCHANGE_BYTES);
    s.read_to_end(&mut back)?;
    if back.len() != EXCHANGE_BYTES {
        return Err(std::io::Error::other("short echo"));
    }
    Ok(())
}

/// Open descriptors of a process (0 once it is gone).
fn open_fds(pid: u32) -> u64 {
    fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// Sockets in TIME_WAIT in a network namespace (`ss -Htan state time-wait`).
fn time_wait(netns_name: &str) -> u64 {
    netns::run(netns::command_in(netns_name, "ss").args(["-Htan", "state", "time-wait"]))
        .map_or(0, |out| {
            out.stdout.iter().filter(|b| **b == b'\n').count() as u64
        })
}

fn print_sample(s: &Sample) {
    println!(
        "  {:>5} s  rss {} KiB  fds {}  time_wait {}  new {} ok / {} failed  idle failed {}",
        s.at_s,
        join(&s.rss_kib),
        join(&s.fds),
        join(&s.time_wait),
        s.completed,
        s.failed,
        s.idle_failed
    );
}

fn join(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(" / ")
}

/// Passes with no failure and no growth beyond the bounds after the warm-up
/// (the second sample, a minute into the load); else says what went wrong.
pub(super) fn judge(samples: &[Sample]) -> Result<(), String> {
    let mut problems = Vec::new();
    let failed: u64 = samples.iter().map(|s| s.failed + s.idle_failed).sum();
    if failed > 0 {
        problems.push(format!("{failed} connections failed"));
    }
    if let Some((warm, later)) = samples.get(1).zip(samples.get(2..)) {
        for (agent, &base) in warm.rss_kib.iter().enumerate() {
            let bound = (base as f64 * (1.0 + RSS_GROWTH)) as u64 + RSS_SLACK_KIB;
            if let Some(s) = later.iter().find(|s| s.rss_kib[agent] > bound) {
                problems.push(format!(
                    "node {} agent's VmRSS grew from {base} KiB after warm-up to {} KiB at {} s (bound {bound})",
                    agent + 1,
                    s.rss_kib[agent],
                    s.at_s
                ));
            }
        }
        for (agent, &base) in warm.fds.iter().enumerate() {
            if let Some(s) = later.iter().find(|s| s.fds[agent] > base + FD_SLACK) {
                problems.push(format!(
                    "node {} agent's descriptors grew from {base} after warm-up to {} at {} s",
                    agent + 1,
                    s.fds[agent],
                    s.at_s
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("failed: {}", problems.join("; ")))
    }
}

/// Writes the run as the `## Soak` section of the page at `path` (replacing
/// that section, keeping the rest; the page is made if missing).
fn write_markdown(
    path: &Path,
    minutes: u64,
    samples: &[Sample],
    verdict: &Result<(), String>,
) -> Result<()> {
    let page = fs::read_to_string(path).unwrap_or_default();
    let section = section(minutes, samples, verdict);
    fs::write(path, replace_section(&page, &section))
        .with_context(|| format!("writing {}", path.display()))
}

/// The heading of the soak's section of `docs/benchmarks.md`.
pub(super) const HEADING: &str = "## Soak";

fn section(minutes: u64, samples: &[Sample], verdict: &Result<(), String>) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "{HEADING}\n");
    let _ = writeln!(
        md,
        "Written by `cargo xtask bench --soak --minutes {minutes} --markdown FILE`: {} idle connections held through the mesh across the nodes, and {} new connections per second (a {EXCHANGE_BYTES}-byte exchange each), for {minutes} min. The first minute is warm-up; the run passes with no failed connection and no later sample above an agent's VmRSS after warm-up by more than {:.0} % + {} MiB, nor its descriptors by more than {FD_SLACK}. Result: **{}**.\n",
        thousands(IDLE_CONNECTIONS as u64),
        thousands(NEW_PER_SECOND),
        RSS_GROWTH * 100.0,
        RSS_SLACK_KIB / 1024,
        match verdict {
            Ok(()) => "passed".to_string(),
            Err(e) => e.clone(),
        }
    );
    let _ = writeln!(
        md,
        "| at (s) | VmRSS node 1 / node 2 (MiB) | descriptors | TIME_WAIT node 1 / node 2 | new connections ok | failed | idle connections failed ({IDLE_CHECKED} checked, all at the end) |"
    );
    md.push_str("| --- | --- | --- | --- | --- | --- | --- |\n");
    for s in samples {
        let mib: Vec<String> = s
            .rss_kib
            .iter()
            .map(|k| format!("{:.1}", *k as f64 / 1024.0))
            .collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            s.at_s,
            mib.join(" / "),
            join(&s.fds),
            join(&s.time_wait),
            s.completed,
            s.failed,
            s.idle_failed
        );
    }
    md
}

/// `n` with a comma between thousands: `10,000`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}

/// `page` with its `## Soak` section (to the next `## ` heading or the end)
/// replaced by `section`, or `section` appended.
pub(super) fn replace_section(page: &str, section: &str) -> String {
    let Some(start) = page.find(&format!("\n{HEADING}\n")).map(|i| i + 1) else {
        let sep = if page.is_empty() || page.ends_with("\n\n") {
            ""
        } else if page.ends_with('\n') {
            "\n"
        } else {
            "\n\n"
        };
        return format!("{page}{sep}{section}");
    };
    let end = page[start + HEADING.len()..]
        .find("\n## ")
        .map_or(page.len(), |i| start + HEADING.len() + i + 1);
    let rest = &page[end..];
    let sep = if rest.is_empty() { "" } else { "\n" };
    format!("{}{section}{sep}{rest}", &page[..start])
}

/// The `## Soak` section of `page`, if it has one (kept by the full bench
/// when it writes the page again).
pub(super) fn existing_section(page: &str) -> Option<&str> {
    let start = page.find(&format!("\n{HEADING}\n"))? + 1;
    let end = page[start + HEADING.len()..]
        .find("\n## ")
        .map_or(page.len(), |i| start + HEADING.len() + i + 1);
    Some(&page[start..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_s: u64, rss: u64, fds: u64, failed: u64) -> Sample {
        Sample {
            at_s,
            rss_kib: vec![rss, rss],
            fds: vec![fds, fds],
            time_wait: vec![0, 100],
            completed: 60_000,
            failed,
            idle_failed: 0,
        }
    }

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(10_000), "10,000");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn growth_after_warm_up_and_failures_fail_the_run() {
        let steady = [
            sample(0, 20_000, 100, 0),
            sample(60, 50_000, 10_100, 0),
            sample(120, 54_000, 10_200, 0),
        ];
        assert_eq!(judge(&steady), Ok(()));
        let mut grown = steady.clone();
        grown[2].rss_kib[1] = 50_000 * 11 / 10 + RSS_SLACK_KIB + 1;
        let why = judge(&grown).unwrap_err();
        assert!(why.contains("node 2 agent's VmRSS"), "{why}");
        let mut leaking = steady.clone();
        leaking[2].fds[0] = 10_100 + FD_SLACK + 1;
        assert!(judge(&leaking).unwrap_err().contains("descriptors"));
        let mut failing = steady.clone();
        failing[1].failed = 2;
        failing[2].idle_failed = 1;
        assert!(
            judge(&failing)
                .unwrap_err()
                .contains("3 connections failed")
        );
    }

    #[test]
    fn the_soak_section_replaces_its_predecessor_and_keeps_the_rest() {
        let page = "# podlink benchmarks\n\n| a |\n\n## Tried\n\n* x\n";
        let first = replace_section(page, "## Soak\n\nrun 1\n");
        assert!(first.starts_with(page), "{first}");
        assert_eq!(existing_section(&first), Some("## Soak\n\nrun 1\n"));
        let second = replace_section(&first, "## Soak\n\nrun 2\n");
        assert!(
            !second.contains("run 1") && second.contains("run 2"),
            "{second}"
        );
        assert!(second.starts_with(page));
        // In the middle of a page, the sections after it stay.
        let middle = "# p\n\n## Soak\n\nold\n\n## Tried\n\n* x\n";
        let replaced = replace_section(middle, "## Soak\n\nnew\n");
        assert_eq!(replaced, "# p\n\n## Soak\n\nnew\n\n## Tried\n\n* x\n");
        assert_eq!(existing_section("# p\n"), None);
    }
}
