//! Addresses the agents do not know yet: a pod's first connection to a peer
//! whose object is still on its way gets HBONE, not plain text. On the sending
//! node, a connection to an unknown address in the cluster's ranges
//! (`--cluster-cidrs`, or learned) waits briefly for the agent to learn it; on the
//! receiving node, the client's own address is kept although that node does
//! not know the client yet (its certificate is valid and the address is the
//! tunnel's own source).
//!
//! Node 2's agent reads a manifests directory of its own, which holds the
//! server pod from the start but never the client; node 1's agent reads the
//! shared one, or the Kubernetes API, where the server (or the Service)
//! appears only after the client has connected. With the manifests directory
//! node 1 is given the ranges (`--cluster-cidrs`); with the Kubernetes API it
//! learns them, the pod ranges from the Node objects, the service range from
//! the Services seen.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use podlink_tests::{Cluster, Metrics, PodSpec, Source, app};

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

/// The Nodes of the test bed with their pod ranges (`spec.podCIDRs`), as
/// the node IPAM controller sets them.
const NODES: &str = "apiVersion: v1
kind: Node
metadata: {name: node1}
spec: {podCIDR: 10.244.1.0/24, podCIDRs: [10.244.1.0/24]}
---
apiVersion: v1
kind: Node
metadata: {name: node2}
spec: {podCIDR: 10.244.2.0/24, podCIDRs: [10.244.2.0/24]}
";

/// Services seen before the late one: their ClusterIPs (10.96.0.1 and
/// 10.96.0.60) make the service range learned 10.96.0.0/26, which holds the
/// late one's.
const SERVICES_SEEN: &str = "apiVersion: v1
kind: Service
metadata: {name: kubernetes, namespace: default}
spec:
  clusterIP: 10.96.0.1
  ports: [{name: https, port: 443, targetPort: 6443}]
---
apiVersion: v1
kind: Service
metadata: {name: other, namespace: shop}
spec:
  clusterIP: 10.96.0.60
  ports: [{port: 80, targetPort: 8080}]
";

#[test]
fn a_peer_learned_late_still_gets_hbone() {
    peer_learned_late(Source::Manifests);
}

/// As [`a_peer_learned_late_still_gets_hbone`], node 1's agent watching the
/// Kubernetes API without `--cluster-cidrs`: the pod range comes from the
/// Node objects' `podCIDRs`, the service range from the Services seen.
#[test]
fn a_peer_learned_late_from_the_kubernetes_api_in_ranges_learned() {
    peer_learned_late(Source::Kubernetes);
}

fn peer_learned_late(source: Source) {
    let mut c = Cluster::with_namespaces_from(2, &[("shop", true)], source).unwrap();
    let client = c.add_pod(PodSpec::new("client", "shop", 0)).unwrap();
    let server = c
        .add_pod_unlisted(PodSpec::new("server", "shop", 1))
        .unwrap();
    // Node 2's own directory: the namespace and the server, not the client.
    let own = c.dir.join("node2-manifests");
    fs::create_dir_all(&own).unwrap();
    fs::write(
        own.join("namespace-shop.yaml"),
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: shop\n  labels:\n    istio.io/dataplane-mode: ambient\n",
    )
    .unwrap();
    fs::write(own.join("pod-shop-server.yaml"), c.pod_manifest(&server)).unwrap();
    let own_dir = own.to_string_lossy().into_owned();
    match source {
        Source::Manifests => c
            .start_agent_with(0, &["--cluster-cidrs", "10.244.0.0/16,10.96.0.0/16"])
            .unwrap(),
        Source::Kubernetes => {
            c.write_manifest("nodes.yaml", NODES).unwrap();
            c.write_manifest("services.yaml", SERVICES_SEEN).unwrap();
            c.start_agent(0).unwrap();
        }
    }
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
