//! The pin layout carries its version (`<pin-dir>/v1/`): an agent finding the
//! unversioned layout of earlier agents moves its pins over without detaching
//! anything (same links, same maps with their entries), and one finding a newer
//! layout refuses to start, naming it.

use std::{fs, process::Command};

use podlink_common::{LAYOUT_VERSION, LINKS_DIR, MAP_NAMES};
use podlink_tests::{Cluster, PodSpec, app, netns};
use serde_json::Value;

/// The kernel's id of the map pinned at `path`.
fn map_id(path: &std::path::Path) -> u64 {
    let out = netns::run(
        Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(path),
    )
    .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_u64().unwrap()
}

#[test]
fn the_unversioned_layout_is_migrated_with_its_links_and_maps() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    c.start_agent(0).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();
    app::exchange(&client.netns, server.addr(8000), b"before").unwrap();
    c.stop_agent(0).unwrap();

    // Put the pins where agents before layout versions had them.
    let node = c.nodes[0].clone();
    let versioned = node.pins();
    for name in MAP_NAMES.iter().copied().chain([LINKS_DIR]) {
        fs::rename(versioned.join(name), node.pin_dir.join(name)).unwrap();
    }
    fs::remove_dir(&versioned).unwrap();
    let old = c.inspect(0).unwrap();
    assert_eq!(old["layout"], "unversioned", "{old:#}");
    assert_eq!(old["problems"], serde_json::json!([]), "{old:#}");
    let map_ids: Vec<u64> = MAP_NAMES
        .iter()
        .map(|m| map_id(&node.pin_dir.join(m)))
        .collect();
    let flows = c.dump_map_at(&node.pin_dir.join("captured_flows")).unwrap();
    assert!(!flows.as_array().unwrap().is_empty());

    c.start_agent(0).unwrap();
    let log = c.agent_log(0);
    assert!(
        log.contains("migrated the unversioned pin layout to layout version 1"),
        "{log}"
    );
    // Everything moved: only v1 is left, holding the very same maps and links.
    let left: Vec<String> = fs::read_dir(&node.pin_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, [format!("v{LAYOUT_VERSION}")]);
    let moved: Vec<u64> = MAP_NAMES
        .iter()
        .map(|m| map_id(&versioned.join(m)))
        .collect();
    assert_eq!(moved, map_ids);
    let new = c.inspect(0).unwrap();
    assert_eq!(new["layout"], "v1");
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
    // Captured flows carried over (the same map; the agent only adds to it).
    let carried = c.dump_map(0, "captured_flows").unwrap();
    for flow in flows.as_array().unwrap() {
        assert!(
            carried.as_array().unwrap().contains(flow),
            "{flow} was lost"
        );
    }
    assert!(c.is_captured(&client).unwrap());
    let ex = app::exchange(&client.netns, server.addr(8000), b"after").unwrap();
    assert_eq!(ex.echoed, b"after");
    assert_eq!(echo.accepted(), 2);
}

#[test]
fn a_newer_layout_is_refused_by_name() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let newer = c.nodes[0].pin_dir.join(format!("v{}", LAYOUT_VERSION + 1));
    fs::create_dir_all(&newer).unwrap();
    let error = c.start_agent(0).unwrap_err().to_string();
    assert!(error.contains(&newer.display().to_string()), "{error}");
    assert!(
        error.contains(&format!(
            "layout version {}, but this agent's layout version is {LAYOUT_VERSION}",
            LAYOUT_VERSION + 1
        )),
        "{error}"
    );
    // Nothing was pinned beside it.
    assert!(!c.nodes[0].pins().exists());
}
