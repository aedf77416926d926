//! Agents get their workload certificates from an Istio CA (here the CA double of
//! `podlink_tests::ca_double`, on the underlay as istiod would be): one CSR per
//! local workload identity, impersonated, with the node agent's token and the
//! cluster ID. With a wrong token, the CA's refusal is logged naming the identity
//! and the CA, only the connections needing that identity fail (closed), and once
//! the token file is fixed (it is read on each request) they succeed.

use std::{collections::BTreeSet, fs, net::SocketAddr, time::Duration};

use podlink_tests::{Cluster, PodSpec, app, ca_double::CaDouble};

const TOKEN: &str = "node-agent-token";
const CLUSTER_ID: &str = "test-cluster";
/// How long an agent may take to retry an issuance (its backoff reaches 15 s).
const RETRY_LIMIT: Duration = Duration::from_secs(60);

fn write_atomically(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

#[test]
fn workload_certificates_come_from_the_istio_ca() {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true)]).unwrap();
    let client = c
        .add_pod(PodSpec::new("client", "mesh", 0).service_account("client"))
        .unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    let ca_ip = c.add_underlay_host(254).unwrap();
    let ca = CaDouble::start(&c.underlay, SocketAddr::from((ca_ip, 15012)), TOKEN).unwrap();
    let roots = c.dir.join("istio-roots.pem");
    fs::write(&roots, &ca.root_pem).unwrap();
    let token = c.dir.join("istio-token");
    write_atomically(&token, TOKEN);
    let roots_arg = roots.to_string_lossy().into_owned();
    let token_arg = token.to_string_lossy().into_owned();
    let args = [
        "--ca-address",
        &ca.address,
        "--ca-root-cert",
        &roots_arg,
        "--ca-token-file",
        &token_arg,
        "--cluster-id",
        CLUSTER_ID,
    ];
    c.start_agent_with(0, &args).unwrap();
    c.start_agent_with(1, &args).unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let _echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();

    let ex = app::exchange(&client.netns, server.addr(8080), b"over HBONE").unwrap_or_else(|e| {
        panic!(
            "{e}\nnode1:\n{}\nnode2:\n{}",
            c.agent_log(0),
            c.agent_log(1)
        )
    });
    assert_eq!(ex.echoed, b"over HBONE");
    assert_eq!(ex.peer_seen.ip(), client.ip);

    // One request per local identity, from that identity's node, impersonating it.
    let id = |sa: &str| format!("spiffe://cluster.local/ns/mesh/sa/{sa}");
    let requests = ca.requests();
    let seen: BTreeSet<(String, std::net::IpAddr)> = requests
        .iter()
        .map(|r| (r.impersonated.clone().unwrap_or_default(), r.peer.ip()))
        .collect();
    let want: BTreeSet<_> = [
        (id("client"), c.nodes[0].ip.into()),
        (id("server"), c.nodes[1].ip.into()),
    ]
    .into();
    assert_eq!(seen, want, "{requests:#?}");
    assert_eq!(requests.len(), 2, "{requests:#?}");
    for r in &requests {
        assert_eq!(r.refused, None, "{r:?}");
        assert_eq!(r.token.as_deref(), Some(TOKEN), "{r:?}");
        assert_eq!(r.cluster_id.as_deref(), Some(CLUSTER_ID), "{r:?}");
        assert_eq!(r.csr_uris, [r.impersonated.clone().unwrap()], "{r:?}");
        // The agent's default --cert-lifetime, 24 h, in seconds.
        assert_eq!(r.validity_secs, 24 * 3600, "{r:?}");
    }

    // A wrong token: new workloads get no certificate.
    write_atomically(&token, "a-wrong-token");
    let client2 = c
        .add_pod(PodSpec::new("client2", "mesh", 0).service_account("client2"))
        .unwrap();
    let server2 = c
        .add_pod(PodSpec::new("server2", "mesh", 1).service_account("server2"))
        .unwrap();
    c.wait_all_captured(&[&client2, &server2]).unwrap();
    let _echo2 = app::EchoServer::start(&server2.netns, server2.addr(8080)).unwrap();
    for (node, sa) in [(0, "client2"), (1, "server2")] {
        c.wait_log_lines(
            node,
            &[id(sa).as_str(), ca.address.as_str(), "Unauthenticated"],
            1,
            RETRY_LIMIT,
        )
        .unwrap();
    }
    let refused = app::exchange(&client2.netns, server2.addr(8080), b"no certificate");
    assert!(refused.is_err(), "{refused:?}");
    // Connections of identities that have their certificates are not affected.
    let ex = app::exchange(&client.netns, server.addr(8080), b"still fine").unwrap();
    assert_eq!(ex.echoed, b"still fine");
    let wrong: Vec<_> = ca
        .requests()
        .into_iter()
        .filter(|r| r.token.as_deref() == Some("a-wrong-token"))
        .collect();
    assert!(!wrong.is_empty());
    assert!(
        wrong
            .iter()
            .all(|r| r.refused.as_ref().is_some_and(|(code, _)| *code == 16)),
        "{wrong:#?}"
    );

    // The token fixed: the agents' next attempts succeed.
    write_atomically(&token, TOKEN);
    for (node, sa) in [(0, "client2"), (1, "server2")] {
        c.wait_log_lines(
            node,
            &["issued the workload certificate of", id(sa).as_str()],
            1,
            RETRY_LIMIT,
        )
        .unwrap();
    }
    let ex = app::exchange(&client2.netns, server2.addr(8080), b"certified").unwrap_or_else(|e| {
        panic!(
            "{e}\nnode1:\n{}\nnode2:\n{}",
            c.agent_log(0),
            c.agent_log(1)
        )
    });
    assert_eq!(ex.echoed, b"certified");
    assert_eq!(ex.peer_seen.ip(), client2.ip);
}
