//! The pin layout carries its version (`<pin-dir>/v4/`): an agent finding an
//! earlier layout (the unversioned one of the first agents, version 1, whose
//! captured flows had no host veth, version 2, whose counters had
//! `dropped_ipv6`, or version 3, whose counters had no `captured_dns`) moves its pins over without detaching anything (same links,
//! same maps with their entries), copies the maps whose layout changed (captured
//! flows with their pods' host veths, counters field by field), and one finding a
//! newer layout refuses to start, naming it.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use aya::maps::{HashMap, Map, MapData, PerCpuHashMap, PerCpuValues};
use podlink_common::{
    FlowKey, LAYOUT_VERSION, LINKS_DIR, MAP_CAPTURED_FLOWS, MAP_COUNTERS, MAP_NAMES,
    MAX_CAPTURED_FLOWS, MAX_PODS, OLDEST_LAYOUT_VERSION, PREVIOUS_LAYOUT_VERSION, PodCounters,
};
use podlink_tests::{Cluster, PodSpec, app, netns};
use serde_json::Value;

/// The kernel's id of the map pinned at `path`.
fn map_id(path: &Path) -> u64 {
    let out = netns::run(
        Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(path),
    )
    .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_u64().unwrap()
}

/// The entries of a pinned captured-flows map whose values are `V`.
fn flows<V: aya::Pod>(path: &Path) -> Vec<(FlowKey, V)> {
    let map: HashMap<MapData, FlowKey, V> =
        HashMap::try_from(Map::LruHashMap(MapData::from_pin(path).unwrap())).unwrap();
    map.iter().map(Result::unwrap).collect()
}

/// The maps whose objects a migration from layout `version` keeps: all but the
/// counters (changed in versions 3 and 4) and, from version 1, the captured flows.
fn kept_maps(version: u32) -> impl Iterator<Item = &'static str> {
    MAP_NAMES
        .into_iter()
        .filter(move |m| *m != MAP_COUNTERS && (version > 1 || *m != MAP_CAPTURED_FLOWS))
}

/// Counters by host veth ifindex, summed over CPUs.
type Counters = Vec<(u32, PodCounters)>;

/// The counters of every host veth in the `pod_counters` map pinned at `path`.
fn counters(path: &Path) -> Counters {
    let map: PerCpuHashMap<MapData, u32, PodCounters> =
        PerCpuHashMap::try_from(Map::PerCpuHashMap(MapData::from_pin(path).unwrap())).unwrap();
    map.iter()
        .map(Result::unwrap)
        .map(|(ifindex, values)| {
            let mut sum = PodCounters::default();
            values.iter().for_each(|v| sum.add(v));
            (ifindex, sum)
        })
        .collect()
}

/// Turns the stopped agent's pins into those of an earlier layout `version`, in
/// `into` (the pin directory itself for the unversioned layout, `v<N>/`
/// otherwise): the maps and links are moved; the counters are written into a map
/// of that version's layout (versions 1 and 2: 14 counters, `dropped_ipv6` 12th,
/// set to 1000 here, no `captured_dns`; version 3: 13 counters, no
/// `captured_dns`), and for version 1 the captured flows into a map of its layout
/// (value `u8`, 1), as their agents made them. Returns the flows with the host
/// veths the current layout had for them, and the counters.
fn make_previous_layout(pins: &Path, into: &Path, version: u32) -> (Vec<(FlowKey, u32)>, Counters) {
    let current = flows::<u32>(&pins.join(MAP_CAPTURED_FLOWS));
    assert!(!current.is_empty(), "no captured flows to carry");
    fs::create_dir_all(into).unwrap();
    for name in kept_maps(version).chain([LINKS_DIR]) {
        fs::rename(pins.join(name), into.join(name)).unwrap();
    }
    let counters_before = counters(&pins.join(MAP_COUNTERS));
    let old_counters = into.join(MAP_COUNTERS);
    // The fields in that version's order.
    let old_fields = |sum: &PodCounters| -> Vec<u64> {
        let mut fields: Vec<u64> = sum
            .named()
            .iter()
            .filter(|(name, _)| *name != "captured_dns")
            .map(|(_, v)| *v)
            .collect();
        if version < 3 {
            fields.insert(11, 1000);
        }
        fields
    };
    let size = if version < 3 { 14 } else { 13 };
    netns::run(
        Command::new("bpftool")
            .args(["map", "create"])
            .arg(&old_counters)
            .args(["type", "percpu_hash", "key", "4", "value"])
            .arg((size * 8).to_string())
            .args(["entries"])
            .arg(MAX_PODS.to_string())
            .args(["name", MAP_COUNTERS]),
    )
    .unwrap();
    if version < 3 {
        write_counters::<14>(&old_counters, &counters_before, old_fields);
    } else {
        write_counters::<13>(&old_counters, &counters_before, old_fields);
    }
    fs::remove_file(pins.join(MAP_COUNTERS)).unwrap();
    if version > 1 {
        fs::remove_dir(pins).unwrap();
        return (current, counters_before);
    }
    let old = into.join(MAP_CAPTURED_FLOWS);
    netns::run(
        Command::new("bpftool")
            .args(["map", "create"])
            .arg(&old)
            .args(["type", "lru_hash", "key"])
            .arg(size_of::<FlowKey>().to_string())
            .args(["value", "1", "entries"])
            .arg(MAX_CAPTURED_FLOWS.to_string())
            .args(["name", MAP_CAPTURED_FLOWS]),
    )
    .unwrap();
    let mut map: HashMap<MapData, FlowKey, u8> =
        HashMap::try_from(Map::LruHashMap(MapData::from_pin(&old).unwrap())).unwrap();
    for (key, _) in &current {
        map.insert(key, 1, 0).unwrap();
    }
    fs::remove_file(pins.join(MAP_CAPTURED_FLOWS)).unwrap();
    fs::remove_dir(pins).unwrap();
    (current, counters_before)
}

