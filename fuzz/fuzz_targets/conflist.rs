//! The conflist editor: a CNI network configuration list as the agent finds it
//! in the CNI configuration directory, with podlink-cni put in
//! (`cni::install::with_plugin`) and taken out (`cni::without_plugin`, as
//! `podlink uninstall` does). Putting it in twice changes nothing more.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use podlink_agent::cni::{install::with_plugin, without_plugin};

fuzz_target!(|data: &str| {
    let socket = Path::new("/var/run/podlink/cni.sock");
    let _ = without_plugin(data);
    if let Ok(Some(added)) = with_plugin(data, socket) {
        assert_eq!(
            with_plugin(&added, socket).ok(),
            Some(None),
            "the plugin is in already: {added}"
        );
        assert!(
            matches!(without_plugin(&added), Ok(Some(_))),
            "the plugin put in can be taken out: {added}"
        );
    }
});
