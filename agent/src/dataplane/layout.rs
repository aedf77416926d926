//! The maps' layouts: what this agent's programs expect of pinned maps it reuses,
//! what the earlier layout versions held, the captured flows and counters carried
//! over from them, and the config value it writes.

use std::{collections::HashMap, net::IpAddr, path::Path};

use aya::maps::{
    HashMap as BpfHashMap, Map, MapData, MapInfo, MapType, PerCpuHashMap, PerCpuValues,
};
use podlink_common::{
    Addr, CidrKey, Config, FlowKey, LAYOUT_VERSION, MAP_CAPTURED_FLOWS, MAP_CONFIG, MAP_COUNTERS,
    MAP_EXCLUDED_CIDRS, MAP_EXCLUDED_PORTS, MAP_NAMES, MAP_PODS, MAX_CAPTURED_FLOWS,
    MAX_EXCLUDED_CIDRS, MAX_EXCLUDED_PORTS, MAX_NODE_ADDRS, MAX_PODS, POD_HAS_IPV4, PodCounters,
    PodInfo, ipv4_mapped,
};

use super::error::{Error, Result};

/// What `pod_counters` held in a layout version: the counters' layouts differ
/// in order and meaning where their sizes may not (versions 2 and 4 both hold 14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CountersLayout {
    /// Versions 1 and 2: [`OldCounters`], with `dropped_ipv6`.
    WithDroppedIpv6,
    /// Version 3: [`V3Counters`], this layout's but `captured_dns`.
    WithoutDns,
    /// Version 4: [`PodCounters`].
    Current,
}

impl CountersLayout {
    /// The counters layout of pin layout `version`.
    pub(super) fn of(version: u32) -> Option<Self> {
        match version {
            1 | 2 => Some(Self::WithDroppedIpv6),
            3 => Some(Self::WithoutDns),
            4 => Some(Self::Current),
            _ => None,
        }
    }

    /// The size of one CPU's value, in bytes.
    fn value_size(self) -> usize {
        match self {
            Self::WithDroppedIpv6 => size_of::<OldCounters>(),
            Self::WithoutDns => size_of::<V3Counters>(),
            Self::Current => size_of::<PodCounters>(),
        }
    }
}

/// The layout of map `name` in layout `version` (1 to 4): type, key size, value
/// size, capacity, and for the counters what their value holds; `None` for
/// another map or version.
fn expected_layout(
    name: &str,
    version: u32,
) -> Option<(MapType, usize, usize, u32, Option<CountersLayout>)> {
    // Version 2 made the captured flows' value the host veth's ifindex; versions
    // 3 and 4 changed the counters.
    let flow_value = if version == 1 { 1 } else { size_of::<u32>() };
    let counters = CountersLayout::of(version)?;
    Some(match name {
        MAP_PODS => (MapType::Hash, 4, size_of::<PodInfo>(), MAX_PODS, None),
        MAP_CONFIG => (MapType::Array, 4, size_of::<Config>(), 1, None),
        MAP_EXCLUDED_CIDRS => (
            MapType::LpmTrie,
            size_of::<CidrKey>(),
            1,
            MAX_EXCLUDED_CIDRS,
            None,
        ),
        MAP_EXCLUDED_PORTS => (MapType::Hash, 2, 1, MAX_EXCLUDED_PORTS, None),
        MAP_COUNTERS => (
            MapType::PerCpuHash,
            4,
            counters.value_size(),
            MAX_PODS,
            Some(counters),
        ),
        MAP_CAPTURED_FLOWS => (
            MapType::LruHash,
            size_of::<FlowKey>(),
            flow_value,
            MAX_CAPTURED_FLOWS,
            None,
        ),
        _ => return None,
    })
}

/// Whether map `name` of layout `version` has the layout of this agent's
/// ([`LAYOUT_VERSION`]): a migration renames its pin; otherwise its entries are
/// copied into a new map.
pub(super) fn same_layout(name: &str, version: u32) -> bool {
    expected_layout(name, version) == expected_layout(name, LAYOUT_VERSION)
}

/// The value of `pod_counters` in layouts 1 and 2: [`PodCounters`]' fields in
/// their order, with `dropped_ipv6` (IPv6 TCP, dropped before it was captured)
/// 12th, between `dropped_unparsable` and `dropped_flow_gone`, and without
/// `captured_dns`.
pub(super) type OldCounters = [u64; 14];

