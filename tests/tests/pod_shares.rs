//! One client against the others. The proxy gives each source address a share
//! of its connection slots (a quarter of `--max-connections`, at least 16) on
//! the outbound and inbound plaintext listeners: a pod that opens more is
//! refused beyond its share while other pods are served, and its idle
//! connections (never sending, never reading) stay open without stopping
//! anyone. The agent's HTTP endpoints (15020, 15021, 15000) and its CNI socket
//! cut off slow and oversized requests and go on answering the others.

use std::{
    io::{self, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

use podlink_agent::cni::protocol::Reply;
use podlink_tests::{ADMIN_PORT, Cluster, METRICS_PORT, Pod, PodSpec, READINESS_PORT, app, netns};

/// The slots node 2's agent is given.
const MAX_CONNECTIONS: &str = "80";
/// A source address's share of them: a quarter (`ConnectionLimits::share`).
const SHARE: usize = 20;
/// The echo server's port on the server pod.
const ECHO_PORT: u16 = 7000;

/// Two nodes: clients outside the mesh (`x`, `y`) on node 1; enrolled clients
/// (`a`, `b`) and an enrolled server (`server`, running an echo server) on node
/// 2, whose agent has `--max-connections 80`.
struct Bed {
    c: Cluster,
    a: Pod,
    b: Pod,
    x: Pod,
    y: Pod,
    server: Pod,
    _echo: app::EchoServer,
}

fn bed() -> Bed {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let x = c.add_pod(PodSpec::new("x", "legacy", 0)).unwrap();
    let y = c.add_pod(PodSpec::new("y", "legacy", 0)).unwrap();
    let a = c.add_pod(PodSpec::new("a", "mesh", 1)).unwrap();
    let b = c.add_pod(PodSpec::new("b", "mesh", 1)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 1)).unwrap();
    c.start_agent(0).unwrap();
    c.start_agent_with(1, &["--max-connections", MAX_CONNECTIONS])
        .unwrap();
    c.wait_all_captured(&[&a, &b, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(ECHO_PORT)).unwrap();
    Bed {
        c,
        a,
        b,
        x,
        y,
        server,
        _echo: echo,
    }
}

/// `n` connections from `pod` to `dst`, each served (its greeting read) or
/// refused (reset or closed before it).
fn open(pod: &Pod, dst: SocketAddr, n: usize) -> (Vec<TcpStream>, usize) {
    let mut served = Vec::new();
    let mut refused = 0;
    let opened: Vec<io::Result<TcpStream>> = (0..n)
        .map(|_| app::connect(&pod.netns, dst, Duration::from_secs(5)))
        .collect();
    for s in opened {
        match s.and_then(|s| app::read_greeting(&s).map(|_| s)) {
            Ok(s) => served.push(s),
            Err(_) => refused += 1,
        }
    }
    (served, refused)
}

/// Waits (up to 10 s) until an exchange from `pod` to `dst` succeeds.
fn eventually_served(c: &Cluster, pod: &Pod, dst: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match app::exchange(&pod.netns, dst, b"served") {
            Ok(ex) if ex.echoed == b"served" => return,
            got => assert!(
                Instant::now() < deadline,
                "{} was not served: {got:?}\n{}",
                pod.name,
                c.agent_log(1)
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn shares_bound_one_pod_while_others_are_served() {
    let bed = bed();
    let (c, dst) = (&bed.c, bed.server.addr(ECHO_PORT));

    // Outbound (15001): pod a opens 30 connections, 20 are served.
    let (held_a, refused) = open(&bed.a, dst, SHARE + 10);
    assert_eq!(
        (held_a.len(), refused),
        (SHARE, 10),
        "pod a's connections served and refused, with a share of {SHARE}\n{}",
        c.agent_log(1)
    );
    // Pod b, on the same node, is served meanwhile.
    eventually_served(c, &bed.b, dst);
    c.wait_log(
        1,
        &[format!(
            "outbound listener: {} holds its share of {SHARE} connections (of {MAX_CONNECTIONS})",
            bed.a.ip
        )
        .as_str()],
    )
    .unwrap();
    c.wait_metrics(1, "10 outbound share_limit failures", |m| {
        m.sum(
            "podlink_connection_failures_total",
            &[("direction", "outbound"), ("kind", "share_limit")],
        ) >= 10.0
    })
    .unwrap();

    // Inbound plaintext (15006): client x outside the mesh, likewise; client y
    // is served meanwhile.
    let (held_x, refused) = open(&bed.x, dst, SHARE + 10);
    assert_eq!(
        (held_x.len(), refused),
        (SHARE, 10),
        "client x's connections served and refused\n{}",
        c.agent_log(1)
    );
    eventually_served(c, &bed.y, dst);
    c.wait_log(
        1,
        &[format!(
            "inbound plaintext listener: {} holds its share of {SHARE} connections",
            bed.x.ip
        )
        .as_str()],
    )
    .unwrap();
    c.wait_metrics(1, "10 inbound share_limit failures", |m| {
        m.sum(
            "podlink_connection_failures_total",
            &[("direction", "inbound"), ("kind", "share_limit")],
        ) >= 10.0
    })
    .unwrap();
    // None of this was the global limit.
    let metrics = c.metrics(1).unwrap();
    assert_eq!(
        metrics.sum(
            "podlink_connection_failures_total",
            &[("kind", "connection_limit")]
        ),
        0.0
    );

    // Once their connections close, a and x are served again.
    drop((held_a, held_x));
    eventually_served(c, &bed.a, dst);
    eventually_served(c, &bed.x, dst);
}

#[test]
fn shares_bound_idle_connections_without_closing_them() {
    let bed = bed();
    let (c, dst) = (&bed.c, bed.server.addr(ECHO_PORT));
    // A server on the server pod that accepts and never reads.
    let sink_addr = bed.server.addr(7100);
    let sink = netns::in_netns(&bed.server.netns, move || TcpListener::bind(sink_addr)).unwrap();
    let sink_thread = std::thread::spawn(move || {
        sink.incoming()
            .take(SHARE / 2)
            .filter_map(Result::ok)
            .collect::<Vec<_>>()
    });

    // Pod a fills its share: half with connections to the sink that send until
    // nothing more is taken and never read, half with connections to the echo
    // server that never send or read (the greeting waits unread).
    let stuffed: Vec<TcpStream> = (0..SHARE / 2)
        .map(|_| {
            let mut s = app::connect(&bed.a.netns, sink_addr, Duration::from_secs(5)).unwrap();
            s.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
            let junk = vec![0u8; 1 << 20];
            // Until the buffers on the way are full: a write then times out.
            for _ in 0..64 {
                if s.write_all(&junk).is_err() {
                    break;
                }
            }
            s
        })
        .collect();
    let sunk = sink_thread.join().unwrap();
    assert_eq!(sunk.len(), SHARE / 2);
    // Opened last: the echo server closes a connection idle for 30 s.
    let silent: Vec<TcpStream> = (0..SHARE / 2)
        .map(|_| app::connect(&bed.a.netns, dst, Duration::from_secs(5)).unwrap())
        .collect();

    // Beyond its share pod a is refused; pod b and client x are served.
    let (more, refused) = open(&bed.a, dst, 1);
    assert_eq!((more.len(), refused), (0, 1), "a connection over a's share");
    eventually_served(c, &bed.b, dst);
    eventually_served(c, &bed.x, dst);

    // The idle connections were not closed: each silent one still carries
    // bytes both ways.
    for mut s in silent {
        app::read_greeting(&s).expect("the greeting of an idle connection");
        let back = app::echo_round(&mut s, b"still here").expect("an idle connection still open");
        assert_eq!(back, b"still here");
        s.shutdown(Shutdown::Write).unwrap();
    }
    drop((stuffed, sunk));
}

/// Whether the peer closes `s` within 30 s while `poke` is called every 500 ms
/// (what `poke` writes may fail once the peer has closed).
fn closed_while(s: &mut TcpStream, mut poke: impl FnMut(&mut TcpStream) -> io::Result<()>) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if poke(s).is_err() {
                    return true;
                }
            }
            Err(_) => return true,
        }
    }
    false
}

/// Sends `head` then, from another thread, up to `body` bytes (as far as they
/// are taken); reads the response until the connection closes (up to 30 s).
/// The response, and whether the connection was closed.
fn request(netns_name: &str, addr: SocketAddr, head: Vec<u8>, body: usize) -> (String, bool) {
    let mut s = netns::in_netns(netns_name, move || TcpStream::connect(addr)).unwrap();
    s.write_all(&head).unwrap();
    let mut writer = s.try_clone().unwrap();
    std::thread::spawn(move || {
        let piece = vec![b'x'; 64 * 1024];
        let mut left = body;
        while left > 0 {
            let n = left.min(piece.len());
            if writer.write_all(&piece[..n]).is_err() {
                return;
            }
            left -= n;
        }
    });
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut response = Vec::new();
    let closed = loop {
        let mut buf = [0u8; 4096];
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => response.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                break false;
            }
            // A reset once the server closed with the body unread.
            Err(_) => break true,
        }
    };
    (String::from_utf8_lossy(&response).into_owned(), closed)
}

