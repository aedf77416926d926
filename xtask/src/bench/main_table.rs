//! The main table: one row per figure, the paths' samples, the target and
//! whether it was met.

use serde::Serialize;

use super::{
    ENROLLED_ON_NODE1, MANY_CLIENTS, PROGRAMS, Path2, Settings,
    connections::{Churn, ClientRun},
    ebpf::{Cost, ProgCounters},
    enrollment::Enrollment,
    memory::Memory,
    round_trips::{FIXED_RATE, FIXED_RATE_CONNECTIONS, FIXED_RATE_SECONDS},
    stats::{Stats, num, stats},
};

/// The round trips' target: what podlink may add to the direct path's p50
/// (µs).
const ADDED_P50_MAX_US: f64 = 85.0;

/// A figure's samples: each path's value per repetition, and the agents' CPU
/// seconds of each podlink run (and, where measured, its eBPF programs' seconds).
#[derive(Default)]
pub(super) struct Series {
    pub(super) direct: Vec<f64>,
    pub(super) podlink: Vec<f64>,
    pub(super) cpu: Vec<f64>,
    pub(super) ebpf: Vec<f64>,
}

impl Series {
    pub(super) fn push(&mut self, path: Path2, value: f64, cpu: f64) {
        match path {
            Path2::Direct => self.direct.push(value),
            Path2::Podlink => {
                self.podlink.push(value);
                self.cpu.push(cpu);
            }
        }
    }

    /// [`Series::push`] with what the run cost, its eBPF programs' seconds
    /// kept for a podlink run.
    pub(super) fn push_costed(&mut self, path: Path2, value: f64, cost: Cost) {
        self.push(path, value, cost.cpu);
        if path == Path2::Podlink {
            self.ebpf.push(cost.ebpf);
        }
    }
}

/// The target of a row comparing the paths.
#[derive(Clone, Copy)]
pub(super) enum Compare {
    /// podlink / direct at least this.
    RatioAtLeast(f64),
    /// podlink − direct at most this.
    AddedAtMost(f64),
}

/// The target of a row of podlink's own value.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) enum Limit {
    AtMost(f64),
    AtLeast(f64),
}

impl Limit {
    /// Whether `v` is within the limit.
    pub(super) fn met(self, v: f64) -> bool {
        match self {
            Limit::AtMost(t) => v <= t,
            Limit::AtLeast(t) => v >= t,
        }
    }
}

#[derive(Serialize)]
pub(super) struct Row {
    pub(super) figure: String,
    pub(super) unit: String,
    pub(super) direct: Option<Stats>,
    pub(super) podlink: Option<Stats>,
    /// What the table prints in place of the stats, when they do not say it all.
    pub(super) direct_text: Option<String>,
    pub(super) podlink_text: Option<String>,
    /// podlink / direct ("ratio"), podlink − direct ("added"), or none.
    pub(super) comparison: Option<f64>,
    pub(super) comparison_kind: &'static str,
    pub(super) target: String,
    pub(super) met: Option<bool>,
    /// Both agents' CPU seconds per podlink run.
    pub(super) agent_cpu_seconds: Option<Stats>,
}

impl Row {
    /// A row comparing the two paths' medians.
    pub(super) fn compared(figure: &str, unit: &str, series: &Series, target: Compare) -> Self {
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
    pub(super) fn own(
        figure: &str,
        unit: &str,
        value: Option<f64>,
        text: String,
        target: Limit,
    ) -> Self {
        let met = value.map(|v| target.met(v));
        let target = match target {
            Limit::AtMost(t) => format!("<= {t} {unit}"),
            Limit::AtLeast(t) => format!(">= {t}"),
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

/// The main table's row of the fixed-rate runs' round trips: p50 of each
/// path, podlink's added µs held to the request/response rows' target.
pub(super) fn fixed_rate_row(latency: &Series) -> Row {
    Row::compared(
        &format!(
            "request/response 1 KiB at {} requests/s over {FIXED_RATE_CONNECTIONS} connections, {} s, p50",
            num(FIXED_RATE),
            num(FIXED_RATE_SECONDS)
        ),
        "µs",
        latency,
        Compare::AddedAtMost(ADDED_P50_MAX_US),
    )
}

#[allow(clippy::too_many_arguments)]
pub(super) fn main_rows(
    s: &Settings,
    throughput: [&Series; 3],
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
            &format!("single-stream throughput over IPv6, iperf3 -t {secs}"),
            "Gbit/s",
            throughput[1],
            Compare::RatioAtLeast(0.6),
        ),
        Row::compared(
            &format!("4-stream throughput, iperf3 -P 4 -t {secs}"),
            "Gbit/s",
            throughput[2],
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
        let limit = if q == "p50" { ADDED_P50_MAX_US } else { 650.0 };
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
