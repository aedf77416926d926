//! The Kubernetes API as a workload source: kube-rs watchers and reflector
//! stores of all pods (destination lookup and identities), this node's pods
//! (capture), the namespaces (enrollment labels), the Services and
//! EndpointSlices (outbound), the Nodes (zones, pod ranges), and Istio's
//! AuthorizationPolicies and PeerAuthentications in both `security.istio.io`
//! versions, the `v1` store read while `v1` is served ([`policies`]). Beside
//! istiod ([`Scope::Node`]) only this node's pods, the namespaces and the
//! Nodes are watched.
//!
//! The watchers list, then watch from the list's `resourceVersion`, and start
//! over with a new list when the API server answers `410 Gone` (Kubernetes API
//! concepts, "Efficient detection of changes"); the reflector stores swap in a
//! new list whole, so a relist never shows a half-listed cluster. Errors (a cut
//! connection, 401/403, 5xx) are logged with the watch that failed and retried
//! with kube-rs's default exponential backoff (0.8 s to 30 s); the stores, and
//! the data path built from them, keep their last state meanwhile.
//!
//! An Istio kind whose CRD is not installed answers `404 Not Found`: it is
//! taken as empty, logged once, and counts as listed; it is listed again every
//! [`policies::NOT_INSTALLED_RETRY`] at most, so that installing the CRDs takes
//! effect without a restart. Until every Istio kind has been listed (or found
//! not installed) the policies are unknown: enrolled pods' inbound
//! connections are denied. A policy object that cannot be compiled keeps its
//! last good version in force, or else makes the policies of its namespace
//! alone unknown ([`policies`]); it does not keep the view from being whole.
//!
//! Objects are kept in partial form ([`kinds`]): the metadata podlink reads
//! (managed fields, finalizers, owners but the controller and every annotation
//! but [`REDIRECTION_ANNOTATION`] are dropped on arrival) and podlink's own
//! `spec`/`status` types ([`crate::k8s`]), not the full ones.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::Path,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::StreamExt;
use kube::{
    Api, Client, Resource,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tokio::sync::Notify;

mod annotate;
mod kinds;
mod policies;

pub use annotate::RedirectionAnnotator;
use kinds::{
    ApiAuthorizationPolicyV1, ApiAuthorizationPolicyV1beta1, ApiEndpointSlice, ApiNamespace,
    ApiNode, ApiPeerAuthenticationV1, ApiPeerAuthenticationV1beta1, ApiPod, ApiService, Projection,
    endpoint_slice_of, meta_of, node_of, pod_of, service_of, trim,
};
use policies::{LastGood, Object, PolicyLists, Refused, Version};

use super::{CaptureReporter, Error, FIRST_LIST_WAIT, Source};
use crate::{
    authz::{MtlsPolicy, Policy},
    k8s::{EndpointSlice, Namespace, Node, Pod, Service},
    state::{Completeness, Delta, PoliciesUnknown},
    telemetry::logging::{HeldMessages, Severity},
};

/// The annotation ztunnel's node agent sets on a pod whose traffic it captures
/// (Istio ambient, `ambient.istio.io/redirection: enabled`); podlink sets it when
/// a pod's links are in place and removes it when it stops capturing the pod.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
/// The value of [`REDIRECTION_ANNOTATION`] on a captured pod.
pub const REDIRECTION_ENABLED: &str = "enabled";

/// How long a patch of [`REDIRECTION_ANNOTATION`] that has not shown up in the
/// watched pod is waited for before it is sent again.
const PATCH_RETRY: Duration = Duration::from_secs(10);

/// A resource the Kubernetes source lists and watches, as an RBAC rule names
/// it: its API group (`""` for the core group) and plural name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Watched {
    /// The API group: `""`, `discovery.k8s.io`, `security.istio.io`.
    pub group: &'static str,
    /// The plural name: `pods`, `endpointslices`, …
    pub resource: &'static str,
}

const PODS: Watched = Watched {
    group: "",
    resource: "pods",
};
const NAMESPACES: Watched = Watched {
    group: "",
    resource: "namespaces",
};
const SERVICES: Watched = Watched {
    group: "",
    resource: "services",
};
const ENDPOINT_SLICES: Watched = Watched {
    group: "discovery.k8s.io",
    resource: "endpointslices",
};
const NODES: Watched = Watched {
    group: "",
    resource: "nodes",
};
const AUTHORIZATION_POLICIES: Watched = Watched {
    group: "security.istio.io",
    resource: "authorizationpolicies",
};
const PEER_AUTHENTICATIONS: Watched = Watched {
    group: "security.istio.io",
    resource: "peerauthentications",
};

/// The kinds istiod sends as its own services and policies: beside istiod
/// ([`super::xds::IstiodSource`]) these are not read from the Kubernetes API.
pub(crate) const REPLACED_BY_ISTIOD: [Watched; 4] = [
    SERVICES,
    ENDPOINT_SLICES,
    AUTHORIZATION_POLICIES,
    PEER_AUTHENTICATIONS,
];

/// What the Kubernetes source watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Everything of [`WATCHED`]: the Kubernetes API is the only source.
    Cluster,
    /// Beside istiod ([`super::xds::IstiodSource`]): only what capture needs,
    /// this node's pods (the CNI path, the annotations), the namespaces
    /// (enrollment labels) and the Nodes; istiod sends every workload,
    /// service and policy. Neither the cluster's pods nor
    /// [`REPLACED_BY_ISTIOD`] are listed or watched.
    Node,
}

/// Every resource the Kubernetes source lists and watches (an Istio kind in
/// both its versions is one resource for RBAC). The watched types of
/// [`kinds`] take their API group and plural name from these, and
/// `deploy/base/clusterrole.yaml` grants `get`, `list` and `watch` on exactly
/// these, and `patch` on pods for [`REDIRECTION_ANNOTATION`] (unit tests hold
/// the watches, this list and the ClusterRole together).
pub const WATCHED: [Watched; 7] = [
    PODS,
    NAMESPACES,
    SERVICES,
    ENDPOINT_SLICES,
    NODES,
    AUTHORIZATION_POLICIES,
    PEER_AUTHENTICATIONS,
];

/// The resources [`Scope::Node`] lists and watches, of [`WATCHED`];
/// `deploy/istio` grants only these.
pub const WATCHED_BESIDE_ISTIOD: [Watched; 3] = [PODS, NAMESPACES, NODES];

