//! What DNS capture asks of a UDP datagram, for both address families: the
//! twin of [`crate::tcp`] for UDP, written once over [`Udp`] and monomorphized
//! per family.

use aya_ebpf::bindings::{
    bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
    bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
};
use podlink_common::PodInfo;

use crate::{
    parse::{self, Ip6, Udp4, Udp6},
    tcp::{LOOPBACK4, tuple4, tuple6},
};

/// A UDP datagram of one address family, as DNS capture sees it.
pub trait Udp {
    /// Size of the family's part of `bpf_sock_tuple`, the size
    /// `bpf_sk_lookup_udp` is given.
    const TUPLE_LEN: u32;

    /// Source port, host order.
    fn sport(&self) -> u16;
    /// Destination port, host order.
    fn dport(&self) -> u16;
    /// Offset of the UDP header from the start of the packet.
    fn l4(&self) -> u32;
    /// Whether a datagram leaving the pod carries one of the pod's addresses as
    /// its source (IPv6 also link-local and unspecified ones, as for other
    /// IPv6, see `parse::is_pod_ipv6_source`).
    fn is_from_pod(&self, pod: &PodInfo) -> bool;
    /// The tuple that finds the agent's DNS socket on `port` (bound to 127.0.0.1
    /// for IPv4, `::1` for IPv6) for this datagram's source.
    fn listener_tuple(&self, port: u16) -> bpf_sock_tuple;
}

impl Udp for Udp4 {
    const TUPLE_LEN: u32 = size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>() as u32;

    #[inline(always)]
    fn sport(&self) -> u16 {
        self.sport
    }

    #[inline(always)]
    fn dport(&self) -> u16 {
        self.dport
    }

    #[inline(always)]
    fn l4(&self) -> u32 {
        self.l4
    }

    #[inline(always)]
    fn is_from_pod(&self, pod: &PodInfo) -> bool {
        parse::is_pod_ipv4(pod, self.saddr)
    }

    #[inline(always)]
    fn listener_tuple(&self, port: u16) -> bpf_sock_tuple {
        tuple4(self.saddr, LOOPBACK4, self.sport, port)
    }
}

impl Udp for Udp6 {
    const TUPLE_LEN: u32 = size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>() as u32;

    #[inline(always)]
    fn sport(&self) -> u16 {
        self.sport
    }

    #[inline(always)]
    fn dport(&self) -> u16 {
        self.dport
    }

    #[inline(always)]
    fn l4(&self) -> u32 {
        self.l4
    }

    #[inline(always)]
    fn is_from_pod(&self, pod: &PodInfo) -> bool {
        parse::is_pod_ipv6_source(pod, &self.saddr)
    }

    #[inline(always)]
    fn listener_tuple(&self, port: u16) -> bpf_sock_tuple {
        tuple6(&self.saddr, &Ip6::LOOPBACK, self.sport, port)
    }
}
