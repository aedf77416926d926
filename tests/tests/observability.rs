//! Operations endpoints with real traffic: Istio's TCP metrics with Istio's labels
//! and byte counts matching what was sent, podlink's own metrics, readiness, one
//! access log line per connection, the log level changed at run time through the
//! admin endpoint's `/logging`, and `--log-format json`.

use std::net::SocketAddr;

use podlink_tests::{Cluster, Metrics, Pod, PodSpec, app};

const OPENED: &str = "istio_tcp_connections_opened_total";
const CLOSED: &str = "istio_tcp_connections_closed_total";
const SENT: &str = "istio_tcp_sent_bytes_total";
const RECEIVED: &str = "istio_tcp_received_bytes_total";

const DENY_PORT_9000: &str = "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-9000, namespace: mesh}
spec:
  action: DENY
  rules:
  - to: [{operation: {ports: [\"9000\"]}}]
";

fn spiffe(pod: &Pod) -> String {
    format!(
        "spiffe://cluster.local/ns/{}/sa/{}",
        pod.namespace, pod.service_account
    )
}

/// Exchanges `payload` with the echo server at `dst`; returns the bytes the
/// client sent and the bytes it received (greeting and echo).
fn exchange(from: &Pod, dst: SocketAddr, payload: &[u8]) -> (u64, u64) {
    let ex = app::exchange(&from.netns, dst, payload)
        .unwrap_or_else(|e| panic!("{} -> {dst}: {e}", from.name));
    assert_eq!(ex.echoed, payload);
    let greeting = format!("peer={}\n", ex.peer_seen);
    (
        payload.len() as u64,
        (greeting.len() + payload.len()) as u64,
    )
}

/// The `(name, value)` label pairs of one connection's series.
fn series<'a>(
    reporter: &'a str,
    source: &'a str,
    destination: &'a str,
    security: &'a str,
) -> Vec<(&'a str, &'a str)> {
    vec![
        ("reporter", reporter),
        ("source_workload", source),
        ("destination_workload", destination),
        ("connection_security_policy", security),
    ]
}

/// Waits until the node's metrics count `count` closed connections of the series,
/// then checks opened, closed and bytes each way.
fn check_connection(
    c: &Cluster,
    node: usize,
    labels: &[(&str, &str)],
    count: f64,
    (received, sent): (u64, u64),
) -> Metrics {
    let m = c
        .wait_metrics(node, &format!("{count} closed {labels:?}"), |m| {
            m.sum(CLOSED, labels) >= count
        })
        .unwrap();
    assert_eq!(m.sum(OPENED, labels), count, "{labels:?}\n{}", m.text);
    assert_eq!(m.sum(CLOSED, labels), count, "{labels:?}\n{}", m.text);
    assert_eq!(
        m.sum(RECEIVED, labels),
        received as f64,
        "{labels:?}\n{}",
        m.text
    );
    assert_eq!(m.sum(SENT, labels), sent as f64, "{labels:?}\n{}", m.text);
    m
}

#[test]
fn metrics_readiness_and_access_log_follow_real_traffic() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c
        .add_pod(
            PodSpec::new("client", "mesh", 0)
                .service_account("client")
                .label("app", "shop"),
        )
        .unwrap();
    let neighbour = c
        .add_pod(PodSpec::new("neighbour", "mesh", 0).service_account("neighbour"))
        .unwrap();
    let server = c
        .add_pod(
            PodSpec::new("server", "mesh", 1)
                .service_account("server")
                .label("app", "web")
                .label("version", "v1"),
        )
        .unwrap();
    let outsider = c.add_pod(PodSpec::new("outsider", "legacy", 0)).unwrap();
    c.write_manifest("policy-deny-9000.yaml", DENY_PORT_9000)
        .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &neighbour, &server])
        .unwrap();
    for node in 0..2 {
        assert_eq!(c.readiness(node).unwrap(), 200, "node {}", node + 1);
    }
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    let _echo_9000 = app::EchoServer::start(&server.netns, server.addr(9000)).unwrap();
    let _local = app::EchoServer::start(&neighbour.netns, neighbour.addr(8080)).unwrap();

    // Across nodes, over HBONE: reported by the source (node 1) and the
    // destination (node 2), with both principals.
    let mut cross = (0, 0);
    for payload in [&b"first"[..], &[7u8; 100_000][..]] {
        let (rx, tx) = exchange(&client, server.addr(8080), payload);
        cross = (cross.0 + rx, cross.1 + tx);
    }
    let outbound = series("source", "client", "server", "mutual_tls");
    let m1 = check_connection(&c, 0, &outbound, 2.0, cross);
    let inbound = series("destination", "client", "server", "mutual_tls");
    let m2 = check_connection(&c, 1, &inbound, 2.0, cross);
    for m in [&m1, &m2] {
        let principals = [
            ("source_principal", spiffe(&client)),
            ("destination_principal", spiffe(&server)),
            ("source_workload_namespace", "mesh".into()),
            ("destination_workload_namespace", "mesh".into()),
            ("source_canonical_service", "shop".into()),
            ("destination_canonical_service", "web".into()),
            ("destination_canonical_revision", "v1".into()),
            ("destination_app", "web".into()),
            ("destination_version", "v1".into()),
            ("source_cluster", "Kubernetes".into()),
            ("request_protocol", "tcp".into()),
        ];
        let principals: Vec<(&str, &str)> =
            principals.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert!(m.has(OPENED, &principals), "{principals:?}\n{}", m.text);
    }

    // Between two pods of node 1: no inbound hop, so node 1 reports both sides.
    let local = exchange(&client, neighbour.addr(8080), b"next door");
    for reporter in ["source", "destination"] {
        check_connection(
            &c,
            0,
            &series(reporter, "client", "neighbour", "none"),
            1.0,
            local,
        );
    }

    // From outside the mesh, in plain text: the source is a known pod without an
    // identity.
    let plain = exchange(&outsider, server.addr(8080), b"plain");
    let m2 = check_connection(
        &c,
        1,
        &series("destination", "outsider", "server", "none"),
        1.0,
        plain,
    );
    assert!(m2.has(
        OPENED,
        &[
            ("source_workload", "outsider"),
            ("source_principal", "unknown"),
            ("source_workload_namespace", "legacy"),
        ]
    ));

    // A denied stream: counted by the policy that denied it, logged as denied.
    assert!(app::exchange(&client.netns, server.addr(9000), b"no").is_err());
    let m2 = c
        .wait_metrics(1, "the denial", |m| {
            m.sum(
                "podlink_authorization_denials_total",
                &[("policy", "mesh/deny-9000")],
            ) >= 1.0
        })
        .unwrap();
    assert_eq!(
        m2.sum(
            "podlink_authorization_denials_total",
            &[("policy", "mesh/deny-9000")]
        ),
        1.0
    );

    // podlink's own metrics.
    let m1 = c.metrics(0).unwrap();
    assert_eq!(m1.sum("podlink_enrolled_pods", &[]), 2.0, "{}", m1.text);
    assert_eq!(m2.sum("podlink_enrolled_pods", &[]), 1.0, "{}", m2.text);
    assert_eq!(
        m1.sum("podlink_bpf_map_entries", &[("map", "pods")]),
        2.0,
        "{}",
        m1.text
    );
    assert!(m1.sum("podlink_bpf_map_entries", &[("map", "captured_flows")]) >= 1.0);
    assert_eq!(
        m1.sum(
            "podlink_captured_connections_total",
            &[("workload", "client"), ("listener", "outbound")]
        ),
        c.counters(&client).unwrap()["captured_outbound"] as f64,
        "{}",
        m1.text
    );
    assert!(m1.has(
        "podlink_redirect_drops_total",
        &[("workload", "client"), ("reason", "no_listener")]
    ));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as f64;
    let expiry = m1.sum(
        "podlink_certificate_expiry_seconds",
        &[("identity", &spiffe(&client))],
    );
    assert!(
        expiry > now && expiry <= now + 25.0 * 3600.0,
        "{expiry}\n{}",
        m1.text
    );
    assert!(m1.has(
        "podlink_connection_failures_total",
        &[("direction", "outbound"), ("kind", "connect_timeout")]
    ));

    // One access log line per connection, with both ends and the bytes.
    let log1 = c.agent_log(0);
    let hbone_lines: Vec<&str> = log1
        .lines()
        .filter(|l| l.contains("access: connection complete") && l.contains("route=hbone"))
        .collect();
    assert_eq!(hbone_lines.len(), 3, "{log1}"); // two exchanges and the denied one
    let line = hbone_lines
        .iter()
        .find(|l| l.contains(&format!("bytes_recv={}", 100_000)))
        .unwrap_or_else(|| panic!("{log1}"));
    for field in [
        format!("src.addr={}:", client.ip),
        "src.workload=\"client\"".into(),
        "src.namespace=\"mesh\"".into(),
        format!("src.identity=\"{}\"", spiffe(&client)),
        format!("dst.addr={}", server.addr(8080)),
        "dst.workload=\"server\"".into(),
        format!("dst.identity=\"{}\"", spiffe(&server)),
        "result=ok".into(),
        "duration_ms=".into(),
        "bytes_sent=".into(),
    ] {
        assert!(line.contains(&field), "{field} missing from {line}");
    }
    let log2 = c.agent_log(1);
    assert!(
        log2.lines()
            .any(|l| l.contains("access: connection complete")
                && l.contains("route=inbound_hbone")
                && l.contains("result=denied")
                && l.contains("policy=\"mesh/deny-9000\"")),
        "{log2}"
    );
    assert!(
        log2.lines()
            .any(|l| l.contains("access: connection complete")
                && l.contains("route=inbound_plaintext")
                && l.contains("src.workload=\"outsider\"")
                && l.contains(&format!("bytes_recv={}", plain.0))),
        "{log2}"
    );
}

