//! podlink's TC programs, attached to the host veth of every enrolled pod.
//!
//! * [`from_pod`] runs at TC ingress (packets leaving the pod, and packets that
//!   [`to_pod`] bounced back in). It assigns a packet with `bpf_sk_assign` to the
//!   proxy socket of its flow, or a new connection to a transparent listener.
//! * [`to_pod`] runs at TC egress (packets entering the pod). It lets the proxy's and
//!   the node's own packets through and bounces new connections and packets of proxy
//!   flows into the same device's ingress, where `from_pod` can assign them
//!   (`bpf_sk_assign` only works at ingress).
//!
//! The decisions are documented in `../shared/DESIGN.md` ("The data path"). Entry
//! points are thin; the work is in [`parse`], [`socket`] and [`maps`].
#![no_std]
#![no_main]

mod maps;
mod parse;
mod socket;

use aya_ebpf::{
    bindings::BPF_F_INGRESS,
    helpers::generated::bpf_redirect,
    macros::classifier,
    programs::TcContext,
};
use podlink_common::{CONFIG_DRAINING, CONFIG_FAIL_OPEN, Config, PodCounters, PodInfo};

use crate::{
    maps::{count, is_excluded, is_node_addr},
    parse::{Packet, Tcp4},
    socket::Lookup,
};

// Verdicts, from include/uapi/linux/pkt_cls.h (TCX reads them as TCX_NEXT,
// TCX_PASS and TCX_DROP).
/// `TC_ACT_UNSPEC`: pass the packet on to the next program or to the stack,
/// untouched.
const PASS: i32 = -1;
/// `TC_ACT_OK`: deliver the (assigned) packet; later programs do not run.
const OK: i32 = 0;
/// `TC_ACT_SHOT`: drop.
const DROP: i32 = 2;

/// Counts and returns the verdict for a packet that is not readable IPv4 TCP.
#[inline(always)]
fn not_tcp4(packet: Packet, counters: Option<*mut PodCounters>) -> i32 {
    match packet {
        Packet::Other | Packet::Ipv4Other { .. } => {
            count(counters, |c| &mut c.passed);
            PASS
        }
        // Capture cannot steer what it cannot read: drop rather than let it pass
        // around the proxy.
        Packet::Fragment => {
            count(counters, |c| &mut c.dropped_fragment);
            DROP
        }
        Packet::Unparsable => {
            count(counters, |c| &mut c.dropped_unparsable);
            DROP
        }
        Packet::Ipv6 => {
            count(counters, |c| &mut c.dropped_ipv6);
            DROP
        }
        Packet::Tcp4(_) => PASS,
    }
}

/// TC ingress of an enrolled pod's host veth.
#[classifier]
pub fn from_pod(ctx: TcContext) -> i32 {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let Some(pod) = maps::pod(ifindex) else {
        return PASS;
    };
    let Some(cfg) = maps::config() else {
        return PASS;
    };
    let counters = maps::counters(ifindex);
    let packet = parse::parse(&ctx);
    // What leaves an enrolled pod carries its own address (the node accepts local
    // source addresses on host veths, for the node's replies bounced back in, so it
    // must not accept them from the pod). Bounced packets are addressed to the pod.
    let spoofed = match &packet {
        Packet::Tcp4(pkt) => {
            !parse::is_pod_ipv4(pod, pkt.saddr) && !parse::is_pod_ipv4(pod, pkt.daddr)
        }
        Packet::Ipv4Other { saddr } => !parse::is_pod_ipv4(pod, *saddr),
        _ => false,
    };
    if spoofed {
        count(counters, |c| &mut c.dropped_spoofed);
        return DROP;
    }
    match packet {
        Packet::Tcp4(pkt) => from_pod_tcp4(&ctx, pod, cfg, counters, &pkt),
        other => not_tcp4(other, counters),
    }
}

