//! The CNI socket protocol: a request line as the agent reads it from the
//! plugin, and a reply line as the plugin reads it from the agent
//! (`cni::protocol`). What parses is written back and parses the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use podlink_agent::cni::protocol::{Reply, Request};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = Request::parse(data) {
        let line = serde_json::to_vec(&request).expect("a request serializes");
        assert_eq!(Request::parse(&line).ok(), Some(request));
    }
    if let Ok(reply) = Reply::parse(data) {
        let line = reply.to_line();
        assert_eq!(Reply::parse(line.as_bytes()).ok(), Some(reply), "{line}");
    }
});