/// Access lines counted on node 1.
fn access_lines(c: &Cluster) -> usize {
    c.agent_log(0)
        .lines()
        .filter(|l| l.contains("connection complete"))
        .count()
}

#[test]
fn logging_changes_the_level_at_run_time_and_refuses_garbage() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    let closed = |c: &Cluster, n: f64| {
        c.wait_metrics(0, &format!("{n} closed connections"), |m| {
            m.sum(CLOSED, &[("reporter", "source")]) >= n
        })
        .unwrap();
    };

    let (status, body) = c.admin_get(0, "/logging").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("podlink_agent=debug"), "{body}");

    exchange(&client, server.addr(8080), b"logged");
    closed(&c, 1.0);
    assert_eq!(access_lines(&c), 1);

    // Up to warnings only: the access line (INFO) of the next connection is not
    // written.
    let (status, body) = c.admin_post(0, "/logging?level=warn").unwrap();
    assert_eq!((status, body.trim()), (200, "warn"));
    exchange(&client, server.addr(8080), b"quiet");
    closed(&c, 2.0);
    assert_eq!(access_lines(&c), 1, "{}", c.agent_log(0));

    // Garbage is refused with the reason; the level stays.
    for bad in [
        "/logging?level=loud",
        "/logging?level=podlink_agent%3Dshouting",
        "/logging",
    ] {
        let (status, body) = c.admin_post(0, bad).unwrap();
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(!body.trim().is_empty());
    }
    let (_, body) = c.admin_post(0, "/logging?level=loud").unwrap();
    assert!(body.contains("loud"), "{body}");
    assert_eq!(c.admin_get(0, "/logging").unwrap().1.trim(), "warn");
    exchange(&client, server.addr(8080), b"still quiet");
    closed(&c, 3.0);
    assert_eq!(access_lines(&c), 1, "{}", c.agent_log(0));

    // A target directive (percent-encoded): debug lines of the proxy only.
    let (status, body) = c
        .admin_post(
            0,
            "/logging?level=warn%2Caccess%3Dinfo%2Cpodlink_agent%3A%3Aproxy%3Ddebug",
        )
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("podlink_agent::proxy=debug"), "{body}");
    exchange(&client, server.addr(8080), b"loud again");
    closed(&c, 4.0);
    assert_eq!(access_lines(&c), 2, "{}", c.agent_log(0));
    // The agent keeps serving.
    assert_eq!(c.config_dump(0).unwrap()["node"], "node1");
}

#[test]
fn json_log_format_writes_one_json_object_per_line() {
    let mut c = Cluster::with_namespaces(1, &[("mesh", true)]).unwrap();
    let client = c.add_pod(PodSpec::new("client", "mesh", 0)).unwrap();
    let server = c.add_pod(PodSpec::new("server", "mesh", 0)).unwrap();
    c.start_agent_with(0, &["--log-format", "json"]).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    let (rx, tx) = exchange(&client, server.addr(8080), b"as json");
    let log = c.wait_log(0, &["connection complete"]).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "agent running")
    );
    let access = lines
        .iter()
        .find(|l| l["target"] == "access")
        .unwrap_or_else(|| panic!("{log}"));
    let fields = &access["fields"];
    assert_eq!(access["level"], "INFO");
    assert_eq!(fields["message"], "connection complete");
    assert_eq!(fields["src.workload"], "client");
    assert_eq!(fields["dst.workload"], "server");
    assert_eq!(
        fields["src.identity"],
        "spiffe://cluster.local/ns/mesh/sa/default"
    );
    assert_eq!(fields["result"], "ok");
    assert_eq!(fields["bytes_recv"], rx);
    assert_eq!(fields["bytes_sent"], tx);
    assert_eq!(fields["route"], "local");
}
