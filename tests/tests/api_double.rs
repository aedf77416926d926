//! The Kubernetes API server double (`podlink_tests::api_double`) against the
//! unmodified kube-rs client: `kube::runtime::watcher` and `reflector` (with the
//! agent's versions and features), configured from the kubeconfig the double
//! writes; and the wire protocol itself, read raw. No root needed: the double
//! listens on the host loopback here.

use std::{
    fmt::Debug,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api, Client, Config, ResourceExt,
    api::{Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt, reflector, watcher},
};
use podlink_tests::api_double::{ApiServer, TOKEN, USER};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const ANNOTATION: &str = "ambient.istio.io/redirection";

fn pod(ns: &str, name: &str, node: Option<&str>, labels: Value) -> Value {
    let mut spec = json!({"containers": [{"name": "app", "image": "registry.example/app:1"}]});
    if let Some(node) = node {
        spec["nodeName"] = node.into();
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": spec,
        "status": {"phase": "Running"},
    })
}

fn namespace(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// A kube client configured from the kubeconfig the double writes, read back
/// from the file (no `KUBECONFIG`, no in-cluster environment).
async fn client(api: &ApiServer, addr: SocketAddr) -> Client {
    let path = std::env::temp_dir().join(format!(
        "podlink-api-double-{}-{}.yaml",
        std::process::id(),
        addr.port()
    ));
    api.write_kubeconfig(addr, &path).unwrap();
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    assert_eq!(config.cluster_url.to_string(), format!("http://{addr}/"));
    // HTTPS_PROXY in the environment would apply, and kube is built without
    // its http-proxy feature.
    config.proxy_url = None;
    Client::try_from(config).unwrap()
}

async fn start() -> (ApiServer, Client) {
    let api = ApiServer::start().unwrap();
    let addr = api.listen_local().unwrap();
    let client = client(&api, addr).await;
    (api, client)
}

/// A reflector driven on its own task (with kube's default backoff, as an agent
/// would), recording what the watcher yields.
struct Watched<K: kube::Resource<DynamicType = ()> + 'static> {
    store: reflector::Store<K>,
    /// `init`, `init-apply ns/name`, `init-done`, `apply ns/name rv`,
    /// `delete ns/name rv`, in order.
    log: Arc<Mutex<Vec<String>>>,
    /// Each error as `Display | Debug`.
    errors: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<K: kube::Resource<DynamicType = ()> + 'static> Drop for Watched<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn id<K: kube::Resource>(obj: &K) -> String {
    format!(
        "{}/{}",
        obj.meta().namespace.as_deref().unwrap_or(""),
        obj.meta().name.as_deref().unwrap_or("")
    )
}

fn watch<K>(api: Api<K>, config: watcher::Config) -> Watched<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let log = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let (l, e) = (log.clone(), errors.clone());
    let task = tokio::spawn(async move {
        let stream = reflector(writer, watcher(api, config)).default_backoff();
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => l.lock().unwrap().push(match &event {
                    watcher::Event::Init => "init".to_string(),
                    watcher::Event::InitApply(o) => format!("init-apply {}", id(o)),
                    watcher::Event::InitDone => "init-done".to_string(),
                    watcher::Event::Apply(o) => {
                        format!(
                            "apply {} {}",
                            id(o),
                            o.resource_version().unwrap_or_default()
                        )
                    }
                    watcher::Event::Delete(o) => {
                        format!(
                            "delete {} {}",
                            id(o),
                            o.resource_version().unwrap_or_default()
                        )
                    }
                }),
                Err(err) => e.lock().unwrap().push(format!("{err} | {err:?}")),
            }
        }
    });
    Watched {
        store,
        log,
        errors,
        task,
    }
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Watched<K> {
    /// The `ns/name`s in the store, sorted.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.store.state().iter().map(|o| id(o.as_ref())).collect();
        names.sort();
        names
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
    }

    fn object(&self, ns: &str, name: &str) -> Option<Arc<K>> {
        self.store
            .state()
            .into_iter()
            .find(|o| id(o.as_ref()) == format!("{ns}/{name}"))
    }

    /// Waits until the store holds exactly `names` (`ns/name`, any order).
    async fn wait_names(&self, names: &[&str]) {
        let mut want: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        want.sort();
        eventually(
            || self.names() == want,
            || {
                format!(
                    "store {:?}, wanted {want:?}; log {:?}; errors {:?}",
                    self.names(),
                    self.log(),
                    self.errors()
                )
            },
        )
        .await;
    }
}

/// Waits (10 s at most, polling every 10 ms) until `cond` holds; panics with
/// `what()` otherwise.
async fn eventually(mut cond: impl FnMut() -> bool, what: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "not after 10 s: {}", what());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The requests on `path` (exact) that are watches, or lists.
fn watches_of(api: &ApiServer, path: &str) -> Vec<podlink_tests::api_double::Request> {
    api.requests()
        .into_iter()
        .filter(|r| r.path == path && r.is_watch())
        .collect()
}

fn lists_of(api: &ApiServer, path: &str) -> Vec<podlink_tests::api_double::Request> {
    api.requests()
        .into_iter()
        .filter(|r| r.path == path && r.is_list())
        .collect()
}