/// kube-runtime's default backoff (0.8 s doubling to 30 s, with jitter), started
/// over only once a watch has delivered something since the last failure. The
/// watcher emits an `Init` marker before every list attempt, on which
/// `StreamBackoff` would otherwise reset it: a failing list would be retried
/// about once a second for as long as it fails, from every node. After a 404
/// of an Istio kind (`not_found`) it waits at most
/// [`policies::NOT_INSTALLED_RETRY`].
struct ProgressBackoff {
    inner: watcher::DefaultBackoff,
    progressed: Arc<AtomicBool>,
    not_found: Arc<AtomicBool>,
}

impl Iterator for ProgressBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if self.progressed.swap(false, Ordering::Relaxed) {
            kube::runtime::utils::Backoff::reset(&mut self.inner);
        }
        let not_found = self.not_found.load(Ordering::Relaxed);
        self.inner
            .next()
            .map(|delay| policies::retry_delay(delay, not_found))
    }
}

impl kube::runtime::utils::Backoff for ProgressBackoff {
    fn reset(&mut self) {}
}

/// What the watches saw change since the last delta.
#[derive(Debug, Default)]
struct Pending {
    /// Pods: a pod watch listed (again), or pods changed.
    pods: Changes,
    /// A Namespace was added, changed or deleted, or the namespaces were listed.
    namespaces: bool,
    /// Services and EndpointSlices, likewise.
    services: Changes,
    endpoint_slices: Changes,
    /// A Node changed, or the Nodes were listed (or each of the other kinds
    /// likewise): the kind is read whole.
    nodes: bool,
    policies: bool,
    mtls_policies: bool,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.pods.is_empty()
            && !self.namespaces
            && self.services.is_empty()
            && self.endpoint_slices.is_empty()
            && !self.nodes
            && !self.policies
            && !self.mtls_policies
    }
}

/// What a watch of a kind sent one by one saw since the last delta.
#[derive(Debug, Default)]
struct Changes {
    /// The watch listed (again): every object is read anew.
    listed: bool,
    /// Objects (`namespace/name`) added, changed (in what podlink reads) or
    /// deleted.
    keys: BTreeSet<String>,
}

impl Changes {
    fn record(&mut self, seen: Seen) {
        match seen {
            Seen::Listed => self.listed = true,
            Seen::Object(key) => {
                self.keys.insert(key);
            }
        }
    }

    fn is_empty(&self) -> bool {
        !self.listed && self.keys.is_empty()
    }
}

/// Every pod of this node's store (`local`) and the cluster's (`all`), one per
/// namespace/name, in that order. This node's pods come from their own watch
/// too, which may be ahead of the cluster-wide one (or working while it fails):
/// its object is preferred.
fn read_all_pods(local: &Store<ApiPod>, all: &Store<ApiPod>) -> Vec<Pod> {
    let mut pods: BTreeMap<(String, String), Pod> = BTreeMap::new();
    for pod in all.state().into_iter().chain(local.state()) {
        let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            continue;
        };
        pods.insert((ns.clone(), name.clone()), pod_of(&pod));
    }
    pods.into_values().collect()
}

/// Pod `namespace/name` as [`read_all_pods`] would give it, if either store
/// has it.
fn current_pod(local: &Store<ApiPod>, all: &Store<ApiPod>, ns: &str, name: &str) -> Option<Pod> {
    let key = ObjectRef::new(name).within(ns);
    local
        .get(&key)
        .or_else(|| all.get(&key))
        .map(|p| pod_of(&p))
}

/// What a watch saw: a (new) list, or a change of the object `namespace/name`.
enum Seen {
    Listed,
    Object(String),
}

/// Records what a pod watch saw.
fn record_pod(pending: &mut Pending, seen: Seen) {
    pending.pods.record(seen);
}

/// Records what the namespace watch saw.
fn record_namespace(pending: &mut Pending, _: Seen) {
    pending.namespaces = true;
}

/// Records what the Service watch saw: a list, or the Service changed.
fn record_service(pending: &mut Pending, seen: Seen) {
    pending.services.record(seen);
}

/// Records what the EndpointSlice watch saw, as [`record_service`].
fn record_endpoint_slice(pending: &mut Pending, seen: Seen) {
    pending.endpoint_slices.record(seen);
}

/// Records what the Node watch saw (the policy kinds likewise): the kind is
/// sent whole.
fn record_node(pending: &mut Pending, _: Seen) {
    pending.nodes = true;
}

fn record_policy(pending: &mut Pending, _: Seen) {
    pending.policies = true;
}

fn record_mtls_policy(pending: &mut Pending, _: Seen) {
    pending.mtls_policies = true;
}

/// Whether a watch has listed, whatever its kind.
struct WatchFlags {
    /// The watch as logs name it (`pods (this node)`).
    what: &'static str,
    /// The first list has been stored, or the resource is not served (404).
    ready: Arc<AtomicBool>,
    /// The last list answered 404 (an Istio CRD that is not installed): the
    /// kind is empty, whatever the store kept.
    absent: Arc<AtomicBool>,
    /// Records what the watch saw in [`Pending`].
    record: fn(&mut Pending, Seen),
}

impl WatchFlags {
    /// Whether listed once (or found not served).
    fn listed(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Whether listed, and served now.
    fn served(&self) -> bool {
        self.listed() && !self.absent.load(Ordering::Relaxed)
    }
}

/// One watch and its store.
struct Watch<K: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    flags: WatchFlags,
    task: tokio::task::JoinHandle<()>,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Watch<K> {
    /// A watch left out of this [`Scope`]: never listed from the API, always
    /// empty, and counted as listed.
    fn unwatched(what: &'static str, record: fn(&mut Pending, Seen)) -> Self {
        let (store, _) = reflector::store();
        Watch {
            store,
            flags: WatchFlags {
                what,
                ready: Arc::new(AtomicBool::new(true)),
                absent: Arc::new(AtomicBool::new(true)),
                record,
            },
            task: tokio::spawn(async {}),
        }
    }

    /// Whether listed, and served now.
    fn served(&self) -> bool {
        self.flags.served()
    }

    /// The objects of the store; none while the resource is not served.
    fn objects(&self) -> Vec<Arc<K>> {
        if self.flags.absent.load(Ordering::Relaxed) {
            Vec::new()
        } else {
            self.store.state()
        }
    }
}

/// What to watch.
struct WatchSpec<K: Resource> {
    /// The watch as logs name it (`pods (this node)`).
    what: &'static str,
    api: Api<K>,
    config: watcher::Config,
    /// Records what the watch saw in [`Pending`].
    record: fn(&mut Pending, Seen),
    /// For an Istio kind: the resource as the 404 warning names it
    /// (`authorizationpolicies.security.istio.io/v1`); a 404 then means its
    /// CRD is not installed.
    crd: Option<&'static str>,
}

impl<K: Resource<DynamicType = ()>> WatchSpec<K> {
    /// Watches every object of the cluster.
    fn all(what: &'static str, client: &Client, record: fn(&mut Pending, Seen)) -> Self {
        WatchSpec {
            what,
            api: Api::all(client.clone()),
            config: watcher::Config::default(),
            record,
            crd: None,
        }
    }

