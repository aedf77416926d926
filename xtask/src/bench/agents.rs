//! The node agents' processes: their ids and the CPU time they used, from
//! `/proc/<pid>/stat`.

use std::fs;

use podlink_tests::Cluster;

/// utime + stime of a process, seconds.
pub(super) fn cpu_seconds(pid: u32) -> f64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields = proc_stat(&stat).map(|(_, f)| f).unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum::<f64>() / ticks)
        .unwrap_or(0.0)
}

pub(super) fn agent_pids(c: &Cluster) -> Vec<u32> {
    (0..c.nodes.len()).filter_map(|n| c.agent_pid(n)).collect()
}

/// CPU seconds both agents have used so far.
pub(super) fn agents_cpu(c: &Cluster) -> f64 {
    agent_pids(c).into_iter().map(cpu_seconds).sum()
}

/// A `/proc/PID/stat` line ("pid (comm) state ...", proc(5)): the command name
/// and the fields after it, from field 3 (the state). The name may hold spaces
/// and parentheses; the fields follow its last closing parenthesis.
pub(super) fn proc_stat(stat: &str) -> Option<(&str, Vec<&str>)> {
    let (comm, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
    Some((comm, rest.split_whitespace().collect()))
}
