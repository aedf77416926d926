//! Where the agent learns about workloads: a manifests directory
//! ([`manifests`]) or the Kubernetes API ([`kube`]).
//!
//! Each source implements [`Source`]: it owns its timing (a directory's
//! settling and resync, the API's watches) and sends [`Delta`]s carrying the
//! changed objects and how complete its view is; [`crate::state::State`] applies
//! them without knowing where they came from. Adding a source adds a module
//! here and an arm to [`open`], nothing in the reconciler.

pub mod kube;
pub mod manifests;

use std::{collections::HashSet, future::Future, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use tokio::{sync::mpsc, task::JoinHandle};

use crate::state::Delta;

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

/// A feed of workloads.
pub trait Source: Send + 'static {
    /// Waits for the source's next delta. The first gives the source's whole
    /// view (waiting at most [`FIRST_LIST_WAIT`] for it); the next ones what
    /// changed since, or a change of the view's completeness.
    fn next(&mut self) -> impl Future<Output = Delta> + Send;

    /// Whether the source lists every Namespace, so that one it lacks does not
    /// exist (the Kubernetes API); a manifests directory need not hold one for
    /// every namespace its pods use.
    fn lists_every_namespace(&self) -> bool;

    /// What tells the cluster which pods are captured, if the source has one
    /// (the Kubernetes API: the pods' redirection annotation).
    fn capture_reporter(&self) -> Option<Box<dyn CaptureReporter>> {
        None
    }
}

/// Tells the cluster which of this node's pods are captured.
pub trait CaptureReporter: Send {
    /// This node's pods captured now (`namespace/name`); the others are not.
    fn captured(&mut self, captured: &HashSet<Arc<str>>);
}

/// A source running in a task of its own.
pub struct Opened {
    /// The source's deltas, its whole view first.
    pub deltas: mpsc::Receiver<Delta>,
    /// See [`Source::lists_every_namespace`].
    pub lists_every_namespace: bool,
    /// See [`Source::capture_reporter`].
    pub reporter: Option<Box<dyn CaptureReporter>>,
    task: JoinHandle<()>,
}

impl Drop for Opened {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts `source` in a task of its own, sending its deltas.
pub fn spawn(mut source: impl Source) -> Opened {
    let (tx, deltas) = mpsc::channel(16);
    let lists_every_namespace = source.lists_every_namespace();
    let reporter = source.capture_reporter();
    let task = tokio::spawn(async move {
        loop {
            let delta = source.next().await;
            if tx.send(delta).await.is_err() {
                return;
            }
        }
    });
    Opened {
        deltas,
        lists_every_namespace,
        reporter,
        task,
    }
}

/// Opens the source `config` names, for node `node`, and starts it.
///
/// # Errors
/// A manifests directory that cannot be read or watched; a Kubernetes
/// configuration that cannot be loaded.
pub async fn open(config: &WorkloadSourceConfig, node: &str) -> Result<Opened> {
    match config {
        WorkloadSourceConfig::Manifests(path) => {
            let source = manifests::ManifestSource::open(path)
                .with_context(|| format!("reading the manifests directory {}", path.display()))?;
            Ok(spawn(source))
        }
        WorkloadSourceConfig::Kubernetes { kubeconfig } => {
            let source = kube::KubeSource::start(kubeconfig.as_deref(), node).await?;
            Ok(spawn(source))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An opened source sends its whole view first.
    #[tokio::test]
    async fn an_opened_manifests_directory_sends_its_pods_first() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("pod.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n",
        )
        .unwrap();
        let config = WorkloadSourceConfig::Manifests(dir.path().to_path_buf());
        let mut opened = open(&config, "node-1").await.unwrap();
        assert!(!opened.lists_every_namespace);
        let first = opened.deltas.recv().await.unwrap();
        let names: Vec<_> = first
            .all_pods
            .iter()
            .flatten()
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        assert_eq!(names, ["web"]);
    }
}
