//! Types shared by podlink's eBPF programs (`ebpf/`) and its agent (`agent/`).
//!
//! Everything here is `#![no_std]` and `#[repr(C)]`: the same bytes are written by
//! the agent with `bpf(BPF_MAP_UPDATE_ELEM)` and read by the TC programs. The map
//! values carry BTF (the programs use BTF map definitions), so
//! `bpftool map dump pinned <pin-dir>/<map>` prints these structs with their field
//! names.
//!
//! Addresses are always 16 bytes wide: an IPv4 address is stored IPv4-mapped
//! (`::ffff:a.b.c.d`, RFC 4291 §2.5.5.2) so that IPv6 needs no change of layout.
#![no_std]
#![warn(missing_docs)]

/// Transparent listener for traffic leaving an enrolled pod (ztunnel's outbound port).
pub const OUTBOUND_PORT: u16 = 15001;
/// Transparent listener for plaintext traffic entering an enrolled pod.
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// HBONE (HTTP/2 CONNECT over mutual TLS) listener for traffic entering an enrolled pod.
pub const HBONE_PORT: u16 = 15008;
/// The agent's DNS server (UDP and TCP): enrolled pods' queries to port 53 are
/// steered to it (ztunnel's DNS port).
pub const DNS_PORT: u16 = 15053;
/// The DNS port (RFC 1035, 4.2): queries to it, UDP or TCP, at any address, are
/// captured.
pub const DNS_SERVICE_PORT: u16 = 53;

/// `SO_MARK` of every socket the proxy opens; the programs let such packets pass.
/// Same value and mask as ztunnel's own sockets.
pub const PROXY_MARK: u32 = 0x539;
/// Bits of `skb->mark` that hold [`PROXY_MARK`].
pub const PROXY_MARK_MASK: u32 = 0xfff;
/// Mark set on a packet after `bpf_sk_assign`; a policy routing rule sends packets
/// carrying it to a table whose only route is `local default dev lo`. Its bits do not
/// overlap [`PROXY_MARK_MASK`].
pub const REDIRECT_MARK: u32 = 0x1000;
/// Bits of `skb->mark` that hold [`REDIRECT_MARK`].
pub const REDIRECT_MARK_MASK: u32 = 0x1000;
/// Routing table that holds the `local default dev lo` routes.
pub const ROUTE_TABLE: u32 = 1339;
/// Preference of the `fwmark` policy routing rule (before `main` at 32766).
pub const RULE_PRIORITY: u32 = 1339;

/// Name of the TC ingress program of a host veth (packets leaving the pod).
pub const PROG_FROM_POD: &str = "from_pod";
/// Name of the TC egress program of a host veth (packets entering the pod).
pub const PROG_TO_POD: &str = "to_pod";

/// Version of the pin layout: the maps' names, types, key and value layouts and
/// capacities, and where links are pinned. Pins live under
/// `<pin-dir>/v<LAYOUT_VERSION>/`; an agent finding another version there migrates
/// it or refuses to start, so that its programs never read maps of another layout.
/// Raise it with any change to a map's layout or to the pin paths.
///
/// * 1: the maps of [`MAP_NAMES`] and `links/`, as before versions (which kept them
///   directly under `<pin-dir>`).
/// * 2: [`MAP_CAPTURED_FLOWS`]' value is the host veth ifindex (`u32`) a flow was
///   taken over on, where it was a `u8` (1), so that the programs' fast path needs
///   no lookup of the pod.
/// * 3: [`PodCounters`] lost `dropped_ipv6` (IPv6 TCP is captured), so
///   [`MAP_COUNTERS`]' value is 13 counters where it was 14.
/// * 4: [`PodCounters`] gained `captured_dns` (DNS queries, counted in
///   `captured_outbound` before), last: 14 counters again, but not version 2's.
pub const LAYOUT_VERSION: u32 = 4;
/// The layout version before [`LAYOUT_VERSION`], which agents migrate from: the
/// same maps and pin paths but for [`MAP_COUNTERS`]' value (13 counters, without
/// `captured_dns`). Versions 2 and 1 (also migrated) differ from it in that
/// value too (14 counters, with `dropped_ipv6` 12th), and version 1 in
/// [`MAP_CAPTURED_FLOWS`]' value (`u8`).
pub const PREVIOUS_LAYOUT_VERSION: u32 = 3;
/// The oldest layout version agents migrate from.
pub const OLDEST_LAYOUT_VERSION: u32 = 1;
/// Directory, under the versioned pin directory, of the TCX link pins
/// (`<ifindex>_<program>`).
pub const LINKS_DIR: &str = "links";

