//! The HBONE inbound connection: the input is what a client sends on a
//! connection to an enrolled pod's port 15008 once TLS is done (the HTTP/2
//! client preface is put in front when the input does not start with it). The
//! proxy's h2 server, with the agent's settings, serves it through memory
//! (`proxy::serve_without_tls`): every CONNECT stream is checked (method,
//! authority, destination pod, AuthorizationPolicy) and answered as the agent
//! answers it.
//!
//! The pods' addresses are not this machine's: the target runs in a network
//! namespace of its own with no interface up (made at its start; needs root), so
//! a stream that passes every check fails to connect (503) and no packet ever
//! leaves.
#![no_main]

use std::{
    collections::HashSet,
    net::SocketAddr,
    path::Path,
    sync::{Arc, LazyLock},
    time::Duration,
};

use libfuzzer_sys::fuzz_target;
use podlink_agent::{
    authz::{DEFAULT_ROOT_NAMESPACE, PolicySet},
    identity::{CertManager, CertSource, SpiffeId, ca},
    proxy::{ProxyConfig, ProxyState, serve_without_tls},
    source::manifests,
    state::{View, WorkloadIndex},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Node n1 runs the `server` pod (dual-stack), which an ALLOW policy opens on
/// port 8080 to the `client` pod of node n2.
const CLUSTER: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: shop, labels: {app: server}}
spec: {nodeName: n1, serviceAccountName: server}
status: {podIP: 10.244.1.2, podIPs: [{ip: 10.244.1.2}, {ip: 'fd00:2::2'}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: shop}
spec: {nodeName: n2, serviceAccountName: client}
status: {podIP: 10.244.2.1, podIPs: [{ip: 10.244.2.1}, {ip: 'fd00:1::1'}]}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: server-8080, namespace: shop}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules:
  - from: [{source: {principals: [cluster.local/ns/shop/sa/client]}}]
    to: [{operation: {ports: ['8080']}}]
";

/// The client's HBONE connection: from its pod to the server pod's port 15008.
const PEER: &str = "10.244.2.1:41000";
const LOCAL: &str = "10.244.1.2:15008";

/// Turns of the runtime given to the server to read the input and spawn its
/// streams before they are waited for.
const SETTLE_YIELDS: usize = 16;

/// A connection that outlives its client's bytes by this much is a hang.
const BOUND: Duration = Duration::from_secs(10);

struct Harness {
    state: Arc<ProxyState>,
    client: SpiffeId,
}

static HARNESS: LazyLock<Harness> = LazyLock::new(|| {
    // SAFETY: unshare has no memory-safety preconditions; it moves this thread
    // (the one that runs every input, and the runtime's) to a new namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        panic!(
            "hbone_inbound runs in a network namespace of its own, so that no packet leaves: unshare(CLONE_NEWNET) failed ({}); run it as root",
            std::io::Error::last_os_error()
        );
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    ca::init(dir.path()).expect("a local CA");
    let certs = CertManager::new(
        CertSource::Local {
            dir: dir.path().to_path_buf(),
        },
        "cluster.local",
        Duration::from_secs(3600),
    )
    .expect("the local CA loads");
    // Loaded: the files are not read again.
    drop(dir);
    let state = Arc::new(ProxyState::new(
        ProxyConfig {
            listen_ip: std::net::Ipv4Addr::LOCALHOST,
            listen_ip6: None,
            outbound_port: 0,
            inbound_plaintext_port: 0,
            hbone_port: 15008,
            proxy_mark: 0,
            connect_timeout: Duration::from_secs(1),
            hbone_idle_timeout: Duration::from_secs(300),
            threads: 0,
            // Small enough for an input to reach it with its streams.
            max_connections: 64,
            cluster_id: "Kubernetes".into(),
        },
        certs,
    ));
    let objects = manifests::parse(Path::new("cluster.yaml"), CLUSTER).expect("the cluster parses");
    let workloads =
        WorkloadIndex::build("n1", "cluster.local", &objects.pods, &objects.namespaces).0;
    let (policies, _) = PolicySet::build(DEFAULT_ROOT_NAMESPACE, objects.policies, []);
    let captured: HashSet<_> = ["10.244.1.2", "fd00:2::2"]
        .iter()
        .map(|ip| ip.parse().expect("an address"))
        .collect();
    state.update(View {
        workloads: Arc::new(workloads),
        captured: Arc::new(captured),
        policies: Arc::new(policies),
        ..View::default()
    });
    Harness {
        state,
        client: SpiffeId::new("cluster.local", "shop", "client"),
    }
});

fuzz_target!(|data: &[u8]| {
    let harness = &*HARNESS;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (mut from_server, mut to_server) = tokio::io::split(client);
        let peer: SocketAddr = PEER.parse().unwrap();
        let local: SocketAddr = LOCAL.parse().unwrap();
        let serve = serve_without_tls(
            harness.state.clone(),
            server,
            harness.client.clone(),
            peer,
            local,
        );
        // The server may stop reading at any point: write errors are its answer.
        // As a client waits for its answers, the connection stays open until
        // the server has read everything and its streams have run to their end.
        let send = async move {
            if !data.starts_with(PREFACE) {
                let _ = to_server.write_all(PREFACE).await;
            }
            let _ = to_server.write_all(data).await;
            for _ in 0..SETTLE_YIELDS {
                tokio::task::yield_now().await;
            }
            let tasks = tokio::runtime::Handle::current().metrics();
            while tasks.num_alive_tasks() > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let _ = to_server.shutdown().await;
        };
        // Everything the server answers is read (a full pipe would stall it).
        let receive = async move {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = from_server.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        };
        tokio::time::timeout(BOUND, async {
            let _ = tokio::join!(serve, send, receive);
        })
        .await
        .expect("the HBONE connection outlived its client's bytes");
    });
});
