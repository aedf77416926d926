//! The pod annotation that tells Istio a pod is captured (a reporter of the
//! Kubernetes source, [`CaptureReporter`]).

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Instant,
};

use kube::{
    Api, Client,
    api::{Patch, PatchParams},
    runtime::reflector::Store,
};

use super::{ApiPod, PATCH_RETRY, REDIRECTION_ANNOTATION, REDIRECTION_ENABLED};
use crate::source::CaptureReporter;

/// Sets [`REDIRECTION_ANNOTATION`] on this node's captured pods: istiod tells
/// other ztunnels to use HBONE only for pods that carry it.
pub struct RedirectionAnnotator {
    client: Client,
    /// This node's pods, as watched.
    local_pods: Store<ApiPod>,
    /// Annotation patches sent: pod → (wanted, when), until the watch shows them.
    patched: HashMap<String, (bool, Instant)>,
}

impl RedirectionAnnotator {
    /// Patches pods through `client`, reading their annotations from
    /// `local_pods` (this node's watch).
    pub(super) fn new(client: Client, local_pods: Store<ApiPod>) -> Self {
        RedirectionAnnotator {
            client,
            local_pods,
            patched: HashMap::new(),
        }
    }
}

impl CaptureReporter for RedirectionAnnotator {
    /// Sets [`REDIRECTION_ANNOTATION`] on this node's pods in `captured`
    /// (`namespace/name`) and removes it from its other pods, by JSON merge patch
    /// (RFC 7386), in the background. A patch is sent again if the watch does not
    /// show it after `PATCH_RETRY`; failures are logged.
    fn captured(&mut self, captured: &HashSet<Arc<str>>) {
        let now = Instant::now();
        let mut seen = HashSet::new();
        // This node's watch, not every pod of the cluster: the annotation is
        // read where the patch shows up.
        for pod in self.local_pods.state() {
            let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
                continue;
            };
            let key = format!("{ns}/{name}");
            let has = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(REDIRECTION_ANNOTATION))
                .is_some_and(|v| v == REDIRECTION_ENABLED);
            let want = captured.contains(key.as_str()) && pod.metadata.deletion_timestamp.is_none();
            if has == want {
                self.patched.remove(&key);
                continue;
            }
            seen.insert(key.clone());
            if self
                .patched
                .get(&key)
                .is_some_and(|&(w, at)| w == want && now.duration_since(at) < PATCH_RETRY)
            {
                continue;
            }
            self.patched.insert(key.clone(), (want, now));
            let api: Api<ApiPod> = Api::namespaced(self.client.clone(), ns);
            let name = name.clone();
            let patch = serde_json::json!({
                "metadata": {"annotations": {REDIRECTION_ANNOTATION: want.then_some(REDIRECTION_ENABLED)}}
            });
            tokio::spawn(async move {
                match api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        tracing::debug!(pod = %key, enabled = want, "redirection annotation patched")
                    }
                    Err(e) => tracing::warn!(
                        pod = %key,
                        "patching the {REDIRECTION_ANNOTATION} annotation failed: {e}; retrying in {}s",
                        PATCH_RETRY.as_secs()
                    ),
                }
            });
        }
        self.patched.retain(|k, _| seen.contains(k));
    }
}