/// Map: host veth ifindex (`u32`) → [`PodInfo`].
pub const MAP_PODS: &str = "pods";
/// Map: a single [`Config`] at index 0.
pub const MAP_CONFIG: &str = "config";
/// Map: LPM trie of destination prefixes ([`CidrKey`]) that bypass capture.
pub const MAP_EXCLUDED_CIDRS: &str = "excluded_cidrs";
/// Map: destination TCP port (`u16`) → `u8`; ports that bypass capture.
pub const MAP_EXCLUDED_PORTS: &str = "excluded_ports";
/// Map: host veth ifindex (`u32`) → per-CPU [`PodCounters`].
pub const MAP_COUNTERS: &str = "pod_counters";
/// Map (LRU): [`FlowKey`] → host veth ifindex (`u32`); flows the proxy took over and
/// the veth it took each over on, so that later packets on that veth are delivered
/// to the proxy with one lookup, and stray packets are dropped rather than passed
/// once the proxy's socket is gone.
pub const MAP_CAPTURED_FLOWS: &str = "captured_flows";
/// All maps the programs use, in pin order.
pub const MAP_NAMES: [&str; 6] = [
    MAP_PODS,
    MAP_CONFIG,
    MAP_EXCLUDED_CIDRS,
    MAP_EXCLUDED_PORTS,
    MAP_COUNTERS,
    MAP_CAPTURED_FLOWS,
];

/// Capacity of the pods and counters maps (host veths on one node).
pub const MAX_PODS: u32 = 16384;
/// Capacity of the excluded-CIDR trie.
pub const MAX_EXCLUDED_CIDRS: u32 = 1024;
/// Capacity of the excluded-port set.
pub const MAX_EXCLUDED_PORTS: u32 = 256;
/// Capacity of the captured-flows LRU map (flows per node).
pub const MAX_CAPTURED_FLOWS: u32 = 65536;
/// Number of node addresses [`Config`] can hold.
pub const MAX_NODE_ADDRS: usize = 8;

/// An IPv6 address, or an IPv4 address in IPv4-mapped form, in network byte order.
pub type Addr = [u8; 16];

/// [`PodInfo::flags`]: the pod's traffic is captured.
pub const POD_ENROLLED: u32 = 1 << 0;
/// [`PodInfo::flags`]: [`PodInfo::ipv4`] holds an address.
pub const POD_HAS_IPV4: u32 = 1 << 1;
/// [`PodInfo::flags`]: [`PodInfo::ipv6`] holds an address.
pub const POD_HAS_IPV6: u32 = 1 << 2;
/// [`PodInfo::flags`]: the pod left the mesh and drains: packets of the flows
/// the proxy already carries still go to it, new connections (SYNs either way)
/// are not captured. The agent detaches the pod once the proxy carries none of
/// its flows, or its drain bound passed.
pub const POD_DRAINING: u32 = 1 << 3;
/// [`PodInfo::flags`]: the pod's DNS queries (UDP and TCP to port 53, any
/// address) go to the agent's DNS server ([`Config::dns_port`]). Unset for a pod
/// annotated `ambient.istio.io/dns-capture: "false"`, and for every pod when the
/// agent runs with `--dns-capture=false`.
pub const POD_DNS_CAPTURE: u32 = 1 << 4;

/// Value of the pods map: one enrolled pod, keyed by its host veth's ifindex.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodInfo {
    /// The pod's IPv4 address, IPv4-mapped; zero when the pod has none.
    pub ipv4: Addr,
    /// The pod's IPv6 address; zero when the pod has none.
    pub ipv6: Addr,
    /// `POD_*` flags.
    pub flags: u32,
    /// The agent's number for the workload, to correlate map entries with workloads.
    pub workload_id: u32,
}

/// [`Config::flags`]: an enrolled pod whose listener is missing passes its traffic
/// uncaptured instead of dropping it (fail open). Off by default: fail closed.
pub const CONFIG_FAIL_OPEN: u32 = 1 << 0;

/// [`Config::flags`]: the proxy is draining. New connections of enrolled pods are
/// handled as if its listeners were gone (dropped, or passed under
/// [`CONFIG_FAIL_OPEN`]) while the listeners still accept the handshakes already
/// under way, so that closing them resets no connection. The next agent clears it
/// when it writes the config map.
pub const CONFIG_DRAINING: u32 = 1 << 1;