    /// An Istio kind: see [`WatchSpec::crd`].
    fn crd(mut self, resource: &'static str) -> Self {
        self.crd = Some(resource);
        self
    }
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Drop for Watch<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts watching `spec.api` into a reflector store, its objects trimmed
/// ([`trim`]); each change to the store that podlink reads ([`Projection`]) is
/// recorded in `pending` by `spec.record` and wakes `changes`.
fn watch<K>(spec: WatchSpec<K>, pending: Arc<Mutex<Pending>>, changes: Arc<Notify>) -> Watch<K>
where
    K: Resource<DynamicType = ()>
        + Projection
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let WatchSpec {
        what,
        api,
        config,
        record,
        crd,
    } = spec;
    let (store, writer) = reflector::store();
    let ready = Arc::new(AtomicBool::new(false));
    let absent = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn({
        let (ready, absent) = (ready.clone(), absent.clone());
        async move {
            let progressed = Arc::new(AtomicBool::new(false));
            // Set before the backoff sees the error, so that it is spaced as a 404.
            let not_found = Arc::new(AtomicBool::new(false));
            let stream = reflector::reflector(
                writer,
                watcher(api, config)
                    .map({
                        let not_found = not_found.clone();
                        move |event| {
                            let is_404 = matches!(&event, Err(e) if policies::is_not_found(e));
                            not_found.store(crd.is_some() && is_404, Ordering::Relaxed);
                            event
                        }
                    })
                    .backoff(ProgressBackoff {
                        inner: watcher::DefaultBackoff::default(),
                        progressed: progressed.clone(),
                        not_found,
                    })
                    .map(|event| event.map(|e| e.modify(|o| trim(o.meta_mut())))),
            );
            let mut stream = std::pin::pin!(stream);
            let mut failing = false;
            // The fingerprints of the stored objects, and of a list under way.
            let mut seen: HashMap<String, u64> = HashMap::new();
            let mut listing: HashMap<String, u64> = HashMap::new();
            let key = |o: &K| {
                format!(
                    "{}/{}",
                    o.meta().namespace.as_deref().unwrap_or(""),
                    o.meta().name.as_deref().unwrap_or("")
                )
            };
            while let Some(event) = stream.next().await {
                // The reflector has stored the event's object when it is seen here.
                let changed = match event {
                    Ok(watcher::Event::Init) => {
                        // Emitted before every list attempt, also one that
                        // then fails: not progress (the backoff keeps growing).
                        listing.clear();
                        continue;
                    }
                    Ok(watcher::Event::InitApply(o)) => {
                        listing.insert(key(&o), o.projection());
                        None
                    }
                    Ok(watcher::Event::InitDone) => {
                        if !ready.swap(true, Ordering::Relaxed) {
                            tracing::info!(watch = what, "listed");
                        }
                        if absent.swap(false, Ordering::Relaxed) {
                            tracing::info!(
                                watch = what,
                                "the Kubernetes API serves {} now (its CRD is installed): its policies are read",
                                crd.unwrap_or(what)
                            );
                        }
                        seen = std::mem::take(&mut listing);
                        Some(Seen::Listed)
                    }
                    Ok(watcher::Event::Apply(o)) => {
                        let key = key(&o);
                        (seen.insert(key.clone(), o.projection()) != Some(o.projection()))
                            .then_some(Seen::Object(key))
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        let key = key(&o);
                        seen.remove(&key);
                        Some(Seen::Object(key))
                    }
                    Err(e) if crd.is_some() && policies::is_not_found(&e) => {
                        // Not installed: the kind is empty, and counts as listed.
                        let newly_absent = !absent.swap(true, Ordering::Relaxed);
                        let newly_ready = !ready.swap(true, Ordering::Relaxed);
                        if newly_absent {
                            tracing::warn!(
                                watch = what,
                                "the Kubernetes API does not serve {} (404 Not Found: its CRD is not installed, or not in that version): it is taken as empty, and the kind read from its other version if that one is served; listing it again every {}s at most",
                                crd.unwrap_or(what),
                                policies::NOT_INSTALLED_RETRY.as_secs()
                            );
                        }
                        failing = false;
                        if newly_absent || newly_ready {
                            record(
                                &mut pending.lock().unwrap_or_else(PoisonError::into_inner),
                                Seen::Listed,
                            );
                            changes.notify_one();
                        }
                        continue;
                    }
                    Err(e) => {
                        // The backoff spaces the retries; the store keeps its state.
                        tracing::warn!(
                            watch = what,
                            "watching the Kubernetes API failed: {e}; retrying with backoff, the data path keeps its state"
                        );
                        failing = true;
                        continue;
                    }
                };
                progressed.store(true, Ordering::Relaxed);
                if std::mem::take(&mut failing) {
                    tracing::info!(watch = what, "watching again");
                }
                if let Some(seen) = changed {
                    record(
                        &mut pending.lock().unwrap_or_else(PoisonError::into_inner),
                        seen,
                    );
                    changes.notify_one();
                }
            }
        }
    });
    Watch {
        store,
        flags: WatchFlags {
            what,
            ready,
            absent,
            record,
        },
        task,
    }
}

/// The Kubernetes API as a workload source.
pub struct KubeSource {
    client: Client,
    all_pods: Watch<ApiPod>,
    local_pods: Watch<ApiPod>,
    namespaces: Watch<ApiNamespace>,
    services: Watch<ApiService>,
    endpoint_slices: Watch<ApiEndpointSlice>,
    nodes: Watch<ApiNode>,
    policies_v1: Watch<ApiAuthorizationPolicyV1>,
    policies_v1beta1: Watch<ApiAuthorizationPolicyV1beta1>,
    mtls_v1: Watch<ApiPeerAuthenticationV1>,
    mtls_v1beta1: Watch<ApiPeerAuthenticationV1beta1>,
    /// The last version that compiled of each AuthorizationPolicy and
    /// PeerAuthentication.
    policy_versions: LastGood<Policy>,
    mtls_versions: LastGood<MtlsPolicy>,
    /// The AuthorizationPolicies and PeerAuthentications that could not be
    /// compiled when last read and have no good version: the policies of
    /// their namespaces are unknown while there are any.
    refused_policies: Vec<Refused>,
    refused_mtls: Vec<Refused>,
    /// Objects refused whose last good version stays in force, each logged
    /// once while it holds.
    held_policies: HeldMessages,
    held_mtls: HeldMessages,
    /// The Istio watches' flags as the last delta was made of them.
    sent_lists: Option<PolicyLists>,
    /// What was not listed yet ([`Self::unlisted`]) as the last delta was
    /// made.
    sent_unlisted: Vec<&'static str>,
    /// What changed since the last delta.
    pending: Arc<Mutex<Pending>>,
    /// Whether the first delta was sent.
    started: bool,
    changes: Arc<Notify>,
}

impl KubeSource {
    /// Connects with `kubeconfig`, or the in-cluster configuration (the service
    /// account's token and CA, `KUBERNETES_SERVICE_HOST`/`_PORT`) when `None`, and
    /// starts the watchers of `scope`. Does not wait for the first lists
    /// ([`Self::wait_ready`]).
    ///
    /// # Errors
    /// A kubeconfig that cannot be read ([`Error::ReadKubeconfig`]) or used
    /// ([`Error::UseKubeconfig`]), no in-cluster configuration
    /// ([`Error::NoInClusterConfig`]), or a configuration kube-rs cannot make
    /// a client of ([`Error::Client`]).
    pub async fn start(kubeconfig: Option<&Path>, node: &str, scope: Scope) -> Result<Self, Error> {
        let mut config = match kubeconfig {
            Some(path) => {
                let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|error| {
                    Error::ReadKubeconfig {
                        path: path.to_path_buf(),
                        error,
                    }
                })?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                    .await
                    .map_err(|error| Error::UseKubeconfig {
                        path: path.to_path_buf(),
                        error,
                    })?
            }
            None => {
                kube::Config::incluster().map_err(|error| Error::NoInClusterConfig { error })?
            }
        };
        // kube-rs takes a proxy from the kubeconfig or the environment
        // (HTTPS_PROXY), but this build has no proxy support and would refuse the
        // configuration: the agent talks to the API server directly.
        if let Some(proxy) = config.proxy_url.take() {
            tracing::warn!(%proxy, "ignoring the proxy for the Kubernetes API: the agent connects directly");
        }
        let cluster = config.cluster_url.to_string();
        let client = Client::try_from(config).map_err(|error| Error::Client { error })?;
        tracing::info!(api = %cluster, node, ?scope, "watching the Kubernetes API");
        let pending = Arc::new(Mutex::new(Pending::default()));
        let changes = Arc::new(Notify::new());
        let c = &client;
        macro_rules! start {
            ($spec:expr) => {
                watch($spec, pending.clone(), changes.clone())
            };
        }
        // What the cluster scope alone watches.
        macro_rules! cluster {
            ($spec:expr) => {{
                let spec = $spec;
                match scope {
                    Scope::Cluster => start!(spec),
                    Scope::Node => Watch::unwatched(spec.what, spec.record),
                }
            }};
        }
        let all_pods = cluster!(WatchSpec::all("pods (all)", c, record_pod));
        let local_pods = start!(WatchSpec {
            config: watcher::Config::default().fields(&format!("spec.nodeName={node}")),
            ..WatchSpec::all("pods (this node)", c, record_pod)
        });
        let namespaces = start!(WatchSpec::all("namespaces", c, record_namespace));
        let services = cluster!(WatchSpec::all("services", c, record_service));
        let endpoint_slices = cluster!(WatchSpec::all("endpointslices", c, record_endpoint_slice));
        let nodes = start!(WatchSpec::all("nodes", c, record_node));
        let policies_v1 = cluster!(
            WatchSpec::all("authorizationpolicies (v1)", c, record_policy)
                .crd("authorizationpolicies.security.istio.io/v1")
        );
        let policies_v1beta1 = cluster!(
            WatchSpec::all("authorizationpolicies (v1beta1)", c, record_policy)
                .crd("authorizationpolicies.security.istio.io/v1beta1")
        );
        let mtls_v1 = cluster!(
            WatchSpec::all("peerauthentications (v1)", c, record_mtls_policy)
                .crd("peerauthentications.security.istio.io/v1")
        );
        let mtls_v1beta1 = cluster!(
            WatchSpec::all("peerauthentications (v1beta1)", c, record_mtls_policy)
                .crd("peerauthentications.security.istio.io/v1beta1")
        );
        Ok(KubeSource {
            client,
            all_pods,
            local_pods,
            namespaces,
            services,
            endpoint_slices,
            nodes,
            policies_v1,
            policies_v1beta1,
            mtls_v1,
            mtls_v1beta1,
            policy_versions: LastGood::default(),
            mtls_versions: LastGood::default(),
            refused_policies: Vec::new(),
            refused_mtls: Vec::new(),
            held_policies: HeldMessages::default(),
            held_mtls: HeldMessages::default(),
            sent_lists: None,
            sent_unlisted: Vec::new(),
            pending,
            started: false,
            changes,
        })
    }

