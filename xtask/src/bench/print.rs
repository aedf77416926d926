//! The report as the bench writes it: the machine header, the main table, the
//! efficiency table, the eBPF cost by kind of run, the connection phases, the scaling and enrollment
//! tables, the Kubernetes API and istiod rows and the bench's own time, as
//! [`Block`]s, printed as text on standard output (and rendered as Markdown by
//! [`super::markdown`]).

use super::{
    ENROLL_TIMEOUT, Path2,
    api_watch::{AIM_P99_MS, AIM_RSS_MIB, ApiWatch},
    connections::Phases,
    efficiency::efficiency_blocks,
    report::Report,
    stats::{Stats, fmt_stats, num},
    xds_watch::XdsWatch,
};

/// One piece of the report.
pub(super) enum Block {
    /// A line of text.
    Line(String),
    /// An entry of a list (indented on the terminal).
    Item(String),
    /// A table: its column names, then its rows of cells.
    Table {
        header: Vec<String>,
        rows: Vec<Vec<String>>,
    },
    /// An empty line, between the report's parts.
    Break,
}

/// A [`Block::Table`] of these column names and rows.
fn table(header: &[&str], rows: Vec<Vec<String>>) -> Block {
    Block::Table {
        header: header.iter().map(|h| h.to_string()).collect(),
        rows,
    }
}

/// Prints the report on standard output.
pub(super) fn print_report(r: &Report) {
    for block in report_blocks(r) {
        match block {
            Block::Line(line) => println!("{line}"),
            Block::Item(item) => println!("  {item}"),
            Block::Table { header, rows } => print_grid(&header, &rows),
            Block::Break => println!(),
        }
    }
}

/// Prints rows of cells as aligned columns.
fn print_grid(header: &[String], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header);
    line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>());
    for row in rows {
        line(row);
    }
}

/// The report of a full run, in the order it is printed.
pub(super) fn report_blocks(r: &Report) -> Vec<Block> {
    let mut out = Vec::new();
    let m = &r.machine;
    let s = &r.settings;
    out.push(Block::Break);
    if s.quick {
        out.push(Block::Line("QUICK RUN (--quick): shortened runs for development; these figures do not judge the targets".into()));
    }
    out.push(Block::Line(format!(
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
    )));
    out.push(Block::Line(format!(
        "pod on node 1 -> pod on node 2; {} interleaved repetition(s): median [min-max]; agent CPU = both agents' utime+stime per podlink run",
        s.repetitions
    )));
    out.push(Block::Break);
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
    out.push(table(
        &[
            "figure",
            "direct",
            "podlink",
            "vs direct",
            "target",
            "met",
            "agent CPU s",
        ],
        rows,
    ));

    out.extend(efficiency_blocks(&r.efficiency));

    out.push(Block::Break);
    out.push(Block::Line(
        "eBPF cost per packet by kind of podlink run (for profiling):".into(),
    ));
    for line in r.ebpf_by_workload.lines() {
        out.push(Block::Item(line));
    }

    out.push(Block::Break);
    out.push(Block::Line("new connections, 1 client: where a connection's time goes (µs; each run's p50, median of the runs)".into()));
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
        out.push(table(
            &["path", "connect", "greeting", "echo and close", "total"],
            vec![
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
        ));
    } else {
        out.push(Block::Item(
            "(no connection completed on one of the paths)".into(),
        ));
    }

    out.push(Block::Break);
    out.push(Block::Line(format!(
        "scaling: concurrent pod pairs (node 1 -> node 2, each pair its own pods), one run each; iperf3 single stream per pair for {} s{}, summed; connections with 1 client thread per pair for {} s",
        s.scaling_throughput_seconds,
        if s.scaling_throughput_seconds < s.throughput_seconds {
            " (shorter than the main table's runs)"
        } else {
            ""
        },
        s.connect_seconds
    )));
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
    out.push(table(
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
        rows,
    ));
    out.push(Block::Line(format!(
        "(pairs set up in {:.1} s; \"iperf3 exits\": from the runs' common start, each client waiting for it in its pod, to the first and the last exit, direct/podlink)",
        r.scaling.pairs_setup_seconds
    )));

    out.push(Block::Break);
    let e = &r.enrollment;
    out.push(Block::Line(format!(
        "enrollment: {} pods made on node 1 by the ptp + host-local CNI plugins in {:.1} s ({:.0} ms per pod, not timed below), then listed one at a time; time from the manifest's write (by rename) to both link pins",
        e.pods_created,
        e.creation_seconds,
        e.creation_seconds * 1e3 / e.pods_created.max(1) as f64
    )));
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
    out.push(table(
        &[
            "pods",
            "p50 ms",
            "p99 ms",
            "max ms",
            "total s (first write to last links)",
        ],
        rows,
    ));
    out.push(Block::Line(format!(
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
    )));

    out.extend(api_watch_blocks(&r.api_watch));
    out.extend(xds_watch_blocks(&r.xds_watch));

    out.push(Block::Break);
    let t = &r.timings;
    out.push(Block::Line(format!(
        "bench time: {:.0} s (bed {:.0} s, main table {:.0} s, scaling {:.0} s, enrollment {:.0} s, Kubernetes API {:.0} s, istiod {:.0} s, cleanup {:.0} s; the build before it not counted)",
        t.total_seconds,
        t.bed_seconds,
        t.main_table_seconds,
        t.scaling_seconds,
        t.enrollment_seconds,
        t.api_watch_seconds,
        t.xds_watch_seconds,
        t.cleanup_seconds
    )));
    out
}

