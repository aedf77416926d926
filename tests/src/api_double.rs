//! An in-process Kubernetes API server double for end-to-end tests: it speaks the
//! real list/watch HTTP protocol of the Kubernetes API (plain HTTP/1.1, no TLS), so
//! the unmodified kube-rs client in the agent runs against it, and the test drives
//! the cluster state and injects faults through a synchronous API.
//!
//! What it serves (see "API concepts",
//! <https://kubernetes.io/docs/reference/using-api/api-concepts/>):
//!
//! * `pods`: `GET /api/v1/pods` (cluster-wide list or watch),
//!   `GET /api/v1/namespaces/{ns}/pods` (namespaced list or watch),
//!   `GET` and `PATCH /api/v1/namespaces/{ns}/pods/{name}`;
//! * `namespaces`: `GET /api/v1/namespaces` (list or watch), `GET` and
//!   `PATCH /api/v1/namespaces/{name}`;
//! * likewise (list, watch, get, patch; namespaced where the kind is)
//!   `services` and `nodes` (`/api/v1`), `endpointslices`
//!   (`/apis/discovery.k8s.io/v1`), and `authorizationpolicies` and
//!   `peerauthentications` under both `/apis/security.istio.io/v1` and
//!   `/apis/security.istio.io/v1beta1`: one store, served under either
//!   version with that version's `apiVersion`, as an API server serves a CRD
//!   with two versions. [`ApiServer::set_istio_crds_installed`] takes the Istio
//!   CRDs away (every request under `security.istio.io` is then 404
//!   `NotFound`, as for a resource the server does not know) and back, and
//!   [`ApiServer::serve_istio_versions`] serves them under one version only
//!   (the other answers 404), as older Istio releases do;
//! * `GET /version`, `/healthz`, `/livez`, `/readyz`.
//!
//! Every request needs `Authorization: Bearer` [`TOKEN`] (else 401, as an API
//! server answers an unknown token); the kubeconfig the double writes carries it.
//! Errors are `Status` objects with the matching HTTP code ("API concepts",
//! "Receiving lists of resources" / the `Status` kind of "Kubernetes API
//! reference: Status").
//!
//! Objects are kept as [`serde_json::Value`]s with `kind`, `apiVersion` and
//! `metadata` (`name`, `namespace` for pods, `uid`, `resourceVersion`,
//! `creationTimestamp`). One global resourceVersion counter (a decimal string in
//! JSON, as opaque to clients as the real one) is bumped on every change, and each
//! resource keeps its history of `ADDED`/`MODIFIED`/`DELETED` events ("Resource
//! versions", "Efficient detection of changes").
//!
//! The server runs on a tokio runtime of its own (one worker thread), so the test
//! side of [`ApiServer`] is synchronous and can be called from plain `#[test]`
//! functions as well as from async code (no method blocks on that runtime).

use std::{
    collections::{BTreeMap, HashMap},
    convert::Infallible,
    fmt, io,
    net::{SocketAddr, TcpListener as StdTcpListener},
    path::Path,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    task::{Context, Poll, ready},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use http::{
    Method, Response, StatusCode,
    header::{AUTHORIZATION, CONTENT_TYPE, USER_AGENT},
};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, watch};

use crate::{Cluster, Pod, netns::in_netns};

/// The bearer token of the user in the kubeconfig the double writes; requests
/// without it are answered 401 Unauthorized.
pub const TOKEN: &str = "podlink-api-double-token";

/// The user that [`TOKEN`] authenticates as, named in 403 Forbidden messages (the
/// agent's service account).
pub const USER: &str = "system:serviceaccount:podlink:podlink";

/// How long a watch lasts when the request has no `timeoutSeconds` (the real API
/// server picks a random time between `--min-request-timeout`, 1800 s, and twice
/// that).
pub const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// The annotation on the bookmark that ends the initial events of a streaming
/// list ("API concepts", "Streaming lists").
pub const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

/// One request the double answered, in arrival order (see
/// [`ApiServer::requests`]).
#[derive(Clone, Debug)]
pub struct Request {
    /// `GET`, `PATCH`, …
    pub method: String,
    /// The path, e.g. `/api/v1/namespaces/mesh/pods`.
    pub path: String,
    /// The raw query string as sent (percent-encoded, without `?`; kube-rs starts
    /// it with `&`), e.g. `&watch=true&timeoutSeconds=290&resourceVersion=7`;
    /// see [`Request::param`] for decoded values.
    pub query: String,
    /// The HTTP status code of the response: for a watch, that of the response
    /// head (200 even when the only event is a 410 `ERROR`).
    pub status: u16,
    /// The `User-Agent` header (empty when absent).
    pub user_agent: String,
    /// The `Authorization` header, e.g. `Bearer <token>`.
    pub authorization: Option<String>,
}

impl Request {
    /// The decoded value of query parameter `name` (the first one), e.g.
    /// `param("fieldSelector") == Some("spec.nodeName=node1")`.
    pub fn param(&self, name: &str) -> Option<String> {
        parse_query(&self.query)
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    /// Whether this is a watch (`watch=true` or `watch=1`).
    pub fn is_watch(&self) -> bool {
        matches!(self.param("watch").as_deref(), Some("true" | "1"))
    }

    /// Whether this is a list (a `GET` of a collection that is not a watch).
    pub fn is_list(&self) -> bool {
        self.method == "GET"
            && matches!(route(&self.path), Some(Target::Collection { .. }))
            && !self.is_watch()
    }
}

/// One `PATCH` request (see [`ApiServer::patches`]), answered or not.
#[derive(Clone, Debug)]
pub struct PatchRequest {
    /// The object's path, e.g. `/api/v1/namespaces/mesh/pods/client`.
    pub path: String,
    /// The raw query string (e.g. `&fieldManager=podlink`).
    pub query: String,
    /// The `Content-Type`, e.g. `application/merge-patch+json`.
    pub content_type: String,
    /// The patch document (`Value::Null` when it is not JSON).
    pub body: Value,
    /// The HTTP status code of the answer (200 when applied).
    pub status: u16,
    /// The `User-Agent` header.
    pub user_agent: String,
}

/// The resources the double serves; an Istio kind once per API version,
/// both versions on one store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Pods,
    Namespaces,
    Services,
    EndpointSlices,
    Nodes,
    AuthorizationPolicies,
    AuthorizationPoliciesV1beta1,
    PeerAuthentications,
    PeerAuthenticationsV1beta1,
}

/// How many stores the kinds have.
const STORES: usize = 7;

impl Kind {
    const ALL: [Kind; 9] = [
        Kind::Pods,
        Kind::Namespaces,
        Kind::Services,
        Kind::EndpointSlices,
        Kind::Nodes,
        Kind::AuthorizationPolicies,
        Kind::AuthorizationPoliciesV1beta1,
        Kind::PeerAuthentications,
        Kind::PeerAuthenticationsV1beta1,
    ];

