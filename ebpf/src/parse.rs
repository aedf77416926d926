//! Packet parsing with direct packet access: Ethernet → IPv4 → TCP.
//!
//! Headers outside the linear part of the skb are pulled in with
//! `bpf_skb_pull_data` once; TCP that still cannot be read is reported, never
//! mistaken for "not TCP", so that it can be dropped instead of escaping capture.

use aya_ebpf::programs::TcContext;
use podlink_common::PodInfo;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_HOPOPTS: u8 = 0;
const IPV4_MIN_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
/// IPv4 flags and fragment offset: MF (0x2000) and the 13-bit offset.
const IP_MF_OFFSET: u16 = 0x3fff;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;
/// Minimal TCP header: ports, sequence numbers, offset and flags.
const TCP_MIN_HLEN: usize = 20;
/// Longest Ethernet + IPv4 (with options) + minimal TCP header.
const MAX_HEADERS: u32 = (ETH_HLEN + 60 + TCP_MIN_HLEN) as u32;

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

/// What a packet is, as far as capture is concerned.
pub enum Packet {
    /// IPv4 TCP with readable headers.
    Tcp4(Tcp4),
    /// Not IPv4 TCP and never captured: ARP, IPv6 UDP and ICMPv6, anything else
    /// that is not IP.
    Other,
    /// IPv4 but not TCP (UDP, ICMP, …): never captured; the source address (network
    /// order) is kept for the anti-spoofing check.
    Ipv4Other { saddr: u32 },
    /// An IPv4 TCP fragment.
    Fragment,
    /// TCP, or an IP header, that cannot be read.
    Unparsable,
    /// IPv6 carrying TCP or extension headers.
    Ipv6,
}

/// Headers not (yet) in the linear data.
struct Short;

#[inline(always)]
fn parse_linear(ctx: &TcContext) -> Result<Packet, Short> {
    let data = ctx.data();
    let end = ctx.data_end();
    if data + ETH_HLEN > end {
        return Err(Short);
    }
    // SAFETY: the Ethernet header is within bounds (checked above).
    let ethertype = u16::from_be(unsafe { *((data + 12) as *const u16) });
    let ip = data + ETH_HLEN;
    match ethertype {
        ETH_P_IP => {}
        ETH_P_IPV6 => {
            if ip + IPV6_HLEN > end {
                return Err(Short);
            }
            // SAFETY: the fixed IPv6 header is within bounds.
            let mut next = unsafe { *((ip + 6) as *const u8) };
            if next == IPPROTO_HOPOPTS {
                // MLD reports are ICMPv6 behind a hop-by-hop header: look one
                // header further.
                if ip + IPV6_HLEN + 2 > end {
                    return Err(Short);
                }
                // SAFETY: the first two bytes of the extension header are in bounds.
                next = unsafe { *((ip + IPV6_HLEN) as *const u8) };
            }
            return Ok(match next {
                IPPROTO_UDP | IPPROTO_ICMPV6 => Packet::Other,
                _ => Packet::Ipv6,
            });
        }
        _ => return Ok(Packet::Other),
    }
    if ip + IPV4_MIN_HLEN > end {
        return Err(Short);
    }
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
    if vihl >> 4 != 4 {
        return Ok(Packet::Unparsable);
    }
    if proto != IPPROTO_TCP {
        return Ok(Packet::Ipv4Other { saddr });
    }
    if frag & IP_MF_OFFSET != 0 {
        return Ok(Packet::Fragment);
    }
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if ihl < IPV4_MIN_HLEN {
        return Ok(Packet::Unparsable);
    }
    let tcp = ip + ihl;
    if tcp + TCP_MIN_HLEN > end {
        return Err(Short);
    }
    // SAFETY: the minimal TCP header is within bounds (checked above).
    let (sport, dport, flags) = unsafe {
        (
            u16::from_be(*(tcp as *const u16)),
            u16::from_be(*((tcp + 2) as *const u16)),
            *((tcp + 13) as *const u8),
        )
    };
    Ok(Packet::Tcp4(Tcp4 {
        saddr,
        daddr,
        sport,
        dport,
        flags,
    }))
}

/// Classifies the packet, pulling non-linear headers in once if needed.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Packet {
    match parse_linear(ctx) {
        Ok(packet) => packet,
        Err(Short) => {
            let want = if ctx.len() < MAX_HEADERS {
                ctx.len()
            } else {
                MAX_HEADERS
            };
            if ctx.pull_data(want).is_err() {
                return Packet::Unparsable;
            }
            parse_linear(ctx).unwrap_or(Packet::Unparsable)
        }
    }
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
