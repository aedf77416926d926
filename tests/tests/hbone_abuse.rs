//! The HBONE listener (15008) against abusive clients holding a valid mesh
//! certificate: slow and unfinished handshakes, HTTP/2 floods (rapid reset,
//! CONTINUATION, oversized and compressed header blocks, SETTINGS and PING,
//! streams over the concurrency limit), many connections or streams from one
//! address, idle connections and streams, and clients that never read. Each is
//! refused or bounded, the agent's resident memory stays within a stated bound
//! and another client of the same node is served meanwhile.

use std::{
    io::Read,
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use http::StatusCode;
use podlink_agent::{identity::SpiffeId, proxy::hbone};
use podlink_tests::{Cluster, Pod, PodSpec, app, netns};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{credentials, frames::*, greeting, hbone_connect, request, tls_connect};

/// How much the agent's resident memory may grow over its settled size while it
/// is abused (KiB): generous, a few times what the bounds below let one
/// attacker make it hold.
const RSS_GROWTH_KIB: u64 = 64 * 1024;

/// The longest an abusive connection may take to be closed once a bound applies
/// to it ("eventually", generously).
const EVENTUALLY: Duration = Duration::from_secs(60);

/// Two nodes: the pods `attacker` and `friend` outside the mesh on node 1, each
/// speaking HBONE itself with a certificate of its own identity; an enrolled
/// `server` pod with an echo server on port 9000 on node 2, whose agent gets
/// `agent_args`.
struct Bed {
    c: Cluster,
    attacker: Pod,
    friend: Pod,
    server: Pod,
    _echo: app::EchoServer,
    key: Arc<CertifiedKey>,
    roots: Arc<rustls::RootCertStore>,
    server_id: SpiffeId,
    rt: tokio::runtime::Runtime,
    /// The agent's VmRSS once settled (KiB).
    settled_kib: u64,
}

impl Bed {
    fn new(agent_args: &[&str]) -> Self {
        let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
        let attacker = c.add_pod(PodSpec::new("attacker", "legacy", 0)).unwrap();
        let friend = c.add_pod(PodSpec::new("friend", "legacy", 0)).unwrap();
        let server = c
            .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
            .unwrap();
        c.start_agent(0).unwrap();
        c.start_agent_with(1, agent_args).unwrap();
        c.wait_captured(&server, true).unwrap();
        let echo = app::EchoServer::start(&server.netns, server.addr(9000)).unwrap();
        let (key, roots) = credentials(
            &c.ca_dir,
            &SpiffeId::new("cluster.local", "legacy", "default"),
        );
        let mut bed = Self {
            c,
            attacker,
            friend,
            server,
            _echo: echo,
            key,
            roots,
            server_id: SpiffeId::new("cluster.local", "mesh", "server"),
            rt: tokio::runtime::Runtime::new().unwrap(),
            settled_kib: 0,
        };
        // Settled: certificates issued, a first tunnel served.
        bed.assert_friend_served("before the abuse");
        bed.settled_kib = bed.rss_kib();
        bed
    }

    fn hbone(&self) -> SocketAddr {
        self.server.addr(15008)
    }

    /// The server node's agent's VmRSS (KiB), from /proc/<pid>/status.
    fn rss_kib(&self) -> u64 {
        let pid = self.c.agent_pid(1).expect("node 2's agent runs");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("a VmRSS line")
    }

    /// The agent's memory has grown by at most [`RSS_GROWTH_KIB`].
    fn assert_memory_bounded(&self, during: &str) {
        let rss = self.rss_kib();
        assert!(
            rss <= self.settled_kib + RSS_GROWTH_KIB,
            "{during}: the agent holds {rss} KiB, settled at {} KiB (bound: {} KiB more)",
            self.settled_kib,
            RSS_GROWTH_KIB
        );
    }

    /// The friend pod's HBONE tunnel to the echo server carries bytes both ways.
    async fn friend_served(&self) -> Result<(), String> {
        let (key, roots) = credentials(
            &self.c.ca_dir,
            &SpiffeId::new("cluster.local", "legacy", "friend"),
        );
        let mut h2 = hbone_connect(
            &self.friend.netns,
            self.hbone(),
            key,
            roots,
            self.server_id.clone(),
        )
        .await?;
        let (status, stream) = request(
            &mut h2,
            hbone::connect_request(self.server.addr(9000), self.friend.ip.into(), None),
        )
        .await;
        let mut stream = stream.ok_or(format!("CONNECT answered {status}"))?;
        greeting(&mut stream).await;
        stream
            .write_all(b"still served")
            .await
            .map_err(|e| e.to_string())?;
        stream.shutdown().await.map_err(|e| e.to_string())?;
        let mut echoed = Vec::new();
        stream
            .read_to_end(&mut echoed)
            .await
            .map_err(|e| e.to_string())?;
        (echoed == b"still served")
            .then_some(())
            .ok_or(format!("echoed {echoed:?}"))
    }

    /// [`Bed::friend_served`], failing the test with the agent's log otherwise.
    fn assert_friend_served(&self, during: &str) {
        let served = self
            .rt
            .block_on(async { tokio::time::timeout(EVENTUALLY, self.friend_served()).await });
        match served {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!(
                "{during}: the friend was not served: {e}\n{}",
                self.c.agent_log(1)
            ),
            Err(_) => panic!(
                "{during}: the friend's tunnel hung\n{}",
                self.c.agent_log(1)
            ),
        }
    }

    /// A TLS connection from the attacker pod, its HTTP/2 written by hand.
    async fn raw(&self) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        tls_connect(
            &self.attacker.netns,
            self.hbone(),
            self.key.clone(),
            self.roots.clone(),
            self.server_id.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.c.agent_log(1)))
    }

    /// Sends `attack` on a new raw connection (after the preface) and reads
    /// what comes back until the connection ends, within [`EVENTUALLY`].
    fn attack(&self, what: &str, attack: &[u8]) -> (End, Vec<Frame>) {
        self.rt.block_on(async {
            let tls = self.raw().await;
            let (mut rd, mut wr) = tokio::io::split(tls);
            let mut bytes = preface(&[]);
            bytes.extend_from_slice(attack);
            // The server may close before it read everything.
            let writer = tokio::spawn(async move {
                let _ = wr.write_all(&bytes).await;
                let _ = wr.flush().await;
                wr
            });
            let mut frames = Vec::new();
            let end = tokio::time::timeout(
                EVENTUALLY,
                read_until_end(&mut rd, |f| {
                    if f.kind != DATA {
                        frames.push(Frame {
                            payload: f.payload.clone(),
                            ..*f
                        });
                    }
                }),
            )
            .await
            .unwrap_or_else(|_| panic!("{what}: the connection was not closed"));
            drop(writer);
            (end, frames)
        })
    }

    /// The failures of `kind` counted by node 2's agent.
    fn failures(&self, kind: &str) -> f64 {
        self.c
            .metrics(1)
            .unwrap()
            .sum("podlink_connection_failures_total", &[("kind", kind)])
    }
}

