//! The node's network configuration the data path needs: policy routing for
//! assigned packets (route netlink, `RTM_NEWRULE` and `RTM_NEWROUTE`, through the
//! `rtnetlink` crate), sysctls, the node's interfaces, and the host veth behind a
//! pod address.
//!
//! Kernel documentation: `Documentation/networking/ip-sysctl.rst` (tcp_early_demux,
//! rp_filter); rtnetlink(7); `ip-rule(8)`, `ip-route(8)` for the same rule and
//! route as `ip` writes them.
//!
//! IPv6 needs the policy routing's twins (`ip -6 rule … lookup 1339`, `local ::/0
//! dev lo` in that table) and no sysctl in place of IPv4's `accept_local` and
//! `rp_filter`: IPv6 has neither, and its input path refuses only a loopback
//! (`::1`) or multicast source from a non-loopback device (`ipv6_rcv`), never a
//! source that is one of the node's own addresses or one routed elsewhere. Seen
//! on kernel 6.18 in two network namespaces (node and pod) joined by a veth, the
//! node with the rule and route above (the mark emulated by `iif <host veth>
//! lookup 1339`), `rp_filter=1` and `accept_local=0`: UDP datagrams to a
//! non-local address, received by an `IPV6_TRANSPARENT` socket bound to `[::]`,
//! arrive from the pod's address, from one of the node's own addresses and from
//! an address the node has no route to, with `net.ipv6.conf.all.forwarding` 0 or
//! 1 alike (local delivery does not forward); the IPv4 datagrams of the same
//! test from a node address or an unroutable one are dropped until
//! `accept_local=1` and `rp_filter=0`. `ip -6 route get <dst> from <src> iif
//! <host veth> mark 0x1000` shows the same (`local … table 1339`). IPv6 forwarding
//! is left to the CNI plugin that gives pods IPv6 (`ptp` turns it on): turning it
//! on here would make the node ignore router advertisements (`accept_ra=1`).
//! TCP early demux and `tcp_tw_reuse` have no IPv6 sysctls: `net.ipv4.*` covers
//! IPv6 TCP too (`ip6_rcv_finish_core` reads `net.ipv4.tcp_early_demux`).

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

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
    ipv6_enabled_from(
        std::fs::read_to_string(IPV6_DISABLED_SYSCTL)
            .ok()
            .as_deref(),
    )
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

/// An address family of the policy routing: IPv4, or its IPv6 twin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    /// Both families, IPv4 first.
    const ALL: [Family; 2] = [Family::V4, Family::V6];

    fn address_family(self) -> AddressFamily {
        match self {
            Family::V4 => AddressFamily::Inet,
            Family::V6 => AddressFamily::Inet6,
        }
    }

    fn ip_version(self) -> IpVersion {
        match self {
            Family::V4 => IpVersion::V4,
            Family::V6 => IpVersion::V6,
        }
    }

    /// The family's name in messages: `IPv4`, `IPv6`.
    fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// The default prefix as `ip` prints it: `0.0.0.0/0`, `::/0`.
    fn default_prefix(self) -> &'static str {
        match self {
            Family::V4 => "0.0.0.0/0",
            Family::V6 => "::/0",
        }
    }

    /// The unspecified address: `0.0.0.0`, `::`.
    fn unspecified(self) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        }
    }

    /// The rule as `ip` prints it, in [`remove_policy_routing`]'s lines: `rule`
    /// for IPv4 (as before IPv6 existed here), `-6 rule` for IPv6.
    fn rule_line(self, mark: u32, mask: u32, table: u32, priority: u32) -> String {
        let prefix = match self {
            Family::V4 => "",
            Family::V6 => "-6 ",
        };
        format!("{prefix}rule pref {priority} fwmark {mark:#x}/{mask:#x} lookup {table}")
    }

    /// The route as `ip` prints it, in [`remove_policy_routing`]'s lines.
    fn route_line(self, table: u32) -> String {
        let prefix = match self {
            Family::V4 => "",
            Family::V6 => "-6 ",
        };
        format!(
            "{prefix}route local {} dev lo table {table}",
            self.default_prefix()
        )
    }
}

