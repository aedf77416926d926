//! The maps' layouts: what this agent's programs expect of pinned maps it reuses,
//! what the previous layout version held, the captured flows carried over from it,
//! and the config value it writes.

use std::{collections::HashMap, net::IpAddr, path::Path};

use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapInfo, MapType};
use podlink_common::{
    Addr, CidrKey, Config, FlowKey, MAP_CAPTURED_FLOWS, MAP_CONFIG, MAP_COUNTERS,
    MAP_EXCLUDED_CIDRS, MAP_EXCLUDED_PORTS, MAP_NAMES, MAP_PODS, MAX_CAPTURED_FLOWS,
    MAX_EXCLUDED_CIDRS, MAX_EXCLUDED_PORTS, MAX_NODE_ADDRS, MAX_PODS, POD_HAS_IPV4, PodCounters,
    PodInfo, ipv4_mapped,
};

use super::error::{Error, Result};

/// The layout of map `name` in layout `version` (1 or 2): type, key size, value
/// size, capacity; `None` for another map or version.
fn expected_layout(name: &str, version: u32) -> Option<(MapType, usize, usize, u32)> {
    // Version 2 made the captured flows' value the host veth's ifindex.
    let flow_value = match version {
        1 => 1,
        2 => size_of::<u32>(),
        _ => return None,
    };
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
            flow_value,
            MAX_CAPTURED_FLOWS,
        ),
        _ => return None,
    })
}

/// Refuses pinned maps whose layout differs from that of layout `version`: the
/// programs would read garbage from them, or a migration would misread them.
/// `pin_dir` is the directory holding the maps: a layout's `v<N>`, or the pin
/// directory itself for the unversioned layout (that of version 1).
pub(super) fn check_pinned_layouts(pin_dir: &Path, version: u32) -> Result<()> {
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
        let info =
            MapInfo::from_pin(&path).map_err(Error::map_pin("reading the pinned map", &path))?;
        let found = (
            info.map_type().ok(),
            info.key_size() as usize,
            info.value_size() as usize,
            info.max_entries(),
        );
        let Some(expected) = expected_layout(name, version) else {
            return Err(Error::NoMapLayout { version });
        };
        let (kind, key, value, entries) = expected;
        if found != (Some(kind), key, value, entries) {
            return Err(Error::IncompatibleMap {
                path,
                found,
                expected,
                pin_dir: top.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Copies the captured flows of a map of layout version 1 (pinned at `old`, `u8`
/// values) into `flows`, this layout's map, each with the host veth of the
/// enrolled pod it belongs to: the pod whose IPv4 address is the flow's source (a
/// flow leaving it) or else its destination (a flow bounced into it), from `pods`
/// (host ifindex and entry, as the pods map holds them). Flows of no enrolled pod
/// are left out. A flow given the wrong veth (both ends enrolled here) only takes
/// the programs' slow path once, which remembers its veth. Keeping the flows keeps
/// the stray packets of a proxy flow whose socket is gone dropped across the
/// upgrade, as they are across any restart. Returns the flows copied and left out.
///
/// # Errors
/// When the old map cannot be opened or read, or an insert fails (the new map is
/// an LRU: it does not fill up).
pub(super) fn carry_captured_flows(
    old: &Path,
    flows: &mut BpfHashMap<&mut MapData, FlowKey, u32>,
    pods: &[(u32, PodInfo)],
) -> Result<(usize, usize)> {
    let old_map: BpfHashMap<MapData, FlowKey, u8> = BpfHashMap::try_from(Map::LruHashMap(
        MapData::from_pin(old).map_err(Error::map_pin("opening", old))?,
    ))
    .map_err(Error::map_pin("reading", old))?;
    let by_addr: HashMap<Addr, u32> = pods
        .iter()
        .filter(|(_, pod)| pod.flags & POD_HAS_IPV4 != 0)
        .map(|(ifindex, pod)| (pod.ipv4, *ifindex))
        .collect();
    let pod_of = |addr: &Addr| by_addr.get(addr).copied();
    let (mut copied, mut left_out) = (0, 0);
    for key in old_map.keys() {
        let key = key.map_err(Error::map_pin("reading", old))?;
        match pod_of(&key.saddr).or_else(|| pod_of(&key.daddr)) {
            Some(ifindex) => {
                flows
                    .insert(key, ifindex, 0)
                    .map_err(Error::map("writing", MAP_CAPTURED_FLOWS))?;
                copied += 1;
            }
            None => left_out += 1,
        }
    }
    Ok((copied, left_out))
}

/// `config` with the node's addresses filled in (the first [`MAX_NODE_ADDRS`]):
/// IPv4 mapped (`::ffff:a.b.c.d`), IPv6 as it is.
pub(super) fn with_node_addrs(mut config: Config, addrs: &[IpAddr]) -> Config {
    config.node_addrs = [[0; 16]; MAX_NODE_ADDRS];
    for (slot, addr) in config.node_addrs.iter_mut().zip(addrs) {
        *slot = match addr {
            IpAddr::V4(v4) => ipv4_mapped(v4.octets()),
            IpAddr::V6(v6) => v6.octets(),
        };
    }
    config.node_addr_count = addrs.len().min(MAX_NODE_ADDRS) as u32;
    config
}
