//! HBONE: TCP tunnelled in HTTP/2 CONNECT streams over mutual TLS 1.3, as Istio
//! ambient's ztunnel speaks it (Istio documentation, "HBONE"; RFC 9113 §8.5 for
//! CONNECT).
//!
//! A request is `:method CONNECT`, `:authority <destination ip>:<port>` (an IPv6
//! address in brackets, `[fd00::2]:8080`, RFC 3986 §3.2.2) and a
//! `forwarded: for=<client ip>` header (RFC 7239) and a `baggage` header naming
//! the client's workload ([`Baggage`]). The server answers 200 (with its
//! workload's `baggage`) and then
//! both DATA streams carry the connection's bytes; END_STREAM is a half-close.
//! Errors, as ztunnel returns them: 400 (not CONNECT, malformed authority, or a
//! destination this server does not serve), 401 (denied by policy), 503 (the
//! destination could not be reached).

use std::{
    io,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes};
use h2::{RecvStream, SendStream};
use http::{HeaderValue, Method, Request, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::copy::{Chunk, Sink, Source};

/// Per-stream flow-control window (bytes): many times the bandwidth-delay
/// product between nodes of a cluster, and what a stream may make the receiving
/// proxy hold; 4 MiB windows with 256 KiB frames cost the agent 6 MiB more
/// resident memory under a single stream, for no throughput (`cargo xtask bench`).
pub const STREAM_WINDOW: u32 = 1024 * 1024;
/// Per-connection flow-control window (bytes).
pub const CONNECTION_WINDOW: u32 = 4 * 1024 * 1024;
/// Largest frame payload this side accepts (bytes): the `SETTINGS_MAX_FRAME_SIZE`
/// it announces (RFC 9113 §6.5.2); the peer's setting bounds what it sends.
pub const MAX_FRAME_SIZE: u32 = 64 * 1024;
/// The unsent TLS records rustls holds on an HBONE connection, which bounds what
/// it takes per write (bytes; rustls's default is 64 KiB). A write is taken whole
/// while the records already waiting and its own (16 KiB of plaintext each, plus
/// 22 bytes) fit: with none waiting, a DATA frame of the copier's largest read
/// (64 KiB) and its 9-byte header (RFC 9113 §4.1) is taken in one write and goes
/// out in one `writev`. With the default, that frame's last 9 bytes went in a
/// second write, a record and a system call of their own. A connection whose
/// socket is full holds up to this much, twice the default.
pub const TLS_BUFFER_LIMIT: usize = 128 * 1024;

/// Sets [`TLS_BUFFER_LIMIT`] on an HBONE connection's TLS session, once its
/// handshake is done.
pub fn take_whole_frames<D>(tls: &mut rustls::ConnectionCommon<D>) {
    tls.set_buffer_limit(Some(TLS_BUFFER_LIMIT));
}

/// Concurrent streams one HBONE connection accepts (`SETTINGS_MAX_CONCURRENT_STREAMS`,
/// RFC 9113 §6.5.2); a stream over it is reset with `REFUSED_STREAM` (§5.1.2).
/// Each open stream also holds a connection slot and one of its client
/// address's share of them ([`ConnectionLimits::peer_connections`]).
///
/// [`ConnectionLimits::peer_connections`]: super::ConnectionLimits::peer_connections
pub const MAX_CONCURRENT_STREAMS: u32 = 1000;
/// Largest request header block a server accepts (bytes, as HPACK decodes it:
/// names, values and 32 bytes per field, RFC 9113 §6.5.2). A larger one is
/// answered 431 and reset; one over four times as large (h2's "way too
/// large") closes the connection with GOAWAY `ENHANCE_YOUR_CALM`. It also bounds
/// CONTINUATION floods (CVE-2024-27316): h2 closes the connection with GOAWAY
/// `ENHANCE_YOUR_CALM` after more CONTINUATION frames in one header block than
/// this size takes in frames of [`MAX_FRAME_SIZE`], plus a quarter, and at least
/// 5 (so 5 here): an unfinished header block holds at most 6 frames' payload
/// (384 KiB).
pub const MAX_HEADER_LIST_SIZE: u32 = 16 * 1024;
/// Streams the client may reset before the server accepted them (RFC 9113
/// §6.4): one more closes the connection with GOAWAY `ENHANCE_YOUR_CALM`. The
/// "rapid reset" of CVE-2023-44487 (HEADERS then RST_STREAM, over and over)
/// meets it at once; a stream reset after it was accepted gives its slots back
/// as soon as the proxy sees the reset (`inbound.rs`). h2's default.
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset because of the client's protocol errors on one
/// connection; one more closes it with GOAWAY `ENHANCE_YOUR_CALM` ("MadeYouReset",
/// CVE-2025-8671). h2's default.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;
/// Streams the server reset and remembers (to ignore the client's frames on them)
/// for [`RESET_STREAM_DURATION`]; beyond it the oldest are forgotten, so the
/// memory they take is bounded. h2's defaults.
pub const MAX_CONCURRENT_RESET_STREAMS: usize = 50;
/// See [`MAX_CONCURRENT_RESET_STREAMS`].
pub const RESET_STREAM_DURATION: std::time::Duration = std::time::Duration::from_secs(1);
/// Bytes a stream may queue to send before it waits (bytes): what the proxy holds
/// for a client that does not read, per stream, whatever window the client
/// grants; the copier stops reading the pod meanwhile, so the pod's socket
/// fills and TCP stops it. h2's (and hyper's) default.
pub const MAX_SEND_BUFFER_SIZE: usize = 400 * 1024;

/// The `forwarded` header.
pub const FORWARDED: &str = "forwarded";

/// The `baggage` header (W3C Baggage): the workload on the other side, for
/// the metrics' peer labels when its address names no workload known here.
pub const BAGGAGE: &str = "baggage";

/// A workload as the `baggage` header names it, with the OpenTelemetry keys
/// ztunnel sends and reads (its `src/baggage.rs`): `k8s.cluster.name`,
/// `k8s.namespace.name`, `k8s.<kind>.name` (`deployment`, `cronjob`, `pod`,
/// `job`), `service.name` (the canonical service), `service.version` (the
/// canonical revision). Values are the names as they are (Kubernetes names
/// need no percent-encoding, W3C Baggage §3.2.1.1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Baggage {
    /// `k8s.cluster.name`.
    pub cluster: String,
    /// `k8s.namespace.name`.
    pub namespace: String,
    /// `k8s.<kind>.name`.
    pub workload: String,
    /// `service.name`.
    pub service: String,
    /// `service.version`.
    pub revision: String,
}

