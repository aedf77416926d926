//! `cargo xtask bench --probe ROW`: one figure of the bench, measured on its own
//! bed, for finding out what moves it.
//!
//! A probe builds the same two-node bed as the full bench, then runs one kind of
//! measurement `--repeat` times (default 3), the direct path and podlink one
//! after the other in alternating order (podlink alone with `--podlink-only`),
//! for the full bench's run length unless `--seconds` gives another, and prints
//! each run's figure with the agents' CPU seconds over it and, with `--ebpf`
//! (which sets `kernel.bpf_stats_enabled` as the full bench does), each
//! program's `run_time_ns / run_cnt` over each podlink run. Last come each
//! path's median [min-max] and their comparison (the ratio, or for round trips
//! the µs podlink adds).
//!
//! `api-watch` and `xds-watch` instead run their cluster-scale part once on
//! its own one-node bed and print its figures.
//!
//! `--hook CMD` runs `sh -c CMD` in a process group of its own once the bed is
//! up, before the first run (for `xds-watch`: once the agent settled, before
//! the changes), with the agents' process ids in `$AGENTS`
//! (comma-separated), for `perf record -g -p $AGENTS` or `strace -c -f -p
//! $AGENTS` (with `--podlink-only`, or it records the direct path's runs too).
//! After the runs, or on Ctrl-C, SIGTERM or SIGHUP, the group gets SIGINT, and
//! the probe waits up to 30 s for the hook to exit (then kills the group)
//! before it removes the bed.

