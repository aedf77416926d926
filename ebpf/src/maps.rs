//! The maps (BTF definitions, pinned by the agent) and small accessors.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuHashMap, lpm_trie::Key},
    macros::btf_map,
};
use podlink_common::{
    Addr, Config, FlowKey, MAX_CAPTURED_FLOWS, MAX_EXCLUDED_CIDRS, MAX_EXCLUDED_PORTS,
    MAX_NODE_ADDRS, MAX_PODS, PodCounters, PodInfo,
};

use crate::{
    parse::{Ip6, ipv4_of},
    tcp::{FlowKeyBytes, Tcp},
};

/// Host veth ifindex → the enrolled pod behind it.
#[btf_map(name = "pods")]
static PODS: HashMap<u32, PodInfo, { MAX_PODS as usize }> = HashMap::new();

/// The proxy's ports and marks and the node's addresses, at index 0.
#[btf_map(name = "config")]
static CONFIG: Array<Config, 1> = Array::new();

/// Destination prefixes that bypass capture.
#[btf_map(name = "excluded_cidrs")]
static EXCLUDED_CIDRS: LpmTrie<Addr, u8, { MAX_EXCLUDED_CIDRS as usize }> = LpmTrie::new();

/// Destination ports that bypass capture.
#[btf_map(name = "excluded_ports")]
static EXCLUDED_PORTS: HashMap<u16, u8, { MAX_EXCLUDED_PORTS as usize }> = HashMap::new();

/// Host veth ifindex → per-CPU packet counters.
#[btf_map(name = "pod_counters")]
static COUNTERS: PerCpuHashMap<u32, PodCounters, { MAX_PODS as usize }> = PerCpuHashMap::new();

/// Flows the proxy took over (see [`remember_flow`]) → the host veth ifindex they
/// were taken over on.
#[btf_map(name = "captured_flows")]
static CAPTURED_FLOWS: LruHashMap<FlowKey, u32, { MAX_CAPTURED_FLOWS as usize }> =
    LruHashMap::new();

/// The bytes of a [`FlowKey`] for IPv4, written as words. Built as a
/// `FlowKey` (16-byte arrays, 2-byte alignment), the key took two calls of a
/// byte-by-byte `memset` subprogram (10 iterations each) and byte stores of the
/// addresses per lookup: the verifier wants aligned stack accesses, so LLVM
/// could not write the arrays wider than their alignment.
#[repr(C, align(8))]
pub struct FlowKeyWords {
    /// Bytes 0..8 of the IPv4-mapped source address: zero.
    saddr_zero: u64,
    /// Bytes 8..12: `0, 0, 0xff, 0xff`.
    saddr_mapped: u32,
    /// The source address, network order.
    saddr: u32,
    daddr_zero: u64,
    daddr_mapped: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
}

// The words lie where `FlowKey`'s fields are.
const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(offset_of!(FlowKeyWords, saddr) == offset_of!(FlowKey, saddr) + 12);
    assert!(offset_of!(FlowKeyWords, daddr_zero) == offset_of!(FlowKey, daddr));
    assert!(offset_of!(FlowKeyWords, daddr) == offset_of!(FlowKey, daddr) + 12);
    assert!(offset_of!(FlowKeyWords, sport) == offset_of!(FlowKey, sport));
    assert!(offset_of!(FlowKeyWords, dport) == offset_of!(FlowKey, dport));
    assert!(size_of::<FlowKeyWords>() >= size_of::<FlowKey>());
};

/// `0, 0, 0xff, 0xff` (bytes 8..12 of an IPv4-mapped address) as a native word.
const MAPPED: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

impl FlowKeyBytes for FlowKeyWords {
    #[inline(always)]
    fn key(&self) -> &FlowKey {
        // SAFETY: same size or larger, stricter alignment, and every byte of
        // `FlowKey`'s layout written (offsets checked above); `FlowKey` is plain
        // bytes and integers.
        unsafe { &*(self as *const Self).cast::<FlowKey>() }
    }
}

impl FlowKeyWords {
    /// The key of an IPv4 flow (addresses network order, ports host order).
    #[inline(always)]
    pub fn new(saddr: u32, daddr: u32, sport: u16, dport: u16) -> Self {
        Self {
            saddr_zero: 0,
            saddr_mapped: MAPPED,
            saddr,
            daddr_zero: 0,
            daddr_mapped: MAPPED,
            daddr,
            sport,
            dport,
        }
    }
}

