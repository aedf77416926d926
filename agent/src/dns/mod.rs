//! The DNS server: enrolled pods' DNS queries, captured in the kernel, answered
//! from the agent's names or forwarded to the resolver the pod asked.
//!
//! * Capture: the TC programs assign an enrolled pod's UDP datagrams and TCP
//!   connections to port 53, whatever the address, to this server's sockets on
//!   127.0.0.1 and `::1`, port [`DNS_PORT`] (15053), unless the pod is annotated
//!   `ambient.istio.io/dns-capture: "false"` or the agent runs with
//!   `--dns-capture=false`. The node's and the agent's own queries never cross
//!   a pod's host veth from the pod's side and are never captured.
//! * Answering from the address asked: the UDP sockets are `IP_TRANSPARENT` and
//!   read each query's original destination (`IP_RECVORIGDSTADDR`,
//!   `IPV6_RECVORIGDSTADDR`, ip(7), ipv6(7)); the answer is sent from that
//!   address (`IP_PKTINFO`/`IPV6_PKTINFO`'s source, allowed for a transparent
//!   socket) and from the server's own port, which the program on the pod's
//!   host veth turns back into 53 (the sockets carry the proxy mark). Over TCP
//!   the accepted connection's local address is the original destination, as
//!   for the proxy's listeners.
//! * Answers: [`message::decide`] with the name table of the proxy's view
//!   ([`names::NameTable`]); what it does not answer goes to the resolver the
//!   pod asked, over the transport the pod used ([`Upstream`]), through a
//!   bounded cache ([`cache`]), at most [`DnsConfig::max_upstream`] at once; a
//!   resolver that does not answer within [`DnsConfig::upstream_timeout`] gets
//!   the pod SERVFAIL. A UDP answer larger than the pod's payload size (at most
//!   1232 bytes) is sent truncated: the pod asks again over TCP (RFC 7766).
//! * A log line per query at debug level (target `podlink_agent::dns`).

pub mod cache;
pub mod message;
pub mod names;

use std::{
    io::{self, IoSlice, IoSliceMut},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    os::fd::AsRawFd,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Message, ResponseCode},
    rr::RecordType,
};
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, SockaddrIn, SockaddrIn6, SockaddrStorage,
    recvmsg, sendmsg, setsockopt, sockopt,
};
use podlink_common::DNS_PORT;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt, Interest},
    net::{TcpListener, TcpStream, UdpSocket},
    sync::Semaphore,
};

use self::{
    cache::{Cache, Key},
    message::{Asked, Decision, Transport, decide, fit},
};
use crate::{
    proxy::{ProxyState, canonical, socket},
    telemetry::{
        logging::RateLimited,
        metrics::{DnsRequestLabels, DnsUpstreamLabels, UNKNOWN},
    },
};

/// The DNS server's settings.
#[derive(Clone, Debug)]
pub struct DnsConfig {
    /// Address of the IPv4 sockets (127.0.0.1).
    pub listen_ip: Ipv4Addr,
    /// Address of the IPv6 sockets (`::1`), `None` on a node without IPv6.
    pub listen_ip6: Option<Ipv6Addr>,
    /// Port of the sockets, UDP and TCP ([`DNS_PORT`]).
    pub port: u16,
    /// `SO_MARK` of every socket (the proxy mark).
    pub mark: u32,
    /// Time a resolver has to answer a forwarded query before the pod gets
    /// SERVFAIL.
    pub upstream_timeout: Duration,
    /// Forwarded queries under way at once; one more gets SERVFAIL at once.
    pub max_upstream: usize,
}

impl DnsConfig {
    /// The defaults for `mark` and `upstream_timeout`: loopback addresses (IPv6
    /// when `ipv6`), [`DNS_PORT`], [`MAX_UPSTREAM`] queries under way.
    pub fn new(ipv6: bool, mark: u32, upstream_timeout: Duration) -> Self {
        DnsConfig {
            listen_ip: Ipv4Addr::LOCALHOST,
            listen_ip6: ipv6.then_some(Ipv6Addr::LOCALHOST),
            port: DNS_PORT,
            mark,
            upstream_timeout,
            max_upstream: MAX_UPSTREAM,
        }
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        let mut addrs = vec![SocketAddr::from((self.listen_ip, self.port))];
        addrs.extend(self.listen_ip6.map(|ip| SocketAddr::from((ip, self.port))));
        addrs
    }
}