    /// The kind a resource name (`pods`, `endpointslices`, …) names, in its
    /// storage version.
    fn of_resource(resource: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.resource() == resource && k.storage() == *k)
    }

    /// The kind of `resource` served at `group`/`version` (`""`/`v1` for the
    /// core API).
    fn at(group: &str, version: &str, resource: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.group() == group && k.version() == version && k.resource() == resource)
    }

    /// The index of the kind's store (an Istio kind's versions share one).
    fn slot(self) -> usize {
        match self {
            Kind::Pods => 0,
            Kind::Namespaces => 1,
            Kind::Services => 2,
            Kind::EndpointSlices => 3,
            Kind::Nodes => 4,
            Kind::AuthorizationPolicies | Kind::AuthorizationPoliciesV1beta1 => 5,
            Kind::PeerAuthentications | Kind::PeerAuthenticationsV1beta1 => 6,
        }
    }

    /// The version objects are stored in.
    fn storage(self) -> Kind {
        match self {
            Kind::AuthorizationPoliciesV1beta1 => Kind::AuthorizationPolicies,
            Kind::PeerAuthenticationsV1beta1 => Kind::PeerAuthentications,
            k => k,
        }
    }

    fn resource(self) -> &'static str {
        match self {
            Kind::Pods => "pods",
            Kind::Namespaces => "namespaces",
            Kind::Services => "services",
            Kind::EndpointSlices => "endpointslices",
            Kind::Nodes => "nodes",
            Kind::AuthorizationPolicies | Kind::AuthorizationPoliciesV1beta1 => {
                "authorizationpolicies"
            }
            Kind::PeerAuthentications | Kind::PeerAuthenticationsV1beta1 => "peerauthentications",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Kind::Pods => "Pod",
            Kind::Namespaces => "Namespace",
            Kind::Services => "Service",
            Kind::EndpointSlices => "EndpointSlice",
            Kind::Nodes => "Node",
            Kind::AuthorizationPolicies | Kind::AuthorizationPoliciesV1beta1 => {
                "AuthorizationPolicy"
            }
            Kind::PeerAuthentications | Kind::PeerAuthenticationsV1beta1 => "PeerAuthentication",
        }
    }

    fn group(self) -> &'static str {
        match self {
            Kind::Pods | Kind::Namespaces | Kind::Services | Kind::Nodes => "",
            Kind::EndpointSlices => "discovery.k8s.io",
            _ => "security.istio.io",
        }
    }

    fn version(self) -> &'static str {
        match self {
            Kind::AuthorizationPoliciesV1beta1 | Kind::PeerAuthenticationsV1beta1 => "v1beta1",
            _ => "v1",
        }
    }

    /// `apiVersion` of the kind's objects: `v1`, `discovery.k8s.io/v1`, …
    fn api_version(self) -> String {
        match self.group() {
            "" => self.version().to_string(),
            group => format!("{group}/{}", self.version()),
        }
    }

    /// Whether the kind is one of Istio's CRDs.
    fn is_istio(self) -> bool {
        self.group() == "security.istio.io"
    }

    fn namespaced(self) -> bool {
        !matches!(self, Kind::Namespaces | Kind::Nodes)
    }

    /// `obj` as this version serves it (its `apiVersion`, when it has one).
    fn versioned(self, mut obj: Value) -> Value {
        if let Value::Object(map) = &mut obj
            && map.contains_key("apiVersion")
        {
            map.insert("apiVersion".into(), self.api_version().into());
        }
        obj
    }

    /// The field selectors the real API server supports for this resource
    /// (`field label not supported` otherwise).
    fn fields(self) -> &'static [&'static str] {
        match self {
            Kind::Pods => &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
            Kind::Namespaces => &["metadata.name", "status.phase"],
            Kind::Nodes => &["metadata.name", "spec.unschedulable"],
            Kind::Services => &[
                "metadata.name",
                "metadata.namespace",
                "spec.clusterIP",
                "spec.type",
            ],
            Kind::EndpointSlices => &["metadata.name", "metadata.namespace", "addressType"],
            _ => &["metadata.name", "metadata.namespace"],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change of one object.
struct Event {
    rv: u64,
    kind: EventType,
    /// The object at `rv` (for `DELETED`: its last state, with `rv`).
    object: Value,
    /// The object before the change (`MODIFIED` and `DELETED`), for watchers whose
    /// selectors it matched.
    previous: Option<Value>,
}

#[derive(Default)]
struct Store {
    /// By `(namespace or "", name)`.
    objects: BTreeMap<(String, String), Value>,
    /// In resourceVersion order.
    history: Vec<Event>,
}

enum Control {
    /// Send the events up to this resourceVersion, then a bookmark.
    Bookmark(u64),
    /// Send the events up to this resourceVersion, then break the connection.
    Cut(u64),
}

struct OpenWatch {
    id: u64,
    kind: Kind,
    control: mpsc::UnboundedSender<Control>,
}

struct State {
    rv: u64,
    /// Watches from a resourceVersion below this get 410 Expired.
    oldest: u64,
    stores: [Store; STORES],
    /// Whether Istio's CRDs are installed ([`ApiServer::set_istio_crds_installed`]).
    istio: bool,
    /// The versions Istio's kinds are served under
    /// ([`ApiServer::serve_istio_versions`]).
    istio_versions: Vec<&'static str>,
    faults: HashMap<String, u16>,
    requests: Vec<Request>,
    patches: Vec<PatchRequest>,
    watches: Vec<OpenWatch>,
    next_id: u64,
    bookmark_interval: Option<Duration>,
}

impl State {
    /// Whether Istio's `kind` is served: its CRD installed, its version
    /// served.
    fn serves(&self, kind: Kind) -> bool {
        self.istio && self.istio_versions.contains(&kind.version())
    }

    fn store(&self, kind: Kind) -> &Store {
        &self.stores[kind.slot()]
    }

    fn store_mut(&mut self, kind: Kind) -> &mut Store {
        &mut self.stores[kind.slot()]
    }

    fn new_uid(&mut self) -> String {
        self.next_id += 1;
        format!(
            "{:08x}-{:04x}-4000-8000-{:012x}",
            std::process::id(),
            self.next_id >> 48,
            self.next_id & 0xffff_ffff_ffff
        )
    }

    /// Creates or replaces an object: fills its metadata, bumps the
    /// resourceVersion and records the event; an object equal to the stored one
    /// changes nothing. Returns the object's resourceVersion.
    fn put(&mut self, kind: Kind, mut obj: Value) -> Result<u64> {
        let kind = kind.storage();
        if kind.is_istio() && !self.istio {
            bail!(
                "the {} CRD is not installed (set_istio_crds_installed)",
                kind.resource()
            );
        }
        let Value::Object(map) = &mut obj else {
            bail!("a {} must be a JSON object", kind.kind());
        };
        map.insert("kind".into(), kind.kind().into());
        map.insert("apiVersion".into(), kind.api_version().into());
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(meta) = meta else {
            bail!("metadata must be an object");
        };
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .context("metadata.name is required")?
            .to_string();
        let namespace = if kind.namespaced() {
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string();
            meta.insert("namespace".into(), ns.clone().into());
            ns
        } else {
            meta.remove("namespace");
            String::new()
        };
        let key = (namespace, name.clone());
        let existing = self.store(kind).objects.get(&key).cloned();
        let uid = match existing.as_ref().map(|o| &o["metadata"]["uid"]) {
            Some(Value::String(uid)) => uid.clone(),
            _ => match meta.get("uid").and_then(Value::as_str) {
                Some(uid) if !uid.is_empty() => uid.to_string(),
                _ => self.new_uid(),
            },
        };
        meta.insert("uid".into(), uid.into());
        let created = match existing
            .as_ref()
            .map(|o| &o["metadata"]["creationTimestamp"])
        {
            Some(Value::String(t)) => t.clone(),
            _ => match meta.get("creationTimestamp").and_then(Value::as_str) {
                Some(t) if !t.is_empty() => t.to_string(),
                _ => now_rfc3339(),
            },
        };
        meta.insert("creationTimestamp".into(), created.into());
        if kind == Kind::Namespaces {
            // As the real API server does (since 1.21).
            let labels = meta
                .entry("labels")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(labels) = labels {
                labels.insert("kubernetes.io/metadata.name".into(), name.into());
            }
            if map.get("status").and_then(|s| s.get("phase")).is_none() {
                map.insert("status".into(), json!({"phase": "Active"}));
            }
        }
        if let Some(old) = &existing {
            obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
            if &obj == old {
                return Ok(rv_of(old));
            }
        }
        self.rv += 1;
        let rv = self.rv;
        obj["metadata"]["resourceVersion"] = rv.to_string().into();
        let store = self.store_mut(kind);
        store.objects.insert(key, obj.clone());
        store.history.push(Event {
            rv,
            kind: if existing.is_some() {
                EventType::Modified
            } else {
                EventType::Added
            },
            object: obj,
            previous: existing,
        });
        Ok(rv)
    }

    fn delete(&mut self, kind: Kind, namespace: &str, name: &str) -> Result<u64> {
        let key = (namespace.to_string(), name.to_string());
        let Some(old) = self.store_mut(kind).objects.remove(&key) else {
            bail!("{} {namespace}/{name} does not exist", kind.resource());
        };
        self.rv += 1;
        let rv = self.rv;
        let mut object = old.clone();
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        self.store_mut(kind).history.push(Event {
            rv,
            kind: EventType::Deleted,
            object,
            previous: Some(old),
        });
        Ok(rv)
    }
}

fn rv_of(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

struct Shared {
    state: Mutex<State>,
    /// Bumped after every change of the stores; open watches wait on it.
    changed: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn notify(&self) {
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }
}

/// The API server double. Dropping it stops the server: its listeners close and
/// every open connection is dropped.
pub struct ApiServer {
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("ApiServer")
            .field("resource_version", &st.rv)
            .field("pods", &st.store(Kind::Pods).objects.len())
            .field("namespaces", &st.store(Kind::Namespaces).objects.len())
            .field("open_watches", &st.watches.len())
            .finish()
    }
}

impl ApiServer {
    /// Starts the double's runtime (one worker thread); it serves nothing until
    /// [`ApiServer::listen_in`] or [`ApiServer::listen_local`] is called. The
    /// resourceVersion starts at 1, with no objects.
    pub fn start() -> Result<ApiServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("api-double")
            .enable_all()
            .build()
            .context("starting the API server double's runtime")?;
        let (changed, _) = watch::channel(0);
        Ok(ApiServer {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    rv: 1,
                    oldest: 0,
                    stores: Default::default(),
                    istio: true,
                    istio_versions: vec!["v1", "v1beta1"],
                    faults: HashMap::new(),
                    requests: Vec::new(),
                    patches: Vec::new(),
                    watches: Vec::new(),
                    next_id: 0,
                    bookmark_interval: None,
                }),
                changed,
            }),
            runtime: Some(runtime),
        })
    }

    fn serve(&self, listener: StdTcpListener) -> Result<SocketAddr> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = self.shared.clone();
        let runtime = self.runtime.as_ref().context("the server is stopped")?;
        runtime.spawn(async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => accept_loop(shared, listener).await,
                Err(e) => eprintln!("api double: cannot serve {addr}: {e}"),
            }
        });
        Ok(addr)
    }

    /// Listens on `127.0.0.1:<ephemeral port>` inside network namespace `netns`
    /// (`/run/netns/<netns>`): the socket is made on a thread that entered the
    /// namespace and keeps it, so clients in that namespace reach the double on
    /// their own loopback. Returns the address (`127.0.0.1:PORT`, meaningful in
    /// that namespace only). May be called for several namespaces.
    pub fn listen_in(&self, netns: &str) -> Result<SocketAddr> {
        let listener = in_netns(netns, || StdTcpListener::bind(("127.0.0.1", 0)))
            .with_context(|| format!("binding 127.0.0.1:0 in network namespace {netns}"))?;
        self.serve(listener)
    }

    /// Listens on `127.0.0.1:<ephemeral port>` of the test's own network
    /// namespace.
    pub fn listen_local(&self) -> Result<SocketAddr> {
        self.serve(StdTcpListener::bind(("127.0.0.1", 0))?)
    }

    /// A kubeconfig (YAML) for a listener at `addr`: cluster `podlink-api-double`
    /// with `server: http://<addr>` (plain HTTP), user `podlink` with the bearer
    /// [`TOKEN`], one context (namespace `default`) made current.
    pub fn kubeconfig(&self, addr: SocketAddr) -> String {
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: podlink-api-double
  cluster:
    server: http://{addr}
users:
- name: podlink
  user:
    token: {TOKEN}
contexts:
- name: podlink-api-double
  context:
    cluster: podlink-api-double
    user: podlink
    namespace: default
current-context: podlink-api-double
"
        )
    }

    /// Writes [`ApiServer::kubeconfig`] of `addr` to `path`.
    pub fn write_kubeconfig(&self, addr: SocketAddr, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.kubeconfig(addr))
            .with_context(|| format!("writing {}", path.display()))
    }

    fn change(&self, f: impl FnOnce(&mut State) -> Result<u64>) -> Result<String> {
        let rv = f(&mut self.shared.lock())?;
        self.shared.notify();
        Ok(rv.to_string())
    }

    /// Creates or replaces (whole, like `kubectl replace`: annotations a client
    /// patched are gone unless `pod` has them) a Pod: `kind`/`apiVersion` are
    /// set, `metadata.namespace` defaults to `default`, `uid` and
    /// `creationTimestamp` are kept from the stored pod or made. Records `ADDED` or
    /// `MODIFIED`; a pod equal to the stored one changes nothing. Returns the pod's
    /// resourceVersion. The namespace need not exist.
    pub fn apply_pod(&self, pod: Value) -> Result<String> {
        self.change(|st| st.put(Kind::Pods, pod))
    }

    /// As [`ApiServer::apply_pod`], for a Namespace; the server adds the label
    /// `kubernetes.io/metadata.name=<name>` and `status.phase: Active` as the real
    /// one does.
    pub fn apply_namespace(&self, namespace: Value) -> Result<String> {
        self.change(|st| st.put(Kind::Namespaces, namespace))
    }

    /// Deletes a pod at once (no graceful termination: one `DELETED` event whose
    /// object is the pod's last state with the new resourceVersion). Returns that
    /// resourceVersion; fails if the pod does not exist.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> Result<String> {
        self.change(|st| st.delete(Kind::Pods, namespace, name))
    }

    /// Deletes a namespace at once (its pods are left alone: delete them first
    /// if the test wants them gone).
    pub fn delete_namespace(&self, name: &str) -> Result<String> {
        self.change(|st| st.delete(Kind::Namespaces, "", name))
    }

    /// Creates or replaces an object of `resource` (`pods`, `namespaces`,
    /// `services`, `endpointslices`, `nodes`, `authorizationpolicies`,
    /// `peerauthentications`), as [`ApiServer::apply_pod`] does a pod:
    /// `kind` and `apiVersion` are set (an Istio object is stored as
    /// `security.istio.io/v1` and served under both versions),
    /// `metadata.namespace` defaults to `default` for a namespaced kind.
    /// Returns the object's resourceVersion. Fails for an unknown resource, and
    /// for an Istio kind while its CRDs are not installed.
    pub fn apply(&self, resource: &str, object: Value) -> Result<String> {
        let kind = Kind::of_resource(resource)
            .with_context(|| format!("the double does not serve {resource:?}"))?;
        self.change(|st| st.put(kind, object))
    }

    /// Deletes an object of `resource` at once (`namespace` is ignored for
    /// a cluster-scoped kind). Returns the resourceVersion of the `DELETED`
    /// event; fails if the object does not exist.
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Result<String> {
        let kind = Kind::of_resource(resource)
            .with_context(|| format!("the double does not serve {resource:?}"))?;
        let namespace = if kind.namespaced() { namespace } else { "" };
        self.change(|st| st.delete(kind, namespace, name))
    }

    /// The stored object of `resource` (`namespace` ignored for a
    /// cluster-scoped kind), in its storage version.
    pub fn object(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = Kind::of_resource(resource)?;
        let namespace = if kind.namespaced() { namespace } else { "" };
        let st = self.shared.lock();
        st.store(kind)
            .objects
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Installs (`true`, the default) or removes Istio's CRDs
    /// (`authorizationpolicies` and `peerauthentications.security.istio.io`).
    /// Removed, every request under `/apis/security.istio.io/` is answered 404
    /// `NotFound` with the `Status` an API server sends for a resource it does
    /// not serve, the open watches of those kinds are cut, and their objects are
    /// gone (as deleting a CRD deletes its objects); installed again, they
    /// are served empty.
    pub fn set_istio_crds_installed(&self, installed: bool) {
        let mut st = self.shared.lock();
        if st.istio == installed {
            return;
        }
        st.istio = installed;
        if !installed {
            let rv = st.rv;
            st.watches.retain(|w| {
                if w.kind.is_istio() {
                    let _ = w.control.send(Control::Cut(rv));
                    false
                } else {
                    true
                }
            });
            for kind in [Kind::AuthorizationPolicies, Kind::PeerAuthentications] {
                *st.store_mut(kind) = Store::default();
            }
        }
        drop(st);
        self.shared.notify();
    }

    /// Serves Istio's kinds under `versions` only (`v1`, `v1beta1`; both at
    /// start), as Istio releases before 1.22 serve only `v1beta1`: a request
    /// under another version is answered 404 `NotFound` as for a resource the
    /// server does not serve, and the open watches of that version are cut.
    /// The objects stay, served under the versions left.
    pub fn serve_istio_versions(&self, versions: &[&'static str]) {
        let mut st = self.shared.lock();
        st.istio_versions = versions.to_vec();
        let rv = st.rv;
        let served: Vec<Kind> = Kind::ALL.into_iter().filter(|k| st.serves(*k)).collect();
        st.watches.retain(|w| {
            if w.kind.is_istio() && !served.contains(&w.kind) {
                let _ = w.control.send(Control::Cut(rv));
                false
            } else {
                true
            }
        });
        drop(st);
        self.shared.notify();
    }

    /// The stored pod (with `kind` and `apiVersion`), e.g. to read what a client
    /// patched.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        let st = self.shared.lock();
        st.store(Kind::Pods)
            .objects
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// The stored namespace.
    pub fn namespace(&self, name: &str) -> Option<Value> {
        let st = self.shared.lock();
        st.store(Kind::Namespaces)
            .objects
            .get(&(String::new(), name.to_string()))
            .cloned()
    }

    /// All stored pods, by namespace and name.
    pub fn pods(&self) -> Vec<Value> {
        let st = self.shared.lock();
        st.store(Kind::Pods).objects.values().cloned().collect()
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.lock().requests.clone()
    }

    /// Every `PATCH` request so far, in order, with its status.
    pub fn patches(&self) -> Vec<PatchRequest> {
        self.shared.lock().patches.clone()
    }

    /// How many watches of `resource` (`pods`, `namespaces`, …; an Istio kind's
    /// of both versions) are open (not yet
    /// ended by their client, their timeout or [`ApiServer::cut_watches`]).
    pub fn open_watches(&self, resource: &str) -> usize {
        let st = self.shared.lock();
        st.watches
            .iter()
            .filter(|w| w.kind.resource() == resource)
            .count()
    }

    /// From now on every request on `resource` (`pods`, `namespaces`, …, an
    /// Istio kind's under both versions: list,
    /// watch, get and patch) is answered `code` with the `Status` the real server
    /// sends: 401 `Unauthorized`; 403 `Forbidden` with the RBAC message
    /// (`pods is forbidden: User "<USER>" cannot list resource "pods" in API group
    /// "" at the cluster scope`); 404 `NotFound`; 429 `TooManyRequests`; 500
    /// `InternalError`; 503 `ServiceUnavailable`; others with a generic reason.
    /// Watches already open go on (as they do when RBAC changes): cut them with
    /// [`ApiServer::cut_watches`].
    pub fn fail(&self, resource: &str, code: u16) {
        self.shared.lock().faults.insert(resource.to_string(), code);
    }

    /// Ends the fault [`ApiServer::fail`] set on `resource`.
    pub fn heal(&self, resource: &str) {
        self.shared.lock().faults.remove(resource);
    }

    /// Breaks every open watch: each gets the events up to now, then its
    /// connection is closed without the chunked terminator (the client sees the
    /// stream break, as when an API server or a load balancer goes away). No
    /// change made after this call reaches those watches; [`ApiServer::open_watches`]
    /// counts them no more.
    pub fn cut_watches(&self) {
        let mut st = self.shared.lock();
        let rv = st.rv;
        for w in st.watches.drain(..) {
            let _ = w.control.send(Control::Cut(rv));
        }
    }

    /// Sends a `BOOKMARK` carrying the current resourceVersion on every open watch
    /// that asked for bookmarks (`allowWatchBookmarks=true`), after the events up
    /// to now ("API concepts", "Watch bookmarks"):
    /// `{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"M"}}}`.
    pub fn bookmark(&self) {
        let st = self.shared.lock();
        for w in &st.watches {
            let _ = w.control.send(Control::Bookmark(st.rv));
        }
    }

    /// Bookmarks every `interval` on watches opened from now on that asked for
    /// them (the real server sends one about every minute); `None` (the default):
    /// only [`ApiServer::bookmark`] sends them.
    pub fn set_bookmark_interval(&self, interval: Option<Duration>) {
        self.shared.lock().bookmark_interval = interval;
    }

    /// Compacts the history: the resourceVersion moves on by one (no object
    /// changes) and every resourceVersion from before is too old, so a watch
    /// resuming from one gets HTTP 200 and then one `ERROR` event with a 410
    /// `Expired` Status, `too old resource version: N (M)` ("API concepts", "410
    /// Gone responses"); continue tokens from before expire too (410 on the list).
    /// Watches open now go on. Returns the new resourceVersion.
    pub fn compact(&self) -> String {
        let mut st = self.shared.lock();
        st.rv += 1;
        st.oldest = st.rv;
        st.rv.to_string()
    }

    /// Waits up to `timeout` (polling every 10 ms) until `pred(self)` holds;
    /// fails naming `what` otherwise.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&ApiServer) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !pred(self) {
            if Instant::now() > deadline {
                bail!("{what}: not after {timeout:?} ({self:?})");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Callable from async code too (where a blocking shutdown panics).
            runtime.shutdown_background();
        }
    }
}

