//! The manifests directory as a [`Source`]: rescans on inotify's word, while
//! changes settle, and every [`RESYNC`] when nothing happens.

use std::{collections::BTreeMap, path::Path};

use super::{Completions, ManifestDir, RESYNC, Rescan, SETTLE, Watch};
use crate::{
    k8s::Pod,
    source::{Error, Source},
    state::{Completeness, Delta, PoliciesUnknown},
    telemetry::logging::{HeldMessages, Severity},
};

/// A watched manifests directory.
pub struct ManifestSource {
    /// The files and their last good objects.
    dir: ManifestDir,
    /// The inotify watch on the directory, filling `dir`'s completions.
    watch: Watch,
    /// Whether the first delta was sent.
    started: bool,
    /// Changes wait for their files to settle: rescan after [`SETTLE`].
    unsettled: bool,
    /// The completeness and policies' state the last delta carried.
    sent: (Completeness, Option<PoliciesUnknown>),
    /// Pods defined more than once, logged once while they are.
    duplicates: HeldMessages,
    /// Whether some pod was defined more than once at the last look.
    had_duplicates: bool,
}

impl ManifestSource {
    /// Watches `path`; reads nothing yet.
    ///
    /// # Errors
    /// [`Error::ManifestsDirectory`] when `path` is not a readable directory,
    /// [`Error::Watch`] when it cannot be watched.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let completions = Completions::default();
        let dir = ManifestDir::new(path)
            .map_err(|error| Error::ManifestsDirectory {
                path: path.to_path_buf(),
                error,
            })?
            .with_completions(completions.clone());
        let watch = Watch::new(dir.dir(), completions).map_err(|error| Error::Watch {
            path: path.to_path_buf(),
            error,
        })?;
        Ok(ManifestSource {
            dir,
            watch,
            started: false,
            unsettled: false,
            sent: (Completeness::Incomplete, None),
            duplicates: HeldMessages::default(),
            had_duplicates: false,
        })
    }

    /// Makes the next rescan look at every file, and watches the directory
    /// again if it was made again since it was watched.
    fn resync(&mut self) {
        self.dir.resync();
        self.watch.renew();
    }

    /// How complete the directory's view is: nothing is whole while a change
    /// settles; a file broken since start-up hides what it holds.
    fn completeness(&self) -> Completeness {
        if self.dir.settling() {
            Completeness::Incomplete
        } else if self.dir.incomplete() {
            Completeness::UnreadableParts
        } else {
            Completeness::Complete
        }
    }

    /// The delta of `rescan`: every object at the first, else the pods it
    /// names with their definitions now, and the other kinds whole when they
    /// changed.
    fn delta(&mut self, rescan: &Rescan) -> Delta {
        let mut delta = Delta {
            completeness: self.completeness(),
            policies_unknown: self.dir.policies_unknown().map(|e| PoliciesUnknown {
                what: e.file.display().to_string(),
                why: e.problem.to_string(),
            }),
            ..Delta::default()
        };
        let (pods, namespaces, services, nodes) = match &rescan.changes {
            None => {
                delta.all_pods = Some(self.dir.pods().cloned().collect());
                (true, true, true, true)
            }
            Some(changes) => {
                if !changes.pods.is_empty() {
                    delta.pods = definitions(&changes.pods, self.dir.pods());
                }
                (
                    !changes.pods.is_empty(),
                    changes.namespaces,
                    changes.services,
                    changes.nodes,
                )
            }
        };
        if nodes {
            delta.nodes = Some(self.dir.nodes().cloned().collect());
        }
        if namespaces {
            delta.namespaces = Some(self.dir.namespaces().cloned().collect());
        }
        if services {
            delta.services = Some(self.dir.services().cloned().collect());
            delta.endpoint_slices = Some(self.dir.endpoint_slices().cloned().collect());
        }
        if rescan.changed || rescan.changes.is_none() {
            delta.policies = Some(self.dir.policies().cloned().collect());
            delta.mtls_policies = Some(self.dir.mtls_policies().cloned().collect());
        }
        // Which files define a pod twice is looked for (a walk of every pod)
        // only where it may have changed: a changed pod has several
        // definitions, or one had before.
        if pods
            && (delta.all_pods.is_some()
                || self.had_duplicates
                || delta.pods.iter().any(|(_, defs)| defs.len() > 1))
        {
            let duplicates = self.dir.duplicate_pods();
            self.had_duplicates = !duplicates.is_empty();
            self.duplicates.log(
                duplicates
                    .into_iter()
                    .map(|w| (Severity::Warn, w))
                    .collect(),
            );
        }
        delta
    }
}