/// The rows with aims of a cluster-scale part: `view`'s p50 / p99 / max
/// (ms, [`AIM_P99_MS`]) and the agent's VmRSS settled and at most (KiB,
/// [`AIM_RSS_MIB`]).
fn aimed_rows(
    view: &str,
    [p50, p99, max]: [f64; 3],
    idle_kib: u64,
    max_kib: u64,
) -> Vec<Vec<String>> {
    let met = |ok: bool| if ok { "ok" } else { "MISSED" }.to_string();
    let mib = |kib: u64| kib as f64 / 1024.0;
    vec![
        vec![
            format!("{view} (ms): p50 / p99 / max"),
            format!("{} / {} / {}", num(p50), num(p99), num(max)),
            format!("p99 < {AIM_P99_MS:.0}"),
            met(p99 < AIM_P99_MS),
        ],
        vec![
            "agent VmRSS (MiB): settled / most during the changes".into(),
            format!("{} / {}", num(mib(idle_kib)), num(mib(max_kib))),
            format!("< {AIM_RSS_MIB:.0}"),
            met(mib(idle_kib.max(max_kib)) < AIM_RSS_MIB),
        ],
    ]
}

/// The report's part: a line on the bed, then a table of the figures with the
/// aims.
fn api_watch_blocks(w: &ApiWatch) -> Vec<Block> {
    vec![
        Block::Break,
        Block::Line(format!(
            "Kubernetes API at cluster scale: one agent watching the API server double with {} pods ({} on its node), {} Services with their EndpointSlices and {} AuthorizationPolicies; {} changes at the API (Service, pod, policy in turn), each added then deleted",
            w.pods,
            w.local_pods,
            w.services,
            w.policies,
            w.change_ms.len() / 2
        )),
        Block::Table {
            header: ["figure", "podlink", "aim", "met"]
                .iter()
                .map(|h| h.to_string())
                .collect(),
            rows: [
                aimed_rows(
                    "change at the API to the agent's view",
                    w.summary(),
                    w.idle_rss_kib,
                    w.max_rss_kib,
                ),
                vec![
                    vec![
                        "by kind, p50 / p99 (ms): Service and slice, pod, policy".into(),
                        ["service", "pod", "policy"]
                            .map(|k| {
                                let [a, b] = w.by_kind(k);
                                format!("{} / {}", num(a), num(b))
                            })
                            .join(", "),
                        "-".into(),
                        "-".into(),
                    ],
                    vec![
                    "agent reconciliation steps, p50 (µs): state, network, plan and publish, apply"
                        .into(),
                    w.reconcile_p50_us.map(num).join(" / "),
                    "-".into(),
                    "-".into(),
                ],
                    vec![
                        "settled VmRSS that is anonymous memory (MiB)".into(),
                        num(w.idle_rss_anon_kib as f64 / 1024.0),
                        "-".into(),
                        "-".into(),
                    ],
                    vec![
                        "agent start to its first view (s)".into(),
                        num(w.first_view_seconds),
                        "-".into(),
                        "-".into(),
                    ],
                    vec![
                        "one /metrics scrape, p50 (ms): the times' resolution".into(),
                        num(w.scrape_p50_ms),
                        "-".into(),
                        "-".into(),
                    ],
                ],
            ]
            .concat(),
        },
    ]
}

/// The istiod part: a line on the bed, then a table of the figures with the
/// Kubernetes API row's aims.
fn xds_watch_blocks(w: &XdsWatch) -> Vec<Block> {
    let [a50, a99, amax] = w.ack_summary();
    let row = |figure: &str, value: String| vec![figure.into(), value, "-".into(), "-".into()];
    vec![
        Block::Break,
        Block::Line(format!(
            "istiod at cluster scale: one agent fed by the delta ADS double with {} workloads ({} of them pods on its node), {} services (a VIP each, every workload backing one) and {} authorization policies; {} changes pushed (service, workload of another node, policy in turn), each added then removed, one push each; the aims are the Kubernetes API row's",
            w.workloads,
            w.local_pods,
            w.services,
            w.policies,
            w.change_ms.len() / 2
        )),
        Block::Table {
            header: ["figure", "podlink", "aim", "met"]
                .iter()
                .map(|h| h.to_string())
                .collect(),
            rows: [
                aimed_rows(
                    "push to the agent's view",
                    w.summary(),
                    w.idle_rss_kib,
                    w.max_rss_kib,
                ),
                vec![
                row(
                    "by kind, p50 / p99 (ms): service, workload, policy",
                    ["service", "workload", "policy"]
                        .map(|k| {
                            let [a, b] = w.by_kind(k);
                            format!("{} / {}", num(a), num(b))
                        })
                        .join(", "),
                ),
                row(
                    "push to the agent's ACK (ms): p50 / p99 / max",
                    format!("{} / {} / {}", num(a50), num(a99), num(amax)),
                ),
                row(
                    "agent reconciliation steps, p50 (µs): state, network, plan and publish, apply",
                    w.reconcile_p50_us.map(num).join(" / "),
                ),
                row(
                    "settled VmRSS that is anonymous memory (MiB)",
                    num(w.idle_rss_anon_kib as f64 / 1024.0),
                ),
                row("agent start to its readiness (s)", num(w.ready_seconds)),
                row(
                    "one /metrics scrape, p50 (ms): the times' resolution",
                    num(w.scrape_p50_ms),
                ),
                ],
            ]
            .concat(),
        },
    ]
}
