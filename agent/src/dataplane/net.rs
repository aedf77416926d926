//! The node's network configuration the data path needs: policy routing for
//! assigned packets (route netlink, `RTM_NEWRULE` and `RTM_NEWROUTE`, through the
//! `rtnetlink` crate), sysctls, the node's interfaces, and the host veth behind a
//! pod address.
//!
//! Kernel documentation: `Documentation/networking/ip-sysctl.rst` (tcp_early_demux,
//! rp_filter); rtnetlink(7); `ip-rule(8)`, `ip-route(8)` for the same rule and
//! route as `ip` writes them.

use std::{collections::HashMap, net::Ipv4Addr};

use futures_util::TryStreamExt;
use rtnetlink::{
    Handle, IpVersion, RouteMessageBuilder,
    packet_route::{
        AddressFamily,
        link::{LinkAttribute, LinkInfo},
        route::{RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType},
        rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage},
    },
};

use super::{
    error::{Error, Result},
    journal::{Interface, SysctlJournal},
    netlink::Netlink,
};

/// Where the kernel says whether IPv6 is off for all interfaces (`disable_ipv6`,
/// kernel `Documentation/networking/ip-sysctl.rst`). Absent when the kernel was
/// booted with `ipv6.disable=1` or built without IPv6.
pub const IPV6_DISABLED_SYSCTL: &str = "/proc/sys/net/ipv6/conf/all/disable_ipv6";

/// Whether this network namespace has IPv6: `IPV6_DISABLED_SYSCTL` exists and
/// reads `0`. When it does not, the agent captures, listens and routes IPv4 only
/// (ztunnel crashed binding `[::]` on such nodes, istio/ztunnel#1131). The one
/// answer every IPv6 step of the agent asks.
pub fn ipv6_enabled() -> bool {
    ipv6_enabled_from(std::fs::read_to_string(IPV6_DISABLED_SYSCTL).ok().as_deref())
}

/// [`ipv6_enabled`] on the sysctl's text, `None` when it cannot be read.
fn ipv6_enabled_from(disable_ipv6: Option<&str>) -> bool {
    disable_ipv6.is_some_and(|text| text.trim() == "0")
}

/// The rule's and the route's table as route netlink carries it: in the header
/// when it fits a byte, else `RT_TABLE_UNSPEC` there and the number in an
/// attribute (`RTA_TABLE`, `FRA_TABLE`), as `ip` does.
fn header_table(table: u32) -> u8 {
    u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC)
}

/// Whether `rule` is podlink's: IPv4, at `priority`, `fwmark <mark>/<mask>`
/// (no other selector, not inverted), `lookup <table>`.
fn is_policy_rule(rule: &RuleMessage, mark: u32, mask: u32, table: u32, priority: u32) -> bool {
    let header = &rule.header;
    if header.family != AddressFamily::Inet
        || header.action != RuleAction::ToTable
        || header.src_len != 0
        || header.dst_len != 0
        || header.flags.contains(RuleFlags::Invert)
    {
        return false;
    }
    let (mut found_priority, mut found_mark, mut found_mask) = (0, None, None);
    let mut found_table = u32::from(header.table);
    for attribute in &rule.attributes {
        match attribute {
            RuleAttribute::Priority(p) => found_priority = *p,
            RuleAttribute::FwMark(m) => found_mark = Some(*m),
            RuleAttribute::FwMask(m) => found_mask = Some(*m),
            RuleAttribute::Table(t) => found_table = *t,
            RuleAttribute::Iifname(_) | RuleAttribute::Oifname(_) => return false,
            _ => {}
        }
    }
    found_priority == priority
        && found_mark == Some(mark)
        && found_mask.unwrap_or(u32::MAX) == mask
        && found_table == table
}

/// Whether `route` is the table's `local 0.0.0.0/0 dev lo` (`lo` the loopback's
/// index).
fn is_local_route(route: &RouteMessage, table: u32, lo: u32) -> bool {
    let header = &route.header;
    if header.address_family != AddressFamily::Inet
        || header.kind != RouteType::Local
        || header.destination_prefix_length != 0
    {
        return false;
    }
    let mut found_table = u32::from(header.table);
    let mut oif = None;
    for attribute in &route.attributes {
        match attribute {
            RouteAttribute::Table(t) => found_table = *t,
            RouteAttribute::Oif(index) => oif = Some(*index),
            _ => {}
        }
    }
    found_table == table && oif == Some(lo)
}

