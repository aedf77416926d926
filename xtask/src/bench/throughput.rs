//! Throughput: iperf3 runs of one pair, and single-stream runs on many pairs
//! started together (the scaling table).

use std::{
    fs,
    io::Write,
    net::IpAddr,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{Pod, netns};
use serde_json::Value;

use super::{IPERF_PORT, agents::proc_stat};

/// An iperf3 client in `client`'s namespace, to the server pod's address
/// `server` (either family: the servers listen on both).
pub(super) fn iperf3_command(
    client: &Pod,
    server: IpAddr,
    seconds: u32,
    streams: usize,
) -> Command {
    let mut cmd = netns::command_in(&client.netns, "iperf3");
    cmd.args(iperf3_args(server, seconds, streams));
    cmd
}

pub(super) fn iperf3_args(server: IpAddr, seconds: u32, streams: usize) -> Vec<String> {
    [
        "-c",
        &server.to_string(),
        "-p",
        &IPERF_PORT.to_string(),
        "-t",
        &seconds.to_string(),
        "-P",
        &streams.to_string(),
        "--connect-timeout",
        "5000",
        "-J",
    ]
    .map(String::from)
    .to_vec()
}

/// Bits per second received, from iperf3's JSON (all streams summed).
pub(super) fn iperf3_received(stdout: &[u8]) -> Result<f64> {
    let v: Value = serde_json::from_slice(stdout)
        .with_context(|| format!("iperf3 output: {}", String::from_utf8_lossy(stdout)))?;
    if let Some(e) = v.get("error") {
        bail!("iperf3: {e}");
    }
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 reported no throughput")
}

/// One iperf3 run of `streams` streams to the server pod's address `server`:
/// Gbit/s received.
pub(super) fn throughput(
    client: &Pod,
    server: IpAddr,
    seconds: u32,
    streams: usize,
) -> Result<f64> {
    let out = iperf3_command(client, server, seconds, streams).output()?;
    Ok(iperf3_received(&out.stdout)? / 1e9)
}

/// What [`throughput_concurrent`] measured.
pub(super) struct Concurrent {
    /// The sum of what each run received (Gbit/s).
    pub(super) gbps: f64,
    pub(super) failures: usize,
    /// From the runs' start to the first and the last exit of those that
    /// measured something (s; 0 if none did).
    pub(super) first_exit_seconds: f64,
    pub(super) last_exit_seconds: f64,
}

/// iperf3 single stream on every pair at once, for `seconds`.
///
/// Each client first waits in its pod for a line on its standard input, and the
/// line goes to all of them once every one waits: starting 100 `ip netns exec`
/// processes takes seconds on a loaded machine, and would spread the runs apart
/// so that their rates' sum measured runs that did not overlap. How far the
/// runs' exits lie apart shows how well they did.
pub(super) fn throughput_concurrent(pairs: &[(Pod, Pod)], seconds: u32) -> Result<Concurrent> {
    let mut children = pairs
        .iter()
        .map(|(client, server)| {
            netns::command_in(&client.netns, "sh")
                .args(["-c", r#"read -r _ && exec iperf3 "$@""#, "sh"])
                .args(iperf3_args(IpAddr::V4(server.ip), seconds, 1))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .context("starting iperf3")
        })
        .collect::<Result<Vec<Child>>>()?;
    wait_reading(&mut children)?;
    let start = Instant::now();
    for child in &mut children {
        // A client gone since it waited prints nothing: counted as failed.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"go\n");
        }
    }
    let ends: Vec<(f64, std::io::Result<std::process::Output>)> = std::thread::scope(|scope| {
        let waits: Vec<_> = children
            .into_iter()
            .map(|child| {
                scope.spawn(move || {
                    let out = child.wait_with_output();
                    (start.elapsed().as_secs_f64(), out)
                })
            })
            .collect();
        waits
            .into_iter()
            .map(|w| w.join().expect("waiting for iperf3 panicked"))
            .collect()
    });
    let mut c = Concurrent {
        gbps: 0.0,
        failures: 0,
        first_exit_seconds: f64::INFINITY,
        last_exit_seconds: 0.0,
    };
    // The exits of the runs that measured something: a failed one may have
    // ended at once.
    for (exit, out) in ends {
        match iperf3_received(&out?.stdout) {
            Ok(bps) => {
                c.gbps += bps / 1e9;
                c.first_exit_seconds = c.first_exit_seconds.min(exit);
                c.last_exit_seconds = c.last_exit_seconds.max(exit);
            }
            Err(e) => {
                c.failures += 1;
                eprintln!("bench: {e:#}");
            }
        }
    }
    if c.first_exit_seconds.is_infinite() {
        c.first_exit_seconds = 0.0;
    }
    Ok(c)
}

/// Whether a `/proc/PID/stat` line is a shell's that sleeps.
pub(super) fn is_sleeping_shell(stat: &str) -> bool {
    proc_stat(stat).is_some_and(|(comm, fields)| comm == "sh" && fields.first() == Some(&"S"))
}

/// Waits until every child is the shell of [`throughput_concurrent`], asleep
/// (in its `read`), 60 s at most.
///
/// # Errors
/// A child that exited (its `ip netns exec` failed, say), or one not waiting
/// after 60 s.
pub(super) fn wait_reading(children: &mut [Child]) -> Result<()> {
    let limit = Instant::now() + Duration::from_secs(60);
    for child in children {
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "iperf3 client {} exited before its start: {status}",
                    child.id()
                );
            }
            // Unreadable once it exited: the next try_wait tells how.
            let stat = fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap_or_default();
            if is_sleeping_shell(&stat) {
                break;
            }
            if Instant::now() > limit {
                bail!(
                    "iperf3 client {} was not waiting after 60 s: {stat}",
                    child.id()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn sleeping_shell_read_from_proc_stat() {
        assert!(is_sleeping_shell("4242 (sh) S 4200 4242 1 0 -1"));
        // Still `ip`, or the shell already running iperf3.
        assert!(!is_sleeping_shell("4242 (ip) S 4200 4242 1 0 -1"));
        assert!(!is_sleeping_shell("4242 (iperf3) S 4200 4242 1 0 -1"));
        assert!(!is_sleeping_shell("4242 (sh) R 4200 4242 1 0 -1"));
        // A name with ") S " in it is not taken for a sleeping shell.
        assert!(!is_sleeping_shell("4242 (sh) S (x) R 4200 4242 1 0 -1"));
        assert!(!is_sleeping_shell(""));
    }
}
