//! The agent as a Kubernetes citizen: the unmodified kube-rs client in the agent
//! watches an API server double (`podlink_tests::api_double`) that speaks the
//! real list/watch protocol, and the enrollment outcome is checked after each
//! event: pods created, relabelled and deleted, the redirection annotation,
//! bookmarks, a stale resourceVersion (410), a watch cut mid-stream, a 403, and
//! an agent restart while pods come and go.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use podlink_tests::{
    Cluster, Pod, PodSpec, Source,
    api_double::{ApiServer, namespace_object, pod_object},
    app,
};
use serde_json::json;

const ANNOTATION: &str = "ambient.istio.io/redirection";

/// A test bed whose agents watch the API server double (one listener in each
/// node's namespace; [`Source::Kubernetes`]).
struct KubeBed {
    c: Cluster,
}

impl KubeBed {
    fn new(nodes: usize) -> Self {
        KubeBed {
            c: Cluster::with_source(nodes, Source::Kubernetes).unwrap(),
        }
    }

    fn api(&self) -> &ApiServer {
        self.c
            .api()
            .expect("a Kubernetes test bed has an API server double")
    }

    fn start_agent(&mut self, node: usize) {
        self.c.start_agent(node).unwrap();
    }

    /// A pod wired by the CNI plugins and created in the API server.
    fn add_pod(&mut self, spec: PodSpec) -> Pod {
        let pod = self.c.add_pod_unlisted(spec).unwrap();
        self.api().apply_pod(pod_object(&self.c, &pod)).unwrap();
        pod
    }

    fn annotation(&self, pod: &Pod) -> Option<String> {
        self.api().pod(&pod.namespace, &pod.name)?["metadata"]["annotations"][ANNOTATION]
            .as_str()
            .map(str::to_string)
    }

