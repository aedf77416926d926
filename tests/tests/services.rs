//! Services: an enrolled client connects to a Service's ClusterIP (there is no
//! kube-proxy in the test bed: only the proxy can resolve it). The proxy picks a
//! ready endpoint, resolves the named target port through the EndpointSlice, and
//! carries the connection over HBONE to endpoints on the other nodes; connections
//! spread over the endpoints; removed, not ready and terminating endpoints get no
//! new connections; a Service without ready endpoints resets the client at
//! once, one without an EndpointSlice after waiting up to 1 s for one; an
//! endpoint outside the mesh is reached in plain TCP.

use std::{
    io::{ErrorKind, Read},
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use podlink_tests::{Capture, Cluster, Pod, PodSpec, Source, app, contains_bytes};

const VIP: &str = "10.96.0.10:80";
const LONELY: &str = "10.96.0.11:80";

const SERVICE: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: http}
---
apiVersion: v1
kind: Service
metadata: {name: lonely, namespace: shop}
spec:
  clusterIP: 10.96.0.11
  ports:
  - {port: 80, targetPort: 8080}
";

/// The EndpointSlice of `web` with `endpoints` (address, conditions).
fn slice(endpoints: &[(&Pod, &str)]) -> String {
    let mut text = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
"
    .to_string();
    for (pod, conditions) in endpoints {
        text.push_str(&format!(
            "- addresses: [\"{}\"]\n  conditions: {conditions}\n",
            pod.ip
        ));
    }
    text
}

const READY: &str = "{ready: true, serving: true, terminating: false}";

fn vip() -> SocketAddr {
    VIP.parse().unwrap()
}

/// Connections each endpoint accepted so far.
fn accepted(servers: &[app::EchoServer]) -> Vec<usize> {
    servers.iter().map(app::EchoServer::accepted).collect()
}

/// Makes `n` exchanges with the Service; each must succeed with the client's
/// address kept.
fn exchanges(c: &Cluster, client: &Pod, n: usize) {
    for i in 0..n {
        let payload = format!("service-payload-{i}-").repeat(20).into_bytes();
        let ex = app::exchange(&client.netns, vip(), &payload).unwrap_or_else(|e| {
            panic!(
                "exchange {i} failed: {e}\nnode1:\n{}\nnode2:\n{}",
                c.agent_log(0),
                c.agent_log(1)
            )
        });
        assert_eq!(ex.echoed, payload);
        assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    }
}

/// Expects the proxy to reset a connection to `dst` at once (not leave it open).
fn reset_at_once(client: &Pod, dst: SocketAddr) {
    // The reset may even come before connect() returns.
    let err = match app::connect(&client.netns, dst, Duration::from_secs(5)) {
        Err(e) => e.kind(),
        Ok(mut stream) => {
            let mut buf = [0u8; 16];
            match stream.read(&mut buf) {
                Ok(0) => ErrorKind::UnexpectedEof,
                Ok(n) => panic!("{n} bytes from a Service without endpoints"),
                Err(e) => e.kind(),
            }
        }
    };
    // A hanging connection would end in the 20 s read timeout (WouldBlock).
    assert!(
        matches!(err, ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof),
        "{err:?}"
    );
}

#[test]
fn service_connections_go_to_ready_endpoints_over_hbone() {
    service_connections(Source::Manifests);
}

#[test]
fn service_connections_from_the_kubernetes_api() {
    service_connections(Source::Kubernetes);
}