// ---------------------------------------------------------------------------
// HTTP

/// A response body: a whole JSON document, or the lines of a watch, fed by the
/// watch's task; an `Err` from the task breaks the connection.
struct ApiBody(BodyInner);

enum BodyInner {
    Full(Option<Bytes>),
    Stream {
        rx: mpsc::UnboundedReceiver<io::Result<Bytes>>,
        error: Option<io::Error>,
    },
}

impl Body for ApiBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        match &mut self.get_mut().0 {
            BodyInner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            BodyInner::Stream { rx, error } => {
                if let Some(e) = error.take() {
                    return Poll::Ready(Some(Err(e)));
                }
                match ready!(rx.poll_recv(cx)) {
                    Some(Ok(bytes)) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                    Some(Err(e)) => {
                        // Pending once first, so that hyper flushes the lines
                        // before it aborts the connection on the error.
                        *error = Some(e);
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    None => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.0, BodyInner::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyInner::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            BodyInner::Full(None) => SizeHint::with_exact(0),
            BodyInner::Stream { .. } => SizeHint::default(),
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: tokio::net::TcpListener) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                eprintln!("api double: accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(shared.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

fn json_response(code: u16, body: &Value) -> Response<ApiBody> {
    let mut bytes = serde_json::to_vec(body).unwrap_or_default();
    bytes.push(b'\n');
    Response::builder()
        .status(code)
        .header(CONTENT_TYPE, "application/json")
        .body(ApiBody(BodyInner::Full(Some(bytes.into()))))
        .unwrap_or_else(|_| Response::new(ApiBody(BodyInner::Full(None))))
}

/// A `Status` object ("Kubernetes API reference", `Status`).
fn status_object(code: u16, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if let Some(details) = details {
        status["details"] = details;
    }
    status
}

fn error(code: u16, reason: &str, message: &str, details: Option<Value>) -> Response<ApiBody> {
    json_response(code, &status_object(code, reason, message, details))
}

fn not_found_path() -> Response<ApiBody> {
    error(
        404,
        "NotFound",
        "the server could not find the requested resource",
        Some(json!({})),
    )
}

fn bad_request(message: &str) -> Response<ApiBody> {
    error(400, "BadRequest", message, None)
}

/// What a request is about.
enum Target {
    Collection {
        kind: Kind,
        namespace: Option<String>,
    },
    Object {
        kind: Kind,
        namespace: Option<String>,
        name: String,
    },
    Version,
    Health,
}

fn route(path: &str) -> Option<Target> {
    match path {
        "/version" | "/version/" => return Some(Target::Version),
        "/healthz" | "/livez" | "/readyz" => return Some(Target::Health),
        _ => {}
    }
    let (group, version, rest) = match path.strip_prefix("/api/v1/") {
        Some(rest) => ("", "v1", rest),
        None => {
            let rest = path.strip_prefix("/apis/")?;
            let mut parts = rest.splitn(3, '/');
            (parts.next()?, parts.next()?, parts.next()?)
        }
    };
    let segments: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    let at = |resource: &str| Kind::at(group, version, resource);
    let s = |s: &str| s.to_string();
    Some(match segments.as_slice() {
        ["namespaces"] if group.is_empty() => Target::Collection {
            kind: Kind::Namespaces,
            namespace: None,
        },
        ["namespaces", name] if group.is_empty() && !name.is_empty() => Target::Object {
            kind: Kind::Namespaces,
            namespace: None,
            name: s(name),
        },
        [resource] => Target::Collection {
            kind: at(resource)?,
            namespace: None,
        },
        [resource, name] if !name.is_empty() => {
            let kind = at(resource).filter(|k| !k.namespaced())?;
            Target::Object {
                kind,
                namespace: None,
                name: s(name),
            }
        }
        ["namespaces", ns, resource] if !ns.is_empty() => Target::Collection {
            kind: at(resource).filter(|k| k.namespaced())?,
            namespace: Some(s(ns)),
        },
        ["namespaces", ns, resource, name] if !ns.is_empty() && !name.is_empty() => {
            Target::Object {
                kind: at(resource).filter(|k| k.namespaced())?,
                namespace: Some(s(ns)),
                name: s(name),
            }
        }
        _ => return None,
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match bytes
                .get(i + 1..i + 3)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(b) => {
                    out.push(b);
                    i += 3;
                    continue;
                }
                None => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

struct Query(Vec<(String, String)>);

impl Query {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, name: &str) -> Option<bool> {
        self.get(name).map(|v| matches!(v, "true" | "1"))
    }
}

async fn handle(
    shared: Arc<Shared>,
    req: hyper::Request<Incoming>,
) -> Result<Response<ApiBody>, Infallible> {
    let header = |name| {
        req.headers()
            .get(name)
            .and_then(|v: &http::HeaderValue| v.to_str().ok())
            .map(str::to_string)
    };
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let user_agent = header(USER_AGENT).unwrap_or_default();
    let authorization = header(AUTHORIZATION);
    let content_type = header(CONTENT_TYPE).unwrap_or_default();
    let body = req.into_body();
    let mut patch_body = None;
    let response = respond(
        &shared,
        &method,
        &path,
        &query,
        authorization.as_deref(),
        &content_type,
        body,
        &mut patch_body,
    )
    .await;
    let status = response.status().as_u16();
    let mut st = shared.lock();
    if method == Method::PATCH {
        st.patches.push(PatchRequest {
            path: path.clone(),
            query: query.clone(),
            content_type,
            body: patch_body.unwrap_or(Value::Null),
            status,
            user_agent: user_agent.clone(),
        });
    }
    st.requests.push(Request {
        method: method.to_string(),
        path,
        query,
        status,
        user_agent,
        authorization,
    });
    Ok(response)
}

#[allow(clippy::too_many_arguments)]
async fn respond(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    query: &str,
    authorization: Option<&str>,
    content_type: &str,
    body: Incoming,
    patch_body: &mut Option<Value>,
) -> Response<ApiBody> {
    if authorization != Some(&format!("Bearer {TOKEN}")) {
        return error(401, "Unauthorized", "Unauthorized", None);
    }
    let Some(target) = route(path) else {
        return not_found_path();
    };
    let q = Query(parse_query(query));
    let (kind, namespace, name) = match target {
        Target::Version if method == Method::GET => {
            return json_response(
                200,
                &json!({
                    "major": "1",
                    "minor": "33",
                    "gitVersion": "v1.33.0-podlink-api-double",
                    "platform": "linux/amd64",
                }),
            );
        }
        Target::Health if method == Method::GET => {
            return Response::builder()
                .status(200)
                .header(CONTENT_TYPE, "text/plain; charset=utf-8")
                .body(ApiBody(BodyInner::Full(Some(Bytes::from_static(b"ok")))))
                .unwrap_or_else(|_| Response::new(ApiBody(BodyInner::Full(None))));
        }
        Target::Version | Target::Health => return method_not_allowed(),
        Target::Collection { kind, namespace } => (kind, namespace, None),
        Target::Object {
            kind,
            namespace,
            name,
        } => (kind, namespace, Some(name)),
    };
    let watch = q.flag("watch") == Some(true);
    let verb = match (method, &name) {
        (&Method::GET, None) if watch => "watch",
        (&Method::GET, None) => "list",
        (&Method::GET, Some(_)) => "get",
        (&Method::PATCH, Some(_)) => "patch",
        _ => return method_not_allowed(),
    };
    if kind.is_istio() && !shared.lock().serves(kind) {
        // As for any resource the server does not serve.
        return not_found_path();
    }
    let fault = shared.lock().faults.get(kind.resource()).copied();
    if let Some(code) = fault {
        return fault_response(code, kind, verb, namespace.as_deref(), name.as_deref());
    }
    let ns_key = namespace.clone().unwrap_or_default();
    match (verb, name) {
        ("watch", _) => start_watch(shared, kind, namespace, &q),
        ("list", _) => list(shared, kind, namespace, &q),
        ("get", Some(name)) => {
            let st = shared.lock();
            match st.store(kind).objects.get(&(ns_key, name.clone())) {
                Some(obj) => json_response(200, &kind.versioned(obj.clone())),
                None => object_not_found(kind, &name),
            }
        }
        ("patch", Some(name)) => {
            patch(
                shared,
                kind,
                ns_key,
                name,
                &q,
                content_type,
                body,
                patch_body,
            )
            .await
        }
        _ => method_not_allowed(),
    }
}

fn method_not_allowed() -> Response<ApiBody> {
    error(
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource",
        Some(json!({})),
    )
}

fn object_not_found(kind: Kind, name: &str) -> Response<ApiBody> {
    let resource = kind.resource();
    error(
        404,
        "NotFound",
        &format!("{resource} \"{name}\" not found"),
        Some(json!({"name": name, "kind": resource})),
    )
}

/// The answer of an injected fault, as the real server words it.
fn fault_response(
    code: u16,
    kind: Kind,
    verb: &str,
    namespace: Option<&str>,
    name: Option<&str>,
) -> Response<ApiBody> {
    let resource = kind.resource();
    match code {
        401 => error(401, "Unauthorized", "Unauthorized", None),
        403 => {
            let subject = match name {
                Some(name) => format!("{resource} \"{name}\""),
                None => resource.to_string(),
            };
            let scope = match namespace {
                Some(ns) => format!("in the namespace \"{ns}\""),
                None => "at the cluster scope".to_string(),
            };
            let mut details = json!({"kind": resource});
            if let Some(name) = name {
                details["name"] = name.into();
            }
            error(
                403,
                "Forbidden",
                &format!(
                    "{subject} is forbidden: User \"{USER}\" cannot {verb} resource \"{resource}\" in API group \"{}\" {scope}",
                    kind.group()
                ),
                Some(details),
            )
        }
        404 => match name {
            Some(name) => object_not_found(kind, name),
            None => not_found_path(),
        },
        410 => error(410, "Gone", "the resource is gone (injected fault)", None),
        429 => error(
            429,
            "TooManyRequests",
            "the server has received too many requests and has asked us to try again later",
            None,
        ),
        500 => error(
            500,
            "InternalError",
            "Internal error occurred: injected fault",
            Some(json!({"causes": [{"message": "injected fault"}]})),
        ),
        503 => error(
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
            None,
        ),
        504 => error(
            504,
            "Timeout",
            "the server was unable to return a response in the time allotted, but may still be processing the request",
            None,
        ),
        code => {
            let reason = StatusCode::from_u16(code)
                .ok()
                .and_then(|c| c.canonical_reason())
                .unwrap_or("Unknown")
                .replace(' ', "");
            error(code, &reason, "injected fault", None)
        }
    }
}

// ---------------------------------------------------------------------------
// Selectors ("Field selectors", "Labels and selectors" in the Kubernetes docs)

enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

struct FieldReq {
    path: String,
    value: String,
    equal: bool,
}

/// Which objects a list or watch is about.
struct Filter {
    namespace: Option<String>,
    fields: Vec<FieldReq>,
    labels: Vec<LabelReq>,
}

fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_set(s: &str) -> Option<Vec<String>> {
    let inner = s.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(
        inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect(),
    )
}

fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, String> {
    let bad = |term: &str| format!("unable to parse requirement: invalid label selector: {term:?}");
    split_top_level(s)
        .into_iter()
        .map(|term| {
            if let Some(key) = term.strip_prefix('!') {
                return Ok(LabelReq::NotExists(key.trim().to_string()));
            }
            if let Some((key, set)) = term.split_once(" notin ") {
                let set = parse_set(set).ok_or_else(|| bad(term))?;
                return Ok(LabelReq::NotIn(key.trim().to_string(), set));
            }
            if let Some((key, set)) = term.split_once(" in ") {
                let set = parse_set(set).ok_or_else(|| bad(term))?;
                return Ok(LabelReq::In(key.trim().to_string(), set));
            }
            if let Some((k, v)) = term.split_once("!=") {
                return Ok(LabelReq::Ne(k.trim().into(), v.trim().into()));
            }
            if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                return Ok(LabelReq::Eq(k.trim().into(), v.trim().into()));
            }
            if term.contains([' ', '(', ')']) {
                return Err(bad(term));
            }
            Ok(LabelReq::Exists(term.to_string()))
        })
        .collect()
}

fn parse_field_selector(kind: Kind, s: &str) -> Result<Vec<FieldReq>, String> {
    split_top_level(s)
        .into_iter()
        .map(|term| {
            let (path, value, equal) = if let Some((k, v)) = term.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (k, v, true)
            } else {
                return Err(format!(
                    "invalid selector: '{s}'; can't understand '{term}'"
                ));
            };
            let path = path.trim();
            if !kind.fields().contains(&path) {
                return Err(format!("field label not supported: {path}"));
            }
            Ok(FieldReq {
                path: path.to_string(),
                value: value.trim().to_string(),
                equal,
            })
        })
        .collect()
}

fn field_value(obj: &Value, path: &str) -> String {
    let v = path.split('.').fold(obj, |v, key| &v[key]);
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    }
}

impl Filter {
    fn parse(kind: Kind, namespace: Option<String>, q: &Query) -> Result<Filter, String> {
        Ok(Filter {
            namespace,
            fields: parse_field_selector(kind, q.get("fieldSelector").unwrap_or(""))?,
            labels: parse_label_selector(q.get("labelSelector").unwrap_or(""))?,
        })
    }

    fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && obj["metadata"]["namespace"].as_str() != Some(ns)
        {
            return false;
        }
        let fields_ok = self
            .fields
            .iter()
            .all(|f| (field_value(obj, &f.path) == f.value) == f.equal);
        let labels = &obj["metadata"]["labels"];
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Eq(k, v) => label(k) == Some(v),
            LabelReq::Ne(k, v) => label(k) != Some(v),
            LabelReq::In(k, set) => label(k).is_some_and(|l| set.iter().any(|v| v == l)),
            LabelReq::NotIn(k, set) => !label(k).is_some_and(|l| set.iter().any(|v| v == l)),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
        });
        fields_ok && labels_ok
    }