/// Whether `rule` is podlink's of `family`: at `priority`, `fwmark <mark>/<mask>`
/// (no other selector, not inverted), `lookup <table>`.
fn is_policy_rule(
    rule: &RuleMessage,
    family: Family,
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
) -> bool {
    let header = &rule.header;
    if header.family != family.address_family()
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

/// Whether `route` is the table's `local 0.0.0.0/0 dev lo` (or, for IPv6,
/// `local ::/0 dev lo`; `lo` the loopback's index).
fn is_local_route(route: &RouteMessage, family: Family, table: u32, lo: u32) -> bool {
    let header = &route.header;
    if header.address_family != family.address_family()
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

/// Whether a route netlink request failed because the kernel has no such
/// address family (`EAFNOSUPPORT`: IPv6 not built in, or booted with
/// `ipv6.disable=1`).
fn no_such_family(error: &rtnetlink::Error) -> bool {
    matches!(error, rtnetlink::Error::NetlinkError(message)
        if message.raw_code() == -libc::EAFNOSUPPORT)
}

/// The rules of [`is_policy_rule`] of `family` in this network namespace. A kernel
/// without the family has none.
async fn policy_rules(
    handle: &Handle,
    family: Family,
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
) -> Result<Vec<RuleMessage>> {
    let found = handle
        .rule()
        .get(family.ip_version())
        .execute()
        .try_filter(|rule| {
            std::future::ready(is_policy_rule(rule, family, mark, mask, table, priority))
        })
        .try_collect()
        .await;
    match found {
        Err(e) if no_such_family(&e) => Ok(Vec::new()),
        found => found.map_err(Error::netlink(format!(
            "dumping the {} policy routing rules",
            family.name()
        ))),
    }
}

/// The routes of [`is_local_route`] of `family` in this network namespace.
async fn local_routes(
    handle: &Handle,
    family: Family,
    table: u32,
    lo: u32,
) -> Result<Vec<RouteMessage>> {
    let mut dump = RouteMessage::default();
    dump.header.address_family = family.address_family();
    let found = handle
        .route()
        .get(dump)
        .execute()
        .try_filter(|route| std::future::ready(is_local_route(route, family, table, lo)))
        .try_collect()
        .await;
    match found {
        Err(e) if no_such_family(&e) => Ok(Vec::new()),
        found => found.map_err(Error::netlink(format!(
            "dumping the {} routes",
            family.name()
        ))),
    }
}

/// The loopback's interface index.
fn loopback() -> Result<u32> {
    ifindex("lo").ok_or(Error::NoLoopback)
}

/// Installs `fwmark <mark>/<mask> lookup <table>` at preference `priority` and the
/// table's `local 0.0.0.0/0 dev lo` route, so that packets assigned to a proxy
/// socket by `from_pod` are delivered locally: the rule and route
/// `ip -4 rule add pref <priority> fwmark <mark>/<mask> lookup <table>` and
/// `ip -4 route replace local 0.0.0.0/0 dev lo table <table>` make. When `ipv6`
/// (the node has IPv6, [`ipv6_enabled`]), their IPv6 twins too (`ip -6 rule add
/// …` and `ip -6 route replace local ::/0 dev lo table <table>`). Idempotent: a
/// rule is added only when missing (rules of others at the same preference are
/// left alone), a route is replaced.
///
/// # Errors
/// A route netlink request the kernel refuses (`CAP_NET_ADMIN` is needed).
pub async fn install_policy_routing(
    netlink: &Netlink,
    mark: u32,
    mask: u32,
    table: u32,
    priority: u32,
    ipv6: bool,
) -> Result<()> {
    let handle = netlink.handle();
    let lo = loopback()?;
    for family in Family::ALL {
        if family == Family::V6 && !ipv6 {
            continue;
        }
        if policy_rules(handle, family, mark, mask, table, priority)
            .await?
            .is_empty()
        {
            let mut add = handle
                .rule()
                .add()
                .action(RuleAction::ToTable)
                .priority(priority)
                .fw_mark(mark)
                .table_id(table);
            let message = add.message_mut();
            message.header.family = family.address_family();
            message.attributes.push(RuleAttribute::FwMask(mask));
            message.header.table = header_table(table);
            add.execute().await.map_err(Error::netlink(format!(
                "adding the {}",
                family.rule_line(mark, mask, table, priority)
            )))?;
        }
        let mut route = RouteMessageBuilder::<IpAddr>::new()
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .protocol(RouteProtocol::Boot)
            .destination_prefix(family.unspecified(), 0)
            .expect("the unspecified address with prefix 0 is a destination")
            .output_interface(lo)
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
                "replacing the {}",
                family.route_line(table)
            )))?;
    }
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
/// Each change is recorded in `journal` first, for `podlink uninstall`. The TCP
/// sysctls cover IPv6 too; IPv6 forwarding is left as it is (turning it on would
/// make the node ignore router advertisements), said once (info) when it is off
/// on a node with IPv6 (`ipv6`).
pub fn apply_node_sysctls(journal: &SysctlJournal, ipv6: bool) -> Result<()> {
    journal.set("net.ipv4.tcp_early_demux", "0", None)?;
    journal.set("net.ipv4.ip_forward", "1", None)?;
    journal.set("net.ipv4.tcp_tw_reuse", "1", None)?;
    if journal.read("net.ipv4.conf.all.rp_filter")? == "1" {
        journal.set("net.ipv4.conf.all.rp_filter", "2", None)?;
        tracing::warn!(
            "net.ipv4.conf.all.rp_filter was 1 (strict), which drops captured inbound packets; set it to 2 (loose)"
        );
    }
    // IPv6 needs no sysctl of its own (the module's documentation); its
    // forwarding is the CNI plugin's, which turns it on for pods with IPv6.
    if ipv6
        && journal
            .read("net.ipv6.conf.all.forwarding")
            .is_ok_and(|v| v == "0")
    {
        tracing::info!(
            "net.ipv6.conf.all.forwarding is 0: this node routes no pod's IPv6 (the CNI plugin that gives pods IPv6 addresses turns it on); left as it is"
        );
    }
    Ok(())
}

