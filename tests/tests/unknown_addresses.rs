//! Addresses the agents do not know yet: a pod's first connection to a peer
//! whose object is still on its way gets HBONE, not plain text. On the sending
//! node, a connection to an unknown address in the cluster's ranges
//! (`--cluster-cidrs`) waits briefly for the agent to learn it; on the
//! receiving node, the client's own address is kept although that node does
//! not know the client yet (its certificate is valid and the address is the
//! tunnel's own source).
//!
//! Node 2's agent reads a manifests directory of its own, which holds the
//! server pod from the start but never the client; node 1's agent reads the
//! shared one, where the server (or the Service) appears only after the client
//! has connected.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use podlink_tests::{Cluster, Metrics, PodSpec, app};

const SERVICE: &str = "apiVersion: v1
kind: Service
metadata: {name: late, namespace: shop}
spec:
  clusterIP: 10.96.0.30
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: late-1, namespace: shop, labels: {kubernetes.io/service-name: late}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [\"SERVER\"]}]
";

/// Node 1's outbound connections over mutual TLS so far.
fn mutual_tls(m: &Metrics) -> f64 {
    m.sum(
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", "source"),
            ("connection_security_policy", "mutual_tls"),
        ],
    )
}

/// Starts an exchange from `netns` to `dst` on a thread of its own, then
/// waits 300 ms (the connection is in the proxy, waiting) and runs `then`.
fn connect_then(netns: &str, dst: SocketAddr, then: impl FnOnce()) -> app::Exchange {
    let netns = netns.to_string();
    let started = Instant::now();
    let client = std::thread::spawn(move || app::exchange(&netns, dst, b"early bird"));
    std::thread::sleep(Duration::from_millis(300));
    then();
    let ex = client.join().unwrap().expect("the early connection failed");
    assert_eq!(ex.echoed, b"early bird");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    ex
}

#[test]
fn a_peer_learned_late_still_gets_hbone() {
    let mut c = Cluster::with_namespaces(2, &[("shop", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "shop", 0)).unwrap();
    let server = c
        .add_pod_unlisted(PodSpec::new("server", "shop", 1))
        .unwrap();
    // Node 2's own directory: the namespace and the server, not the client.
    let own = c.dir.join("node2-manifests");
    fs::create_dir_all(&own).unwrap();
    for entry in fs::read_dir(&c.manifests).unwrap().flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("namespace-")
        {
            fs::copy(entry.path(), own.join(entry.file_name())).unwrap();
        }
    }
    c.list_pod(&server).unwrap();
    let server_file = format!("pod-shop-{}.yaml", server.name);
    fs::rename(c.manifests.join(&server_file), own.join(&server_file)).unwrap();
    let own_dir = own.to_string_lossy().into_owned();
    c.start_agent_with(0, &["--cluster-cidrs", "10.244.0.0/16,10.96.0.0/16"])
        .unwrap();
    c.start_agent_with(1, &["--manifests", &own_dir]).unwrap();
    c.wait_captured(&client, true).unwrap();
    c.wait_captured(&server, true).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();

    // The server's pod appears at node 1 after the client connected: the
    // connection waited for it and went over HBONE; node 2, which never
    // learns the client, kept the client's own address.
    let before = mutual_tls(&c.metrics(0).unwrap());
    let ex = connect_then(&client.netns, server.addr(8080), || {
        c.list_pod(&server).unwrap()
    });
    assert_eq!(
        ex.peer_seen.ip(),
        IpAddr::V4(client.ip),
        "{}",
        c.agent_log(1)
    );
    let after = mutual_tls(&c.metrics(0).unwrap());
    assert_eq!(after, before + 1.0, "{}", c.agent_log(0));
    assert!(c.agent_log(0).contains("learned it"), "{}", c.agent_log(0));

    // A Service that appears after its client connected.
    let before = after;
    let ex = connect_then(&client.netns, "10.96.0.30:80".parse().unwrap(), || {
        c.write_manifest(
            "service-late.yaml",
            &SERVICE.replace("SERVER", &server.ip.to_string()),
        )
        .unwrap()
    });
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    let metrics = c.metrics(0).unwrap();
    assert_eq!(mutual_tls(&metrics), before + 1.0, "{}", metrics.text);
    assert!(
        metrics.has(
            "istio_tcp_connections_opened_total",
            &[("destination_service_name", "late")]
        ),
        "{}",
        metrics.text
    );
}
