//! `--markdown FILE`: the report of a full run as a Markdown page
//! (`docs/benchmarks.md` is one): a title, the report's [`Block`]s as
//! paragraphs, lists and tables (the machine header, the main table with each
//! figure's target, the breakdowns, the scaling and enrollment tables, the
//! Kubernetes API and istiod ones), then the ideas tried and not kept
//! ([`TRIED`]).

use super::print::Block;

/// The ideas measured and dropped, one Markdown list item each: "idea —
/// measured effect — why it was dropped" (`xtask/src/bench/tried.md`).
pub(super) const TRIED: &str = include_str!("tried.md");

/// The page for a run whose report is `blocks`; `quick` for a `--quick` run,
/// which the title says (the report's first line says it too).
pub(super) fn markdown(blocks: &[Block], quick: bool) -> String {
    let mut md = format!(
        "# podlink benchmarks{}\n\n",
        if quick { " (quick run)" } else { "" }
    );
    md += "Written by `cargo xtask bench --markdown FILE`: podlink against the direct path, \
           measured in one run on the two-node test bed (see `xtask/src/bench.rs` for how \
           each figure is measured).\n";
    let mut in_list = false;
    for block in blocks {
        let item = matches!(block, Block::Item(_));
        if !(item && in_list) {
            paragraph(&mut md);
        }
        in_list = item;
        match block {
            Block::Line(line) => {
                md += line;
                md.push('\n');
            }
            Block::Item(entry) => {
                md += "* ";
                md += entry;
                md.push('\n');
            }
            Block::Table { header, rows } => {
                md += &table_row(header, header.len());
                md += &table_row(&vec!["---".to_string(); header.len()], header.len());
                for row in rows {
                    md += &table_row(row, header.len());
                }
            }
            Block::Break => {}
        }
    }
    paragraph(&mut md);
    md += "## Tried and not kept\n\n";
    md += "Each line: the idea, its measured effect, why it was dropped.\n\n";
    md += TRIED.trim();
    md.push('\n');
    md
}

/// Ends the paragraph `md` ends with: an empty line after it.
fn paragraph(md: &mut String) {
    while !md.ends_with("\n\n") {
        md.push('\n');
    }
}