#[tokio::test]
async fn the_reflector_lists_then_follows_added_modified_deleted() {
    let (api, client) = start().await;
    api.apply_namespace(namespace("a", json!({}))).unwrap();
    api.apply_pod(pod("a", "one", Some("node1"), json!({"app": "web"})))
        .unwrap();
    api.apply_pod(pod("a", "two", Some("node1"), json!({})))
        .unwrap();
    api.apply_pod(pod("b", "three", Some("node2"), json!({})))
        .unwrap();

    let pods = watch(Api::<Pod>::all(client.clone()), watcher::Config::default());
    let in_b = watch(
        Api::<Pod>::namespaced(client.clone(), "b"),
        watcher::Config::default(),
    );
    let namespaces = watch(
        Api::<Namespace>::all(client.clone()),
        watcher::Config::default(),
    );
    pods.wait_names(&["a/one", "a/two", "b/three"]).await;
    in_b.wait_names(&["b/three"]).await;
    namespaces.wait_names(&["/a"]).await;
    eventually(|| api.open_watches("pods") == 2, || format!("{api:?}")).await;

    // What kube 5's watcher sends: a list with limit=500 and no resourceVersion,
    // then a watch from the list's resourceVersion with bookmarks and
    // timeoutSeconds=290.
    let list = &lists_of(&api, "/api/v1/pods")[0];
    assert_eq!(list.param("limit").as_deref(), Some("500"), "{list:?}");
    assert_eq!(list.param("resourceVersion"), None, "{list:?}");
    let w = &watches_of(&api, "/api/v1/pods")[0];
    assert_eq!(
        w.param("allowWatchBookmarks").as_deref(),
        Some("true"),
        "{w:?}"
    );
    assert_eq!(w.param("timeoutSeconds").as_deref(), Some("290"), "{w:?}");
    assert_eq!(w.param("sendInitialEvents"), None, "{w:?}");
    assert_eq!(w.param("resourceVersion").as_deref(), Some("5"), "{w:?}");
    assert_eq!(
        w.authorization.as_deref(),
        Some(format!("Bearer {TOKEN}").as_str())
    );
    // kube 5 sets no User-Agent of its own (a client adds one through
    // Config::headers if it wants to be told apart).
    assert_eq!(w.user_agent, "", "{w:?}");
    assert_eq!(watches_of(&api, "/api/v1/namespaces/b/pods").len(), 1);

    // ADDED.
    let rv = api.apply_pod(pod("b", "four", None, json!({}))).unwrap();
    pods.wait_names(&["a/one", "a/two", "b/four", "b/three"])
        .await;
    in_b.wait_names(&["b/four", "b/three"]).await;
    assert!(
        pods.log().contains(&format!("apply b/four {rv}")),
        "{:?}",
        pods.log()
    );
    // MODIFIED.
    let rv = api
        .apply_pod(pod("a", "one", Some("node1"), json!({"app": "db"})))
        .unwrap();
    eventually(
        || {
            pods.object("a", "one")
                .is_some_and(|p| p.labels().get("app").map(String::as_str) == Some("db"))
        },
        || format!("{:?}", pods.log()),
    )
    .await;
    assert!(pods.log().contains(&format!("apply a/one {rv}")));
    assert_eq!(
        pods.object("a", "one").unwrap().resource_version(),
        Some(rv)
    );
    // DELETED.
    let rv = api.delete_pod("b", "three").unwrap();
    pods.wait_names(&["a/one", "a/two", "b/four"]).await;
    in_b.wait_names(&["b/four"]).await;
    assert!(pods.log().contains(&format!("delete b/three {rv}")));
    // Namespaces too (the server labels each with its name).
    api.apply_namespace(namespace(
        "a",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    api.apply_namespace(namespace("b", json!({}))).unwrap();
    namespaces.wait_names(&["/a", "/b"]).await;
    eventually(
        || {
            namespaces.object("", "a").is_some_and(|n| {
                n.labels()
                    .get("istio.io/dataplane-mode")
                    .map(String::as_str)
                    == Some("ambient")
                    && n.labels()
                        .get("kubernetes.io/metadata.name")
                        .map(String::as_str)
                        == Some("a")
            })
        },
        || format!("{:?}", namespaces.log()),
    )
    .await;
    api.delete_namespace("b").unwrap();
    namespaces.wait_names(&["/a"]).await;
    for w in [&pods.errors(), &in_b.errors(), &namespaces.errors()] {
        assert!(w.is_empty(), "{w:?}");
    }
}

#[tokio::test]
async fn selectors_pick_this_nodes_pods_as_they_move_in_and_out() {
    let (api, client) = start().await;
    api.apply_pod(pod("a", "p1", Some("node1"), json!({"app": "web"})))
        .unwrap();
    api.apply_pod(pod("a", "p2", Some("node2"), json!({"app": "web"})))
        .unwrap();
    api.apply_pod(pod("a", "p3", None, json!({"app": "db"})))
        .unwrap();

    let mine = watch(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields("spec.nodeName=node1"),
    );
    let web = watch(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels("app=web,tier!=db"),
    );
    mine.wait_names(&["a/p1"]).await;
    web.wait_names(&["a/p1", "a/p2"]).await;
    let selectors: Vec<_> = api
        .requests()
        .iter()
        .filter_map(|r| r.param("fieldSelector"))
        .collect();
    assert!(
        selectors.iter().all(|s| s == "spec.nodeName=node1"),
        "{selectors:?}"
    );
    assert_eq!(
        selectors.len(),
        2,
        "a list and a watch: {:?}",
        api.requests()
    );

    // Scheduled onto node1: the filtered watch gets ADDED.
    api.apply_pod(pod("a", "p3", Some("node1"), json!({"app": "db"})))
        .unwrap();
    mine.wait_names(&["a/p1", "a/p3"]).await;
    // Out of the selection (a label, a node): DELETED for those watchers.
    api.apply_pod(pod(
        "a",
        "p2",
        Some("node2"),
        json!({"app": "web", "tier": "db"}),
    ))
    .unwrap();
    web.wait_names(&["a/p1"]).await;
    api.apply_pod(pod("a", "p1", Some("node2"), json!({"app": "web"})))
        .unwrap();
    mine.wait_names(&["a/p3"]).await;
    assert!(
        mine.log().iter().any(|l| l.starts_with("delete a/p1 ")),
        "{:?}",
        mine.log()
    );
    assert!(mine.errors().is_empty() && web.errors().is_empty());
}

#[tokio::test]
async fn a_bookmark_moves_the_watchers_resource_version_on() {
    let (api, client) = start().await;
    let rv_pod = api.apply_pod(pod("a", "p", None, json!({}))).unwrap();
    let pods = watch(Api::<Pod>::all(client), watcher::Config::default());
    pods.wait_names(&["a/p"]).await;
    eventually(|| api.open_watches("pods") == 1, || format!("{api:?}")).await;

    // Namespace changes move the global resourceVersion; a cut watch of pods
    // resumes from the last pod it saw.
    api.apply_namespace(namespace("a", json!({}))).unwrap();
    api.cut_watches();
    eventually(
        || watches_of(&api, "/api/v1/pods").len() == 2,
        || format!("{:?}", api.requests()),
    )
    .await;
    assert_eq!(
        watches_of(&api, "/api/v1/pods")[1].param("resourceVersion"),
        Some(rv_pod)
    );

    // With a bookmark first, it resumes from the bookmark's resourceVersion.
    let rv_ns = api.apply_namespace(namespace("b", json!({}))).unwrap();
    eventually(|| api.open_watches("pods") == 1, || format!("{api:?}")).await;
    api.bookmark();
    api.cut_watches();
    eventually(
        || watches_of(&api, "/api/v1/pods").len() == 3,
        || format!("{:?}", api.requests()),
    )
    .await;
    assert_eq!(
        watches_of(&api, "/api/v1/pods")[2].param("resourceVersion"),
        Some(rv_ns)
    );
    // Neither needed a new list, and the store is unchanged.
    assert_eq!(lists_of(&api, "/api/v1/pods").len(), 1);
    assert_eq!(pods.names(), ["a/p"]);
}

#[tokio::test]
async fn a_compacted_history_makes_the_cut_watcher_relist_and_stay_right() {
    let (api, client) = start().await;
    api.apply_pod(pod("a", "one", None, json!({}))).unwrap();
    api.apply_pod(pod("a", "two", None, json!({}))).unwrap();
    let pods = watch(Api::<Pod>::all(client), watcher::Config::default());
    pods.wait_names(&["a/one", "a/two"]).await;
    eventually(|| api.open_watches("pods") == 1, || format!("{api:?}")).await;

    api.delete_pod("a", "one").unwrap();
    pods.wait_names(&["a/two"]).await;
    // Every resourceVersion the watcher holds is now too old.
    let oldest = api.compact();
    api.cut_watches();
    // Made while the watcher reconnects, gets 410 and relists.
    api.apply_pod(pod("a", "three", None, json!({}))).unwrap();
    pods.wait_names(&["a/three", "a/two"]).await;
    eventually(
        || lists_of(&api, "/api/v1/pods").len() == 2,
        || format!("{:?}", api.requests()),
    )
    .await;

    // The 410 arrived as an ERROR event on an HTTP 200 watch, and kube reported it.
    // (resumed from the last event it saw)
    let delete_rv = watches_of(&api, "/api/v1/pods")[1]
        .param("resourceVersion")
        .unwrap();
    assert_eq!(watches_of(&api, "/api/v1/pods")[1].status, 200);
    let errors = pods.errors();
    assert!(
        errors.iter().any(|e| e
            .contains(&format!("too old resource version: {delete_rv} ({oldest})"))
            && e.contains("410")
            && e.contains("Expired")),
        "{errors:?}"
    );
    // After the relist it watches from a fresh resourceVersion.
    eventually(
        || watches_of(&api, "/api/v1/pods").len() >= 3,
        || format!("{:?}", api.requests()),
    )
    .await;
    let resumed = watches_of(&api, "/api/v1/pods")[2]
        .param("resourceVersion")
        .unwrap();
    assert!(resumed.parse::<u64>().unwrap() >= oldest.parse().unwrap());
    api.apply_pod(pod("a", "four", None, json!({}))).unwrap();
    pods.wait_names(&["a/four", "a/three", "a/two"]).await;
}

#[tokio::test]
async fn a_forbidden_api_is_reported_and_the_watcher_recovers_after_heal() {
    let (api, client) = start().await;
    api.apply_pod(pod("a", "one", None, json!({}))).unwrap();

    // Forbidden from the start: the initial list fails.
    api.fail("pods", 403);
    let pods = watch(Api::<Pod>::all(client), watcher::Config::default());
    eventually(|| !pods.errors().is_empty(), || format!("{api:?}")).await;
    let first = &pods.errors()[0];
    assert!(
        first.contains("failed to perform initial object list"),
        "{first}"
    );
    assert!(
        first.contains(&format!(
            "pods is forbidden: User \\\"{USER}\\\" cannot list resource \\\"pods\\\" in API group \\\"\\\" at the cluster scope"
        )) || first.contains(&format!(
            "pods is forbidden: User \"{USER}\" cannot list resource \"pods\" in API group \"\" at the cluster scope"
        )),
        "{first}"
    );
    assert!(first.contains("403"), "{first}");
    api.heal("pods");
    pods.wait_names(&["a/one"]).await;
    eventually(|| api.open_watches("pods") == 1, || format!("{api:?}")).await;

    // Forbidden while watching: the re-watch fails, changes pile up.
    api.fail("pods", 403);
    api.cut_watches();
    eventually(
        || {
            pods.errors()
                .iter()
                .any(|e| e.contains("failed to start watching"))
        },
        || format!("{:?}", pods.errors()),
    )
    .await;
    let failed = pods
        .errors()
        .into_iter()
        .find(|e| e.contains("failed to start watching"))
        .unwrap();
    assert!(
        failed.contains("cannot watch resource") && failed.contains("403"),
        "{failed}"
    );
    let forbidden = watches_of(&api, "/api/v1/pods")
        .into_iter()
        .filter(|r| r.status == 403)
        .count();
    assert!(forbidden >= 1);
    api.delete_pod("a", "one").unwrap();
    api.apply_pod(pod("a", "two", None, json!({}))).unwrap();
    assert_eq!(
        pods.names(),
        ["a/one"],
        "nothing reaches a forbidden watcher"
    );
    api.heal("pods");
    // Resumed from where it was: the events made meanwhile, without a relist.
    pods.wait_names(&["a/two"]).await;
    assert_eq!(
        lists_of(&api, "/api/v1/pods")
            .iter()
            .filter(|r| r.status == 200)
            .count(),
        1
    );
}

#[tokio::test]
async fn a_merge_patch_of_an_annotation_is_stored_and_watched() {
    let (api, client) = start().await;
    api.apply_pod(pod("mesh", "p", Some("node1"), json!({"app": "web"})))
        .unwrap();
    let pods = watch(Api::<Pod>::all(client.clone()), watcher::Config::default());
    pods.wait_names(&["mesh/p"]).await;
    let before = api.resource_version();

    let mesh: Api<Pod> = Api::namespaced(client.clone(), "mesh");
    let patched = mesh
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {ANNOTATION: "enabled"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        patched.annotations().get(ANNOTATION).map(String::as_str),
        Some("enabled")
    );
    assert_eq!(patched.labels().get("app").map(String::as_str), Some("web"));
    let rv = patched.resource_version().unwrap();
    assert_eq!(rv, (before + 1).to_string());
    let stored = api.pod("mesh", "p").unwrap();
    assert_eq!(stored["metadata"]["annotations"][ANNOTATION], "enabled");
    assert_eq!(stored["spec"]["nodeName"], "node1");
    // As a MODIFIED event to the watcher.
    eventually(
        || pods.log().contains(&format!("apply mesh/p {rv}")),
        || format!("{:?}", pods.log()),
    )
    .await;
    assert_eq!(
        pods.object("mesh", "p")
            .unwrap()
            .annotations()
            .get(ANNOTATION)
            .map(String::as_str),
        Some("enabled")
    );
    let patches = api.patches();
    assert_eq!(patches.len(), 1, "{patches:?}");
    assert_eq!(patches[0].path, "/api/v1/namespaces/mesh/pods/p");
    assert_eq!(patches[0].content_type, "application/merge-patch+json");
    assert_eq!(patches[0].status, 200);
    assert_eq!(
        patches[0].body["metadata"]["annotations"][ANNOTATION],
        "enabled"
    );

    // The same patch again changes nothing (no new resourceVersion).
    let again = mesh
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {ANNOTATION: "enabled"}}})),
        )
        .await
        .unwrap();
    assert_eq!(again.resource_version().unwrap(), rv);
    // A strategic merge patch removes it (null).
    let removed = mesh
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Strategic(json!({"metadata": {"annotations": {ANNOTATION: null}}})),
        )
        .await
        .unwrap();
    assert!(!removed.annotations().contains_key(ANNOTATION));
    eventually(
        || {
            pods.object("mesh", "p")
                .is_some_and(|p| !p.annotations().contains_key(ANNOTATION))
        },
        || format!("{:?}", pods.log()),
    )
    .await;
    // A stale resourceVersion in the patch is a conflict; a missing pod 404;
    // server-side apply is not served.
    let conflict = mesh
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&conflict, kube::Error::Api(s) if s.code == 409),
        "{conflict:?}"
    );
    let missing = mesh
        .patch("nope", &PatchParams::default(), &Patch::Merge(json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(&missing, kube::Error::Api(s) if s.code == 404 && s.reason == "NotFound"),
        "{missing:?}"
    );
    let apply = mesh
        .patch(
            "p",
            &PatchParams::apply("podlink"),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&apply, kube::Error::Api(s) if s.code == 415),
        "{apply:?}"
    );
    // Single-object GET.
    assert_eq!(
        mesh.get("p").await.unwrap().resource_version(),
        removed.resource_version()
    );
    let gone = mesh.get("nope").await.unwrap_err();
    assert!(
        matches!(&gone, kube::Error::Api(s) if s.code == 404),
        "{gone:?}"
    );
    assert!(pods.errors().is_empty(), "{:?}", pods.errors());
}

