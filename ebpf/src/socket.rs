//! Socket lookups and assignment (`bpf_skc_lookup_tcp`, `bpf_sk_lookup_udp`,
//! `bpf_sk_assign`).
//!
//! Every socket returned by a lookup is released on every path.

use aya_ebpf::{
    bindings::{BPF_F_CURRENT_NETNS, BPF_TCP_LISTEN, BPF_TCP_TIME_WAIT, bpf_sock, bpf_sock_tuple},
    helpers::generated::{bpf_sk_assign, bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp},
    programs::TcContext,
};
use podlink_common::Config;

use crate::{tcp::Tcp, udp::Udp};

/// Linux `PACKET_HOST`.
const PACKET_HOST: u32 = 0;

pub enum Lookup {
    /// A non-listening socket owns the flow; it must be released (done by `assign`).
    Found(*mut bpf_sock),
    None,
}

/// `bpf_skc_lookup_tcp` with the `P` family's part of the tuple (its size tells
/// the kernel the family).
#[inline(always)]
fn skc_lookup<P: Tcp>(ctx: &TcContext, t: &mut bpf_sock_tuple) -> *mut bpf_sock {
    // SAFETY: helper call with the context and a stack tuple whose `P` part is
    // written, of that part's size.
    unsafe {
        bpf_skc_lookup_tcp(
            ctx.skb.skb.cast(),
            t,
            P::TUPLE_LEN,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    }
}

#[inline(always)]
fn release(sk: *mut bpf_sock) {
    // SAFETY: `sk` came from a lookup and has not been released.
    unsafe { bpf_sk_release(sk.cast()) };
}

/// Finds a non-listening socket for the packet's own 4-tuple. A SYN that finds a
/// TIME_WAIT socket is treated as new (the listener then takes it).
#[inline(always)]
pub fn lookup_established<P: Tcp>(ctx: &TcContext, pkt: &P) -> Lookup {
    let mut t = pkt.sock_tuple();
    let sk = skc_lookup::<P>(ctx, &mut t);
    if sk.is_null() {
        return Lookup::None;
    }
    // SAFETY: non-null socket from the helper; `state` is readable on sock_common.
    let state = unsafe { (*sk).state };
    if state == BPF_TCP_LISTEN || (state == BPF_TCP_TIME_WAIT && pkt.is_syn()) {
        release(sk);
        return Lookup::None;
    }
    Lookup::Found(sk)
}

/// Whether a non-listening socket (the proxy's, since pod addresses are not local)
/// owns the packet's 4-tuple.
#[inline(always)]
pub fn proxy_socket_exists<P: Tcp>(ctx: &TcContext, pkt: &P) -> bool {
    match lookup_established(ctx, pkt) {
        Lookup::Found(sk) => {
            release(sk);
            true
        }
        Lookup::None => false,
    }
}

/// Finds the proxy's transparent listener on `port` (bound to 127.0.0.1 for IPv4,
/// `[::1]` for IPv6).
#[inline(always)]
pub fn lookup_listener<P: Tcp>(ctx: &TcContext, pkt: &P, port: u16) -> Option<*mut bpf_sock> {
    let mut t = pkt.listener_tuple(port);
    let sk = skc_lookup::<P>(ctx, &mut t);
    if sk.is_null() {
        return None;
    }
    // SAFETY: non-null socket from the helper.
    if unsafe { (*sk).state } != BPF_TCP_LISTEN {
        release(sk);
        return None;
    }
    Some(sk)
}

/// Finds the agent's DNS socket on `port` (UDP, bound to 127.0.0.1 for IPv4,
/// `[::1]` for IPv6) with `bpf_sk_lookup_udp`.
#[inline(always)]
pub fn lookup_dns_socket<P: Udp>(ctx: &TcContext, pkt: &P, port: u16) -> Option<*mut bpf_sock> {
    let mut t = pkt.listener_tuple(port);
    // SAFETY: helper call with the context and a stack tuple whose `P` part is
    // written, of that part's size.
    let sk = unsafe {
        bpf_sk_lookup_udp(
            ctx.skb.skb.cast(),
            &mut t,
            P::TUPLE_LEN,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    };
    if sk.is_null() { None } else { Some(sk) }
}

/// Assigns the packet to `sk` (consuming the lookup reference), then marks it for
/// local delivery and makes it addressed to this host (a bounced packet still
/// carries the pod's MAC).
#[inline(always)]
pub fn assign(ctx: &TcContext, sk: *mut bpf_sock, cfg: &Config) -> Result<(), ()> {
    // SAFETY: `sk` is a referenced socket from a lookup.
    let ret = unsafe { bpf_sk_assign(ctx.skb.skb.cast(), sk.cast(), 0) };
    release(sk);
    if ret != 0 {
        return Err(());
    }
    deliver_locally(ctx, cfg);
    Ok(())
}

/// Marks the packet for local delivery (the policy rule on the redirect mark
/// routes it to the `local` table) and makes it addressed to this host (a bounced
/// packet still carries the pod's MAC). Without an assigned socket, the kernel's
/// own lookup picks the socket of the packet's 4-tuple.
#[inline(always)]
pub fn deliver_locally(ctx: &TcContext, cfg: &Config) {
    // SAFETY: reading the context's mark.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark((mark & !cfg.redirect_mark_mask) | cfg.redirect_mark);
    // SAFETY: reading the context's packet type.
    if unsafe { (*ctx.skb.skb).pkt_type } != PACKET_HOST {
        let _ = ctx.change_type(PACKET_HOST);
    }
}