impl Baggage {
    /// The header naming workload `w` of cluster `cluster` ([`Baggage::header`]).
    pub fn of(cluster: &str, w: &crate::state::Workload) -> Option<HeaderValue> {
        Baggage {
            cluster: cluster.to_string(),
            namespace: w.namespace.clone(),
            workload: w.workload_name.clone(),
            service: w.canonical_service.clone(),
            revision: w.canonical_revision.clone(),
        }
        .header(&w.workload_kind)
    }

    /// The header's value, `kind` (the workload's: `Deployment`, `CronJob`,
    /// `Job`, `Pod`) naming the workload key; a kind ztunnel does not read
    /// (`StatefulSet`, …) is sent as `k8s.deployment.name`, which it reads.
    /// `None` if a value cannot be in a header.
    pub fn header(&self, kind: &str) -> Option<HeaderValue> {
        let kind = match kind {
            "CronJob" => "cronjob",
            "Job" => "job",
            "Pod" => "pod",
            _ => "deployment",
        };
        let pairs = [
            ("k8s.cluster.name", &self.cluster),
            ("k8s.namespace.name", &self.namespace),
            (&*format!("k8s.{kind}.name"), &self.workload),
            ("service.name", &self.service),
            ("service.version", &self.revision),
        ]
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
        HeaderValue::from_str(&pairs).ok()
    }

    /// Reads every `baggage` value of `headers`; members podlink does not know,
    /// and malformed ones, are ignored. `None` when nothing is known.
    pub fn parse(headers: &http::HeaderMap) -> Option<Self> {
        let mut b = Baggage::default();
        for value in headers.get_all(BAGGAGE) {
            let Ok(text) = value.to_str() else { continue };
            for member in text.split(',') {
                // Properties (`;…`) are not read.
                let member = member.split(';').next().unwrap_or_default();
                let Some((key, value)) = member.split_once('=') else {
                    continue;
                };
                let value = value.trim().to_string();
                match key.trim() {
                    "k8s.cluster.name" => b.cluster = value,
                    "k8s.namespace.name" => b.namespace = value,
                    "k8s.deployment.name"
                    | "k8s.cronjob.name"
                    | "k8s.pod.name"
                    | "k8s.job.name" => b.workload = value,
                    "service.name" => b.service = value,
                    "service.version" => b.revision = value,
                    _ => {}
                }
            }
        }
        (b != Baggage::default()).then_some(b)
    }
}