#[test]
fn shares_of_the_endpoints_cut_off_slow_and_oversized_requests() {
    let mut c = Cluster::new(1).unwrap();
    c.start_agent(0).unwrap();
    let ns = c.nodes[0].netns.clone();
    for (port, path) in [
        (METRICS_PORT, "/metrics"),
        (READINESS_PORT, "/healthz/ready"),
        (ADMIN_PORT, "/config_dump"),
    ] {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        // A request whose headers are trickled, a line every 500 ms, is cut off.
        let mut slow = netns::in_netns(&ns, move || TcpStream::connect(addr)).unwrap();
        slow.write_all(format!("GET {path} HTTP/1.1\r\n").as_bytes())
            .unwrap();
        let mut line = 0;
        let cut = closed_while(&mut slow, |s| {
            line += 1;
            s.write_all(format!("x-slow-{line}: 1\r\n").as_bytes())
        });
        assert!(cut, "{port}: a slowloris client was not cut off");

        // Headers over 16 KiB: 431 and closed.
        let junk = "a".repeat(32 * 1024);
        let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\nx-junk: {junk}\r\n\r\n");
        let (response, closed) = request(&ns, addr, head.into_bytes(), 0);
        assert!(response.starts_with("HTTP/1.1 431"), "{port}: {response:?}");
        assert!(
            closed,
            "{port}: an oversized header's connection stays open"
        );

        // A 1 GiB body is not read: answered, then closed.
        let head = format!("POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 1073741824\r\n\r\n");
        let (response, closed) = request(&ns, addr, head.into_bytes(), 1 << 30);
        assert!(response.starts_with("HTTP/1.1 "), "{port}: {response:?}");
        assert!(closed, "{port}: a huge body's connection stays open");

        // A normal request still gets its answer.
        let (status, _) = c.http_request(0, port, "GET", path).unwrap();
        assert_eq!(status, 200, "{port}: {path}");
    }

    // A flood of idle connections to the readiness endpoint: the agent closes
    // them (those over its limit at once, the others at the header timeout) and
    // answers again.
    let addr = SocketAddr::from(([127, 0, 0, 1], READINESS_PORT));
    let flood: Vec<TcpStream> = netns::in_netns(&ns, move || {
        (0..200).map(|_| TcpStream::connect(addr)).collect()
    })
    .unwrap();
    for mut s in flood {
        assert!(
            closed_while(&mut s, |_| Ok(())),
            "an idle connection to the readiness endpoint stayed open"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.readiness(0).ok() != Some(200) {
        assert!(
            Instant::now() < deadline,
            "readiness does not answer after the flood"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Sends `request` on the CNI socket at `path` and reads the reply (up to 30 s);
/// `None` when the connection ended without one.
fn cni_exchange(path: &Path, request: &[u8]) -> Option<Reply> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = s.write_all(request);
    let _ = s.shutdown(Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    Reply::parse(&out).ok()
}

#[test]
fn shares_of_the_cni_socket_cut_off_slow_and_oversized_requests() {
    let mut c = Cluster::new(1).unwrap();
    c.start_agent(0).unwrap();
    let path = c.nodes[0].cni_socket.clone();

    // A request trickled a byte every 500 ms is answered with an error and closed.
    let mut slow = UnixStream::connect(&path).unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let trickle = br#"{"version":1,"command":"DEL","containerId":"c","namespace":"n","name":"p"}"#;
    let (mut at, mut out) = (0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    let closed = loop {
        assert!(
            Instant::now() < deadline,
            "a slowloris CNI client was not cut off"
        );
        match slow.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                // Never the last byte: the request never ends.
                if at + 1 < trickle.len() && slow.write_all(&trickle[at..=at]).is_ok() {
                    at += 1;
                }
            }
            Err(_) => break true,
        }
    };
    assert!(closed);
    match Reply::parse(&out) {
        Ok(Reply::Error { message, .. }) => {
            assert!(message.contains("no complete request"), "{message}")
        }
        other => panic!("the slow request's reply: {other:?}"),
    }

    // A request of 1 MiB: an error naming the limit, or the connection closed.
    let huge = vec![b' '; 1 << 20];
    match cni_exchange(&path, &huge) {
        Some(Reply::Error { message, .. }) => assert!(message.contains("bytes"), "{message}"),
        None => {}
        Some(other) => panic!("an oversized request answered {other:?}"),
    }

    // A normal request still gets its answer.
    let reply = cni_exchange(
        &path,
        b"{\"version\":1,\"command\":\"DEL\",\"containerId\":\"c\",\"namespace\":\"n\",\"name\":\"p\"}\n",
    );
    assert_eq!(reply, Some(Reply::Removed), "{}", c.agent_log(0));
}