/// The value of `pod_counters` in layout 3: [`PodCounters`]' fields in their
/// order but the last, `captured_dns` (DNS counted in `captured_outbound`).
pub(super) type V3Counters = [u64; 13];

/// Where `dropped_ipv6` was in [`OldCounters`].
const OLD_DROPPED_IPV6: usize = 11;

/// The counters of layout 3, field by field, `captured_dns` zero (the DNS
/// captured before stays in `captured_outbound`).
pub(super) fn counters_from_v3(v3: &V3Counters) -> PodCounters {
    let mut fields = [0u64; size_of::<PodCounters>() / 8];
    fields[..v3.len()].copy_from_slice(v3);
    counters_of(fields)
}

/// The counters of layout 1 or 2, field by field, without `dropped_ipv6` (whose
/// packets are captured now: no counter of this layout stands for them) and
/// with `captured_dns` zero.
pub(super) fn counters_from_old(old: &OldCounters) -> PodCounters {
    let mut v3 = [0u64; size_of::<V3Counters>() / 8];
    let kept = old
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != OLD_DROPPED_IPV6)
        .map(|(_, v)| *v);
    for (field, value) in v3.iter_mut().zip(kept) {
        *field = value;
    }
    counters_from_v3(&v3)
}

/// [`PodCounters`] from its fields in declaration order.
fn counters_of(fields: [u64; size_of::<PodCounters>() / 8]) -> PodCounters {
    let [
        captured_outbound,
        captured_inbound_hbone,
        captured_inbound_plaintext,
        assigned_established,
        bounced,
        passed,
        dropped_no_listener,
        dropped_bounce_miss,
        dropped_assign_failed,
        dropped_fragment,
        dropped_unparsable,
        dropped_flow_gone,
        dropped_spoofed,
        captured_dns,
    ] = fields;
    PodCounters {
        captured_outbound,
        captured_inbound_hbone,
        captured_inbound_plaintext,
        assigned_established,
        bounced,
        passed,
        dropped_no_listener,
        dropped_bounce_miss,
        dropped_assign_failed,
        dropped_fragment,
        dropped_unparsable,
        dropped_flow_gone,
        dropped_spoofed,
        captured_dns,
    }
}

/// The per-CPU counters of the `pod_counters` map of layout `version` pinned
/// at `pin`, as this layout's, by host veth ifindex.
///
/// # Errors
/// An unknown version, or a map that cannot be opened or read.
pub(super) fn read_counters_of(pin: &Path, version: u32) -> Result<Vec<(u32, Vec<PodCounters>)>> {
    match CountersLayout::of(version).ok_or(Error::NoMapLayout { version })? {
        CountersLayout::WithDroppedIpv6 => read_counters::<OldCounters>(pin, counters_from_old),
        CountersLayout::WithoutDns => read_counters::<V3Counters>(pin, counters_from_v3),
        CountersLayout::Current => read_counters::<PodCounters>(pin, |c| *c),
    }
}

/// The per-CPU counters of the `pod_counters` map pinned at `pin`, whose values
/// are `V`, each CPU's converted by `convert`, by host veth ifindex.
pub(super) fn read_counters<V: aya::Pod>(
    pin: &Path,
    convert: impl Fn(&V) -> PodCounters,
) -> Result<Vec<(u32, Vec<PodCounters>)>> {
    let reading = || Error::map_pin("reading", pin);
    let map: PerCpuHashMap<MapData, u32, V> = PerCpuHashMap::try_from(
        Map::from_map_data(MapData::from_pin(pin).map_err(Error::map_pin("opening", pin))?)
            .map_err(reading())?,
    )
    .map_err(reading())?;
    map.iter()
        .map(|entry| {
            let (ifindex, values) = entry.map_err(reading())?;
            Ok((ifindex, values.iter().map(&convert).collect()))
        })
        .collect()
}