#[tokio::test]
async fn paged_lists_and_streaming_lists_fill_the_store() {
    // Pages of one object: the watcher follows the continue tokens.
    let (api, client) = start().await;
    for name in ["a", "b", "c"] {
        api.apply_pod(pod("x", name, None, json!({}))).unwrap();
    }
    let paged = watch(
        Api::<Pod>::all(client),
        watcher::Config::default().page_size(1),
    );
    paged.wait_names(&["x/a", "x/b", "x/c"]).await;
    let lists = lists_of(&api, "/api/v1/pods");
    assert_eq!(lists.len(), 3, "{lists:?}");
    assert!(
        lists
            .iter()
            .all(|l| l.param("limit").as_deref() == Some("1"))
    );
    assert_eq!(
        lists
            .iter()
            .filter(|l| l.param("continue").is_some())
            .count(),
        2
    );
    api.apply_pod(pod("x", "d", None, json!({}))).unwrap();
    paged.wait_names(&["x/a", "x/b", "x/c", "x/d"]).await;

    // Streaming lists: one watch with sendInitialEvents=true, no list.
    let (api, client) = start().await;
    for name in ["a", "b"] {
        api.apply_pod(pod("x", name, None, json!({}))).unwrap();
    }
    let streamed = watch(
        Api::<Pod>::all(client),
        watcher::Config::default().streaming_lists(),
    );
    streamed.wait_names(&["x/a", "x/b"]).await;
    eventually(
        || streamed.log().contains(&"init-done".to_string()),
        || format!("{:?}", streamed.log()),
    )
    .await;
    let w = &watches_of(&api, "/api/v1/pods")[0];
    assert_eq!(
        w.param("sendInitialEvents").as_deref(),
        Some("true"),
        "{w:?}"
    );
    assert_eq!(
        w.param("resourceVersionMatch").as_deref(),
        Some("NotOlderThan")
    );
    assert!(lists_of(&api, "/api/v1/pods").is_empty());
    api.delete_pod("x", "a").unwrap();
    streamed.wait_names(&["x/b"]).await;
    assert!(streamed.errors().is_empty(), "{:?}", streamed.errors());
}

