//! `cargo xtask bench --probe ROW`: one figure of the bench, measured on its own
//! bed, for finding out what moves it.
//!
//! A probe builds the same two-node bed as the full bench, then runs one kind of
//! measurement `--repeat` times (default 3), the direct path and podlink one
//! after the other in alternating order (podlink alone with `--podlink-only`),
//! and prints each run's figure with the agents' CPU seconds over it and, with
//! `--ebpf` (which sets `kernel.bpf_stats_enabled` as the full bench does), each
//! program's `run_time_ns / run_cnt` over each podlink run. Last come each
//! path's median [min-max] and their ratio.
//!
//! `--hook CMD` runs `sh -c CMD` once the bed is up, before the first run, with
//! the agents' process ids in `$AGENTS` (comma-separated), for `perf record -p
//! $AGENTS -- sleep 5` and the like; the probe waits for it to exit before it
//! removes the bed.

use std::process::{Command, ExitStatus};

use super::*;

/// The measurements a probe can make: each is one of the full bench's, with
/// the run length of `--seconds` where it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Row {
    /// iperf3, one stream (Gbit/s).
    SingleStream,
    /// iperf3 -P 4 (Gbit/s).
    FourStreams,
    /// 10,000 round trips of 1 byte on one connection (p50 µs).
    RoundTrips,
    /// New connections per second, one client.
    OneClient,
    /// New connections per second, 16 clients.
    SixteenClients,
    /// `--count` pod pairs (default 100) at once: single-stream iperf3 summed
    /// (Gbit/s), then one connecting client per pair (connections/s).
    Scaling,
    /// `--count` pods (default 200) enrolled one at a time (p50, p99, max ms);
    /// made once, so `--repeat` must be 1.
    Enrollment,
}

/// What `--probe` and its flags asked for.
#[derive(Debug)]
pub struct Options {
    pub row: Row,
    pub repeat: usize,
    /// Length of each run (s) of the rows that have one.
    pub seconds: u32,
    pub podlink_only: bool,
    pub ebpf: bool,
    /// Pod pairs (`scaling`) or pods (`enrollment`).
    pub count: Option<usize>,
    pub hook: Option<String>,
}

/// Builds the bed, runs the probe, and leaves the removal of the bed to the
/// caller's cleanup.
pub fn probe(o: &Options) -> Result<()> {
    if o.seconds == 0 {
        bail!("--seconds must be at least 1");
    }
    if o.row == Row::Enrollment && o.repeat != 1 {
        bail!("the enrollment probe makes its pods once: give --repeat 1");
    }
    if o.count.is_some() && !matches!(o.row, Row::Scaling | Row::Enrollment) {
        bail!("--count is for the scaling and enrollment probes only");
    }
    eprintln!("bench: building the two-node test bed");
    let mut bed = build_bed()?;
    std::thread::sleep(Duration::from_secs(2));
    let stats = o.ebpf.then(BpfStatsOn::enable).transpose()?;
    let mut hook = o.hook.as_deref().map(|h| start_hook(&bed, h)).transpose()?;
    let result = run_rows(&mut bed, o);
    if let Some(child) = hook.as_mut() {
        eprintln!("bench: waiting for the hook to exit");
        let status: std::io::Result<ExitStatus> = child.wait();
        netns::unregister(&netns::Resource::Process(child.id()));
        if let Ok(status) = status
            && !status.success()
        {
            eprintln!("bench: the hook exited with {status}");
        }
    }
    drop(stats);
    result
}

fn start_hook(bed: &Bed, hook: &str) -> Result<Child> {
    let agents: Vec<String> = agent_pids(&bed.cluster)
        .iter()
        .map(u32::to_string)
        .collect();
    eprintln!("bench: agents {}; starting the hook", agents.join(","));
    let child = Command::new("sh")
        .args(["-c", hook])
        .env("AGENTS", agents.join(","))
        .spawn()
        .context("starting the hook")?;
    netns::register(netns::Resource::Process(child.id()));
    Ok(child)
}

fn run_rows(bed: &mut Bed, o: &Options) -> Result<()> {
    let name = format!("{:?}", o.row);
    match o.row {
        Row::Enrollment => {
            let n = o.count.unwrap_or(ENROLLMENT_PODS);
            let e = enrollment(&mut bed.cluster, n)?;
            let s = e.summary(n).with_context(|| {
                format!("only {} of {n} pods were enrolled", e.per_pod_ms.len())
            })?;
            println!(
                "probe Enrollment of {n} pods: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; agents' CPU {:.2} s; {} pods without a pods map entry",
                s.p50_ms, s.p99_ms, s.max_ms, e.agent_cpu_seconds, e.missing_map_entries
            );
            return Ok(());
        }
        Row::Scaling => return scaling_probe(bed, o),
        _ => {}
    }
    let prog_pods = [&bed.pair(Path2::Podlink).0, &bed.pair(Path2::Podlink).1];
    let mut values: [Vec<f64>; 2] = Default::default();
    for rep in 0..o.repeat {
        for path in order(rep, o.podlink_only) {
            let (client, server) = bed.pair(path);
            // The direct path runs no podlink program.
            let before = (o.ebpf && path == Path2::Podlink)
                .then(|| program_counters(&bed.cluster, prog_pods))
                .transpose()?;
            let cpu = agents_cpu(&bed.cluster);
            let secs = o.seconds;
            let echo = server.addr(ECHO_PORT);
            let v = match o.row {
                Row::SingleStream => throughput(client, server, secs, 1)?,
                Row::FourStreams => throughput(client, server, secs, 4)?,
                Row::RoundTrips => latency(client, echo, 1, ROUND_TRIPS)?[0],
                Row::OneClient => run_clients(&[(client, echo)], 1, secs as f64, true)?.rate(),
                Row::SixteenClients => {
                    run_clients(&[(client, echo)], MANY_CLIENTS, secs as f64, false)?.rate()
                }
                Row::Scaling | Row::Enrollment => unreachable!("handled above"),
            };
            let cpu = agents_cpu(&bed.cluster) - cpu;
            let ebpf = match before {
                Some(before) => {
                    let after = program_counters(&bed.cluster, prog_pods)?;
                    per_program(&counters_delta(&before, &after))
                }
                None => String::new(),
            };
            println!(
                "probe {name} {}/{} {path:?}: {} agents' CPU {cpu:.2} s{ebpf}",
                rep + 1,
                o.repeat,
                num(v)
            );
            values[path as usize].push(v);
        }
    }
    summarize(&name, &values);
    Ok(())
}