/// The bytes of a [`FlowKey`] for IPv6, written as words for the reason
/// [`FlowKeyWords`] gives: the full 16-byte addresses.
#[repr(C, align(4))]
pub struct FlowKeyWords6 {
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport: u16,
    dport: u16,
}

// The words lie where `FlowKey`'s fields are, and cover all of it.
const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(offset_of!(FlowKeyWords6, saddr) == offset_of!(FlowKey, saddr));
    assert!(offset_of!(FlowKeyWords6, daddr) == offset_of!(FlowKey, daddr));
    assert!(offset_of!(FlowKeyWords6, sport) == offset_of!(FlowKey, sport));
    assert!(offset_of!(FlowKeyWords6, dport) == offset_of!(FlowKey, dport));
    assert!(size_of::<FlowKeyWords6>() == size_of::<FlowKey>());
};

impl FlowKeyBytes for FlowKeyWords6 {
    #[inline(always)]
    fn key(&self) -> &FlowKey {
        // SAFETY: the same size, stricter alignment, every byte written (offsets
        // checked above, no padding); `FlowKey` is plain bytes and integers.
        unsafe { &*(self as *const Self).cast::<FlowKey>() }
    }
}

impl FlowKeyWords6 {
    /// The key of an IPv6 flow (ports host order).
    #[inline(always)]
    pub fn new(saddr: &Ip6, daddr: &Ip6, sport: u16, dport: u16) -> Self {
        Self {
            saddr: saddr.0,
            daddr: daddr.0,
            sport,
            dport,
        }
    }
}

/// Records that the flow of `pkt` (as `from_pod` sees it on host veth `ifindex`)
/// is the proxy's.
#[inline(always)]
pub fn remember_flow<P: Tcp>(pkt: &P, ifindex: u32) {
    let key = pkt.flow_key();
    let _ = CAPTURED_FLOWS.insert(key.key(), ifindex, 0);
}

/// Forgets the flow of `pkt` (a SYN that is not captured), so that an earlier
/// captured flow of the same 4-tuple cannot steer it.
#[inline(always)]
pub fn forget_flow<P: Tcp>(pkt: &P) {
    let key = pkt.flow_key();
    let _ = CAPTURED_FLOWS.remove(key.key());
}

/// Records the flow of the proxy's own connection into the pod (a SYN seen by
/// `to_pod` on host veth `ifindex`), keyed as `from_pod` will see the pod's
/// replies.
#[inline(always)]
pub fn remember_reply_flow<P: Tcp>(pkt: &P, ifindex: u32) {
    let key = pkt.reply_flow_key();
    // SAFETY: a plain value read. An update of a present key would replace its
    // element: looking first is cheaper when 4-tuples are reused.
    if unsafe { CAPTURED_FLOWS.get(key.key()) }.copied() != Some(ifindex) {
        let _ = CAPTURED_FLOWS.insert(key.key(), ifindex, 0);
    }
}

/// The host veth ifindex on which the proxy took over the flow of `pkt` (keyed as
/// `from_pod` sees it), if it did.
#[inline(always)]
pub fn captured_on<P: Tcp>(pkt: &P) -> Option<u32> {
    let key = pkt.flow_key();
    // SAFETY: a plain value read.
    unsafe { CAPTURED_FLOWS.get(key.key()) }.copied()
}

#[inline(always)]
pub fn pod(ifindex: u32) -> Option<&'static PodInfo> {
    // SAFETY: the agent replaces entries whole; a concurrent update can at worst
    // show this packet the old or the new pod, both valid values.
    unsafe { PODS.get(ifindex) }
}

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

/// Adds one to a counter of this CPU's slot of the pod behind host veth `ifindex`,
/// if it has counters. The lookup is made here, on the one path that counts, so
/// that paths which count nothing do not pay for it.
#[inline(always)]
pub fn count(ifindex: u32, field: impl FnOnce(&mut PodCounters) -> &mut u64) {
    if let Some(c) = COUNTERS.get_ptr_mut(ifindex) {
        // SAFETY: a per-CPU slot: only this program invocation writes it now.
        unsafe { *field(&mut *c) += 1 };
    }
}

/// Whether the outbound destination of `pkt` (address and port) bypasses capture.
#[inline(always)]
pub fn is_excluded<P: Tcp>(pkt: &P) -> bool {
    is_excluded_port(pkt.dport()) || pkt.is_excluded_daddr()
}

