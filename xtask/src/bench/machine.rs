//! The machine header: cores, CPU model, kernel, idle policy and load average.

use std::fs;

use serde::Serialize;

#[derive(Serialize)]
pub(super) struct Machine {
    pub(super) cores: usize,
    pub(super) cpu_model: String,
    pub(super) kernel: String,
    /// /proc/loadavg when the bench started and when its measurements ended (the
    /// machine may be shared).
    pub(super) load_average_at_start: String,
    pub(super) load_average_at_end: String,
    /// How an idle CPU waits: the cpuidle driver and governor, and the guest
    /// halt-polling window of the `haltpoll` driver in ns, e.g. "cpuidle
    /// haltpoll/haltpoll, guest_halt_poll_ns=0" (empty where sysfs has neither).
    /// On a virtual machine a vCPU that halts at once is woken by an interrupt
    /// through the host, so the setting moves every figure whose threads sleep
    /// between events (kernel Documentation/virt/guest-halt-polling.rst).
    pub(super) cpu_idle: String,
}

/// The 1, 5 and 15 minute load averages.
pub(super) fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn machine() -> Machine {
    let cpu_model = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_string())
        .unwrap_or_default();
    Machine {
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model,
        kernel,
        load_average_at_start: load_average(),
        load_average_at_end: String::new(),
        cpu_idle: cpu_idle(),
    }
}

/// The idle policy for [`Machine::cpu_idle`], read from sysfs.
pub(super) fn cpu_idle() -> String {
    cpu_idle_from(|p| fs::read_to_string(p).map(|v| v.trim().to_string()).ok())
}

/// [`cpu_idle`] with `read` for sysfs (a file's trimmed contents, `None` where
/// it cannot be read).
pub(super) fn cpu_idle_from(read: impl Fn(&str) -> Option<String>) -> String {
    let mut parts = Vec::new();
    if let Some(driver) = read("/sys/devices/system/cpu/cpuidle/current_driver") {
        let governor = read("/sys/devices/system/cpu/cpuidle/current_governor")
            .or_else(|| read("/sys/devices/system/cpu/cpuidle/current_governor_ro"))
            .unwrap_or_default();
        parts.push(format!("cpuidle {driver}/{governor}"));
    }
    if let Some(ns) = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        parts.push(format!("guest_halt_poll_ns={ns}"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn cpu_idle_names_driver_governor_and_polling() {
        let haltpoll = |p: &str| {
            Some(
                match p.rsplit('/').next()? {
                    "current_driver" => "haltpoll",
                    "current_governor" => "haltpoll",
                    "guest_halt_poll_ns" => "0",
                    _ => return None,
                }
                .to_string(),
            )
        };
        assert_eq!(
            cpu_idle_from(haltpoll),
            "cpuidle haltpoll/haltpoll, guest_halt_poll_ns=0"
        );
        // An older kernel names the governor only in the read-only file, and
        // without the haltpoll module there is no polling window.
        let acpi = |p: &str| {
            Some(
                match p.rsplit('/').next()? {
                    "current_driver" => "acpi_idle",
                    "current_governor_ro" => "menu",
                    _ => return None,
                }
                .to_string(),
            )
        };
        assert_eq!(cpu_idle_from(acpi), "cpuidle acpi_idle/menu");
        assert_eq!(cpu_idle_from(|_| None), "");
    }
}