/// Whether a connection was refused: not made, or closed or reset by the proxy
/// (read within 100 ms).
fn is_reset(s: &std::io::Result<TcpStream>) -> bool {
    let Ok(s) = s else {
        return true;
    };
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut byte = [0u8; 1];
    match (&*s).read(&mut byte) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// One client address holds at most its share of the handshakes under way (a
/// quarter of the budget, itself a quarter of `--max-connections`): of 16
/// connections that never finish (or trickle) their TLS handshake, 4 are held
/// and the rest reset; another client's handshakes go through meanwhile; the
/// held ones are closed at the handshake timeout (10 s).
#[test]
fn hbone_handshakes_one_address_takes_its_share() {
    let bed = Bed::new(&["--max-connections", "64"]);
    let hbone = bed.hbone();
    let held: Vec<std::io::Result<TcpStream>> = (0..16)
        .map(|i| {
            netns::in_netns(&bed.attacker.netns, move || {
                let mut s = TcpStream::connect_timeout(&hbone, Duration::from_secs(5))?;
                // Half of them start a TLS record (a handshake record header,
                // RFC 8446 §5.1) and never finish it.
                if i % 2 == 0 {
                    std::io::Write::write_all(&mut s, &[0x16, 0x03, 0x01])?;
                }
                Ok(s)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let reset: Vec<bool> = held.iter().map(is_reset).collect();
    let refused = reset.iter().filter(|r| **r).count();
    assert!(
        refused >= 12,
        "only {refused} of 16 unfinished handshakes from one address were refused (its share: 4)"
    );
    bed.c
        .wait_log(1, &["is at its share of 4 handshakes under way"])
        .unwrap();
    assert!(bed.failures("handshake_limit") >= 12.0);
    bed.assert_friend_served("while one address holds its share of handshakes");
    bed.assert_memory_bounded("unfinished handshakes");

    // The held ones are closed at the handshake timeout.
    for (s, was_reset) in held.iter().zip(&reset) {
        if *was_reset {
            continue;
        }
        let s = s.as_ref().unwrap();
        s.set_read_timeout(Some(EVENTUALLY)).unwrap();
        let mut byte = [0u8; 1];
        match (&*s).read(&mut byte) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("an unfinished handshake was not closed: {other:?}"),
        }
    }
    let timed_out = reset.iter().filter(|r| !**r).count() as f64;
    assert!(
        bed.failures("handshake") >= timed_out,
        "{timed_out} handshakes timed out, fewer counted as `handshake` failures"
    );
    drop(held);
    bed.assert_friend_served("after the handshakes timed out");
}

/// HTTP/2 floods written by hand, each on a connection of its own: each closes
/// its connection with GOAWAY `ENHANCE_YOUR_CALM` or is bounded, the agent's
/// memory stays bounded, and the friend is served after each.
#[test]
fn hbone_frame_floods_are_refused() {
    let bed = Bed::new(&[]);
    let target = hbone::authority(bed.server.addr(9000));

    // Rapid reset (CVE-2023-44487): streams opened and reset at once.
    let mut attack = Vec::new();
    for i in 0..200u32 {
        let id = 2 * i + 1;
        frame(
            &mut attack,
            HEADERS,
            END_HEADERS,
            id,
            &connect_block(&target),
        );
        frame(&mut attack, RST_STREAM, 0, id, &CANCEL.to_be_bytes());
    }
    let (end, _) = bed.attack("rapid reset", &attack);
    assert_eq!(end, End::GoAway(ENHANCE_YOUR_CALM), "rapid reset");
    bed.assert_memory_bounded("rapid reset");
    bed.assert_friend_served("after a rapid reset");

    // CONTINUATION flood (CVE-2024-27316): a header block never ended.
    let mut attack = Vec::new();
    let block = connect_block(&target);
    frame(&mut attack, HEADERS, 0, 1, &block[..2]);
    for _ in 0..10_000 {
        frame(&mut attack, CONTINUATION, 0, 1, &[]);
    }
    let (end, _) = bed.attack("CONTINUATION flood", &attack);
    assert_eq!(end, End::GoAway(ENHANCE_YOUR_CALM), "CONTINUATION flood");
    bed.assert_memory_bounded("CONTINUATION flood");
    bed.assert_friend_served("after a CONTINUATION flood");

    // A header block over the 16 KiB limit: answered 431, the connection goes on.
    let mut attack = Vec::new();
    let mut block = connect_block(&target);
    literal(&mut block, "x-big", &vec![b'a'; 20 * 1024]);
    frame(&mut attack, HEADERS, END_HEADERS | END_STREAM, 1, &block);
    // A PING after it, to see the connection still read.
    frame(&mut attack, PING, 0, 0, b"pingpong");
    let (end, frames) = bed.rt.block_on(async {
        let tls = bed.raw().await;
        let (mut rd, mut wr) = tokio::io::split(tls);
        let mut bytes = preface(&[]);
        bytes.extend_from_slice(&attack);
        wr.write_all(&bytes).await.unwrap();
        let mut frames = Vec::new();
        let end = tokio::time::timeout(EVENTUALLY, async {
            // Until both the PING's answer and the stream's have come.
            let (mut pong, mut answer) = (false, false);
            while let Some(f) = read_frame(&mut rd).await {
                pong |= f.kind == PING && f.flags & ACK != 0;
                answer |= matches!(f.kind, HEADERS | RST_STREAM) && f.stream == 1;
                frames.push(f);
                if pong && answer {
                    return None;
                }
            }
            Some(End::Closed)
        })
        .await
        .unwrap_or_else(|_| {
            panic!("no PING ACK or no answer to an oversized header block: {frames:?}")
        });
        (end, frames)
    });
    assert_eq!(
        end, None,
        "the connection closed after an oversized header block: {frames:?}"
    );
    let answered = frames
        .iter()
        .any(|f| matches!(f.kind, HEADERS | RST_STREAM) && f.stream == 1);
    assert!(
        answered,
        "the oversized header block was not answered: {frames:?}"
    );

    // A header block that decompresses to far more than the limit (HPACK: one
    // 3 KiB field added to the table, then referenced 100 times, 1 byte each).
    let mut attack = Vec::new();
    let mut block = connect_block(&target);
    indexed_literal(&mut block, "x-bomb", &vec![b'b'; 3 * 1024]);
    for _ in 0..100 {
        indexed(&mut block, 62);
    }
    frame(&mut attack, HEADERS, END_HEADERS, 1, &block);
    let (end, _) = bed.attack("HPACK bomb", &attack);
    assert_eq!(
        end,
        End::GoAway(ENHANCE_YOUR_CALM),
        "a header block 300 KiB decoded"
    );
    bed.assert_memory_bounded("HPACK bomb");
    bed.assert_friend_served("after a header block 300 KiB decoded");

    // Streams over the 1000 a connection may have open: refused.
    let mut attack = Vec::new();
    for i in 0..1100u32 {
        // Malformed (400, no upstream connection); left open by the client.
        frame(
            &mut attack,
            HEADERS,
            END_HEADERS,
            2 * i + 1,
            &connect_block("nowhere:1"),
        );
    }
    let refused = bed.rt.block_on(async {
        let tls = bed.raw().await;
        let (mut rd, mut wr) = tokio::io::split(tls);
        let mut bytes = preface(&[]);
        bytes.extend_from_slice(&attack);
        wr.write_all(&bytes).await.unwrap();
        let mut refused = Vec::new();
        // Until the 100 streams over the limit are refused, or nothing more comes.
        while refused.len() < 100 {
            let next = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut rd));
            let Ok(Some(f)) = next.await else { break };
            if f.kind == RST_STREAM && f.error_code() == Some(REFUSED_STREAM) {
                refused.push(f.stream);
            }
        }
        drop(wr);
        refused
    });
    assert!(
        !refused.is_empty(),
        "none of 1100 streams open at once was refused (limit: {})",
        hbone::MAX_CONCURRENT_STREAMS
    );
    assert!(
        refused
            .iter()
            .all(|&id| id > 2 * hbone::MAX_CONCURRENT_STREAMS - 1),
        "a stream within the limit was refused: {refused:?}"
    );
    bed.assert_friend_served("after streams over the limit");

    // SETTINGS and PING floods from a client that does not read: the proxy
    // answers one at a time and stops reading once its answers are not read, so
    // 64 MiB of them are never all taken.
    for (name, kind, payload) in [
        ("SETTINGS", SETTINGS, &[][..]),
        ("PING", PING, &b"pingpong"[..]),
    ] {
        let mut chunk = Vec::new();
        while chunk.len() < 1 << 20 {
            frame(&mut chunk, kind, 0, 0, payload);
        }
        let written = bed.rt.block_on(async {
            let tls = bed.raw().await;
            let (rd, mut wr) = tokio::io::split(tls);
            wr.write_all(&preface(&[])).await.unwrap();
            let written = Arc::new(AtomicU64::new(0));
            let flood = {
                let written = written.clone();
                async move {
                    for _ in 0..64 {
                        if wr.write_all(&chunk).await.is_err() {
                            break;
                        }
                        written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    }
                }
            };
            let finished = tokio::time::timeout(Duration::from_secs(20), flood)
                .await
                .is_ok();
            bed.assert_memory_bounded(&format!("{name} flood"));
            bed.friend_served()
                .await
                .unwrap_or_else(|e| panic!("during a {name} flood: {e}"));
            drop(rd);
            (finished, written.load(Ordering::Relaxed))
        });
        let (finished, written) = written;
        assert!(
            !finished,
            "64 MiB of {name} frames were all taken from a client that reads nothing ({written} bytes)"
        );
        bed.assert_memory_bounded(&format!("after a {name} flood"));
    }
    bed.assert_friend_served("after the floods");
}

/// A listener in `pod` at `addr` that accepts and holds its connections, never
/// reading or writing.
fn silent_server(pod: &Pod, addr: SocketAddr) -> std::thread::JoinHandle<()> {
    let listener = netns::in_netns(&pod.netns, move || TcpListener::bind(addr)).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming() {
            held.push(s);
        }
    })
}

