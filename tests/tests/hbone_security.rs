//! The HBONE endpoint against a hostile client: a pod outside the mesh speaks HBONE
//! to an enrolled pod's port 15008 itself. The tunnel only ever reaches the pod the
//! connection was made to; malformed requests get 400; certificates from another CA
//! or trust domain are refused; the client's address is kept only when its
//! certificate proves that address's identity.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use http::{Method, Request, StatusCode};
use podlink_agent::{
    identity::{SpiffeId, ca::CertificateAuthority, tls},
    proxy::hbone,
};
use podlink_tests::{Cluster, PodSpec, app};

mod common;
use common::{attempt, credentials, greeting, hbone_connect, request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[test]
fn the_hbone_endpoint_refuses_everything_but_its_own_pod() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let attacker = c.add_pod(PodSpec::new("attacker", "legacy", 0)).unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    let neighbour = c.add_pod(PodSpec::new("neighbour", "mesh", 1)).unwrap();
    let far = c.add_pod(PodSpec::new("far", "mesh", 0)).unwrap();
    c.start_agents().unwrap();
    for pod in [&server, &neighbour, &far] {
        c.wait_captured(pod, true).unwrap();
    }
    let _echo = app::EchoServer::start(&server.netns, server.addr(9000)).unwrap();
    let _echo2 = app::EchoServer::start(&neighbour.netns, neighbour.addr(9000)).unwrap();
    let hbone_addr = server.addr(15008);
    let server_id = SpiffeId::new("cluster.local", "mesh", "server");
    // The attacker's own identity (its pod's service account) and another one.
    let own_id = SpiffeId::new("cluster.local", "legacy", "default");
    let other_id = SpiffeId::new("cluster.local", "mesh", "client");
    let node2 = c.nodes[1].ip;

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (key, roots) = credentials(&c.ca_dir, &own_id);
        let mut h2 = hbone_connect(
            &attacker.netns,
            hbone_addr,
            key,
            roots.clone(),
            server_id.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", c.agent_log(1)));

        // Control: the pod this connection was made to, with the client's address
        // kept because the certificate is the attacker pod's own identity.
        let (status, stream) = request(
            &mut h2,
            hbone::connect_request(server.addr(9000), attacker.ip.into(), None),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let mut stream = stream.unwrap();
        assert_eq!(greeting(&mut stream).await.ip(), IpAddr::V4(attacker.ip));
        stream.write_all(b"through the tunnel").await.unwrap();
        stream.shutdown().await.unwrap();
        let mut echoed = Vec::new();
        stream.read_to_end(&mut echoed).await.unwrap();
        assert_eq!(echoed, b"through the tunnel");

        // Never an open proxy.
        let refused: [(SocketAddr, &str); 6] = [
            (far.addr(9000), "another node's pod"),
            (neighbour.addr(9000), "another pod of this node"),
            (SocketAddr::from((node2, 22)), "the node itself"),
            (
                SocketAddr::from((Ipv4Addr::LOCALHOST, 15000)),
                "loopback admin port",
            ),
            (SocketAddr::from((node2, 15008)), "the node's HBONE port"),
            (
                SocketAddr::from((Ipv4Addr::new(10, 244, 2, 1), 80)),
                "the node's pod gateway",
            ),
        ];
        for (target, what) in refused {
            let (status, _) = request(
                &mut h2,
                hbone::connect_request(target, attacker.ip.into(), None),
            )
            .await;
            assert_eq!(
                status,
                StatusCode::BAD_REQUEST,
                "CONNECT to {what} ({target})"
            );
        }

        // Malformed requests.
        let mut get = Request::new(());
        *get.method_mut() = Method::GET;
        *get.uri_mut() = format!("https://{}/", server.addr(9000)).parse().unwrap();
        assert_eq!(request(&mut h2, get).await.0, StatusCode::BAD_REQUEST);
        let mut named = Request::new(());
        *named.method_mut() = Method::CONNECT;
        *named.uri_mut() = "server.mesh.svc:9000".parse().unwrap();
        assert_eq!(request(&mut h2, named).await.0, StatusCode::BAD_REQUEST);

        // Nothing listening on the destination port: 503.
        let (status, _) = request(
            &mut h2,
            hbone::connect_request(server.addr(9999), attacker.ip.into(), None),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);

        // A certificate of another identity than the attacker pod's: served, but
        // the pod sees the node's address, not the attacker's.
        let (key, roots) = credentials(&c.ca_dir, &other_id);
        let mut h2 = hbone_connect(&attacker.netns, hbone_addr, key, roots, server_id.clone())
            .await
            .unwrap();
        let (status, stream) = request(
            &mut h2,
            hbone::connect_request(server.addr(9000), attacker.ip.into(), None),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let seen = greeting(&mut stream.unwrap()).await;
        // The node's own address on the route to the pod: its ptp gateway.
        let gateway = c.nodes[1].pod_cidr.octets();
        assert_eq!(
            seen.ip(),
            IpAddr::V4(Ipv4Addr::new(gateway[0], gateway[1], gateway[2], 1)),
            "a client address without its identity was kept"
        );

        // A certificate from another CA: refused in the handshake.
        let foreign = c.dir.join("foreign-ca");
        podlink_agent::identity::ca::init(&foreign).unwrap();
        let (foreign_key, _) = credentials(&foreign, &own_id);
        let result = attempt(
            &attacker.netns,
            hbone_addr,
            foreign_key,
            roots_of(&c),
            server_id.clone(),
            server.addr(9000),
        )
        .await;
        let err = result.expect_err("a foreign CA's certificate was accepted");
        eprintln!("foreign CA refused: {err}");
        // The server refused the chain: it does not lead to the mesh's root (the
        // two development CAs share a name, so the signature check is what fails).
        c.wait_log(
            1,
            &[
                "TLS handshake refused: invalid peer certificate: BadSignature",
                "TLS handshake refused: invalid peer certificate: UnknownIssuer",
            ],
        )
        .unwrap();

        // A certificate of the right CA for another trust domain: refused.
        let (td_key, _) = credentials(
            &c.ca_dir,
            &SpiffeId::new("evil.example", "legacy", "default"),
        );
        let result = attempt(
            &attacker.netns,
            hbone_addr,
            td_key,
            roots_of(&c),
            server_id.clone(),
            server.addr(9000),
        )
        .await;
        let err = result.expect_err("another trust domain's certificate was accepted");
        eprintln!("other trust domain refused: {err}");
    });
    c.wait_log(1, &["not in trust domain cluster.local"])
        .unwrap();

    // The HBONE listener is bound to loopback: the node's address does not serve it.
    let err = app::connect(
        &attacker.netns,
        SocketAddr::from((node2, 15008)),
        Duration::from_secs(2),
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
}

fn roots_of(c: &Cluster) -> Arc<rustls::RootCertStore> {
    let ca = CertificateAuthority::load(&c.ca_dir).unwrap();
    tls::root_store(ca.roots()).unwrap()
}
