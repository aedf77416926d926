//! podlink's TC programs, attached to the host veth of every enrolled pod.
//!
//! * [`from_pod`] runs at TC ingress (packets leaving the pod, and packets that
//!   [`to_pod`] bounced back in). It assigns a packet with `bpf_sk_assign` to the
//!   proxy socket of its flow, or a new connection to a transparent listener.
//!   DNS queries (UDP and TCP to port 53) go to the agent's DNS server.
//! * [`to_pod`] runs at TC egress (packets entering the pod). It lets the proxy's and
//!   the node's own packets through and bounces new connections and packets of proxy
//!   flows into the same device's ingress, where `from_pod` can assign them
//!   (`bpf_sk_assign` only works at ingress). The DNS server's UDP answers get
//!   port 53 back as their source port.
//!
//! The kernel facts they rely on are listed in docs/architecture.md ("Kernel facts
//! the data path depends on"). Entry points are thin; the work is in [`parse`], [`socket`]
//! and [`maps`]. IPv4 and IPv6 TCP take the same logic, written once over [`tcp::Tcp`].
#![no_std]
#![no_main]

mod maps;
mod parse;
mod socket;
mod tcp;
mod udp;

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, BPF_F_MARK_MANGLED_0},
    helpers::generated::bpf_redirect,
    macros::classifier,
    programs::TcContext,
};
use podlink_common::{
    CONFIG_DRAINING, CONFIG_FAIL_OPEN, Config, DNS_SERVICE_PORT, POD_DNS_CAPTURE, POD_DRAINING,
    PodInfo,
};

