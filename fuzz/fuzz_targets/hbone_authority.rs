//! A CONNECT request's `:authority` as the HBONE server reads it
//! (`hbone::parse_authority`); what parses is written back by the client's
//! `hbone::authority` and parses to the same destination.
#![no_main]

use libfuzzer_sys::fuzz_target;
use podlink_agent::proxy::hbone::{authority, parse_authority};

fuzz_target!(|data: &str| {
    if let Ok(dst) = parse_authority(data) {
        assert_ne!(dst.port(), 0, "{data:?}");
        let written = authority(dst);
        assert_eq!(
            parse_authority(&written),
            Ok(dst),
            "{data:?} -> {written:?}"
        );
    }
});