impl crate::telemetry::metrics::WorkloadMeta for Baggage {
    fn name(&self) -> &str {
        &self.workload
    }

    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn workload_name(&self) -> &str {
        &self.workload
    }

    fn canonical_service(&self) -> &str {
        &self.service
    }

    fn canonical_revision(&self) -> &str {
        &self.revision
    }

    fn label(&self, _key: &str) -> Option<&str> {
        None
    }
}

/// Counts a stream in a shared count while it lives (one more at
/// [`ActiveStream::new`], one less at drop).
pub struct ActiveStream(Arc<AtomicUsize>);

impl ActiveStream {
    /// Adds one to `count` until the returned guard is dropped.
    pub fn new(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for ActiveStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A CONNECT stream as a byte stream.
pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    pending: Bytes,
    read_eof: bool,
    write_closed: bool,
    /// The stream's place in its pooled connection's count, if it has one.
    _counted: Option<ActiveStream>,
}

impl H2Stream {
    /// Wraps the two halves of an accepted or opened CONNECT stream.
    pub fn new(send: SendStream<Bytes>, recv: RecvStream) -> Self {
        Self {
            send,
            recv,
            pending: Bytes::new(),
            read_eof: false,
            write_closed: false,
            _counted: None,
        }
    }

    /// As [`H2Stream::new`], counted by `counted` until dropped.
    pub fn counted(send: SendStream<Bytes>, recv: RecvStream, counted: ActiveStream) -> Self {
        Self {
            _counted: Some(counted),
            ..Self::new(send, recv)
        }
    }
}

fn h2_to_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::new(io::ErrorKind::ConnectionReset, e)
    }
}

impl H2Stream {
    /// The next bytes received: what is pending, else the next DATA frame (its
    /// flow-control window given back, as the bytes are handed on now); `None`
    /// at the end of the stream.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        if !self.pending.is_empty() {
            return Poll::Ready(Ok(Some(std::mem::take(&mut self.pending))));
        }
        while !self.read_eof {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    let _ = self.recv.flow_control().release_capacity(chunk.len());
                    if !chunk.is_empty() {
                        return Poll::Ready(Ok(Some(chunk)));
                    }
                }
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => {
                    self.read_eof = true;
                }
                Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
                None => self.read_eof = true,
            }
        }
        Poll::Ready(Ok(None))
    }

    /// Waits until the stream may send; returns how many bytes it may (at least
    /// one), having asked for `wanted`.
    fn poll_send_capacity(
        &mut self,
        cx: &mut Context<'_>,
        wanted: usize,
    ) -> Poll<io::Result<usize>> {
        loop {
            let available = self.send.capacity();
            if available > 0 {
                return Poll::Ready(Ok(available));
            }
            self.send.reserve_capacity(wanted);
            match ready!(self.send.poll_capacity(cx)) {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
                None => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "HBONE stream closed",
                    )));
                }
            }
        }
    }
}

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(mut chunk) = ready!(self.poll_chunk(cx))? {
            let n = chunk.len().min(out.remaining());
            out.put_slice(&chunk[..n]);
            chunk.advance(n);
            self.pending = chunk;
        }
        Poll::Ready(Ok(()))
    }
}

/// The copier takes the DATA frames as h2 received them.
impl Source for H2Stream {
    fn poll_read_chunk(&mut self, cx: &mut Context<'_>, chunk: &mut Chunk) -> Poll<io::Result<()>> {
        if let Some(data) = ready!(self.poll_chunk(cx))? {
            chunk.set_data(data);
        }
        Poll::Ready(Ok(()))
    }
}

/// The copier's chunks are sent as they are, as much of each at a time as the
/// stream's flow-control window allows (h2 cuts that into frames of at most the
/// peer's `SETTINGS_MAX_FRAME_SIZE`, RFC 9113 §6.5.2).
impl Sink for H2Stream {
    fn poll_write_chunk(&mut self, cx: &mut Context<'_>, data: &mut Bytes) -> Poll<io::Result<()>> {
        let n = ready!(self.poll_send_capacity(cx, data.len()))?.min(data.len());
        self.send
            .send_data(data.split_to(n), false)
            .map_err(h2_to_io)?;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = ready!(self.poll_send_capacity(cx, buf.len()))?.min(buf.len());
        self.send
            .send_data(Bytes::copy_from_slice(&buf[..n]), false)
            .map_err(h2_to_io)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The connection task writes frames as soon as they are queued.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.write_closed {
            self.write_closed = true;
            self.send.send_data(Bytes::new(), true).map_err(h2_to_io)?;
        }
        Poll::Ready(Ok(()))
    }
}