// ---------------------------------------------------------------------------
// The wire protocol, read raw (plain #[test]: the double's API is synchronous).

/// One HTTP/1.1 request on a new connection (`Connection: close`); returns the
/// status code and the raw body bytes as sent (chunk framing included), read
/// until the server closes.
fn raw(addr: SocketAddr, method: &str, target: &str, token: bool, extra: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let auth = if token {
        format!("Authorization: Bearer {TOKEN}\r\n")
    } else {
        String::new()
    };
    write!(
        stream,
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n{extra}\r\n"
    )
    .unwrap();
    let mut response = Vec::new();
    // A cut watch ends without a clean close: keep what arrived.
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// The JSON lines of a chunked body.
fn lines(chunked: &str) -> Vec<Value> {
    let mut data = String::new();
    let mut rest = chunked;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || tail.len() < size {
            break;
        }
        data.push_str(&tail[..size]);
        rest = tail[size..].strip_prefix("\r\n").unwrap_or(&tail[size..]);
    }
    data.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_wire_protocol() {
    let api = ApiServer::start().unwrap();
    let addr = api.listen_local().unwrap();
    api.apply_pod(pod("a", "p", Some("node1"), json!({})))
        .unwrap();

    // Unknown token: 401 Status.
    let (code, body) = raw(addr, "GET", "/api/v1/pods", false, "");
    assert_eq!(code, 401);
    let status: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["reason"], "Unauthorized");
    assert_eq!(status["code"], 401);

    // A list: the List kind, its resourceVersion, items without kind.
    let (code, body) = raw(addr, "GET", "/api/v1/pods", true, "");
    assert_eq!(code, 200);
    let list: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["kind"], "PodList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(
        list["metadata"]["resourceVersion"],
        api.resource_version().to_string()
    );
    assert_eq!(list["items"][0]["metadata"]["name"], "p");
    assert!(list["items"][0].get("kind").is_none());
    let meta = &list["items"][0]["metadata"];
    for field in ["uid", "resourceVersion", "creationTimestamp", "namespace"] {
        assert!(meta[field].is_string(), "{field}: {meta}");
    }

    // 404s: an object, a path.
    let (code, body) = raw(addr, "GET", "/api/v1/namespaces/a/pods/nope", true, "");
    assert_eq!(code, 404);
    let status: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["message"], "pods \"nope\" not found");
    assert_eq!(status["reason"], "NotFound");
    assert_eq!(
        raw(addr, "GET", "/apis/apps/v1/deployments", true, "").0,
        404
    );
    assert_eq!(
        raw(
            addr,
            "GET",
            "/api/v1/pods?fieldSelector=spec.bogus%3Dx",
            true,
            ""
        )
        .0,
        400
    );

    // Injected faults.
    for (code, reason) in [
        (403, "Forbidden"),
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
        (401, "Unauthorized"),
    ] {
        api.fail("pods", code);
        let (got, body) = raw(
            addr,
            "GET",
            "/api/v1/namespaces/a/pods?watch=true",
            true,
            "",
        );
        assert_eq!(got, code);
        let status: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status["reason"], reason, "{body}");
        if code == 403 {
            assert_eq!(
                status["message"],
                format!(
                    "pods is forbidden: User \"{USER}\" cannot watch resource \"pods\" in API group \"\" in the namespace \"a\""
                )
            );
        }
    }
    api.heal("pods");
    assert_eq!(
        raw(addr, "GET", "/api/v1/namespaces/a/pods/p", true, "").0,
        200
    );

    // A watch from before a compaction: HTTP 200, one ERROR event (410
    // Expired), then a clean end of the body.
    let before = api.resource_version();
    let oldest = api.compact();
    let (code, body) = raw(
        addr,
        "GET",
        &format!("/api/v1/pods?watch=1&resourceVersion={before}"),
        true,
        "",
    );
    assert_eq!(code, 200);
    assert!(body.ends_with("0\r\n\r\n"), "{body:?}");
    let events = lines(&body);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "ERROR");
    assert_eq!(
        events[0]["object"],
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": format!("too old resource version: {before} ({oldest})"),
               "reason": "Expired", "code": 410})
    );

    // A watch with timeoutSeconds ends cleanly; from resourceVersion 0 it starts
    // with synthetic ADDED events, and the bookmark follows the events.
    let watcher = std::thread::spawn(move || {
        raw(
            addr,
            "GET",
            "/api/v1/pods?watch=true&resourceVersion=0&allowWatchBookmarks=true&timeoutSeconds=3",
            true,
            "",
        )
    });
    api.wait_for("a watch", Duration::from_secs(10), |a| {
        a.open_watches("pods") == 1
    })
    .unwrap();
    let rv = api.apply_pod(pod("a", "q", None, json!({}))).unwrap();
    api.bookmark();
    let (code, body) = watcher.join().unwrap();
    assert_eq!(code, 200);
    assert!(body.ends_with("0\r\n\r\n"), "{body:?}");
    let events = lines(&body);
    let kinds: Vec<_> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ADDED", "ADDED", "BOOKMARK"], "{events:?}");
    assert_eq!(events[1]["object"]["metadata"]["name"], "q");
    assert_eq!(events[1]["object"]["kind"], "Pod");
    assert_eq!(
        events[2]["object"],
        json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}})
    );

    // A cut watch: the events, then the connection closes with no terminator.
    let watcher = std::thread::spawn(move || {
        raw(
            addr,
            "GET",
            &format!("/api/v1/namespaces/a/pods?watch=true&resourceVersion={rv}"),
            true,
            "",
        )
    });
    api.wait_for("a watch", Duration::from_secs(10), |a| {
        a.open_watches("pods") == 1
    })
    .unwrap();
    api.delete_pod("a", "q").unwrap();
    api.cut_watches();
    assert_eq!(api.open_watches("pods"), 0);
    api.apply_pod(pod("a", "after", None, json!({}))).unwrap();
    let (code, body) = watcher.join().unwrap();
    assert_eq!(code, 200);
    assert!(!body.ends_with("0\r\n\r\n"), "{body:?}");
    let events = lines(&body);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "DELETED");
    assert_eq!(events[0]["object"]["metadata"]["name"], "q");

    // The log.
    let requests = api.requests();
    assert!(requests.iter().all(|r| r.method == "GET"));
    assert_eq!(requests[0].status, 401);
    assert!(requests.iter().skip(1).all(|r| r.authorization.is_some()));
}