/// Upstream connections of node 2's proxy to `dst`, as `ss` lists them there.
fn upstream_sockets(c: &Cluster, dst: SocketAddr) -> usize {
    let out = netns::run(
        netns::command_in(&c.nodes[1].netns, "ss")
            .args(["-Htn", "state", "established", "dst"])
            .arg(dst.to_string()),
    )
    .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// One client address holds at most its share of the connection slots (a
/// quarter of `--max-connections`, its HBONE connections and their streams):
/// with 16 slots, one connection and 3 streams; a fourth stream is answered
/// 503, a second connection refused after its handshakes; another address is
/// served meanwhile.
#[test]
fn hbone_one_address_takes_its_share_of_connections() {
    let bed = Bed::new(&["--max-connections", "16"]);
    let sink = bed.server.addr(9100);
    let _sink = silent_server(&bed.server, sink);
    bed.rt.block_on(async {
        let mut h2 = hbone_connect(
            &bed.attacker.netns,
            bed.hbone(),
            bed.key.clone(),
            bed.roots.clone(),
            bed.server_id.clone(),
        )
        .await
        .unwrap();
        let mut streams = Vec::new();
        for i in 0..3 {
            let (status, stream) = request(
                &mut h2,
                hbone::connect_request(sink, bed.attacker.ip.into(), None),
            )
            .await;
            assert_eq!(status, StatusCode::OK, "stream {i} within the share");
            streams.push(stream);
        }
        let (status, _) = request(
            &mut h2,
            hbone::connect_request(sink, bed.attacker.ip.into(), None),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "a stream over the share"
        );
        bed.c
            .wait_log(1, &["is at its share of 4 connections"])
            .unwrap();
        // A second connection: its handshakes succeed, then it is closed.
        let second = common::attempt(
            &bed.attacker.netns,
            bed.hbone(),
            bed.key.clone(),
            bed.roots.clone(),
            bed.server_id.clone(),
            bed.server.addr(9000),
        )
        .await;
        assert!(
            second.is_err(),
            "a connection over the share was served: {second:?}"
        );
        assert!(bed.failures("connection_limit") >= 2.0);
        bed.friend_served()
            .await
            .unwrap_or_else(|e| panic!("while one address holds its share: {e}"));
        bed.assert_memory_bounded("one address at its share of connections");
        drop((streams, h2));
    });
    assert_eq!(bed.c.agent_log(1).matches("panicked").count(), 0);
}

/// Idle connections and tunnels that never carry a byte are closed at the idle
/// timeout (`--hbone-idle-timeout`, here 2 s); a client that never reads its
/// tunnels makes the proxy hold at most a bounded amount, and stop reading the
/// pod.
#[test]
fn hbone_idle_and_unread_tunnels_are_bounded() {
    let bed = Bed::new(&["--hbone-idle-timeout", "2s"]);

    // A connection that opens no stream: GOAWAY at the idle timeout.
    let (end, _) = bed.attack("idle connection", &[]);
    assert_eq!(end, End::GoAway(NO_ERROR), "an idle connection");

    // A CONNECT that never sends, to a pod that never speaks: reset.
    let silent = bed.server.addr(9100);
    let _silent = silent_server(&bed.server, silent);
    bed.rt.block_on(async {
        let mut h2 = hbone_connect(
            &bed.attacker.netns,
            bed.hbone(),
            bed.key.clone(),
            bed.roots.clone(),
            bed.server_id.clone(),
        )
        .await
        .unwrap();
        let (status, stream) = request(
            &mut h2,
            hbone::connect_request(silent, bed.attacker.ip.into(), None),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let mut stream = stream.unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(EVENTUALLY, stream.read(&mut buf))
            .await
            .expect("a tunnel that never carried a byte was not closed");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    });
    bed.c
        .wait_log(
            1,
            &["the tunnel carried no byte either way within the idle timeout"],
        )
        .unwrap();
    let deadline = Instant::now() + EVENTUALLY;
    while upstream_sockets(&bed.c, silent) > 0 {
        assert!(
            Instant::now() < deadline,
            "the unused tunnel's upstream connection stayed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A client that grants the largest windows and never reads, on 8 tunnels
    // to a pod that writes as fast as it can.
    let firehose = bed.server.addr(9200);
    let listener = netns::in_netns(&bed.server.netns, move || TcpListener::bind(firehose)).unwrap();
    let written = Arc::new(AtomicU64::new(0));
    {
        let written = written.clone();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { break };
                let written = written.clone();
                std::thread::spawn(move || {
                    let chunk = vec![b'f'; 64 * 1024];
                    while let Ok(n) = std::io::Write::write(&mut s, &chunk) {
                        written.fetch_add(n as u64, Ordering::Relaxed);
                    }
                });
            }
        });
    }
    let target = hbone::authority(firehose);
    let mut attack = Vec::new();
    frame(
        &mut attack,
        WINDOW_UPDATE,
        0,
        0,
        &(MAX_WINDOW - 65_535).to_be_bytes(),
    );
    for i in 0..8u32 {
        frame(
            &mut attack,
            HEADERS,
            END_HEADERS,
            2 * i + 1,
            &connect_block(&target),
        );
    }
    bed.rt.block_on(async {
        let tls = bed.raw().await;
        let (rd, mut wr) = tokio::io::split(tls);
        let mut bytes = preface(&[(INITIAL_WINDOW_SIZE, MAX_WINDOW)]);
        bytes.extend_from_slice(&attack);
        wr.write_all(&bytes).await.unwrap();
        // The pod stops being read: what it wrote stops growing.
        let deadline = Instant::now() + EVENTUALLY;
        let mut last = u64::MAX;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = written.load(Ordering::Relaxed);
            if now == last && now > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the pod is still read for a client that reads nothing ({now} bytes)"
            );
            last = now;
        }
        bed.assert_memory_bounded("8 tunnels not read");
        bed.friend_served()
            .await
            .unwrap_or_else(|e| panic!("while a client reads nothing: {e}"));
        drop((rd, wr));
    });
    eprintln!(
        "the pod wrote {} KiB to 8 tunnels never read",
        written.load(Ordering::Relaxed) / 1024
    );
    bed.assert_memory_bounded("after the client that reads nothing");
}
