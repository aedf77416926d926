//! Agent memory: the agents' VmRSS, read once (idle) or sampled every 100 ms
//! (during the throughput runs).

use std::{
    fs,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use serde::Serialize;

/// A field of `/proc/PID/status` (`VmRSS:`, `RssAnon:`), KiB (0 once the
/// process is gone).
pub(super) fn status_kib(pid: u32, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// VmRSS of a process, KiB (0 once it is gone).
pub(super) fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// Samples the agents' VmRSS every 100 ms until stopped; keeps each one's maximum.
pub(super) struct RssSampler {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: JoinHandle<Vec<u64>>,
}

impl RssSampler {
    pub(super) fn start(pids: Vec<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut max = vec![0; pids.len()];
                loop {
                    for (m, pid) in max.iter_mut().zip(&pids) {
                        *m = (*m).max(rss_kib(*pid));
                    }
                    if stop.load(Ordering::Relaxed) {
                        return max;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        Self { stop, thread }
    }

    pub(super) fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

#[derive(Serialize)]
pub(super) struct Memory {
    /// VmRSS (KiB) of the agents of node 1 and node 2 after the bed settled.
    pub(super) idle_kib: Vec<u64>,
    /// Their largest VmRSS (KiB) sampled during the podlink throughput runs.
    pub(super) throughput_max_kib: Vec<u64>,
}