/// `listen_in`: the socket lives in the given network namespace (as an agent in
/// a node namespace sees it on its own loopback), not in the test's. Needs root
/// (it makes a namespace), like the test bed.
#[test]
fn it_listens_inside_a_network_namespace() {
    use podlink_tests::netns::{self, Resource};
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test makes a network namespace: run it as root"
    );
    let ns = format!("plt{}api", std::process::id());
    netns::ip(&["netns", "add", &ns]).unwrap();
    netns::register(Resource::Netns(ns.clone()));
    netns::ip(&["-n", &ns, "link", "set", "lo", "up"]).unwrap();

    let api = ApiServer::start().unwrap();
    api.apply_pod(pod("a", "p", Some("node1"), json!({})))
        .unwrap();
    let addr = api.listen_in(&ns).unwrap();
    assert!(addr.ip().is_loopback());
    let (code, body) = netns::in_netns(&ns, move || {
        Ok(raw(addr, "GET", "/api/v1/namespaces/a/pods/p", true, ""))
    })
    .unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"name\":\"p\""), "{body}");
    assert!(
        TcpStream::connect(addr).is_err(),
        "the port is open in the test's own namespace"
    );
    drop(api);
    netns::remove(&Resource::Netns(ns));
}

// ---------------------------------------------------------------------------
// Services, EndpointSlices, Nodes and Istio's policies.

