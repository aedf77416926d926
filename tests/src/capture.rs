//! Packet captures with `tcpdump`, to show what crosses a wire.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::netns::{self, Resource, register, run};

/// A packet capture (`tcpdump`) on an interface of a namespace.
pub struct Capture {
    child: Child,
    file: PathBuf,
}

impl Capture {
    /// Starts capturing TCP on `iface` in `netns` into a file under `dir`.
    pub fn start(netns_name: &str, iface: &str, dir: &Path, name: &str) -> Result<Self> {
        let file = dir.join(format!("{name}.pcap"));
        let err = dir.join(format!("{name}.tcpdump.log"));
        let mut child = netns::command_in(netns_name, "tcpdump")
            .args([
                "-i",
                iface,
                "-nn",
                "-U",
                "--immediate-mode",
                "-s",
                "0",
                "-w",
            ])
            .arg(&file)
            .arg("tcp")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&err)?)
            .spawn()
            .context("starting tcpdump")?;
        register(Resource::Process(child.id()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !fs::read_to_string(&err)
            .unwrap_or_default()
            .contains("listening on")
        {
            if let Some(status) = child.try_wait()? {
                bail!("tcpdump exited ({status}): {}", fs::read_to_string(&err)?);
            }
            if Instant::now() > deadline {
                bail!("tcpdump did not start");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self { child, file })
    }

    /// Stops the capture; returns the raw file contents and tcpdump's one-line
    /// summaries, one line a packet, without timestamps (`-t`): a time such as
    /// `40.150084` would otherwise match a search for `.15008`.
    pub fn stop(mut self) -> Result<(Vec<u8>, Vec<String>)> {
        // A moment for the last packets to be written.
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        netns::unregister(&Resource::Process(self.child.id()));
        let raw = fs::read(&self.file)?;
        let out = run(Command::new("tcpdump")
            .args(["-nn", "-t", "-r"])
            .arg(&self.file))?;
        let lines = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        Ok((raw, lines))
    }
}

/// Whether `needle` occurs in `haystack`.
pub fn contains_bytes(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// How many connections tcpdump's summary `lines` show opened to `ip`, port
/// `port` (SYNs to `10.244.2.2.15008`, `fd00:10:244:2::2.15008`: tcpdump prints
/// an endpoint as `address.port` in both families).
pub fn syns_to(lines: &[String], ip: std::net::IpAddr, port: u16) -> usize {
    let needle = format!("> {ip}.{port}: Flags [S]");
    lines.iter().filter(|l| l.contains(&needle)).count()
}

/// Whether tcpdump's summary `lines` show a packet from `ip` (any port): `ip`
/// as the source, before the line's ` > ` (`IP 10.244.1.2.51946 > …`), not as
/// the destination.
pub fn any_from(lines: &[String], ip: std::net::IpAddr) -> bool {
    let needle = format!(" {ip}.");
    lines.iter().any(|l| {
        l.split_once(" > ")
            .is_some_and(|(src, _)| src.contains(&needle))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packet_is_from_its_source_only() {
        let to_client =
            "IP 10.244.2.2.15008 > 10.244.1.2.51946: Flags [FP.], length 63".to_string();
        let from_client = "IP 10.244.1.2.51946 > 10.244.2.2.8000: Flags [S], length 0".to_string();
        let client = "10.244.1.2".parse().unwrap();
        assert!(!any_from(std::slice::from_ref(&to_client), client));
        assert!(any_from(&[to_client, from_client], client));
        let v6 = "IP6 fd00:10:244:1::2.40000 > fd00:10:244:2::2.8000: Flags [S]".to_string();
        assert!(any_from(
            std::slice::from_ref(&v6),
            "fd00:10:244:1::2".parse().unwrap()
        ));
        assert!(!any_from(&[v6], "fd00:10:244:2::2".parse().unwrap()));
        assert!(!any_from(&["garbage".to_string()], client));
    }
}
