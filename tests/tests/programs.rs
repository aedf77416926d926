//! The TC programs' decisions on crafted packets, through `BPF_PROG_TEST_RUN`.
//!
//! `bpf_sk_assign` is not supported under test runs (`-EOPNOTSUPP`), so a packet
//! that reaches a socket shows up as `dropped_assign_failed`; the real redirect is
//! tested with real traffic by the other end-to-end tests. Runs in a network
//! namespace of its own, where loopback (ifindex 1) plays the host veth.

use std::net::{Ipv4Addr, Ipv6Addr, TcpListener};

use aya::{
    Ebpf,
    maps::{
        Array, HashMap, MapData, PerCpuHashMap, PerCpuValues,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use podlink_common::{
    CONFIG_DRAINING, CONFIG_FAIL_OPEN, Config, DNS_PORT, FlowKey, MAP_CAPTURED_FLOWS, MAP_CONFIG,
    MAP_COUNTERS, MAP_EXCLUDED_CIDRS, MAP_EXCLUDED_PORTS, MAP_PODS, OUTBOUND_PORT, POD_DNS_CAPTURE,
    POD_ENROLLED, POD_HAS_IPV4, POD_HAS_IPV6, PROXY_MARK, PodCounters, PodInfo, ipv4_mapped,
};
use podlink_tests::netns;

const PASS: u32 = u32::MAX; // TC_ACT_UNSPEC (-1)
const OK: u32 = 0; // TC_ACT_OK
const DROP: u32 = 2; // TC_ACT_SHOT
const REDIRECT: u32 = 7; // TC_ACT_REDIRECT

const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 7);
const NODE: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 5);
const PEER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 7);
const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 1);
const LINK_LOCAL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 5);
const IFINDEX: u32 = 1;

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

/// Ethernet + IPv4 + TCP with the given addresses, ports and flags.
/// Takes `listener` out of the kernel's socket lookup at once. Dropping it is
/// not enough: a process another thread forks in the meantime holds a copy of
/// its descriptor until it execs, and the socket listens until the last copy
/// closes. `shutdown(SHUT_RD)` on a listening socket stops it whatever holds
/// descriptors (`inet_shutdown()` disconnects a `TCP_LISTEN` socket).
fn stop_listening(listener: TcpListener) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the call (`listener` owns it).
    let r = unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RD) };
    assert_eq!(r, 0, "shutdown: {}", std::io::Error::last_os_error());
}

fn tcp(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 20];
    p[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut p[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&40u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let t = &mut p[34..54];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = flags;
    p
}

/// Ethernet + IPv6 + extension headers + `upper`, the upper-layer header of protocol
/// `proto`. `ext` lists the extension headers in order, as (header type,
/// `hdr_ext_len`): each is `(hdr_ext_len + 1) * 8` bytes, zero but for its next
/// header and length (a fragment header, type 44, takes length 0: its second byte
/// is reserved).
fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, ext: &[(u8, u8)], proto: u8, upper: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 40];
    p[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    p[14] = 0x60;
    p[20] = ext.first().map_or(proto, |e| e.0);
    p[21] = 64;
    p[22..38].copy_from_slice(&src.octets());
    p[38..54].copy_from_slice(&dst.octets());
    for (i, &(_, len)) in ext.iter().enumerate() {
        let mut header = vec![0u8; (usize::from(len) + 1) * 8];
        header[0] = ext.get(i + 1).map_or(proto, |e| e.0);
        header[1] = len;
        p.extend(header);
    }
    p.extend(upper);
    let payload = u16::try_from(p.len() - 54).unwrap();
    p[18..20].copy_from_slice(&payload.to_be_bytes());
    p
}

/// A 20-byte TCP header with the given ports and flags.
fn tcp_header(sport: u16, dport: u16, flags: u8) -> [u8; 20] {
    let mut t = [0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = flags;
    t
}

/// Ethernet + IPv6 + extension headers (see [`ipv6`]) + TCP.
fn tcp6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    ext: &[(u8, u8)],
    sport: u16,
    dport: u16,
    flags: u8,
) -> Vec<u8> {
    ipv6(src, dst, ext, 6, &tcp_header(sport, dport, flags))
}

/// The captured-flows key of a flow as `from_pod` sees its packets.
fn flow(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16) -> FlowKey {
    FlowKey::ipv4(src.octets(), dst.octets(), sport, dport)
}

/// The captured-flows key of an IPv6 flow as `from_pod` sees its packets: the
/// full addresses.
fn flow6(src: Ipv6Addr, dst: Ipv6Addr, sport: u16, dport: u16) -> FlowKey {
    FlowKey {
        saddr: src.octets(),
        daddr: dst.octets(),
        sport,
        dport,
    }
}

/// `struct __sk_buff` input: ifindex (offset 40) and mark (offset 8).
fn ctx(mark: u32) -> Vec<u8> {
    let mut c = vec![0u8; 192];
    c[8..12].copy_from_slice(&mark.to_ne_bytes());
    c[40..44].copy_from_slice(&IFINDEX.to_ne_bytes());
    c
}

struct Programs {
    ebpf: Ebpf,
}