/// An Istio kind as the agent watches it: metadata, the spec as JSON, and the
/// `apiVersion` the object was served with (watch events carry it; list items
/// do not).
macro_rules! istio_kind {
    ($ty:ident, $kind:literal, $version:literal, $plural:literal) => {
        #[derive(Clone, Debug, serde::Deserialize)]
        #[allow(dead_code, reason = "not every kind's test reads every field")]
        struct $ty {
            #[serde(rename = "apiVersion")]
            api_version: Option<String>,
            metadata: kube::core::ObjectMeta,
            spec: Option<Value>,
        }
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = k8s_openapi::NamespaceResourceScope;
            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                "security.istio.io".into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &kube::core::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut kube::core::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

istio_kind!(
    PolicyV1,
    "AuthorizationPolicy",
    "v1",
    "authorizationpolicies"
);
istio_kind!(
    PolicyV1beta1,
    "AuthorizationPolicy",
    "v1beta1",
    "authorizationpolicies"
);
istio_kind!(
    PeerAuthenticationV1,
    "PeerAuthentication",
    "v1",
    "peerauthentications"
);

fn service(ns: &str, name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    })
}

fn endpoint_slice(ns: &str, name: &str, service: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}, "nodeName": "node1"}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })
}

fn node(name: &str, zone: &str, cidr: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
    })
}

fn policy(ns: &str, name: &str, action: &str) -> Value {
    json!({
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"action": action, "rules": [{}]},
    })
}

#[tokio::test]
async fn services_endpoint_slices_and_nodes_are_listed_and_watched() {
    use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
    let (api, client) = start().await;
    api.apply("services", service("shop", "web", "10.96.0.10"))
        .unwrap();
    api.apply(
        "endpointslices",
        endpoint_slice("shop", "web-1", "web", "10.244.1.2"),
    )
    .unwrap();
    api.apply("nodes", node("node1", "a", "10.244.1.0/24"))
        .unwrap();

    let services = watch(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    );
    let shop = watch(
        Api::<Service>::namespaced(client.clone(), "shop"),
        watcher::Config::default(),
    );
    let slices = watch(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default(),
    );
    let nodes = watch(Api::<Node>::all(client.clone()), watcher::Config::default());
    services.wait_names(&["shop/web"]).await;
    shop.wait_names(&["shop/web"]).await;
    slices.wait_names(&["shop/web-1"]).await;
    nodes.wait_names(&["/node1"]).await;
    let slice = slices.object("shop", "web-1").unwrap();
    assert_eq!(slice.endpoints[0].node_name.as_deref(), Some("node1"));
    let n = nodes.object("", "node1").unwrap();
    assert_eq!(
        n.spec.as_ref().unwrap().pod_cidr.as_deref(),
        Some("10.244.1.0/24")
    );
    for path in [
        "/api/v1/services",
        "/api/v1/namespaces/shop/services",
        "/apis/discovery.k8s.io/v1/endpointslices",
        "/api/v1/nodes",
    ] {
        assert_eq!(lists_of(&api, path).len(), 1, "{path}");
    }

    // Followed: added, modified, deleted; another namespace not in `shop`'s.
    api.apply("services", service("bank", "teller", "10.96.0.11"))
        .unwrap();
    api.apply("nodes", node("node2", "b", "10.244.2.0/24"))
        .unwrap();
    api.apply(
        "endpointslices",
        endpoint_slice("shop", "web-1", "web", "10.244.1.3"),
    )
    .unwrap();
    services.wait_names(&["bank/teller", "shop/web"]).await;
    nodes.wait_names(&["/node1", "/node2"]).await;
    eventually(
        || {
            slices
                .object("shop", "web-1")
                .is_some_and(|s| s.endpoints[0].addresses == ["10.244.1.3"])
        },
        || format!("{:?}", slices.log()),
    )
    .await;
    api.delete("services", "shop", "web").unwrap();
    api.delete("nodes", "", "node1").unwrap();
    api.delete("endpointslices", "shop", "web-1").unwrap();
    services.wait_names(&["bank/teller"]).await;
    shop.wait_names(&[]).await;
    nodes.wait_names(&["/node2"]).await;
    slices.wait_names(&[]).await;
    assert!(api.object("nodes", "", "node2").is_some());
    assert!(
        api.apply("replicasets", json!({"metadata": {"name": "x"}}))
            .is_err()
    );
}