use std::{
    os::unix::process::{CommandExt, ExitStatusExt},
    process::{Child, Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{
    CONNECT_SECONDS, ECHO_PORT, ENROLLMENT_PODS, MANY_CLIENTS, Path2, ROUND_TRIPS, SCALING_PAIRS,
    SCALING_THROUGHPUT_SECONDS, THROUGHPUT_SECONDS,
    agents::{agent_pids, agents_cpu},
    bed::{Bed, build_bed},
    connections::run_clients,
    dns,
    ebpf::{BpfStatsOn, EbpfByWorkload},
    efficiency::{Work, probe_cost},
    enrollment::enrollment,
    round_trips::{FIXED_RATE, FIXED_RATE_CONNECTIONS, FIXED_RATE_SECONDS, fixed_rate, latency},
    scaling::{scaling_pairs, scaling_run},
    stats::{fmt_stats, num, stats},
    throughput::throughput,
};

/// The measurements a probe can make: each is one of the full bench's, with
/// its run length unless `--seconds` gives another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Row {
    /// iperf3, one stream (Gbit/s), 10 s runs.
    SingleStream,
    /// iperf3, one stream to the server's IPv6 address (Gbit/s), 10 s runs.
    SingleStreamIpv6,
    /// iperf3 -P 4 (Gbit/s), 10 s runs.
    FourStreams,
    /// 10,000 round trips of 1 byte on one connection (p50 µs).
    RoundTrips,
    /// New connections per second, one client, 3 s runs.
    OneClient,
    /// New connections per second, 16 clients, 3 s runs.
    SixteenClients,
    /// `--count` pod pairs (default 100, at most [`MAX_SCALING_PAIRS`]) at
    /// once: single-stream iperf3 for 5 s, summed (Gbit/s), then one connecting
    /// client per pair for 3 s (connections/s).
    Scaling,
    /// `--count` pods (default 200, at most [`MAX_ENROLLMENT_PODS`]) enrolled
    /// one at a time (p50, p99, max ms); made once, so `--repeat` is 1.
    Enrollment,
    /// 1 KiB requests at a fixed 1,000 per second over 16 keep-alive
    /// connections, 10 s runs (requests/s answered; the agents' CPU per run
    /// is the efficiency table's vCPU per 1,000 requests/s).
    FixedRate,
    /// DNS queries per second answered from the agent's own names (a Service
    /// name), 4 clients, 3 s runs; direct: the resolver answers it.
    DnsOwnNames,
    /// DNS queries forwarded to the resolver, each a new name, one after the
    /// other (p50 µs of `--count`, default 2,000).
    DnsForwarded,
    /// One agent watching the Kubernetes API server double at cluster scale
    /// (its own one-node bed): change-to-view times (p50, p99, max ms) and
    /// VmRSS ([`super::api_watch`]); `--repeat` is 1.
    ApiWatch,
    /// One agent fed by the istiod (delta ADS) double at cluster scale (its
    /// own one-node bed): push-to-view and push-to-ACK times (p50, p99, max
    /// ms) and VmRSS ([`super::xds_watch`]); `--repeat` is 1; `--hook` runs
    /// over the changes.
    XdsWatch,
}

/// The most pod pairs a scaling probe makes: their servers are on node 2,
/// whose pods get addresses from one /24 (253), beside the bed's four.
pub const MAX_SCALING_PAIRS: usize = 120;

/// The most pods an enrollment probe makes on node 1: its /24 and the bed's
/// extra /21 hold about 2,290 beside the bed's own.
pub const MAX_ENROLLMENT_PODS: usize = 2_000;

impl Row {
    /// The full bench's run length for this row (s), if it has one.
    fn bench_seconds(self) -> Option<u32> {
        match self {
            Row::SingleStream | Row::SingleStreamIpv6 | Row::FourStreams => {
                Some(THROUGHPUT_SECONDS)
            }
            Row::OneClient | Row::SixteenClients | Row::DnsOwnNames => Some(CONNECT_SECONDS as u32),
            Row::FixedRate => Some(FIXED_RATE_SECONDS as u32),
            Row::Scaling => Some(SCALING_THROUGHPUT_SECONDS),
            Row::RoundTrips
            | Row::Enrollment
            | Row::ApiWatch
            | Row::XdsWatch
            | Row::DnsForwarded => None,
        }
    }

    /// Repetitions without `--repeat`: 3, and 1 for enrollment (its pods are
    /// made once) and the cluster-scale rows (their own bed, run once).
    pub fn default_repeat(self) -> usize {
        if matches!(self, Row::Enrollment | Row::ApiWatch | Row::XdsWatch) {
            1
        } else {
            3
        }
    }

    /// The unit of work of a run `seconds` long, for the row's cost per unit
    /// (the efficiency table's); none for rows it has no figure for.
    fn work(self, seconds: f64) -> Option<Work> {
        match self {
            Row::SingleStream | Row::SingleStreamIpv6 | Row::FourStreams => {
                Some(Work::Gib { seconds })
            }
            Row::OneClient | Row::SixteenClients => Some(Work::ThousandConnections { seconds }),
            Row::FixedRate => Some(Work::ThousandRequests { seconds }),
            _ => None,
        }
    }

    /// The name `--probe` takes.
    fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    fn unit(self) -> &'static str {
        match self {
            Row::SingleStream | Row::SingleStreamIpv6 | Row::FourStreams | Row::Scaling => "Gbit/s",
            Row::RoundTrips | Row::DnsForwarded => "µs p50",
            Row::DnsOwnNames => "queries/s",
            Row::FixedRate => "requests/s",
            Row::OneClient | Row::SixteenClients => "connections/s",
            Row::Enrollment | Row::ApiWatch | Row::XdsWatch => "ms",
        }
    }
}

/// What `--probe` and its flags asked for.
#[derive(Debug)]
pub struct Options {
    pub row: Row,
    pub repeat: usize,
    /// Length of each run (s), for the rows that have one (the iperf3 runs of
    /// `scaling`); `None` for the full bench's.
    pub seconds: Option<u32>,
    pub podlink_only: bool,
    pub ebpf: bool,
    /// Pod pairs (`scaling`), pods (`enrollment`) or queries (`dns-forwarded`).
    pub count: Option<usize>,
    pub hook: Option<String>,
}

