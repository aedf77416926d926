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
pub mod xds;

use std::{collections::HashSet, future::Future, io, path::PathBuf, sync::Arc, time::Duration};

use ::kube::config::{InClusterError, KubeconfigError};
use tokio::{sync::mpsc, task::JoinHandle};

use crate::{error::Chain, state::Delta};

/// Why a source could not be opened. Each message ends with its cause and the
/// cause's own causes, `: `-separated, so the cause is a field (`error`), not
/// [`std::error::Error::source`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The manifests directory is not a readable directory.
    #[error("reading the manifests directory {}: {}", path.display(), Chain(error))]
    ManifestsDirectory {
        /// The directory, as given.
        path: PathBuf,
        /// The system call's error.
        error: io::Error,
    },
    /// inotify cannot watch the manifests directory (inotify(7); the message
    /// is the one of [`Error::ManifestsDirectory`]).
    #[error("reading the manifests directory {}: {}", path.display(), Chain(error))]
    Watch {
        /// The directory, as given.
        path: PathBuf,
        /// The watcher's error.
        error: notify::Error,
    },
    /// The kubeconfig cannot be read or parsed.
    #[error("reading the kubeconfig {}: {}", path.display(), Chain(error))]
    ReadKubeconfig {
        /// The kubeconfig.
        path: PathBuf,
        /// kube-rs's error.
        error: KubeconfigError,
    },
    /// The kubeconfig gives no usable configuration (no current context, a
    /// cluster URL or credentials that cannot be used).
    #[error("using the kubeconfig {}: {}", path.display(), Chain(error))]
    UseKubeconfig {
        /// The kubeconfig.
        path: PathBuf,
        /// kube-rs's error.
        error: KubeconfigError,
    },
    /// No kubeconfig was given and the agent does not run in a pod
    /// (`KUBERNETES_SERVICE_HOST`/`_PORT` unset, or no service account token
    /// or CA).
    #[error(
        "no --manifests or --kubeconfig given, and no in-cluster configuration (KUBERNETES_SERVICE_HOST and the service account) found: {}",
        Chain(error)
    )]
    NoInClusterConfig {
        /// kube-rs's error.
        error: InClusterError,
    },
    /// The xDS client cannot be made (its address is not `https://host:port`).
    #[error("{}", Chain(error))]
    Xds {
        /// The client's error.
        error: crate::xds::XdsError,
    },
    /// The Kubernetes client cannot be made from the configuration (its TLS
    /// settings, its authentication).
    #[error("making the Kubernetes client: {}", Chain(error))]
    Client {
        /// kube-rs's error.
        error: ::kube::Error,
    },
}

/// Where the agent learns about workloads.
#[derive(Clone, Debug)]
pub enum WorkloadSourceConfig {
    /// A directory of manifests (Pods, Namespaces, AuthorizationPolicies,
    /// Services, EndpointSlices), watched.
    Manifests(PathBuf),
    /// The Kubernetes API: watchers of all pods, this node's pods, the
    /// namespaces, Services, EndpointSlices, Nodes, AuthorizationPolicies and
    /// PeerAuthentications.
    Kubernetes {
        /// The kubeconfig to use; `None`: the in-cluster configuration.
        kubeconfig: Option<PathBuf>,
    },
    /// Istiod's workload xDS for workloads, services and policies, beside the
    /// Kubernetes API for the pods ([`xds::IstiodSource`]).
    Istiod {
        /// The kubeconfig to use; `None`: the in-cluster configuration.
        kubeconfig: Option<PathBuf>,
        /// How to reach istiod.
        xds: Box<crate::xds::XdsConfig>,
        /// The trust domain of workloads that name none.
        trust_domain: String,
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

    /// Whether the agent is to be ready (`/healthz/ready`) only once the
    /// source's view is whole ([`crate::state::Completeness::Complete`]) and
    /// the policies are known (the Kubernetes API: its first lists); a
    /// manifests directory makes it ready with its first view.
    fn readiness_waits_for_whole_view(&self) -> bool {
        false
    }

    /// What tells the cluster which pods are captured, if the source has one
    /// (the Kubernetes API: the pods' redirection annotation).
    fn capture_reporter(&self) -> Option<Box<dyn CaptureReporter>> {
        None
    }
}

/// Tells the cluster which of this node's pods are captured.
pub trait CaptureReporter: Send {
    /// This node's pods captured now (`namespace/name`); the others are not.
    /// Told only from a whole view of the source, so that a pod the agent
    /// does not know yet (a previous agent's capture) is not reported
    /// uncaptured.
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
    /// See [`Source::readiness_waits_for_whole_view`].
    pub readiness_waits_for_whole_view: bool,
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
    let readiness_waits_for_whole_view = source.readiness_waits_for_whole_view();
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
        readiness_waits_for_whole_view,
        task,
    }
}