    /// The watches of the kinds but Istio's, whose two versions are read as
    /// one kind ([`Self::policies_listed`]).
    fn core_watches(&self) -> [&WatchFlags; 6] {
        [
            &self.local_pods.flags,
            &self.all_pods.flags,
            &self.namespaces.flags,
            &self.services.flags,
            &self.endpoint_slices.flags,
            &self.nodes.flags,
        ]
    }

    /// The resource of every watch: its API group and plural name.
    #[cfg(test)]
    fn watched_resources(&self) -> BTreeSet<(String, String)> {
        fn of<K: Resource<DynamicType = ()> + Clone + 'static>(_: &Watch<K>) -> (String, String) {
            (K::group(&()).into(), K::plural(&()).into())
        }
        BTreeSet::from([
            of(&self.local_pods),
            of(&self.all_pods),
            of(&self.namespaces),
            of(&self.services),
            of(&self.endpoint_slices),
            of(&self.nodes),
            of(&self.policies_v1),
            of(&self.policies_v1beta1),
            of(&self.mtls_v1),
            of(&self.mtls_v1beta1),
        ])
    }

    /// What has not been listed once yet, as logs name it: the watches
    /// (`pods (this node)`, `nodes`, …), and the Istio kinds
    /// (`authorizationpolicies`, `peerauthentications`) not listed as
    /// [`Self::policies_listed`] counts them. The agent is not ready while
    /// anything is left; whether the view is whole is told from the same
    /// reading ([`Self::completeness`]).
    fn unlisted(&self) -> Vec<&'static str> {
        let mut unlisted: Vec<&'static str> = self
            .core_watches()
            .into_iter()
            .filter(|w| !w.listed())
            .map(|w| w.what)
            .collect();
        if !istio_kind_listed(&self.policies_v1.flags, &self.policies_v1beta1.flags) {
            unlisted.push(AUTHORIZATION_POLICIES.resource);
        }
        if !istio_kind_listed(&self.mtls_v1.flags, &self.mtls_v1beta1.flags) {
            unlisted.push(PEER_AUTHENTICATIONS.resource);
        }
        unlisted
    }

    /// Whether every Istio kind has been listed (or found not installed), so
    /// that the policies can be known ([`istio_kind_listed`]).
    fn policies_listed(&self) -> bool {
        istio_kind_listed(&self.policies_v1.flags, &self.policies_v1beta1.flags)
            && istio_kind_listed(&self.mtls_v1.flags, &self.mtls_v1beta1.flags)
    }

    /// Whether the policies are listed, and which version of each kind is
    /// read ([`policies::choose_version`]); read before the stores.
    fn policy_lists(&self) -> PolicyLists {
        PolicyLists {
            listed: self.policies_listed(),
            policies: policies::choose_version(
                self.policies_v1.served(),
                self.policies_v1beta1.served(),
            ),
            mtls: policies::choose_version(self.mtls_v1.served(), self.mtls_v1beta1.served()),
        }
    }

    /// Whether every watch has listed once (nothing is [`Self::unlisted`]).
    fn all_listed(&self) -> bool {
        self.unlisted().is_empty()
    }

    /// Waits until every watch has listed once ([`Self::all_listed`]) or
    /// `timeout` has passed.
    pub async fn wait_ready(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.all_listed() {
            if tokio::time::timeout_at(deadline, self.changes.notified())
                .await
                .is_err()
            {
                break;
            }
        }
    }

    /// Every pod of both pod stores, one per namespace/name (this node's watch
    /// preferred), in that order.
    fn read_all_pods(&self) -> Vec<Pod> {
        read_all_pods(&self.local_pods.store, &self.all_pods.store)
    }

    /// Every namespace of the store.
    fn read_namespaces(&self) -> Vec<Namespace> {
        self.namespaces
            .objects()
            .iter()
            .map(|ns| Namespace {
                metadata: meta_of(&ns.metadata),
            })
            .collect()
    }

    fn read_services(&self) -> Vec<Service> {
        self.services
            .objects()
            .iter()
            .map(|s| service_of(s))
            .collect()
    }

    fn read_endpoint_slices(&self) -> Vec<EndpointSlice> {
        self.endpoint_slices
            .objects()
            .iter()
            .map(|s| endpoint_slice_of(s))
            .collect()
    }

    fn read_nodes(&self) -> Vec<Node> {
        self.nodes.objects().iter().map(|n| node_of(n)).collect()
    }

    /// The AuthorizationPolicies of `version`'s store, compiled; an object
    /// that cannot be compiled keeps its last good version in force (logged
    /// once while it holds), or is kept as refused to make its namespace's
    /// policies unknown.
    fn read_policies(&mut self, version: Version) -> Vec<Arc<Policy>> {
        let (v1, v1beta1) = (self.policies_v1.objects(), self.policies_v1beta1.objects());
        let objects = policies::objects_of(version, borrowed(&v1), borrowed(&v1beta1));
        let compiled = self
            .policy_versions
            .compile(&objects, policies::compile_policy);
        log_held(&mut self.held_policies, &compiled.held);
        self.refused_policies = compiled.refused;
        compiled.policies
    }

    /// The PeerAuthentications of `version`'s store, compiled, as
    /// [`Self::read_policies`].
    fn read_mtls_policies(&mut self, version: Version) -> Vec<Arc<MtlsPolicy>> {
        let (v1, v1beta1) = (self.mtls_v1.objects(), self.mtls_v1beta1.objects());
        let objects = policies::objects_of(version, borrowed(&v1), borrowed(&v1beta1));
        let compiled = self
            .mtls_versions
            .compile(&objects, policies::compile_mtls_policy);
        log_held(&mut self.held_mtls, &compiled.held);
        self.refused_mtls = compiled.refused;
        compiled.policies
    }

    /// Why the policies cannot be known, all of them or those of some
    /// namespaces ([`policies::policies_unknown`]); `listed` is
    /// [`Self::policies_listed`] as read before the stores.
    fn policies_unknown(
        &self,
        listed: bool,
    ) -> (Option<PoliciesUnknown>, BTreeMap<String, PoliciesUnknown>) {
        let refused: Vec<&Refused> = self
            .refused_policies
            .iter()
            .chain(&self.refused_mtls)
            .collect();
        policies::policies_unknown(listed, &refused)
    }

    /// How complete the watches' view is, `unlisted` being what
    /// [`Self::unlisted`] read: whole once this node's pods, the namespaces,
    /// the Services and the EndpointSlices were listed.
    fn completeness(&self, unlisted: &[&str]) -> Completeness {
        let whole = [
            &self.local_pods.flags,
            &self.namespaces.flags,
            &self.services.flags,
            &self.endpoint_slices.flags,
        ]
        .iter()
        .all(|w| !unlisted.contains(&w.what));
        if whole {
            Completeness::Complete
        } else {
            Completeness::Incomplete
        }
    }

    /// The delta of what the watches saw: every pod when a pod watch listed
    /// (again), else the pods they named with their objects now; every object
    /// of another kind when one of that kind changed.
    /// `lists` are the Istio watches' flags and `unlisted` what was not
    /// listed yet ([`Self::unlisted`]), both read before `pending` was taken.
    fn delta(
        &mut self,
        pending: Pending,
        lists: PolicyLists,
        unlisted: Vec<&'static str>,
    ) -> Delta {
        self.sent_lists = Some(lists);
        let mut delta = Delta {
            completeness: self.completeness(&unlisted),
            ..Delta::default()
        };
        self.sent_unlisted.clone_from(&unlisted);
        delta.unlisted = unlisted;
        if pending.pods.listed {
            delta.all_pods = Some(self.read_all_pods());
        } else {
            delta.pods = changed_pods(
                pending.pods.keys,
                &self.local_pods.store,
                &self.all_pods.store,
            );
        }
        if pending.namespaces {
            delta.namespaces = Some(self.read_namespaces());
        }
        if pending.services.listed {
            delta.services = Some(self.read_services());
        } else {
            delta.changed_services = changed(pending.services.keys, &self.services, service_of);
        }
        if pending.endpoint_slices.listed {
            delta.endpoint_slices = Some(self.read_endpoint_slices());
        } else {
            delta.changed_endpoint_slices = changed(
                pending.endpoint_slices.keys,
                &self.endpoint_slices,
                endpoint_slice_of,
            );
        }
        if pending.nodes {
            delta.nodes = Some(self.read_nodes());
        }
        if pending.policies {
            delta.policies = Some(self.read_policies(lists.policies));
        }
        if pending.mtls_policies {
            delta.mtls_policies = Some(self.read_mtls_policies(lists.mtls));
        }
        (delta.policies_unknown, delta.policies_unknown_in) = self.policies_unknown(lists.listed);
        delta
    }

    /// The whole view: every object of every kind.
    fn whole(&mut self) -> Delta {
        // Read before the stores: a list that ends meanwhile comes as a
        // delta of its own, never as a complete view of what was read before.
        let lists = self.policy_lists();
        self.sent_lists = Some(lists);
        let unlisted = self.unlisted();
        let completeness = self.completeness(&unlisted);
        self.sent_unlisted.clone_from(&unlisted);
        let mut delta = Delta {
            all_pods: Some(self.read_all_pods()),
            namespaces: Some(self.read_namespaces()),
            services: Some(self.read_services()),
            endpoint_slices: Some(self.read_endpoint_slices()),
            nodes: Some(self.read_nodes()),
            policies: Some(self.read_policies(lists.policies)),
            mtls_policies: Some(self.read_mtls_policies(lists.mtls)),
            completeness,
            unlisted,
            ..Delta::default()
        };
        (delta.policies_unknown, delta.policies_unknown_in) = self.policies_unknown(lists.listed);
        delta
    }

    fn take_pending(&self) -> Pending {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Whether an Istio kind whose versions are watched by `v1` and `v1beta1`
/// has been listed: one version served has every object; both must have
/// answered otherwise (each listed, or found not installed).
fn istio_kind_listed(v1: &WatchFlags, v1beta1: &WatchFlags) -> bool {
    v1.served() || v1beta1.served() || (v1.listed() && v1beta1.listed())
}

/// The objects `keys` (`namespace/name`) of `watch`'s store now, as podlink
/// reads them (`of`); none for those gone.
fn changed<K, T>(
    keys: BTreeSet<String>,
    watch: &Watch<K>,
    of: impl Fn(&K) -> T,
) -> Vec<(String, Option<T>)>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    keys.into_iter()
        .map(|key| {
            // Services and EndpointSlices always have a namespace; an
            // object without one is keyed `/name` by the watch.
            let now = key.split_once('/').and_then(|(ns, name)| {
                let at = ObjectRef::new(name);
                let at = if ns.is_empty() { at } else { at.within(ns) };
                watch.store.get(&at).map(|o| of(&o))
            });
            (key, now)
        })
        .collect()
}

