//! Packet parsing with direct packet access: Ethernet → IPv4 → TCP or UDP, and
//! Ethernet → IPv6 → (extension headers) → TCP or UDP.
//!
//! Headers outside the linear part of the skb are pulled in with
//! `bpf_skb_pull_data` once; TCP that still cannot be read is reported, never
//! mistaken for "not TCP", so that it can be dropped instead of escaping capture.
//! IPv6 extension headers (rare) are read with `bpf_skb_load_bytes`, which needs no
//! linear data and no bounds proof for their variable offsets.

use aya_ebpf::programs::TcContext;
use podlink_common::PodInfo;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
/// UDP header: source and destination ports, length, checksum (RFC 768).
const UDP_HLEN: usize = 8;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_DSTOPTS: u8 = 60;
/// Most IPv6 extension headers walked before the upper-layer header; a longer
/// chain is unparsable. The order RFC 8200 (4.1) recommends has at most four of
/// them: hop-by-hop, destination options, routing, destination options (a fragment
/// header ends the walk).
const MAX_IPV6_EXT_HEADERS: usize = 4;
const IPV4_MIN_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
/// IPv4 flags and fragment offset: MF (0x2000) and the 13-bit offset.
const IP_MF_OFFSET: u16 = 0x3fff;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_ACK: u8 = 0x10;
/// Minimal TCP header: ports, sequence numbers, offset and flags.
const TCP_MIN_HLEN: usize = 20;
/// Longest Ethernet + IPv4 (with options) + minimal TCP header; more than the 74
/// bytes of Ethernet + IPv6 + minimal TCP.
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

/// An IPv6 address as read from a packet: its 16 bytes in network order, held as
/// four words (the bytes as they lie in memory), so that it is copied and compared
/// word by word (a byte array costs 16 loads and stores per copy, and `==` on one
/// calls `bcmp`, which BPF has not).
#[derive(Clone, Copy)]
pub struct Ip6(pub [u32; 4]);

impl Ip6 {
    /// `::1`: the proxy's IPv6 transparent listeners are bound to it.
    pub const LOOPBACK: Ip6 = Ip6([0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])]);

    #[inline(always)]
    pub fn eq(&self, other: &Ip6) -> bool {
        (self.0[0] ^ other.0[0])
            | (self.0[1] ^ other.0[1])
            | (self.0[2] ^ other.0[2])
            | (self.0[3] ^ other.0[3])
            == 0
    }

    /// `fe80::/10`: neighbour discovery, MLD and router solicitations come from it.
    #[inline(always)]
    pub fn is_link_local(&self) -> bool {
        u32::from_be(self.0[0]) & 0xffc0_0000 == 0xfe80_0000
    }

    /// `::`: the source of duplicate address detection's neighbour solicitations and
    /// of MLD reports sent before the interface has a link-local address.
    #[inline(always)]
    fn is_unspecified(&self) -> bool {
        self.0[0] | self.0[1] | self.0[2] | self.0[3] == 0
    }
}

/// The fields of an IPv6 TCP segment the programs decide on (after any hop-by-hop,
/// routing and destination options headers). Ports are host order.
pub struct Tcp6 {
    pub saddr: Ip6,
    pub daddr: Ip6,
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
}

/// The fields of a UDP datagram the programs decide on (IPv4, unfragmented).
/// The source address in network order, ports in host order; `l4` is the offset of the UDP
/// header from the start of the packet (its checksum is at `l4 + 6`).
pub struct Udp4 {
    pub saddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub l4: u32,
}

/// The fields of an IPv6 UDP datagram the programs decide on (after any
/// hop-by-hop, routing and destination options headers); as [`Udp4`].
pub struct Udp6 {
    pub saddr: Ip6,
    pub sport: u16,
    pub dport: u16,
    pub l4: u32,
}

/// What a packet is, as far as capture is concerned.
pub enum Packet {
    /// IPv4 TCP with readable headers.
    Tcp4(Tcp4),
    /// IPv6 TCP with readable headers.
    Tcp6(Tcp6),
    /// Unfragmented IPv4 UDP with a readable header (DNS is captured).
    Udp4(Udp4),
    /// IPv6 UDP with a readable header (DNS is captured).
    Udp6(Udp6),
    /// Not IP and never captured: ARP, anything else.
    Other,
    /// IPv4 but neither TCP nor readable UDP (ICMP, UDP fragments, …): never
    /// captured; the source address (network order) is kept for the
    /// anti-spoofing check.
    Ipv4Other { saddr: u32 },
    /// IPv6 but neither TCP nor UDP (ICMPv6, no next header, …, also behind
    /// extension headers, and fragments of them, UDP's too): never captured; the
    /// source address is kept for the anti-spoofing check.
    Ipv6Other { saddr: Ip6 },
    /// A TCP fragment (IPv4), or an IPv6 fragment of TCP or of extension headers
    /// that may hide TCP.
    Fragment,
    /// TCP, an IP header, or an IPv6 extension header chain (longer than
    /// `MAX_IPV6_EXT_HEADERS`), that cannot be read.
    Unparsable,
}

