//! Packet parsing with direct packet access: Ethernet → IPv4 → TCP.

use aya_ebpf::programs::TcContext;
use podlink_common::PodInfo;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IPPROTO_TCP: u8 = 6;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;
/// Minimal TCP header: ports, sequence numbers, offset and flags.
const TCP_MIN_HLEN: usize = 20;

/// The fields of an IPv4 TCP segment the programs decide on. Addresses stay in
/// network byte order (as `bpf_sock_tuple` wants them); ports are host order.
pub struct Tcp4 {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
}

impl Tcp4 {
    /// A connection request: SYN without ACK.
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    }
}

/// Parses an IPv4 TCP segment. `None` for anything else (other ethertypes, IPv6,
/// other protocols, non-first fragments, truncated headers): such packets pass.
#[inline(always)]
pub fn tcp4(ctx: &TcContext) -> Option<Tcp4> {
    let data = ctx.data();
    let end = ctx.data_end();
    if data + ETH_HLEN + 20 > end {
        return None;
    }
    // SAFETY: bounds checked against data_end just above.
    let ethertype = u16::from_be(unsafe { *((data + 12) as *const u16) });
    if ethertype != ETH_P_IP {
        return None;
    }
    let ip = data + ETH_HLEN;
    // SAFETY: the whole 20-byte IPv4 header is within bounds (checked above).
    let (vihl, proto, frag, saddr, daddr) = unsafe {
        (
            *(ip as *const u8),
            *((ip + 9) as *const u8),
            u16::from_be(*((ip + 6) as *const u16)),
            *((ip + 12) as *const u32),
            *((ip + 16) as *const u32),
        )
    };
    if vihl >> 4 != 4 || proto != IPPROTO_TCP || frag & 0x1fff != 0 {
        return None;
    }
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if ihl < 20 {
        return None;
    }
    let tcp = ip + ihl;
    if tcp + TCP_MIN_HLEN > end {
        return None;
    }
    // SAFETY: the minimal TCP header is within bounds (checked above).
    let (sport, dport, flags) = unsafe {
        (
            u16::from_be(*(tcp as *const u16)),
            u16::from_be(*((tcp + 2) as *const u16)),
            *((tcp + 13) as *const u8),
        )
    };
    Some(Tcp4 {
        saddr,
        daddr,
        sport,
        dport,
        flags,
    })
}

/// Whether `addr` (network order) is the pod's IPv4 address.
#[inline(always)]
pub fn is_pod_ipv4(pod: &PodInfo, addr: u32) -> bool {
    pod.flags & podlink_common::POD_HAS_IPV4 != 0 && ipv4_of(&pod.ipv4) == addr
}

/// The IPv4 address (network order, as read from a packet) of an IPv4-mapped `Addr`.
#[inline(always)]
pub fn ipv4_of(addr: &[u8; 16]) -> u32 {
    u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]])
}