/// `forwarded` header value naming the client address (RFC 7239 §4, §6: IPv6 in
/// quotes and brackets).
pub fn forwarded_for(ip: IpAddr) -> HeaderValue {
    let value = match ip.to_canonical() {
        IpAddr::V4(v4) => format!("for={v4}"),
        IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
    };
    HeaderValue::from_str(&value).expect("an address is a valid header value")
}

/// The `:authority` of a CONNECT to `dst`: `ip:port`, an IPv6 address in brackets
/// (`[fd00::2]:8080`, RFC 3986 §3.2.2). An IPv4-mapped IPv6 address is written as
/// its IPv4 address; an IPv6 scope is left out (pod addresses have none).
pub fn authority(dst: SocketAddr) -> String {
    match dst.ip().to_canonical() {
        IpAddr::V4(v4) => format!("{v4}:{}", dst.port()),
        IpAddr::V6(v6) => format!("[{v6}]:{}", dst.port()),
    }
}

/// Builds a CONNECT request for `dst` from client `src`, with the client
/// workload's `baggage` if given.
pub fn connect_request(dst: SocketAddr, src: IpAddr, baggage: Option<&HeaderValue>) -> Request<()> {
    let mut req = Request::new(());
    *req.method_mut() = Method::CONNECT;
    *req.uri_mut() = authority(dst)
        .parse()
        .expect("a socket address is a valid authority");
    req.headers_mut().insert(FORWARDED, forwarded_for(src));
    if let Some(baggage) = baggage {
        req.headers_mut().insert(BAGGAGE, baggage.clone());
    }
    req
}

/// Why an HBONE request is refused, with the status ztunnel uses for it.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("method {0} is not CONNECT")]
    /// The request's method is not CONNECT.
    NotConnect(Method),
    #[error("authority {authority:?} is not an ip:port: {why}")]
    /// The `:authority` is not an `ip:port` (hostnames are not served; an IPv6
    /// address must be in brackets).
    BadAuthority {
        /// The authority as received.
        authority: String,
        /// What is wrong with it ([`AuthorityError`]).
        why: AuthorityError,
    },
}

/// What is wrong with a CONNECT authority ([`parse_authority`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    #[error("no authority")]
    /// The request has no `:authority`.
    Missing,
    #[error("no port")]
    /// No `:port` after the address.
    NoPort,
    #[error("the port is not a number from 1 to 65535")]
    /// The port is not a decimal number from 1 to 65535.
    BadPort,
    #[error("an IPv6 address must be in brackets, as [fd00::2]:8080")]
    /// An IPv6 address without brackets (RFC 3986 §3.2.2).
    UnbracketedIpv6,
    #[error("the address in brackets is not an IPv6 address")]
    /// Brackets around something other than an IPv6 address (an IPv4 address,
    /// a zone identifier, an IPvFuture literal), or no closing bracket.
    BadIpv6,
    #[error("the host is not an IP address (hostnames are not served)")]
    /// A hostname, or an address that does not parse.
    NotAnAddress,
}

impl RequestError {
    /// The HTTP status ztunnel answers this error with (400).
    pub fn status(&self) -> StatusCode {
        StatusCode::BAD_REQUEST
    }
}

/// The destination a CONNECT authority names: `a.b.c.d:port` or `[v6]:port`
/// (RFC 3986 §3.2.2), port 1-65535. An IPv4-mapped IPv6 address
/// (`[::ffff:10.1.2.3]:80`) is the IPv4 destination it maps.
///
/// # Errors
/// [`AuthorityError`] naming what is wrong.
pub fn parse_authority(authority: &str) -> Result<SocketAddr, AuthorityError> {
    if authority.is_empty() {
        return Err(AuthorityError::Missing);
    }
    let (ip, port) = match authority.strip_prefix('[') {
        Some(bracketed) => {
            let (ip, rest) = bracketed.split_once(']').ok_or(AuthorityError::BadIpv6)?;
            let ip: std::net::Ipv6Addr = ip.parse().map_err(|_| AuthorityError::BadIpv6)?;
            let port = rest.strip_prefix(':').ok_or(AuthorityError::NoPort)?;
            (IpAddr::V6(ip), port)
        }
        None => {
            let (host, port) = authority.rsplit_once(':').ok_or_else(|| {
                if authority.parse::<std::net::Ipv6Addr>().is_ok() {
                    AuthorityError::UnbracketedIpv6
                } else {
                    AuthorityError::NoPort
                }
            })?;
            if host.contains(':') {
                return Err(AuthorityError::UnbracketedIpv6);
            }
            let ip: std::net::Ipv4Addr = host.parse().map_err(|_| AuthorityError::NotAnAddress)?;
            (IpAddr::V4(ip), port)
        }
    };
    let port = if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
        port.parse::<u16>().ok().filter(|&p| p != 0)
    } else {
        None
    };
    let port = port.ok_or(AuthorityError::BadPort)?;
    Ok(SocketAddr::new(ip.to_canonical(), port))
}