impl Programs {
    fn load() -> Self {
        let mut ebpf =
            Ebpf::load(podlink_agent::dataplane::ebpf_object()).expect("loading the object");
        for name in ["from_pod", "to_pod"] {
            let p: &mut SchedClassifier = ebpf.program_mut(name).unwrap().try_into().unwrap();
            p.load().unwrap();
        }
        let mut config: Array<&mut MapData, Config> =
            Array::try_from(ebpf.map_mut(MAP_CONFIG).unwrap()).unwrap();
        let mut node_addrs = [[0; 16]; 8];
        node_addrs[0] = ipv4_mapped(NODE.octets());
        node_addrs[1] = NODE6.octets();
        config
            .set(
                0,
                Config {
                    node_addr_count: 2,
                    node_addrs,
                    ..Config::with_defaults(0)
                },
                0,
            )
            .unwrap();
        let mut pods: HashMap<&mut MapData, u32, PodInfo> =
            HashMap::try_from(ebpf.map_mut(MAP_PODS).unwrap()).unwrap();
        pods.insert(
            IFINDEX,
            PodInfo {
                ipv4: ipv4_mapped(POD.octets()),
                ipv6: POD6.octets(),
                flags: POD_ENROLLED | POD_HAS_IPV4 | POD_HAS_IPV6,
                workload_id: 1,
            },
            0,
        )
        .unwrap();
        let mut counters: PerCpuHashMap<&mut MapData, u32, PodCounters> =
            PerCpuHashMap::try_from(ebpf.map_mut(MAP_COUNTERS).unwrap()).unwrap();
        let cpus = aya::util::nr_cpus().unwrap();
        counters
            .insert(
                IFINDEX,
                PerCpuValues::try_from(vec![PodCounters::default(); cpus]).unwrap(),
                0,
            )
            .unwrap();
        let mut excluded: HashMap<&mut MapData, u16, u8> =
            HashMap::try_from(ebpf.map_mut(MAP_EXCLUDED_PORTS).unwrap()).unwrap();
        excluded.insert(22, 1, 0).unwrap();
        Self { ebpf }
    }

    /// Gives the pod its IPv6 address `POD6` (`on`), or leaves it without one.
    fn set_pod_ipv6(&mut self, on: bool) {
        let mut pods: HashMap<&mut MapData, u32, PodInfo> =
            HashMap::try_from(self.ebpf.map_mut(MAP_PODS).unwrap()).unwrap();
        let mut pod = pods.get(&IFINDEX, 0).unwrap();
        if on {
            pod.ipv6 = POD6.octets();
            pod.flags |= POD_HAS_IPV6;
        } else {
            pod.ipv6 = [0; 16];
            pod.flags &= !POD_HAS_IPV6;
        }
        pods.insert(IFINDEX, pod, 0).unwrap();
    }

    /// Adds an excluded destination prefix, written as the agent writes it (IPv6
    /// as it is; IPv4 would be IPv4-mapped, 96 added to its length).
    fn exclude_cidr6(&mut self, prefix: Ipv6Addr, len: u32) {
        let mut cidrs: LpmTrie<&mut MapData, [u8; 16], u8> =
            LpmTrie::try_from(self.ebpf.map_mut(MAP_EXCLUDED_CIDRS).unwrap()).unwrap();
        cidrs.insert(&Key::new(len, prefix.octets()), 1, 0).unwrap();
    }

    /// Sets (`on`) or clears the config map's `flag`.
    fn set_flag(&mut self, flag: u32, on: bool) {
        let mut config: Array<&mut MapData, Config> =
            Array::try_from(self.ebpf.map_mut(MAP_CONFIG).unwrap()).unwrap();
        let mut c = config.get(&0, 0).unwrap();
        if on {
            c.flags |= flag;
        } else {
            c.flags &= !flag;
        }
        config.set(0, c, 0).unwrap();
    }

    fn run(&mut self, program: &str, packet: &[u8], mark: u32) -> u32 {
        let ctx_in = ctx(mark);
        let p: &mut SchedClassifier = self.ebpf.program_mut(program).unwrap().try_into().unwrap();
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(packet);
        opts.ctx_in = Some(&ctx_in);
        p.test_run(opts)
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN {packet:02x?}: {e}"))
            .return_value
    }

    /// Runs `program` on `packet`; the verdict and the packet as it left.
    fn run_out(&mut self, program: &str, packet: &[u8], mark: u32) -> (u32, Vec<u8>) {
        let ctx_in = ctx(mark);
        let mut out = vec![0u8; packet.len() + 64];
        let p: &mut SchedClassifier = self.ebpf.program_mut(program).unwrap().try_into().unwrap();
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(packet);
        opts.ctx_in = Some(&ctx_in);
        opts.data_out = Some(&mut out);
        let verdict = p
            .test_run(opts)
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN {packet:02x?}: {e}"))
            .return_value;
        out.truncate(packet.len());
        (verdict, out)
    }

    /// Sets the flags of the pod's entry.
    fn set_pod_flags(&mut self, flags: u32) {
        let mut pods: HashMap<&mut MapData, u32, PodInfo> =
            HashMap::try_from(self.ebpf.map_mut(MAP_PODS).unwrap()).unwrap();
        let mut info = pods.get(&IFINDEX, 0).unwrap();
        info.flags = flags;
        pods.insert(IFINDEX, info, 0).unwrap();
    }

    fn flows(&mut self) -> HashMap<&mut MapData, FlowKey, u32> {
        HashMap::try_from(self.ebpf.map_mut(MAP_CAPTURED_FLOWS).unwrap()).unwrap()
    }

    fn counters(&self) -> PodCounters {
        let counters: PerCpuHashMap<&MapData, u32, PodCounters> =
            PerCpuHashMap::try_from(self.ebpf.map(MAP_COUNTERS).unwrap()).unwrap();
        let values = counters.get(&IFINDEX, 0).unwrap();
        values.iter().fold(PodCounters::default(), |mut sum, c| {
            sum.add(c);
            sum
        })
    }
}