    /// The event a watcher with this filter gets for `event`: a change that moves
    /// an object into the selection is `ADDED`, out of it `DELETED` (with the
    /// previous content and the event's resourceVersion), as the API server's
    /// watch cache does.
    fn convert(&self, event: &Event) -> Option<(EventType, Value)> {
        let now = event.kind != EventType::Deleted && self.matches(&event.object);
        let before = event.previous.as_ref().is_some_and(|p| self.matches(p));
        match (before, now) {
            (false, true) => Some((EventType::Added, event.object.clone())),
            (true, true) => Some((EventType::Modified, event.object.clone())),
            (true, false) if event.kind == EventType::Deleted => {
                Some((EventType::Deleted, event.object.clone()))
            }
            (true, false) => {
                let mut old = event.previous.clone()?;
                old["metadata"]["resourceVersion"] = event.rv.to_string().into();
                Some((EventType::Deleted, old))
            }
            (false, false) => None,
        }
    }
}

// ---------------------------------------------------------------------------
// LIST ("Retrieving large results sets in chunks", "Resource versions")

fn encode_continue(rv: u64, key: &(String, String)) -> String {
    format!("{rv}/{}/{}", key.0, key.1)
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> Option<(u64, (String, String))> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.splitn(3, '/');
    let rv = parts.next()?.parse().ok()?;
    Some((rv, (parts.next()?.to_string(), parts.next()?.to_string())))
}

