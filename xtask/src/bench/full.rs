//! The full bench: the bed, the main table's repetitions, the churn, the
//! scaling table and the enrollment, in that order, then on beds of their own
//! the agent at cluster scale fed by the Kubernetes API and by istiod, then
//! the report.

use std::{
    fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use podlink_tests::{Family, netns};

use super::{
    ECHO_PORT, MANY_CLIENTS, Path2, Settings,
    agents::{agent_pids, agents_cpu},
    api_watch::api_watch,
    bed::build_bed,
    connections::{Churn, OneClientPhases, Phases, run_clients},
    dns,
    ebpf::{BpfStatsOn, EbpfByWorkload, counters_delta, program_counters},
    efficiency::{EfficiencyRuns, efficiency_rows},
    enrollment::enrollment,
    machine::{load_average, machine},
    main_table::{Series, fixed_rate_row, main_rows},
    markdown,
    memory::{Memory, RssSampler, rss_kib},
    print::{print_report, report_blocks},
    report::{Report, Timings},
    round_trips::{FIXED_RATE, FIXED_RATE_CONNECTIONS, FIXED_RATE_SECONDS, fixed_rate, latency},
    scaling::{Scaling, scaling},
    throughput::throughput,
    xds_watch::xds_watch,
};

pub(super) fn bench(s: Settings, json: Option<&Path>, markdown: Option<&Path>) -> Result<()> {
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
    let mut t1v6 = Series::default();
    let mut t4 = Series::default();
    let mut rr = [(); 4].map(|_| Series::default()); // 1 B p50, p99, 1 KiB p50, p99
    let mut one_client_phases: [Vec<Phases>; 2] = Default::default();
    let mut c1 = Series::default();
    let mut c16 = Series::default();
    let mut rate = Series::default();
    let mut rate_latency = Series::default();
    let mut dns_own = Series::default();
    let mut dns_forwarded = Series::default();
    let dns_queries = s.round_trips / 5;
    for rep in 0..s.repetitions {
        eprintln!("bench: repetition {}/{}", rep + 1, s.repetitions);
        let order = Path2::order(rep);
        let pids = agent_pids(&bed.cluster);
        for (series, streams, family) in [
            (&mut t1, 1, Family::V4),
            (&mut t1v6, 1, Family::V6),
            (&mut t4, 4, Family::V4),
        ] {
            for path in order {
                let (client, server) = bed.pair(path);
                let sampler = (path == Path2::Podlink).then(|| RssSampler::start(pids.clone()));
                let workload = match (streams, family) {
                    (1, Family::V4) => "single-stream throughput",
                    (1, Family::V6) => "single-stream throughput, IPv6",
                    _ => "4-stream throughput",
                };
                let (v, cost) = ebpf_by_workload.measure_cost(
                    &bed.cluster,
                    prog_pods,
                    workload,
                    path,
                    || throughput(client, server.ip_of(family), s.throughput_seconds, streams),
                )?;
                series.push_costed(path, v, cost);
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
                let ([p50, p99], cost) = ebpf_by_workload.measure_cost(
                    &bed.cluster,
                    prog_pods,
                    "request/response",
                    path,
                    || latency(client, server.addr(ECHO_PORT), size, s.round_trips),
                )?;
                rr[2 * i].push(path, p50, cost.cpu);
                rr[2 * i + 1].push(path, p99, cost.cpu);
            }
        }
        for (series, clients) in [(&mut c1, 1), (&mut c16, MANY_CLIENTS)] {
            for path in order {
                let (client, server) = bed.pair(path);
                let (run, cost) = ebpf_by_workload.measure_cost(
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
                series.push_costed(path, run.rate(), cost);
                if let Some(phases) = run.phases {
                    one_client_phases[path as usize].push(phases);
                }
            }
        }
        for path in order {
            let (client, server) = bed.pair(path);
            let (run, cost) = ebpf_by_workload.measure_cost(
                &bed.cluster,
                prog_pods,
                "fixed request rate",
                path,
                || {
                    fixed_rate(
                        client,
                        server.addr(ECHO_PORT),
                        FIXED_RATE,
                        FIXED_RATE_CONNECTIONS,
                        FIXED_RATE_SECONDS,
                    )
                },
            )?;
            rate.push_costed(path, run.rate(), cost);
            rate_latency.push(path, run.p50_us, cost.cpu);
        }
        for path in order {
            let client = &bed.pair(path).0;
            let cpu = agents_cpu(&bed.cluster);
            let v = dns::own_names_rate(client, bed.resolver_ip(), s.connect_seconds)?;
            dns_own.push(path, v, agents_cpu(&bed.cluster) - cpu);
            let cpu = agents_cpu(&bed.cluster);
            let v = dns::forwarded_latency(client, bed.resolver_ip(), dns_queries)?;
            dns_forwarded.push(path, v, agents_cpu(&bed.cluster) - cpu);
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
    let (podlink_churn, _) =
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
    let mut rows = main_rows(
        &s,
        [&t1, &t1v6, &t4],
        &rr,
        [&c1, &c16],
        &churn,
        &memory,
        &ebpf,
        &enrollment,
    );
    let efficiency = efficiency_rows(&EfficiencyRuns {
        throughput_seconds: s.throughput_seconds as f64,
        connect_seconds: s.connect_seconds,
        throughput: [&t1, &t4],
        connections: [&c1, &c16],
        round_trips: [&rr[0], &rr[2]],
        fixed_rate: &rate,
    });
    rows.push(fixed_rate_row(&rate_latency));
    rows.extend(dns::rows(
        &dns_own,
        &dns_forwarded,
        s.connect_seconds,
        dns_queries,
    ));

    eprintln!("bench: removing the test bed");
    let t = Instant::now();
    drop(bed);
    netns::cleanup();
    timings.cleanup_seconds = t.elapsed().as_secs_f64();

    // On a bed of its own, with the two-node bed gone.
    eprintln!("bench: the agent watching the Kubernetes API at cluster scale");
    let t = Instant::now();
    let api_watch = api_watch()?;
    timings.api_watch_seconds = t.elapsed().as_secs_f64();
    netns::cleanup();
    eprintln!("bench: the agent fed by istiod at cluster scale");
    let t = Instant::now();
    let xds_watch = xds_watch(None)?;
    timings.xds_watch_seconds = t.elapsed().as_secs_f64();
    machine.load_average_at_end = load_average();
    netns::cleanup();
    timings.total_seconds = started.elapsed().as_secs_f64();

    let report = Report {
        machine,
        settings: s,
        rows,
        efficiency,
        churn,
        memory,
        ebpf,
        ebpf_by_workload,
        one_client_phases: OneClientPhases::new(one_client_phases),
        enrollment,
        scaling,
        api_watch,
        xds_watch,
        timings,
    };
    print_report(&report);
    if let Some(path) = json {
        fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    if let Some(path) = markdown {
        let page = markdown::markdown(&report_blocks(&report), report.settings.quick);
        // The last soak's section stays (`--soak` writes it).
        let old = fs::read_to_string(path).unwrap_or_default();
        let page = match super::soak::existing_section(&old) {
            Some(soak) => super::soak::replace_section(&page, soak),
            None => page,
        };
        fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}
