//! Agents fed by istiod (here the delta ADS double of
//! `podlink_tests::xds_double` and the CA double, on the underlay as istiod
//! would be), this node's pods from the Kubernetes API double: the workloads,
//! services and policies istiod pushes are captured, resolved, tunnelled and
//! enforced; a policy removed stops being enforced; a workload istiod no
//! longer lists stops being captured. A service istiod gives a waypoint (the
//! waypoint double of `podlink_tests::waypoint_double` on the underlay) has
//! its connections sent through it; one whose waypoint istiod does not know
//! has them refused.

use std::{
    collections::HashMap,
    fs,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use podlink_agent::identity::{SpiffeId, ca::CertificateAuthority, tls};
use podlink_agent::xds::proto::{
    self,
    security::{Action, Authorization, Clause, Match, Rule, Scope, ServiceAccountMatch},
    workload::{
        Address, GatewayAddress, NetworkAddress, Port, PortList, Service, TunnelProtocol, Workload,
        address, gateway_address,
    },
};
use podlink_tests::{
    Cluster, Pod, PodSpec, Source, app,
    ca_double::CaDouble,
    netns::ip,
    waypoint_double::{Route, WaypointDouble},
    xds_double::{XdsDouble, istiod_agent_args},
};

const TOKEN: &str = "node-agent-token";
const CLUSTER_ID: &str = "test-cluster";
/// How long a push may take to be applied (generous: the machine is shared).
const LIMIT: Duration = Duration::from_secs(30);
/// The service only istiod knows (no Service object in the API double).
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);

fn workload(pod: &Pod, node: &str, services: &[(&str, u32, u32)]) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: format!("{CLUSTER_ID}//Pod/{}/{}", pod.namespace, pod.name),
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            addresses: vec![pod.ip.octets().to_vec()],
            tunnel_protocol: TunnelProtocol::Hbone as i32,
            service_account: pod.service_account.clone(),
            node: node.to_string(),
            canonical_name: pod.name.clone(),
            services: services
                .iter()
                .map(|(host, port, target)| {
                    (
                        (*host).to_string(),
                        PortList {
                            ports: vec![Port {
                                service_port: *port,
                                target_port: *target,
                                app_protocol: 0,
                            }],
                        },
                    )
                })
                .collect(),
            ..Default::default()
        })),
    }
}

/// `mesh/api`, at [`VIP`] port 80, to its workloads' port 8080.
fn service() -> Address {
    service_at("api", VIP, None)
}

/// `mesh/<name>`, at `vip` port 80, to its workloads' port 8080, through
/// `waypoint` if given.
fn service_at(name: &str, vip: Ipv4Addr, waypoint: Option<GatewayAddress>) -> Address {
    Address {
        r#type: Some(address::Type::Service(Service {
            name: name.to_string(),
            namespace: "mesh".to_string(),
            hostname: format!("{name}.mesh.svc.cluster.local"),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vip.octets().to_vec(),
                length: None,
            }],
            waypoint,
            ports: vec![Port {
                service_port: 80,
                target_port: 8080,
                app_protocol: 0,
            }],
            ..Default::default()
        })),
    }
}