/// Default of [`DnsConfig::max_upstream`].
pub const MAX_UPSTREAM: usize = 1024;
/// TCP connections from pods served at once; more are closed at once.
pub const MAX_TCP_CONNECTIONS: usize = 1024;
/// A pod's TCP connection with no query for this long is closed (RFC 7766 6.2.3
/// recommends seconds).
pub const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// The bound sockets: UDP and TCP, for each family.
pub struct DnsSockets {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
}

/// A DNS socket could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("binding the DNS server's {protocol} socket {addr}: {error}")]
pub struct DnsBindError {
    /// `UDP` or `TCP`.
    pub protocol: &'static str,
    /// The address.
    pub addr: SocketAddr,
    /// The system call's error (`EADDRINUSE`; `EPERM` without `CAP_NET_ADMIN`).
    pub error: io::Error,
}

impl DnsSockets {
    /// Binds the UDP sockets (transparent, reading original destinations) and
    /// the TCP listeners (transparent) of `config`.
    ///
    /// # Errors
    /// [`DnsBindError`].
    pub fn bind(config: &DnsConfig) -> Result<Self, DnsBindError> {
        let mut udp = Vec::new();
        let mut tcp = Vec::new();
        for addr in config.addrs() {
            udp.push(udp_socket(addr, config.mark).map_err(|error| DnsBindError {
                protocol: "UDP",
                addr,
                error,
            })?);
            tcp.push(
                socket::transparent_listener(addr, config.mark).map_err(|error| DnsBindError {
                    protocol: "TCP",
                    addr,
                    error,
                })?,
            );
        }
        Ok(DnsSockets { udp, tcp })
    }
}

/// A UDP socket at `addr` that the programs assign queries to: transparent (it
/// answers from the addresses pods asked), reading each datagram's original
/// destination, marked, non-blocking. Not `SO_REUSEPORT`: `bpf_sk_assign`
/// refuses such sockets before Linux 6.5.
fn udp_socket(addr: SocketAddr, mark: u32) -> io::Result<UdpSocket> {
    let s = Socket::new(
        Domain::for_address(addr),
        Type::DGRAM.nonblocking(),
        Some(Protocol::UDP),
    )?;
    s.set_reuse_address(true)?;
    s.set_mark(mark)?;
    match addr {
        SocketAddr::V4(_) => {
            s.set_ip_transparent_v4(true)?;
            setsockopt(&s, sockopt::Ipv4OrigDstAddr, &true)?;
        }
        SocketAddr::V6(_) => {
            s.set_only_v6(true)?;
            s.set_ip_transparent_v6(true)?;
            setsockopt(&s, sockopt::Ipv6OrigDstAddr, &true)?;
        }
    }
    s.bind(&addr.into())?;
    UdpSocket::from_std(s.into())
}

/// The resolvers the server forwards to: the cache, the slots, the timeout.
pub struct Upstream {
    cache: Mutex<Cache>,
    slots: Arc<Semaphore>,
    timeout: Duration,
    mark: u32,
}

impl Upstream {
    fn new(config: &DnsConfig) -> Self {
        Upstream {
            cache: Mutex::new(Cache::default()),
            slots: Arc::new(Semaphore::new(config.max_upstream)),
            timeout: config.upstream_timeout,
            mark: config.mark,
        }
    }

    /// The cached answer to `asked` from `resolver`, fitted to `transport`.
    fn cached(&self, asked: &Asked, resolver: SocketAddr, transport: Transport) -> Option<Vec<u8>> {
        let key = Key::of(asked, resolver);
        let hit = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(
            &key,
            asked.id(),
            Instant::now(),
        )?;
        Some(fit(&hit, asked, transport))
    }

    /// Asks `resolver` `query` (the pod's bytes, `asked`) over `transport`;
    /// the answer's bytes, or SERVFAIL when it gives none in time. A UDP
    /// answer larger than the pod takes is truncated for it.
    async fn ask(
        &self,
        state: &ProxyState,
        query: &[u8],
        asked: &Asked,
        resolver: SocketAddr,
        transport: Transport,
    ) -> (Vec<u8>, &'static str) {
        let labels = DnsUpstreamLabels {
            request_protocol: transport.as_str(),
        };
        let metrics = &state.metrics.dns;
        let Ok(_slot) = self.slots.clone().try_acquire_owned() else {
            metrics.upstream_failures.get_or_create(&labels).inc();
            return (
                asked.error(ResponseCode::ServFail),
                "servfail (too many upstream queries)",
            );
        };
        metrics.upstream_requests.get_or_create(&labels).inc();
        let start = Instant::now();
        let exchanged = tokio::time::timeout(self.timeout, async {
            match transport {
                Transport::Udp => exchange_udp(query, asked, resolver, self.mark).await,
                Transport::Tcp => exchange_tcp(query, resolver, self.mark).await,
            }
        })
        .await;
        let bytes = match exchanged {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(_)) | Err(_) => {
                metrics.upstream_failures.get_or_create(&labels).inc();
                return (
                    asked.error(ResponseCode::ServFail),
                    "servfail (no upstream answer)",
                );
            }
        };
        metrics
            .upstream_duration
            .get_or_create(&labels)
            .observe(start.elapsed().as_secs_f64());
        let Ok(answer) = Message::from_vec(&bytes) else {
            // Relayed as it came: the pod's resolver judges it.
            return (bytes, "forwarded");
        };
        let fitted = match transport {
            Transport::Udp
                if bytes.len() > asked.udp_payload.min(message::UDP_MAX_PAYLOAD.into()) =>
            {
                fit(&answer, asked, transport)
            }
            _ => bytes,
        };
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).put(
            Key::of(asked, resolver),
            answer,
            Instant::now(),
        );
        (fitted, "forwarded")
    }
}