/// Value of the config map (one entry, index 0). Written by the agent at start.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// `SO_MARK` of the proxy's sockets.
    pub proxy_mark: u32,
    /// Bits of `skb->mark` compared with `proxy_mark`.
    pub proxy_mark_mask: u32,
    /// Mark set after a socket assignment (policy routing to local delivery).
    pub redirect_mark: u32,
    /// Bits of `skb->mark` replaced by `redirect_mark`.
    pub redirect_mark_mask: u32,
    /// Outbound listener port, host byte order.
    pub outbound_port: u16,
    /// Inbound plaintext listener port, host byte order.
    pub inbound_plaintext_port: u16,
    /// HBONE listener port, host byte order.
    pub hbone_port: u16,
    /// The agent's DNS server port (UDP and TCP), host byte order; zero: DNS is
    /// not captured. (Padding, zero, in the agents before DNS capture: the
    /// layout is the same.)
    pub dns_port: u16,
    /// `CONFIG_*` flags.
    pub flags: u32,
    /// Number of valid entries in `node_addrs`.
    pub node_addr_count: u32,
    /// The node's own addresses; packets from them to a pod (kubelet probes) pass.
    pub node_addrs: [Addr; MAX_NODE_ADDRS],
}

impl Config {
    /// podlink's ports and marks ([`OUTBOUND_PORT`], [`PROXY_MARK`], …), with
    /// `flags` and no node addresses.
    pub const fn with_defaults(flags: u32) -> Self {
        Self {
            proxy_mark: PROXY_MARK,
            proxy_mark_mask: PROXY_MARK_MASK,
            redirect_mark: REDIRECT_MARK,
            redirect_mark_mask: REDIRECT_MARK_MASK,
            outbound_port: OUTBOUND_PORT,
            inbound_plaintext_port: INBOUND_PLAINTEXT_PORT,
            hbone_port: HBONE_PORT,
            dns_port: DNS_PORT,
            flags,
            node_addr_count: 0,
            node_addrs: [[0; 16]; MAX_NODE_ADDRS],
        }
    }
}

/// Key of the excluded-CIDR LPM trie (`struct bpf_lpm_trie_key` layout).
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CidrKey {
    /// Prefix length in bits over the 16-byte address (IPv4 prefixes add 96).
    pub prefix_len: u32,
    /// The prefix, IPv4-mapped for IPv4.
    pub addr: Addr,
}

/// Key of the captured-flows map: a TCP 4-tuple as `from_pod` sees the flow's
/// packets (source first). Ports in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowKey {
    /// Source address.
    pub saddr: Addr,
    /// Destination address.
    pub daddr: Addr,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

impl FlowKey {
    /// The key of an IPv4 flow: addresses as four octets in network order, ports
    /// in host byte order.
    pub const fn ipv4(saddr: [u8; 4], daddr: [u8; 4], sport: u16, dport: u16) -> Self {
        Self {
            saddr: ipv4_mapped(saddr),
            daddr: ipv4_mapped(daddr),
            sport,
            dport,
        }
    }
}

/// Value of the per-CPU counters map: packets seen on one pod's host veth, by outcome.
/// Sum over CPUs for totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    /// SYNs from the pod assigned to the outbound listener (its DNS over TCP is
    /// counted in `captured_dns`).
    pub captured_outbound: u64,
    /// SYNs to the pod's HBONE port assigned to the HBONE listener.
    pub captured_inbound_hbone: u64,
    /// SYNs to the pod assigned to the inbound plaintext listener.
    pub captured_inbound_plaintext: u64,
    /// Packets assigned to an existing proxy socket after a socket lookup: flows
    /// the proxy opened itself (until the captured-flows map knows them), flows
    /// whose map entry was evicted, any proxy flow while the proxy drains. Later
    /// packets of flows in the captured-flows map take the fast path and are not
    /// counted (the proxy counts their bytes).
    pub assigned_established: u64,
    /// Packets to the pod bounced to the host veth's ingress for assignment: new
    /// connections, and packets of proxy flows found by a socket lookup (those on
    /// the fast path are not counted).
    pub bounced: u64,
    /// Packets passed untouched (flows from before enrollment, node traffic,
    /// excluded destinations, non-TCP), and the SYN of each connection the proxy
    /// opens into the pod (its later packets are not counted).
    pub passed: u64,
    /// Dropped: a new connection while no proxy listener exists (fail closed).
    pub dropped_no_listener: u64,
    /// Dropped: a bounced packet found no proxy socket (it would loop).
    pub dropped_bounce_miss: u64,
    /// Dropped: `bpf_sk_assign` failed.
    pub dropped_assign_failed: u64,
    /// Dropped: a TCP fragment (its ports cannot be seen, so it cannot be steered).
    pub dropped_fragment: u64,
    /// Dropped: TCP whose headers cannot be read (truncated or malformed).
    pub dropped_unparsable: u64,
    /// Dropped: a packet of a flow the proxy had taken over whose socket is gone
    /// (for example after the agent stopped); passing it would leak it in plain text.
    pub dropped_flow_gone: u64,
    /// Dropped: a packet from the pod whose source is not the pod's address. IPv6
    /// may also come from a link-local or the unspecified address (neighbour
    /// discovery, MLD), but IPv6 TCP from a link-local address only to a
    /// link-local one, and never from the unspecified address.
    pub dropped_spoofed: u64,
    /// The pod's DNS assigned to the agent's DNS server: UDP queries and TCP
    /// SYNs to port 53.
    pub captured_dns: u64,
}