/// A store's objects as [`Object`]s borrowing from them.
fn borrowed<K: kinds::IstioObject>(objects: &[Arc<K>]) -> Vec<Object<'_>> {
    objects.iter().map(|o| Object::of(&**o)).collect()
}

/// Logs, once while it holds, each object refused whose last good version
/// stays in force.
fn log_held(messages: &mut HeldMessages, held: &[Refused]) {
    messages.log(
        held.iter()
            .map(|r| (Severity::Warn, policies::held_message(r)))
            .collect(),
    );
}

/// The pods `keys` (`namespace/name`) with their objects now ([`current_pod`]),
/// none for those gone.
fn changed_pods(
    keys: BTreeSet<String>,
    local: &Store<ApiPod>,
    all: &Store<ApiPod>,
) -> Vec<(String, Vec<Pod>)> {
    keys.into_iter()
        .filter_map(|key| {
            let (ns, name) = key.split_once('/')?;
            let now = current_pod(local, all, ns, name);
            Some((key, now.into_iter().collect()))
        })
        .collect()
}

impl Source for KubeSource {
    async fn next(&mut self) -> Delta {
        if !std::mem::replace(&mut self.started, true) {
            self.wait_ready(FIRST_LIST_WAIT).await;
            let unlisted = self.unlisted();
            let whole = self.completeness(&unlisted) == Completeness::Complete;
            if !unlisted.is_empty() {
                tracing::warn!(
                    unlisted = ?unlisted,
                    "the Kubernetes API has not listed everything the agent watches within {}s; serving with what is known, not ready until it has{}",
                    FIRST_LIST_WAIT.as_secs(),
                    if whole {
                        ""
                    } else {
                        ", and nothing is detached until this node's pods, the namespaces, the Services and the EndpointSlices are listed"
                    }
                );
            }
            self.take_pending();
            return self.whole();
        }
        loop {
            // The flags before the pending changes, and both before the
            // stores: a list that ends meanwhile is read again
            // ([`policies::rereads`], and a watch listed since the last
            // delta is read whole) or comes with the next delta, never taken
            // as listed with the objects read before it.
            let lists = self.policy_lists();
            let unlisted = self.unlisted();
            let mut pending = self.take_pending();
            let (policies, mtls) = policies::rereads(self.sent_lists, lists);
            pending.policies |= policies;
            pending.mtls_policies |= mtls;
            for watch in self.core_watches() {
                if self.sent_unlisted.contains(&watch.what) && !unlisted.contains(&watch.what) {
                    (watch.record)(&mut pending, Seen::Listed);
                }
            }
            if !pending.is_empty() || unlisted != self.sent_unlisted {
                return self.delta(pending, lists, unlisted);
            }
            self.changes.notified().await;
        }
    }