fn service_connections(source: Source) {
    // The client on node 1, the endpoints on nodes 2 and 3.
    let mut c =
        Cluster::with_namespaces_from(3, &[("shop", true), ("legacy", false)], source).unwrap();
    let client = c.add_pod(PodSpec::new("client", "shop", 0)).unwrap();
    let first = c
        .add_pod(PodSpec::new("web-a", "shop", 1).label("app", "web"))
        .unwrap();
    let far1 = c
        .add_pod(PodSpec::new("web-b", "shop", 1).label("app", "web"))
        .unwrap();
    let far2 = c
        .add_pod(PodSpec::new("web-c", "shop", 2).label("app", "web"))
        .unwrap();
    // An endpoint outside the mesh: reached in plain TCP.
    let legacy = c.add_pod(PodSpec::new("old", "legacy", 2)).unwrap();
    c.write_manifest("service-web.yaml", SERVICE).unwrap();
    c.write_manifest(
        "service-old.yaml",
        &format!(
            "apiVersion: v1
kind: Service
metadata: {{name: old, namespace: legacy}}
spec:
  clusterIP: 10.96.0.12
  ports: [{{port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: old-1, namespace: legacy, labels: {{kubernetes.io/service-name: old}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{{addresses: [\"{}\"]}}]
",
            legacy.ip
        ),
    )
    .unwrap();
    c.write_manifest(
        "slice-web.yaml",
        &slice(&[(&first, READY), (&far1, READY), (&far2, READY)]),
    )
    .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &first, &far1, &far2])
        .unwrap();
    let servers: Vec<app::EchoServer> = [&first, &far1, &far2]
        .iter()
        .map(|p| app::EchoServer::start(&p.netns, p.addr(8080)).unwrap())
        .collect();

    // Spread over the endpoints, over HBONE only.
    let capture = Capture::start(&c.nodes[0].netns, "eth0", &c.dir, "underlay").unwrap();
    exchanges(&c, &client, 30);
    let (raw, lines) = capture.stop().unwrap();
    let counts = accepted(&servers);
    assert!(counts.iter().all(|&n| n > 0), "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), 30);
    assert!(
        !contains_bytes(&raw, b"service-payload"),
        "plaintext on the underlay"
    );
    assert!(!lines.iter().any(|l| l.contains(".8080:")), "{lines:#?}");
    for endpoint in [&first, &far1, &far2] {
        assert!(c.counters(endpoint).unwrap()["captured_inbound_hbone"] > 0);
    }
    let dump = c.config_dump(0).unwrap();
    let web = dump["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "web")
        .unwrap_or_else(|| panic!("{dump:#}"));
    assert_eq!(web["vip"], VIP);
    assert_eq!(web["endpoints"].as_array().unwrap().len(), 3, "{dump:#}");
    let metrics = c.metrics(0).unwrap().text;
    assert!(
        metrics.contains("destination_service=\"web.shop.svc.cluster.local\""),
        "{metrics}"
    );
    // The view holds the three Services (web, lonely, old).
    let known = c.metrics(0).unwrap();
    assert_eq!(
        known.sum("podlink_known_objects", &[("kind", "services")]),
        3.0,
        "{}",
        known.text
    );

    let old = app::EchoServer::start(&legacy.netns, legacy.addr(8080)).unwrap();
    let ex = app::exchange(&client.netns, "10.96.0.12:80".parse().unwrap(), b"legacy").unwrap();
    assert_eq!(
        (ex.echoed.as_slice(), ex.peer_seen.ip()),
        (&b"legacy"[..], IpAddr::V4(client.ip))
    );
    assert_eq!(old.accepted(), 1);

    // An endpoint removed while the client keeps connecting: no connection
    // fails, and once the change is in, the removed one gets none.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, netns) = (stop.clone(), client.netns.clone());
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = app::exchange(&netns, vip(), b"during") {
                    failures.push(e.to_string());
                }
            }
            failures
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    c.write_manifest("slice-web.yaml", &slice(&[(&first, READY), (&far1, READY)]))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.service_endpoints(0, "shop", "web") != 2 {
        assert!(Instant::now() < deadline, "{}", c.agent_log(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let failures = load.join().unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    let before = accepted(&servers);
    exchanges(&c, &client, 20);
    let after = accepted(&servers);
    assert_eq!(after[2], before[2], "the removed endpoint got connections");

    // Not ready and terminating endpoints get no new connections.
    c.write_manifest(
        "slice-web.yaml",
        &slice(&[
            (&first, "{ready: false}"),
            (&far1, "{ready: true, serving: true, terminating: true}"),
            (&far2, READY),
        ]),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let before = accepted(&servers);
        exchanges(&c, &client, 10);
        let after = accepted(&servers);
        if after[0] == before[0] && after[1] == before[1] {
            assert_eq!(after[2], before[2] + 10);
            break;
        }
        assert!(Instant::now() < deadline, "{}", c.agent_log(0));
    }

    // No ready endpoint: reset at once, with a clear log line.
    c.write_manifest("slice-web.yaml", &slice(&[(&first, "{ready: false}")]))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c
        .agent_log(0)
        .contains("service shop/web has no ready endpoint")
    {
        assert!(Instant::now() < deadline, "{}", c.agent_log(0));
        let _ = app::exchange(&client.netns, vip(), b"x");
        std::thread::sleep(Duration::from_millis(100));
    }
    reset_at_once(&client, vip());
    // A Service without an EndpointSlice: the same, saying so.
    reset_at_once(&client, LONELY.parse().unwrap());
    c.wait_log(0, &["service shop/lonely has no EndpointSlice yet"])
        .unwrap();
}

const PICK_VIP: &str = "10.96.0.20:80";

/// Nodes 1 and 2 in zone `a`, node 3 in zone `b`.
const NODES: &str = "apiVersion: v1
kind: Node
metadata: {name: node1, labels: {topology.kubernetes.io/zone: a}}
---
apiVersion: v1
kind: Node
metadata: {name: node2, labels: {topology.kubernetes.io/zone: a}}
---
apiVersion: v1
kind: Node
metadata: {name: node3, labels: {topology.kubernetes.io/zone: b}}
";

/// Service `pick` with `spec` lines added, and its slice of `endpoints`
/// (pod, node index, conditions).
fn pick(spec: &str, endpoints: &[(&Pod, usize, &str)]) -> String {
    let mut text = format!(
        "apiVersion: v1
kind: Service
metadata: {{name: pick, namespace: shop}}
spec:
  clusterIP: 10.96.0.20
  ports: [{{name: http, port: 80, targetPort: 8080}}]
{spec}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: pick-1, namespace: shop, labels: {{kubernetes.io/service-name: pick}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
"
    );
    for (pod, node, conditions) in endpoints {
        let zone = if *node == 2 { "b" } else { "a" };
        text.push_str(&format!(
            "- addresses: [\"{}\"]\n  conditions: {conditions}\n  nodeName: node{}\n  zone: {zone}\n",
            pod.ip,
            node + 1
        ));
    }
    text
}

/// Waits until node 1's agent has Service `pick` with `choice` and `usable`
/// endpoints.
fn wait_choice(c: &Cluster, choice: &str, usable: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let dump = c.config_dump(0).unwrap();
        let port = dump["services"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["name"] == "pick")
            .cloned();
        if let Some(port) = &port
            && port["choice"] == choice
            && port["usable"].as_array().map(Vec::len) == Some(usable)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {choice} with {usable} usable: {port:#?}\n{}",
            c.agent_log(0)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Makes `n` exchanges with Service `pick`; returns how many each server
/// accepted meanwhile.
fn spread(c: &Cluster, client: &Pod, servers: &[app::EchoServer], n: usize) -> Vec<usize> {
    let before = accepted(servers);
    for i in 0..n {
        let ex = app::exchange(&client.netns, PICK_VIP.parse().unwrap(), b"pick")
            .unwrap_or_else(|e| panic!("exchange {i} failed: {e}\n{}", c.agent_log(0)));
        assert_eq!(ex.echoed, b"pick");
    }
    accepted(servers)
        .iter()
        .zip(before)
        .map(|(a, b)| a - b)
        .collect()
}

#[test]
fn endpoint_choice_follows_the_service_from_manifests() {
    endpoint_choice(Source::Manifests);
}

#[test]
fn endpoint_choice_follows_the_service_from_the_kubernetes_api() {
    endpoint_choice(Source::Kubernetes);
}

/// How the proxy chooses among a Service's endpoints, as kube-proxy would:
/// serving-terminating endpoints when none is ready, `trafficDistribution` by
/// the Node objects' zones (`PreferClose`, `PreferSameZone`, `PreferSameNode`
/// falling back to the zone), `internalTrafficPolicy: Local`,
/// `sessionAffinity: ClientIP` and its timeout; a headless Service leaves
/// connections to its pods as they are. The endpoints, pods of one
/// Deployment, make one `destination_workload` series, and pods of other
/// controllers (StatefulSet, DaemonSet, Job, CronJob) and canonical labels
/// are named as Istio names them.
fn endpoint_choice(source: Source) {
    let mut c = Cluster::with_namespaces_from(3, &[("shop", true)], source).unwrap();
    c.write_manifest("nodes.yaml", NODES).unwrap();
    let client = c.add_pod(PodSpec::new("client", "shop", 0)).unwrap();
    let web = |name: &str, node: usize| {
        PodSpec::new(name, "shop", node)
            .label("app", "web")
            .label("pod-template-hash", "5d8f9c7b6")
            .owner("ReplicaSet", "web-5d8f9c7b6")
    };
    let w1 = c.add_pod(web("web-5d8f9c7b6-aaaaa", 0)).unwrap();
    let w2 = c.add_pod(web("web-5d8f9c7b6-bbbbb", 1)).unwrap();
    let w3 = c.add_pod(web("web-5d8f9c7b6-ccccc", 2)).unwrap();
    // Pods of other controllers, and of other canonical labels, on node 2
    // (`ownerReferences` as their controllers set them).
    let owned = WORKLOADS.map(|(name, owner, labels, _)| {
        let mut spec = PodSpec::new(name, "shop", 1);
        if let Some((kind, owner)) = owner {
            spec = spec.owner(kind, owner);
        }
        for (key, value) in labels {
            spec = spec.label(key, value);
        }
        c.add_pod(spec).unwrap()
    });
    c.start_agents().unwrap();
    let mut all = vec![&client, &w1, &w2, &w3];
    all.extend(&owned);
    c.wait_all_captured(&all).unwrap();
    let servers: Vec<app::EchoServer> = [&w1, &w2, &w3]
        .iter()
        .map(|p| app::EchoServer::start(&p.netns, p.addr(8080)).unwrap())
        .collect();
    let terminating = "{ready: false, serving: true, terminating: true}";
    let gone = "{ready: false, serving: false, terminating: true}";

    // No endpoint ready: the serving ones that are terminating, never the
    // ones that no longer serve.
    c.write_manifest(
        "pick.yaml",
        &pick("", &[(&w2, 1, terminating), (&w3, 2, gone)]),
    )
    .unwrap();
    wait_choice(&c, "serving-terminating", 1);
    assert_eq!(spread(&c, &client, &servers, 10), [0, 10, 0]);

    // PreferClose: node 1 is in zone a, as node 2's endpoint is.
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  trafficDistribution: PreferClose\n",
            &[(&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "same-zone", 1);
    assert_eq!(spread(&c, &client, &servers, 10), [0, 10, 0]);
    // No endpoint near: any.
    c.write_manifest(
        "pick.yaml",
        &pick("  trafficDistribution: PreferClose\n", &[(&w3, 2, READY)]),
    )
    .unwrap();
    wait_choice(&c, "ready", 1);
    assert_eq!(spread(&c, &client, &servers, 5), [0, 0, 5]);
    // Node 1 moves to zone b: the Service is chosen for it again.
    c.write_manifest("nodes.yaml", &NODES.replacen("zone: a", "zone: b", 1))
        .unwrap();
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  trafficDistribution: PreferClose\n",
            &[(&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "same-zone", 1);
    assert_eq!(spread(&c, &client, &servers, 10), [0, 0, 10]);
    c.write_manifest("nodes.yaml", NODES).unwrap();

    // PreferSameZone: the endpoints of node 1's zone a, on node 1 and node 2.
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  trafficDistribution: PreferSameZone\n",
            &[(&w1, 0, READY), (&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "same-zone", 2);
    let counts = spread(&c, &client, &servers, 20);
    assert!(counts[2] == 0 && counts[0] + counts[1] == 20, "{counts:?}");

    // PreferSameNode: the endpoint on the client's node.
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  trafficDistribution: PreferSameNode\n",
            &[(&w1, 0, READY), (&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "same-node", 1);
    assert_eq!(spread(&c, &client, &servers, 10), [10, 0, 0]);
    // None on node 1: another node's, in node 1's zone.
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  trafficDistribution: PreferSameNode\n",
            &[(&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "same-zone", 1);
    assert_eq!(spread(&c, &client, &servers, 10), [0, 10, 0]);

    // internalTrafficPolicy Local: only this node's endpoints; none here,
    // none at all.
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  internalTrafficPolicy: Local\n",
            &[(&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "none", 0);
    reset_at_once(&client, PICK_VIP.parse().unwrap());
    c.wait_log(
        0,
        &["service shop/pick has no endpoint on this node (internalTrafficPolicy: Local)"],
    )
    .unwrap();
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  internalTrafficPolicy: Local\n",
            &[(&w1, 0, READY), (&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "local", 1);
    assert_eq!(spread(&c, &client, &servers, 10), [10, 0, 0]);

    // A headless Service (no ClusterIP) of the same pods: no virtual
    // address; connections to a pod's address go to that pod, as they are.
    // Written before the next change of `pick`, which shows it arrived.
    c.write_manifest("headless.yaml", &headless(&[&w2, &w3]))
        .unwrap();

    // sessionAffinity ClientIP with a timeout of 2 s: the client keeps its
    // endpoint while it comes back within the timeout, even with a
    // connection open to it (balancing alone would choose the other, idle
    // one); past the timeout it is chosen afresh: the other one.
    c.write_manifest(
        "pick.yaml",
        &pick(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}\n",
            &[(&w2, 1, READY), (&w3, 2, READY)],
        ),
    )
    .unwrap();
    wait_choice(&c, "ready", 2);
    let before = accepted(&servers);
    let held = app::connect(
        &client.netns,
        PICK_VIP.parse().unwrap(),
        Duration::from_secs(5),
    )
    .unwrap();
    app::read_greeting(&held).unwrap();
    let kept = (0..3)
        .find(|&i| accepted(&servers)[i] > before[i])
        .unwrap_or_else(|| panic!("no endpoint accepted: {:?}", accepted(&servers)));
    assert!(kept == 1 || kept == 2, "{kept}");
    let mut only_kept = [0; 3];
    only_kept[kept] = 10;
    assert_eq!(spread(&c, &client, &servers, 10), only_kept);
    std::thread::sleep(Duration::from_secs(3));
    let mut only_other = [0; 3];
    only_other[3 - kept] = 10;
    assert_eq!(spread(&c, &client, &servers, 10), only_other);
    drop(held);

    let dump = c.config_dump(0).unwrap();
    assert!(
        !dump["services"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "headless"),
        "{dump:#}"
    );
    // Over HBONE: node 1 counts them as mutual TLS, to no Service.
    let direct = [
        ("reporter", "source"),
        ("connection_security_policy", "mutual_tls"),
        ("destination_service", "unknown"),
    ];
    let tunnelled = c
        .metrics(0)
        .unwrap()
        .sum("istio_tcp_connections_opened_total", &direct);
    let before = accepted(&servers);
    for _ in 0..5 {
        let ex = app::exchange(&client.netns, w3.addr(8080), b"headless").unwrap();
        assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    }
    let after = accepted(&servers);
    assert_eq!(
        [
            after[0] - before[0],
            after[1] - before[1],
            after[2] - before[2]
        ],
        [0, 0, 5]
    );
    c.wait_metrics(0, "5 more direct connections over HBONE", |m| {
        m.sum("istio_tcp_connections_opened_total", &direct) == tunnelled + 5.0
    })
    .unwrap();

    // The endpoints are pods of Deployment web: one series for all of them.
    let metrics = c.metrics(0).unwrap();
    let series: Vec<_> = metrics
        .matching(
            "istio_tcp_connections_opened_total",
            &[("reporter", "source")],
        )
        .filter(|(_, labels, _)| {
            labels.get("destination_service_name").map(String::as_str) == Some("pick")
        })
        .collect();
    assert!(!series.is_empty(), "{}", metrics.text);
    for (_, labels, _) in &series {
        assert_eq!(labels["destination_workload"], "web", "{}", metrics.text);
        assert_eq!(labels["destination_canonical_service"], "web");
        assert_eq!(labels["destination_canonical_revision"], "latest");
    }

    // The workload of a StatefulSet's, a DaemonSet's, a Job's and a
    // CronJob's pod, and the canonical labels by precedence; the same names
    // on the source side.
    let _owned: Vec<app::EchoServer> = owned
        .iter()
        .map(|p| app::EchoServer::start(&p.netns, p.addr(8080)).unwrap())
        .collect();
    for (pod, (_, _, _, [workload, service, revision])) in owned.iter().zip(WORKLOADS) {
        let ex = app::exchange(&client.netns, pod.addr(8080), b"who").unwrap();
        assert_eq!(ex.echoed, b"who");
        let labels = [
            ("reporter", "source"),
            ("source_workload", "client"),
            ("destination_workload", workload),
            ("destination_canonical_service", service),
            ("destination_canonical_revision", revision),
            ("destination_app", service),
            ("destination_version", revision),
        ];
        c.wait_metrics(0, &format!("{labels:?}"), |m| {
            m.has("istio_tcp_connections_opened_total", &labels)
        })
        .unwrap();
    }
    let cron = &owned[3];
    app::exchange(&cron.netns, w1.addr(8080), b"from a CronJob").unwrap();
    let labels = [
        ("reporter", "destination"),
        ("source_workload", "report"),
        ("source_canonical_service", "report"),
        ("source_canonical_revision", "latest"),
        ("source_app", "report"),
        ("source_version", "latest"),
        ("destination_workload", "web"),
    ];
    c.wait_metrics(0, &format!("{labels:?}"), |m| {
        m.has("istio_tcp_connections_opened_total", &labels)
    })
    .unwrap();
}

/// Pods on node 2 by name, with their controller (kind, name) and labels,
/// and the `*_workload`, `*_canonical_service` (and `*_app`) and
/// `*_canonical_revision` (and `*_version`) telemetry reports them by.
#[allow(clippy::type_complexity)]
const WORKLOADS: [(&str, Option<(&str, &str)>, &[(&str, &str)], [&str; 3]); 6] = [
    (
        "db-0",
        Some(("StatefulSet", "db")),
        &[("app", "db"), ("version", "v2")],
        ["db", "db", "v2"],
    ),
    (
        "logs-x7k2p",
        Some(("DaemonSet", "logs")),
        &[],
        ["logs", "logs", "latest"],
    ),
    (
        "migrate-9fj2k",
        Some(("Job", "migrate")),
        &[],
        ["migrate", "migrate", "latest"],
    ),
    // A Job a CronJob made: named after the CronJob and the scheduled time.
    (
        "report-28999680-k4x8z",
        Some(("Job", "report-28999680")),
        &[],
        ["report", "report", "latest"],
    ),
    // Istio's canonical labels over app.kubernetes.io's over app/version.
    (
        "storefront",
        None,
        &[
            ("service.istio.io/canonical-name", "shop-ui"),
            ("service.istio.io/canonical-revision", "v3"),
            ("app.kubernetes.io/name", "store"),
            ("app.kubernetes.io/version", "v2"),
            ("app", "front"),
            ("version", "v1"),
        ],
        ["storefront", "shop-ui", "v3"],
    ),
    (
        "catalog",
        None,
        &[
            ("app.kubernetes.io/name", "catalog-api"),
            ("app.kubernetes.io/version", "v2"),
            ("app", "catalog"),
            ("version", "v1"),
        ],
        ["catalog", "catalog-api", "v2"],
    ),
];

/// A headless Service `headless` (`clusterIP: None`) and its EndpointSlice
/// of `pods`.
fn headless(pods: &[&Pod]) -> String {
    let endpoints: String = pods
        .iter()
        .map(|p| format!("- addresses: [\"{}\"]\n", p.ip))
        .collect();
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: headless, namespace: shop}}
spec:
  clusterIP: None
  ports: [{{name: http, port: 8080, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: headless-1, namespace: shop, labels: {{kubernetes.io/service-name: headless}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
{endpoints}"
    )
}
