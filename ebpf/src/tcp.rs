//! What the capture logic asks of a TCP segment, for both address families.
//!
//! `main.rs` writes the capture logic once, generic over [`Tcp`], and calls it with
//! [`Tcp4`] or [`Tcp6`]: each call is monomorphized and inlined, so IPv4's code is
//! what it was before IPv6 capture (no address-family branches on its path) and
//! IPv6's is its exact twin. The family-specific parts are here: addresses, flow
//! keys, socket tuples and the loopback address of the proxy's listeners.

use aya_ebpf::bindings::{
    bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
    bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
};
use podlink_common::{Config, FlowKey, PodInfo};

use crate::{
    maps::{self, FlowKeyWords, FlowKeyWords6},
    parse::{self, Ip6, TCP_FLAG_ACK, TCP_FLAG_SYN, Tcp4, Tcp6},
};

/// 127.0.0.1 in network order: the proxy's IPv4 listeners are bound to loopback,
/// so only packets steered by these programs reach them.
pub const LOOPBACK4: u32 = u32::from_ne_bytes([127, 0, 0, 1]);

/// A captured-flows key built on the stack, as the map reads it.
pub trait FlowKeyBytes {
    /// The key's bytes as a [`FlowKey`].
    fn key(&self) -> &FlowKey;
}

/// A TCP segment of one address family, as the capture logic sees it.
pub trait Tcp {
    /// The family's captured-flows key, written as words.
    type Key: FlowKeyBytes;
    /// Size of the family's part of `bpf_sock_tuple` (`ipv4` or `ipv6`), the size
    /// `bpf_skc_lookup_tcp` is given.
    const TUPLE_LEN: u32;

    /// TCP flags.
    fn flags(&self) -> u8;
    /// Destination port, host order.
    fn dport(&self) -> u16;

    /// A connection request: SYN without ACK.
    #[inline(always)]
    fn is_syn(&self) -> bool {
        self.flags() & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    }

    /// The key of the segment's flow as `from_pod` sees it (source first).
    fn flow_key(&self) -> Self::Key;
    /// The key of the reverse flow: `to_pod`'s view of the proxy's own connection
    /// into the pod, keyed as `from_pod` will see the pod's replies.
    fn reply_flow_key(&self) -> Self::Key;
    /// The segment's own 4-tuple, for a socket lookup.
    fn sock_tuple(&self) -> bpf_sock_tuple;
    /// The tuple that finds the proxy's transparent listener on `port` (127.0.0.1
    /// for IPv4, `::1` for IPv6) for this segment's source.
    fn listener_tuple(&self, port: u16) -> bpf_sock_tuple;

    /// Whether a segment seen at the host veth's ingress carries neither the pod's
    /// address as its source (leaving the pod) nor as its destination (bounced in
    /// by `to_pod`). IPv6 link-local and unspecified sources are the pod's (see
    /// `parse::is_pod_ipv6_source`).
    fn is_spoofed(&self, pod: &PodInfo) -> bool;
    /// Whether the segment is addressed to the pod.
    fn is_to_pod(&self, pod: &PodInfo) -> bool;
    /// Whether the segment comes from one of the node's own addresses.
    fn is_from_node(&self, cfg: &Config) -> bool;
    /// Whether the destination address is in an excluded prefix (the port is
    /// checked apart).
    fn is_excluded_daddr(&self) -> bool;
}

impl Tcp for Tcp4 {
    type Key = FlowKeyWords;
    const TUPLE_LEN: u32 = size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>() as u32;

    #[inline(always)]
    fn flags(&self) -> u8 {
        self.flags
    }

    #[inline(always)]
    fn dport(&self) -> u16 {
        self.dport
    }

    #[inline(always)]
    fn flow_key(&self) -> FlowKeyWords {
        FlowKeyWords::new(self.saddr, self.daddr, self.sport, self.dport)
    }

    #[inline(always)]
    fn reply_flow_key(&self) -> FlowKeyWords {
        FlowKeyWords::new(self.daddr, self.saddr, self.dport, self.sport)
    }

    #[inline(always)]
    fn sock_tuple(&self) -> bpf_sock_tuple {
        tuple4(self.saddr, self.daddr, self.sport, self.dport)
    }

    #[inline(always)]
    fn listener_tuple(&self, port: u16) -> bpf_sock_tuple {
        tuple4(self.saddr, LOOPBACK4, self.sport, port)
    }