/// A table row of `width` cells (`cells`, then empty ones), `|` escaped.
fn table_row(cells: &[String], width: usize) -> String {
    let mut line = String::from("|");
    for i in 0..width {
        let cell = cells.get(i).map_or("", String::as_str);
        line += &format!(" {} |", cell.replace('|', "\\|"));
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{
        Path2, Settings,
        api_watch::ApiWatch,
        connections::{Churn, ClientRun, OneClientPhases, Phases},
        ebpf::{Cost, EbpfByWorkload, ProgCounters, WorkloadCounters},
        efficiency::{EfficiencyRuns, efficiency_rows},
        enrollment::Enrollment,
        machine::Machine,
        main_table::{Series, main_rows},
        memory::Memory,
        print::report_blocks,
        report::{Report, Timings},
        scaling::{Scaling, ScalingRun},
        xds_watch::XdsWatch,
    };

    /// Samples of a figure: `reps` values per path, podlink's a fraction of
    /// the direct path's.
    fn series(reps: usize, direct: f64) -> Series {
        let mut s = Series::default();
        for i in 0..reps {
            let v = direct + i as f64;
            s.push(Path2::Direct, v, 0.0);
            s.push_costed(
                Path2::Podlink,
                v * 0.4,
                Cost {
                    cpu: 1.5 + i as f64 / 10.0,
                    ebpf: 0.1,
                },
            );
        }
        s
    }

    fn client_run(per_second: Vec<u64>) -> ClientRun {
        ClientRun {
            completed: per_second.iter().sum(),
            seconds: per_second.len() as f64,
            per_second,
            failed: 0,
            phases: None,
        }
    }

    /// A report as a run with `s`'s settings could make, fewer pods enrolled
    /// than the largest enrollment figure asks for.
    fn synthetic(s: Settings) -> Report {
        let reps = s.repetitions;
        let machine = Machine {
            cores: 2,
            cpu_model: "Example CPU 9000".into(),
            kernel: "6.18.44-example".into(),
            load_average_at_start: "0.10 0.20 0.30".into(),
            load_average_at_end: "9.10 8.20 7.30".into(),
            cpu_idle: "cpuidle haltpoll/haltpoll, guest_halt_poll_ns=0".into(),
        };
        let churn = Churn {
            direct: client_run(vec![5_000; 20]),
            podlink: client_run((0..20).map(|i| 3_000 + i * 10).collect()),
            podlink_agent_cpu_seconds: 40.0,
        };
        let memory = Memory {
            idle_kib: vec![9_000, 8_500],
            throughput_max_kib: vec![17_000, 16_000],
        };
        let ebpf: Vec<ProgCounters> = ["from_pod", "to_pod"]
            .iter()
            .enumerate()
            .map(|(i, name)| ProgCounters {
                name: name.to_string(),
                id: i as u64 + 1,
                node: 0,
                run_time_ns: 300_000 * (i as u64 + 1),
                run_cnt: 1_000,
            })
            .collect();
        let enrolled = s.enrollment_total() - 1;
        let enrollment = Enrollment {
            pods_created: s.enrollment_total(),
            creation_seconds: 30.0,
            per_pod_ms: (0..enrolled).map(|i| 1.0 + i as f64 / 100.0).collect(),
            cumulative_seconds: (1..=enrolled).map(|i| i as f64 * 0.01).collect(),
            timed_out_at: Some(enrolled),
            missing_map_entries: 0,
            agent_cpu_seconds: 2.0,
        };
        let runs = s
            .scaling_pairs
            .iter()
            .flat_map(|&pairs| {
                [(Path2::Direct, 25.0), (Path2::Podlink, 3.0)].map(|(path, gbps)| ScalingRun {
                    pairs,
                    path,
                    throughput_gbps: gbps,
                    throughput_failures: 0,
                    throughput_first_exit_seconds: 5.1,
                    throughput_last_exit_seconds: 6.2,
                    throughput_agent_cpu_seconds: 4.0,
                    connections_per_second: 1_000.0 * pairs as f64,
                    connection_failures: 0,
                    connections_agent_cpu_seconds: 2.0,
                })
            })
            .collect();
        let phases = Phases {
            connect_us: 60.0,
            greeting_us: 120.0,
            echo_close_us: 90.0,
            total_us: 270.0,
        };
        let rows = main_rows(
            &s,
            [
                &series(reps, 12.0),
                &series(reps, 11.0),
                &series(reps, 28.0),
            ],
            &[0, 1, 2, 3].map(|i| series(reps, 80.0 + 10.0 * i as f64)),
            [&series(reps, 3_000.0), &series(reps, 5_000.0)],
            &churn,
            &memory,
            &ebpf,
            &enrollment,
        );
        let efficiency = efficiency_rows(&EfficiencyRuns {
            throughput_seconds: s.throughput_seconds as f64,
            connect_seconds: s.connect_seconds,
            throughput: [&series(reps, 12.0), &series(reps, 28.0)],
            connections: [&series(reps, 3_000.0), &series(reps, 5_000.0)],
            round_trips: [&series(reps, 80.0), &series(reps, 100.0)],
            fixed_rate: &series(reps, 1_000.0),
        });
        Report {
            machine,
            rows,
            efficiency,
            churn,
            memory,
            ebpf,
            ebpf_by_workload: EbpfByWorkload {
                runs: vec![WorkloadCounters {
                    workload: "churn".into(),
                    program: "from_pod".into(),
                    run_time_ns: 500_000,
                    run_cnt: 2_000,
                }],
            },
            one_client_phases: OneClientPhases::new([vec![phases], vec![phases]]),
            scaling: Scaling {
                pairs_setup_seconds: 12.0,
                runs,
                enrollment: s
                    .scaling_pods
                    .iter()
                    .filter_map(|n| enrollment.summary(*n))
                    .collect(),
            },
            enrollment,
            api_watch: ApiWatch {
                pods: 5_000,
                local_pods: 100,
                services: 1_000,
                policies: 500,
                first_view_seconds: 3.0,
                idle_rss_kib: 40_000,
                max_rss_kib: 42_000,
                change_ms: (0..10)
                    .map(|i| ("service".to_string(), 5.0 + i as f64))
                    .collect(),
                scrape_p50_ms: 0.5,
                idle_rss_anon_kib: 30_000,
                reconcile_p50_us: [1_000.0, 200.0, 300.0, 10.0],
            },
            xds_watch: XdsWatch {
                workloads: 5_000,
                local_pods: 100,
                services: 1_000,
                policies: 500,
                ready_seconds: 3.5,
                idle_rss_kib: 36_000,
                idle_rss_anon_kib: 24_000,
                max_rss_kib: 38_000,
                change_ms: (0..9)
                    .map(|i| {
                        let kind = ["service", "workload", "policy"][i % 3];
                        (kind.to_string(), 30.0 + i as f64)
                    })
                    .collect(),
                ack_ms: (0..9).map(|i| 10.0 + i as f64).collect(),
                scrape_p50_ms: 7.0,
                reconcile_p50_us: [12_000.0, 40.0, 1_500.0, 4_000.0],
            },
            timings: Timings::default(),
            settings: s,
        }
    }

    /// The cells of a Markdown table row (`|` escaped in a cell is not a
    /// separator).
    fn cells(line: &str) -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        let mut out = vec![String::new()];
        let mut chars = inner.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' if chars.peek() == Some(&'|') => {
                    chars.next();
                    out.last_mut().unwrap().push('|');
                }
                '|' => out.push(String::new()),
                c => out.last_mut().unwrap().push(c),
            }
        }
        out.into_iter().map(|c| c.trim().to_string()).collect()
    }

    #[test]
    fn the_page_holds_the_machine_every_row_and_what_was_tried() {
        for quick in [false, true] {
            let report = synthetic(Settings::new(quick, None));
            let md = markdown(&report_blocks(&report), quick);
            let lines: Vec<&str> = md.lines().collect();

            assert!(lines[0].starts_with("# "), "{md}");
            assert_eq!(lines[0].contains("quick run"), quick, "{}", lines[0]);
            assert_eq!(md.contains("QUICK RUN (--quick)"), quick);
            let m = &report.machine;
            for told in [
                &m.cpu_model,
                &m.kernel,
                &m.cpu_idle,
                &m.load_average_at_start,
                &m.load_average_at_end,
            ] {
                assert!(md.contains(told.as_str()), "{told} missing:\n{md}");
            }

            // Every table: a header, its separator, rows as wide as the header
            // (the enrollment figure not reached included).
            let mut tables: Vec<Vec<Vec<String>>> = Vec::new();
            let mut previous_was_table = false;
            for line in &lines {
                let is_table = line.starts_with('|');
                if is_table && !previous_was_table {
                    tables.push(Vec::new());
                }
                if is_table {
                    tables.last_mut().unwrap().push(cells(line));
                }
                previous_was_table = is_table;
            }
            for table in &tables {
                assert!(table[1].iter().all(|c| c == "---"), "{table:?}");
                assert!(table.iter().all(|r| r.len() == table[0].len()), "{table:?}");
            }

            // The main table: one row per figure, with its target and verdict.
            let main = &tables[0];
            assert_eq!(main.len() - 2, report.rows.len(), "{md}");
            for (row, cells) in report.rows.iter().zip(&main[2..]) {
                assert!(cells[0].starts_with(&row.figure), "{cells:?}");
                assert!(cells.contains(&row.target), "{cells:?}");
                let verdict = match row.met {
                    Some(true) => "ok",
                    Some(false) => "MISSED",
                    None => "-",
                };
                assert!(cells.contains(&verdict.to_string()), "{cells:?}");
            }
            let scaling = tables
                .iter()
                .find(|t| t[0][0] == "pairs")
                .expect("a scaling table");
            assert_eq!(scaling.len() - 2, report.settings.scaling_pairs.len());
            let enrollment = tables
                .iter()
                .find(|t| t[0][0] == "pods")
                .expect("an enrollment table");
            assert_eq!(enrollment.len() - 2, report.settings.scaling_pods.len());
            // The cluster-scale tables: the Kubernetes API's, then istiod's.
            let scale: Vec<_> = tables
                .iter()
                .filter(|t| t[0] == ["figure", "podlink", "aim", "met"])
                .collect();
            assert_eq!(scale.len(), 2, "{md}");
            assert!(scale[0][2][0].starts_with("change at the API"), "{md}");
            assert!(
                scale[1][2][0].starts_with("push to the agent's view"),
                "{md}"
            );
            assert!(md.contains("istiod at cluster scale"), "{md}");

            // After the tables, every idea tried, in order.
            let tried = md
                .find("\n## Tried and not kept\n")
                .expect("a tried section");
            let mut at = tried;
            for idea in TRIED.lines().filter(|l| !l.trim().is_empty()) {
                at += md[at..]
                    .find(idea)
                    .unwrap_or_else(|| panic!("{idea} missing"));
            }
            assert!(
                !md[tried..].contains("\n|"),
                "no table after the ideas tried"
            );
        }
    }

    #[test]
    fn cells_are_escaped_and_short_rows_filled() {
        let md = markdown(
            &[Block::Table {
                header: vec!["a".into(), "b".into(), "c".into()],
                rows: vec![vec!["x | y".into()]],
            }],
            false,
        );
        let row = md
            .lines()
            .find(|l| l.contains("x \\| y"))
            .expect("the escaped cell");
        assert_eq!(cells(row), ["x | y", "", ""]);
    }

    #[test]
    fn each_idea_tried_is_one_item_of_idea_effect_and_why() {
        let ideas: Vec<&str> = TRIED.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!ideas.is_empty());
        for idea in ideas {
            assert!(idea.starts_with("* "), "{idea}");
            assert!(idea.matches(" — ").count() >= 2, "{idea}");
        }
    }
}