/// The paths of repetition `rep` ([`Path2::order`], or podlink alone).
fn order(rep: usize, podlink_only: bool) -> Vec<Path2> {
    if podlink_only {
        vec![Path2::Podlink]
    } else {
        Path2::order(rep).to_vec()
    }
}

/// " from_pod N ns (runs) to_pod N ns (runs)", both nodes' instances summed.
fn per_program(delta: &[ProgCounters]) -> String {
    PROGRAMS
        .iter()
        .map(|name| {
            let (t, n) = delta
                .iter()
                .filter(|c| c.name == *name)
                .fold((0, 0), |(t, n), c| (t + c.run_time_ns, n + c.run_cnt));
            let ns = if n > 0 { t as f64 / n as f64 } else { 0.0 };
            format!(" {name} {} ns ({n} runs)", num(ns))
        })
        .collect()
}

fn summarize(name: &str, values: &[Vec<f64>; 2]) {
    let medians = [Path2::Direct, Path2::Podlink].map(|path| {
        let v = &values[path as usize];
        (!v.is_empty()).then(|| {
            let s = stats(v);
            println!("probe {name} {path:?}: {}", fmt_stats(&s));
            s.median
        })
    });
    if let [Some(direct), Some(podlink)] = medians
        && direct > 0.0
    {
        println!(
            "probe {name}: podlink / direct {:.2} (medians)",
            podlink / direct
        );
    }
}

fn scaling_probe(bed: &mut Bed, o: &Options) -> Result<()> {
    let n = o.count.unwrap_or(100);
    let (pairs, setup) = scaling_pairs(bed, n)?;
    eprintln!("bench: {n} pairs per path made in {setup:.1} s");
    let mut gbps: [Vec<f64>; 2] = Default::default();
    let mut rates: [Vec<f64>; 2] = Default::default();
    for rep in 0..o.repeat {
        for path in order(rep, o.podlink_only) {
            let run = scaling_run(
                bed,
                &pairs[path as usize],
                path,
                o.seconds,
                o.seconds as f64,
            )?;
            println!(
                "probe Scaling {n} pairs {}/{} {path:?}: {} Gbit/s (iperf3 exits {:.2} to {:.2} s, {} failed, agents' CPU {:.2} s), {} connections/s ({} failed, agents' CPU {:.2} s)",
                rep + 1,
                o.repeat,
                num(run.throughput_gbps),
                run.throughput_first_exit_seconds,
                run.throughput_batch_seconds,
                run.throughput_failures,
                run.throughput_agent_cpu_seconds,
                num(run.connections_per_second),
                run.connection_failures,
                run.connections_agent_cpu_seconds
            );
            gbps[path as usize].push(run.throughput_gbps);
            rates[path as usize].push(run.connections_per_second);
        }
    }
    summarize(&format!("Scaling {n} pairs, Gbit/s"), &gbps);
    summarize(&format!("Scaling {n} pairs, connections/s"), &rates);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(row: Row) -> Options {
        Options {
            row,
            repeat: 1,
            seconds: 5,
            podlink_only: false,
            ebpf: false,
            count: None,
            hook: None,
        }
    }

    /// Refused before any bed is built (these run without root).
    #[test]
    fn flags_that_do_not_apply_are_refused() {
        let err = |o: Options| probe(&o).unwrap_err().to_string();
        assert!(
            err(Options {
                count: Some(3),
                ..options(Row::SingleStream)
            })
            .contains("--count is for the scaling and enrollment probes")
        );
        assert!(
            err(Options {
                repeat: 2,
                ..options(Row::Enrollment)
            })
            .contains("give --repeat 1")
        );
        assert!(
            err(Options {
                seconds: 0,
                ..options(Row::OneClient)
            })
            .contains("--seconds must be at least 1")
        );
    }

    #[test]
    fn podlink_only_runs_podlink_alone() {
        for rep in 0..3 {
            assert_eq!(order(rep, true), [Path2::Podlink]);
            assert_eq!(order(rep, false), Path2::order(rep));
        }
    }
}
