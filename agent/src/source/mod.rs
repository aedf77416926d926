//! The agent's workload source behind one interface: a manifests directory or
//! the Kubernetes API. Both feed the same enrollment code
//! ([`crate::state::WorkloadIndex::build`] and the agent's reconciler).

use std::{collections::HashSet, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};

pub mod kube;
pub mod manifests;

use self::{
    kube::KubeSource,
    manifests::{ManifestDir, ManifestError, Rescan},
};
use crate::k8s::{EndpointSlice, Namespace, Pod, Service};
use crate::{authz::Policy, dataplane::Removal};

/// Where the agent learns about workloads.
#[derive(Clone, Debug)]
pub enum WorkloadSourceConfig {
    /// A directory of manifests (Pods, Namespaces, AuthorizationPolicies,
    /// Services, EndpointSlices), watched.
    Manifests(PathBuf),
    /// The Kubernetes API: watchers of all pods, this node's pods and the
    /// namespaces.
    Kubernetes {
        /// The kubeconfig to use; `None`: the in-cluster configuration.
        kubeconfig: Option<PathBuf>,
    },
}

/// How long the agent waits at start for the Kubernetes API's first lists before
/// it serves with what it has (pinned pods stay captured meanwhile).
pub const FIRST_LIST_WAIT: Duration = Duration::from_secs(10);

/// A workload source, opened.
pub enum Source {
    /// A watched manifests directory.
    Manifests {
        /// The files and their last good objects.
        dir: ManifestDir,
        /// The inotify watch on the directory, filling `dir`'s completions.
        watch: Box<manifests::Watch>,
    },
    /// The Kubernetes API.
    Kubernetes(Box<KubeSource>),
}

impl Source {
    /// Opens the source `config` names, for node `node`.
    ///
    /// # Errors
    /// A manifests directory that cannot be read or watched; a Kubernetes
    /// configuration that cannot be loaded.
    pub async fn open(config: &WorkloadSourceConfig, node: &str) -> Result<Self> {
        match config {
            WorkloadSourceConfig::Manifests(path) => {
                let completions = manifests::Completions::default();
                let dir = ManifestDir::new(path)
                    .with_context(|| format!("reading the manifests directory {}", path.display()))?
                    .with_completions(completions.clone());
                let watch = manifests::Watch::new(dir.dir(), completions)
                    .map(Box::new)
                    .with_context(|| format!("watching {}", path.display()))?;
                Ok(Source::Manifests { dir, watch })
            }
            WorkloadSourceConfig::Kubernetes { kubeconfig } => {
                let source = KubeSource::start(kubeconfig.as_deref(), node).await?;
                if !source.wait_ready(FIRST_LIST_WAIT).await {
                    tracing::warn!(
                        "the Kubernetes API has not listed this node's pods and the namespaces within {}s; serving with what is known, nothing is detached until it has",
                        FIRST_LIST_WAIT.as_secs()
                    );
                }
                Ok(Source::Kubernetes(Box::new(source)))
            }
        }
    }

    /// Waits for the next change (for manifests, with the writer's related
    /// changes coalesced).
    pub async fn changed(&mut self) {
        match self {
            Source::Manifests { watch, .. } => watch.changed().await,
            Source::Kubernetes(kube) => kube.changed().await,
        }
    }

    /// Reads what changed since the last call.
    pub fn rescan(&mut self) -> Rescan {
        match self {
            Source::Manifests { dir, .. } => dir.rescan(),
            Source::Kubernetes(kube) => kube.refresh(),
        }
    }

    /// Makes the next [`Source::rescan`] look at everything again (the agent's
    /// periodic resync; see [`ManifestDir::resync`]). A manifests directory that
    /// was removed, or moved away, and made again since it was watched (the old
    /// inotify watch went with it) is watched again. The Kubernetes API's
    /// watches need none.
    pub fn resync(&mut self) {
        if let Source::Manifests { dir, watch } = self {
            dir.resync();
            watch.renew();
        }
    }