/// The destination of a CONNECT request ([`parse_authority`]).
///
/// # Errors
/// [`RequestError`] for another method or an authority that is not `ip:port`.
pub fn parse_connect<B>(req: &Request<B>) -> Result<SocketAddr, RequestError> {
    if req.method() != Method::CONNECT {
        return Err(RequestError::NotConnect(req.method().clone()));
    }
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .unwrap_or_default();
    parse_authority(&authority).map_err(|why| RequestError::BadAuthority { authority, why })
}

/// The h2 client configuration of HBONE connections.
pub fn client_builder() -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .enable_push(false);
    b
}

/// The h2 server configuration of HBONE connections: the windows, the frame
/// size and the abuse bounds above, set even where they are h2's defaults.
///
/// What h2 bounds without a setting: it answers one SETTINGS or PING at a time
/// and reads no further frame until that answer is written (a SETTINGS or PING
/// flood from a client that does not read stops being read), and it closes a
/// connection with GOAWAY `ENHANCE_YOUR_CALM` after more than 100 empty DATA
/// frames without END_STREAM, or when small DATA frames buffered unread cost more than half the
/// connection window in overhead.
pub fn server_builder() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST_SIZE)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .max_concurrent_reset_streams(MAX_CONCURRENT_RESET_STREAMS)
        .reset_stream_duration(RESET_STREAM_DURATION)
        .max_send_buffer_size(MAX_SEND_BUFFER_SIZE);
    b
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// The baggage ztunnel sends is read back; podlink's reads the same.
    #[test]
    fn baggage_round_trips_and_reads_ztunnels() {
        let b = Baggage {
            cluster: "K1".to_string(),
            namespace: "shop".to_string(),
            workload: "web".to_string(),
            service: "web".to_string(),
            revision: "v1".to_string(),
        };
        let value = b.header("StatefulSet").unwrap();
        assert_eq!(
            value,
            "k8s.cluster.name=K1,k8s.namespace.name=shop,k8s.deployment.name=web,service.name=web,service.version=v1"
        );
        let mut headers = http::HeaderMap::new();
        headers.append(BAGGAGE, value);
        assert_eq!(Baggage::parse(&headers), Some(b));
        // ztunnel's test header, split over two values, with a property and an
        // unknown member.
        let mut headers = http::HeaderMap::new();
        headers.append(
            BAGGAGE,
            HeaderValue::from_static("k8s.cluster.name=K1,k8s.namespace.name=NS1;p=1"),
        );
        headers.append(
            BAGGAGE,
            HeaderValue::from_static(
                "k8s.pod.name=N1,other=x,service.name=N2,service.version=V1,bad",
            ),
        );
        let read = Baggage::parse(&headers).unwrap();
        assert_eq!(
            (
                read.cluster.as_str(),
                read.namespace.as_str(),
                read.workload.as_str(),
                read.service.as_str(),
                read.revision.as_str()
            ),
            ("K1", "NS1", "N1", "N2", "V1")
        );
        assert_eq!(Baggage::parse(&http::HeaderMap::new()), None);
    }

    /// The client address a `forwarded` header names ([`forwarded_for`]'s forms, RFC
    /// 7239 §4: `for=10.1.2.3`, `for="[fd00::1]"`, also quoted IPv4 and an IPv6 node
    /// with a port, `for="[fd00::1]:4711"`), in canonical form (an IPv4-mapped IPv6
    /// address is its IPv4 address). The first `for` of the first element counts;
    /// `None` when there is none or it is not an address (`unknown`, an obfuscated
    /// identifier, an unbracketed IPv6 address).
    fn parse_forwarded_for(value: &HeaderValue) -> Option<IpAddr> {
        let first = value.to_str().ok()?.split(',').next()?;
        let node = first.split(';').find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("for")
                .then_some(value.trim())
        })?;
        let node = match node.strip_prefix('"') {
            Some(quoted) => quoted.strip_suffix('"')?,
            None => node,
        };
        let ip = match node.strip_prefix('[') {
            Some(bracketed) => {
                let (ip, _port) = bracketed.split_once(']')?;
                IpAddr::V6(ip.parse().ok()?)
            }
            None => {
                let ip = node.split_once(':').map_or(node, |(ip, _port)| ip);
                IpAddr::V4(ip.parse().ok()?)
            }
        };
        Some(ip.to_canonical())
    }

    /// After a handshake, h2's vectored write of a DATA frame of a 64 KiB read
    /// and its header is taken whole and goes out as its TLS records together
    /// (rustls's default takes 64 KiB and leaves the last 9 bytes to another write).
    #[test]
    fn a_whole_frame_is_taken_in_one_write() {
        use std::io::{IoSlice, Write};

        use crate::identity::{SpiffeId, tls::tests::Mesh};

        let mesh = Mesh::new();
        let server_id = SpiffeId::new("cluster.local", "ns2", "server");
        let client_id = SpiffeId::new("cluster.local", "ns1", "client");
        let (server, client) = mesh.configs(&server_id, &client_id);
        let name = rustls_pki_types::ServerName::try_from("10.0.0.1").unwrap();
        let mut c = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        while c.is_handshaking() || s.is_handshaking() {
            let mut wire = Vec::new();
            c.write_tls(&mut wire).unwrap();
            s.read_tls(&mut &wire[..]).unwrap();
            s.process_new_packets().unwrap();
            wire.clear();
            s.write_tls(&mut wire).unwrap();
            c.read_tls(&mut &wire[..]).unwrap();
            c.process_new_packets().unwrap();
        }
        let mut wire = Vec::new();
        c.write_tls(&mut wire).unwrap();

        let (head, payload) = ([0u8; 9], vec![1u8; 64 * 1024]);
        let frame = [IoSlice::new(&head), IoSlice::new(&payload)];
        let write = |c: &mut rustls::ClientConnection| {
            let taken = c.writer().write_vectored(&frame).unwrap();
            let mut wire = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut wire).unwrap();
            }
            (taken, wire.len())
        };
        // Four full records: 16 KiB, a content type, a 16-byte tag, a 5-byte header.
        let record = 16 * 1024 + 1 + 16 + 5;
        assert_eq!(write(&mut c), (64 * 1024, 4 * record));
        take_whole_frames(&mut c);
        assert_eq!(write(&mut c), (64 * 1024 + 9, 4 * record + 9 + 22));
    }

    #[test]
    fn forwarded_header_forms() {
        assert_eq!(forwarded_for("10.1.2.3".parse().unwrap()), "for=10.1.2.3");
        assert_eq!(
            forwarded_for("fd00::1".parse().unwrap()),
            "for=\"[fd00::1]\""
        );
    }

    #[test]
    fn forwarded_headers_parse_back() {
        for ip in ["10.1.2.3", "fd00::1", "::1"] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(parse_forwarded_for(&forwarded_for(ip)), Some(ip), "{ip}");
        }
        let parse = |v: &str| parse_forwarded_for(&HeaderValue::from_str(v).unwrap());
        // Other forms of RFC 7239 §4 and §7.1.
        assert_eq!(parse("for=\"10.1.2.3:4711\""), "10.1.2.3".parse().ok());
        assert_eq!(parse("For=\"[fd00::1]:4711\""), "fd00::1".parse().ok());
        assert_eq!(
            parse("proto=https; for=10.0.0.1, for=10.0.0.2"),
            "10.0.0.1".parse().ok()
        );
        // An IPv4-mapped address is its IPv4 address.
        assert_eq!(parse("for=\"[::ffff:10.1.2.3]\""), "10.1.2.3".parse().ok());
        assert_eq!(
            forwarded_for("::ffff:10.1.2.3".parse().unwrap()),
            "for=10.1.2.3"
        );
        for bad in [
            "for=unknown",
            "for=_hidden",
            "for=fd00::1",
            "by=10.0.0.1",
            "",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    /// IPv6 authorities are bracketed both ways; mapped addresses are IPv4.
    #[test]
    fn authorities_of_both_families() {
        let v6: SocketAddr = "[fd00::2]:8080".parse().unwrap();
        assert_eq!(authority(v6), "[fd00::2]:8080");
        assert_eq!(authority("10.1.2.3:80".parse().unwrap()), "10.1.2.3:80");
        assert_eq!(
            authority("[::ffff:10.1.2.3]:80".parse().unwrap()),
            "10.1.2.3:80"
        );
        let scoped = SocketAddr::V6(std::net::SocketAddrV6::new(
            "fe80::1".parse().unwrap(),
            80,
            0,
            3,
        ));
        assert_eq!(authority(scoped), "[fe80::1]:80");

        let good = [
            ("10.1.2.3:80", "10.1.2.3:80"),
            ("[fd00::2]:8080", "[fd00::2]:8080"),
            ("[FD00:0::2]:65535", "[fd00::2]:65535"),
            ("[::ffff:10.1.2.3]:80", "10.1.2.3:80"),
            ("[::1]:1", "[::1]:1"),
        ];
        for (text, want) in good {
            assert_eq!(parse_authority(text), Ok(want.parse().unwrap()), "{text}");
        }
        let bad = [
            ("", AuthorityError::Missing),
            ("10.1.2.3", AuthorityError::NoPort),
            ("[fd00::2]", AuthorityError::NoPort),
            ("[fd00::2]8080", AuthorityError::NoPort),
            ("fd00::2:8080", AuthorityError::UnbracketedIpv6),
            ("fd00::2", AuthorityError::UnbracketedIpv6),
            ("::1", AuthorityError::UnbracketedIpv6),
            ("[fd00::2:8080", AuthorityError::BadIpv6),
            ("[10.1.2.3]:80", AuthorityError::BadIpv6),
            ("[fe80::1%eth0]:80", AuthorityError::BadIpv6),
            ("[v1.fe]:80", AuthorityError::BadIpv6),
            ("[fd00::2]:", AuthorityError::BadPort),
            ("[fd00::2]:0", AuthorityError::BadPort),
            ("[fd00::2]:65536", AuthorityError::BadPort),
            ("10.1.2.3:+80", AuthorityError::BadPort),
            ("10.1.2.3:http", AuthorityError::BadPort),
            ("example.com:80", AuthorityError::NotAnAddress),
            ("010.1.2.3:80", AuthorityError::NotAnAddress),
        ];
        for (text, want) in bad {
            assert_eq!(parse_authority(text), Err(want), "{text:?}");
        }
    }

    /// A CONNECT to an IPv6 destination goes as a bracketed authority and parses
    /// back; a malformed one is a 400 naming the authority and what is wrong.
    #[test]
    fn ipv6_connect_requests_parse_back() {
        let dst: SocketAddr = "[fd00:10:244::5]:8080".parse().unwrap();
        let req = connect_request(dst, "fd00:10:244::9".parse().unwrap(), None);
        assert_eq!(req.uri().authority().unwrap(), "[fd00:10:244::5]:8080");
        assert_eq!(parse_connect(&req).unwrap(), dst);
        assert_eq!(
            parse_forwarded_for(&req.headers()[FORWARDED]),
            "fd00:10:244::9".parse().ok()
        );

        let mut zero = Request::new(());
        *zero.method_mut() = Method::CONNECT;
        *zero.uri_mut() = "[fd00::5]:0".parse().unwrap();
        let err = parse_connect(&zero).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            err.to_string(),
            "authority \"[fd00::5]:0\" is not an ip:port: the port is not a number from 1 to 65535"
        );
    }

    #[test]
    fn connect_requests_parse_back() {
        let dst: SocketAddr = "10.1.2.3:8080".parse().unwrap();
        let req = connect_request(dst, "10.0.0.1".parse().unwrap(), None);
        assert_eq!(parse_connect(&req).unwrap(), dst);

        let mut get = Request::new(());
        *get.uri_mut() = "http://10.1.2.3:80/".parse().unwrap();
        assert!(matches!(
            parse_connect(&get),
            Err(RequestError::NotConnect(_))
        ));

        let mut named = Request::new(());
        *named.method_mut() = Method::CONNECT;
        *named.uri_mut() = "example.com:80".parse().unwrap();
        let err = parse_connect(&named).unwrap_err();
        assert!(err.to_string().contains("example.com:80"), "{err}");
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    /// A CONNECT stream carries bytes both ways, larger than the windows, and
    /// half-closes.
    #[tokio::test]
    async fn streams_carry_bytes_and_half_close() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let server = tokio::spawn(async move {
            let mut conn = server_builder().handshake::<_, Bytes>(b).await.unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            let dst = parse_connect(&req).unwrap();
            let forwarded = req.headers()[FORWARDED].to_str().unwrap().to_string();
            let send = respond
                .send_response(http::Response::new(()), false)
                .unwrap();
            let mut stream = H2Stream::new(send, req.into_body());
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            // Echo until the client half-closes, then add a trailer.
            let mut received = Vec::new();
            stream.read_to_end(&mut received).await.unwrap();
            stream.write_all(&received).await.unwrap();
            stream.write_all(b"done").await.unwrap();
            stream.shutdown().await.unwrap();
            (dst, forwarded)
        });
        let (mut sender, conn) = client_builder().handshake(a).await.unwrap();
        tokio::spawn(conn);
        let dst: SocketAddr = "10.9.9.9:443".parse().unwrap();
        sender = sender.ready().await.unwrap();
        let (resp, send) = sender
            .send_request(
                connect_request(dst, "10.0.0.7".parse().unwrap(), None),
                false,
            )
            .unwrap();
        let resp = resp.await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let stream = H2Stream::new(send, resp.into_body());
        let payload: Vec<u8> = (0..(STREAM_WINDOW as usize * 2 + 12345))
            .map(|i| (i % 251) as u8)
            .collect();
        let (mut rd, mut wr) = tokio::io::split(stream);
        let writer = {
            let payload = payload.clone();
            tokio::spawn(async move {
                wr.write_all(&payload).await.unwrap();
                wr.shutdown().await.unwrap();
            })
        };
        let mut back = Vec::new();
        rd.read_to_end(&mut back).await.unwrap();
        writer.await.unwrap();
        assert_eq!(back.len(), payload.len() + 4);
        assert_eq!(&back[..payload.len()], &payload[..]);
        assert_eq!(&back[payload.len()..], b"done");
        let (seen_dst, forwarded) = server.await.unwrap();
        assert_eq!(seen_dst, dst);
        assert_eq!(forwarded, "for=10.0.0.7");
    }

    /// The copier moves bytes through CONNECT streams both ways as whole chunks
    /// (the streams' `Source` and `Sink`), past the flow-control windows, and
    /// passes half-closes on: app → copier → stream → copier → echo and back.
    #[tokio::test]
    async fn the_copier_carries_chunks_through_streams() {
        use super::super::copy;
        let (a, b) = tokio::io::duplex(1 << 16);
        let server = tokio::spawn(async move {
            let mut conn = server_builder().handshake::<_, Bytes>(b).await.unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            let send = respond
                .send_response(http::Response::new(()), false)
                .unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let mut stream = H2Stream::new(send, req.into_body());
            let (mut to_echo, mut echo) = tokio::io::duplex(1 << 16);
            let echoer = tokio::spawn(async move {
                let mut got = Vec::new();
                echo.read_to_end(&mut got).await.unwrap();
                echo.write_all(&got).await.unwrap();
                echo.shutdown().await.unwrap();
            });
            let copied = copy::bidirectional(&mut stream, &mut to_echo)
                .await
                .unwrap();
            echoer.await.unwrap();
            copied
        });
        let (sender, conn) = client_builder().handshake(a).await.unwrap();
        tokio::spawn(conn);
        let mut sender = sender.ready().await.unwrap();
        let (resp, send) = sender
            .send_request(
                connect_request(
                    "10.9.9.9:443".parse().unwrap(),
                    "10.0.0.7".parse().unwrap(),
                    None,
                ),
                false,
            )
            .unwrap();
        let mut stream = H2Stream::new(send, resp.await.unwrap().into_body());
        let (mut app, mut from_app) = tokio::io::duplex(1 << 16);
        let client =
            tokio::spawn(async move { copy::bidirectional(&mut from_app, &mut stream).await });
        let payload: Vec<u8> = (0..(STREAM_WINDOW as usize * 3 + 999))
            .map(|i| (i % 239) as u8)
            .collect();
        let (mut rd, mut wr) = tokio::io::split(&mut app);
        let write = async {
            wr.write_all(&payload).await.unwrap();
            wr.shutdown().await.unwrap();
        };
        let mut back = Vec::new();
        let read = rd.read_to_end(&mut back);
        let ((), read) = tokio::join!(write, read);
        read.unwrap();
        assert!(
            back == payload,
            "{} bytes back of {}",
            back.len(),
            payload.len()
        );
        let n = payload.len() as u64;
        assert_eq!(client.await.unwrap().unwrap(), (n, n));
        assert_eq!(server.await.unwrap(), (n, n));
    }
}