impl Options {
    /// Refuses flags the row has no use for, and values it cannot run with.
    ///
    /// # Errors
    /// Names the flag and why.
    pub fn validate(&self) -> Result<()> {
        let row = self.row;
        if self.repeat == 0 {
            bail!("--repeat must be at least 1");
        }
        if self.seconds == Some(0) {
            bail!("--seconds must be at least 1");
        }
        if self.seconds.is_some() && row.bench_seconds().is_none() {
            bail!(
                "--probe {} has no run length to set with --seconds",
                row.name()
            );
        }
        match (row, self.count) {
            (Row::Scaling | Row::Enrollment | Row::DnsForwarded, Some(0)) => {
                bail!("--count must be at least 1")
            }
            (Row::Scaling, Some(n)) if n > MAX_SCALING_PAIRS => bail!(
                "--count {n}: the scaling probe makes at most {MAX_SCALING_PAIRS} pairs (node 2's pods share one /24)"
            ),
            (Row::Enrollment, Some(n)) if n > MAX_ENROLLMENT_PODS => bail!(
                "--count {n}: the enrollment probe makes at most {MAX_ENROLLMENT_PODS} pods (node 1's pod addresses)"
            ),
            (Row::Scaling | Row::Enrollment | Row::DnsForwarded, _) | (_, None) => {}
            (_, Some(_)) => {
                bail!("--count is for the scaling, enrollment and dns-forwarded probes only")
            }
        }
        if row == Row::ApiWatch
            && (self.repeat != 1 || self.podlink_only || self.ebpf || self.hook.is_some())
        {
            bail!(
                "the api-watch probe runs once on its own bed: give none of --repeat, --podlink-only, --ebpf, --hook"
            );
        }
        if row == Row::XdsWatch && (self.repeat != 1 || self.podlink_only || self.ebpf) {
            bail!(
                "the xds-watch probe runs once on its own bed: give none of --repeat, --podlink-only, --ebpf"
            );
        }
        if row == Row::Enrollment {
            if self.repeat != 1 {
                bail!("the enrollment probe makes its pods once: give --repeat 1");
            }
            if self.podlink_only {
                bail!("the enrollment probe has no direct path to leave out");
            }
        }
        if self.ebpf && matches!(row, Row::Scaling | Row::Enrollment) {
            bail!(
                "--ebpf is for the probes of one pod pair (the scaling pairs' programs are not counted)"
            );
        }
        Ok(())
    }

    fn seconds(&self) -> u32 {
        self.seconds
            .or(self.row.bench_seconds())
            .unwrap_or_default()
    }
}

/// Builds the bed, runs the probe (its options [`Options::validate`]d, before
/// setup and the build), and leaves the removal of the bed to the caller's
/// cleanup.
pub fn probe(o: &Options) -> Result<()> {
    if o.row == Row::ApiWatch {
        let w = super::api_watch::api_watch()?;
        let [p50, p99, max] = w.summary();
        println!(
            "probe api-watch: change to view p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms over {} changes; VmRSS settled {:.1} MiB, most {:.1} MiB; first view {:.1} s; one scrape p50 {:.2} ms",
            w.change_ms.len(),
            w.idle_rss_kib as f64 / 1024.0,
            w.max_rss_kib as f64 / 1024.0,
            w.first_view_seconds,
            w.scrape_p50_ms
        );
        let [s50, s99] = w.by_kind("service");
        let [p50, p99] = w.by_kind("pod");
        let [a50, a99] = w.by_kind("policy");
        println!(
            "  by kind p50/p99 ms: service {s50:.1}/{s99:.1}, pod {p50:.1}/{p99:.1}, policy {a50:.1}/{a99:.1}; reconcile steps p50 µs (state, network, plan+publish, apply): {:?}; settled RssAnon {:.1} MiB",
            w.reconcile_p50_us,
            w.idle_rss_anon_kib as f64 / 1024.0
        );
        return Ok(());
    }
    if o.row == Row::XdsWatch {
        let w = super::xds_watch::xds_watch(o.hook.as_deref());
        stop_hook();
        let w = w?;
        let [p50, p99, max] = w.summary();
        let [a50, a99, amax] = w.ack_summary();
        println!(
            "probe xds-watch: push to view p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms over {} pushes; push to ACK p50 {a50:.2} ms, p99 {a99:.2} ms, max {amax:.2} ms; VmRSS settled {:.1} MiB (anonymous {:.1}), most {:.1} MiB; ready {:.1} s after its start; one scrape p50 {:.2} ms",
            w.change_ms.len(),
            w.idle_rss_kib as f64 / 1024.0,
            w.idle_rss_anon_kib as f64 / 1024.0,
            w.max_rss_kib as f64 / 1024.0,
            w.ready_seconds,
            w.scrape_p50_ms
        );
        let [s50, s99] = w.by_kind("service");
        let [w50, w99] = w.by_kind("workload");
        let [p50, p99] = w.by_kind("policy");
        println!(
            "  by kind p50/p99 ms: service {s50:.1}/{s99:.1}, workload {w50:.1}/{w99:.1}, policy {p50:.1}/{p99:.1}; reconcile steps p50 µs (state, network, plan+publish, apply): {:?}",
            w.reconcile_p50_us,
        );
        return Ok(());
    }
    eprintln!("bench: building the two-node test bed");
    let mut bed = build_bed()?;
    std::thread::sleep(Duration::from_secs(2));
    let stats = o.ebpf.then(BpfStatsOn::enable).transpose()?;
    if let Some(hook) = &o.hook {
        start_hook(&agent_pids(&bed.cluster), hook)?;
    }
    let result = run_rows(&mut bed, o);
    stop_hook();
    drop(stats);
    result
}