/// Every definition of the pods `keys` (`namespace/name`) among `pods`, in
/// their order, by key; a key without one has none (the pod is gone).
fn definitions<'a>(
    keys: &std::collections::BTreeSet<String>,
    pods: impl Iterator<Item = &'a Pod>,
) -> Vec<(String, Vec<Pod>)> {
    let mut found: BTreeMap<(&str, &str), Vec<Pod>> = keys
        .iter()
        .filter_map(|k| k.split_once('/'))
        .map(|k| (k, Vec::new()))
        .collect();
    for pod in pods {
        let Some(name) = pod.metadata.name.as_deref() else {
            continue;
        };
        if let Some(definitions) = found.get_mut(&(pod.metadata.namespace_or_default(), name)) {
            definitions.push(pod.clone());
        }
    }
    found
        .into_iter()
        .map(|((namespace, name), definitions)| (format!("{namespace}/{name}"), definitions))
        .collect()
}

impl Source for ManifestSource {
    async fn next(&mut self) -> Delta {
        loop {
            if self.started {
                let wait = if self.unsettled { SETTLE } else { RESYNC };
                tokio::select! {
                    () = self.watch.changed() => {}
                    () = tokio::time::sleep(wait) => {
                        // Nothing happened for a while: look at everything
                        // again, in case a change was missed.
                        if !self.unsettled {
                            self.resync();
                        }
                    }
                }
            }
            let rescan = self.dir.rescan();
            for error in &rescan.errors {
                tracing::warn!("manifest refused: {error}");
            }
            self.unsettled = rescan.unsettled;
            let first = !std::mem::replace(&mut self.started, true);
            let delta = self.delta(&rescan);
            let state = (delta.completeness, delta.policies_unknown.clone());
            if first || !delta.has_no_objects() || state != self.sent {
                self.sent = state;
                return delta;
            }
        }
    }

