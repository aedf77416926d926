//! The workload xDS client (`podlink_agent::xds`) against the delta ADS double
//! (`podlink_tests::xds_double`), in process (no root needed): subscription and
//! readiness, updates and removals, NACKs naming refused resources, reconnecting
//! with `initial_resource_versions`, a refused token, and the node identity istiod
//! reads.

use std::{
    collections::HashMap,
    fs,
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use podlink_agent::xds::{
    Backoff, ConnectionState, Handler, NodeIdentity, Refused, ResourceType, XdsClient, XdsConfig,
    XdsMetrics,
    proto::{
        self,
        security::{Action, Authorization, Scope},
        workload::{Address, NetworkAddress, Service, Workload, address},
    },
};
use podlink_tests::xds_double::{XdsDouble, XdsRequest};

const TOKEN: &str = "node-agent-token";
const CLUSTER_ID: &str = "test-cluster";
/// How long anything may take to happen (generous: the machine is shared).
const LIMIT: Duration = Duration::from_secs(30);

/// What the recording handler was handed and holds.
#[derive(Default)]
struct Record {
    addresses: HashMap<String, Address>,
    authorizations: HashMap<String, Authorization>,
    /// Each `addresses` call: updated names, removed names.
    address_calls: Vec<(Vec<String>, Vec<String>)>,
    states: Vec<ConnectionState>,
    /// Names to refuse.
    refuse: Vec<String>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Record>>);

impl Handler for Recorder {
    fn addresses(&mut self, updated: Vec<(String, Address)>, removed: Vec<String>) -> Vec<Refused> {
        let mut r = self.0.lock().unwrap();
        r.address_calls.push((
            updated.iter().map(|(n, _)| n.clone()).collect(),
            removed.clone(),
        ));
        let mut refused = Vec::new();
        for (name, address) in updated {
            if r.refuse.contains(&name) {
                refused.push(Refused::new(name, "unknown load balancing mode"));
            } else {
                r.addresses.insert(name, address);
            }
        }
        for name in removed {
            r.addresses.remove(&name);
        }
        refused
    }

    fn authorizations(
        &mut self,
        updated: Vec<(String, Authorization)>,
        removed: Vec<String>,
    ) -> Vec<Refused> {
        let mut r = self.0.lock().unwrap();
        for (name, policy) in updated {
            r.authorizations.insert(name, policy);
        }
        for name in removed {
            r.authorizations.remove(&name);
        }
        Vec::new()
    }

    fn connection(&mut self, state: &ConnectionState) {
        self.0.lock().unwrap().states.push(state.clone());
    }
}

fn workload(uid: &str, ip: [u8; 4], sa: &str) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid.into(),
            name: uid.rsplit('/').next().unwrap().into(),
            namespace: "shop".into(),
            addresses: vec![ip.to_vec()],
            service_account: sa.into(),
            node: "node-1".into(),
            ..Default::default()
        })),
    }
}

fn service(name: &str, vip: [u8; 4]) -> Address {
    Address {
        r#type: Some(address::Type::Service(Service {
            name: name.into(),
            namespace: "shop".into(),
            hostname: format!("{name}.shop.svc.cluster.local"),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vip.to_vec(),
                length: None,
            }],
            ..Default::default()
        })),
    }
}

fn policy(name: &str) -> Authorization {
    Authorization {
        name: name.into(),
        namespace: "shop".into(),
        scope: Scope::Namespace as i32,
        action: Action::Deny as i32,
        ..Default::default()
    }
}

/// A client on its own runtime, talking to `double`.
struct Bed {
    double: XdsDouble,
    _dir: tempfile::TempDir,
    token_file: std::path::PathBuf,
    record: Recorder,
    ready: tokio::sync::watch::Receiver<bool>,
    metrics: XdsMetrics,
    rt: tokio::runtime::Runtime,
}