    fn readiness_waits_for_whole_view(&self) -> bool {
        true
    }

    fn lists_every_namespace(&self) -> bool {
        true
    }

    fn capture_reporter(&self) -> Option<Box<dyn CaptureReporter>> {
        Some(Box::new(RedirectionAnnotator::new(
            self.client.clone(),
            self.local_pods.store.clone(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_pod(json: serde_json::Value) -> ApiPod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_backoff_grows_until_a_watch_delivers() {
        let progressed = Arc::new(AtomicBool::new(false));
        let mut backoff = ProgressBackoff {
            inner: watcher::DefaultBackoff::default(),
            progressed: progressed.clone(),
            not_found: Arc::new(AtomicBool::new(false)),
        };
        // Resets from StreamBackoff (on the watcher's Init markers) change nothing.
        let mut last = Duration::ZERO;
        for _ in 0..6 {
            kube::runtime::utils::Backoff::reset(&mut backoff);
            last = backoff.next().unwrap();
        }
        assert!(last >= Duration::from_secs(25), "{last:?}");
        // Something delivered: the next failure starts over.
        progressed.store(true, Ordering::Relaxed);
        assert!(backoff.next().unwrap() < Duration::from_secs(2));
    }

    /// With both pod stores, a pod's update takes the object a full read
    /// takes: this node's watch first, also while the other watch lags behind
    /// it (a delete seen by one watch only).
    #[test]
    fn updates_from_both_stores_match_a_full_read() {
        let pod = |name: &str, ip: &str| {
            api_pod(serde_json::json!({
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"nodeName": "n1"},
                "status": {"podIP": ip},
            }))
        };
        let (local, mut local_writer) = reflector::store::<ApiPod>();
        let (all, mut all_writer) = reflector::store::<ApiPod>();
        let mut list = Vec::new();
        // The pods as deltas of changed pods leave them, in key order.
        let check = |list: &mut Vec<Pod>, keys: &[&str]| {
            let mut pods: BTreeMap<String, Pod> =
                list.drain(..).map(|p| (p.key().unwrap(), p)).collect();
            let changed = changed_pods(keys.iter().map(|k| k.to_string()).collect(), &local, &all);
            for (key, now) in changed {
                pods.remove(&key);
                pods.extend(now.into_iter().map(|p| (key.clone(), p)));
            }
            list.extend(pods.into_values());
            assert_eq!(*list, read_all_pods(&local, &all), "after {keys:?}");
        };
        let apply = |w: &mut reflector::store::Writer<ApiPod>, p: ApiPod| {
            w.apply_watcher_event(&watcher::Event::Apply(p))
        };
        // The cluster's watch first, then this node's, newer.
        apply(&mut all_writer, pod("a", "10.0.0.1"));
        apply(&mut all_writer, pod("b", "10.0.0.2"));
        check(&mut list, &["ns/a", "ns/b"]);
        apply(&mut local_writer, pod("a", "10.0.0.9"));
        check(&mut list, &["ns/a"]);
        assert_eq!(
            list[0].status.as_ref().unwrap().pod_ip.as_deref(),
            Some("10.0.0.9")
        );
        // This node's watch sees the delete first: the cluster's object shows.
        local_writer.apply_watcher_event(&watcher::Event::Delete(pod("a", "10.0.0.9")));
        check(&mut list, &["ns/a"]);
        assert_eq!(
            list[0].status.as_ref().unwrap().pod_ip.as_deref(),
            Some("10.0.0.1")
        );
        all_writer.apply_watcher_event(&watcher::Event::Delete(pod("a", "10.0.0.1")));
        check(&mut list, &["ns/a"]);
        assert_eq!(list.len(), 1);
    }

    #[test]
    fn watches_record_what_they_saw() {
        let mut pending = Pending::default();
        assert!(pending.is_empty());
        record_pod(&mut pending, Seen::Object("ns/a".into()));
        record_pod(&mut pending, Seen::Object("ns/a".into()));
        assert_eq!(pending.pods.keys, BTreeSet::from(["ns/a".to_string()]));
        assert!(!pending.pods.listed && !pending.namespaces);
        record_pod(&mut pending, Seen::Listed);
        assert!(pending.pods.listed);
        record_namespace(&mut pending, Seen::Object("/shop".into()));
        assert!(pending.namespaces);
        for (record, what) in [
            (record_service as fn(&mut Pending, Seen), "services"),
            (record_endpoint_slice, "endpoint_slices"),
            (record_node, "nodes"),
            (record_policy, "policies"),
            (record_mtls_policy, "mtls_policies"),
        ] {
            let mut pending = Pending::default();
            record(&mut pending, Seen::Listed);
            assert!(!pending.is_empty(), "{what}");
            let mut pending = Pending::default();
            record(&mut pending, Seen::Object("ns/x".into()));
            assert!(!pending.is_empty(), "{what}");
        }
        // Services and EndpointSlices are sent one by one, but for a list.
        let mut pending = Pending::default();
        record_service(&mut pending, Seen::Object("ns/web".into()));
        record_endpoint_slice(&mut pending, Seen::Object("ns/web-1".into()));
        assert!(!pending.services.listed && !pending.endpoint_slices.listed);
        assert_eq!(
            pending.services.keys,
            BTreeSet::from(["ns/web".to_string()])
        );
        assert_eq!(
            pending.endpoint_slices.keys,
            BTreeSet::from(["ns/web-1".to_string()])
        );
        record_service(&mut pending, Seen::Listed);
        assert!(pending.services.listed);
    }

    /// What the ClusterRole `role` grants: verbs by API group and resource.
    fn granted(role: &serde_json::Value) -> BTreeMap<(String, String), BTreeSet<String>> {
        assert_eq!(role["kind"], "ClusterRole");
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .unwrap_or_else(|| panic!("not a list: {v}"))
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        let mut granted: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
        for rule in role["rules"].as_array().unwrap() {
            assert!(
                rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none(),
                "{rule}"
            );
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    granted
                        .entry((group.clone(), resource))
                        .or_default()
                        .extend(strings(&rule["verbs"]));
                }
            }
        }
        granted
    }

    /// `get`, `list` and `watch` on every resource of `watched`, and `patch`
    /// on pods (the redirection annotation, [`RedirectionAnnotator`]).
    fn needed(watched: &[Watched]) -> BTreeMap<(String, String), BTreeSet<String>> {
        let read = BTreeSet::from(["get", "list", "watch"].map(String::from));
        let mut wanted: BTreeMap<(String, String), BTreeSet<String>> = watched
            .iter()
            .map(|w| ((w.group.into(), w.resource.into()), read.clone()))
            .collect();
        wanted
            .get_mut(&(PODS.group.into(), PODS.resource.into()))
            .unwrap()
            .insert("patch".into());
        wanted
    }

    /// `deploy/base/clusterrole.yaml` grants what [`WATCHED`] needs, and
    /// nothing else; `deploy/istio`'s, what [`WATCHED_BESIDE_ISTIOD`] needs.
    #[test]
    fn the_cluster_role_grants_exactly_what_is_watched() {
        let role: serde_json::Value = serde_yaml_ng::from_str(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/base/clusterrole.yaml"
        )))
        .unwrap();
        assert_eq!(granted(&role), needed(&WATCHED));
        let istio =
            crate::cli::tests::patched("istio", "clusterrole.yaml", "ClusterRole", "podlink");
        let istio: serde_json::Value = serde_yaml_ng::from_value(istio).unwrap();
        assert_eq!(granted(&istio), needed(&WATCHED_BESIDE_ISTIOD));
    }