#[tokio::test]
async fn istio_policies_are_served_under_both_versions_and_404_while_not_installed() {
    let (api, client) = start().await;
    api.set_istio_crds_installed(false);
    assert!(
        api.apply("authorizationpolicies", policy("shop", "deny", "DENY"))
            .is_err(),
        "no object of a CRD that is not installed"
    );

    // Not installed: the list is 404 NotFound, retried with backoff.
    let v1 = watch(
        Api::<PolicyV1>::all(client.clone()),
        watcher::Config::default(),
    );
    let beta = watch(
        Api::<PolicyV1beta1>::all(client.clone()),
        watcher::Config::default(),
    );
    let mtls = watch(
        Api::<PeerAuthenticationV1>::all(client.clone()),
        watcher::Config::default(),
    );
    for w in [&v1.errors, &beta.errors, &mtls.errors] {
        eventually(|| !w.lock().unwrap().is_empty(), || format!("{api:?}")).await;
        let first = w.lock().unwrap()[0].clone();
        assert!(
            first.contains("failed to perform initial object list") && first.contains("404"),
            "{first}"
        );
        assert!(first.contains("NotFound"), "{first}");
    }
    assert_eq!(
        lists_of(
            &api,
            "/apis/security.istio.io/v1beta1/authorizationpolicies"
        )[0]
        .status,
        404
    );

    // Installed: the watchers list without a restart; one object, both versions.
    api.set_istio_crds_installed(true);
    api.apply("authorizationpolicies", policy("shop", "deny", "DENY"))
        .unwrap();
    api.apply(
        "peerauthentications",
        json!({"metadata": {"name": "strict", "namespace": "shop"}, "spec": {"mtls": {"mode": "STRICT"}}}),
    )
    .unwrap();
    v1.wait_names(&["shop/deny"]).await;
    beta.wait_names(&["shop/deny"]).await;
    mtls.wait_names(&["shop/strict"]).await;
    assert_eq!(
        v1.object("shop", "deny").unwrap().spec.as_ref().unwrap()["action"],
        "DENY"
    );
    eventually(
        || api.open_watches("authorizationpolicies") == 2,
        || format!("{api:?}"),
    )
    .await;
    // A change is watched under both versions, each with its apiVersion.
    api.apply("authorizationpolicies", policy("shop", "allow", "ALLOW"))
        .unwrap();
    v1.wait_names(&["shop/allow", "shop/deny"]).await;
    beta.wait_names(&["shop/allow", "shop/deny"]).await;
    assert_eq!(
        v1.object("shop", "allow").unwrap().api_version.as_deref(),
        Some("security.istio.io/v1")
    );
    assert_eq!(
        beta.object("shop", "allow").unwrap().api_version.as_deref(),
        Some("security.istio.io/v1beta1")
    );
    api.delete("authorizationpolicies", "shop", "allow")
        .unwrap();
    beta.wait_names(&["shop/deny"]).await;
    v1.wait_names(&["shop/deny"]).await;

    // Removed again: open watches are cut, lists are 404 again.
    let errors_before = v1.errors().len();
    api.set_istio_crds_installed(false);
    assert_eq!(api.open_watches("authorizationpolicies"), 0);
    assert!(
        api.object("authorizationpolicies", "shop", "deny")
            .is_none()
    );
    eventually(
        || {
            v1.errors()[errors_before..]
                .iter()
                .any(|e| e.contains("404"))
        },
        || format!("{:?}", v1.errors()),
    )
    .await;
}

#[test]
fn the_wire_protocol_of_the_new_kinds() {
    let api = ApiServer::start().unwrap();
    let addr = api.listen_local().unwrap();
    api.apply("authorizationpolicies", policy("shop", "deny", "DENY"))
        .unwrap();
    api.apply("nodes", node("node1", "a", "10.244.1.0/24"))
        .unwrap();

    // The same object under both versions, in the version's list kind.
    for version in ["v1", "v1beta1"] {
        let (code, body) = raw(
            addr,
            "GET",
            &format!("/apis/security.istio.io/{version}/namespaces/shop/authorizationpolicies"),
            true,
            "",
        );
        assert_eq!(code, 200, "{body}");
        let list: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(list["kind"], "AuthorizationPolicyList");
        assert_eq!(list["apiVersion"], format!("security.istio.io/{version}"));
        assert_eq!(list["items"][0]["metadata"]["name"], "deny");
        let (code, body) = raw(
            addr,
            "GET",
            &format!(
                "/apis/security.istio.io/{version}/namespaces/shop/authorizationpolicies/deny"
            ),
            true,
            "",
        );
        assert_eq!(code, 200, "{body}");
        let obj: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(obj["apiVersion"], format!("security.istio.io/{version}"));
    }
    // Cluster-scoped nodes: by name, not under a namespace.
    let (code, _) = raw(addr, "GET", "/api/v1/nodes/node1", true, "");
    assert_eq!(code, 200);
    let (code, _) = raw(addr, "GET", "/api/v1/namespaces/shop/nodes", true, "");
    assert_eq!(code, 404);
    let (code, _) = raw(
        addr,
        "GET",
        "/apis/discovery.k8s.io/v1/endpointslices",
        true,
        "",
    );
    assert_eq!(code, 200);

    // Served under v1beta1 only (Istio before 1.22): v1 is 404, v1beta1
    // lists the same object.
    api.serve_istio_versions(&["v1beta1"]);
    let list = |version: &str| {
        raw(
            addr,
            "GET",
            &format!("/apis/security.istio.io/{version}/authorizationpolicies"),
            true,
            "",
        )
    };
    assert_eq!(list("v1").0, 404);
    let (code, body) = list("v1beta1");
    assert_eq!(code, 200, "{body}");
    let listed: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listed["items"][0]["metadata"]["name"], "deny");
    api.serve_istio_versions(&["v1", "v1beta1"]);
    assert_eq!(list("v1").0, 200);

    // Not installed: 404 with the Status of a resource the server does not serve,
    // on list, watch and get.
    api.set_istio_crds_installed(false);
    for target in [
        "/apis/security.istio.io/v1/authorizationpolicies",
        "/apis/security.istio.io/v1beta1/peerauthentications?watch=true",
        "/apis/security.istio.io/v1/namespaces/shop/authorizationpolicies/deny",
    ] {
        let (code, body) = raw(addr, "GET", target, true, "");
        assert_eq!(code, 404, "{target}");
        let status: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status["kind"], "Status", "{target}");
        assert_eq!(status["reason"], "NotFound", "{target}");
        assert_eq!(
            status["message"], "the server could not find the requested resource",
            "{target}"
        );
    }
    // Other kinds are served as before.
    let (code, _) = raw(addr, "GET", "/api/v1/nodes", true, "");
    assert_eq!(code, 200);
}