fn node() -> NodeIdentity {
    NodeIdentity {
        ip: "10.100.0.1".parse().unwrap(),
        pod_name: "podlink-x7k2p".into(),
        namespace: "istio-system".into(),
        node_name: "node-1".into(),
        network: "net-1".into(),
    }
}

impl Bed {
    /// A double holding two workloads, a service and a policy; the client not
    /// started yet.
    fn new(token: &str) -> Bed {
        let double = XdsDouble::start(None, SocketAddr::from(([127, 0, 0, 1], 0)), TOKEN).unwrap();
        double.set_address(
            "Kubernetes//Pod/shop/web-0",
            &workload("Kubernetes//Pod/shop/web-0", [10, 244, 1, 5], "web"),
        );
        double.set_address(
            "Kubernetes//Pod/shop/db-0",
            &workload("Kubernetes//Pod/shop/db-0", [10, 244, 1, 6], "db"),
        );
        double.set_address(
            "shop/web.shop.svc.cluster.local",
            &service("web", [10, 96, 0, 10]),
        );
        double.set_authorization("shop/deny-all", &policy("deny-all"));
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("istio-token");
        fs::write(&token_file, token).unwrap();
        let roots = dir.path().join("roots.pem");
        fs::write(&roots, &double.root_pem).unwrap();
        let config = XdsConfig {
            address: double.address.clone(),
            root_cert: roots,
            token_file: token_file.clone(),
            cluster_id: CLUSTER_ID.into(),
            node: node(),
            backoff: Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(400),
            },
        };
        let metrics = XdsMetrics::default();
        let client = XdsClient::new(config, metrics.clone()).unwrap();
        let ready = client.ready();
        let record = Recorder::default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.spawn(client.run(record.clone()));
        Bed {
            double,
            _dir: dir,
            token_file,
            record,
            ready,
            metrics,
            rt,
        }
    }

    fn wait(&self, what: &str, done: impl Fn(&Record) -> bool) {
        let deadline = Instant::now() + LIMIT;
        while !done(&self.record.0.lock().unwrap()) {
            assert!(
                Instant::now() < deadline,
                "{what}: not within {LIMIT:?}; states {:?}; requests {:#?}; responses {:#?}",
                self.record.0.lock().unwrap().states,
                self.double.requests(),
                self.double.responses()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + LIMIT;
        while !*self.ready.borrow() {
            assert!(
                Instant::now() < deadline,
                "not ready within {LIMIT:?}; states {:?}; requests {:#?}",
                self.record.0.lock().unwrap().states,
                self.double.requests()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the answer to the last response of `type_url` sent.
    fn wait_answer(&self, type_url: &str) -> XdsRequest {
        let nonce = self
            .double
            .responses()
            .iter()
            .rev()
            .find(|r| r.type_url == type_url)
            .expect("a response of the type")
            .nonce
            .clone();
        let requests = self
            .double
            .wait_requests(LIMIT, |rs| {
                rs.iter().any(|r| r.request.response_nonce == nonce)
            })
            .unwrap();
        requests
            .into_iter()
            .find(|r| r.request.response_nonce == nonce)
            .unwrap()
    }

    /// Pushes and waits for the answer to the push of `type_url`.
    fn push(&self, type_url: &str) -> XdsRequest {
        let before = self.double.responses().len();
        self.double.push();
        assert!(
            self.double.responses()[before..]
                .iter()
                .any(|r| r.type_url == type_url),
            "nothing pushed of {type_url}"
        );
        self.wait_answer(type_url)
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        // The client's task ends with its runtime.
        let rt = std::mem::replace(
            &mut self.rt,
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap(),
        );
        rt.shutdown_background();
    }
}

#[test]
fn both_types_are_pushed_acked_and_make_the_client_ready() {
    let bed = Bed::new(TOKEN);
    bed.wait_ready();
    {
        let r = bed.record.0.lock().unwrap();
        let mut names: Vec<&String> = r.addresses.keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "Kubernetes//Pod/shop/db-0",
                "Kubernetes//Pod/shop/web-0",
                "shop/web.shop.svc.cluster.local"
            ]
        );
        assert_eq!(
            r.addresses["shop/web.shop.svc.cluster.local"],
            service("web", [10, 96, 0, 10])
        );
        assert_eq!(r.authorizations["shop/deny-all"], policy("deny-all"));
        assert_eq!(
            r.states,
            [ConnectionState::Connected {
                address: bed.double.address.clone()
            }]
        );
    }
    // One subscription and one ACK per type, on one stream.
    let requests = bed.double.requests();
    for t in [proto::ADDRESS_TYPE_URL, proto::AUTHORIZATION_TYPE_URL] {
        let of_type: Vec<&XdsRequest> = requests
            .iter()
            .filter(|r| r.request.type_url == t)
            .collect();
        assert_eq!(of_type.len(), 2, "{t}: {of_type:#?}");
        assert!(!of_type[0].is_answer(), "{t}");
        assert!(of_type[1].is_ack(), "{t}");
        assert!(of_type.iter().all(|r| r.stream == 1));
    }
    assert!(bed.metrics.connected());
    assert_eq!(bed.metrics.resources(ResourceType::Address), 3);
    assert_eq!(bed.metrics.resources(ResourceType::Authorization), 1);
    assert_eq!(bed.metrics.pushes(ResourceType::Address), 1);
    assert_eq!(bed.metrics.nacks(ResourceType::Address), 0);
    assert_eq!(bed.metrics.reconnects(), 0);
}

#[test]
fn the_node_and_credentials_are_what_istiod_expects() {
    let bed = Bed::new(TOKEN);
    bed.wait_ready();
    let call = &bed.double.calls()[0];
    assert_eq!(
        call.authorization.as_deref(),
        Some("Bearer node-agent-token")
    );
    assert_eq!(call.cluster_id.as_deref(), Some(CLUSTER_ID));
    for r in bed.double.requests().iter().filter(|r| !r.is_answer()) {
        // A wildcard subscription: no names; nothing held yet.
        assert!(r.request.resource_names_subscribe.is_empty());
        assert!(r.request.resource_names_unsubscribe.is_empty());
        assert!(r.request.initial_resource_versions.is_empty());
        let node = r.request.node.as_ref().expect("the node on a subscription");
        assert_eq!(
            node.id,
            "ztunnel~10.100.0.1~podlink-x7k2p.istio-system~istio-system.svc.cluster.local"
        );
        let mut metadata: Vec<(String, String)> = node
            .metadata
            .as_ref()
            .unwrap()
            .fields
            .iter()
            .map(|(k, v)| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => (k.clone(), s.clone()),
                other => panic!("{k}: {other:?}"),
            })
            .collect();
        metadata.sort();
        let want: Vec<(String, String)> = [
            ("CLUSTER_ID", CLUSTER_ID),
            ("INSTANCE_IPS", "10.100.0.1"),
            ("NAME", "podlink-x7k2p"),
            ("NAMESPACE", "istio-system"),
            ("NETWORK", "net-1"),
            ("NODE_NAME", "node-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        assert_eq!(metadata, want);
    }
}

#[test]
fn updates_and_removals_are_applied_and_acked() {
    let bed = Bed::new(TOKEN);
    bed.wait_ready();
    let moved = workload("Kubernetes//Pod/shop/web-0", [10, 244, 1, 50], "web");
    bed.double.set_address("Kubernetes//Pod/shop/web-0", &moved);
    bed.double
        .remove(proto::ADDRESS_TYPE_URL, "Kubernetes//Pod/shop/db-0");
    let answer = bed.push(proto::ADDRESS_TYPE_URL);
    assert!(answer.is_ack(), "{answer:#?}");
    let last = bed.double.responses().last().unwrap().clone();
    assert_eq!(last.resources, ["Kubernetes//Pod/shop/web-0"]);
    assert_eq!(last.removed, ["Kubernetes//Pod/shop/db-0"]);
    {
        let r = bed.record.0.lock().unwrap();
        assert_eq!(r.addresses["Kubernetes//Pod/shop/web-0"], moved);
        assert!(!r.addresses.contains_key("Kubernetes//Pod/shop/db-0"));
        assert_eq!(
            r.address_calls.last().unwrap(),
            &(
                vec!["Kubernetes//Pod/shop/web-0".to_string()],
                vec!["Kubernetes//Pod/shop/db-0".to_string()]
            )
        );
    }
    bed.double
        .remove(proto::AUTHORIZATION_TYPE_URL, "shop/deny-all");
    assert!(bed.push(proto::AUTHORIZATION_TYPE_URL).is_ack());
    assert!(bed.record.0.lock().unwrap().authorizations.is_empty());
    assert_eq!(bed.metrics.resources(ResourceType::Address), 2);
    assert_eq!(bed.metrics.resources(ResourceType::Authorization), 0);
}

#[test]
fn refused_resources_are_nacked_by_name_and_the_others_applied() {
    let bed = Bed::new(TOKEN);
    bed.wait_ready();
    bed.record.0.lock().unwrap().refuse = vec!["shop/odd.shop.svc.cluster.local".into()];
    bed.double.set_address(
        "shop/odd.shop.svc.cluster.local",
        &service("odd", [10, 96, 0, 11]),
    );
    bed.double.set_raw(
        proto::ADDRESS_TYPE_URL,
        "Kubernetes//Pod/shop/garbled",
        vec![0x0a, 0xff, 0xff],
    );
    bed.double.set_address(
        "Kubernetes//Pod/shop/new-0",
        &workload("Kubernetes//Pod/shop/new-0", [10, 244, 1, 7], "new"),
    );
    let answer = bed.push(proto::ADDRESS_TYPE_URL);
    let message = answer
        .nack()
        .unwrap_or_else(|| panic!("a NACK: {answer:#?}"));
    assert!(
        message.contains("Kubernetes//Pod/shop/garbled: does not decode: "),
        "{message}"
    );
    assert!(
        message.contains("shop/odd.shop.svc.cluster.local: unknown load balancing mode"),
        "{message}"
    );
    assert!(!message.contains("new-0"), "{message}");
    {
        let r = bed.record.0.lock().unwrap();
        assert!(r.addresses.contains_key("Kubernetes//Pod/shop/new-0"));
        assert!(!r.addresses.contains_key("shop/odd.shop.svc.cluster.local"));
    }
    assert_eq!(bed.metrics.nacks(ResourceType::Address), 1);
    assert_eq!(bed.metrics.resources(ResourceType::Address), 4);
    // The stream goes on: the next push is ACKed.
    bed.double
        .set_authorization("shop/deny-all", &policy("deny-all"));
    assert!(bed.push(proto::AUTHORIZATION_TYPE_URL).is_ack());
}

#[test]
fn a_new_stream_sends_what_is_held_and_gets_only_changes() {
    let mut bed = Bed::new(TOKEN);
    bed.wait_ready();
    let held_before = bed.double.versions(proto::ADDRESS_TYPE_URL);
    bed.double.stop();
    bed.wait("the loss reported", |r| r.states.len() == 2);
    // While istiod is away: what was received stays; one change, one removal.
    assert_eq!(bed.record.0.lock().unwrap().addresses.len(), 3);
    assert!(*bed.ready.borrow());
    assert!(!bed.metrics.connected());
    let moved = workload("Kubernetes//Pod/shop/web-0", [10, 244, 1, 50], "web");
    bed.double.set_address("Kubernetes//Pod/shop/web-0", &moved);
    bed.double
        .remove(proto::ADDRESS_TYPE_URL, "Kubernetes//Pod/shop/db-0");
    // Let a few attempts fail before istiod returns.
    std::thread::sleep(Duration::from_millis(500));
    bed.double.restart().unwrap();
    let requests = bed
        .double
        .wait_requests(LIMIT, |rs| {
            rs.iter().filter(|r| r.stream > 1 && r.is_ack()).count() == 2
        })
        .unwrap();
    let stream = requests.iter().find(|r| r.stream > 1).unwrap().stream;
    let subscription = |t: &str| {
        requests
            .iter()
            .find(|r| r.stream == stream && !r.is_answer() && r.request.type_url == t)
            .unwrap()
            .request
            .initial_resource_versions
            .clone()
    };
    assert_eq!(subscription(proto::ADDRESS_TYPE_URL), held_before);
    assert_eq!(subscription(proto::AUTHORIZATION_TYPE_URL).len(), 1);
    // Only what changed came again.
    let responses: Vec<_> = bed
        .double
        .responses()
        .into_iter()
        .filter(|r| r.stream == stream)
        .collect();
    let addresses = responses
        .iter()
        .find(|r| r.type_url == proto::ADDRESS_TYPE_URL)
        .unwrap();
    assert_eq!(addresses.resources, ["Kubernetes//Pod/shop/web-0"]);
    assert_eq!(addresses.removed, ["Kubernetes//Pod/shop/db-0"]);
    let policies = responses
        .iter()
        .find(|r| r.type_url == proto::AUTHORIZATION_TYPE_URL)
        .unwrap();
    assert!(policies.resources.is_empty() && policies.removed.is_empty());
    bed.wait("connected again", |r| r.states.len() == 3);
    let r = bed.record.0.lock().unwrap();
    assert_eq!(r.addresses["Kubernetes//Pod/shop/web-0"], moved);
    assert!(!r.addresses.contains_key("Kubernetes//Pod/shop/db-0"));
    // Lost once, however many attempts failed.
    assert!(
        matches!(
            r.states.as_slice(),
            [
                ConnectionState::Connected { .. },
                ConnectionState::Lost { .. },
                ConnectionState::Connected { .. }
            ]
        ),
        "{:?}",
        r.states
    );
    assert_eq!(bed.metrics.reconnects(), 1);
    assert!(bed.metrics.connected());
}

#[test]
fn a_refused_token_is_retried_until_accepted() {
    let bed = Bed::new("a-stale-token");
    let refused = |bed: &Bed, n: usize| {
        let deadline = Instant::now() + LIMIT;
        while bed.double.calls().len() < n {
            assert!(Instant::now() < deadline, "{:#?}", bed.double.calls());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    refused(&bed, 3);
    assert!(
        bed.double
            .calls()
            .iter()
            .all(|c| c.refused == Some(tonic::Code::Unauthenticated))
    );
    assert!(!*bed.ready.borrow());
    // The token file is read for every stream: fixing it is enough.
    write_atomically(&bed.token_file, TOKEN);
    bed.wait_ready();
    let r = bed.record.0.lock().unwrap();
    match r.states.as_slice() {
        [
            ConnectionState::Lost { why },
            ConnectionState::Connected { .. },
        ] => {
            assert!(why.contains("Unauthenticated"), "{why}")
        }
        states => panic!("{states:?}"),
    }
    drop(r);
    // istiod restarts and refuses the token for a while (its token reviews
    // failing): retried until accepted again.
    let mut bed = bed;
    bed.double.reject_tokens(true);
    bed.double.restart().unwrap();
    let calls = bed.double.calls().len();
    refused(&bed, calls + 2);
    bed.double.reject_tokens(false);
    bed.wait("connected again", |r| r.states.len() == 4);
    let r = bed.record.0.lock().unwrap();
    assert!(
        matches!(&r.states[2], ConnectionState::Lost { .. }),
        "{:?}",
        r.states
    );
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}