    fn lists_every_namespace(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  namespace: default\nspec:\n  nodeName: node-1\nstatus:\n  podIP: 10.0.0.5\n";

    /// The periodic resync is what watches a manifests directory made again:
    /// after it, a manifest written into the new directory wakes the source and
    /// is sent.
    #[tokio::test]
    async fn a_resync_watches_a_manifests_directory_made_again() {
        let guard = tempfile::tempdir().unwrap();
        let path = guard.path().join("manifests");
        std::fs::create_dir(&path).unwrap();
        let mut source = ManifestSource::open(&path).unwrap();
        source.next().await;
        std::fs::remove_dir(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        // The old watch's report of the removal is not what is waited for.
        tokio::time::sleep(Duration::from_millis(200)).await;
        tokio::time::timeout(Duration::from_millis(500), source.watch.changed())
            .await
            .ok();
        source.resync();
        source.dir.rescan();
        std::fs::write(path.join("pod.yaml"), POD).unwrap();
        tokio::time::timeout(Duration::from_secs(5), source.watch.changed())
            .await
            .expect("a manifest written into the directory made again woke the source");
        // The file may still be settling (its close not seen yet): take deltas
        // until it is sent.
        let delta = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let delta = source.next().await;
                if !delta.pods.is_empty() {
                    return delta;
                }
            }
        })
        .await
        .expect("the pod was sent");
        let names: Vec<_> = delta
            .pods
            .iter()
            .flat_map(|(_, defs)| defs)
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        assert_eq!(names, ["web"]);
    }

    /// A changed pod is sent with every definition the directory has of it;
    /// a removed one with none.
    #[tokio::test]
    async fn a_changed_pod_is_sent_with_its_definitions() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), POD).unwrap();
        let mut source = ManifestSource::open(dir.path()).unwrap();
        let first = source.next().await;
        assert_eq!(first.all_pods.map(|p| p.len()), Some(1));
        assert_eq!(first.completeness, Completeness::Complete);
        // A second definition of the same pod, in another file.
        std::fs::write(
            dir.path().join("b.yaml"),
            POD.replace("10.0.0.5", "10.0.0.6"),
        )
        .unwrap();
        let delta = tokio::time::timeout(Duration::from_secs(5), source.next())
            .await
            .unwrap();
        assert_eq!(delta.pods.len(), 1);
        let (key, defs) = &delta.pods[0];
        assert_eq!(key, "default/web");
        let ips: Vec<_> = defs
            .iter()
            .filter_map(|p| p.status.as_ref()?.pod_ip.as_deref())
            .collect();
        assert_eq!(ips, ["10.0.0.5", "10.0.0.6"]);
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        std::fs::remove_file(dir.path().join("b.yaml")).unwrap();
        // The two removals may come in one delta or two: the last says it is
        // gone.
        tokio::time::timeout(Duration::from_secs(5), async {
            while source.next().await.pods != [("default/web".to_string(), Vec::new())] {}
        })
        .await
        .expect("the pod was sent gone");
    }

    /// Takes deltas until one carries pods.
    async fn next_pods(source: &mut ManifestSource) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while source.next().await.pods.is_empty() {}
        })
        .await
        .expect("a delta with pods");
    }

    /// Pods defined twice are looked for when a changed pod has several
    /// definitions, and again once it has one.
    #[tokio::test]
    async fn duplicates_are_looked_for_where_they_may_have_changed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), POD).unwrap();
        let mut source = ManifestSource::open(dir.path()).unwrap();
        source.next().await;
        assert!(!source.had_duplicates);
        std::fs::write(dir.path().join("b.yaml"), POD).unwrap();
        next_pods(&mut source).await;
        assert!(source.had_duplicates);
        std::fs::remove_file(dir.path().join("b.yaml")).unwrap();
        next_pods(&mut source).await;
        assert!(!source.had_duplicates);
    }

    /// PeerAuthentications and Nodes are sent whole: in the first view, and
    /// when a file changes them; a broken PeerAuthentication file makes the
    /// policies unknown, naming it.
    #[tokio::test]
    async fn peer_authentications_and_nodes_are_sent() {
        let dir = tempfile::tempdir().unwrap();
        let pa = "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: strict, namespace: shop}\nspec: {mtls: {mode: STRICT}}\n";
        let node = "apiVersion: v1\nkind: Node\nmetadata: {name: node-1, labels: {topology.kubernetes.io/zone: a}}\nspec: {podCIDR: 10.244.1.0/24}\n";
        std::fs::write(dir.path().join("pa.yaml"), pa).unwrap();
        std::fs::write(dir.path().join("node.yaml"), node).unwrap();
        let mut source = ManifestSource::open(dir.path()).unwrap();
        let first = source.next().await;
        assert_eq!(first.mtls_policies.map(|p| p.len()), Some(1));
        assert_eq!(first.nodes.map(|n| n.len()), Some(1));
        assert_eq!(first.policies_unknown, None);

        std::fs::write(
            dir.path().join("node.yaml"),
            node.replace("zone: a", "zone: b"),
        )
        .unwrap();
        let delta = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let delta = source.next().await;
                if delta.nodes.is_some() {
                    return delta;
                }
            }
        })
        .await
        .expect("the nodes were sent");
        let nodes = delta.nodes.unwrap();
        assert_eq!(
            nodes[0].metadata.labels.as_ref().unwrap()[crate::k8s::ZONE_LABEL],
            "b"
        );

        // Broken from the start (a fresh source): the policies are unknown.
        std::fs::write(dir.path().join("pa.yaml"), pa.replace("STRICT", "STRICTER")).unwrap();
        let mut fresh = ManifestSource::open(dir.path()).unwrap();
        let first = fresh.next().await;
        let unknown = first.policies_unknown.expect("policies unknown");
        assert!(unknown.what.ends_with("pa.yaml"), "{unknown:?}");
        assert!(unknown.why.contains("STRICTER"), "{unknown:?}");
    }
}
