//! The Kubernetes API as a workload source: kube-rs watchers and reflector
//! stores of all pods (destination lookup and identities), this node's pods
//! (capture) and the namespaces (enrollment labels).
//!
//! The watchers list, then watch from the list's `resourceVersion`, and start
//! over with a new list when the API server answers `410 Gone` (Kubernetes API
//! concepts, "Efficient detection of changes"); the reflector stores swap in a
//! new list whole, so a relist never shows a half-listed cluster. Errors (a cut
//! connection, 401/403, 5xx) are logged with the watch that failed and retried
//! with kube-rs's default exponential backoff (0.8 s to 30 s); the stores, and
//! the data path built from them, keep their last state meanwhile.
//!
//! Objects are kept in partial form: the metadata podlink reads (managed fields
//! and every annotation but [`REDIRECTION_ANNOTATION`] are dropped on arrival)
//! and podlink's own `spec`/`status` types ([`crate::k8s`]), not the full ones.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet, HashMap},
    hash::{Hash, Hasher},
    path::Path,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::StreamExt;
use k8s_openapi::{
    ClusterResourceScope, NamespaceResourceScope,
    apimachinery::pkg::apis::meta::v1::ObjectMeta as ApiObjectMeta,
};
use kube::{
    Api, Client, Resource,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::Deserialize;
use tokio::sync::Notify;

mod annotate;

pub use annotate::RedirectionAnnotator;

use super::{CaptureReporter, Error, FIRST_LIST_WAIT, Source};
use crate::{
    k8s::{self, Namespace, Pod},
    state::{Completeness, Delta},
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

/// A pod as watched: API metadata, podlink's partial spec and status.
#[derive(Clone, Debug, Deserialize)]
struct ApiPod {
    metadata: ApiObjectMeta,
    spec: Option<k8s::PodSpec>,
    status: Option<k8s::PodStatus>,
}

/// A namespace as watched: its metadata only.
#[derive(Clone, Debug, Deserialize)]
struct ApiNamespace {
    metadata: ApiObjectMeta,
}

impl Resource for ApiPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;
    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }
    fn meta(&self) -> &ApiObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ApiObjectMeta {
        &mut self.metadata
    }
}

impl Resource for ApiNamespace {
    type DynamicType = ();
    type Scope = ClusterResourceScope;
    fn kind(_: &()) -> Cow<'_, str> {
        "Namespace".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "namespaces".into()
    }
    fn meta(&self) -> &ApiObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ApiObjectMeta {
        &mut self.metadata
    }
}

/// What podlink reads of a watched object, as a fingerprint: an event that
/// changes none of it (status conditions, container statuses, a resourceVersion
/// bump) does not make the agent rebuild its view.
trait Projection {
    fn projection(&self) -> u64;
}

fn fingerprint(meta: &ApiObjectMeta, rest: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    meta.labels.hash(&mut h);
    meta.annotations.hash(&mut h);
    meta.deletion_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .hash(&mut h);
    rest.hash(&mut h);
    h.finish()
}

impl Projection for ApiPod {
    fn projection(&self) -> u64 {
        fingerprint(&self.metadata, (&self.spec, &self.status))
    }
}

impl Projection for ApiNamespace {
    fn projection(&self) -> u64 {
        fingerprint(&self.metadata, ())
    }
}

/// kube-runtime's default backoff (0.8 s doubling to 30 s, with jitter), started
/// over only once a watch has delivered something since the last failure. The
/// watcher emits an `Init` marker before every list attempt, on which
/// `StreamBackoff` would otherwise reset it: a failing list would be retried
/// about once a second for as long as it fails, from every node.
struct ProgressBackoff {
    inner: watcher::DefaultBackoff,
    progressed: Arc<AtomicBool>,
}

impl Iterator for ProgressBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if self.progressed.swap(false, Ordering::Relaxed) {
            kube::runtime::utils::Backoff::reset(&mut self.inner);
        }
        self.inner.next()
    }
}