/// Runs `f` in a fresh network namespace (so no listener of the machine is seen).
fn in_fresh_netns(f: impl FnOnce() + Send + 'static) {
    podlink_tests::require_root();
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("plt{}-progs{n}", std::process::id());
    netns::ip(&["netns", "add", &name]).unwrap();
    netns::register(netns::Resource::Netns(name.clone()));
    netns::ip(&["-n", &name, "link", "set", "lo", "up"]).unwrap();
    let result = netns::in_netns(&name, move || {
        f();
        Ok(())
    });
    netns::remove(&netns::Resource::Netns(name));
    result.unwrap();
}

#[test]
fn decisions_on_crafted_packets() {
    in_fresh_netns(|| {
        let mut p = Programs::load();

        // Not TCP: an ARP frame, UDP, ICMPv6: passed.
        let mut arp = vec![0u8; 60];
        arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        assert_eq!(p.run("from_pod", &arp, 0), PASS);
        let mut udp = tcp(POD, PEER, 1000, 53, 0);
        udp[23] = 17;
        assert_eq!(p.run("from_pod", &udp, 0), PASS);
        assert_eq!(p.run("to_pod", &udp, 0), PASS);
        let mut icmp6 = vec![0u8; 14 + 40 + 8];
        icmp6[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
        icmp6[14] = 0x60;
        icmp6[20] = 58;
        assert_eq!(p.run("from_pod", &icmp6, 0), PASS);
        // An MLD report: ICMPv6 behind a hop-by-hop header.
        let mut mld = vec![0u8; 14 + 40 + 8 + 8];
        mld[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
        mld[14] = 0x60;
        mld[20] = 0;
        mld[54] = 58;
        assert_eq!(p.run("from_pod", &mld, 0), PASS);

        // IPv4 from the pod with another source address: dropped, TCP or not.
        let spoofed_before = p.counters().dropped_spoofed;
        assert_eq!(p.run("from_pod", &tcp(NODE, PEER, 1000, 80, SYN), 0), DROP);
        let mut spoofed_udp = udp.clone();
        spoofed_udp[26..30].copy_from_slice(&NODE.octets());
        assert_eq!(p.run("from_pod", &spoofed_udp, 0), DROP);
        assert_eq!(p.counters().dropped_spoofed, spoofed_before + 2);

        // TCP that capture cannot steer is dropped in both directions, never
        // passed around the proxy: fragments (a first fragment with MF, a later
        // one with an offset), truncated headers.
        let before = p.counters();
        for frag_field in [0x2000u16, 0x0010] {
            let mut frag = tcp(POD, PEER, 1000, 80, SYN);
            frag[20..22].copy_from_slice(&frag_field.to_be_bytes());
            assert_eq!(p.run("from_pod", &frag, 0), DROP);
            let mut frag_in = tcp(PEER, POD, 1000, 80, SYN);
            frag_in[20..22].copy_from_slice(&frag_field.to_be_bytes());
            assert_eq!(p.run("to_pod", &frag_in, 0), DROP);
        }
        let short = tcp(POD, PEER, 1000, 80, SYN);
        assert_eq!(p.run("from_pod", &short[..40], 0), DROP);
        assert_eq!(
            p.run("to_pod", &tcp(PEER, POD, 1000, 80, SYN)[..40], 0),
            DROP
        );
        let after = p.counters();
        assert_eq!(after.dropped_fragment, before.dropped_fragment + 4);
        assert_eq!(after.dropped_unparsable, before.dropped_unparsable + 2);

        // from_pod, outbound: data of a flow from before enrollment passes.
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1000, 80, ACK), 0), PASS);
        // A SYN to an excluded port passes.
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1000, 22, SYN), 0), PASS);
        let before = p.counters();
        // A SYN with no proxy listener: dropped (fail closed).
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1000, 80, SYN), 0), DROP);
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 1
        );
        // A bounced (inbound) non-SYN that found no socket: dropped, never looped.
        assert_eq!(p.run("from_pod", &tcp(PEER, POD, 1000, 80, ACK), 0), DROP);
        assert_eq!(
            p.counters().dropped_bounce_miss,
            before.dropped_bounce_miss + 1
        );

        // Data of a flow the proxy took over: the fast path marks it for local
        // delivery (OK, no socket lookup), where the kernel's own lookup finds the
        // proxy's socket; it counts nothing (the proxy counts the bytes).
        let taken = flow(POD, PEER, 1234, 80);
        p.flows().insert(taken, IFINDEX, 0).unwrap();
        let counted = p.counters();
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1234, 80, ACK), 0), OK);
        assert_eq!(p.counters(), counted);
        // Under a draining (or stopped) proxy the slow path runs: its socket is
        // gone, so the packet is dropped, not passed in plain text.
        p.set_flag(CONFIG_DRAINING, true);
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1234, 80, ACK), 0), DROP);
        assert_eq!(p.counters().dropped_flow_gone, before.dropped_flow_gone + 1);
        p.set_flag(CONFIG_DRAINING, false);
        // The fast path holds for the veth the flow was taken over on only: the
        // same 4-tuple remembered on another veth (a pod whose address moved)
        // takes the slow path, which finds no socket and drops it.
        p.flows().insert(taken, IFINDEX + 1, 0).unwrap();
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1234, 80, ACK), 0), DROP);
        assert_eq!(p.counters().dropped_flow_gone, before.dropped_flow_gone + 2);
        // A SYN of the same 4-tuple that is not captured (an excluded port here)
        // forgets the earlier flow, so that its packets are not steered.
        let excluded_flow = FlowKey { dport: 22, ..taken };
        p.flows().insert(excluded_flow, IFINDEX, 0).unwrap();
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1234, 22, SYN), 0), PASS);
        assert!(
            p.flows().get(&excluded_flow, 0).is_err(),
            "flow not forgotten"
        );
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1234, 22, ACK), 0), PASS);

        // With the outbound listener present the SYN reaches it (assignment itself
        // is refused under test runs).
        let _outbound = TcpListener::bind((Ipv4Addr::LOCALHOST, OUTBOUND_PORT)).unwrap();
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1001, 80, SYN), 0), DROP);
        assert_eq!(
            p.counters().dropped_assign_failed,
            before.dropped_assign_failed + 1
        );
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 1
        );
        // A draining proxy: the listener is still there, but a new connection is
        // dropped as if it were not (fail closed), and only a new one.
        p.set_flag(CONFIG_DRAINING, true);
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1003, 80, SYN), 0), DROP);
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 2
        );
        assert_eq!(
            p.counters().dropped_assign_failed,
            before.dropped_assign_failed + 1
        );
        p.set_flag(CONFIG_DRAINING, false);

        // to_pod: the proxy's marked packets, the node's own and pre-enrollment
        // flows pass; new connections are bounced to ingress.
        assert_eq!(
            p.run("to_pod", &tcp(PEER, POD, 1000, 80, SYN), PROXY_MARK),
            PASS
        );
        // ... and the proxy's connection is remembered as the pod's replies will
        // look to from_pod.
        let reply = flow(POD, PEER, 80, 1000);
        assert_eq!(
            p.flows().get(&reply, 0).ok(),
            Some(IFINDEX),
            "proxy flow not remembered on its veth"
        );
        // The pod's replies to it take the fast path.
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 80, 1000, ACK), 0), OK);
        // A proxy connection to an address that is not the pod's is not remembered:
        // the fast path takes the veth for the pod's addresses.
        let elsewhere = Ipv4Addr::new(10, 244, 1, 99);
        assert_eq!(
            p.run("to_pod", &tcp(PEER, elsewhere, 1000, 80, SYN), PROXY_MARK),
            PASS
        );
        assert!(
            p.flows().get(&flow(elsewhere, PEER, 80, 1000), 0).is_err(),
            "a flow of another address was remembered"
        );
        // A connection from the node is not captured, and forgets an earlier
        // captured flow of its 4-tuple.
        let from_node = flow(NODE, POD, 1000, 80);
        p.flows().insert(from_node, IFINDEX, 0).unwrap();
        assert_eq!(p.run("to_pod", &tcp(NODE, POD, 1000, 80, SYN), 0), PASS);
        assert!(p.flows().get(&from_node, 0).is_err(), "flow not forgotten");
        assert_eq!(p.run("to_pod", &tcp(PEER, POD, 1000, 80, ACK), 0), PASS);
        assert_eq!(p.run("to_pod", &tcp(PEER, POD, 1000, 22, SYN), 0), PASS);
        assert_eq!(
            p.run(
                "to_pod",
                &tcp(PEER, Ipv4Addr::new(10, 244, 1, 99), 1000, 80, SYN),
                0
            ),
            PASS
        );
        let bounced = p.counters().bounced;
        assert_eq!(p.run("to_pod", &tcp(PEER, POD, 1000, 80, SYN), 0), REDIRECT);
        assert_eq!(p.counters().bounced, bounced + 1);
        // A SYN-ACK is not a new connection.
        assert_eq!(
            p.run("to_pod", &tcp(PEER, POD, 1000, 80, SYN | ACK), 0),
            PASS
        );
        // Data of a flow the proxy took over (keyed as from_pod sees the bounced
        // packet) is bounced without a socket lookup.
        let inbound = flow(PEER, POD, 1000, 8080);
        p.flows().insert(inbound, IFINDEX, 0).unwrap();
        assert_eq!(
            p.run("to_pod", &tcp(PEER, POD, 1000, 8080, ACK), 0),
            REDIRECT
        );
        assert_eq!(p.counters().bounced, bounced + 1);
        // ... and its bounced packet is delivered locally by from_pod.
        assert_eq!(p.run("from_pod", &tcp(PEER, POD, 1000, 8080, ACK), 0), OK);
        // Remembered on another veth (a pod whose address moved here), it is still
        // bounced, never let into the pod in plain text, and from_pod, finding no
        // proxy socket for it, drops it.
        p.flows().insert(inbound, IFINDEX + 1, 0).unwrap();
        assert_eq!(
            p.run("to_pod", &tcp(PEER, POD, 1000, 8080, ACK), 0),
            REDIRECT
        );
        let misses = p.counters().dropped_bounce_miss;
        assert_eq!(p.run("from_pod", &tcp(PEER, POD, 1000, 8080, ACK), 0), DROP);
        assert_eq!(p.counters().dropped_bounce_miss, misses + 1);

        // Fail open (a flag, off by default): with no listener, an outbound SYN
        // passes; an inbound one is still dropped.
        stop_listening(_outbound);
        p.set_flag(CONFIG_FAIL_OPEN, true);
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1002, 80, SYN), 0), PASS);
        assert_eq!(p.run("from_pod", &tcp(PEER, POD, 1002, 80, SYN), 0), DROP);
    });
}