/// The running hook (`sh -c CMD`, leading its own process group).
static HOOK: Mutex<Option<Child>> = Mutex::new(None);

/// How long the hook may take to exit after its SIGINT (perf writing its data,
/// say) before its process group is killed.
const HOOK_GRACE: Duration = Duration::from_secs(30);

/// Starts `sh -c hook` with `pids` (the agents') in `$AGENTS`.
pub(super) fn start_hook(pids: &[u32], hook: &str) -> Result<()> {
    let agents: Vec<String> = pids.iter().map(u32::to_string).collect();
    eprintln!("bench: agents {}; starting the hook", agents.join(","));
    let mut child = Command::new("sh")
        .args(["-c", hook])
        .env("AGENTS", agents.join(","))
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .context("starting the hook")?;
    // A hook that cannot start (perf missing, say) is told now, not after
    // the runs.
    std::thread::sleep(Duration::from_secs(1));
    if let Some(status) = child.try_wait()? {
        eprintln!("bench: the hook exited before the runs: {status}");
    }
    *HOOK.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
    Ok(())
}

/// Stops the hook, if one runs: SIGINT to its process group (which the
/// terminal's Ctrl-C does not reach), then up to [`HOOK_GRACE`] for it to
/// exit, then SIGKILL to the group. Also called on Ctrl-C, SIGTERM and SIGHUP.
pub(super) fn stop_hook() {
    let Some(mut child) = HOOK.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    eprintln!("bench: stopping the hook (SIGINT) and waiting for it");
    let group = -(child.id() as i32);
    // SAFETY: kill has no memory preconditions; the negative pid names the
    // hook's process group, which it leads and which stays while it is not
    // reaped.
    unsafe { libc::kill(group, libc::SIGINT) };
    let limit = Instant::now() + HOOK_GRACE;
    loop {
        match child.try_wait() {
            // sh ends by the SIGINT it was sent, whatever its command did.
            Ok(Some(status)) if !status.success() && status.signal() != Some(libc::SIGINT) => {
                eprintln!("bench: the hook exited with {status}");
                return;
            }
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < limit => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) | Err(_) => {
                eprintln!("bench: the hook did not exit within {HOOK_GRACE:?}; killing it");
                // SAFETY: as above.
                unsafe { libc::kill(group, libc::SIGKILL) };
                let _ = child.wait();
                return;
            }
        }
    }
}

