//! Efficiency: what both agents spend per unit of work, beside ztunnel's
//! figures measured on this kind of machine (issue 37).
//!
//! Each figure is a podlink run's CPU seconds over the work it carried, the
//! median [min-max] over the repetitions:
//!
//! * per GiB delivered: both agents' utime+stime (`/proc/PID/stat`) over the
//!   bytes iperf3 received (its bits per second × the run's seconds);
//! * per 1,000 new connections: the same over the connections the clients
//!   completed;
//! * per 1,000 requests/s: over a run at a fixed rate of [`FIXED_RATE`]
//!   requests of 1 KiB, each echoed, over [`FIXED_RATE_CONNECTIONS`] keep-alive
//!   connections (the load of Istio's performance dashboards), the agents' CPU
//!   seconds per second divided by the thousands of requests per second, that
//!   is vCPU per 1,000 requests/s.
//!
//! The eBPF programs' own time (`run_time_ns` of `bpf_stats`, which the
//! kernel counts in softirq or in the sender's system time, not in the
//! agents') is a column of its own, per the same unit.
//!
//! ztunnel's figures are not measured by the bench (it does not build or run
//! ztunnel): they are those of issue 37, measured once side by side with
//! podlink on the same kind of machine (ztunnel 62d82653, ring, 2 worker
//! threads; both nodes on one bed), except its vCPU per 1,000 requests/s,
//! which is the figure Istio publishes for ztunnel
//! (<https://istio.io/latest/docs/ops/deployment/performance-and-scalability/>),
//! on other machines. That run measured podlink too, at 2.87 and 3.17 CPU-s
//! per GiB where this bench measured about 2.2 before the proxy threads: its
//! load and lengths differed, so podlink / ztunnel compares across setups. The
//! aim is half of ztunnel's CPU, and of its added latency.

use serde::Serialize;

use super::{
    main_table::{Limit, Series},
    print::Block,
    round_trips::{FIXED_RATE, FIXED_RATE_CONNECTIONS, FIXED_RATE_SECONDS},
    stats::{Stats, fmt_stats_sig, num, sig, stats},
};

const GIB: f64 = (1u64 << 30) as f64;

/// The unit a figure's work is counted in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Work {
    /// GiB received, from Gbit/s over a run of this many seconds.
    Gib { seconds: f64 },
    /// Thousands of connections, from connections/s over this many seconds.
    ThousandConnections { seconds: f64 },
    /// Thousands of requests, from requests/s over this many seconds: CPU
    /// seconds per thousand requests are vCPU per 1,000 requests/s.
    ThousandRequests { seconds: f64 },
}

impl Work {
    /// The work of a run that measured `value` (its figure's unit).
    pub(super) fn of(self, value: f64) -> f64 {
        match self {
            Work::Gib { seconds } => value * 1e9 * seconds / 8.0 / GIB,
            Work::ThousandConnections { seconds } | Work::ThousandRequests { seconds } => {
                value * seconds / 1000.0
            }
        }
    }

    /// The name of the cost per this work, as a table unit.
    pub(super) fn unit(self) -> &'static str {
        match self {
            Work::Gib { .. } => "CPU-s per GiB",
            Work::ThousandConnections { .. } => "CPU-s per 1,000 connections",
            Work::ThousandRequests { .. } => "vCPU per 1,000 requests/s",
        }
    }
}

/// One row of the efficiency table.
#[derive(Clone, Debug, Serialize)]
pub(super) struct EfficiencyRow {
    pub(super) figure: String,
    pub(super) unit: String,
    /// podlink's figure over the runs (the agents' CPU per unit, or the
    /// measured value for the latency and rate rows).
    pub(super) podlink: Stats,
    /// The eBPF programs' seconds per the same unit (CPU rows only).
    pub(super) ebpf: Option<Stats>,
    /// ztunnel's figure on this kind of machine ([`reference`]).
    pub(super) ztunnel: f64,
    /// Where the reference comes from when not issue 37's side-by-side run.
    pub(super) ztunnel_source: Option<&'static str>,
    /// What podlink aims at: half of ztunnel's cost or added latency, twice
    /// its rate.
    pub(super) aim: Limit,
    /// Whether podlink's median is within the aim.
    pub(super) met: bool,
}