/// What the linear data says: a packet, or an IPv6 header followed by extension
/// headers, walked afterwards by [`parse_ipv6_ext`] (once, not on both tries of
/// [`parse_linear`]).
enum Linear {
    Packet(Packet),
    Ipv6Ext { next: u8, saddr: Ip6, daddr: Ip6 },
}

/// Headers not (yet) in the linear data.
struct Short;

#[inline(always)]
fn parse_linear(ctx: &TcContext) -> Result<Linear, Short> {
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
            let (vtc, next, saddr) = unsafe {
                (
                    *(ip as *const u8),
                    *((ip + 6) as *const u8),
                    Ip6(*((ip + 8) as *const [u32; 4])),
                )
            };
            if vtc >> 4 != 6 {
                return Ok(Linear::Packet(Packet::Unparsable));
            }
            return match next {
                IPPROTO_TCP => {
                    let tcp = ip + IPV6_HLEN;
                    if tcp + TCP_MIN_HLEN > end {
                        return Err(Short);
                    }
                    // SAFETY: the fixed IPv6 header and the minimal TCP header are
                    // within bounds (checked above).
                    let (daddr, sport, dport, flags) = unsafe {
                        (
                            Ip6(*((ip + 24) as *const [u32; 4])),
                            u16::from_be(*(tcp as *const u16)),
                            u16::from_be(*((tcp + 2) as *const u16)),
                            *((tcp + 13) as *const u8),
                        )
                    };
                    Ok(Linear::Packet(Packet::Tcp6(Tcp6 {
                        saddr,
                        daddr,
                        sport,
                        dport,
                        flags,
                    })))
                }
                IPPROTO_UDP => {
                    let udp = ip + IPV6_HLEN;
                    if udp + UDP_HLEN > end {
                        return Err(Short);
                    }
                    // SAFETY: the fixed IPv6 header and the UDP header are within
                    // bounds (checked above).
                    let (sport, dport) = unsafe {
                        (
                            u16::from_be(*(udp as *const u16)),
                            u16::from_be(*((udp + 2) as *const u16)),
                        )
                    };
                    Ok(Linear::Packet(Packet::Udp6(Udp6 {
                        saddr,
                        sport,
                        dport,
                        l4: (ETH_HLEN + IPV6_HLEN) as u32,
                    })))
                }
                IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT => {
                    // SAFETY: the fixed IPv6 header is within bounds.
                    let daddr = unsafe { Ip6(*((ip + 24) as *const [u32; 4])) };
                    Ok(Linear::Ipv6Ext { next, saddr, daddr })
                }
                _ => Ok(Linear::Packet(Packet::Ipv6Other { saddr })),
            };
        }
        _ => return Ok(Linear::Packet(Packet::Other)),
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
        return Ok(Linear::Packet(Packet::Unparsable));
    }
    if proto == IPPROTO_UDP {
        // A fragment's ports are in its first fragment only: UDP fragments pass
        // as other IPv4 does (a DNS query fits one datagram).
        let ihl = ((vihl & 0x0f) as usize) * 4;
        if frag & IP_MF_OFFSET != 0 || ihl < IPV4_MIN_HLEN {
            return Ok(Linear::Packet(Packet::Ipv4Other { saddr }));
        }
        let udp = ip + ihl;
        if udp + UDP_HLEN > end {
            return Err(Short);
        }
        // SAFETY: the UDP header is within bounds (checked above).
        let (sport, dport) = unsafe {
            (
                u16::from_be(*(udp as *const u16)),
                u16::from_be(*((udp + 2) as *const u16)),
            )
        };
        return Ok(Linear::Packet(Packet::Udp4(Udp4 {
            saddr,
            sport,
            dport,
            l4: (ETH_HLEN + ihl) as u32,
        })));
    }
    if proto != IPPROTO_TCP {
        return Ok(Linear::Packet(Packet::Ipv4Other { saddr }));
    }
    if frag & IP_MF_OFFSET != 0 {
        return Ok(Linear::Packet(Packet::Fragment));
    }
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if ihl < IPV4_MIN_HLEN {
        return Ok(Linear::Packet(Packet::Unparsable));
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
    Ok(Linear::Packet(Packet::Tcp4(Tcp4 {
        saddr,
        daddr,
        sport,
        dport,
        flags,
    })))
}

