//! The node's network configuration the data path needs, through the `ip` tool:
//! policy routing for assigned packets, sysctls, the node's addresses, and the host
//! veth behind a pod address.
//!
//! Kernel documentation: `Documentation/networking/ip-sysctl.rst` (tcp_early_demux,
//! rp_filter); `ip-rule(8)`, `ip-route(8)`.

use std::{collections::HashMap, process::Command};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::journal::{Interface, SysctlJournal};

/// Runs `ip` with `args`; returns its standard output.
fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running the ip tool (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Installs `fwmark <mark>/<mask> lookup <table>` at preference `priority` and the
/// table's `local 0.0.0.0/0 dev lo` route, so that packets assigned to a proxy
/// socket by `from_pod` are delivered locally. Idempotent.
pub fn install_policy_routing(mark: u32, mask: u32, table: u32, priority: u32) -> Result<()> {
    let pref = priority.to_string();
    let table_s = table.to_string();
    let fwmark = format!("{mark:#x}/{mask:#x}");
    let existing = ip(&["-4", "rule", "show", "pref", &pref])?;
    let wanted = format!("fwmark {fwmark} lookup {table}");
    if !existing.contains(&wanted) {
        // Rules of others at the same preference are left alone.
        ip(&[
            "-4", "rule", "add", "pref", &pref, "fwmark", &fwmark, "lookup", &table_s,
        ])?;
    }
    ip(&[
        "-4",
        "route",
        "replace",
        "local",
        "0.0.0.0/0",
        "dev",
        "lo",
        "table",
        &table_s,
    ])?;
    Ok(())
}

/// The sysctls the data path needs in the node namespace (see docs/architecture.md,
/// "Kernel facts the data path depends on"): early demux would attach later packets of
/// proxied flows arriving from the uplink or another pod to the proxy's socket and
/// then drop them in the forwarding path.
///
/// Bounced packets arrive on a host veth with the remote client's source address;
/// strict reverse-path filtering (`rp_filter=1`) drops them, and the effective
/// value is the maximum of `all` and the interface's. A node with `all` strict is
/// moved to loose mode (2), which still refuses sources the node cannot route.
///
/// The proxy's source-preserving upstream connections close first (the client's
/// FIN reaches them first), so their TIME_WAIT sockets stay in the node namespace,
/// each holding its 4-tuple for 60 s: a pod pair opening connections faster than
/// about 470 a second (the 28,232 ports of the default range over 60 s) would run
/// out of source ports. `tcp_tw_reuse=1` lets `connect()` reuse a TIME_WAIT
/// 4-tuple after a second (RFC 7323 timestamps tell the old segments apart), as
/// it does by default on loopback only (`tcp_tw_reuse=2`); see
/// `Documentation/networking/ip-sysctl.rst`.
///
/// Each change is recorded in `journal` first, for `podlink uninstall`.
pub fn apply_node_sysctls(journal: &SysctlJournal) -> Result<()> {
    journal.set("net.ipv4.tcp_early_demux", "0", None)?;
    journal.set("net.ipv4.ip_forward", "1", None)?;
    journal.set("net.ipv4.tcp_tw_reuse", "1", None)?;
    if journal.read("net.ipv4.conf.all.rp_filter")? == "1" {
        journal.set("net.ipv4.conf.all.rp_filter", "2", None)?;
        tracing::warn!(
            "net.ipv4.conf.all.rp_filter was 1 (strict), which drops captured inbound packets; set it to 2 (loose)"
        );
    }
    Ok(())
}

/// Removes what [`install_policy_routing`] installed with the same arguments: the
/// `fwmark <mark>/<mask> lookup <table>` rule at `priority` (every copy) and the
/// table's `local 0.0.0.0/0 dev lo` route. Other rules and routes, also in that
/// table, stay. Idempotent; returns what was removed, as `ip` would print it.
///
/// # Errors
/// When `ip` fails or its output cannot be read.
pub fn remove_policy_routing(
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
) -> Result<Vec<String>> {
    let pref = priority.to_string();
    let table_s = table.to_string();
    let fwmark = format!("{mark:#x}/{mask:#x}");
    let wanted = format!("fwmark {fwmark} lookup {table}");
    let mut removed = Vec::new();
    while ip(&["-4", "rule", "show", "pref", &pref])?.contains(&wanted) {
        ip(&[
            "-4", "rule", "del", "pref", &pref, "fwmark", &fwmark, "lookup", &table_s,
        ])?;
        removed.push(format!("rule pref {pref} {wanted}"));
    }
    // A table that was never made lists as an error in some iproute2 versions.
    let routes: Vec<Route> = match ip(&["-j", "-4", "route", "show", "table", &table_s]) {
        Ok(out) if out.trim().is_empty() => Vec::new(),
        Ok(out) => serde_json::from_str(&out).context("parsing ip -j route")?,
        Err(_) => Vec::new(),
    };
    let ours = routes.iter().any(|r| {
        r.kind.as_deref() == Some("local")
            && (r.dst == "default" || r.dst == "0.0.0.0/0")
            && r.dev.as_deref() == Some("lo")
    });
    if ours {
        ip(&[
            "-4",
            "route",
            "del",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            &table_s,
        ])?;
        removed.push(format!("route local 0.0.0.0/0 dev lo table {table}"));
    }
    Ok(removed)
}

/// Per-interface sysctls of a captured host veth: bounced packets arrive on it with
/// a source that is routed elsewhere (reverse-path filtering off), or with one of
/// the node's own addresses when the node answers a connection the proxy made for
/// the pod (`accept_local`; `from_pod` drops anything the pod itself sends with a
/// source other than its own address). Each change is recorded in `journal` first.
pub fn apply_host_veth_sysctls(journal: &SysctlJournal, ifname: &str, ifindex: u32) -> Result<()> {
    let interface = Interface {
        name: ifname.to_string(),
        ifindex,
    };
    journal.set_all(
        [("rp_filter", "0"), ("accept_local", "1")]
            .into_iter()
            .map(|(setting, value)| {
                (
                    format!("net.ipv4.conf.{ifname}.{setting}"),
                    value,
                    Some(interface.clone()),
                )
            })
            .collect(),
    )?;
    Ok(())
}

#[derive(Deserialize)]
struct Route {
    dst: String,
    #[serde(rename = "type")]
    kind: Option<String>,
    dev: Option<String>,
}

#[derive(Deserialize)]
struct LinkInfo {
    ifindex: u32,
    ifname: String,
    linkinfo: Option<LinkKind>,
}

#[derive(Deserialize)]
struct LinkKind {
    info_kind: Option<String>,
}

/// The node's interfaces by index: name, and kind (`veth`, `bridge`, …; `None`
/// for plain devices such as loopback).
pub fn interfaces() -> Result<HashMap<u32, (String, Option<String>)>> {
    let out = ip(&["-j", "-d", "link", "show"])?;
    let links: Vec<LinkInfo> = serde_json::from_str(&out).context("parsing ip -j -d link")?;
    Ok(links
        .into_iter()
        .map(|l| {
            let kind = l.linkinfo.and_then(|k| k.info_kind);
            (l.ifindex, (l.ifname, kind))
        })
        .collect())
}

/// The interface index of `name` in the current network namespace.
pub fn ifindex(name: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(name).ok()
}