/// Writes `counters` into the `pod_counters` map of an earlier layout pinned at
/// `path` (`N` counters a value), each as `fields` gives them, on the first CPU.
fn write_counters<const N: usize>(
    path: &Path,
    counters: &Counters,
    fields: impl Fn(&PodCounters) -> Vec<u64>,
) {
    let mut old: PerCpuHashMap<MapData, u32, [u64; N]> =
        PerCpuHashMap::try_from(Map::PerCpuHashMap(MapData::from_pin(path).unwrap())).unwrap();
    let cpus = aya::util::nr_cpus().unwrap();
    for (ifindex, sum) in counters {
        let mut values = vec![[0u64; N]; cpus];
        values[0] = fields(sum).try_into().unwrap();
        old.insert(ifindex, PerCpuValues::try_from(values).unwrap(), 0)
            .unwrap();
    }
}

/// Captures two pods, stops the agent, puts its pins in an earlier layout (see
/// [`make_previous_layout`]), starts it again and checks the migration: the same
/// maps and links, the captured flows with their veths, traffic as before. With
/// `interrupted`, the maps and links are already back in the current layout, as an
/// agent stopped after its renames leaves them, and only the old maps are left to
/// carry. `version` is the layout's (1 for the unversioned one).
fn migrates_from(layout: &str, version: u32, logged: &str, interrupted: bool) {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    app::exchange(&client.netns, server.addr(8000), b"before").unwrap();
    c.stop_agent(0).unwrap();

    let node = c.nodes[0].clone();
    let pins = node.pins();
    let old_dir: PathBuf = if layout == "unversioned" {
        node.pin_dir.clone()
    } else {
        node.pin_dir.join(layout)
    };
    let (flows_before, counters_before) = make_previous_layout(&pins, &old_dir, version);
    let moved_to = if interrupted {
        fs::create_dir(&pins).unwrap();
        for name in kept_maps(version).chain([LINKS_DIR]) {
            fs::rename(old_dir.join(name), pins.join(name)).unwrap();
        }
        &pins
    } else {
        &old_dir
    };
    let old = c.inspect(0).unwrap();
    if interrupted {
        assert_eq!(old["layout"], format!("v{LAYOUT_VERSION}"), "{old:#}");
        let kinds: Vec<&Value> = old["problems"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| &p["kind"])
            .collect();
        assert_eq!(kinds, ["previous_layout_pins_left"], "{old:#}");
    } else {
        assert_eq!(old["layout"], layout, "{old:#}");
        assert_eq!(old["problems"], serde_json::json!([]), "{old:#}");
    }
    let map_ids: Vec<u64> = kept_maps(version)
        .map(|m| map_id(&moved_to.join(m)))
        .collect();

    c.start_agent(0).unwrap();
    let log = c.agent_log(0);
    assert!(
        log.contains(&format!(
            "migrated {logged} to layout version {LAYOUT_VERSION}"
        )),
        "{log}"
    );
    if version == 1 {
        assert!(log.contains("captured flows carried over"), "{log}");
    }
    assert!(log.contains("counters carried over"), "{log}");
    // The counters went on from where they were, but for `dropped_ipv6`;
    // `captured_dns` starts at zero.
    let carried = counters(&pins.join(MAP_COUNTERS));
    for (ifindex, before) in &counters_before {
        let (_, now) = carried
            .iter()
            .find(|(i, _)| i == ifindex)
            .unwrap_or_else(|| panic!("counters of {ifindex} lost: {carried:?}"));
        for ((name, was), (_, is)) in before.named().iter().zip(now.named()) {
            assert!(is >= *was, "{name} of {ifindex}: {was} before, {is} after");
        }
        // Its neighbours did not take `dropped_ipv6`'s 1000.
        assert!(now.dropped_unparsable < 1000, "{now:?}");
        assert!(now.dropped_flow_gone < 1000, "{now:?}");
        assert_eq!(now.captured_dns, 0, "{now:?}");
    }
    // Everything moved: only the current layout is left, holding the very same
    // maps and links.
    let left: Vec<String> = fs::read_dir(&node.pin_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, [format!("v{LAYOUT_VERSION}")]);
    let moved: Vec<u64> = kept_maps(version).map(|m| map_id(&pins.join(m))).collect();
    assert_eq!(moved, map_ids);
    let new = c.inspect(0).unwrap();
    assert_eq!(new["layout"], format!("v{LAYOUT_VERSION}"));
    assert_eq!(new["problems"], serde_json::json!([]), "{new:#}");
    let ids = |report: &Value| -> Vec<u64> {
        report["links"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["link_id"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(ids(&new), ids(&old), "the links were adopted, not replaced");
    let pods = |report: &Value| -> Vec<(Value, Value, Value)> {
        report["pods"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["ifindex"].clone(), p["ipv4"].clone(), p["flags"].clone()))
            .collect()
    };
    assert_eq!(pods(&new), pods(&old));
    // The captured flows were carried over, each with the veth it was taken over
    // on (read from the pods' addresses).
    let carried = flows::<u32>(&pins.join(MAP_CAPTURED_FLOWS));
    for flow in &flows_before {
        assert!(
            carried.contains(flow),
            "{flow:?} was lost or given another veth: {carried:?}"
        );
    }
    assert!(c.is_captured(&client).unwrap());
    let ex = app::exchange(&client.netns, server.addr(8000), b"after").unwrap();
    assert_eq!(ex.echoed, b"after");
    assert_eq!(echo.accepted(), 2);
}

#[test]
fn the_unversioned_layout_is_migrated_with_its_links_maps_and_flows() {
    migrates_from("unversioned", 1, "the unversioned pin layout", false);
}

#[test]
fn layout_version_1_is_migrated_with_its_links_maps_and_flows() {
    migrates_from(
        &format!("v{OLDEST_LAYOUT_VERSION}"),
        OLDEST_LAYOUT_VERSION,
        &format!("pin layout version {OLDEST_LAYOUT_VERSION}"),
        false,
    );
}

#[test]
fn layout_version_2_is_migrated_with_its_links_maps_and_counters() {
    migrates_from("v2", 2, "pin layout version 2", false);
}

#[test]
fn layout_version_3_is_migrated_with_its_links_maps_and_counters() {
    migrates_from(
        &format!("v{PREVIOUS_LAYOUT_VERSION}"),
        PREVIOUS_LAYOUT_VERSION,
        &format!("pin layout version {PREVIOUS_LAYOUT_VERSION}"),
        false,
    );
}

#[test]
fn a_migration_stopped_after_its_renames_is_finished() {
    migrates_from(
        &format!("v{OLDEST_LAYOUT_VERSION}"),
        OLDEST_LAYOUT_VERSION,
        &format!("pin layout version {OLDEST_LAYOUT_VERSION}"),
        true,
    );
}

#[test]
fn a_migration_from_version_3_stopped_after_its_renames_is_finished() {
    migrates_from(
        &format!("v{PREVIOUS_LAYOUT_VERSION}"),
        PREVIOUS_LAYOUT_VERSION,
        &format!("pin layout version {PREVIOUS_LAYOUT_VERSION}"),
        true,
    );
}

#[test]
fn a_newer_layout_is_refused_by_name() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let newer = c.nodes[0].pin_dir.join(format!("v{}", LAYOUT_VERSION + 1));
    fs::create_dir_all(&newer).unwrap();
    // The agent refuses to start, and inspect to read, naming it alike.
    let refusal = format!(
        "layout version {}, but this podlink's layout version is {LAYOUT_VERSION}: it was made by a newer podlink",
        LAYOUT_VERSION + 1
    );
    for error in [c.start_agent(0).unwrap_err(), c.inspect(0).unwrap_err()] {
        let error = format!("{error:#}");
        assert!(error.contains(&newer.display().to_string()), "{error}");
        assert!(error.contains(&refusal), "{error}");
    }
    // Nothing was pinned beside it.
    assert!(!c.nodes[0].pins().exists());
}