    /// A source of `scope` whose API server is the discard port: nothing
    /// answers, every list fails and is retried, nothing is ever listed.
    async fn unanswered(scope: Scope) -> KubeSource {
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            "apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: \"http://127.0.0.1:9\"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
",
        )
        .unwrap();
        KubeSource::start(Some(&kubeconfig), "node1", scope)
            .await
            .unwrap()
    }

    /// The watches the source starts are of exactly the resources of
    /// [`WATCHED`]. Until each has listed it is named unlisted (the Nodes
    /// too), and the view is whole once this node's pods, the namespaces, the
    /// Services and the EndpointSlices are listed; an Istio kind counts as
    /// listed once one version is served, or both have answered.
    #[tokio::test]
    async fn the_watches_are_of_the_watched_resources_and_say_what_is_unlisted() {
        let source = unanswered(Scope::Cluster).await;
        let watched: BTreeSet<(String, String)> = WATCHED
            .iter()
            .map(|w| (w.group.into(), w.resource.into()))
            .collect();
        assert_eq!(source.watched_resources(), watched);

        let unlisted = source.unlisted();
        assert_eq!(
            unlisted,
            [
                "pods (this node)",
                "pods (all)",
                "namespaces",
                "services",
                "endpointslices",
                "nodes",
                "authorizationpolicies",
                "peerauthentications"
            ]
        );
        assert_eq!(source.completeness(&unlisted), Completeness::Incomplete);
        let list = |w: &WatchFlags| w.ready.store(true, Ordering::Relaxed);
        for w in [
            &source.local_pods.flags,
            &source.namespaces.flags,
            &source.services.flags,
            &source.endpoint_slices.flags,
        ] {
            list(w);
        }
        let unlisted = source.unlisted();
        assert_eq!(source.completeness(&unlisted), Completeness::Complete);
        // Whole, but not everything is listed: the agent is not ready yet.
        assert_eq!(
            unlisted,
            [
                "pods (all)",
                "nodes",
                "authorizationpolicies",
                "peerauthentications"
            ]
        );
        list(&source.all_pods.flags);
        list(&source.nodes.flags);
        // AuthorizationPolicy v1 not installed (404), v1beta1 not listed yet:
        // unlisted; v1beta1 listed: listed.
        source
            .policies_v1
            .flags
            .absent
            .store(true, Ordering::Relaxed);
        list(&source.policies_v1.flags);
        // PeerAuthentication v1 served: listed whatever v1beta1 does.
        list(&source.mtls_v1.flags);
        assert_eq!(source.unlisted(), ["authorizationpolicies"]);
        assert!(!source.all_listed());
        list(&source.policies_v1beta1.flags);
        assert!(source.unlisted().is_empty());
        assert!(source.all_listed());
    }

    /// Beside istiod only this node's pods, the namespaces and the Nodes are
    /// listed: the rest counts as listed, and empty, from the start.
    #[tokio::test]
    async fn beside_istiod_only_what_capture_needs_is_watched() {
        let source = unanswered(Scope::Node).await;
        let unlisted = source.unlisted();
        assert_eq!(unlisted, ["pods (this node)", "namespaces", "nodes"]);
        assert_eq!(source.completeness(&unlisted), Completeness::Incomplete);
        for w in [
            &source.local_pods.flags,
            &source.namespaces.flags,
            &source.nodes.flags,
        ] {
            w.ready.store(true, Ordering::Relaxed);
        }
        let unlisted = source.unlisted();
        assert!(unlisted.is_empty(), "{unlisted:?}");
        assert_eq!(source.completeness(&unlisted), Completeness::Complete);
        assert!(source.read_services().is_empty());
        assert!(source.all_pods.objects().is_empty());
        assert!(!source.policy_lists().listed || !source.policies_v1.served());
    }

    /// A 404 of an Istio kind is retried within `NOT_INSTALLED_RETRY`,
    /// however long the backoff has grown.
    #[test]
    fn a_404_caps_the_backoff() {
        let not_found = Arc::new(AtomicBool::new(true));
        let mut backoff = ProgressBackoff {
            inner: watcher::DefaultBackoff::default(),
            progressed: Arc::new(AtomicBool::new(false)),
            not_found: not_found.clone(),
        };
        for _ in 0..10 {
            assert!(backoff.next().unwrap() <= policies::NOT_INSTALLED_RETRY);
        }
        not_found.store(false, Ordering::Relaxed);
        assert!(backoff.next().unwrap() > policies::NOT_INSTALLED_RETRY);
    }
}