fn list(
    shared: &Arc<Shared>,
    kind: Kind,
    namespace: Option<String>,
    q: &Query,
) -> Response<ApiBody> {
    let filter = match Filter::parse(kind, namespace, q) {
        Ok(f) => f,
        Err(e) => return bad_request(&e),
    };
    let limit = match q
        .get("limit")
        .filter(|l| !l.is_empty())
        .map(str::parse::<usize>)
    {
        None => None,
        Some(Ok(0)) => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => return bad_request("limit must be a non-negative integer"),
    };
    let st = shared.lock();
    let (rv, after) = match q.get("continue").filter(|c| !c.is_empty()) {
        None => (st.rv, None),
        Some(token) => match decode_continue(token) {
            None => {
                return bad_request(
                    "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)",
                );
            }
            Some((rv, _)) if rv < st.oldest => {
                return error(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
                    None,
                );
            }
            Some((rv, key)) => (rv, Some(key)),
        },
    };
    if q.get("resourceVersionMatch") == Some("Exact")
        && let Some(Ok(n)) = q.get("resourceVersion").map(str::parse::<u64>)
        && n < st.oldest
    {
        return error(
            410,
            "Expired",
            &format!("too old resource version: {n} ({})", st.oldest),
            None,
        );
    }
    let store = st.store(kind);
    let mut matching = store
        .objects
        .iter()
        .filter(|(key, _)| after.as_ref().is_none_or(|a| *key > a))
        .filter(|(_, obj)| filter.matches(obj));
    let mut items = Vec::new();
    let mut last = None;
    for (key, obj) in matching.by_ref() {
        if limit.is_some_and(|l| items.len() >= l) {
            break;
        }
        let mut item = obj.clone();
        if let Value::Object(map) = &mut item {
            // Items of a list carry no kind/apiVersion, as the real server's.
            map.remove("kind");
            map.remove("apiVersion");
        }
        items.push(item);
        last = Some(key.clone());
    }
    // The loop stopped early iff there is a match beyond the page: look again.
    let more = limit.is_some_and(|l| items.len() >= l)
        && store
            .objects
            .iter()
            .filter(|(key, _)| last.as_ref().is_some_and(|a| *key > a))
            .any(|(_, obj)| filter.matches(obj));
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if more && let Some(last) = &last {
        metadata["continue"] = encode_continue(rv, last).into();
    }
    json_response(
        200,
        &json!({
            "kind": format!("{}List", kind.kind()),
            "apiVersion": kind.api_version(),
            "metadata": metadata,
            "items": items,
        }),
    )
}