use crate::{
    maps::{count, is_excluded},
    parse::Packet,
    socket::Lookup,
    tcp::Tcp,
    udp::Udp,
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

/// Counts and returns the verdict for a packet of an enrolled pod that is
/// neither readable TCP nor a DNS query.
#[inline(always)]
fn not_tcp(packet: Packet, ifindex: u32) -> i32 {
    match packet {
        Packet::Other | Packet::Ipv4Other { .. } | Packet::Ipv6Other { .. } => {
            count(ifindex, |c| &mut c.passed);
            PASS
        }
        // Capture cannot steer what it cannot read: drop rather than let it pass
        // around the proxy.
        Packet::Fragment => {
            count(ifindex, |c| &mut c.dropped_fragment);
            DROP
        }
        Packet::Unparsable => {
            count(ifindex, |c| &mut c.dropped_unparsable);
            DROP
        }
        Packet::Tcp4(_) | Packet::Tcp6(_) | Packet::Udp4(_) | Packet::Udp6(_) => {
            count(ifindex, |c| &mut c.passed);
            PASS
        }
    }
}

/// TC ingress of an enrolled pod's host veth.
#[classifier]
pub fn from_pod(ctx: TcContext) -> i32 {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let Some(cfg) = maps::config() else {
        return PASS;
    };
    // One match on the packet, each family's TCP to its own instance of the same
    // logic ([`from_pod_tcp`]): IPv4 pays nothing for IPv6.
    match parse::parse(&ctx) {
        Packet::Tcp4(pkt) => from_pod_tcp(&ctx, cfg, ifindex, &pkt),
        Packet::Tcp6(pkt) => from_pod_tcp(&ctx, cfg, ifindex, &pkt),
        Packet::Udp4(pkt) => from_pod_udp(&ctx, cfg, ifindex, &pkt),
        Packet::Udp6(pkt) => from_pod_udp(&ctx, cfg, ifindex, &pkt),
        // What leaves an enrolled pod carries its own address (see
        // `Tcp::is_spoofed`). IPv6 also passes link-local and unspecified sources
        // (neighbour discovery, MLD), for a pod without an IPv6 address too; any
        // other IPv6 source of such a pod is spoofed (see
        // `parse::is_pod_ipv6_source`). Each family's source is read in its own
        // arm: matched together, LLVM read the enum's payload before the
        // variant, from a stack slot the other variants never wrote, which the
        // verifier of Linux 6.1 refuses ("invalid read from stack").
        Packet::Ipv4Other { saddr } => {
            let Some(pod) = maps::pod(ifindex) else {
                return PASS;
            };
            if !parse::is_pod_ipv4(pod, saddr) {
                return spoofed(ifindex);
            }
            count(ifindex, |c| &mut c.passed);
            PASS
        }
        Packet::Ipv6Other { saddr } => {
            let Some(pod) = maps::pod(ifindex) else {
                return PASS;
            };
            if !parse::is_pod_ipv6_source(pod, &saddr) {
                return spoofed(ifindex);
            }
            count(ifindex, |c| &mut c.passed);
            PASS
        }
        other => {
            if maps::pod(ifindex).is_none() {
                return PASS;
            }
            not_tcp(other, ifindex)
        }
    }
}

/// A UDP datagram at the host veth's ingress (only ever from the pod: `to_pod`
/// bounces no UDP). A DNS query (to port 53, at any address) of a pod whose DNS
/// is captured goes to the agent's DNS socket, which answers from the address
/// asked; without that socket it is dropped (fail closed) or passed (fail open).
/// Anything else passes. Written once for both families (see [`udp`]).
#[inline(always)]
fn from_pod_udp<P: Udp>(ctx: &TcContext, cfg: &Config, ifindex: u32, pkt: &P) -> i32 {
    let Some(pod) = maps::pod(ifindex) else {
        return PASS;
    };
    if !pkt.is_from_pod(pod) {
        return spoofed(ifindex);
    }
    if pkt.dport() != DNS_SERVICE_PORT
        || pod.flags & POD_DNS_CAPTURE == 0
        || pod.flags & POD_DRAINING != 0
        || cfg.dns_port == 0
    {
        count(ifindex, |c| &mut c.passed);
        return PASS;
    }
    // Unlike the TCP listeners, the DNS socket answers to the end, draining or
    // not: a datagram has no handshake to finish, and the socket closes at once.
    let Some(sk) = socket::lookup_dns_socket(ctx, pkt, cfg.dns_port) else {
        if cfg.flags & CONFIG_FAIL_OPEN != 0 {
            count(ifindex, |c| &mut c.passed);
            return PASS;
        }
        count(ifindex, |c| &mut c.dropped_no_listener);
        return DROP;
    };
    match socket::assign(ctx, sk, cfg) {
        Ok(()) => {
            count(ifindex, |c| &mut c.captured_dns);
            OK
        }
        Err(()) => {
            count(ifindex, |c| &mut c.dropped_assign_failed);
            DROP
        }
    }
}

/// Drops a packet whose source is not its pod's, counting it.
#[inline(always)]
fn spoofed(ifindex: u32) -> i32 {
    count(ifindex, |c| &mut c.dropped_spoofed);
    DROP
}

/// A TCP packet at the host veth's ingress: from the pod, or bounced in by
/// `to_pod`. Written once for both families (see [`tcp`]).
#[inline(always)]
fn from_pod_tcp<P: Tcp>(ctx: &TcContext, cfg: &Config, ifindex: u32, pkt: &P) -> i32 {
    // The host veth the proxy took this 4-tuple over on, if it has (or had) it: the
    // captured-flows map is filled when a flow's SYN is assigned, and when a socket
    // lookup below finds the proxy's socket.
    let flow = maps::captured_on(pkt);
    // 1. Fast path, one hash lookup per packet: a later packet of a flow the proxy
    //    took over on this very veth is only marked for local delivery; the
    //    kernel's own socket lookup (tcp_v4_rcv, tcp_v6_rcv) then finds the
    //    proxy's socket, as it does for TPROXY. Were the socket gone, the packet
    //    would end in the local stack, never on the network. The veth stands for
    //    the pod's addresses: every entry of this veth was remembered for a packet
    //    carrying the pod's address (after the anti-spoofing check below, or in
    //    `to_pod` for a packet addressed to the pod), so a packet of its 4-tuple
    //    carries it too. (An entry outlives a new address of the pod on the same
    //    veth, which the agent does not sweep the map for: the pod could still
    //    send from its old address, into the proxy sockets of its own earlier
    //    flows only.) It is not counted: the proxy counts the flow's bytes. A
    //    draining or stopped proxy takes the slow path, which tells such packets
    //    apart and counts them.
    if flow == Some(ifindex) && !pkt.is_syn() && cfg.flags & CONFIG_DRAINING == 0 {
        socket::deliver_locally(ctx, cfg);
        return OK;
    }
    let Some(pod) = maps::pod(ifindex) else {
        return PASS;
    };
    // What leaves an enrolled pod carries its own address (the node accepts local
    // source addresses on host veths, for the node's replies bounced back in, so it
    // must not accept them from the pod). Bounced packets are addressed to the pod.
    if pkt.is_spoofed(pod) {
        count(ifindex, |c| &mut c.dropped_spoofed);
        return DROP;
    }
    from_pod_slow(ctx, pod, cfg, ifindex, pkt, flow)
}

/// The slow path of a TCP packet from the pod (or bounced into its veth): `flow` is
/// the host veth the proxy took its 4-tuple over on, if any.
#[inline(always)]
fn from_pod_slow<P: Tcp>(
    ctx: &TcContext,
    pod: &PodInfo,
    cfg: &Config,
    ifindex: u32,
    pkt: &P,
    flow: Option<u32>,
) -> i32 {
    // A packet addressed to the pod itself was bounced in by `to_pod`: it is
    // inbound. Anything else comes from the pod: outbound.
    let bounced = pkt.is_to_pod(pod);
    let syn = pkt.is_syn();
    // Whether the proxy has (or had) this 4-tuple, here or on another veth (a pod
    // whose address moved to a new veth).
    let known = flow.is_some();
    let remembered_here = flow == Some(ifindex);

    // 2. Slow path: a proxy socket (or any socket of this netns) owns this
    //    4-tuple: replies to connections the proxy opened itself, flows whose map
    //    entry was evicted, any packet while draining. A SYN looks only when the
    //    proxy had its 4-tuple (a SYN meeting a TIME_WAIT socket opens a new
    //    connection); a fresh one goes straight to the listener.
    if (!syn || known)
        && let Lookup::Found(sk) = socket::lookup_established(ctx, pkt)
    {
        return match socket::assign(ctx, sk, cfg) {
            Ok(()) => {
                if !remembered_here {
                    maps::remember_flow(pkt, ifindex);
                }
                count(ifindex, |c| &mut c.assigned_established);
                OK
            }
            Err(()) => {
                count(ifindex, |c| &mut c.dropped_assign_failed);
                DROP
            }
        };
    }

    if !syn {
        if bounced {
            // `to_pod` saw a proxy flow whose socket is gone now; passing the
            // packet would route it back out of this veth and bounce it again.
            count(ifindex, |c| &mut c.dropped_bounce_miss);
            return DROP;
        }
        if known {
            // The proxy had this flow and its socket is gone (the agent stopped,
            // or the connection was reset): never let its bytes out in plain text.
            count(ifindex, |c| &mut c.dropped_flow_gone);
            return DROP;
        }
        // A flow from before enrollment: leave it alone.
        count(ifindex, |c| &mut c.passed);
        return PASS;
    }

    // A pod that left the mesh drains: the flows the proxy carries went on
    // above, a new connection goes direct. (`to_pod` bounces no SYN to it.)
    if pod.flags & POD_DRAINING != 0 {
        if known {
            maps::forget_flow(pkt);
        }
        count(ifindex, |c| &mut c.passed);
        return PASS;
    }

    // 3. A new connection: to the transparent listener for its direction (on
    //    127.0.0.1 for IPv4, [::1] for IPv6, the same ports).
    let dport = pkt.dport();
    let listener_port = if bounced {
        if dport == cfg.hbone_port {
            cfg.hbone_port
        } else {
            cfg.inbound_plaintext_port
        }
    } else if dport == DNS_SERVICE_PORT && pod.flags & POD_DNS_CAPTURE != 0 && cfg.dns_port != 0 {
        // DNS over TCP, to any address: the agent's DNS server (exclusions do
        // not apply, as they do not to DNS over UDP).
        cfg.dns_port
    } else {
        if is_excluded(pkt) {
            // An earlier captured flow of the same 4-tuple must not steer this one.
            if known {
                maps::forget_flow(pkt);
            }
            count(ifindex, |c| &mut c.passed);
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
            if known {
                maps::forget_flow(pkt);
            }
            count(ifindex, |c| &mut c.passed);
            return PASS;
        }
        // Fail closed: no byte of an enrolled pod leaves in plain text while the
        // proxy is away. The client's SYN retry succeeds once it is back.
        count(ifindex, |c| &mut c.dropped_no_listener);
        return DROP;
    };
    match socket::assign(ctx, sk, cfg) {
        Ok(()) => {
            if !remembered_here {
                maps::remember_flow(pkt, ifindex);
            }
            if bounced {
                if listener_port == cfg.hbone_port {
                    count(ifindex, |c| &mut c.captured_inbound_hbone);
                } else {
                    count(ifindex, |c| &mut c.captured_inbound_plaintext);
                }
            } else if listener_port == cfg.outbound_port {
                count(ifindex, |c| &mut c.captured_outbound);
            } else {
                count(ifindex, |c| &mut c.captured_dns);
            }
            OK
        }
        Err(()) => {
            count(ifindex, |c| &mut c.dropped_assign_failed);
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
    let Some(cfg) = maps::config() else {
        return PASS;
    };
    let packet = parse::parse(&ctx);
    // SAFETY: reading the context's mark.
    let mark = unsafe { (*ctx.skb.skb).mark };
    // The proxy's own connection to the pod: most of what enters a pod, so checked
    // before the pod's entry is looked up (the verdict does not depend on it; only
    // its SYN looks the pod up, to remember the flow).
    let proxy_own = mark & cfg.proxy_mark_mask == cfg.proxy_mark;
    // One match on the packet: testing it for TCP twice made LLVM read the flags
    // on a path where they were never set, which the verifier refuses.
    match packet {
        Packet::Tcp4(pkt) => to_pod_tcp(&ctx, cfg, ifindex, proxy_own, &pkt),
        Packet::Tcp6(pkt) => to_pod_tcp(&ctx, cfg, ifindex, proxy_own, &pkt),
        Packet::Udp4(pkt) => to_pod_udp(&ctx, cfg, ifindex, proxy_own, &pkt),
        Packet::Udp6(pkt) => to_pod_udp(&ctx, cfg, ifindex, proxy_own, &pkt),
        other => {
            if proxy_own || maps::pod(ifindex).is_none() {
                return PASS;
            }
            not_tcp(other, ifindex)
        }
    }
}

/// A TCP packet at the host veth's egress (entering the pod). Written once for
/// both families (see [`tcp`]).
#[inline(always)]
fn to_pod_tcp<P: Tcp>(
    ctx: &TcContext,
    cfg: &Config,
    ifindex: u32,
    proxy_own: bool,
    pkt: &P,
) -> i32 {
    let syn = pkt.is_syn();
    if proxy_own {
        // Remember it, so that the pod's replies take `from_pod`'s fast path and
        // are never passed in plain text once the proxy's socket is gone: only a
        // connection to the pod's own address, as the fast path takes the veth for
        // the pod's addresses (one pod lookup per connection). Counted once, at
        // its SYN: the proxy counts the flow's bytes.
        if syn {
            if let Some(pod) = maps::pod(ifindex)
                && pkt.is_to_pod(pod)
            {
                maps::remember_reply_flow(pkt, ifindex);
            }
            count(ifindex, |c| &mut c.passed);
        }
        return PASS;
    }
    // The veth the proxy took this flow over on, if it did (keyed as `from_pod`
    // sees the bounced packet). A SYN is a new connection, whatever was before.
    let flow = if syn { None } else { maps::captured_on(pkt) };
    // Fast path: a later packet of a flow the proxy took over on this veth
    // (remembered here only for packets addressed to this pod). Not counted: the
    // proxy counts the flow's bytes.
    if flow == Some(ifindex) {
        return redirect_to_ingress(ifindex);
    }
    let Some(pod) = maps::pod(ifindex) else {
        return PASS;
    };
    if !pkt.is_to_pod(pod) {
        count(ifindex, |c| &mut c.passed);
        return PASS;
    }
    let bounce = if syn {
        // New connections from the node itself (kubelet probes), to excluded
        // ports and to a pod that left the mesh (draining) are not captured.
        let capture = pod.flags & POD_DRAINING == 0
            && !pkt.is_from_node(cfg)
            && !maps::is_excluded_port(pkt.dport());
        if !capture {
            // An earlier captured flow of the same 4-tuple must not steer this one.
            maps::forget_flow(pkt);
        }
        capture
    } else if flow.is_some() {
        // A flow the proxy took over on another veth (a pod whose address moved
        // here): bounced, uncounted, as on the fast path. `from_pod` finds the
        // proxy's socket and remembers this veth, or drops the packet; it never
        // enters the pod in plain text.
        return redirect_to_ingress(ifindex);
    } else if socket::proxy_socket_exists(ctx, pkt) {
        // Packets of the proxy's flows, from anywhere (the node's own replies to a
        // connection the proxy opened), not remembered on this veth yet; later
        // ones take the fast path.
        maps::remember_flow(pkt, ifindex);
        true
    } else {
        // Anything else predates enrollment.
        false
    };
    if !bounce {
        count(ifindex, |c| &mut c.passed);
        return PASS;
    }
    count(ifindex, |c| &mut c.bounced);
    redirect_to_ingress(ifindex)
}

/// A UDP datagram at the host veth's egress (entering the pod). An answer of the
/// agent's DNS server (the proxy's mark, from the DNS port) gets the DNS port
/// (53) back as its source port: the server sent it from the address the pod
/// asked, but from its own port. Anything else passes, uncounted when it is
/// the proxy's.
#[inline(always)]
fn to_pod_udp<P: Udp>(
    ctx: &TcContext,
    cfg: &Config,
    ifindex: u32,
    proxy_own: bool,
    pkt: &P,
) -> i32 {
    if proxy_own {
        if cfg.dns_port != 0 && pkt.sport() == cfg.dns_port {
            // The UDP checksum covers the port (RFC 768): replaced with it.
            // `BPF_F_MARK_MANGLED_0`: an IPv4 checksum of zero (none) stays zero,
            // one computed as zero is written 0xffff. A checksum left to the
            // device (CHECKSUM_PARTIAL) holds the pseudo-header's sum only, which
            // the kernel leaves alone for a port.
            let from = cfg.dns_port.to_be() as u64;
            let to = DNS_SERVICE_PORT.to_be() as u64;
            let csum = pkt.l4() as usize + UDP_CHECK_OFFSET;
            if ctx
                .l4_csum_replace(csum, from, to, BPF_F_MARK_MANGLED_0 as u64 | 2)
                .is_err()
                || ctx
                    .store(pkt.l4() as usize, &DNS_SERVICE_PORT.to_be(), 0)
                    .is_err()
            {
                return DROP;
            }
        }
        return PASS;
    }
    if maps::pod(ifindex).is_none() {
        return PASS;
    }
    count(ifindex, |c| &mut c.passed);
    PASS
}

/// Offset of the checksum in the UDP header (RFC 768).
const UDP_CHECK_OFFSET: usize = 6;

/// Bounces the packet into the ingress of host veth `ifindex`, where `from_pod`
/// assigns it (`bpf_redirect` with `BPF_F_INGRESS`).
#[inline(always)]
fn redirect_to_ingress(ifindex: u32) -> i32 {
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