impl PodCounters {
    /// Adds `other` to these counters, field by field (summing the per-CPU values
    /// of one pod). Adding a field without adding it here fails to compile.
    pub fn add(&mut self, other: &PodCounters) {
        let PodCounters {
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
        } = *other;
        self.captured_outbound += captured_outbound;
        self.captured_inbound_hbone += captured_inbound_hbone;
        self.captured_inbound_plaintext += captured_inbound_plaintext;
        self.assigned_established += assigned_established;
        self.bounced += bounced;
        self.passed += passed;
        self.dropped_no_listener += dropped_no_listener;
        self.dropped_bounce_miss += dropped_bounce_miss;
        self.dropped_assign_failed += dropped_assign_failed;
        self.dropped_fragment += dropped_fragment;
        self.dropped_unparsable += dropped_unparsable;
        self.dropped_flow_gone += dropped_flow_gone;
        self.dropped_spoofed += dropped_spoofed;
        self.captured_dns += captured_dns;
    }

    /// Every counter with its field name (as `bpftool` prints it from BTF), in
    /// declaration order. Adding a field without naming it here fails to compile.
    pub const fn named(&self) -> [(&'static str, u64); 14] {
        let PodCounters {
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
        } = *self;
        [
            ("captured_outbound", captured_outbound),
            ("captured_inbound_hbone", captured_inbound_hbone),
            ("captured_inbound_plaintext", captured_inbound_plaintext),
            ("assigned_established", assigned_established),
            ("bounced", bounced),
            ("passed", passed),
            ("dropped_no_listener", dropped_no_listener),
            ("dropped_bounce_miss", dropped_bounce_miss),
            ("dropped_assign_failed", dropped_assign_failed),
            ("dropped_fragment", dropped_fragment),
            ("dropped_unparsable", dropped_unparsable),
            ("dropped_flow_gone", dropped_flow_gone),
            ("dropped_spoofed", dropped_spoofed),
            ("captured_dns", captured_dns),
        ]
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all five are `#[repr(C)]` plain data with no padding holes that the
    // kernel would interpret, and every bit pattern is a valid value.
    unsafe impl aya::Pod for super::PodInfo {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::CidrKey {}
    unsafe impl aya::Pod for super::PodCounters {}
    unsafe impl aya::Pod for super::FlowKey {}
}

/// Converts an IPv4 address (four octets, network order) to the 16-byte map form.
pub const fn ipv4_mapped(octets: [u8; 4]) -> Addr {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, octets[0], octets[1], octets[2], octets[3],
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_what_the_programs_read() {
        assert_eq!(core::mem::size_of::<PodInfo>(), 40);
        assert_eq!(core::mem::size_of::<CidrKey>(), 20);
        assert_eq!(core::mem::size_of::<Config>(), 32 + 16 * MAX_NODE_ADDRS);
        assert_eq!(core::mem::size_of::<PodCounters>(), 14 * 8);
        assert_eq!(core::mem::size_of::<FlowKey>(), 36);
    }

    #[test]
    fn every_counter_is_named_once() {
        let named = PodCounters::default().named();
        assert_eq!(named.len() * 8, core::mem::size_of::<PodCounters>());
        for (i, (a, _)) in named.iter().enumerate() {
            assert!(named[i + 1..].iter().all(|(b, _)| a != b), "{a} twice");
        }
        let c = PodCounters {
            dropped_spoofed: 7,
            ..Default::default()
        };
        assert_eq!(c.named()[12], ("dropped_spoofed", 7));
    }

    #[test]
    fn ipv4_mapped_form() {
        let a = ipv4_mapped([10, 1, 2, 3]);
        assert_eq!(&a[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(&a[12..], &[10, 1, 2, 3]);
    }

    #[test]
    fn marks_do_not_overlap() {
        assert_eq!(PROXY_MARK_MASK & REDIRECT_MARK_MASK, 0);
        assert_eq!(PROXY_MARK & !PROXY_MARK_MASK, 0);
        assert_eq!(REDIRECT_MARK & !REDIRECT_MARK_MASK, 0);
    }
}