/// Copies the per-CPU counters of a `pod_counters` map of an earlier layout
/// `version` (pinned at `old`) into `counters`, this layout's map, field by field
/// ([`read_counters_of`]), for every host veth that has no entry there yet (an
/// earlier, newer layout's was copied first). Returns the entries copied.
///
/// # Errors
/// When the old map cannot be opened or read, or an insert fails.
pub(super) fn carry_counters(
    old: &Path,
    version: u32,
    counters: &mut PerCpuHashMap<MapData, u32, PodCounters>,
) -> Result<usize> {
    let mut copied = 0;
    for (ifindex, values) in read_counters_of(old, version)? {
        if counters.get(&ifindex, 0).is_ok() {
            continue;
        }
        let values = PerCpuValues::try_from(values).map_err(|error| Error::PerCpu { error })?;
        counters
            .insert(ifindex, values, 0)
            .map_err(Error::map("writing", MAP_COUNTERS))?;
        copied += 1;
    }
    Ok(copied)
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
        let Some((kind, key, value, entries, _)) = expected_layout(name, version) else {
            return Err(Error::NoMapLayout { version });
        };
        let expected = (kind, key, value, entries);
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

/// The excluded-CIDRs trie key of a prefix: an IPv4 prefix IPv4-mapped with 96
/// added to its length (the programs look IPv4 destinations up mapped), an IPv6
/// prefix as it is (the programs look IPv6 destinations up as they are).
pub(super) fn cidr_key(net: &ipnet::IpNet) -> CidrKey {
    match net {
        ipnet::IpNet::V4(v4) => CidrKey {
            prefix_len: 96 + u32::from(v4.prefix_len()),
            addr: ipv4_mapped(v4.network().octets()),
        },
        ipnet::IpNet::V6(v6) => CidrKey {
            prefix_len: u32::from(v6.prefix_len()),
            addr: v6.network().octets(),
        },
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use podlink_common::{OLDEST_LAYOUT_VERSION, PREVIOUS_LAYOUT_VERSION};

    #[test]
    fn excluded_prefixes_are_keyed_as_the_programs_look_them_up() {
        let v4 = cidr_key(&"10.96.0.0/12".parse().unwrap());
        assert_eq!({ v4.prefix_len }, 108);
        assert_eq!(v4.addr, ipv4_mapped([10, 96, 0, 0]));
        let v6 = cidr_key(&"fd00:ec2::/64".parse().unwrap());
        assert_eq!({ v6.prefix_len }, 64);
        assert_eq!(
            v6.addr,
            "fd00:ec2::".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
    }

    #[test]
    fn old_counters_are_carried_field_by_field_without_dropped_ipv6() {
        let old: OldCounters = core::array::from_fn(|i| i as u64 + 1);
        let new = counters_from_old(&old);
        let named = new.named();
        // Every field before `dropped_ipv6` where it was, every one after it one
        // place earlier, `dropped_ipv6` (12) nowhere; `captured_dns`, last, zero.
        for (i, (name, value)) in named[..old.len() - 1].iter().enumerate() {
            let was = if i < OLD_DROPPED_IPV6 { i } else { i + 1 };
            assert_eq!(*value, old[was], "{name}");
        }
        assert_eq!(named[OLD_DROPPED_IPV6], ("dropped_flow_gone", 13));
        assert_eq!(new.dropped_unparsable, 11);
        assert_eq!(new.dropped_spoofed, 14);
        assert_eq!(new.captured_dns, 0);
        assert!(named.iter().all(|(_, v)| *v != 12));
    }

    #[test]
    fn v3_counters_are_carried_field_by_field_with_no_dns_yet() {
        let v3: V3Counters = core::array::from_fn(|i| i as u64 + 1);
        let new = counters_from_v3(&v3);
        let named = new.named();
        for (i, was) in v3.iter().enumerate() {
            assert_eq!(named[i].1, *was, "{}", named[i].0);
        }
        assert_eq!(named[v3.len()], ("captured_dns", 0));
    }

    #[test]
    fn only_changed_maps_are_copied_in_a_migration() {
        assert!(MAP_NAMES.iter().all(|n| same_layout(n, LAYOUT_VERSION)));
        let changed = |version| -> Vec<&str> {
            MAP_NAMES
                .into_iter()
                .filter(|n| !same_layout(n, version))
                .collect()
        };
        assert_eq!(changed(PREVIOUS_LAYOUT_VERSION), [MAP_COUNTERS]);
        assert_eq!(
            changed(OLDEST_LAYOUT_VERSION),
            [MAP_COUNTERS, MAP_CAPTURED_FLOWS]
        );
        assert_eq!(changed(2), [MAP_COUNTERS]);
        assert_eq!(
            expected_layout(MAP_COUNTERS, PREVIOUS_LAYOUT_VERSION).map(|l| l.2),
            Some(13 * 8)
        );
        // Version 2's counters are as large as this layout's, not the same.
        assert_eq!(
            expected_layout(MAP_COUNTERS, 2).map(|l| l.2),
            expected_layout(MAP_COUNTERS, LAYOUT_VERSION).map(|l| l.2),
        );
    }
}