    /// Waits until the API server's copy of `pod` has the redirection annotation
    /// (`true`) or not.
    fn wait_annotation(&self, pod: &Pod, enabled: bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while (self.annotation(pod).as_deref() == Some("enabled")) != enabled {
            assert!(
                Instant::now() < deadline,
                "pod {} annotation {ANNOTATION} is {:?} after 10 s, wanted {}; agent log:\n{}",
                pod.name,
                self.annotation(pod),
                if enabled { "enabled" } else { "absent" },
                self.c.agent_log(pod.node)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What identifies a pod's attachments: its TCX links' kernel ids or its
    /// filters' places ([`Cluster::attachment_ids`]).
    fn link_ids(&self, pod: &Pod) -> Vec<String> {
        let ids = self.c.attachment_ids(pod).unwrap();
        assert_eq!(ids.len(), 2, "{ids:?}");
        ids
    }
}

/// Tunnelled traffic between two enrolled pods works.
fn assert_tunnelled(c: &Cluster, client: &Pod, server: &Pod) {
    let ex = app::exchange(&client.netns, server.addr(8000), b"through the mesh").unwrap();
    assert_eq!(ex.peer_seen.ip(), IpAddr::V4(client.ip));
    assert_eq!(ex.echoed, b"through the mesh");
    assert!(c.counters(client).unwrap()["captured_outbound"] >= 1);
    assert!(c.counters(server).unwrap()["captured_inbound_hbone"] >= 1);
}

#[test]
fn watched_pods_are_enrolled_annotated_and_released() {
    let mut b = KubeBed::new(2);
    b.api()
        .apply_namespace(namespace_object("mesh", true))
        .unwrap();
    b.api()
        .apply_namespace(namespace_object("plain", false))
        .unwrap();
    let client = b.add_pod(PodSpec::new("client", "mesh", 0));
    let server = b.add_pod(PodSpec::new("server", "mesh", 1));
    let outside = b.add_pod(PodSpec::new("outside", "plain", 0));
    b.start_agent(0);
    b.start_agent(1);
    let _echo = app::EchoServer::start(&server.netns, server.addr(8000)).unwrap();

    b.c.wait_all_captured(&[&client, &server]).unwrap();
    assert!(!b.c.is_captured(&outside).unwrap());
    assert_tunnelled(&b.c, &client, &server);
    b.wait_annotation(&client, true);
    b.wait_annotation(&server, true);
    assert_eq!(b.annotation(&outside), None);
    // The agents patched, with their own credentials.
    let patches = b.api().patches();
    assert!(
        patches
            .iter()
            .any(|p| p.path.ends_with("/namespaces/mesh/pods/client")),
        "{patches:?}"
    );

    // A pod labelled into the mesh in a plain namespace.
    let mut labelled = pod_object(&b.c, &outside);
    labelled["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "ambient"});
    b.api().apply_pod(labelled).unwrap();
    b.c.wait_captured(&outside, true).unwrap();
    b.wait_annotation(&outside, true);

    // Opting the client out releases it and takes the annotation away.
    let mut opted_out = pod_object(&b.c, &client);
    opted_out["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "none"});
    opted_out["metadata"]["annotations"] = json!({ANNOTATION: "enabled"});
    b.api().apply_pod(opted_out).unwrap();
    b.c.wait_captured(&client, false).unwrap();
    b.wait_annotation(&client, false);

    // The namespace leaving the mesh releases the server.
    b.api()
        .apply_namespace(namespace_object("mesh", false))
        .unwrap();
    b.c.wait_captured(&server, false).unwrap();
    b.wait_annotation(&server, false);

    // Deleting a pod detaches it.
    b.api().delete_pod("plain", "outside").unwrap();
    b.c.wait_captured(&outside, false).unwrap();
}

#[test]
fn watch_failures_keep_the_data_path_and_recover() {
    let mut b = KubeBed::new(1);
    b.api()
        .apply_namespace(namespace_object("mesh", true))
        .unwrap();
    let first = b.add_pod(PodSpec::new("first", "mesh", 0));
    b.start_agent(0);
    b.c.wait_captured(&first, true).unwrap();
    let links = b.link_ids(&first);

    // A bookmark only moves the resourceVersion on.
    b.api().bookmark();
    let second = b.add_pod(PodSpec::new("second", "mesh", 0));
    b.c.wait_captured(&second, true).unwrap();

    // History compacted and the watches cut: resuming gets 410 Gone, the agent
    // relists, and a pod created meanwhile is enrolled.
    b.api().compact();
    b.api().cut_watches();
    let third = b.add_pod(PodSpec::new("third", "mesh", 0));
    b.c.wait_captured(&third, true).unwrap();
    // Both pod watches (all pods, this node's) were told 410 and listed again.
    let pod_lists = |api: &ApiServer| {
        api.requests()
            .iter()
            .filter(|r| r.path == "/api/v1/pods" && r.is_list())
            .count()
    };
    b.api()
        .wait_for(
            "both pod watches to list again",
            Duration::from_secs(10),
            |api| pod_lists(api) >= 4,
        )
        .unwrap();
    b.c.wait_log_lines(
        0,
        &[
            "watching the Kubernetes API failed",
            "too old resource version",
        ],
        2,
        Duration::from_secs(10),
    )
    .unwrap();

    // The API forbids pods for a while: logged, the data path unchanged.
    b.api().fail("pods", 403);
    b.api().cut_watches();
    b.c.wait_log_lines(
        0,
        &["watching the Kubernetes API failed", "403"],
        1,
        Duration::from_secs(10),
    )
    .unwrap();
    b.api().delete_pod("mesh", "second").unwrap();
    let fourth = b.add_pod(PodSpec::new("fourth", "mesh", 0));
    std::thread::sleep(Duration::from_millis(500));
    for pod in [&first, &second, &third] {
        assert!(b.c.is_captured(pod).unwrap(), "{} lost capture", pod.name);
    }
    assert!(!b.c.is_captured(&fourth).unwrap());
    // Healed: what happened meanwhile is applied.
    b.api().heal("pods");
    b.c.wait_captured(&fourth, true).unwrap();
    b.c.wait_captured(&second, false).unwrap();
    b.c.wait_log(0, &["watching again"]).unwrap();
    assert!(
        b.api()
            .requests()
            .iter()
            .any(|r| r.path == "/api/v1/pods" && r.is_watch() && r.status == 200)
    );
    // The first pod's links were never replaced.
    assert_eq!(b.link_ids(&first), links);
}

#[test]
fn a_restarted_agent_adopts_enrolls_and_cleans_up() {
    let mut b = KubeBed::new(1);
    b.api()
        .apply_namespace(namespace_object("mesh", true))
        .unwrap();
    let stays = b.add_pod(PodSpec::new("stays", "mesh", 0));
    let goes = b.add_pod(PodSpec::new("goes", "mesh", 0));
    b.start_agent(0);
    b.c.wait_all_captured(&[&stays, &goes]).unwrap();
    let links = b.link_ids(&stays);

    b.c.stop_agent(0).unwrap();
    // While the agent is down: one pod deleted, one created.
    b.api().delete_pod("mesh", "goes").unwrap();
    let comes = b.add_pod(PodSpec::new("comes", "mesh", 0));
    // Pinned links keep the deleted pod captured until an agent is back.
    assert!(b.c.is_captured(&goes).unwrap());

    b.start_agent(0);
    b.c.wait_captured(&comes, true).unwrap();
    b.c.wait_captured(&goes, false).unwrap();
    // The pod that stayed kept its links: no gap in its capture.
    assert_eq!(b.link_ids(&stays), links);
    assert!(b.c.is_captured(&stays).unwrap());
    b.wait_annotation(&comes, true);
}