/// DENY to port 9090 of namespace `mesh`'s workloads.
fn deny_9090() -> Authorization {
    Authorization {
        name: "no-9090".to_string(),
        namespace: "mesh".to_string(),
        scope: Scope::Namespace as i32,
        action: Action::Deny as i32,
        rules: vec![Rule {
            clauses: vec![Clause {
                matches: vec![Match {
                    destination_ports: vec![9090],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    }
}

/// Starts both nodes' agents with istiod (`xds`) as their source and `ca` as
/// their CA, trusting `ca`'s and `xds`'s roots and `extra_roots` (PEM).
fn start_agents(c: &mut Cluster, ca: &CaDouble, xds: &XdsDouble, extra_roots: &str) {
    for n in 0..2 {
        let args = istiod_agent_args(c, n, ca, xds, TOKEN, CLUSTER_ID, extra_roots).unwrap();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        c.start_agent_with(n, &args).unwrap();
    }
}

fn wait_until(what: &str, c: &Cluster, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what} within {LIMIT:?}\n{}",
            c.agent_logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn istiods_workloads_services_and_policies_are_captured_resolved_and_enforced() {
    let mut c = Cluster::with_namespaces_from(2, &[("mesh", true)], Source::Kubernetes).unwrap();
    let client = c
        .add_pod(PodSpec::new("client", "mesh", 0).service_account("client"))
        .unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    let ca_ip = c.add_underlay_host(254).unwrap();
    let ca = CaDouble::start(&c.underlay, SocketAddr::from((ca_ip, 15012)), TOKEN).unwrap();
    let xds_ip = c.add_underlay_host(253).unwrap();
    let xds =
        XdsDouble::start(Some(&c.underlay), SocketAddr::from((xds_ip, 15012)), TOKEN).unwrap();
    let (n1, n2) = (c.nodes[0].name.clone(), c.nodes[1].name.clone());
    xds.set_address("client", &workload(&client, &n1, &[]));
    xds.set_address(
        "server",
        &workload(
            &server,
            &n2,
            &[("mesh/api.mesh.svc.cluster.local", 80, 8080)],
        ),
    );
    xds.set_address("api", &service());
    xds.set_authorization("no-9090", &deny_9090());
    start_agents(&mut c, &ca, &xds, "");
    c.wait_all_captured(&[&client, &server]).unwrap();
    wait_until("both agents ready", &c, || {
        (0..2).all(|n| c.readiness(n).ok() == Some(200))
    });
    for n in 0..2 {
        let m = c.metrics(n).unwrap();
        assert_eq!(m.sum("podlink_xds_connected", &[]), 1.0);
    }

    // A pod istiod lists, over HBONE, the client's address kept.
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    let _echo9090 = app::EchoServer::start(&server.netns, server.addr(9090)).unwrap();
    let ex = app::exchange(&client.netns, server.addr(8080), b"to the pod")
        .unwrap_or_else(|e| panic!("{e}\n{}", c.agent_logs()));
    assert_eq!(ex.echoed, b"to the pod");
    assert_eq!(ex.peer_seen.ip(), IpAddr::from(client.ip));
    // A service only istiod knows: resolved to its workload's target port.
    let ex = app::exchange(
        &client.netns,
        SocketAddr::from((VIP, 80)),
        b"to the service",
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", c.agent_logs()));
    assert_eq!(ex.echoed, b"to the service");
    assert_eq!(ex.peer_seen.ip(), IpAddr::from(client.ip));
    // istiod's DENY on port 9090, enforced by the server's agent.
    assert!(
        app::exchange(&client.netns, server.addr(9090), b"denied").is_err(),
        "port 9090 is denied by istiod's policy"
    );
    assert!(
        c.agent_log(1).contains("mesh/no-9090"),
        "{}",
        c.agent_log(1)
    );

    // The policy removed: allowed.
    xds.remove(proto::AUTHORIZATION_TYPE_URL, "no-9090");
    xds.push();
    wait_until("port 9090 allowed once the policy is removed", &c, || {
        app::exchange(&client.netns, server.addr(9090), b"allowed").is_ok()
    });

    // The server no longer listed by istiod: its node stops capturing it.
    xds.remove(proto::ADDRESS_TYPE_URL, "server");
    xds.push();
    wait_until("the server no longer captured", &c, || {
        let shown = c.inspect(1).unwrap();
        !shown.to_string().contains(&server.ip.to_string())
    });
}

/// The waypoint double's address on the underlay.
const WAYPOINT_HOST: u8 = 252;
/// A service whose waypoint istiod does not know.
const GHOST_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 78);
/// The address that waypoint is named by: no workload has it.
const GHOST_WAYPOINT: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 99);

/// A waypoint named by its address, on HBONE port 15008.
fn waypoint_at(ip: Ipv4Addr) -> GatewayAddress {
    GatewayAddress {
        destination: Some(gateway_address::Destination::Address(NetworkAddress {
            network: String::new(),
            address: ip.octets().to_vec(),
            length: None,
        })),
        hbone_mtls_port: 15008,
    }
}

/// The waypoint's workload `mesh/waypoint` (service account `waypoint`) at
/// `ip`, on no node of the cluster.
fn waypoint_workload(ip: Ipv4Addr) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: format!("{CLUSTER_ID}//Pod/mesh/waypoint"),
            name: "waypoint".to_string(),
            namespace: "mesh".to_string(),
            addresses: vec![ip.octets().to_vec()],
            tunnel_protocol: TunnelProtocol::Hbone as i32,
            service_account: "waypoint".to_string(),
            canonical_name: "waypoint".to_string(),
            ..Default::default()
        })),
    }
}