/// Walks the IPv6 extension headers TCP may follow: hop-by-hop, routing and
/// destination options, at most `MAX_IPV6_EXT_HEADERS` of them, from `next`, the
/// fixed header's next header. Each is `(hdr_ext_len + 1) * 8` bytes, its next
/// header in its first byte.
#[inline(always)]
fn parse_ipv6_ext(ctx: &TcContext, mut next: u8, saddr: Ip6, daddr: Ip6) -> Packet {
    let mut off = ETH_HLEN + IPV6_HLEN;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        if !matches!(next, IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS) {
            break;
        }
        let Ok([following, len]) = ctx.load::<[u8; 2]>(off) else {
            return Packet::Unparsable;
        };
        next = following;
        off += (len as usize + 1) * 8;
    }
    match next {
        IPPROTO_TCP => {
            let Ok(tcp) = ctx.load::<[u8; 14]>(off) else {
                return Packet::Unparsable;
            };
            Packet::Tcp6(Tcp6 {
                saddr,
                daddr,
                sport: u16::from_be_bytes([tcp[0], tcp[1]]),
                dport: u16::from_be_bytes([tcp[2], tcp[3]]),
                flags: tcp[13],
            })
        }
        IPPROTO_UDP => {
            let Ok(udp) = ctx.load::<[u8; 4]>(off) else {
                return Packet::Ipv6Other { saddr };
            };
            Packet::Udp6(Udp6 {
                saddr,
                sport: u16::from_be_bytes([udp[0], udp[1]]),
                dport: u16::from_be_bytes([udp[2], udp[3]]),
                l4: off as u32,
            })
        }
        IPPROTO_FRAGMENT => {
            // Every fragment's header names the protocol of the fragmented part
            // (RFC 8200, 4.5): TCP, or headers that may hide it, is dropped as IPv4
            // TCP fragments are; other fragments (large UDP) pass as in IPv4.
            let Ok(fragmented) = ctx.load::<u8>(off) else {
                return Packet::Unparsable;
            };
            match fragmented {
                IPPROTO_TCP | IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS
                | IPPROTO_FRAGMENT => Packet::Fragment,
                _ => Packet::Ipv6Other { saddr },
            }
        }
        // Still an extension header after the bound.
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => Packet::Unparsable,
        _ => Packet::Ipv6Other { saddr },
    }
}

/// Classifies the packet, pulling non-linear headers in once if needed.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Packet {
    let linear = match parse_linear(ctx) {
        Ok(linear) => linear,
        Err(Short) => {
            let want = if ctx.len() < MAX_HEADERS {
                ctx.len()
            } else {
                MAX_HEADERS
            };
            if ctx.pull_data(want).is_err() {
                return Packet::Unparsable;
            }
            match parse_linear(ctx) {
                Ok(linear) => linear,
                Err(Short) => return Packet::Unparsable,
            }
        }
    };
    match linear {
        Linear::Packet(packet) => packet,
        Linear::Ipv6Ext { next, saddr, daddr } => parse_ipv6_ext(ctx, next, saddr, daddr),
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

/// Whether `addr` is the pod's IPv6 address.
#[inline(always)]
pub fn is_pod_ipv6(pod: &PodInfo, addr: &Ip6) -> bool {
    pod.flags & podlink_common::POD_HAS_IPV6 != 0 && ipv6_of(pod).eq(addr)
}

/// Whether an IPv6 packet from the pod may carry `addr` as its source: the pod's
/// IPv6 address, or a link-local (`fe80::/10`) or the unspecified (`::`) address,
/// whether the pod has an IPv6 address or not.
///
/// Neighbour discovery, router solicitations and MLD come from those two, and must
/// keep working in every pod whose interface has IPv6 on (most do, even in an IPv4
/// cluster). They cannot be spoofing that matters: such packets never leave the
/// link (routers must not forward them, RFC 4291 2.5.2 and 2.5.6), and the only
/// other end of a pod's link is the node. Any other source is not one the mesh
/// gave the pod: for a pod without an IPv6 address (an IPv4-only pod, in the
/// mesh's view) every global, unique local, loopback or IPv4-mapped source is
/// spoofed, as an IPv4 source other than the pod's is.
#[inline(always)]
pub fn is_pod_ipv6_source(pod: &PodInfo, addr: &Ip6) -> bool {
    addr.is_link_local() || addr.is_unspecified() || is_pod_ipv6(pod, addr)
}

/// The pod's IPv6 address, as read from a packet.
#[inline(always)]
fn ipv6_of(pod: &PodInfo) -> Ip6 {
    const _: () = assert!(
        core::mem::offset_of!(PodInfo, ipv6) % 4 == 0 && core::mem::align_of::<PodInfo>() >= 4
    );
    // SAFETY: `ipv6` is 16 bytes at a 4-aligned offset of a 4-aligned `PodInfo`
    // (asserted above).
    Ip6(unsafe { *(pod.ipv6.as_ptr() as *const [u32; 4]) })
}
