//! DNS: enrolled pods' queries to port 53 are captured in the kernel and
//! answered by the agent's DNS server; a real resolver (dnsmasq, in a pod
//! outside the mesh) answers what the agent forwards.
//!
//! * A Service name (full, or as the pod's search path makes it) and a
//!   headless Service are answered by the agent, from the address the pod
//!   asked; the resolver never sees them.
//! * Other names are forwarded to the resolver the pod asked (it sees the
//!   agent's query, not the pod's), over UDP and over TCP.
//! * A truncated answer over UDP reaches the pod with TC set; its retry over
//!   TCP is captured and answered whole.
//! * Malformed queries get FORMERR or nothing, and the server goes on.
//! * A pod annotated `ambient.istio.io/dns-capture: "false"`, and every pod
//!   under `--dns-capture=false`, asks the resolver itself.
//! * With the agent stopped, queries are dropped (fail closed) or reach the
//!   resolver (`--fail-open`).

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use hickory_proto::{
    op::{Message, ResponseCode},
    rr::{RData, RecordType},
};
use podlink_tests::{
    Cluster, Pod, PodSpec,
    dns::{Resolver, addresses, ask_tcp, ask_udp, query_bytes},
    netns,
};

const SERVICES: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {port: 80}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec:
  clusterIP: None
  ports:
  - {port: 5432}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: db-1
  namespace: shop
  labels: {kubernetes.io/service-name: db}