/// Removes what [`install_policy_routing`] installed with the same arguments, for
/// both families (whether or not the node has IPv6 now): the `fwmark
/// <mark>/<mask> lookup <table>` rules at `priority` (every copy) and the table's
/// `local 0.0.0.0/0 dev lo` and `local ::/0 dev lo` routes. Other rules and
/// routes, also in that table, stay. Idempotent; returns what was removed, as
/// `ip` would print it (`rule …`, `route …` for IPv4, `-6 rule …`, `-6 route …`
/// for IPv6). A kernel without IPv6 has nothing of it to remove.
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
    let lo = loopback()?;
    let mut removed = Vec::new();
    for family in Family::ALL {
        let rule = family.rule_line(mark, mask, table, priority);
        for found in policy_rules(handle, family, mark, mask, table, priority).await? {
            handle
                .rule()
                .del(found)
                .execute()
                .await
                .map_err(Error::netlink(format!("deleting the {rule}")))?;
            removed.push(rule.clone());
        }
        let route = family.route_line(table);
        for found in local_routes(handle, family, table, lo).await? {
            handle
                .route()
                .del(found)
                .execute()
                .await
                .map_err(Error::netlink(format!("deleting the {route}")))?;
            removed.push(route.clone());
        }
    }
    Ok(removed)
}