fn run_rows(bed: &mut Bed, o: &Options) -> Result<()> {
    let name = o.row.name();
    match o.row {
        Row::Enrollment => {
            let n = o.count.unwrap_or(ENROLLMENT_PODS);
            let e = enrollment(&mut bed.cluster, n)?;
            let s = e.summary(n).with_context(|| {
                format!("only {} of {n} pods were enrolled", e.per_pod_ms.len())
            })?;
            println!(
                "probe enrollment of {n} pods: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; agents' CPU {:.2} s; {} pods without a pods map entry",
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
            let secs = o.seconds();
            let echo = server.addr(ECHO_PORT);
            let resolver = bed.resolver_ip();
            let measure = || match o.row {
                Row::SingleStream => throughput(client, server.ip.into(), secs, 1),
                Row::SingleStreamIpv6 => {
                    throughput(client, server.ip_of(podlink_tests::Family::V6), secs, 1)
                }
                Row::FourStreams => throughput(client, server.ip.into(), secs, 4),
                Row::RoundTrips => Ok(latency(client, echo, 1, ROUND_TRIPS)?[0]),
                Row::OneClient => Ok(run_clients(&[(client, echo)], 1, secs as f64, true)?.rate()),
                Row::SixteenClients => {
                    Ok(run_clients(&[(client, echo)], MANY_CLIENTS, secs as f64, false)?.rate())
                }
                Row::FixedRate => Ok(fixed_rate(
                    client,
                    echo,
                    FIXED_RATE,
                    FIXED_RATE_CONNECTIONS,
                    secs as f64,
                )?
                .rate()),
                Row::DnsOwnNames => dns::own_names_rate(client, resolver, secs as f64),
                Row::DnsForwarded => {
                    dns::forwarded_latency(client, resolver, o.count.unwrap_or(dns::DNS_FORWARDED))
                }
                Row::Scaling | Row::Enrollment | Row::ApiWatch | Row::XdsWatch => {
                    unreachable!("handled above")
                }
            };
            let cpu = agents_cpu(&bed.cluster);
            // The full bench's breakdown by kind of run, over this one run
            // (nothing for the direct path, which runs no podlink program).
            let mut ebpf = EbpfByWorkload::default();
            let (v, ebpf_seconds) = if o.ebpf {
                let (v, seconds) = ebpf.measure(&bed.cluster, prog_pods, "eBPF", path, measure)?;
                (v, Some(seconds))
            } else {
                (measure()?, None)
            };
            let cpu = agents_cpu(&bed.cluster) - cpu;
            let cost = match (path, o.row.work(secs as f64)) {
                (Path2::Podlink, Some(work)) => {
                    format!(" = {}", probe_cost(work, v, cpu, ebpf_seconds))
                }
                _ => String::new(),
            };
            let ebpf: String = ebpf.lines().iter().map(|l| format!("; {l}")).collect();
            println!(
                "probe {name} {}/{} {path:?}: {} {}, agents' CPU {cpu:.2} s{cost}{ebpf}",
                rep + 1,
                o.repeat,
                num(v),
                o.row.unit()
            );
            values[path as usize].push(v);
        }
    }
    summarize(
        &name,
        &values,
        matches!(o.row, Row::RoundTrips | Row::DnsForwarded),
    );
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

/// Each path's median [min-max], then podlink / direct of the medians, or with
/// `added` podlink − direct.
fn summarize(name: &str, values: &[Vec<f64>; 2], added: bool) {
    let medians = [Path2::Direct, Path2::Podlink].map(|path| {
        let v = &values[path as usize];
        (!v.is_empty()).then(|| {
            let s = stats(v);
            println!("probe {name} {path:?}: {}", fmt_stats(&s));
            s.median
        })
    });
    match medians {
        [Some(direct), Some(podlink)] if added => {
            println!(
                "probe {name}: podlink adds {} µs (medians)",
                num(podlink - direct)
            )
        }
        [Some(direct), Some(podlink)] if direct > 0.0 => println!(
            "probe {name}: podlink / direct {:.2} (medians)",
            podlink / direct
        ),
        _ => {}
    }
}

fn scaling_probe(bed: &mut Bed, o: &Options) -> Result<()> {
    let n = o.count.unwrap_or(SCALING_PAIRS[SCALING_PAIRS.len() - 1]);
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
                o.seconds(),
                CONNECT_SECONDS,
            )?;
            println!(
                "probe scaling {n} pairs {}/{} {path:?}: {} Gbit/s (iperf3 exits {:.2} to {:.2} s, {} failed, agents' CPU {:.2} s), {} connections/s ({} failed, agents' CPU {:.2} s)",
                rep + 1,
                o.repeat,
                num(run.throughput_gbps),
                run.throughput_first_exit_seconds,
                run.throughput_last_exit_seconds,
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
    summarize(&format!("scaling {n} pairs, Gbit/s"), &gbps, false);
    summarize(&format!("scaling {n} pairs, connections/s"), &rates, false);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Settings;

    fn options(row: Row) -> Options {
        Options {
            row,
            repeat: 1,
            seconds: None,
            podlink_only: false,
            ebpf: false,
            count: None,
            hook: None,
        }
    }

    #[test]
    fn flags_that_do_not_apply_are_refused() {
        type Set = fn(&mut Options);
        let refusals: [(Row, Set, &str); 13] = [
            (
                Row::SingleStream,
                |o| o.count = Some(3),
                "--count is for the scaling, enrollment and dns-forwarded probes",
            ),
            (
                Row::Scaling,
                |o| o.count = Some(MAX_SCALING_PAIRS + 1),
                "at most 120 pairs",
            ),
            (
                Row::Scaling,
                |o| o.count = Some(0),
                "--count must be at least 1",
            ),
            (
                Row::Enrollment,
                |o| o.count = Some(0),
                "--count must be at least 1",
            ),
            (
                Row::Enrollment,
                |o| o.count = Some(MAX_ENROLLMENT_PODS + 1),
                "at most 2000 pods",
            ),
            (Row::Enrollment, |o| o.repeat = 2, "give --repeat 1"),
            (Row::Enrollment, |o| o.podlink_only = true, "no direct path"),
            (
                Row::OneClient,
                |o| o.seconds = Some(0),
                "--seconds must be at least 1",
            ),
            (Row::RoundTrips, |o| o.seconds = Some(5), "no run length"),
            (
                Row::Scaling,
                |o| o.ebpf = true,
                "--ebpf is for the probes of one pod pair",
            ),
            (
                Row::FourStreams,
                |o| o.repeat = 0,
                "--repeat must be at least 1",
            ),
            (Row::XdsWatch, |o| o.repeat = 2, "runs once on its own bed"),
            (Row::XdsWatch, |o| o.ebpf = true, "runs once on its own bed"),
        ];
        for (row, set, what) in refusals {
            let mut o = options(row);
            set(&mut o);
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{o:?}: {e}");
        }
        for row in [Row::SingleStream, Row::Scaling, Row::Enrollment] {
            options(row).validate().unwrap();
        }
        // The xds-watch probe takes a hook (over its changes).
        Options {
            hook: Some("true".into()),
            ..options(Row::XdsWatch)
        }
        .validate()
        .unwrap();
        // The limits themselves are taken.
        for (row, most) in [
            (Row::Scaling, MAX_SCALING_PAIRS),
            (Row::Enrollment, MAX_ENROLLMENT_PODS),
        ] {
            Options {
                count: Some(most),
                ..options(row)
            }
            .validate()
            .unwrap();
        }
    }

    #[test]
    fn rows_are_named_as_the_flag_takes_them() {
        assert_eq!(Row::SixteenClients.name(), "sixteen-clients");
        assert_eq!(Row::RoundTrips.name(), "round-trips");
        assert_eq!(Row::XdsWatch.name(), "xds-watch");
    }

    #[test]
    fn runs_last_as_in_the_full_bench_unless_told() {
        let full = Settings::new(false, None);
        for row in [Row::SingleStream, Row::SingleStreamIpv6, Row::FourStreams] {
            assert_eq!(options(row).seconds(), full.throughput_seconds);
        }
        for row in [Row::OneClient, Row::SixteenClients] {
            assert_eq!(options(row).seconds() as f64, full.connect_seconds);
        }
        assert_eq!(
            options(Row::Scaling).seconds(),
            full.scaling_throughput_seconds
        );
        let told = Options {
            seconds: Some(2),
            ..options(Row::SixteenClients)
        };
        assert_eq!(told.seconds(), 2);
    }

    #[test]
    fn podlink_only_runs_podlink_alone() {
        for rep in 0..3 {
            assert_eq!(order(rep, true), [Path2::Podlink]);
            assert_eq!(order(rep, false), Path2::order(rep));
        }
    }
}