/// The agent's Kubernetes source against the double: the new kinds in its
/// first view, the Istio CRDs installed after it started, a policy that
/// cannot be compiled making the policies unknown until it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_source_reads_the_new_kinds_and_istio_crds_installed_later() {
    use podlink_agent::{source::Source, state::Delta};
    let api = ApiServer::start().unwrap();
    let addr = api.listen_local().unwrap();
    let kubeconfig = std::env::temp_dir().join(format!(
        "podlink-api-double-source-{}-{}.yaml",
        std::process::id(),
        addr.port()
    ));
    api.write_kubeconfig(addr, &kubeconfig).unwrap();
    api.set_istio_crds_installed(false);
    api.apply_namespace(namespace("shop", json!({}))).unwrap();
    let mut web = pod("shop", "web-1", Some("node1"), json!({"app": "web"}));
    web["metadata"]["ownerReferences"] = json!([
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f", "uid": "u-1", "controller": true},
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "u-2"},
    ]);
    api.apply_pod(web).unwrap();
    api.apply("services", service("shop", "web", "10.96.0.10"))
        .unwrap();
    api.apply(
        "endpointslices",
        endpoint_slice("shop", "web-1", "web", "10.244.1.2"),
    )
    .unwrap();
    api.apply("nodes", node("node1", "a", "10.244.1.0/24"))
        .unwrap();

    let mut source = podlink_agent::source::kube::KubeSource::start(
        Some(&kubeconfig),
        "node1",
        podlink_agent::source::kube::Scope::Cluster,
    )
    .await
    .unwrap();
    let _ = std::fs::remove_file(&kubeconfig);
    let first = tokio::time::timeout(Duration::from_secs(15), source.next())
        .await
        .expect("the first view");
    assert_eq!(
        first.completeness,
        podlink_agent::state::Completeness::Complete
    );
    // Every kind listed, the Nodes too (the Istio kinds found not installed).
    assert!(first.unlisted.is_empty(), "{:?}", first.unlisted);
    // Istio not installed: no policies, and known to be none.
    assert_eq!(first.policies_unknown, None);
    assert_eq!(first.policies.as_ref().map(Vec::len), Some(0));
    assert_eq!(first.mtls_policies.as_ref().map(Vec::len), Some(0));
    assert_eq!(first.services.as_ref().map(Vec::len), Some(1));
    assert_eq!(first.endpoint_slices.as_ref().map(Vec::len), Some(1));
    let nodes = first.nodes.unwrap();
    assert_eq!(nodes[0].metadata.name.as_deref(), Some("node1"));
    let pods = first.all_pods.unwrap();
    let owners = pods[0].metadata.owner_references.as_ref().unwrap();
    assert_eq!(owners.len(), 1, "only the controller: {owners:?}");
    assert_eq!(owners[0].name, "web-5d8f");

    // Takes deltas (20 s at most) until `done` holds of one.
    async fn until(
        source: &mut podlink_agent::source::kube::KubeSource,
        what: &str,
        mut done: impl FnMut(&Delta) -> bool,
    ) -> Delta {
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let delta = source.next().await;
                if done(&delta) {
                    return delta;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no delta with {what}"))
    }

    // Installed later: listed again within 10 s, without a restart; the
    // policy served under both versions counts once.
    api.set_istio_crds_installed(true);
    api.apply("authorizationpolicies", policy("shop", "deny", "DENY"))
        .unwrap();
    api.apply(
        "peerauthentications",
        json!({"metadata": {"name": "strict", "namespace": "shop"}, "spec": {"mtls": {"mode": "STRICT"}}}),
    )
    .unwrap();
    // Both kinds may come in one delta or two.
    let (mut policies, mut mtls) = (None, None);
    until(&mut source, "the policy and the PeerAuthentication", |d| {
        if let Some(p) = d.policies.as_ref().filter(|p| !p.is_empty()) {
            policies = Some(p.iter().map(|p| p.to_string()).collect::<Vec<_>>());
        }
        if let Some(m) = d.mtls_policies.as_ref().filter(|m| !m.is_empty()) {
            mtls = Some(m.iter().map(|m| m.to_string()).collect::<Vec<_>>());
        }
        policies.is_some() && mtls.is_some()
    })
    .await;
    assert_eq!(policies.unwrap(), ["shop/deny"]);
    assert_eq!(mtls.unwrap(), ["shop/strict"]);

    // A policy that cannot be compiled: its namespace's policies unknown,
    // naming it, the others' known; known once gone.
    api.apply("authorizationpolicies", policy("shop", "bad", "ALLOWW"))
        .unwrap();
    let delta = until(&mut source, "policies unknown", |d| {
        !d.policies_unknown_in.is_empty()
    })
    .await;
    assert_eq!(delta.policies_unknown, None);
    let unknown = &delta.policies_unknown_in["shop"];
    assert_eq!(unknown.what, "AuthorizationPolicy shop/bad");
    assert!(unknown.why.contains("ALLOWW"), "{unknown:?}");
    api.delete("authorizationpolicies", "shop", "bad").unwrap();
    until(&mut source, "policies known", |d| {
        d.policies_unknown.is_none() && d.policies_unknown_in.is_empty()
    })
    .await;

    // A Service change comes alone, with its object; a deletion without.
    api.apply("services", service("shop", "api", "10.96.0.12"))
        .unwrap();
    let delta = until(&mut source, "the new Service", |d| {
        !d.changed_services.is_empty()
    })
    .await;
    assert!(delta.services.is_none(), "not the whole set");
    let [(key, Some(api_service))] = delta.changed_services.as_slice() else {
        panic!("one Service, with its object: {:?}", delta.changed_services);
    };
    assert_eq!(key, "shop/api");
    assert_eq!(api_service.metadata.name.as_deref(), Some("api"));
    api.delete("services", "shop", "api").unwrap();
    let delta = until(&mut source, "the Service deleted", |d| {
        !d.changed_services.is_empty()
    })
    .await;
    assert!(
        matches!(delta.changed_services.as_slice(), [(key, None)] if key == "shop/api"),
        "{:?}",
        delta.changed_services
    );
}
