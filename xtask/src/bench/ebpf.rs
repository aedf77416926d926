//! eBPF program cost: `kernel.bpf_stats_enabled` while the bench measures, and
//! the counters of the programs the bed's link pins use, over the whole run and
//! by kind of run.

use std::{fs, process::Command, sync::Mutex};

use anyhow::{Context, Result};
use podlink_tests::{Cluster, Pod, netns};
use serde::Serialize;
use serde_json::Value;

use super::{PROGRAMS, Path2, agents::agents_cpu, bed::link_pins, stats::num};

pub(super) const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

// eBPF program statistics

/// The value of `kernel.bpf_stats_enabled` to restore, while the bench has it on.
pub(super) static BPF_STATS_PREVIOUS: Mutex<Option<String>> = Mutex::new(None);

/// `kernel.bpf_stats_enabled=1` while alive; the previous value comes back on drop
/// (and from the Ctrl-C handler, through [`restore_bpf_stats`]).
pub(super) struct BpfStatsOn;

impl BpfStatsOn {
    pub(super) fn enable() -> Result<Self> {
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

pub(super) fn restore_bpf_stats() {
    if let Some(previous) = BPF_STATS_PREVIOUS.lock().unwrap().take() {
        let _ = fs::write(BPF_STATS_SYSCTL, previous);
    }
}

/// One loaded program's counters.
#[derive(Clone, Debug, Serialize)]
pub(super) struct ProgCounters {
    pub(super) name: String,
    pub(super) id: u64,
    pub(super) node: usize,
    pub(super) run_time_ns: u64,
    pub(super) run_cnt: u64,
}

/// The counters of the podlink programs the bed's link pins use (one instance of
/// each program per node agent), found by name in `bpftool prog show`.
pub(super) fn program_counters(c: &Cluster, pods: [&Pod; 2]) -> Result<Vec<ProgCounters>> {
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
pub(super) struct EbpfByWorkload {
    /// Per kind of run and program, summed over nodes and runs.
    pub(super) runs: Vec<WorkloadCounters>,
}

#[derive(Debug, Serialize)]
pub(super) struct WorkloadCounters {
    pub(super) workload: String,
    pub(super) program: String,
    pub(super) run_time_ns: u64,
    pub(super) run_cnt: u64,
}

impl EbpfByWorkload {
    /// Runs `run`; for a podlink run, adds the change of the counters of the
    /// programs `pods` use over it to `workload` (the direct path runs none).
    /// Gives `run`'s value and the programs' seconds over it (all programs and
    /// nodes; 0 for the direct path).
    pub(super) fn measure<T>(
        &mut self,
        c: &Cluster,
        pods: [&Pod; 2],
        workload: &str,
        path: Path2,
        run: impl FnOnce() -> Result<T>,
    ) -> Result<(T, f64)> {
        if path != Path2::Podlink {
            return Ok((run()?, 0.0));
        }
        let before = program_counters(c, pods)?;
        let value = run()?;
        let after = program_counters(c, pods)?;
        let delta = counters_delta(&before, &after);
        let seconds = delta.iter().map(|d| d.run_time_ns as f64 / 1e9).sum();
        for d in delta {
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
        Ok((value, seconds))
    }

    /// [`EbpfByWorkload::measure`], also giving what the run cost: both
    /// agents' CPU seconds and (for a podlink run) the programs' seconds.
    pub(super) fn measure_cost<T>(
        &mut self,
        c: &Cluster,
        pods: [&Pod; 2],
        workload: &str,
        path: Path2,
        run: impl FnOnce() -> Result<T>,
    ) -> Result<(T, Cost)> {
        let cpu = agents_cpu(c);
        let (value, ebpf) = self.measure(c, pods, workload, path, run)?;
        let cost = Cost {
            cpu: agents_cpu(c) - cpu,
            ebpf,
        };
        Ok((value, cost))
    }

    /// "workload: from_pod N ns (runs), to_pod N ns (runs)" lines.
    pub(super) fn lines(&self) -> Vec<String> {
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

/// What a run cost (s): both agents' CPU, and the eBPF programs' time (0
/// for the direct path, which runs none).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Cost {
    pub(super) cpu: f64,
    pub(super) ebpf: f64,
}

/// The counters' change from `before` to `after`.
pub(super) fn counters_delta(before: &[ProgCounters], after: &[ProgCounters]) -> Vec<ProgCounters> {
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