/// The rules of [`is_policy_rule`] in this network namespace.
async fn policy_rules(
    handle: &Handle,
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
) -> Result<Vec<RuleMessage>> {
    handle
        .rule()
        .get(IpVersion::V4)
        .execute()
        .try_filter(|rule| std::future::ready(is_policy_rule(rule, mark, mask, table, priority)))
        .try_collect()
        .await
        .map_err(Error::netlink("dumping the IPv4 policy routing rules"))
}

/// The routes of [`is_local_route`] in this network namespace.
async fn local_routes(handle: &Handle, table: u32, lo: u32) -> Result<Vec<RouteMessage>> {
    handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute()
        .try_filter(|route| std::future::ready(is_local_route(route, table, lo)))
        .try_collect()
        .await
        .map_err(Error::netlink("dumping the IPv4 routes"))
}

/// The loopback's interface index.
fn loopback() -> Result<u32> {
    ifindex("lo").ok_or(Error::NoLoopback)
}

/// Installs `fwmark <mark>/<mask> lookup <table>` at preference `priority` and the
/// table's `local 0.0.0.0/0 dev lo` route, so that packets assigned to a proxy
/// socket by `from_pod` are delivered locally: the rule and route
/// `ip -4 rule add pref <priority> fwmark <mark>/<mask> lookup <table>` and
/// `ip -4 route replace local 0.0.0.0/0 dev lo table <table>` make. Idempotent:
/// the rule is added only when missing (rules of others at the same preference
/// are left alone), the route is replaced.
///
/// # Errors
/// A route netlink request the kernel refuses (`CAP_NET_ADMIN` is needed).
pub async fn install_policy_routing(
    netlink: &Netlink,
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
) -> Result<()> {
    let handle = netlink.handle();
    if policy_rules(handle, mark, mask, table, priority)
        .await?
        .is_empty()
    {
        let mut add = handle
            .rule()
            .add()
            .v4()
            .action(RuleAction::ToTable)
            .priority(priority)
            .fw_mark(mark)
            .table_id(table);
        let message = add.message_mut();
        message.attributes.push(RuleAttribute::FwMask(mask));
        message.header.table = header_table(table);
        add.execute().await.map_err(Error::netlink(format!(
            "adding the rule pref {priority} fwmark {mark:#x}/{mask:#x} lookup {table}"
        )))?;
    }
    let mut route = RouteMessageBuilder::<Ipv4Addr>::new()
        .kind(RouteType::Local)
        .scope(RouteScope::Host)
        .protocol(RouteProtocol::Boot)
        .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
        .output_interface(loopback()?)
        .table_id(table)
        .build();
    route.header.table = header_table(table);
    handle
        .route()
        .add(route)
        .replace()
        .execute()
        .await
        .map_err(Error::netlink(format!(
            "replacing the route local 0.0.0.0/0 dev lo table {table}"
        )))?;
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
/// A route netlink dump or deletion the kernel refuses.
pub async fn remove_policy_routing(
    netlink: &Netlink,
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
) -> Result<Vec<String>> {
    let handle = netlink.handle();
    let mut removed = Vec::new();
    let rule = format!("rule pref {priority} fwmark {mark:#x}/{mask:#x} lookup {table}");
    for found in policy_rules(handle, mark, mask, table, priority).await? {
        handle
            .rule()
            .del(found)
            .execute()
            .await
            .map_err(Error::netlink(format!("deleting the {rule}")))?;
        removed.push(rule.clone());
    }
    let route = format!("route local 0.0.0.0/0 dev lo table {table}");
    for found in local_routes(handle, table, loopback()?).await? {
        handle
            .route()
            .del(found)
            .execute()
            .await
            .map_err(Error::netlink(format!("deleting the {route}")))?;
        removed.push(route.clone());
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

/// The node's interfaces by index: name, and kind (`veth`, `bridge`, …; `None`
/// for plain devices such as loopback), from a dump of the links
/// (`RTM_GETLINK`).
///
/// # Errors
/// A failed dump.
pub async fn interfaces(netlink: &Netlink) -> Result<HashMap<u32, (String, Option<String>)>> {
    let mut links = netlink.handle().link().get().execute();
    let mut out = HashMap::new();
    while let Some(link) = links
        .try_next()
        .await
        .map_err(Error::netlink("dumping the links"))?
    {
        let mut name = None;
        let mut kind = None;
        for attribute in &link.attributes {
            match attribute {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::LinkInfo(infos) => {
                    kind = infos.iter().find_map(|i| match i {
                        LinkInfo::Kind(k) => Some(k.to_string()),
                        _ => None,
                    });
                }
                _ => {}
            }
        }
        if let Some(name) = name {
            out.insert(link.header.index, (name, kind));
        }
    }
    Ok(out)
}

/// The interface index of `name` in the current network namespace.
pub fn ifindex(name: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::testing::{in_new_network_namespace, ip};

    const MARK: u32 = 0x1000;
    const TABLE: u32 = 1339;
    const PRIORITY: u32 = 1339;

    #[test]
    fn ipv6_is_on_only_when_the_sysctl_reads_zero() {
        assert!(ipv6_enabled_from(Some("0\n")));
        assert!(!ipv6_enabled_from(Some("1\n")));
        assert!(!ipv6_enabled_from(None), "no sysctl: IPv6 not in this kernel");
        assert!(!ipv6_enabled_from(Some("")));
    }

    /// In a network namespace of its own (this thread's): the rule and route are
    /// those `ip` makes, installed once however often installed, and removed
    /// without what others put at the same preference or in the same table.
    /// Needs root (`unshare(CLONE_NEWNET)`) and `ip`.
    #[test]
    #[ignore = "needs root"]
    fn policy_routing_is_what_ip_makes_installed_once_and_removed_exactly() {
        in_new_network_namespace(|| async move {
            let shown = || {
                (
                    ip(&format!("-d -j -4 rule show pref {PRIORITY}")),
                    ip(&format!("-d -j -4 route show table {TABLE}")),
                )
            };
            let netlink = Netlink::open().unwrap();
            let install = async || {
                install_policy_routing(&netlink, MARK, MARK, TABLE, PRIORITY)
                    .await
                    .unwrap()
            };
            let remove = async || {
                remove_policy_routing(&netlink, MARK, MARK, TABLE, PRIORITY)
                    .await
                    .unwrap()
            };
            ip("link set lo up");
            // What `ip` makes.
            ip(&format!(
                "-4 rule add pref {PRIORITY} fwmark {MARK:#x}/{MARK:#x} lookup {TABLE}"
            ));
            ip(&format!(
                "-4 route replace local 0.0.0.0/0 dev lo table {TABLE}"
            ));
            let by_ip = shown();
            // Found as podlink's: not added again, and removed.
            install().await;
            assert_eq!(shown(), by_ip);
            let lines = [
                format!("rule pref {PRIORITY} fwmark {MARK:#x}/{MARK:#x} lookup {TABLE}"),
                format!("route local 0.0.0.0/0 dev lo table {TABLE}"),
            ];
            assert_eq!(remove().await, lines);
            // The same through route netlink, however often installed.
            install().await;
            install().await;
            assert_eq!(shown(), by_ip);
            // Others' rule at the preference and route in the table stay.
            ip(&format!(
                "-4 rule add pref {PRIORITY} fwmark 0x2000/0x2000 lookup {TABLE}"
            ));
            ip(&format!(
                "-4 route add local 10.1.0.0/16 dev lo table {TABLE}"
            ));
            assert_eq!(remove().await, lines);
            let (rules, routes) = shown();
            assert!(!rules.contains(&format!("{MARK:#x}")), "{rules}");
            assert!(rules.contains("0x2000"), "{rules}");
            assert!(!routes.contains("default"), "{routes}");
            assert!(routes.contains("10.1.0.0/16"), "{routes}");
            assert!(remove().await.is_empty());
        });
    }

    /// The interfaces this namespace has, as `ip` lists them.
    #[tokio::test]
    async fn interfaces_are_those_ip_shows() {
        let netlink = Netlink::open().unwrap();
        let found = interfaces(&netlink).await.unwrap();
        let links: serde_json::Value = serde_json::from_str(&ip("-j -d link show")).unwrap();
        let shown: HashMap<u32, (String, Option<String>)> = links
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["ifindex"].as_u64().unwrap() as u32,
                    (
                        l["ifname"].as_str().unwrap().to_string(),
                        l["linkinfo"]["info_kind"].as_str().map(str::to_string),
                    ),
                )
            })
            .collect();
        assert_eq!(found, shown);
    }
}
