//! The maps' layouts: what this agent's programs expect of pinned maps it reuses,
//! and the config value it writes.

use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context, Result, bail};
use aya::maps::{MapInfo, MapType};
use podlink_common::{
    CidrKey, Config, FlowKey, MAP_CAPTURED_FLOWS, MAP_CONFIG, MAP_COUNTERS, MAP_EXCLUDED_CIDRS,
    MAP_EXCLUDED_PORTS, MAP_NAMES, MAP_PODS, MAX_CAPTURED_FLOWS, MAX_EXCLUDED_CIDRS,
    MAX_EXCLUDED_PORTS, MAX_NODE_ADDRS, MAX_PODS, PodCounters, PodInfo, ipv4_mapped,
};

/// The layout this agent's programs expect of each map: type, key size, value size,
/// capacity.
fn expected_layout(name: &str) -> Option<(MapType, usize, usize, u32)> {
    Some(match name {
        MAP_PODS => (MapType::Hash, 4, size_of::<PodInfo>(), MAX_PODS),
        MAP_CONFIG => (MapType::Array, 4, size_of::<Config>(), 1),
        MAP_EXCLUDED_CIDRS => (
            MapType::LpmTrie,
            size_of::<CidrKey>(),
            1,
            MAX_EXCLUDED_CIDRS,
        ),
        MAP_EXCLUDED_PORTS => (MapType::Hash, 2, 1, MAX_EXCLUDED_PORTS),
        MAP_COUNTERS => (MapType::PerCpuHash, 4, size_of::<PodCounters>(), MAX_PODS),
        MAP_CAPTURED_FLOWS => (
            MapType::LruHash,
            size_of::<FlowKey>(),
            1,
            MAX_CAPTURED_FLOWS,
        ),
        _ => return None,
    })
}

/// Refuses pinned maps whose layout differs from what the programs expect: reusing
/// them would make the programs read garbage.
/// `pin_dir` is the directory holding the maps: a layout's `v<N>`, or the pin
/// directory itself for the unversioned layout.
pub(super) fn check_pinned_layouts(pin_dir: &Path) -> Result<()> {
    // The directory `podlink uninstall` takes.
    let versioned = pin_dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('v') && n[1..].bytes().all(|b| b.is_ascii_digit()));
    let top = match pin_dir.parent() {
        Some(parent) if versioned => parent,
        _ => pin_dir,
    };
    for name in MAP_NAMES {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path)
            .with_context(|| format!("reading the pinned map {}", path.display()))?;
        let found = (
            info.map_type().ok(),
            info.key_size() as usize,
            info.value_size() as usize,
            info.max_entries(),
        );
        let (kind, key, value, entries) =
            expected_layout(name).expect("every map name has a layout");
        if found != (Some(kind), key, value, entries) {
            bail!(
                "the pinned map {} ({:?}, key {} B, value {} B, {} entries) was made by an incompatible podlink; this agent expects {kind:?}, key {key} B, value {value} B, {entries} entries. Remove its pins with `podlink uninstall --pin-dir {}` (this detaches capture) and start again",
                path.display(),
                found.0,
                found.1,
                found.2,
                found.3,
                top.display()
            );
        }
    }
    Ok(())
}

/// `config` with the node's addresses filled in (at most [`MAX_NODE_ADDRS`]).
pub(super) fn with_node_addrs(mut config: Config, addrs: &[Ipv4Addr]) -> Config {
    config.node_addrs = [[0; 16]; MAX_NODE_ADDRS];
    for (slot, addr) in config.node_addrs.iter_mut().zip(addrs) {
        *slot = ipv4_mapped(addr.octets());
    }
    config.node_addr_count = addrs.len().min(MAX_NODE_ADDRS) as u32;
    config
}