/// Opens the source `config` names, for node `node`, and starts it; an
/// istiod source counts in `xds_metrics`.
///
/// # Errors
/// A manifests directory that cannot be read or watched; a Kubernetes
/// configuration that cannot be loaded; an istiod address that is not
/// `https://host:port` ([`Error`]).
pub async fn open(
    config: &WorkloadSourceConfig,
    node: &str,
    xds_metrics: &crate::xds::XdsMetrics,
) -> Result<Opened, Error> {
    match config {
        WorkloadSourceConfig::Manifests(path) => {
            let source = manifests::ManifestSource::open(path)?;
            Ok(spawn(source))
        }
        WorkloadSourceConfig::Kubernetes { kubeconfig } => {
            let source =
                kube::KubeSource::start(kubeconfig.as_deref(), node, kube::Scope::Cluster).await?;
            Ok(spawn(source))
        }
        WorkloadSourceConfig::Istiod {
            kubeconfig,
            xds,
            trust_domain,
        } => {
            let client =
                crate::xds::XdsClient::new(crate::xds::XdsConfig::clone(xds), xds_metrics.clone())
                    .map_err(|error| Error::Xds { error })?;
            let kube = spawn(
                kube::KubeSource::start(kubeconfig.as_deref(), node, kube::Scope::Node).await?,
            );
            Ok(spawn(xds::IstiodSource::start(kube, client, trust_domain)))
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
        let mut opened = open(&config, "node-1", &Default::default()).await.unwrap();
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

    /// A manifests directory that is not one: the message `anyhow`'s `{:#}`
    /// printed with the context `open` gave it.
    #[tokio::test]
    async fn a_missing_manifests_directory_is_named_with_its_cause() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing");
        let config = WorkloadSourceConfig::Manifests(path.clone());
        let Err(error) = open(&config, "node-1", &Default::default()).await else {
            panic!("a missing directory was opened");
        };
        assert!(
            matches!(error, Error::ManifestsDirectory { .. }),
            "{error:?}"
        );
        let cause = std::fs::read_dir(&path).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "{:#}",
                anyhow::Error::new(cause).context(format!(
                    "reading the manifests directory {}",
                    path.display()
                ))
            )
        );
    }

    /// A kubeconfig that cannot be read: kube-rs's error and its causes, after
    /// the context `anyhow` printed.
    #[tokio::test]
    async fn an_unreadable_kubeconfig_is_named_with_its_causes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let config = WorkloadSourceConfig::Kubernetes {
            kubeconfig: Some(path.clone()),
        };
        let Err(error) = open(&config, "node-1", &Default::default()).await else {
            panic!("a missing kubeconfig was used");
        };
        assert!(matches!(error, Error::ReadKubeconfig { .. }), "{error:?}");
        let cause = ::kube::config::Kubeconfig::read_from(&path).unwrap_err();
        let expected = format!(
            "{:#}",
            anyhow::Error::new(cause).context(format!("reading the kubeconfig {}", path.display()))
        );
        assert_eq!(error.to_string(), expected);
        // The cause's own cause (the system call's error) is in the message.
        assert!(expected.matches(": ").count() >= 2, "{expected}");
    }

    /// A kubeconfig without a context cannot be used.
    #[tokio::test]
    async fn a_kubeconfig_without_a_context_is_named_with_its_causes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(&path, "apiVersion: v1\nkind: Config\n").unwrap();
        let config = WorkloadSourceConfig::Kubernetes {
            kubeconfig: Some(path.clone()),
        };
        let Err(error) = open(&config, "node-1", &Default::default()).await else {
            panic!("a kubeconfig without a context was used");
        };
        assert!(matches!(error, Error::UseKubeconfig { .. }), "{error:?}");
        let kubeconfig = ::kube::config::Kubeconfig::read_from(&path).unwrap();
        let cause = ::kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "{:#}",
                anyhow::Error::new(cause)
                    .context(format!("using the kubeconfig {}", path.display()))
            )
        );
    }
}