// ---------------------------------------------------------------------------
// PATCH ("Server-side apply" is not served: 415)

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(map) = target else {
        return;
    };
    for (key, value) in patch {
        if value.is_null() {
            map.remove(key);
        } else {
            merge_patch(map.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn patch(
    shared: &Arc<Shared>,
    kind: Kind,
    namespace: String,
    name: String,
    q: &Query,
    content_type: &str,
    body: Incoming,
    patch_body: &mut Option<Value>,
) -> Response<ApiBody> {
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return bad_request(&format!("reading the body: {e}")),
    };
    let parsed: Option<Value> = serde_json::from_slice(&bytes).ok();
    patch_body.clone_from(&parsed);
    let media = content_type.split(';').next().unwrap_or("").trim();
    if !matches!(
        media,
        "application/merge-patch+json" | "application/strategic-merge-patch+json"
    ) {
        return error(
            415,
            "UnsupportedMediaType",
            &format!(
                "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (this double got {media:?})"
            ),
            None,
        );
    }
    let Some(doc) = parsed else {
        return bad_request("error decoding patch: invalid JSON");
    };
    if !doc.is_object() {
        return bad_request("error decoding patch: the patch must be a JSON object");
    }
    let dry_run = q.get("dryRun").is_some_and(|d| !d.is_empty());
    let response = {
        let mut st = shared.lock();
        let key = (namespace, name.clone());
        let Some(old) = st.store(kind).objects.get(&key).cloned() else {
            return object_not_found(kind, &name);
        };
        if let Some(Value::String(wanted)) =
            doc.get("metadata").and_then(|m| m.get("resourceVersion"))
            && wanted != old["metadata"]["resourceVersion"].as_str().unwrap_or("")
        {
            return error(
                409,
                "Conflict",
                &format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                    kind.resource()
                ),
                Some(json!({"name": name, "kind": kind.resource()})),
            );
        }
        let mut new = old.clone();
        merge_patch(&mut new, &doc);
        // What a patch cannot change.
        for field in ["kind", "apiVersion"] {
            new[field] = old[field].clone();
        }
        if !new["metadata"].is_object() {
            new["metadata"] = json!({});
        }
        for field in ["name", "namespace", "uid", "creationTimestamp"] {
            match old["metadata"].get(field) {
                Some(v) => new["metadata"][field] = v.clone(),
                None => {
                    if let Some(m) = new["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
        }
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if dry_run || new == old {
            json_response(200, &kind.versioned(new))
        } else {
            match st.put(kind, new) {
                Ok(_) => match st.store(kind).objects.get(&key) {
                    Some(stored) => json_response(200, &kind.versioned(stored.clone())),
                    None => error(500, "InternalError", "the patched object vanished", None),
                },
                Err(e) => error(422, "Invalid", &e.to_string(), None),
            }
        }
    };
    shared.notify();
    response
}

// ---------------------------------------------------------------------------
// WATCH ("Efficient detection of changes", "Watch bookmarks", "410 Gone
// responses", "Streaming lists")

fn event_line(kind: EventType, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": kind.as_str(), "object": object})).unwrap_or_default();
    line.push(b'\n');
    line.into()
}

fn bookmark_line(kind: Kind, rv: u64, initial_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        metadata["annotations"] = json!({INITIAL_EVENTS_END: "true"});
    }
    let mut line = serde_json::to_vec(&json!({
        "type": "BOOKMARK",
        "object": {"kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": metadata},
    }))
    .unwrap_or_default();
    line.push(b'\n');
    line.into()
}

fn stream_response(rx: mpsc::UnboundedReceiver<io::Result<Bytes>>) -> Response<ApiBody> {
    Response::builder()
        .status(200)
        .header(CONTENT_TYPE, "application/json")
        .header("Cache-Control", "no-cache, private")
        .body(ApiBody(BodyInner::Stream { rx, error: None }))
        .unwrap_or_else(|_| Response::new(ApiBody(BodyInner::Full(None))))
}

struct WatchTask {
    shared: Arc<Shared>,
    id: u64,
    kind: Kind,
    filter: Filter,
    cursor: u64,
    bookmarks: bool,
    timeout: Duration,
    interval: Option<Duration>,
    tx: mpsc::UnboundedSender<io::Result<Bytes>>,
    control: mpsc::UnboundedReceiver<Control>,
    changed: watch::Receiver<u64>,
}

fn start_watch(
    shared: &Arc<Shared>,
    kind: Kind,
    namespace: Option<String>,
    q: &Query,
) -> Response<ApiBody> {
    let filter = match Filter::parse(kind, namespace, q) {
        Ok(f) => f,
        Err(e) => return bad_request(&e),
    };
    let timeout = match q.get("timeoutSeconds").filter(|t| !t.is_empty()) {
        None => DEFAULT_WATCH_TIMEOUT,
        Some(t) => match t.parse::<u64>() {
            Ok(0) => DEFAULT_WATCH_TIMEOUT,
            Ok(s) => Duration::from_secs(s),
            Err(_) => return bad_request("timeoutSeconds must be a non-negative integer"),
        },
    };
    let bookmarks = q.flag("allowWatchBookmarks") == Some(true);
    let send_initial = q.flag("sendInitialEvents");
    if send_initial == Some(true) {
        let mut causes = Vec::new();
        if q.get("resourceVersionMatch") != Some("NotOlderThan") {
            causes.push("resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan");
        }
        if !bookmarks {
            causes.push("allowWatchBookmarks: Forbidden: sendInitialEvents requires allowWatchBookmarks=true");
        }
        if !causes.is_empty() {
            return error(
                422,
                "Invalid",
                &format!(
                    "ListOptions.meta.k8s.io \"\" is invalid: {}",
                    causes.join(", ")
                ),
                Some(json!({"kind": "ListOptions", "group": "meta.k8s.io"})),
            );
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let mut st = shared.lock();
    let (initial, cursor) = match q
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0")
    {
        None => (send_initial != Some(false), st.rv),
        Some(rv) => {
            let Ok(n) = rv.parse::<u64>() else {
                return bad_request(&format!("invalid resource version: {rv:?}"));
            };
            if n < st.oldest {
                let status = status_object(
                    410,
                    "Expired",
                    &format!("too old resource version: {n} ({})", st.oldest),
                    None,
                );
                let _ = tx.send(Ok(event_line_error(&status)));
                return stream_response(rx);
            }
            if send_initial == Some(true) {
                (true, st.rv)
            } else {
                (false, n)
            }
        }
    };
    if initial {
        for obj in st.store(kind).objects.values() {
            if filter.matches(obj) {
                let _ = tx.send(Ok(event_line(
                    EventType::Added,
                    &kind.versioned(obj.clone()),
                )));
            }
        }
    }
    if send_initial == Some(true) {
        let _ = tx.send(Ok(bookmark_line(kind, st.rv, true)));
    }
    st.next_id += 1;
    let id = st.next_id;
    let (control_tx, control) = mpsc::unbounded_channel();
    st.watches.push(OpenWatch {
        id,
        kind,
        control: control_tx,
    });
    let task = WatchTask {
        shared: shared.clone(),
        id,
        kind,
        filter,
        cursor,
        bookmarks,
        timeout,
        interval: st.bookmark_interval,
        tx,
        control,
        // Subscribed under the lock: no change after the snapshot is missed.
        changed: shared.changed.subscribe(),
    };
    drop(st);
    tokio::spawn(task.run());
    stream_response(rx)
}

fn event_line_error(status: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": "ERROR", "object": status})).unwrap_or_default();
    line.push(b'\n');
    line.into()
}

/// Forgets an open watch when its task ends.
struct Unregister {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        self.shared.lock().watches.retain(|w| w.id != self.id);
    }
}

impl WatchTask {
    /// Sends the events after the cursor up to `upto` (default: now) that the
    /// filter selects; false once the client is gone.
    fn flush(&mut self, upto: Option<u64>) -> bool {
        let lines: Vec<Bytes> = {
            let st = self.shared.lock();
            let upto = upto.unwrap_or(st.rv).min(st.rv);
            if upto <= self.cursor {
                return !self.tx.is_closed();
            }
            let history = &st.store(self.kind).history;
            let start = history.partition_point(|e| e.rv <= self.cursor);
            let lines = history[start..]
                .iter()
                .take_while(|e| e.rv <= upto)
                .filter_map(|e| self.filter.convert(e))
                .map(|(kind, obj)| event_line(kind, &self.kind.versioned(obj)))
                .collect();
            self.cursor = upto;
            lines
        };
        lines.into_iter().all(|l| self.tx.send(Ok(l)).is_ok())
    }

    fn send_bookmark(&self) -> bool {
        !self.bookmarks
            || self
                .tx
                .send(Ok(bookmark_line(self.kind, self.cursor, false)))
                .is_ok()
    }

    async fn run(mut self) {
        let _unregister = Unregister {
            shared: self.shared.clone(),
            id: self.id,
        };
        let deadline = tokio::time::sleep(self.timeout);
        tokio::pin!(deadline);
        let mut ticker = self.interval.map(|d| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        if !self.flush(None) {
            return;
        }
        loop {
            let tick = async {
                match &mut ticker {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                control = self.control.recv() => match control {
                    Some(Control::Bookmark(rv)) => {
                        if !self.flush(Some(rv)) || !self.send_bookmark() {
                            return;
                        }
                    }
                    Some(Control::Cut(rv)) => {
                        self.flush(Some(rv));
                        let _ = self.tx.send(Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "watch cut by the test",
                        )));
                        return;
                    }
                    None => return,
                },
                changed = self.changed.changed() => {
                    if changed.is_err() || !self.flush(None) {
                        return;
                    }
                }
                () = self.tx.closed() => return,
                // The timeout ends the body cleanly (the chunked terminator).
                () = &mut deadline => return,
                () = tick => {
                    if !self.flush(None) || !self.send_bookmark() {
                        return;
                    }
                }
            }
        }
    }
}

/// The current UTC time as RFC 3339 (`2025-01-31T12:00:00Z`), as in
/// `creationTimestamp`.
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The Pod object the API server holds for a test bed pod (scheduled, running,
/// with its address).
pub fn pod_object(c: &Cluster, pod: &Pod) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod.name,
            "namespace": pod.namespace,
            "labels": pod.labels,
        },
        "spec": {
            "nodeName": c.nodes[pod.node].name,
            "serviceAccountName": pod.service_account,
            "containers": [{"name": "app", "image": "registry.example/app:1"}],
        },
        "status": {
            "phase": "Running",
            "podIP": pod.ip.to_string(),
            "podIPs": pod.ips().iter().map(|ip| json!({"ip": ip.to_string()})).collect::<Vec<_>>(),
        },
    })
}

/// A Namespace object, labelled into the mesh (ambient) when `ambient`.
pub fn namespace_object(name: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({"istio.io/dataplane-mode": "ambient"})
    } else {
        json!({})
    };
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_and_queries() {
        assert_eq!(
            percent_decode("spec.nodeName%3Dnode1"),
            "spec.nodeName=node1"
        );
        assert_eq!(percent_decode("a+b%2"), "a b%2");
        let q = parse_query("&watch=true&fieldSelector=spec.nodeName%3Dn&x");
        assert_eq!(q[0], ("watch".into(), "true".into()));
        assert_eq!(q[1].1, "spec.nodeName=n");
        assert_eq!(q[2], ("x".into(), String::new()));
    }

    #[test]
    fn selectors() {
        let pod = json!({"metadata": {"name": "a", "namespace": "ns", "labels": {"app": "web", "tier": "1"}},
                          "spec": {"nodeName": "node1"}});
        let q = |s: &str| Query(parse_query(s));
        let f = |s: &str| {
            Filter::parse(Kind::Pods, None, &q(s))
                .unwrap()
                .matches(&pod)
        };
        assert!(f("fieldSelector=spec.nodeName%3Dnode1"));
        assert!(!f("fieldSelector=spec.nodeName%3Dnode2"));
        assert!(f("fieldSelector=spec.nodeName!%3Dnode2,metadata.name%3Da"));
        assert!(f("labelSelector=app%3Dweb,tier"));
        assert!(!f("labelSelector=app!%3Dweb"));
        assert!(f("labelSelector=other!%3Dx,!other"));
        assert!(f("labelSelector=app+in+(web,%20db),tier+notin+(2)"));
        assert!(!f("labelSelector=app+notin+(web)"));
        assert!(Filter::parse(Kind::Pods, None, &q("fieldSelector=spec.bogus%3D1")).is_err());
    }

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut v = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut v, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(v, json!({"a": "z", "c": {"d": "e"}}));
    }

    #[test]
    fn continue_tokens_round_trip() {
        let key = ("ns".to_string(), "a/b".to_string());
        assert_eq!(decode_continue(&encode_continue(7, &key)), Some((7, key)));
        assert_eq!(decode_continue("zz"), None);
    }

    #[test]
    fn timestamps_are_rfc3339() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z'), "{t}");
    }
}