/// An aim as the table writes it.
fn aim_text(aim: Limit) -> String {
    match aim {
        Limit::AtMost(a) => format!("<= {}", sig(a)),
        Limit::AtLeast(a) => format!(">= {}", sig(a)),
    }
}

/// ztunnel's figures of issue 37 (see the module's documentation).
pub(super) mod reference {
    /// Both agents' CPU-s per GiB, 1 and 4 streams.
    pub const CPU_PER_GIB: [f64; 2] = [3.53, 2.96];
    /// Both agents' CPU-s per 1,000 new connections, 1 and 16 clients.
    pub const CPU_PER_THOUSAND_CONNECTIONS: [f64; 2] = [1.013, 0.424];
    /// vCPU per 1,000 requests/s, as Istio publishes it for ztunnel.
    pub const VCPU_PER_THOUSAND_RPS: f64 = 0.06;
    /// Added round-trip latency p50 (µs), 1 B and 1 KiB.
    pub const ADDED_LATENCY_US: [f64; 2] = [128.0, 127.0];
    /// Throughput (Gbit/s), 1 and 4 streams.
    pub const THROUGHPUT_GBPS: [f64; 2] = [2.86, 3.89];
    /// New connections/s, 1 and 16 clients.
    pub const CONNECTIONS_PER_SECOND: [f64; 2] = [823.0, 2_932.0];
}

/// A CPU row: the agents' seconds per unit of `work` over each podlink run of
/// `series`, and its eBPF programs' seconds per the same unit.
pub(super) fn cpu_row(
    figure: &str,
    series: &Series,
    work: Work,
    ztunnel: f64,
    source: Option<&'static str>,
) -> Option<EfficiencyRow> {
    let per = |costs: &[f64]| -> Vec<f64> {
        costs
            .iter()
            .zip(&series.podlink)
            .map(|(c, v)| c / work.of(*v))
            .filter(|x| x.is_finite())
            .collect()
    };
    let agents = per(&series.cpu);
    if agents.is_empty() {
        return None;
    }
    let ebpf = per(&series.ebpf);
    let podlink = stats(&agents);
    let aim = Limit::AtMost(ztunnel / 2.0);
    Some(EfficiencyRow {
        figure: figure.into(),
        unit: work.unit().into(),
        met: aim.met(podlink.median),
        podlink,
        ebpf: (!ebpf.is_empty()).then(|| stats(&ebpf)),
        ztunnel,
        ztunnel_source: source,
        aim,
    })
}

/// A row of podlink's own measured value against ztunnel's: the added µs of
/// `series` (podlink − the direct path's median, per podlink run) when
/// `added`, else its value; the aim is half of ztunnel's added latency or
/// twice its rate.
pub(super) fn value_row(
    figure: &str,
    unit: &str,
    series: &Series,
    added: bool,
    ztunnel: f64,
) -> Option<EfficiencyRow> {
    if series.podlink.is_empty() || (added && series.direct.is_empty()) {
        return None;
    }
    let values: Vec<f64> = if added {
        let direct = stats(&series.direct).median;
        series.podlink.iter().map(|v| v - direct).collect()
    } else {
        series.podlink.clone()
    };
    let podlink = stats(&values);
    let aim = if added {
        Limit::AtMost(ztunnel / 2.0)
    } else {
        Limit::AtLeast(ztunnel * 2.0)
    };
    Some(EfficiencyRow {
        figure: figure.into(),
        unit: unit.into(),
        met: aim.met(podlink.median),
        podlink,
        ebpf: None,
        ztunnel,
        ztunnel_source: None,
        aim,
    })
}

