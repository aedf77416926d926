//! The CNI plugin's input: its environment (`CNI_COMMAND`, `CNI_ARGS`, ...) and
//! its stdin (the network configuration with `prevResult`), as the container
//! runtime gives them (`cni::plugin::run_with`).
//!
//! The input is the environment as `NAME=value` lines, an empty line, then
//! stdin. No socket is touched: the agent's part is played here, and every
//! request the plugin would send must be one the agent reads
//! (`protocol::Request::parse`).
#![no_main]

use std::{collections::HashMap, path::Path};

use libfuzzer_sys::fuzz_target;
use podlink_agent::cni::{
    plugin::{AgentUnreachable, run_with},
    protocol::{Command, Reply, Request},
};

fuzz_target!(|data: &[u8]| {
    let (head, stdin) = match data.windows(2).position(|w| w == b"\n\n") {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let env: HashMap<String, String> = String::from_utf8_lossy(head)
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();
    let agent = |_: &Path, line: &[u8]| -> Result<Reply, AgentUnreachable> {
        let line = line.strip_suffix(b"\n").expect("a request is a line");
        let request = Request::parse(line).unwrap_or_else(|e| {
            panic!(
                "the agent refuses the plugin's request {}: {e}",
                String::from_utf8_lossy(line)
            )
        });
        Ok(match request.command {
            Command::Add | Command::Check => Reply::Enrolled {
                interface: request.host_interface.unwrap_or_default(),
            },
            Command::Del => Reply::Removed,
        })
    };
    let _ = run_with(&|name| env.get(name).cloned(), stdin, &agent);
});