#[test]
fn a_waypoint_named_for_a_service_receives_its_connections() {
    let mut c = Cluster::with_namespaces_from(2, &[("mesh", true)], Source::Kubernetes).unwrap();
    let client = c
        .add_pod(PodSpec::new("client", "mesh", 0).service_account("client"))
        .unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    let ca_ip = c.add_underlay_host(254).unwrap();
    let ca = CaDouble::start(&c.underlay, SocketAddr::from((ca_ip, 15012)), TOKEN).unwrap();
    let xds_ip = c.add_underlay_host(253).unwrap();
    let xds =
        XdsDouble::start(Some(&c.underlay), SocketAddr::from((xds_ip, 15012)), TOKEN).unwrap();

    // The waypoint double on the underlay, which reaches the pods through
    // their nodes. Its certificate comes from the test bed's own CA, whose
    // root the agents are given; it trusts the CA double that issues the
    // pods' certificates.
    let waypoint_ip = c.add_underlay_host(WAYPOINT_HOST).unwrap();
    for node in &c.nodes {
        let (cidr, via) = (format!("{}/24", node.pod_cidr), node.ip.to_string());
        ip(&["-n", &c.underlay, "route", "add", &cidr, "via", &via]).unwrap();
    }
    let id = |sa: &str| SpiffeId::new("cluster.local", "mesh", sa);
    let bed_ca = CertificateAuthority::load(&c.ca_dir).unwrap();
    let cert = bed_ca
        .issue(&id("waypoint"), Duration::from_secs(3600))
        .unwrap();
    let key = tls::provider()
        .key_provider
        .load_private_key(cert.key)
        .unwrap();
    let key = Arc::new(rustls::sign::CertifiedKey::new(cert.chain, key));
    let pod_roots = podlink_agent::identity::ca::parse_ca_bundle(
        std::path::Path::new("CA double"),
        ca.root_pem.as_bytes(),
    )
    .unwrap();
    let routes = HashMap::from([(
        SocketAddr::from((VIP, 80)),
        Route {
            endpoint: server.addr(8080),
            identity: id("server"),
        },
    )]);
    let waypoint = WaypointDouble::start(
        &c.underlay,
        SocketAddr::from((waypoint_ip, 15008)),
        key,
        tls::root_store(&pod_roots).unwrap(),
        "cluster.local",
        routes,
    )
    .unwrap();

    let (n1, n2) = (c.nodes[0].name.clone(), c.nodes[1].name.clone());
    xds.set_address("client", &workload(&client, &n1, &[]));
    xds.set_address(
        "server",
        &workload(
            &server,
            &n2,
            &[
                ("mesh/api.mesh.svc.cluster.local", 80, 8080),
                ("mesh/ghost.mesh.svc.cluster.local", 80, 8080),
            ],
        ),
    );
    xds.set_address("waypoint", &waypoint_workload(waypoint_ip));
    xds.set_address(
        "api",
        &service_at("api", VIP, Some(waypoint_at(waypoint_ip))),
    );
    xds.set_address(
        "ghost",
        &service_at("ghost", GHOST_VIP, Some(waypoint_at(GHOST_WAYPOINT))),
    );
    let bed_root = fs::read_to_string(c.ca_dir.join("ca.crt")).unwrap();
    start_agents(&mut c, &ca, &xds, &bed_root);
    c.wait_all_captured(&[&client, &server]).unwrap();
    wait_until("both agents ready", &c, || {
        (0..2).all(|n| c.readiness(n).ok() == Some(200))
    });

    // To the service: through the waypoint, which gets the original
    // destination from the client's agent under the client's identity, and
    // whose forwarded CONNECT the server's agent accepts from it.
    let echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    let ex = app::exchange(
        &client.netns,
        SocketAddr::from((VIP, 80)),
        b"through the waypoint",
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", c.agent_logs()));
    assert_eq!(ex.echoed, b"through the waypoint");
    assert_eq!(
        ex.peer_seen.ip(),
        IpAddr::from(waypoint_ip),
        "the server sees the waypoint's address"
    );
    let connects = waypoint.connects();
    assert_eq!(connects.len(), 1, "{connects:?}");
    let connect = &connects[0];
    assert_eq!(connect.authority, format!("{VIP}:80"));
    assert_eq!(connect.client, id("client").to_string());
    assert_eq!(connect.peer.ip(), IpAddr::from(client.ip));
    assert_eq!(connect.forwarded, Some(200), "{}", c.agent_log(1));
    let inbound = c
        .wait_log(1, &["route=inbound_waypoint", &server.ip.to_string()])
        .unwrap_or_else(|e| panic!("{e}\n{}", c.agent_log(1)));
    assert!(
        inbound.contains("spiffe://cluster.local/ns/mesh/sa/waypoint"),
        "{inbound}"
    );
    c.wait_log(0, &["route=waypoint", &format!("{VIP}:80")])
        .unwrap_or_else(|e| panic!("{e}\n{}", c.agent_log(0)));

    // To the service whose waypoint istiod does not know: refused, logged
    // and counted, never sent around the waypoint.
    let accepted = echo.accepted();
    assert!(
        app::exchange(&client.netns, SocketAddr::from((GHOST_VIP, 80)), b"ghost").is_err(),
        "a service whose waypoint is not known is refused"
    );
    let metrics = c.metrics(0).unwrap();
    assert_eq!(
        metrics.sum(
            "podlink_connection_failures_total",
            &[("direction", "outbound"), ("kind", "no_waypoint")]
        ),
        1.0,
        "{}",
        metrics.text
    );
    let log = c.agent_log(0);
    assert!(
        log.contains(&format!(
            "its waypoint {GHOST_WAYPOINT}:15008 cannot be reached"
        )),
        "{log}"
    );
    assert_eq!(echo.accepted(), accepted, "not sent around the waypoint");
    assert_eq!(waypoint.connects().len(), 1);

    // The server's policies see the waypoint's identity, as ztunnel's do: a
    // DENY of the waypoint's service account refuses its forwarded CONNECT.
    xds.set_authorization("no-waypoint", &deny_from("waypoint"));
    xds.push();
    // A connection the server had answered 200 as the DENY arrived may fail
    // too (open connections are checked again): the refused CONNECT is waited for.
    wait_until(
        "the waypoint's CONNECT denied by the server's agent",
        &c,
        || {
            app::exchange(&client.netns, SocketAddr::from((VIP, 80)), b"denied").is_err()
                && waypoint
                    .connects()
                    .last()
                    .is_some_and(|connect| connect.forwarded == Some(401))
        },
    );
    assert!(
        c.agent_log(1).contains("mesh/no-waypoint"),
        "{}",
        c.agent_log(1)
    );
}

/// DENY from service account `sa` of namespace `mesh`, for the workloads of
/// namespace `mesh`.
fn deny_from(sa: &str) -> Authorization {
    Authorization {
        name: "no-waypoint".to_string(),
        namespace: "mesh".to_string(),
        scope: Scope::Namespace as i32,
        action: Action::Deny as i32,
        rules: vec![Rule {
            clauses: vec![Clause {
                matches: vec![Match {
                    service_accounts: vec![ServiceAccountMatch {
                        namespace: "mesh".to_string(),
                        service_account: sa.to_string(),
                    }],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    }
}