    /// All pods.
    pub fn pods(&self) -> Box<dyn Iterator<Item = &Pod> + '_> {
        match self {
            Source::Manifests { dir, .. } => Box::new(dir.pods()),
            Source::Kubernetes(kube) => Box::new(kube.pods().iter()),
        }
    }

    /// Pods defined more than once, worded with where (see
    /// [`ManifestDir::duplicate_pods`]); the Kubernetes API has none.
    pub fn duplicate_pods(&self) -> Vec<String> {
        match self {
            Source::Manifests { dir, .. } => dir.duplicate_pods(),
            Source::Kubernetes(_) => Vec::new(),
        }
    }

    /// All namespaces.
    pub fn namespaces(&self) -> Box<dyn Iterator<Item = &Namespace> + '_> {
        match self {
            Source::Manifests { dir, .. } => Box::new(dir.namespaces()),
            Source::Kubernetes(kube) => Box::new(kube.namespaces().iter()),
        }
    }

    /// All Services (the Kubernetes source does not watch them yet).
    pub fn services(&self) -> Box<dyn Iterator<Item = &Service> + '_> {
        match self {
            Source::Manifests { dir, .. } => Box::new(dir.services()),
            Source::Kubernetes(_) => Box::new(std::iter::empty()),
        }
    }

    /// All EndpointSlices (the Kubernetes source does not watch them yet).
    pub fn endpoint_slices(&self) -> Box<dyn Iterator<Item = &EndpointSlice> + '_> {
        match self {
            Source::Manifests { dir, .. } => Box::new(dir.endpoint_slices()),
            Source::Kubernetes(_) => Box::new(std::iter::empty()),
        }
    }

    /// All authorization policies (the Kubernetes source does not watch them yet).
    pub fn policies(&self) -> Box<dyn Iterator<Item = &Arc<Policy>> + '_> {
        match self {
            Source::Manifests { dir, .. } => Box::new(dir.policies()),
            Source::Kubernetes(_) => Box::new(std::iter::empty()),
        }
    }

    /// A broken manifest that may hold policies (see
    /// [`ManifestDir::policies_unknown`]).
    pub fn policies_unknown(&self) -> Option<&ManifestError> {
        match self {
            Source::Manifests { dir, .. } => dir.policies_unknown(),
            Source::Kubernetes(_) => None,
        }
    }

    /// What may be detached, given how complete the source is: nothing while a
    /// manifest settles or the API has not listed yet; only this agent's own
    /// attachments while a manifest is broken since start-up.
    pub fn removal(&self) -> Removal {
        match self {
            Source::Manifests { dir, .. } if dir.settling() => Removal::Nothing,
            Source::Manifests { dir, .. } if dir.incomplete() => Removal::OwnOnly,
            Source::Manifests { .. } => Removal::All,
            Source::Kubernetes(kube) if !kube.ready() => Removal::Nothing,
            Source::Kubernetes(_) => Removal::All,
        }
    }

    /// Whether the source has a Namespace object named `name`. A manifests
    /// directory need not hold one for every namespace its pods use: always
    /// true there.
    pub fn knows_namespace(&self, name: &str) -> bool {
        match self {
            Source::Manifests { .. } => true,
            Source::Kubernetes(kube) => kube
                .namespaces()
                .iter()
                .any(|ns| ns.metadata.name.as_deref() == Some(name)),
        }
    }

    /// Tells the source which of this node's pods are captured now
    /// (`namespace/name`): the Kubernetes source annotates them.
    pub fn captured(&mut self, captured: &HashSet<Arc<str>>) {
        if let Source::Kubernetes(kube) = self {
            kube.annotate(captured);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  namespace: default\nspec:\n  nodeName: node-1\nstatus:\n  podIP: 10.0.0.5\n";

    /// The agent's periodic resync is what watches a manifests directory made
    /// again: after it, a manifest written into the new directory wakes the
    /// source and is read.
    #[tokio::test]
    async fn a_resync_watches_a_manifests_directory_made_again() {
        let guard = tempfile::tempdir().unwrap();
        let path = guard.path().join("manifests");
        std::fs::create_dir(&path).unwrap();
        let config = WorkloadSourceConfig::Manifests(path.clone());
        let mut source = Source::open(&config, "node-1").await.unwrap();
        std::fs::remove_dir(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        // The old watch's report of the removal is not what is waited for.
        tokio::time::sleep(Duration::from_millis(200)).await;
        tokio::time::timeout(Duration::from_millis(500), source.changed())
            .await
            .ok();
        source.resync();
        source.rescan();
        std::fs::write(path.join("pod.yaml"), POD).unwrap();
        tokio::time::timeout(Duration::from_secs(5), source.changed())
            .await
            .expect("a manifest written into the directory made again woke the source");
        // The file may still be settling (its close not seen yet): rescan until
        // it is read.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut errors = Vec::new();
        while source.pods().count() == 0 && std::time::Instant::now() < deadline {
            errors.extend(source.rescan().errors);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(errors.is_empty(), "{errors:?}");
        let names: Vec<_> = source
            .pods()
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        assert_eq!(names, ["web"]);
    }
}