addressType: IPv4
endpoints:
- addresses: [\"10.244.9.1\"]
  conditions: {ready: true}
- addresses: [\"10.244.9.2\"]
- addresses: [\"10.244.9.3\"]
  conditions: {ready: false}
";

/// What the resolver answers itself.
const EXTERNAL: &str = "external.test";
const EXTERNAL_IP: &str = "192.0.2.7";
/// A TXT record too large for a UDP answer without EDNS(0) (512 bytes).
const BIG: &str = "big.test";

/// Long enough that they need a wait for an upstream (2 s) and a retry.
const WAIT: Duration = Duration::from_secs(5);
/// How long an answer that must not come is waited for.
const NO_ANSWER: Duration = Duration::from_secs(1);

/// A cluster of one node with an enrolled client, an opted-out pod in the same
/// namespace and the resolver pod outside the mesh.
fn bed(extra_agent_args: &[&str]) -> (Cluster, Pod, Pod, Resolver) {
    let mut c =
        Cluster::with_namespaces(1, &[("app", true), ("dns", false), ("shop", false)]).unwrap();
    c.write_manifest("services.yaml", SERVICES).unwrap();
    let client = c.add_pod(PodSpec::new("client", "app", 0)).unwrap();
    let optout = c
        .add_pod(
            PodSpec::new("optout", "app", 0).annotation("ambient.istio.io/dns-capture", "false"),
        )
        .unwrap();
    let resolver_pod = c.add_pod(PodSpec::new("resolver", "dns", 0)).unwrap();
    let big: Vec<String> = (0..4).map(|i| format!("{i}{}", "x".repeat(199))).collect();
    let resolver = Resolver::start(
        &resolver_pod.netns,
        IpAddr::V4(resolver_pod.ip),
        &[(EXTERNAL, EXTERNAL_IP)],
        &[(BIG, big)],
        true,
    )
    .unwrap();
    c.start_agent_with(0, extra_agent_args).unwrap();
    c.wait_all_captured(&[&client, &optout]).unwrap();
    (c, client, optout, resolver)
}

/// Asks `name` of type `qtype` over UDP from `pod` to `server`.
fn udp(
    pod: &Pod,
    server: SocketAddr,
    name: &str,
    qtype: RecordType,
    wait: Duration,
) -> Option<Message> {
    let query = query_bytes(name, qtype, false);
    udp_raw(pod, server, query, wait).map(|a| Message::from_vec(&a).expect("a DNS message"))
}

fn udp_raw(pod: &Pod, server: SocketAddr, query: Vec<u8>, wait: Duration) -> Option<Vec<u8>> {
    netns::in_netns(&pod.netns, move || Ok(ask_udp(&query, server, wait))).unwrap()
}

fn tcp(pod: &Pod, server: SocketAddr, name: &str, qtype: RecordType) -> Message {
    let query = query_bytes(name, qtype, true);
    let answer = netns::in_netns(&pod.netns, move || ask_tcp(&query, server, WAIT))
        .unwrap_or_else(|e| panic!("{name} over TCP: {e}"));
    Message::from_vec(&answer).unwrap()
}

fn ips(m: &Message) -> Vec<String> {
    let mut ips: Vec<String> = addresses(m).iter().map(ToString::to_string).collect();
    ips.sort();
    ips
}

#[test]
fn dns_names_are_answered_by_the_agent_or_forwarded() {
    podlink_tests::require_root();
    let (c, client, optout, resolver) = bed(&[]);
    let server = SocketAddr::new(resolver.addr, 53);
    let before = c.counters(&client).unwrap();

    // A Service: answered by the agent, authoritative, from the address asked.
    let m = udp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .expect("an answer for the Service");
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert!(m.metadata.authoritative, "the agent's own answer");
    assert_eq!(ips(&m), ["10.96.0.10"]);
    // The name the pod's search path makes of `web.shop`.
    let m = udp(
        &client,
        server,
        "web.shop.app.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .unwrap();
    assert_eq!(ips(&m), ["10.96.0.10"]);
    // No IPv6 address: no record, no error.
    let m = udp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::AAAA,
        WAIT,
    )
    .unwrap();
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert!(m.answers.is_empty());
    // A headless Service: its ready endpoints.
    let m = udp(
        &client,
        server,
        "db.shop.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .unwrap();
    assert_eq!(ips(&m), ["10.244.9.1", "10.244.9.2"]);
    // Over TCP too.
    let m = tcp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(ips(&m), ["10.96.0.10"]);
    assert_eq!(
        resolver.queries("web.shop.svc.cluster.local", None),
        0,
        "{}",
        resolver.log()
    );
    assert_eq!(resolver.queries("db.shop.svc.cluster.local", None), 0);

    // Another name: forwarded; the resolver sees the agent, not the pod.
    let m = udp(
        &client,
        server,
        &format!("{EXTERNAL}."),
        RecordType::A,
        WAIT,
    )
    .expect("a forwarded answer");
    assert!(!m.metadata.authoritative || ips(&m) == [EXTERNAL_IP]);
    assert_eq!(ips(&m), [EXTERNAL_IP]);
    let m = tcp(&client, server, &format!("{EXTERNAL}."), RecordType::A);
    assert_eq!(ips(&m), [EXTERNAL_IP]);
    assert!(resolver.queries(EXTERNAL, None) >= 1, "{}", resolver.log());
    assert_eq!(resolver.queries(EXTERNAL, Some(IpAddr::V4(client.ip))), 0);

    // Too large for UDP: truncated; the retry over TCP gets it whole.
    let m = udp(&client, server, &format!("{BIG}."), RecordType::TXT, WAIT).unwrap();
    assert!(m.metadata.truncation, "{m:?}");
    let m = tcp(&client, server, &format!("{BIG}."), RecordType::TXT);
    assert!(!m.metadata.truncation);
    let strings: usize = m
        .answers
        .iter()
        .map(|r| match &r.data {
            RData::TXT(txt) => txt.txt_data.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(strings, 4, "{m:?}");

    // Malformed: nothing for a datagram shorter than a header or for a
    // response; FORMERR for a question cut short; the server goes on.
    assert!(udp_raw(&client, server, vec![0x12, 0x34, 0x01], NO_ANSWER).is_none());
    let mut response = query_bytes("web.shop.svc.cluster.local.", RecordType::A, false);
    response[2] |= 0x80;
    assert!(udp_raw(&client, server, response, NO_ANSWER).is_none());
    let cut = query_bytes("web.shop.svc.cluster.local.", RecordType::A, false);
    let cut = cut[..cut.len() - 3].to_vec();
    let formerr = udp_raw(&client, server, cut, WAIT).expect("FORMERR");
    assert_eq!(formerr[3] & 0x0f, 1, "FORMERR");
    let m = udp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .unwrap();
    assert_eq!(ips(&m), ["10.96.0.10"]);

    // Counted per pod (UDP queries and TCP connections), apart from the pod's
    // other captured connections: it made none meanwhile.
    let after = c.counters(&client).unwrap();
    assert!(
        after["captured_dns"] >= before["captured_dns"] + 10,
        "{before:?} {after:?}"
    );
    assert_eq!(
        after["captured_outbound"], before["captured_outbound"],
        "{before:?} {after:?}"
    );
    let metrics = c
        .wait_metrics(0, "the DNS requests", |m| {
            m.sum(
                "istio_dns_requests_total",
                &[
                    ("source_workload_namespace", "app"),
                    ("request_protocol", "udp"),
                ],
            ) >= 8.0
                && m.sum("istio_dns_requests_total", &[("request_protocol", "tcp")]) >= 3.0
        })
        .unwrap();
    assert!(
        metrics.sum("istio_dns_upstream_requests_total", &[]) >= 2.0,
        "{}",
        metrics.text
    );
    assert!(metrics.has("istio_dns_upstream_request_duration_seconds_count", &[]));

    // The opted-out pod asks the resolver itself, Service names too.
    let m = udp(
        &optout,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .expect("the resolver's answer");
    assert!(!m.metadata.authoritative || m.answers.is_empty());
    assert!(
        addresses(&m).is_empty(),
        "the resolver does not know the Service"
    );
    assert_eq!(
        resolver.queries("web.shop.svc.cluster.local", Some(IpAddr::V4(optout.ip))),
        1,
        "{}",
        resolver.log()
    );
}

#[test]
fn dns_capture_off_and_the_agent_stopped() {
    podlink_tests::require_root();
    // Off: every pod asks the resolver itself.
    let (mut c, client, _optout, resolver) = bed(&["--dns-capture=false"]);
    let server = SocketAddr::new(resolver.addr, 53);
    let m = udp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .expect("the resolver's answer");
    assert!(addresses(&m).is_empty());
    assert_eq!(
        resolver.queries("web.shop.svc.cluster.local", Some(IpAddr::V4(client.ip))),
        1
    );

    // Captured, and the agent stopped: fail closed, the query is dropped.
    c.stop_agent(0).unwrap();
    c.start_agent(0).unwrap();
    let m = udp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
        WAIT,
    )
    .unwrap();
    assert_eq!(ips(&m), ["10.96.0.10"]);
    c.stop_agent(0).unwrap();
    assert!(
        udp(
            &client,
            server,
            &format!("{EXTERNAL}."),
            RecordType::A,
            NO_ANSWER
        )
        .is_none(),
        "fail closed: no answer while the agent is away"
    );
    assert_eq!(resolver.queries(EXTERNAL, None), 0);

    // `--fail-open`: with the agent stopped the pod reaches the resolver.
    c.start_agent_with(0, &["--fail-open"]).unwrap();
    c.stop_agent(0).unwrap();
    let m = udp(
        &client,
        server,
        &format!("{EXTERNAL}."),
        RecordType::A,
        WAIT,
    )
    .expect("fail open: the resolver answers");
    assert_eq!(ips(&m), [EXTERNAL_IP]);
    assert_eq!(resolver.queries(EXTERNAL, Some(IpAddr::V4(client.ip))), 1);
}

/// Over IPv6: the pod asks the resolver's IPv6 address; the agent answers a
/// Service's IPv6 ClusterIP from that address, and forwards another name.
#[test]
fn dns_over_ipv6() {
    podlink_tests::require_root();
    let mut c = Cluster::dual_stack(1, &[("app", true), ("dns", false), ("shop", false)]).unwrap();
    c.write_manifest(
        "services.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ports:\n  - {port: 80}\n",
    )
    .unwrap();
    let client = c.add_pod(PodSpec::new("client", "app", 0)).unwrap();
    let resolver_pod = c.add_pod(PodSpec::new("resolver", "dns", 0)).unwrap();
    let resolver = Resolver::start(
        &resolver_pod.netns,
        resolver_pod.ip_of(podlink_tests::Family::V6),
        &[(EXTERNAL, EXTERNAL_IP)],
        &[],
        true,
    )
    .unwrap();
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client]).unwrap();
    let server = SocketAddr::new(resolver.addr, 53);

    let m = udp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::AAAA,
        WAIT,
    )
    .expect("an answer over IPv6");
    assert!(m.metadata.authoritative);
    assert_eq!(ips(&m), ["fd00:96::10"]);
    let m = tcp(
        &client,
        server,
        "web.shop.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(ips(&m), ["10.96.0.10"]);
    let m = udp(
        &client,
        server,
        &format!("{EXTERNAL}."),
        RecordType::A,
        WAIT,
    )
    .expect("forwarded");
    assert_eq!(ips(&m), [EXTERNAL_IP]);
    assert_eq!(resolver.queries("web.shop.svc.cluster.local", None), 0);
    assert_eq!(
        resolver.queries(EXTERNAL, Some(client.ip_of(podlink_tests::Family::V6))),
        0
    );
    assert!(resolver.queries(EXTERNAL, None) >= 1, "{}", resolver.log());
}