/// Sends `query` to `resolver` over UDP from a new marked socket, and returns
/// the first datagram that answers it (same ID and question).
async fn exchange_udp(
    query: &[u8],
    asked: &Asked,
    resolver: SocketAddr,
    mark: u32,
) -> io::Result<Vec<u8>> {
    let s = Socket::new(
        Domain::for_address(resolver),
        Type::DGRAM.nonblocking(),
        Some(Protocol::UDP),
    )?;
    s.set_mark(mark)?;
    let any: SocketAddr = match resolver {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    s.bind(&any.into())?;
    let s = UdpSocket::from_std(s.into())?;
    s.connect(resolver).await?;
    s.send(query).await?;
    let mut buf = vec![0u8; message::TCP_MAX_MESSAGE];
    loop {
        let n = s.recv(&mut buf).await?;
        let bytes = &buf[..n];
        if bytes.len() >= 2 && u16::from_be_bytes([bytes[0], bytes[1]]) == asked.id() {
            match Message::from_vec(bytes) {
                Ok(m) if m.queries == asked.message.queries => return Ok(bytes.to_vec()),
                // An answer whose question is not the query's is not its answer.
                Ok(_) => {}
                Err(_) => return Ok(bytes.to_vec()),
            }
        }
    }
}

/// Sends `query` to `resolver` over a new marked TCP connection and reads one
/// answer (RFC 7766: two-byte length, then the message).
async fn exchange_tcp(query: &[u8], resolver: SocketAddr, mark: u32) -> io::Result<Vec<u8>> {
    let mut stream = socket::connect(None, resolver, mark).await?;
    write_framed(&mut stream, query).await?;
    let len = stream.read_u16().await?;
    let mut answer = vec![0; usize::from(len)];
    stream.read_exact(&mut answer).await?;
    Ok(answer)
}

async fn write_framed(stream: &mut TcpStream, message: &[u8]) -> io::Result<()> {
    let len = u16::try_from(message.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a message over 65535 bytes"))?;
    let mut framed = Vec::with_capacity(message.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(message);
    stream.write_all(&framed).await
}

/// The server: its settings, the proxy's state (the view's names and pods, the
/// metrics) and its upstream.
pub struct DnsServer {
    state: Arc<ProxyState>,
    upstream: Upstream,
    tcp_slots: Arc<Semaphore>,
    recv_failed: RateLimited,
}

impl DnsServer {
    /// A server reading `state`.
    pub fn new(config: &DnsConfig, state: Arc<ProxyState>) -> Self {
        DnsServer {
            state,
            upstream: Upstream::new(config),
            tcp_slots: Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS)),
            recv_failed: RateLimited::default(),
        }
    }

    /// Decides `query` from `peer` over `transport`, counting it; the asking
    /// pod's namespace and workload come from the view.
    fn decide(&self, query: &[u8], peer: SocketAddr, transport: Transport) -> Decision {
        let view = self.state.view();
        let pod = view.workloads.by_ip(peer.ip());
        let decision = decide(
            query,
            &view.names,
            pod.map(|w| w.namespace.as_str()),
            transport,
        );
        let qtype = match &decision {
            Decision::Drop => return decision,
            Decision::Answer(_) | Decision::Refuse(..) => query_type_of(query),
            Decision::Forward(asked) => Some(asked.qtype()),
        };
        self.state
            .metrics
            .dns
            .requests
            .get_or_create(&DnsRequestLabels {
                request_query_type: qtype.map_or("other", type_label),
                request_protocol: transport.as_str(),
                source_workload: pod.map_or(UNKNOWN.into(), |w| w.workload_name.clone()),
                source_workload_namespace: pod.map_or(UNKNOWN.into(), |w| w.namespace.clone()),
            })
            .inc();
        decision
    }
}

/// The question's type of an answered query (decoded again: answered queries
/// are read twice only for this label).
fn query_type_of(query: &[u8]) -> Option<RecordType> {
    Message::from_vec(query)
        .ok()?
        .queries
        .first()
        .map(|q| q.query_type())
}

/// The `request_query_type` label: the type's name for the common types, else
/// `other`.
fn type_label(t: RecordType) -> &'static str {
    match t {
        RecordType::A => "A",
        RecordType::AAAA => "AAAA",
        RecordType::CNAME => "CNAME",
        RecordType::MX => "MX",
        RecordType::NS => "NS",
        RecordType::PTR => "PTR",
        RecordType::SOA => "SOA",
        RecordType::SRV => "SRV",
        RecordType::TXT => "TXT",
        RecordType::HTTPS => "HTTPS",
        RecordType::SVCB => "SVCB",
        RecordType::ANY => "ANY",
        _ => "other",
    }
}