#[test]
fn ipv6_decisions_on_crafted_packets() {
    in_fresh_netns(|| {
        let mut p = Programs::load();
        let udp_header = [0u8; 8];
        // An ICMPv6 echo request.
        let echo = [128u8, 0, 0, 0, 0, 0, 0, 1];
        // A neighbour solicitation (type 135) for the node's link-local address.
        let mut solicitation = [0u8; 24];
        solicitation[0] = 135;
        solicitation[8..24].copy_from_slice(&Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1).octets());
        let solicited_node: Ipv6Addr = "ff02::1:ff00:1".parse().unwrap();
        let all_routers: Ipv6Addr = "ff02::2".parse().unwrap();
        let mld_routers: Ipv6Addr = "ff02::16".parse().unwrap();

        // Not TCP, from the pod's own address: passed, both ways, also behind
        // extension headers and as a fragment (large UDP, as in IPv4).
        let before = p.counters();
        for packet in [
            ipv6(POD6, PEER6, &[], 17, &udp_header),
            ipv6(POD6, PEER6, &[], 58, &echo),
            ipv6(POD6, PEER6, &[(60, 0)], 17, &udp_header),
            ipv6(POD6, PEER6, &[(44, 0)], 17, &udp_header),
            ipv6(POD6, PEER6, &[], 59, &[]),
        ] {
            assert_eq!(p.run("from_pod", &packet, 0), PASS);
        }
        assert_eq!(
            p.run("to_pod", &ipv6(PEER6, POD6, &[], 17, &udp_header), 0),
            PASS
        );
        assert_eq!(p.run("to_pod", &ipv6(PEER6, POD6, &[], 58, &echo), 0), PASS);
        assert_eq!(p.counters().passed, before.passed + 7);

        // Neighbour discovery and MLD, from a link-local address or from `::`
        // (duplicate address detection), pass whether the pod has an IPv6 address
        // or not (an IPv4-only pod's interface has IPv6 on all the same).
        for has_ipv6 in [true, false] {
            p.set_pod_ipv6(has_ipv6);
            let before = p.counters();
            for packet in [
                ipv6(LINK_LOCAL, solicited_node, &[], 58, &solicitation),
                ipv6(
                    Ipv6Addr::UNSPECIFIED,
                    solicited_node,
                    &[],
                    58,
                    &solicitation,
                ),
                ipv6(
                    LINK_LOCAL,
                    all_routers,
                    &[],
                    58,
                    &[133, 0, 0, 0, 0, 0, 0, 0],
                ),
                ipv6(
                    LINK_LOCAL,
                    mld_routers,
                    &[(0, 0)],
                    58,
                    &[143, 0, 0, 0, 0, 0, 0, 0],
                ),
            ] {
                assert_eq!(
                    p.run("from_pod", &packet, 0),
                    PASS,
                    "pod has IPv6: {has_ipv6}"
                );
            }
            assert_eq!(p.counters().passed, before.passed + 4);
            assert_eq!(p.counters().dropped_spoofed, before.dropped_spoofed);
        }

        // A pod without an IPv6 address (in the mesh's view) sending from a global
        // or unique local address: spoofed, TCP or not.
        let before = p.counters();
        assert_eq!(
            p.run("from_pod", &ipv6(POD6, PEER6, &[], 17, &udp_header), 0),
            DROP
        );
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1000, 80, SYN), 0),
            DROP
        );
        assert_eq!(p.counters().dropped_spoofed, before.dropped_spoofed + 2);
        p.set_pod_ipv6(true);

        // A pod with an IPv6 address sending from another one: spoofed, TCP or
        // not, checked before any capture decision.
        let before = p.counters();
        let elsewhere: Ipv6Addr = "fd00:10:244:1::99".parse().unwrap();
        for packet in [
            ipv6(elsewhere, PEER6, &[], 17, &udp_header),
            ipv6(elsewhere, PEER6, &[], 58, &echo),
            ipv6(Ipv6Addr::LOCALHOST, PEER6, &[], 17, &udp_header),
            tcp6(elsewhere, PEER6, &[], 1000, 80, SYN),
            tcp6(elsewhere, PEER6, &[(0, 0), (60, 0)], 1000, 80, ACK),
            // TCP from a link-local source to a routable address, or from `::`.
            tcp6(LINK_LOCAL, PEER6, &[], 1000, 80, SYN),
            tcp6(Ipv6Addr::UNSPECIFIED, PEER6, &[], 1000, 80, SYN),
        ] {
            assert_eq!(p.run("from_pod", &packet, 0), DROP);
        }
        assert_eq!(p.counters().dropped_spoofed, before.dropped_spoofed + 7);

        // TCP between link-local addresses (the pod and its node) passes
        // uncaptured, as to an excluded prefix: it never leaves the link.
        let before = p.counters();
        let node_link_local = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
        assert_eq!(
            p.run(
                "from_pod",
                &tcp6(LINK_LOCAL, node_link_local, &[], 1000, 80, SYN),
                0
            ),
            PASS
        );
        assert_eq!(
            p.run(
                "from_pod",
                &tcp6(POD6, node_link_local, &[], 1000, 80, SYN),
                0
            ),
            PASS
        );
        assert_eq!(p.counters().passed, before.passed + 2);
        assert_eq!(p.counters().captured_outbound, before.captured_outbound);

        // IPv6 TCP is captured as IPv4 TCP is (see `decisions_on_crafted_packets`),
        // also behind hop-by-hop, routing (16 bytes) and destination options
        // headers, up to four of them.
        let chain = [(0, 0), (43, 1), (60, 0)];
        let four = [(0, 0), (60, 1), (43, 0), (60, 0)];
        // from_pod, outbound: data of a flow from before enrollment passes; a SYN
        // to an excluded port or prefix passes.
        let before = p.counters();
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1000, 80, ACK), 0),
            PASS
        );
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &chain, 1000, 22, SYN), 0),
            PASS
        );
        let excluded: Ipv6Addr = "fd00:99::7".parse().unwrap();
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, excluded, &[], 1000, 80, SYN), 0),
            DROP,
            "captured before its prefix is excluded"
        );
        p.exclude_cidr6("fd00:99::".parse().unwrap(), 64);
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, excluded, &[], 1000, 80, SYN), 0),
            PASS
        );
        assert_eq!(p.counters().passed, before.passed + 3);
        // A SYN with no proxy listener on [::1]: dropped (fail closed), with or
        // without extension headers.
        let before = p.counters();
        for ext in [&[][..], &chain, &four] {
            assert_eq!(
                p.run("from_pod", &tcp6(POD6, PEER6, ext, 1000, 80, SYN), 0),
                DROP,
                "{ext:?}"
            );
        }
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 3
        );
        // A bounced (inbound) non-SYN that found no socket: dropped, never looped.
        assert_eq!(
            p.run("from_pod", &tcp6(PEER6, POD6, &[], 1000, 80, ACK), 0),
            DROP
        );
        assert_eq!(
            p.counters().dropped_bounce_miss,
            before.dropped_bounce_miss + 1
        );

        // Data of an IPv6 flow the proxy took over (keyed by its full addresses):
        // the fast path, uncounted, also behind extension headers.
        let taken = flow6(POD6, PEER6, 1234, 80);
        p.flows().insert(taken, IFINDEX, 0).unwrap();
        let counted = p.counters();
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1234, 80, ACK), 0),
            OK
        );
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &chain, 1234, 80, ACK), 0),
            OK
        );
        assert_eq!(p.counters(), counted);
        // Under a draining proxy the slow path finds its socket gone: dropped.
        p.set_flag(CONFIG_DRAINING, true);
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1234, 80, ACK), 0),
            DROP
        );
        assert_eq!(p.counters().dropped_flow_gone, before.dropped_flow_gone + 1);
        p.set_flag(CONFIG_DRAINING, false);
        // Its 4-tuple's SYN to an excluded port forgets the earlier flow.
        let excluded_flow = FlowKey { dport: 22, ..taken };
        p.flows().insert(excluded_flow, IFINDEX, 0).unwrap();
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1234, 22, SYN), 0),
            PASS
        );
        assert!(
            p.flows().get(&excluded_flow, 0).is_err(),
            "flow not forgotten"
        );

        // With the outbound listener on [::1] (where the proxy binds its IPv6
        // listeners) the SYN reaches it (assignment itself is refused under test
        // runs), also behind extension headers; a draining proxy drops it as if
        // the listener were gone.
        let before = p.counters();
        let _outbound = TcpListener::bind((Ipv6Addr::LOCALHOST, OUTBOUND_PORT)).unwrap();
        for ext in [&[][..], &chain] {
            assert_eq!(
                p.run("from_pod", &tcp6(POD6, PEER6, ext, 1001, 80, SYN), 0),
                DROP
            );
        }
        assert_eq!(
            p.counters().dropped_assign_failed,
            before.dropped_assign_failed + 2
        );
        assert_eq!(p.counters().dropped_no_listener, before.dropped_no_listener);
        p.set_flag(CONFIG_DRAINING, true);
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1003, 80, SYN), 0),
            DROP
        );
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 1
        );
        p.set_flag(CONFIG_DRAINING, false);

        // to_pod: the proxy's own SYN passes and is remembered as the pod's
        // replies will look to from_pod, which takes them on the fast path.
        assert_eq!(
            p.run("to_pod", &tcp6(PEER6, POD6, &[], 1000, 80, SYN), PROXY_MARK),
            PASS
        );
        assert_eq!(
            p.flows().get(&flow6(POD6, PEER6, 80, 1000), 0).ok(),
            Some(IFINDEX),
            "proxy flow not remembered on its veth"
        );
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 80, 1000, ACK), 0),
            OK
        );
        // A connection from the node's IPv6 address is not captured, and forgets
        // an earlier captured flow of its 4-tuple; neither is one to an excluded
        // port, data of a flow from before enrollment, or a SYN-ACK.
        let from_node = flow6(NODE6, POD6, 1000, 80);
        p.flows().insert(from_node, IFINDEX, 0).unwrap();
        let before = p.counters();
        for packet in [
            tcp6(NODE6, POD6, &[], 1000, 80, SYN),
            tcp6(PEER6, POD6, &[], 1000, 22, SYN),
            tcp6(PEER6, POD6, &[], 1000, 80, ACK),
            tcp6(PEER6, POD6, &[], 1000, 80, SYN | ACK),
        ] {
            assert_eq!(p.run("to_pod", &packet, 0), PASS);
        }
        assert!(p.flows().get(&from_node, 0).is_err(), "flow not forgotten");
        assert_eq!(p.counters().passed, before.passed + 4);
        // New connections to the pod's IPv6 address are bounced to ingress, also
        // behind extension headers.
        for ext in [&[][..], &chain] {
            assert_eq!(
                p.run("to_pod", &tcp6(PEER6, POD6, ext, 1000, 80, SYN), 0),
                REDIRECT
            );
        }
        assert_eq!(p.counters().bounced, before.bounced + 2);
        // Data of an inbound flow the proxy took over: bounced without a lookup,
        // uncounted, and delivered locally by from_pod.
        let inbound = flow6(PEER6, POD6, 1000, 8080);
        p.flows().insert(inbound, IFINDEX, 0).unwrap();
        assert_eq!(
            p.run("to_pod", &tcp6(PEER6, POD6, &[], 1000, 8080, ACK), 0),
            REDIRECT
        );
        assert_eq!(p.counters().bounced, before.bounced + 2);
        assert_eq!(
            p.run("from_pod", &tcp6(PEER6, POD6, &[], 1000, 8080, ACK), 0),
            OK
        );
        // A bounced SYN meets the inbound listeners on [::1]: none here.
        assert_eq!(
            p.run("from_pod", &tcp6(PEER6, POD6, &[], 1000, 80, SYN), 0),
            DROP
        );
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 1
        );

        // Fail open: with no listener, an outbound SYN passes; an inbound one is
        // still dropped.
        stop_listening(_outbound);
        p.set_flag(CONFIG_FAIL_OPEN, true);
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1002, 80, SYN), 0),
            PASS
        );
        assert_eq!(
            p.run("from_pod", &tcp6(PEER6, POD6, &[], 1002, 80, SYN), 0),
            DROP
        );
        p.set_flag(CONFIG_FAIL_OPEN, false);
        // An IPv4 listener does not take IPv6 connections.
        let _outbound4 = TcpListener::bind((Ipv4Addr::LOCALHOST, OUTBOUND_PORT)).unwrap();
        let before = p.counters();
        assert_eq!(
            p.run("from_pod", &tcp6(POD6, PEER6, &[], 1004, 80, SYN), 0),
            DROP
        );
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 1
        );

        // Fragments of TCP (or of extension headers that may hide it): dropped.
        let before = p.counters();
        for (program, packet) in [
            ("from_pod", tcp6(POD6, PEER6, &[(44, 0)], 1000, 80, SYN)),
            (
                "from_pod",
                tcp6(POD6, PEER6, &[(0, 0), (44, 0)], 1000, 80, SYN),
            ),
            (
                "from_pod",
                ipv6(POD6, PEER6, &[(44, 0), (60, 0)], 17, &udp_header),
            ),
            ("to_pod", tcp6(PEER6, POD6, &[(44, 0)], 1000, 80, SYN)),
        ] {
            assert_eq!(p.run(program, &packet, 0), DROP, "{program}");
        }
        assert_eq!(p.counters().dropped_fragment, before.dropped_fragment + 4);

        // Unreadable: more than four extension headers, a truncated TCP header or
        // extension header, a wrong IP version: dropped as truncated IPv4 TCP is.
        // (A truncated fixed IPv6 header is parsed as unreadable too, but
        // `BPF_PROG_TEST_RUN` refuses such a packet with `EINVAL`.)
        let before = p.counters();
        let five = [(0, 0), (60, 0), (43, 0), (60, 0), (60, 0)];
        let mut version4 = tcp6(POD6, PEER6, &[], 1000, 80, SYN);
        version4[14] = 0x40;
        let mut long_option = tcp6(POD6, PEER6, &[(0, 0)], 1000, 80, SYN);
        long_option[55] = 2; // 24 bytes announced: the TCP header is cut
        for (program, packet) in [
            ("from_pod", tcp6(POD6, PEER6, &five, 1000, 80, SYN)),
            ("from_pod", ipv6(POD6, PEER6, &five, 17, &udp_header)),
            ("to_pod", tcp6(PEER6, POD6, &five, 1000, 80, SYN)),
            (
                "from_pod",
                tcp6(POD6, PEER6, &[], 1000, 80, SYN)[..14 + 40 + 10].to_vec(),
            ),
            (
                "from_pod",
                tcp6(POD6, PEER6, &chain, 1000, 80, SYN)[..14 + 40 + 32 + 10].to_vec(),
            ),
            ("from_pod", long_option),
            ("from_pod", version4),
        ] {
            assert_eq!(p.run(program, &packet, 0), DROP, "{program}");
        }
        assert_eq!(
            p.counters().dropped_unparsable,
            before.dropped_unparsable + 7
        );

        // IPv4 is unchanged by the pod's IPv6 address.
        assert_eq!(p.run("from_pod", &tcp(POD, PEER, 1000, 80, ACK), 0), PASS);
        assert_eq!(p.run("from_pod", &tcp(NODE, PEER, 1000, 80, ACK), 0), DROP);
    });
}