#[inline(always)]
fn from_pod_tcp4(
    ctx: &TcContext,
    pod: &PodInfo,
    cfg: &Config,
    counters: Option<*mut PodCounters>,
    pkt: &Tcp4,
) -> i32 {
    // A packet addressed to the pod itself was bounced in by `to_pod`: it is
    // inbound. Anything else comes from the pod: outbound.
    let bounced = parse::is_pod_ipv4(pod, pkt.daddr);

    // 1. A proxy socket (or any socket of this netns) already owns this 4-tuple:
    //    replies to the proxy's upstream connections and later packets of captured
    //    flows. A SYN that meets a TIME_WAIT socket opens a new connection instead.
    if let Lookup::Found(sk) = socket::lookup_established(ctx, pkt) {
        return match socket::assign(ctx, sk, cfg) {
            Ok(()) => {
                count(counters, |c| &mut c.assigned_established);
                OK
            }
            Err(()) => {
                count(counters, |c| &mut c.dropped_assign_failed);
                DROP
            }
        };
    }

    if !pkt.is_syn() {
        if bounced {
            // `to_pod` saw a proxy socket that is gone now; passing the packet
            // would route it back out of this veth and bounce it again.
            count(counters, |c| &mut c.dropped_bounce_miss);
            return DROP;
        }
        if maps::is_captured_flow(pkt) {
            // The proxy had this flow and its socket is gone (the agent stopped,
            // or the connection was reset): never let its bytes out in plain text.
            count(counters, |c| &mut c.dropped_flow_gone);
            return DROP;
        }
        // A flow from before enrollment: leave it alone.
        count(counters, |c| &mut c.passed);
        return PASS;
    }

    // 2. A new connection: to the transparent listener for its direction.
    let listener_port = if bounced {
        if pkt.dport == cfg.hbone_port {
            cfg.hbone_port
        } else {
            cfg.inbound_plaintext_port
        }
    } else {
        if is_excluded(pkt.daddr, pkt.dport) {
            count(counters, |c| &mut c.passed);
            return PASS;
        }
        cfg.outbound_port
    };
    // A draining proxy takes no new connection: its listeners only finish the
    // handshakes under way before they close.
    let listener = if cfg.flags & CONFIG_DRAINING != 0 {
        None
    } else {
        socket::lookup_listener(ctx, pkt, listener_port)
    };
    let Some(sk) = listener else {
        if cfg.flags & CONFIG_FAIL_OPEN != 0 && !bounced {
            count(counters, |c| &mut c.passed);
            return PASS;
        }
        // Fail closed: no byte of an enrolled pod leaves in plain text while the
        // proxy is away. The client's SYN retry succeeds once it is back.
        count(counters, |c| &mut c.dropped_no_listener);
        return DROP;
    };
    match socket::assign(ctx, sk, cfg) {
        Ok(()) => {
            maps::remember_flow(pkt);
            if !bounced {
                count(counters, |c| &mut c.captured_outbound);
            } else if listener_port == cfg.hbone_port {
                count(counters, |c| &mut c.captured_inbound_hbone);
            } else {
                count(counters, |c| &mut c.captured_inbound_plaintext);
            }
            OK
        }
        Err(()) => {
            count(counters, |c| &mut c.dropped_assign_failed);
            DROP
        }
    }
}

/// TC egress of an enrolled pod's host veth.
///
/// Its prologue repeats `from_pod`'s on purpose: returning the parsed packet from a
/// shared helper made LLVM emit a read of an uninitialised register on one path,
/// which the verifier refuses.
#[classifier]
pub fn to_pod(ctx: TcContext) -> i32 {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let Some(pod) = maps::pod(ifindex) else {
        return PASS;
    };
    let Some(cfg) = maps::config() else {
        return PASS;
    };
    let counters = maps::counters(ifindex);
    let packet = parse::parse(&ctx);
    let mark = unsafe { (*ctx.skb.skb).mark };
    if mark & cfg.proxy_mark_mask == cfg.proxy_mark {
        // The proxy's own connection to the pod. Remember it, so that the pod's
        // replies are never passed in plain text once the proxy's socket is gone.
        if let Packet::Tcp4(pkt) = &packet
            && pkt.is_syn()
        {
            maps::remember_reply_flow(pkt);
        }
        count(counters, |c| &mut c.passed);
        return PASS;
    }
    let pkt = match packet {
        Packet::Tcp4(pkt) => pkt,
        other => return not_tcp4(other, counters),
    };
    if !parse::is_pod_ipv4(pod, pkt.daddr) {
        count(counters, |c| &mut c.passed);
        return PASS;
    }
    let bounce = if pkt.is_syn() {
        // New connections from the node itself (kubelet probes) and to excluded
        // ports are not captured.
        !is_node_addr(cfg, pkt.saddr) && !maps::is_excluded_port(pkt.dport)
    } else {
        // Packets of the proxy's flows, from anywhere (the node's own replies to a
        // proxied connection included); anything else predates enrollment.
        socket::proxy_socket_exists(&ctx, &pkt)
    };
    if !bounce {
        count(counters, |c| &mut c.passed);
        return PASS;
    }
    count(counters, |c| &mut c.bounced);
    // SAFETY: a helper call with a scalar ifindex and flags.
    unsafe { bpf_redirect(ifindex, BPF_F_INGRESS as u64) as i32 }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