/// Serves the sockets until the task is dropped.
pub async fn serve(server: Arc<DnsServer>, sockets: DnsSockets) {
    let udp = futures_util::future::join_all(
        sockets
            .udp
            .into_iter()
            .map(|s| serve_udp(server.clone(), Arc::new(s))),
    );
    let tcp = futures_util::future::join_all(
        sockets
            .tcp
            .into_iter()
            .map(|l| serve_tcp(server.clone(), l)),
    );
    tokio::join!(udp, tcp);
}

/// A datagram received: its length, its source, its original destination.
type Received = (usize, SocketAddr, Option<SocketAddr>);

/// `recvmsg(2)` of one datagram into `buf`, with its original destination.
fn recv_query(socket: &UdpSocket, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!(libc::sockaddr_in6);
    let msg = recvmsg::<SockaddrStorage>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::empty(),
    )?;
    let peer = msg
        .address
        .and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| SocketAddr::V4(SocketAddrV4::from(*v4)))
                .or_else(|| {
                    a.as_sockaddr_in6()
                        .map(|v6| SocketAddr::V6(SocketAddrV6::from(*v6)))
                })
        })
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a datagram without a source"))?;
    let mut original = None;
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::Ipv4OrigDstAddr(sa) => {
                original = Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
                    u16::from_be(sa.sin_port),
                )));
            }
            ControlMessageOwned::Ipv6OrigDstAddr(sa) => {
                original = Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sa.sin6_addr.s6_addr),
                    u16::from_be(sa.sin6_port),
                    0,
                    0,
                )));
            }
            _ => {}
        }
    }
    Ok((msg.bytes, canonical(peer), original.map(canonical)))
}

/// `sendmsg(2)` of `answer` to `to` from address `from` (the address the pod
/// asked: `IP_PKTINFO`'s `ipi_spec_dst`, `IPV6_PKTINFO`'s `ipi6_addr`).
fn send_answer(socket: &UdpSocket, answer: &[u8], to: SocketAddr, from: IpAddr) -> io::Result<()> {
    let iov = [IoSlice::new(answer)];
    let fd = socket.as_raw_fd();
    match (to, from) {
        (SocketAddr::V4(to), IpAddr::V4(from)) => {
            let info = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from(from).to_be(),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            sendmsg(
                fd,
                &iov,
                &[ControlMessage::Ipv4PacketInfo(&info)],
                MsgFlags::empty(),
                Some(&SockaddrIn::from(to)),
            )?;
        }
        (SocketAddr::V6(to), IpAddr::V6(from)) => {
            let info = libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr {
                    s6_addr: from.octets(),
                },
                ipi6_ifindex: 0,
            };
            sendmsg(
                fd,
                &iov,
                &[ControlMessage::Ipv6PacketInfo(&info)],
                MsgFlags::empty(),
                Some(&SockaddrIn6::from(to)),
            )?;
        }
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the pod and the address it asked are of different families",
            ));
        }
    }
    Ok(())
}

async fn reply(socket: &UdpSocket, answer: &[u8], to: SocketAddr, from: IpAddr) {
    if answer.is_empty() {
        return;
    }
    let _ = socket
        .async_io(Interest::WRITABLE, || send_answer(socket, answer, to, from))
        .await;
}

/// Logs one query at debug level.
fn log(transport: Transport, peer: SocketAddr, resolver: SocketAddr, what: &str, outcome: &str) {
    tracing::debug!(
        protocol = transport.as_str(),
        src = %peer,
        resolver = %resolver,
        query = what,
        outcome,
        "dns query"
    );
}