/// The inputs of the efficiency table, from the main table's runs and the
/// fixed-rate runs.
pub(super) struct EfficiencyRuns<'a> {
    pub(super) throughput_seconds: f64,
    pub(super) connect_seconds: f64,
    /// Gbit/s, 1 and 4 streams.
    pub(super) throughput: [&'a Series; 2],
    /// Connections/s, 1 and 16 clients.
    pub(super) connections: [&'a Series; 2],
    /// Request/response p50 (µs), 1 B and 1 KiB.
    pub(super) round_trips: [&'a Series; 2],
    /// Requests/s answered at the fixed rate.
    pub(super) fixed_rate: &'a Series,
}

/// The efficiency table's rows.
pub(super) fn efficiency_rows(r: &EfficiencyRuns) -> Vec<EfficiencyRow> {
    use reference::*;
    let gib = Work::Gib {
        seconds: r.throughput_seconds,
    };
    let conns = Work::ThousandConnections {
        seconds: r.connect_seconds,
    };
    let requests = Work::ThousandRequests {
        seconds: FIXED_RATE_SECONDS,
    };
    let istio = Some("Istio's published figure, other machines");
    [
        cpu_row("both agents' CPU, 1 stream", r.throughput[0], gib, CPU_PER_GIB[0], None),
        cpu_row("both agents' CPU, 4 streams", r.throughput[1], gib, CPU_PER_GIB[1], None),
        cpu_row(
            "both agents' CPU, new connections, 1 client",
            r.connections[0],
            conns,
            CPU_PER_THOUSAND_CONNECTIONS[0],
            None,
        ),
        cpu_row(
            "both agents' CPU, new connections, 16 clients",
            r.connections[1],
            conns,
            CPU_PER_THOUSAND_CONNECTIONS[1],
            None,
        ),
        cpu_row(
            &format!(
                "both agents' CPU at {} requests/s of 1 KiB over {FIXED_RATE_CONNECTIONS} connections",
                num(FIXED_RATE)
            ),
            r.fixed_rate,
            requests,
            VCPU_PER_THOUSAND_RPS,
            istio,
        ),
        value_row("added round-trip latency 1 B, p50", "µs", r.round_trips[0], true, ADDED_LATENCY_US[0]),
        value_row("added round-trip latency 1 KiB, p50", "µs", r.round_trips[1], true, ADDED_LATENCY_US[1]),
        value_row("throughput, 1 stream", "Gbit/s", r.throughput[0], false, THROUGHPUT_GBPS[0]),
        value_row("throughput, 4 streams", "Gbit/s", r.throughput[1], false, THROUGHPUT_GBPS[1]),
        value_row(
            "new connections/s, 1 client",
            "conn/s",
            r.connections[0],
            false,
            CONNECTIONS_PER_SECOND[0],
        ),
        value_row(
            "new connections/s, 16 clients",
            "conn/s",
            r.connections[1],
            false,
            CONNECTIONS_PER_SECOND[1],
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The efficiency table as printed: a heading, the rows, and the reference's
/// source.
pub(super) fn efficiency_blocks(rows: &[EfficiencyRow]) -> Vec<Block> {
    let opt = |s: &Option<Stats>| s.as_ref().map_or("-".into(), fmt_stats_sig);
    let table = rows
        .iter()
        .map(|r| {
            vec![
                format!("{} ({})", r.figure, r.unit),
                fmt_stats_sig(&r.podlink),
                opt(&r.ebpf),
                match r.ztunnel_source {
                    Some(source) => format!("{} ({source})", sig(r.ztunnel)),
                    None => sig(r.ztunnel),
                },
                format!("{:.2} x", r.podlink.median / r.ztunnel),
                aim_text(r.aim),
                if r.met { "ok" } else { "MISSED" }.into(),
            ]
        })
        .collect();
    vec![
        Block::Break,
        Block::Line(format!(
            "efficiency: both agents' CPU (utime+stime) per unit of work over each podlink run of the main table, and over {} s runs at {} requests/s of 1 KiB over {FIXED_RATE_CONNECTIONS} keep-alive connections; eBPF: the programs' run_time_ns per the same unit (kernel time, not in the agents'); ztunnel: measured beside podlink on this kind of machine with another load (issue 37: ztunnel 62d82653, ring, 2 worker threads), so the ratio compares across setups; aim: half ztunnel's CPU and added latency, twice its rates",
            num(FIXED_RATE_SECONDS),
            num(FIXED_RATE)
        )),
        Block::Break,
        Block::Table {
            header: [
                "figure",
                "podlink",
                "eBPF",
                "ztunnel",
                "podlink / ztunnel",
                "aim",
                "met",
            ]
            .map(String::from)
            .to_vec(),
            rows: table,
        },
    ]
}

/// One probe run's cost per unit, for `--probe`'s lines: "N unit (eBPF M)".
pub(super) fn probe_cost(work: Work, value: f64, cpu: f64, ebpf: Option<f64>) -> String {
    let w = work.of(value);
    let mut text = format!("{} {}", sig(cpu / w), work.unit());
    if let Some(e) = ebpf {
        text += &format!(" (eBPF {})", sig(e / w));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{Path2, ebpf::Cost};

    fn series(podlink: &[f64], cpu: &[f64], ebpf: &[f64]) -> Series {
        let mut s = Series::default();
        for ((v, c), e) in podlink.iter().zip(cpu).zip(ebpf) {
            s.push_costed(Path2::Podlink, *v, Cost { cpu: *c, ebpf: *e });
            s.push(Path2::Direct, v / 2.0, 0.0);
        }
        s
    }

    #[test]
    fn cpu_per_gib_is_the_runs_cpu_over_the_bytes_received() {
        // 8 Gbit/s for 10 s is 1e10 bytes, 9.31 GiB.
        let s = series(&[8.0, 8.0, 8.0], &[9.31, 18.63, 27.94], &[1.0, 1.0, 1.0]);
        let row = cpu_row("x", &s, Work::Gib { seconds: 10.0 }, 3.0, None).unwrap();
        assert!((row.podlink.median - 2.0).abs() < 0.01, "{row:?}");
        assert!((row.ebpf.unwrap().median - 0.1074).abs() < 0.001);
        assert!(!row.met, "2 CPU-s per GiB is over half of 3");
    }

    #[test]
    fn cpu_per_thousand_requests_is_vcpu_per_thousand_rps() {
        // 1,000 requests/s for 10 s using 0.5 CPU-s: 0.05 vCPU at 1,000 rps.
        let s = series(&[1000.0], &[0.5], &[0.0]);
        let row = cpu_row(
            "x",
            &s,
            Work::ThousandRequests { seconds: 10.0 },
            0.06,
            None,
        )
        .unwrap();
        assert!((row.podlink.median - 0.05).abs() < 1e-9);
        assert_eq!(row.unit, "vCPU per 1,000 requests/s");
    }

    #[test]
    fn added_latency_is_against_the_direct_median_and_rates_aim_at_twice() {
        let s = series(&[100.0, 120.0, 110.0], &[1.0; 3], &[0.0; 3]);
        // direct: 50, 60, 55 (half podlink's), median 55.
        let row = value_row("x", "µs", &s, true, 128.0).unwrap();
        assert!((row.podlink.median - 55.0).abs() < 1e-9);
        assert!(row.met);
        let row = value_row("x", "conn/s", &s, false, 60.0).unwrap();
        assert!(!row.met, "110 is under twice 60");
    }

    #[test]
    fn a_series_without_podlink_runs_gives_no_row() {
        let s = Series::default();
        assert!(cpu_row("x", &s, Work::Gib { seconds: 1.0 }, 1.0, None).is_none());
        assert!(value_row("x", "µs", &s, true, 1.0).is_none());
    }
}