/// Whether an IPv4 destination (network order) is in an excluded prefix: the
/// trie is looked up with its IPv4-mapped form, prefix length 128.
#[inline(always)]
pub fn is_excluded_cidr(daddr: u32) -> bool {
    let key = CidrKeyWords {
        prefix_len: 128,
        zero: [0; 2],
        mapped: MAPPED,
        addr: daddr,
    };
    EXCLUDED_CIDRS.get(key.key()).is_some()
}

/// Whether an IPv6 destination is in an excluded prefix: the trie is looked up
/// with the full address, prefix length 128 (the agent writes IPv6 prefixes as
/// they are, IPv4 ones IPv4-mapped with 96 added to their length).
#[inline(always)]
pub fn is_excluded_cidr6(daddr: &Ip6) -> bool {
    let key = CidrKeyWords6 {
        prefix_len: 128,
        addr: daddr.0,
    };
    EXCLUDED_CIDRS.get(key.key()).is_some()
}

/// The bytes of an excluded-CIDRs lookup key for an IPv6 address, written as
/// words for the reason [`FlowKeyWords`] gives.
#[repr(C, align(4))]
struct CidrKeyWords6 {
    prefix_len: u32,
    addr: [u32; 4],
}

const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(offset_of!(CidrKeyWords6, addr) == offset_of!(Key<Addr>, data));
    assert!(size_of::<CidrKeyWords6>() == size_of::<Key<Addr>>());
};

impl CidrKeyWords6 {
    /// The key, as the trie reads it.
    #[inline(always)]
    fn key(&self) -> &Key<Addr> {
        // SAFETY: as for `CidrKeyWords::key`.
        unsafe { &*(self as *const Self).cast::<Key<Addr>>() }
    }
}

/// The bytes of an excluded-CIDRs lookup key (a full-length IPv4-mapped
/// address), written as words for the reason [`FlowKeyWords`] gives.
#[repr(C, align(4))]
struct CidrKeyWords {
    prefix_len: u32,
    /// Bytes 0..8 of the IPv4-mapped address: zero.
    zero: [u32; 2],
    /// Bytes 8..12: `0, 0, 0xff, 0xff`.
    mapped: u32,
    /// The address, network order.
    addr: u32,
}

// The words lie where the trie key's fields are.
const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(offset_of!(CidrKeyWords, zero) == offset_of!(Key<Addr>, data));
    assert!(offset_of!(CidrKeyWords, addr) == offset_of!(Key<Addr>, data) + 12);
    assert!(size_of::<CidrKeyWords>() == size_of::<Key<Addr>>());
};

impl CidrKeyWords {
    /// The key, as the trie reads it.
    #[inline(always)]
    fn key(&self) -> &Key<Addr> {
        // SAFETY: the same size, stricter alignment (the trie key is packed),
        // every byte written (offsets checked above), plain integers and bytes.
        unsafe { &*(self as *const Self).cast::<Key<Addr>>() }
    }
}

#[inline(always)]
pub fn is_excluded_port(port: u16) -> bool {
    // SAFETY: a plain value read.
    unsafe { EXCLUDED_PORTS.get(port).is_some() }
}

/// Whether `addr` (IPv4, network order) is one of the node's own addresses.
#[inline(always)]
pub fn is_node_addr(cfg: &Config, addr: u32) -> bool {
    let n = cfg.node_addr_count as usize;
    let mut i = 0;
    while i < MAX_NODE_ADDRS {
        if i >= n {
            return false;
        }
        if ipv4_of(&cfg.node_addrs[i]) == addr && cfg.node_addrs[i][10] == 0xff {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether `addr` (IPv6) is one of the node's own IPv6 addresses (stored as they
/// are; the IPv4-mapped entries never equal an address read from an IPv6 packet).
#[inline(always)]
pub fn is_node_addr6(cfg: &Config, addr: &Ip6) -> bool {
    const _: () = assert!(
        core::mem::offset_of!(Config, node_addrs) % 4 == 0 && core::mem::align_of::<Config>() >= 4
    );
    let n = cfg.node_addr_count as usize;
    let mut i = 0;
    while i < MAX_NODE_ADDRS {
        if i >= n {
            return false;
        }
        // SAFETY: each entry is 16 bytes at a 4-aligned offset of a 4-aligned
        // `Config` (asserted above).
        let node = Ip6(unsafe { *(cfg.node_addrs[i].as_ptr() as *const [u32; 4]) });
        if node.eq(addr) {
            return true;
        }
        i += 1;
    }
    false
}