/// Per-interface sysctls of a captured host veth: bounced packets arrive on it with
/// a source that is routed elsewhere (reverse-path filtering off), or with one of
/// the node's own addresses when the node answers a connection the proxy made for
/// the pod (`accept_local`; `from_pod` drops anything the pod itself sends with a
/// source other than its own address). Each change is recorded in `journal` first.
/// IPv6 needs none (see the module's documentation).
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
        assert!(
            !ipv6_enabled_from(None),
            "no sysctl: IPv6 not in this kernel"
        );
        assert!(!ipv6_enabled_from(Some("")));
    }

    /// A rule as `ip rule add pref PRIORITY fwmark MARK/MARK lookup TABLE` of
    /// `family` makes it (table in an attribute, it does not fit the header).
    fn rule_of(family: Family) -> RuleMessage {
        let mut rule = RuleMessage::default();
        rule.header.family = family.address_family();
        rule.header.action = RuleAction::ToTable;
        rule.header.table = RouteHeader::RT_TABLE_UNSPEC;
        rule.attributes = vec![
            RuleAttribute::Table(TABLE),
            RuleAttribute::Priority(PRIORITY),
            RuleAttribute::FwMark(MARK),
            RuleAttribute::FwMask(MARK),
        ];
        rule
    }

    /// A route as `ip route add local <default> dev lo table TABLE` of `family`
    /// makes it, `lo` index 1.
    fn route_of(family: Family) -> RouteMessage {
        let mut route = RouteMessage::default();
        route.header.address_family = family.address_family();
        route.header.kind = RouteType::Local;
        route.header.table = RouteHeader::RT_TABLE_UNSPEC;
        route.attributes = vec![RouteAttribute::Table(TABLE), RouteAttribute::Oif(1)];
        route
    }

    #[test]
    fn rules_and_routes_are_recognized_per_family() {
        for family in Family::ALL {
            let other = match family {
                Family::V4 => Family::V6,
                Family::V6 => Family::V4,
            };
            let rule = rule_of(family);
            assert!(is_policy_rule(&rule, family, MARK, MARK, TABLE, PRIORITY));
            assert!(
                !is_policy_rule(&rule, other, MARK, MARK, TABLE, PRIORITY),
                "{family:?}'s rule is not {other:?}'s"
            );
            let mut inverted = rule.clone();
            inverted.header.flags |= RuleFlags::Invert;
            assert!(!is_policy_rule(
                &inverted, family, MARK, MARK, TABLE, PRIORITY
            ));
            let mut with_iif = rule.clone();
            with_iif
                .attributes
                .push(RuleAttribute::Iifname("eth0".into()));
            assert!(!is_policy_rule(
                &with_iif, family, MARK, MARK, TABLE, PRIORITY
            ));
            assert!(!is_policy_rule(
                &rule,
                family,
                MARK,
                MARK,
                TABLE,
                PRIORITY + 1
            ));
            let route = route_of(family);
            assert!(is_local_route(&route, family, TABLE, 1));
            assert!(!is_local_route(&route, other, TABLE, 1));
            assert!(!is_local_route(&route, family, TABLE, 2), "not lo");
            let mut narrower = route.clone();
            narrower.header.destination_prefix_length = 16;
            assert!(!is_local_route(&narrower, family, TABLE, 1));
        }
        assert_eq!(
            Family::V6.rule_line(MARK, MARK, TABLE, PRIORITY),
            "-6 rule pref 1339 fwmark 0x1000/0x1000 lookup 1339"
        );
        assert_eq!(
            Family::V6.route_line(TABLE),
            "-6 route local ::/0 dev lo table 1339"
        );
    }

    /// In a network namespace of its own (this thread's): the rules and routes
    /// of both families are those `ip` makes, installed once however often
    /// installed, and removed without what others put at the same preference or
    /// in the same table; without IPv6, only IPv4's are installed. Needs root
    /// (`unshare(CLONE_NEWNET)`) and `ip`.
    #[test]
    #[ignore = "needs root"]
    fn policy_routing_is_what_ip_makes_installed_once_and_removed_exactly() {
        in_new_network_namespace(|| async move {
            let shown = || {
                ["-4", "-6"].map(|family| {
                    (
                        ip(&format!("-d -j {family} rule show pref {PRIORITY}")),
                        ip(&format!("-d -j {family} route show table {TABLE}")),
                    )
                })
            };
            let netlink = Netlink::open().unwrap();
            let install = async |ipv6| {
                install_policy_routing(&netlink, MARK, MARK, TABLE, PRIORITY, ipv6)
                    .await
                    .unwrap()
            };
            let remove = async || {
                remove_policy_routing(&netlink, MARK, MARK, TABLE, PRIORITY)
                    .await
                    .unwrap()
            };
            ip("link set lo up");
            assert!(ipv6_enabled(), "a new network namespace has IPv6");
            // What `ip` makes.
            for (family, default) in [("-4", "0.0.0.0/0"), ("-6", "::/0")] {
                ip(&format!(
                    "{family} rule add pref {PRIORITY} fwmark {MARK:#x}/{MARK:#x} lookup {TABLE}"
                ));
                ip(&format!(
                    "{family} route replace local {default} dev lo table {TABLE}"
                ));
            }
            let by_ip = shown();
            // Found as podlink's: not added again, and removed.
            install(true).await;
            assert_eq!(shown(), by_ip);
            let lines = [
                format!("rule pref {PRIORITY} fwmark {MARK:#x}/{MARK:#x} lookup {TABLE}"),
                format!("route local 0.0.0.0/0 dev lo table {TABLE}"),
                format!("-6 rule pref {PRIORITY} fwmark {MARK:#x}/{MARK:#x} lookup {TABLE}"),
                format!("-6 route local ::/0 dev lo table {TABLE}"),
            ];
            assert_eq!(remove().await, lines);
            // The same through route netlink, however often installed.
            install(true).await;
            install(true).await;
            assert_eq!(shown(), by_ip);
            // Others' rules at the preference and routes in the table stay.
            for (family, prefix) in [("-4", "10.1.0.0/16"), ("-6", "fd00:1::/64")] {
                ip(&format!(
                    "{family} rule add pref {PRIORITY} fwmark 0x2000/0x2000 lookup {TABLE}"
                ));
                ip(&format!(
                    "{family} route add local {prefix} dev lo table {TABLE}"
                ));
            }
            assert_eq!(remove().await, lines);
            let [(rules4, routes4), (rules6, routes6)] = shown();
            for (rules, routes, prefix) in [
                (rules4, routes4, "10.1.0.0/16"),
                (rules6, routes6, "fd00:1::/64"),
            ] {
                assert!(!rules.contains(&format!("{MARK:#x}")), "{rules}");
                assert!(rules.contains("0x2000"), "{rules}");
                assert!(!routes.contains("default"), "{routes}");
                assert!(routes.contains(prefix), "{routes}");
            }
            assert!(remove().await.is_empty());
            // Without IPv6, IPv4's only.
            install(false).await;
            let [(rules4, _), (rules6, routes6)] = shown();
            assert!(rules4.contains(&format!("{MARK:#x}")), "{rules4}");
            assert!(!rules6.contains(&format!("{MARK:#x}")), "{rules6}");
            assert!(!routes6.contains("default"), "{routes6}");
            assert_eq!(remove().await, lines[..2]);
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