/// Per-path cost of the programs in a `BPF_PROG_TEST_RUN` loop (hot caches, no
/// `bpf_stats`), for profiling; ignored by default, run with
/// `cargo test --release -p podlink-tests --test programs -- --ignored --nocapture`.
/// Each path's verdict is checked; the times are printed, not judged.
/// Ethernet + IPv4 + UDP with the given addresses and ports, 4 bytes of
/// payload, and a valid UDP checksum (RFC 768).
fn udp4(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 12];
    p[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut p[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&32u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let udp = &mut p[34..46];
    udp[0..2].copy_from_slice(&sport.to_be_bytes());
    udp[2..4].copy_from_slice(&dport.to_be_bytes());
    udp[4..6].copy_from_slice(&12u16.to_be_bytes());
    udp[8..12].copy_from_slice(b"dns!");
    let sum = udp4_checksum(&p);
    p[40..42].copy_from_slice(&sum.to_be_bytes());
    p
}

/// The one's complement sum (RFC 1071) of the IPv4 pseudo-header and the UDP
/// datagram of `packet` (an `udp4` frame), complemented: 0 when the checksum
/// in it is right.
fn udp4_checksum(packet: &[u8]) -> u16 {
    let udp = &packet[34..];
    let mut words: Vec<u8> = packet[26..34].to_vec();
    words.extend_from_slice(&[0, 17]);
    words.extend_from_slice(&(udp.len() as u16).to_be_bytes());
    words.extend_from_slice(udp);
    let mut sum: u32 = words
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// DNS capture: a pod's query to port 53 without the agent's DNS socket is
/// dropped (fail closed) or passed (fail open), and only when the pod's DNS is
/// captured; the DNS server's answer gets port 53 back as its source port,
/// its checksum still right; other UDP passes untouched.
#[test]
fn dns_queries_and_answers() {
    in_fresh_netns(|| {
        let mut p = Programs::load();
        let query = udp4(POD, PEER, 40000, 53);
        // Not captured without the pod's flag.
        assert_eq!(p.run("from_pod", &query, 0), PASS);
        p.set_pod_flags(POD_ENROLLED | POD_HAS_IPV4 | POD_HAS_IPV6 | POD_DNS_CAPTURE);
        let before = p.counters();
        assert_eq!(
            p.run("from_pod", &query, 0),
            DROP,
            "no DNS socket: fail closed"
        );
        assert_eq!(
            p.counters().dropped_no_listener,
            before.dropped_no_listener + 1
        );
        // Another port passes.
        assert_eq!(p.run("from_pod", &udp4(POD, PEER, 40000, 54), 0), PASS);
        // From another address: spoofed.
        assert_eq!(p.run("from_pod", &udp4(NODE, PEER, 40000, 53), 0), DROP);
        p.set_flag(CONFIG_FAIL_OPEN, true);
        assert_eq!(p.run("from_pod", &query, 0), PASS, "fail open");
        p.set_flag(CONFIG_FAIL_OPEN, false);

        // The answer, from the DNS port with the proxy's mark.
        let answer = udp4(PEER, POD, DNS_PORT, 40000);
        let (verdict, out) = p.run_out("to_pod", &answer, PROXY_MARK);
        assert_eq!(verdict, PASS);
        assert_eq!(u16::from_be_bytes([out[34], out[35]]), 53);
        assert_eq!(udp4_checksum(&out), 0, "the checksum follows the port");
        assert_eq!(out[36..40], answer[36..40]);
        assert_eq!(out[42..], answer[42..]);
        // Without the mark, or from another port: untouched.
        for (packet, mark) in [
            (answer.clone(), 0),
            (udp4(PEER, POD, 5353, 40000), PROXY_MARK),
        ] {
            let (verdict, out) = p.run_out("to_pod", &packet, mark);
            assert_eq!(verdict, PASS);
            assert_eq!(out, packet);
        }
    });
}

#[test]
#[ignore]
fn cost_per_path() {
    in_fresh_netns(|| {
        let mut p = Programs::load();
        let taken = flow(POD, PEER, 1234, 80);
        p.flows().insert(taken, IFINDEX, 0).unwrap();
        p.flows()
            .insert(flow6(POD6, PEER6, 1234, 80), IFINDEX, 0)
            .unwrap();
        let mut udp = tcp(POD, PEER, 1000, 53, 0);
        udp[23] = 17;
        let paths = [
            (
                "from_pod, a captured flow (fast path)",
                "from_pod",
                tcp(POD, PEER, 1234, 80, ACK),
                0,
                OK,
            ),
            (
                "from_pod, a flow from before enrollment",
                "from_pod",
                tcp(POD, PEER, 1235, 80, ACK),
                0,
                PASS,
            ),
            ("from_pod, UDP", "from_pod", udp, 0, PASS),
            (
                "to_pod, the proxy's own packet",
                "to_pod",
                tcp(PEER, POD, 80, 1234, ACK),
                PROXY_MARK,
                PASS,
            ),
            (
                "to_pod, a flow from before enrollment",
                "to_pod",
                tcp(PEER, POD, 80, 1234, ACK),
                0,
                PASS,
            ),
            (
                "from_pod, a captured IPv6 flow (fast path)",
                "from_pod",
                tcp6(POD6, PEER6, &[], 1234, 80, ACK),
                0,
                OK,
            ),
            (
                "from_pod, an IPv6 flow from before enrollment",
                "from_pod",
                tcp6(POD6, PEER6, &[], 1235, 80, ACK),
                0,
                PASS,
            ),
            (
                "to_pod, an IPv6 flow from before enrollment",
                "to_pod",
                tcp6(PEER6, POD6, &[], 80, 1234, ACK),
                0,
                PASS,
            ),
        ];
        for (name, program, packet, mark, verdict) in paths {
            let ctx_in = ctx(mark);
            let prog: &mut SchedClassifier =
                p.ebpf.program_mut(program).unwrap().try_into().unwrap();
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(&packet);
            opts.ctx_in = Some(&ctx_in);
            opts.repeat = 1_000_000;
            let run = prog.test_run(opts).unwrap();
            assert_eq!(run.return_value, verdict, "{name}");
            eprintln!("{name}: {:?} per run", run.duration);
        }
    });
}
