//! The proxy's resources against clients that hold on to them: the number of
//! connections is bounded (and recovers), and a tunnel's upstream connection goes
//! when its HBONE connection does, even while the pod is not reading.

use std::{
    io::Read,
    net::{SocketAddr, TcpListener, TcpStream},
    process::Command,
    time::{Duration, Instant},
};

use http::StatusCode;
use podlink_agent::{identity::SpiffeId, proxy::hbone};
use podlink_tests::{Cluster, Pod, PodSpec, app, netns};
use tokio::io::AsyncWriteExt;

mod common;
use common::{attempt, credentials, hbone_connect, request};

/// Two nodes: a client outside the mesh on node 1, an enrolled server on node 2
/// whose agent gets `agent_args`.
fn bed(agent_args: &[&str]) -> (Cluster, Pod, Pod) {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "legacy", 0)).unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    c.start_agent(0).unwrap();
    c.start_agent_with(1, agent_args).unwrap();
    c.wait_captured(&server, true).unwrap();
    (c, client, server)
}

/// Whether a connection was refused: not made, or closed or reset by the proxy
/// (read within 50 ms).
fn is_reset(s: &std::io::Result<TcpStream>) -> bool {
    let Ok(s) = s else {
        return true;
    };
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut byte = [0u8; 1];
    match (&*s).read(&mut byte) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

#[test]
fn connections_are_bounded_and_the_proxy_recovers() {
    let (c, client, server) = bed(&["--max-connections", "8"]);
    let _echo = app::EchoServer::start(&server.netns, server.addr(9000)).unwrap();

    // Silent connections to the HBONE port: beyond the handshake limit they are
    // reset.
    let hbone_addr = server.addr(15008);
    let silent: Vec<std::io::Result<TcpStream>> = (0..20)
        .map(|_| {
            netns::in_netns(&client.netns, move || {
                TcpStream::connect_timeout(&hbone_addr, Duration::from_secs(5))
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let reset = silent.iter().filter(|s| is_reset(s)).count();
    // Handshakes under way have their own budget, a quarter of the connections,
    // and one address has a quarter of that (at least one).
    assert!(
        reset >= 18,
        "only {reset} of 20 silent connections from one address over its share of 1 handshake were refused"
    );
    c.wait_log(1, &["is at its share of 1 handshakes under way"])
        .unwrap();
    let refused = c.metrics(1).unwrap().sum(
        "podlink_connection_failures_total",
        &[("kind", "handshake_limit")],
    );
    assert!(
        refused >= 18.0,
        "{refused} refusals counted as handshake_limit"
    );
    // They leave the other listeners' connections alone: a plaintext connection
    // to the server (the inbound plaintext listener of the same proxy) is served
    // while they wait.
    let echo_addr = server.addr(9000);
    let served = app::exchange(&client.netns, echo_addr, b"while the handshakes wait")
        .expect("a plaintext connection is served while silent HBONE clients wait");
    assert_eq!(served.echoed, b"while the handshakes wait");
    drop(silent);

    let id = SpiffeId::new("cluster.local", "legacy", "default");
    let (key, roots) = credentials(&c.ca_dir, &id);
    let server_id = SpiffeId::new("cluster.local", "mesh", "server");
    let rt = tokio::runtime::Runtime::new().unwrap();
    // One HBONE connection and CONNECT to the echo server; any failure is an error.
    let tunnel = || {
        rt.block_on(attempt(
            &client.netns,
            server.addr(15008),
            key.clone(),
            roots.clone(),
            server_id.clone(),
            echo_addr,
        ))
    };

    // Connections themselves are bounded: of 12 plaintext connections held open,
    // those over the limit of 8 are reset.
    let held: Vec<std::io::Result<TcpStream>> = (0..12)
        .map(|_| {
            netns::in_netns(&client.netns, move || {
                TcpStream::connect_timeout(&echo_addr, Duration::from_secs(5))
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let refused = held.iter().filter(|s| is_reset(s)).count();
    assert!(
        refused >= 4,
        "only {refused} of 12 connections over a limit of 8 were refused"
    );
    c.wait_log(1, &["at the limit of 8 connections"]).unwrap();
    // An HBONE client that completes its handshakes while every connection slot
    // is taken is refused after them (once the silent clients' handshake permits
    // are back; until then it is refused before).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = tunnel();
        assert!(
            got != Ok(StatusCode::OK),
            "an HBONE stream was served with every connection slot taken"
        );
        if c.agent_log(1).contains("after its handshakes") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no HBONE connection was refused after its handshakes ({got:?}):\n{}",
            c.agent_log(1)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(held);

    // Once they are gone, the proxy serves again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if tunnel() == Ok(StatusCode::OK) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy did not recover:\n{}",
            c.agent_log(1)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Upstream connections of node 2's proxy to `dst`, as `ss` lists them there.
fn upstream_sockets(c: &Cluster, dst: SocketAddr) -> usize {
    let out = netns::run(
        netns::command_in(&c.nodes[1].netns, "ss")
            .args(["-Htn", "dst"])
            .arg(dst.to_string()),
    )
    .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[test]
fn a_tunnel_ends_with_its_hbone_connection() {
    let (c, client, server) = bed(&[]);
    // A pod that accepts and never reads.
    let sink_addr = server.addr(9100);
    let sink = netns::in_netns(&server.netns, move || TcpListener::bind(sink_addr)).unwrap();
    let held = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in sink.incoming().take(1) {
            held.push(s);
        }
        std::thread::sleep(Duration::from_secs(30));
        drop(held);
    });

    let id = SpiffeId::new("cluster.local", "legacy", "default");
    let (key, roots) = credentials(&c.ca_dir, &id);
    let server_id = SpiffeId::new("cluster.local", "mesh", "server");
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The stream stays open (held here) while its connection goes away.
    let (_h2, _stream) = rt.block_on(async {
        let mut h2 = hbone_connect(&client.netns, server.addr(15008), key, roots, server_id)
            .await
            .unwrap();
        let (status, stream) = request(
            &mut h2,
            hbone::connect_request(sink_addr, client.ip.into(), None),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let mut stream = stream.unwrap();
        // More than the pod will ever read: the proxy's copy blocks on it.
        let junk = vec![0u8; 8 << 20];
        let _ = tokio::time::timeout(Duration::from_secs(2), stream.write_all(&junk)).await;
        (h2, stream)
    });
    assert_eq!(upstream_sockets(&c, sink_addr), 1);
    // The client goes away: its runtime, and with it the HBONE connection, end.
    drop(rt);
    let deadline = Instant::now() + Duration::from_secs(10);
    while upstream_sockets(&c, sink_addr) > 0 {
        assert!(
            Instant::now() < deadline,
            "the upstream connection outlived its tunnel:\n{}",
            String::from_utf8_lossy(
                &Command::new("ip")
                    .args(["netns", "exec", &c.nodes[1].netns, "ss", "-tn"])
                    .output()
                    .unwrap()
                    .stdout
            )
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(held);
}