    #[inline(always)]
    fn is_spoofed(&self, pod: &PodInfo) -> bool {
        !parse::is_pod_ipv4(pod, self.saddr) && !parse::is_pod_ipv4(pod, self.daddr)
    }

    #[inline(always)]
    fn is_to_pod(&self, pod: &PodInfo) -> bool {
        parse::is_pod_ipv4(pod, self.daddr)
    }

    #[inline(always)]
    fn is_from_node(&self, cfg: &Config) -> bool {
        maps::is_node_addr(cfg, self.saddr)
    }

    #[inline(always)]
    fn is_excluded_daddr(&self) -> bool {
        maps::is_excluded_cidr(self.daddr)
    }
}

// An IPv6 key cannot stand for an IPv4 flow: IPv4 keys are IPv4-mapped, and the
// kernel sends IPv4 for a socket's IPv4-mapped peer, so no IPv6 packet of the
// pod's carries mapped addresses. A crafted one could only meet an IPv4 key on
// the fast path, where it is marked for local delivery, and the kernel drops
// IPv6 with a mapped source (ip6_rcv_core).
impl Tcp for Tcp6 {
    type Key = FlowKeyWords6;
    const TUPLE_LEN: u32 = size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>() as u32;

    #[inline(always)]
    fn flags(&self) -> u8 {
        self.flags
    }

    #[inline(always)]
    fn dport(&self) -> u16 {
        self.dport
    }

    #[inline(always)]
    fn flow_key(&self) -> FlowKeyWords6 {
        FlowKeyWords6::new(&self.saddr, &self.daddr, self.sport, self.dport)
    }

    #[inline(always)]
    fn reply_flow_key(&self) -> FlowKeyWords6 {
        FlowKeyWords6::new(&self.daddr, &self.saddr, self.dport, self.sport)
    }

    #[inline(always)]
    fn sock_tuple(&self) -> bpf_sock_tuple {
        tuple6(&self.saddr, &self.daddr, self.sport, self.dport)
    }

    #[inline(always)]
    fn listener_tuple(&self, port: u16) -> bpf_sock_tuple {
        tuple6(&self.saddr, &Ip6::LOOPBACK, self.sport, port)
    }

    /// TCP, unlike neighbour discovery, may come from a link-local source only
    /// to a link-local destination (the node, the pod's only link peer): from
    /// `::`, or from a link-local source to any other address, it is spoofed.
    #[inline(always)]
    fn is_spoofed(&self, pod: &PodInfo) -> bool {
        !parse::is_pod_ipv6(pod, &self.saddr)
            && !(self.saddr.is_link_local() && self.daddr.is_link_local())
            && !parse::is_pod_ipv6(pod, &self.daddr)
    }

    #[inline(always)]
    fn is_to_pod(&self, pod: &PodInfo) -> bool {
        parse::is_pod_ipv6(pod, &self.daddr)
    }

    #[inline(always)]
    fn is_from_node(&self, cfg: &Config) -> bool {
        maps::is_node_addr6(cfg, &self.saddr)
    }

    /// A link-local destination is the node itself (RFC 4291 2.5.6: never
    /// forwarded): such a connection passes, as to an excluded prefix.
    #[inline(always)]
    fn is_excluded_daddr(&self) -> bool {
        self.daddr.is_link_local() || maps::is_excluded_cidr6(&self.daddr)
    }
}

#[inline(always)]
pub fn tuple4(saddr: u32, daddr: u32, sport: u16, dport: u16) -> bpf_sock_tuple {
    bpf_sock_tuple {
        __bindgen_anon_1: bpf_sock_tuple__bindgen_ty_1 {
            ipv4: bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
                saddr,
                daddr,
                sport: sport.to_be(),
                dport: dport.to_be(),
            },
        },
    }
}

#[inline(always)]
pub fn tuple6(saddr: &Ip6, daddr: &Ip6, sport: u16, dport: u16) -> bpf_sock_tuple {
    bpf_sock_tuple {
        __bindgen_anon_1: bpf_sock_tuple__bindgen_ty_1 {
            ipv6: bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
                saddr: saddr.0,
                daddr: daddr.0,
                sport: sport.to_be(),
                dport: dport.to_be(),
            },
        },
    }
}