impl kube::runtime::utils::Backoff for ProgressBackoff {
    fn reset(&mut self) {}
}

/// Keeps of an object's metadata what podlink reads.
fn trim(meta: &mut ApiObjectMeta) {
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| k == REDIRECTION_ANNOTATION);
        if annotations.is_empty() {
            meta.annotations = None;
        }
    }
}

fn meta_of(meta: &ApiObjectMeta) -> k8s::ObjectMeta {
    k8s::ObjectMeta {
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        labels: meta.labels.clone(),
        annotations: meta.annotations.clone(),
        deletion_timestamp: meta.deletion_timestamp.as_ref().map(|t| t.0.to_string()),
        owner_references: None,
    }
}

/// What the watches saw change since the last delta.
#[derive(Debug, Default)]
struct Pending {
    /// Pods (`namespace/name`) added, changed (in what podlink reads) or deleted.
    pods: BTreeSet<String>,
    /// A Namespace was added, changed or deleted, or the namespaces were listed.
    namespaces: bool,
    /// A pod watch listed (again): every pod is read anew.
    everything: bool,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.pods.is_empty() && !self.namespaces && !self.everything
    }
}

/// podlink's view of a watched pod.
fn pod_of(pod: &ApiPod) -> Pod {
    Pod {
        metadata: meta_of(&pod.metadata),
        spec: pod.spec.clone(),
        status: pod.status.clone(),
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
    match seen {
        Seen::Listed => pending.everything = true,
        Seen::Object(key) => {
            pending.pods.insert(key);
        }
    }
}

/// Records what the namespace watch saw.
fn record_namespace(pending: &mut Pending, _: Seen) {
    pending.namespaces = true;
}

/// One watch and its store.
struct Watch<K: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    /// The first list has been stored.
    ready: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Drop for Watch<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts watching `api` into a reflector store; each change to the store that
/// podlink reads ([`Projection`]) is recorded in `pending` by `record` and wakes
/// `changes`.
fn watch<K>(
    what: &'static str,
    api: Api<K>,
    config: watcher::Config,
    modify: fn(&mut K),
    pending: Arc<Mutex<Pending>>,
    record: fn(&mut Pending, Seen),
    changes: Arc<Notify>,
) -> Watch<K>
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
    let (store, writer) = reflector::store();
    let ready = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn({
        let ready = ready.clone();
        async move {
            let progressed = Arc::new(AtomicBool::new(false));
            let stream = reflector::reflector(
                writer,
                watcher(api, config)
                    .backoff(ProgressBackoff {
                        inner: watcher::DefaultBackoff::default(),
                        progressed: progressed.clone(),
                    })
                    .map(|event| event.map(|e| e.modify(modify))),
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
                        listing.clear();
                        None
                    }
                    Ok(watcher::Event::InitApply(o)) => {
                        listing.insert(key(&o), o.projection());
                        None
                    }
                    Ok(watcher::Event::InitDone) => {
                        if !ready.swap(true, Ordering::Relaxed) {
                            tracing::info!(watch = what, "listed");
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
    Watch { store, ready, task }
}

/// The Kubernetes API as a workload source.
pub struct KubeSource {
    client: Client,
    all_pods: Watch<ApiPod>,
    local_pods: Watch<ApiPod>,
    namespaces: Watch<ApiNamespace>,
    /// What changed since the last delta.
    pending: Arc<Mutex<Pending>>,
    /// Whether the first delta was sent.
    started: bool,
    changes: Arc<Notify>,
}

impl KubeSource {
    /// Connects with `kubeconfig`, or the in-cluster configuration (the service
    /// account's token and CA, `KUBERNETES_SERVICE_HOST`/`_PORT`) when `None`, and
    /// starts the watchers. Does not wait for the first lists ([`Self::ready`]).
    ///
    /// # Errors
    /// A kubeconfig that cannot be read ([`Error::ReadKubeconfig`]) or used
    /// ([`Error::UseKubeconfig`]), no in-cluster configuration
    /// ([`Error::NoInClusterConfig`]), or a configuration kube-rs cannot make
    /// a client of ([`Error::Client`]).
    pub async fn start(kubeconfig: Option<&Path>, node: &str) -> Result<Self, Error> {
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
        tracing::info!(api = %cluster, node, "watching the Kubernetes API");
        let pending = Arc::new(Mutex::new(Pending::default()));
        let changes = Arc::new(Notify::new());
        let pod_modify: fn(&mut ApiPod) = |p| trim(&mut p.metadata);
        let ns_modify: fn(&mut ApiNamespace) = |n| trim(&mut n.metadata);
        let all_pods = watch(
            "pods (all)",
            Api::all(client.clone()),
            watcher::Config::default(),
            pod_modify,
            pending.clone(),
            record_pod,
            changes.clone(),
        );
        let local_pods = watch(
            "pods (this node)",
            Api::all(client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={node}")),
            pod_modify,
            pending.clone(),
            record_pod,
            changes.clone(),
        );
        let namespaces = watch(
            "namespaces",
            Api::all(client.clone()),
            watcher::Config::default(),
            ns_modify,
            pending.clone(),
            record_namespace,
            changes.clone(),
        );
        Ok(KubeSource {
            client,
            all_pods,
            local_pods,
            namespaces,
            pending,
            started: false,
            changes,
        })
    }

    /// Whether this node's pods and the namespaces have been listed: only then
    /// may pods missing from the source be taken as deleted.
    pub fn ready(&self) -> bool {
        self.local_pods.ready.load(Ordering::Relaxed)
            && self.namespaces.ready.load(Ordering::Relaxed)
    }

    /// Waits until [`Self::ready`] or `timeout` has passed; returns whether ready.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.ready() {
            if tokio::time::timeout_at(deadline, self.changes.notified())
                .await
                .is_err()
            {
                return self.ready();
            }
        }
        true
    }

    /// Every pod of both pod stores, one per namespace/name (this node's watch
    /// preferred), in that order.
    fn read_all_pods(&self) -> Vec<Pod> {
        read_all_pods(&self.local_pods.store, &self.all_pods.store)
    }

    /// Every namespace of the store.
    fn read_namespaces(&self) -> Vec<Namespace> {
        self.namespaces
            .store
            .state()
            .iter()
            .map(|ns| Namespace {
                metadata: meta_of(&ns.metadata),
            })
            .collect()
    }

    /// How complete the watches' view is: whole once this node's pods and the
    /// namespaces were listed.
    fn completeness(&self) -> Completeness {
        if self.ready() {
            Completeness::Complete
        } else {
            Completeness::Incomplete
        }
    }

    /// The delta of what the watches saw: every pod when a pod watch listed
    /// (again), else the pods they named with their objects now; every
    /// namespace when one changed.
    fn delta(&self, pending: Pending) -> Delta {
        // Read before the stores (see `next`).
        let mut delta = Delta {
            completeness: self.completeness(),
            ..Delta::default()
        };
        if pending.everything {
            delta.all_pods = Some(self.read_all_pods());
        } else {
            delta.pods = changed_pods(pending.pods, &self.local_pods.store, &self.all_pods.store);
        }
        if pending.namespaces {
            delta.namespaces = Some(self.read_namespaces());
        }
        delta
    }

    fn take_pending(&self) -> Pending {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }
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
            if !self.wait_ready(FIRST_LIST_WAIT).await {
                tracing::warn!(
                    "the Kubernetes API has not listed this node's pods and the namespaces within {}s; serving with what is known, nothing is detached until it has",
                    FIRST_LIST_WAIT.as_secs()
                );
            }
            self.take_pending();
            // Read before the stores: a list that ends meanwhile comes as a
            // delta of its own, never as a complete view of what was read before.
            let completeness = self.completeness();
            return Delta {
                all_pods: Some(self.read_all_pods()),
                namespaces: Some(self.read_namespaces()),
                completeness,
                ..Delta::default()
            };
        }
        loop {
            let pending = self.take_pending();
            if !pending.is_empty() {
                return self.delta(pending);
            }
            self.changes.notified().await;
        }
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
    fn a_watched_pod_keeps_only_what_podlink_reads() {
        let mut pod = api_pod(serde_json::json!({
            "metadata": {
                "name": "web-1", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                "labels": {"app": "web", "istio.io/dataplane-mode": "ambient"},
                "annotations": {REDIRECTION_ANNOTATION: "enabled", "kubectl.kubernetes.io/last-applied-configuration": "{...}"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}],
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "u-0"}],
                "deletionTimestamp": "2026-11-30T18:00:00Z",
            },
            "spec": {"nodeName": "node1", "serviceAccountName": "web", "containers": [{"name": "app", "image": "x"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}], "conditions": []},
        }));
        trim(&mut pod.metadata);
        assert!(pod.metadata.managed_fields.is_none());
        assert!(pod.metadata.owner_references.is_none());
        let meta = meta_of(&pod.metadata);
        assert_eq!(meta.name.as_deref(), Some("web-1"));
        assert_eq!(meta.namespace.as_deref(), Some("shop"));
        assert_eq!(meta.labels.as_ref().unwrap()["app"], "web");
        assert_eq!(
            meta.annotations,
            Some([(REDIRECTION_ANNOTATION.to_string(), "enabled".to_string())].into())
        );
        assert!(
            meta.deletion_timestamp
                .as_deref()
                .unwrap()
                .starts_with("2026-11-30")
        );
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node1"));
        assert_eq!(spec.service_account_name.as_deref(), Some("web"));
        assert_eq!(pod.status.unwrap().pod_ip.as_deref(), Some("10.0.0.5"));
    }

    #[test]
    fn other_annotations_alone_leave_none() {
        let mut pod = api_pod(serde_json::json!({
            "metadata": {"name": "a", "namespace": "b", "annotations": {"other": "x"}},
        }));
        trim(&mut pod.metadata);
        assert_eq!(meta_of(&pod.metadata).annotations, None);
    }

    #[test]
    fn the_backoff_grows_until_a_watch_delivers() {
        let progressed = Arc::new(AtomicBool::new(false));
        let mut backoff = ProgressBackoff {
            inner: watcher::DefaultBackoff::default(),
            progressed: progressed.clone(),
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

    #[test]
    fn only_what_podlink_reads_changes_the_fingerprint() {
        let pod = |rv: &str, ready: bool, phase: &str| {
            api_pod(serde_json::json!({
                "metadata": {"name": "a", "namespace": "b", "resourceVersion": rv},
                "spec": {"nodeName": "n1"},
                "status": {"phase": phase, "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": ready.to_string()}]},
            }))
        };
        let base = pod("1", false, "Running").projection();
        assert_eq!(pod("2", true, "Running").projection(), base);
        assert_ne!(pod("3", true, "Succeeded").projection(), base);
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
        assert_eq!(pending.pods, BTreeSet::from(["ns/a".to_string()]));
        assert!(!pending.everything && !pending.namespaces);
        record_pod(&mut pending, Seen::Listed);
        assert!(pending.everything);
        record_namespace(&mut pending, Seen::Object("/shop".into()));
        assert!(pending.namespaces);
    }

    #[test]
    fn resources_name_the_core_v1_api() {
        assert_eq!(
            ApiPod::url_path(&(), Some("shop")),
            "/api/v1/namespaces/shop/pods"
        );
        assert_eq!(ApiNamespace::url_path(&(), None), "/api/v1/namespaces");
    }
}