/// What a decision is about, for the log line.
fn describe(decision: &Decision) -> String {
    match decision {
        Decision::Forward(asked) => format!("{} {}", asked.name, asked.qtype()),
        Decision::Answer(_) => "answered".into(),
        Decision::Refuse(_, rcode) => format!("refused {rcode}"),
        Decision::Drop => "dropped".into(),
    }
}

async fn serve_udp(server: Arc<DnsServer>, socket: Arc<UdpSocket>) {
    let mut buf = vec![0u8; message::TCP_MAX_MESSAGE];
    loop {
        let received = socket
            .async_io(Interest::READABLE, || recv_query(&socket, &mut buf))
            .await;
        let (len, peer, original) = match received {
            Ok(r) => r,
            Err(e) => {
                server
                    .recv_failed
                    .warn(|n| format!("DNS server: receiving failed: {e} ({n} times)"));
                continue;
            }
        };
        // Without the address the pod asked it cannot be answered from it.
        let Some(resolver) = original else { continue };
        let query = &buf[..len];
        let decision = server.decide(query, peer, Transport::Udp);
        if tracing::enabled!(tracing::Level::DEBUG) {
            let outcome = match &decision {
                Decision::Answer(_) => "local",
                Decision::Refuse(..) => "refused",
                Decision::Drop => "dropped",
                Decision::Forward(_) => "forwarding",
            };
            log(
                Transport::Udp,
                peer,
                resolver,
                &describe(&decision),
                outcome,
            );
        }
        match decision {
            Decision::Answer(bytes) | Decision::Refuse(bytes, _) => {
                reply(&socket, &bytes, peer, resolver.ip()).await;
            }
            Decision::Drop => {}
            Decision::Forward(asked) => {
                if let Some(bytes) = server.upstream.cached(&asked, resolver, Transport::Udp) {
                    reply(&socket, &bytes, peer, resolver.ip()).await;
                    continue;
                }
                let query = query.to_vec();
                let server = server.clone();
                let socket = socket.clone();
                tokio::spawn(async move {
                    let (bytes, outcome) = server
                        .upstream
                        .ask(&server.state, &query, &asked, resolver, Transport::Udp)
                        .await;
                    log(Transport::Udp, peer, resolver, &asked.name, outcome);
                    reply(&socket, &bytes, peer, resolver.ip()).await;
                });
            }
        }
    }
}

async fn serve_tcp(server: Arc<DnsServer>, listener: TcpListener) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = server.tcp_slots.clone().try_acquire_owned() else {
            socket::reset_on_close(&stream);
            continue;
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let server = server.clone();
        tokio::spawn(async move {
            let _ = serve_connection(&server, stream, canonical(peer), canonical(local)).await;
            drop(slot);
        });
    }
}

/// Answers the queries of one TCP connection in order, until it closes, stays
/// idle for [`TCP_IDLE_TIMEOUT`], or sends what is not a query.
async fn serve_connection(
    server: &DnsServer,
    mut stream: TcpStream,
    peer: SocketAddr,
    resolver: SocketAddr,
) -> io::Result<()> {
    loop {
        let Ok(len) = tokio::time::timeout(TCP_IDLE_TIMEOUT, stream.read_u16()).await else {
            return Ok(());
        };
        let mut query = vec![0u8; usize::from(len?)];
        tokio::time::timeout(TCP_IDLE_TIMEOUT, stream.read_exact(&mut query))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        let decision = server.decide(&query, peer, Transport::Tcp);
        let answer = match decision {
            Decision::Answer(bytes) => {
                log(Transport::Tcp, peer, resolver, "answered", "local");
                bytes
            }
            Decision::Refuse(bytes, rcode) => {
                log(
                    Transport::Tcp,
                    peer,
                    resolver,
                    &rcode.to_string(),
                    "refused",
                );
                bytes
            }
            Decision::Drop => return Ok(()),
            Decision::Forward(asked) => {
                match server.upstream.cached(&asked, resolver, Transport::Tcp) {
                    Some(bytes) => bytes,
                    None => {
                        let (bytes, outcome) = server
                            .upstream
                            .ask(&server.state, &query, &asked, resolver, Transport::Tcp)
                            .await;
                        log(Transport::Tcp, peer, resolver, &asked.name, outcome);
                        bytes
                    }
                }
            }
        };
        if !answer.is_empty() {
            write_framed(&mut stream, &answer).await?;
        }
    }
}
