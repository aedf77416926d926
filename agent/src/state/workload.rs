//! Workloads (pods) and the enrollment decision.
//!
//! The sources ([`crate::source`]) produce podlink's partial Pods and Namespaces
//! ([`crate::k8s`]); [`WorkloadIndex::build`] turns them into the proxy's and the
//! dataplane's view.
//!
//! Enrollment follows Istio ambient ("Ambient mode" → "Add workloads to the mesh"):
//! the label `istio.io/dataplane-mode=ambient` on the pod's namespace or on the pod
//! enrolls it; `istio.io/dataplane-mode=none` on the pod opts it out; pods with
//! `hostNetwork: true` are never enrolled.
//!
//! A workload also carries the names telemetry reports it by, made once with
//! it: the workload the pod belongs to ([`owning_workload`]: its Deployment,
//! StatefulSet, … as Istio names them) and Istio's canonical service and
//! revision ([`canonical_service`], [`canonical_revision`]).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, hash_map::Entry},
    net::IpAddr,
    sync::Arc,
};

use crate::k8s::{Namespace, Pod};
use serde::Serialize;

use crate::identity::SpiffeId;

/// The label that selects the dataplane mode of a namespace or pod.
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// [`DATAPLANE_MODE_LABEL`] value that enrolls.
pub const DATAPLANE_MODE_AMBIENT: &str = "ambient";
/// [`DATAPLANE_MODE_LABEL`] value that opts a pod out.
pub const DATAPLANE_MODE_NONE: &str = "none";
/// Pod annotation: `"false"` leaves the pod's DNS uncaptured (Istio ambient's
/// opt-out; any other value, or none, captures it when the agent captures DNS).
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";

/// Whether `pod`'s DNS is captured, as far as the pod says
/// ([`DNS_CAPTURE_ANNOTATION`]).
pub fn dns_capture(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DNS_CAPTURE_ANNOTATION))
        .is_none_or(|v| v != "false")
}

/// Pod label naming the workload the pod belongs to, over what its controller
/// gives (Istio's `service.istio.io/workload-name`).
pub const WORKLOAD_NAME_LABEL: &str = "service.istio.io/workload-name";
/// Pod label a Deployment's ReplicaSet sets: the hash its name ends with.
pub const POD_TEMPLATE_HASH_LABEL: &str = "pod-template-hash";
/// Pod label an Argo Rollout's ReplicaSet sets: the hash its name ends with.
pub const ROLLOUTS_POD_TEMPLATE_HASH_LABEL: &str = "rollouts-pod-template-hash";
/// Pod label an OpenShift DeploymentConfig's ReplicationController sets: the
/// DeploymentConfig's name.
pub const DEPLOYMENT_CONFIG_LABEL: &str = "deploymentconfig";
/// The labels giving the canonical service, first present first.
pub const CANONICAL_SERVICE_LABELS: [&str; 3] = [
    "service.istio.io/canonical-name",
    "app.kubernetes.io/name",
    "app",
];
/// The labels giving the canonical revision, first present first.
pub const CANONICAL_REVISION_LABELS: [&str; 3] = [
    "service.istio.io/canonical-revision",
    "app.kubernetes.io/version",
    "version",
];
/// The canonical revision of a pod without any of [`CANONICAL_REVISION_LABELS`].
pub const DEFAULT_CANONICAL_REVISION: &str = "latest";

/// The workload a pod belongs to, as telemetry names it: borrowed from the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwningWorkload<'a> {
    /// Its name, e.g. `reviews` for pod `reviews-v1-5d8f9c7b6-x2x9q`.
    pub name: &'a str,
    /// Its kind: `Deployment`, `StatefulSet`, `DaemonSet`, `Job`, `CronJob`,
    /// `ReplicaSet`, `Rollout`, `DeploymentConfig`, another controller's kind as
    /// its owner reference gives it, or `Pod` for a pod without a controller.
    pub kind: &'a str,
}

/// The workload `pod` belongs to, as Istio's `GetDeployMetaFromPod` (istiod,
/// and the `WORKLOAD_NAME` its sidecar injector gives a proxy) works it out
/// from the pod's controller (its `metadata.ownerReferences` entry with
/// `controller: true`):
///
/// * a ReplicaSet whose name ends with the pod's `pod-template-hash` label: its
///   Deployment, the ReplicaSet's name without `-<hash>` (likewise an Argo
///   Rollout, with `rollouts-pod-template-hash`);
/// * a ReplicationController, when the pod has a `deploymentconfig` label:
///   that OpenShift DeploymentConfig;
/// * a Job whose name ends with `-` and 8 to 10 digits (the scheduled time a
///   CronJob appends): that CronJob, the Job's name without the suffix;
/// * any other controller (StatefulSet, DaemonSet, Job, a ReplicaSet of no
///   Deployment, …): itself;
/// * no controller: the pod, by its name.
///
/// The label `service.istio.io/workload-name`, when set and not empty, names
/// the workload whatever the controller (Istio's `GetWorkloadMetaFromPod`).
/// Unlike Istio, the owner references are read whether or not the pod has a
/// `metadata.generateName` (podlink does not read it; pods made by
/// controllers have one). A name that ends like a hash but is not the pod's
/// `pod-template-hash` is kept whole.
pub fn owning_workload(pod: &Pod) -> OwningWorkload<'_> {
    let meta = &pod.metadata;
    let pod_name = meta.name.as_deref().unwrap_or_default();
    let label = |key: &str| {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(key))
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    };
    let controller = meta
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true));
    let mut owner = match controller {
        None => OwningWorkload {
            name: pod_name,
            kind: "Pod",
        },
        Some(r) => {
            let without_hash = |key| {
                label(key)
                    .filter(|hash| r.name.ends_with(hash))
                    .map(|hash| strip_dash_suffix(&r.name, hash))
            };
            let made_by = match r.kind.as_str() {
                "ReplicaSet" => without_hash(POD_TEMPLATE_HASH_LABEL)
                    .map(|name| (name, "Deployment"))
                    .or_else(|| {
                        without_hash(ROLLOUTS_POD_TEMPLATE_HASH_LABEL).map(|name| (name, "Rollout"))
                    }),
                "ReplicationController" => {
                    label(DEPLOYMENT_CONFIG_LABEL).map(|name| (name, "DeploymentConfig"))
                }
                "Job" => cron_job_of(&r.name).map(|name| (name, "CronJob")),
                _ => None,
            };
            let (name, kind) = made_by.unwrap_or((&r.name, &r.kind));
            OwningWorkload { name, kind }
        }
    };
    if owner.name.is_empty() {
        owner.name = pod_name;
    }
    if let Some(name) = label(WORKLOAD_NAME_LABEL) {
        owner.name = name;
    }
    owner
}

/// `name` without `-<suffix>` (`name` ends with `suffix`); `name` whole when
/// the suffix is not after a `-`.
fn strip_dash_suffix<'a>(name: &'a str, suffix: &str) -> &'a str {
    name.strip_suffix(suffix)
        .and_then(|n| n.strip_suffix('-'))
        .unwrap_or(name)
}

/// The CronJob that made Job `job`: `<cronjob>-<8 to 10 digits>` (the digits are
/// the scheduled time, in minutes since the Unix epoch), as Istio's
/// `(.+)-\d{8,10}$`.
fn cron_job_of(job: &str) -> Option<&str> {
    let (name, digits) = job.rsplit_once('-')?;
    (!name.is_empty()
        && (8..=10).contains(&digits.len())
        && digits.bytes().all(|b| b.is_ascii_digit()))
    .then_some(name)
}

/// The first of `keys` that `labels` has (an empty value counts, as in Istio).
fn first_label<'a>(labels: &'a BTreeMap<String, String>, keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| labels.get(*k)).map(String::as_str)
}

/// Istio's canonical service of a pod with `labels` belonging to workload
/// `workload_name`: the first of [`CANONICAL_SERVICE_LABELS`] it has
/// (`service.istio.io/canonical-name`, `app.kubernetes.io/name`, `app`), else
/// the workload's name.
pub fn canonical_service<'a>(
    labels: &'a BTreeMap<String, String>,
    workload_name: &'a str,
) -> &'a str {
    first_label(labels, &CANONICAL_SERVICE_LABELS).unwrap_or(workload_name)
}

/// Istio's canonical revision of a pod with `labels`: the first of
/// [`CANONICAL_REVISION_LABELS`] it has (`service.istio.io/canonical-revision`,
/// `app.kubernetes.io/version`, `version`), else `latest`.
pub fn canonical_revision(labels: &BTreeMap<String, String>) -> &str {
    first_label(labels, &CANONICAL_REVISION_LABELS).unwrap_or(DEFAULT_CANONICAL_REVISION)
}

/// Whether a pod's traffic is captured, and why not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum Enrollment {
    /// Captured by podlink.
    Enrolled,
    /// Not captured, for the reason given.
    NotEnrolled(&'static str),
}

impl Enrollment {
    /// Whether this is [`Enrollment::Enrolled`].
    pub fn is_enrolled(self) -> bool {
        self == Enrollment::Enrolled
    }
}

/// Decides a pod's enrollment from its labels, its namespace's labels and
/// `spec.hostNetwork`.
pub fn enrollment(pod: &Pod, namespace: Option<&Namespace>) -> Enrollment {
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
    {
        return Enrollment::NotEnrolled("hostNetwork pod");
    }
    fn mode(labels: Option<&BTreeMap<String, String>>) -> Option<&str> {
        labels
            .and_then(|l| l.get(DATAPLANE_MODE_LABEL))
            .map(String::as_str)
    }
    match mode(pod.metadata.labels.as_ref()) {
        Some(DATAPLANE_MODE_NONE) => return Enrollment::NotEnrolled("pod opted out"),
        Some(DATAPLANE_MODE_AMBIENT) => return Enrollment::Enrolled,
        _ => {}
    }
    let ns_mode = namespace.and_then(|ns| mode(ns.metadata.labels.as_ref()));
    if ns_mode == Some(DATAPLANE_MODE_AMBIENT) {
        Enrollment::Enrolled
    } else {
        Enrollment::NotEnrolled("no ambient label on pod or namespace")
    }
}

/// One pod as the proxy and the dataplane see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Workload {
    /// `namespace/name`, made once (see [`Workload::key`]).
    #[serde(skip)]
    pub(crate) key: Arc<str>,
    /// `metadata.namespace` (`default` when absent).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `spec.nodeName`; `None` while unscheduled.
    pub node: Option<String>,
    /// `spec.serviceAccountName` (`default` when absent).
    pub service_account: String,
    /// `status.podIPs` (or `status.podIP`), in order.
    pub ips: Vec<IpAddr>,
    /// Whether the pod is captured.
    pub enrollment: Enrollment,
    /// `metadata.deletionTimestamp` is set: the pod is shutting down.
    pub terminating: bool,
    /// `metadata.labels` (what authorization policy selectors match).
    pub labels: BTreeMap<String, String>,
    /// The workload's SPIFFE ID.
    #[serde(serialize_with = "serialize_display")]
    pub identity: SpiffeId,
    /// The name of the workload the pod belongs to ([`owning_workload`]): its
    /// Deployment's, StatefulSet's, …, or the pod's own. The metrics'
    /// `*_workload` label.
    pub workload_name: String,
    /// The kind of that workload ([`OwningWorkload::kind`]): `Deployment`,
    /// `StatefulSet`, …, `Pod`.
    pub workload_kind: String,
    /// Istio's canonical service ([`canonical_service`]).
    pub canonical_service: String,
    /// Istio's canonical revision ([`canonical_revision`]).
    pub canonical_revision: String,
    /// `spec.hostNetwork`: the pod's addresses are its node's, so they name no
    /// workload.
    #[serde(skip)]
    pub(crate) host_network: bool,
    /// Whether its DNS queries are captured when the agent captures DNS: not when
    /// annotated [`DNS_CAPTURE_ANNOTATION`] `"false"`.
    pub dns_capture: bool,
    /// What Istio's control plane says of the workload beyond what a pod says
    /// (workload xDS); `None` for a workload made from a pod alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mesh: Option<Arc<MeshFacts>>,
}

/// What istiod says of a workload that a Pod object does not (workload xDS
/// `istio.workload.Workload`, Istio's `pkg/workloadapi/workload.proto`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MeshFacts {
    /// The resource's name (`uid`: `<cluster>//Pod/<namespace>/<name>` for a pod).
    pub uid: String,
    /// The authorization policies istiod selected for it by their selectors
    /// (`authorization_policies`, `namespace/name`); namespace and mesh-wide
    /// ones are not listed (they apply by scope).
    pub policies: Vec<String>,
    /// The services it backs (`services`): `namespace/hostname` → its ports,
    /// each (service port, target port); a target port 0 is the service's own.
    pub services: BTreeMap<String, Vec<(u16, u16)>>,
    /// `status` is `HEALTHY`: it gets new connections.
    pub healthy: bool,
    /// `network` (empty: the default network).
    pub network: String,
    /// `locality.zone`, if set.
    pub zone: Option<String>,
    /// `waypoint`: connections to it go through this waypoint.
    pub waypoint: Option<Waypoint>,
}

/// A waypoint (an L7 proxy reached over HBONE) that connections to a workload
/// or service go through (workload xDS `GatewayAddress`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Waypoint {
    /// Where it is.
    pub target: WaypointTarget,
    /// Its HBONE port (`hbone_mtls_port`; 15008 when 0).
    pub port: u16,
}

/// Where a waypoint is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaypointTarget {
    /// An address: a waypoint workload's, or its service's virtual address.
    Address(std::net::IpAddr),
    /// A service, by `namespace/hostname`.
    Service(String),
}

impl MeshFacts {
    /// The target port of this workload for port `service_port` of service
    /// `service` (`namespace/hostname`): its own if it names one, else
    /// `default` (the service's). `None` if it does not back that service.
    pub fn target_port(&self, service: &str, service_port: u16, default: u16) -> Option<u16> {
        let ports = self.services.get(service)?;
        match ports.iter().find(|(p, _)| *p == service_port) {
            Some((_, 0)) | None => Some(default),
            Some((_, target)) => Some(*target),
        }
    }
}

fn serialize_display<S: serde::Serializer>(
    v: &impl std::fmt::Display,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl Workload {
    /// `namespace/name`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether this workload is what `pod` (whose service account, defaulted, is
    /// `service_account` and whose enrollment is `enrollment`) makes in
    /// `trust_domain`, field by field and without allocating: the index then keeps
    /// this one instead of making it again. The namespace and name are not
    /// compared: the caller found this workload by the pod's `namespace/name`,
    /// which names one pod (names are DNS labels and subdomains, without `/`: the
    /// manifests reader refuses others, the Kubernetes API server too).
    fn is_made_from(
        &self,
        pod: &Pod,
        service_account: &str,
        enrollment: Enrollment,
        trust_domain: &str,
    ) -> bool {
        let spec = pod.spec.as_ref();
        self.enrollment == enrollment
            && self.mesh.is_none()
            && self.host_network == spec.and_then(|s| s.host_network).unwrap_or(false)
            && self.service_account == service_account
            && self.identity.trust_domain() == trust_domain
            && self.node.as_deref() == spec.and_then(|s| s.node_name.as_deref())
            && self.terminating == pod.metadata.deletion_timestamp.is_some()
            && pod
                .metadata
                .labels
                .as_ref()
                .map_or(self.labels.is_empty(), |l| *l == self.labels)
            && pod_ips_are(pod, &self.ips)
            && self.dns_capture == dns_capture(pod)
            // The canonical names follow from the labels and the workload's name.
            && owning_workload(pod)
                == OwningWorkload {
                    name: &self.workload_name,
                    kind: &self.workload_kind,
                }
    }

    /// The pod's first IPv4 address.
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        self.ips.iter().find_map(|ip| match ip {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
    }

    /// The workload's first IPv6 address (`status.podIPs`), if any; an
    /// IPv4-mapped address is not one.
    pub fn ipv6(&self) -> Option<std::net::Ipv6Addr> {
        self.ips.iter().find_map(|ip| match ip {
            IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => Some(*v6),
            _ => None,
        })
    }
}

/// Pods that are not workloads: finished ones no longer own their address.
pub(crate) fn is_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The IPs of a pod: `status.podIPs`, else `status.podIP`. Unparsable entries were
/// refused when the manifest was read, so they are skipped here.
fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok())
        .collect();
    if ips.is_empty()
        && let Some(ip) = status.pod_ip.as_deref().and_then(|ip| ip.parse().ok())
    {
        ips.push(ip);
    }
    ips
}

/// Whether [`pod_ips`] of `pod` would be `ips` (the addresses the index
/// gives its workload), without allocating.
pub(crate) fn pod_ips_are(pod: &Pod, ips: &[IpAddr]) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return ips.is_empty();
    };
    let parsed = || {
        status
            .pod_ips
            .iter()
            .flatten()
            .filter_map(|p| p.ip.parse::<IpAddr>().ok())
    };
    if parsed().next().is_some() {
        return parsed().eq(ips.iter().copied());
    }
    let single: Option<IpAddr> = status.pod_ip.as_deref().and_then(|ip| ip.parse().ok());
    single.into_iter().eq(ips.iter().copied())
}

/// All workloads of the cluster, indexed by address, from this node's point of view.
///
/// Made whole by [`WorkloadIndex::build`] (or [`WorkloadIndex::rebuild`]), or
/// changed pod by pod with [`WorkloadIndex::update`]: an index updated for a
/// set of pods is the one a build from the same pods would make. An update
/// costs its pod's own work (a few ordered-map steps); what stays a walk of
/// every pod is its caller's copy of the index the proxy does not share.
#[derive(Clone, Debug, Default)]
pub struct WorkloadIndex {
    node: String,
    workloads: BTreeMap<Arc<str>, Arc<Workload>>,
    /// Each address's owner: its only claimant, or the one [`settle`] picks.
    ///
    /// [`settle`]: WorkloadIndex::settle
    by_ip: HashMap<IpAddr, Arc<Workload>>,
    /// Addresses claimed by more than one workload, with all their claimants by
    /// `namespace/name`.
    contested: BTreeMap<IpAddr, BTreeMap<Arc<str>, Arc<Workload>>>,
    /// Contested addresses without an owner (more than one live claimant), with
    /// their live claimants' `namespace/name`s in that order.
    conflicts: BTreeMap<IpAddr, Vec<String>>,
    /// Pods defined more than once (`namespace/name`).
    duplicated: BTreeSet<Arc<str>>,
    /// How many times a workload left the index (a rebuild counts as one).
    removals: u64,
}

/// The workload `pod` makes, keyed `key`: `previous` (the same `Arc`) when it
/// is what `pod` makes, else a new one.
fn workload_of(
    previous: Option<&Arc<Workload>>,
    key: &str,
    pod: &Pod,
    namespace: Option<&Namespace>,
    trust_domain: &str,
) -> Arc<Workload> {
    let spec = pod.spec.as_ref();
    let service_account = spec
        .and_then(|s| s.service_account_name.as_deref())
        .filter(|s| !s.is_empty())
        .unwrap_or("default");
    let enrollment = enrollment(pod, namespace);
    match previous {
        Some(w) if w.is_made_from(pod, service_account, enrollment, trust_domain) => w.clone(),
        _ => {
            let pod_namespace = pod.metadata.namespace_or_default();
            let labels = pod.metadata.labels.clone().unwrap_or_default();
            let owner = owning_workload(pod);
            Arc::new(Workload {
                canonical_service: canonical_service(&labels, owner.name).to_string(),
                canonical_revision: canonical_revision(&labels).to_string(),
                workload_name: owner.name.to_string(),
                workload_kind: owner.kind.to_string(),
                key: Arc::from(key),
                identity: SpiffeId::new(trust_domain, pod_namespace, service_account),
                enrollment,
                node: spec.and_then(|s| s.node_name.clone()),
                terminating: pod.metadata.deletion_timestamp.is_some(),
                labels,
                ips: pod_ips(pod),
                host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
                dns_capture: dns_capture(pod),
                namespace: pod_namespace.to_string(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                service_account: service_account.to_string(),
                mesh: None,
            })
        }
    }
}

impl WorkloadIndex {
    /// Builds the index for node `node`. Returns warnings for conflicts (live pods
    /// claiming one address: it is served for none of them). Of a pod defined
    /// twice, the first definition is used and the others are skipped
    /// ([`WorkloadIndex::has_duplicates`]; the source words those, see
    /// [`crate::source::manifests::ManifestDir::duplicate_pods`]).
    pub fn build<'a>(
        node: &str,
        trust_domain: &str,
        pods: impl IntoIterator<Item = &'a Pod>,
        namespaces: impl IntoIterator<Item = &'a Namespace>,
    ) -> (Self, Vec<String>) {
        WorkloadIndex::default().rebuild(node, trust_domain, pods, namespaces)
    }

    /// As [`WorkloadIndex::build`], keeping this index's workloads (the same
    /// `Arc`s) for the pods that did not change: with many pods and one changed,
    /// the index is remade without remaking every workload, and this one is
    /// dropped without freeing them.
    pub fn rebuild<'a>(
        &self,
        node: &str,
        trust_domain: &str,
        pods: impl IntoIterator<Item = &'a Pod>,
        namespaces: impl IntoIterator<Item = &'a Namespace>,
    ) -> (Self, Vec<String>) {
        let namespaces: HashMap<&str, &Namespace> = namespaces
            .into_iter()
            .filter_map(|ns| ns.metadata.name.as_deref().map(|n| (n, ns)))
            .collect();
        let mut index = WorkloadIndex {
            node: node.to_string(),
            by_ip: HashMap::with_capacity(self.by_ip.len()),
            removals: self.removals + 1,
            ..Default::default()
        };
        let mut key = String::new();
        for pod in pods {
            let Some(name) = pod.metadata.name.as_deref() else {
                continue;
            };
            if is_finished(pod) {
                continue;
            }
            let namespace = pod.metadata.namespace_or_default();
            key.clear();
            key.push_str(namespace);
            key.push('/');
            key.push_str(name);
            if let Some((key, _)) = index.workloads.get_key_value(key.as_str()) {
                index.duplicated.insert(key.clone());
                continue;
            }
            let workload = workload_of(
                self.workloads.get(key.as_str()),
                &key,
                pod,
                namespaces.get(namespace).copied(),
                trust_domain,
            );
            index.insert(workload);
        }
        let warnings = index.warnings();
        (index, warnings)
    }

    /// Updates the workload `key` (`namespace/name`) from `definitions`: every
    /// pod of the source with that namespace and name, in the source's order
    /// (none when it is gone), as [`WorkloadIndex::build`] would see them;
    /// `namespace` is the pod's Namespace object, if the source has one. The
    /// index is then the one a build would make. Warnings are those of
    /// [`WorkloadIndex::warnings`], asked once all pods are updated.
    pub fn update<'a>(
        &mut self,
        trust_domain: &str,
        key: &str,
        definitions: impl IntoIterator<Item = &'a Pod>,
        namespace: Option<&Namespace>,
    ) {
        let mut live = definitions.into_iter().filter(|pod| !is_finished(pod));
        let first = live.next();
        let workload = first
            .map(|pod| workload_of(self.workloads.get(key), key, pod, namespace, trust_domain));
        let previous = self.workloads.get(key).cloned();
        let unchanged = matches!((&previous, &workload), (Some(p), Some(w)) if Arc::ptr_eq(p, w));
        if !unchanged {
            if let Some(previous) = previous {
                self.remove(&previous);
                if workload.is_none() {
                    self.removals += 1;
                }
            }
            if let Some(workload) = workload.clone() {
                self.insert(workload);
            }
        }
        match (workload, live.next().is_some()) {
            (Some(w), true) => {
                self.duplicated.insert(w.key.clone());
            }
            _ => {
                self.duplicated.remove(key);
            }
        }
    }

    /// Lays istiod's workloads (workload xDS, [`Workload::mesh`] set) over the
    /// pods of this index: a workload whose `namespace/name` is a pod's keeps
    /// the pod's fields (its enrollment decided from the Kubernetes API, as the
    /// CNI path needs) and gets istiod's [`MeshFacts`]; any other is added as
    /// istiod describes it, except that one on this node without a pod object
    /// is not captured (capture waits for the pod from the Kubernetes API).
    /// An enrolled pod of this node that istiod does not list (or says is
    /// reached without a tunnel) is not captured either: istiod decides which
    /// workloads are in the mesh, as it does for ztunnel.
    pub fn lay_mesh<'a>(&mut self, mesh: impl IntoIterator<Item = &'a Arc<Workload>>) {
        let mut listed = HashSet::new();
        for workload in mesh {
            listed.insert(workload.key.clone());
            match self.workloads.get(&workload.key).cloned() {
                Some(pod) => {
                    if pod.mesh == workload.mesh
                        && (workload.enrollment.is_enrolled() || !pod.enrollment.is_enrolled())
                    {
                        continue;
                    }
                    let enrollment = if workload.enrollment.is_enrolled() {
                        pod.enrollment
                    } else {
                        workload.enrollment
                    };
                    let merged = Arc::new(Workload {
                        mesh: workload.mesh.clone(),
                        enrollment,
                        ..Workload::clone(&pod)
                    });
                    self.remove(&pod);
                    self.insert(merged);
                }
                None if self.is_local(workload) && workload.enrollment.is_enrolled() => {
                    self.insert(Arc::new(Workload {
                        enrollment: Enrollment::NotEnrolled(
                            "istiod knows it, the Kubernetes API has no pod of that name on this node yet",
                        ),
                        ..Workload::clone(workload)
                    }));
                }
                None => self.insert(workload.clone()),
            }
        }
        let unlisted: Vec<Arc<Workload>> = self
            .workloads
            .values()
            .filter(|w| w.enrollment.is_enrolled() && self.is_local(w) && !listed.contains(&w.key))
            .cloned()
            .collect();
        for pod in unlisted {
            self.remove(&pod);
            self.insert(Arc::new(Workload {
                enrollment: Enrollment::NotEnrolled("istiod does not list it as a mesh workload"),
                ..Workload::clone(&pod)
            }));
        }
    }

    /// Adds `workload` (whose key is not in the index) and its address claims.
    fn insert(&mut self, workload: Arc<Workload>) {
        // A hostNetwork pod's address is its node's: it names no workload.
        if !workload.host_network {
            for ip in &workload.ips {
                self.claim(*ip, &workload);
            }
        }
        self.workloads.insert(workload.key.clone(), workload);
    }

    /// Removes `workload` (the index's own) and its address claims.
    fn remove(&mut self, workload: &Arc<Workload>) {
        self.workloads.remove(&workload.key);
        if workload.host_network {
            return;
        }
        for ip in &workload.ips {
            if let Some(claimants) = self.contested.get_mut(ip) {
                claimants.remove(&workload.key);
                if claimants.len() > 1 {
                    self.settle(*ip);
                    continue;
                }
                let only = claimants.pop_first().map(|(_, w)| w);
                self.contested.remove(ip);
                self.conflicts.remove(ip);
                if let Some(only) = only {
                    self.by_ip.insert(*ip, only);
                }
            } else if self
                .by_ip
                .get(ip)
                .is_some_and(|owner| owner.key == workload.key)
            {
                self.by_ip.remove(ip);
            }
        }
    }

    /// Records that `workload` claims `ip`.
    fn claim(&mut self, ip: IpAddr, workload: &Arc<Workload>) {
        if let Some(claimants) = self.contested.get_mut(&ip) {
            claimants.insert(workload.key.clone(), workload.clone());
        } else {
            match self.by_ip.entry(ip) {
                Entry::Vacant(e) => {
                    e.insert(workload.clone());
                    return;
                }
                // The same address listed twice by one pod.
                Entry::Occupied(e) if e.get().key == workload.key => return,
                Entry::Occupied(e) => {
                    let other = e.get().clone();
                    self.contested.insert(
                        ip,
                        BTreeMap::from([
                            (other.key.clone(), other),
                            (workload.key.clone(), workload.clone()),
                        ]),
                    );
                }
            }
        }
        self.settle(ip);
    }

    /// Picks the owner of contested address `ip`: its only live claimant; the
    /// first (by `namespace/name`) when all are terminating, since a terminating
    /// pod gives way to one that is not; none when several are live (a
    /// conflict: it is served for none of them).
    fn settle(&mut self, ip: IpAddr) {
        let Some(claimants) = self.contested.get(&ip) else {
            return;
        };
        let live: Vec<&Arc<Workload>> = claimants.values().filter(|w| !w.terminating).collect();
        let owner = match live.as_slice() {
            [] => claimants.values().next(),
            [one] => Some(*one),
            _ => None,
        };
        match owner {
            Some(owner) => {
                self.by_ip.insert(ip, owner.clone());
                self.conflicts.remove(&ip);
            }
            None => {
                let names = live.iter().map(|w| w.key().to_string()).collect();
                self.by_ip.remove(&ip);
                self.conflicts.insert(ip, names);
            }
        }
    }

    /// One warning per conflict (live pods claiming one address), by address.
    pub fn warnings(&self) -> Vec<String> {
        self.conflicts
            .iter()
            .map(|(ip, names)| {
                format!(
                    "pods {} all claim address {ip}: it is served for none of them (its connections are refused) until only one does",
                    names.join(", ")
                )
            })
            .collect()
    }

    /// How many times a workload has left the index: unchanged, no workload
    /// known before is gone.
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// The workload `namespace/name`.
    pub fn get(&self, key: &str) -> Option<&Arc<Workload>> {
        self.workloads.get(key)
    }

    /// The node this index was built for.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The workload that owns `ip`.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_ip.get(&ip)
    }

    /// Whether `w` runs on this node.
    pub fn is_local(&self, w: &Workload) -> bool {
        w.node.as_deref() == Some(self.node.as_str())
    }

    /// The enrolled workload on this node that owns `ip`.
    pub fn local_enrolled(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_ip(ip)
            .filter(|w| w.enrollment.is_enrolled() && self.is_local(w))
    }

    /// All workloads, by `namespace/name`.
    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values()
    }

    /// How many workloads the index holds (every pod of the source).
    pub fn len(&self) -> usize {
        self.workloads.len()
    }

    /// Whether the index holds no workload.
    pub fn is_empty(&self) -> bool {
        self.workloads.is_empty()
    }

    /// This node's enrolled workloads that have an address (what the dataplane
    /// captures).
    ///
    /// A pod whose address is in conflict ([`WorkloadIndex::conflict`]) stays
    /// captured, so that its traffic meets the proxy, which refuses it, rather than
    /// leaving uncaptured.
    pub fn captured(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values().filter(|w| {
            w.enrollment.is_enrolled()
                && self.is_local(w)
                && !w.ips.is_empty()
                && w.ips.iter().all(|ip| {
                    self.conflicts.contains_key(ip)
                        || self
                            .by_ip
                            .get(ip)
                            .is_some_and(|owner| Arc::ptr_eq(owner, w))
                })
        })
    }

    /// The pods that claim `ip` when more than one does.
    pub fn conflict(&self, ip: IpAddr) -> Option<&[String]> {
        self.conflicts.get(&ip).map(Vec::as_slice)
    }

    /// Whether some pod was defined more than once (only its first definition
    /// was used).
    pub fn has_duplicates(&self) -> bool {
        !self.duplicated.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(yaml: &str) -> Pod {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn ns(name: &str, ambient: bool) -> Namespace {
        let labels = if ambient {
            "  labels: {istio.io/dataplane-mode: ambient}\n"
        } else {
            ""
        };
        serde_yaml_ng::from_str(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n{labels}"
        ))
        .unwrap()
    }

    fn p(name: &str, ns: &str, labels: &str, host_network: bool, ip: &str, node: &str) -> Pod {
        pod(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{{labels}}}\nspec:\n  nodeName: {node}\n  hostNetwork: {host_network}\n  serviceAccountName: sa-{name}\n  containers: []\nstatus:\n  podIP: {ip}\n"
        ))
    }

    #[test]
    fn enrollment_rules() {
        let amb = ns("amb", true);
        let plain = ns("plain", false);
        let cases = [
            (
                p("a", "amb", "", false, "10.0.0.1", "n1"),
                Some(&amb),
                Enrollment::Enrolled,
            ),
            (
                p(
                    "b",
                    "amb",
                    "istio.io/dataplane-mode: none",
                    false,
                    "10.0.0.2",
                    "n1",
                ),
                Some(&amb),
                Enrollment::NotEnrolled("pod opted out"),
            ),
            (
                p(
                    "c",
                    "plain",
                    "istio.io/dataplane-mode: ambient",
                    false,
                    "10.0.0.3",
                    "n1",
                ),
                Some(&plain),
                Enrollment::Enrolled,
            ),
            (
                p("d", "plain", "", false, "10.0.0.4", "n1"),
                Some(&plain),
                Enrollment::NotEnrolled("no ambient label on pod or namespace"),
            ),
            (
                p(
                    "e",
                    "amb",
                    "istio.io/dataplane-mode: ambient",
                    true,
                    "10.0.0.5",
                    "n1",
                ),
                Some(&amb),
                Enrollment::NotEnrolled("hostNetwork pod"),
            ),
            (
                p("f", "missing", "", false, "10.0.0.6", "n1"),
                None,
                Enrollment::NotEnrolled("no ambient label on pod or namespace"),
            ),
        ];
        for (pod, namespace, want) in cases {
            assert_eq!(enrollment(&pod, namespace), want, "{:?}", pod.metadata.name);
        }
    }

    #[test]
    fn index_by_address_and_node() {
        let amb = ns("amb", true);
        let pods = [
            p("local", "amb", "", false, "10.0.0.1", "n1"),
            p("remote", "amb", "", false, "10.0.1.1", "n2"),
            p("host", "amb", "", true, "192.168.0.1", "n1"),
        ];
        let (index, warnings) = WorkloadIndex::build("n1", "cluster.local", &pods, [&amb]);
        assert!(warnings.is_empty());
        let local = index.by_ip("10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(
            local.identity.to_string(),
            "spiffe://cluster.local/ns/amb/sa/sa-local"
        );
        assert!(index.local_enrolled("10.0.0.1".parse().unwrap()).is_some());
        assert!(index.local_enrolled("10.0.1.1".parse().unwrap()).is_none());
        assert!(index.by_ip("192.168.0.1".parse().unwrap()).is_none());
        let captured: Vec<_> = index.captured().map(|w| w.key()).collect();
        assert_eq!(captured, ["amb/local"]);
    }

    #[test]
    fn address_conflicts_fail_closed() {
        let amb = ns("amb", true);
        let pods = [
            p("b", "amb", "", false, "10.0.0.1", "n1"),
            p("a", "amb", "", false, "10.0.0.1", "n2"),
            p("c", "amb", "", false, "10.0.0.2", "n1"),
        ];
        let (index, warnings) = WorkloadIndex::build("n1", "cluster.local", &pods, [&amb]);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("amb/a, amb/b"), "{warnings:?}");
        // Served for neither, but still captured where it is local.
        let ip = "10.0.0.1".parse().unwrap();
        assert!(index.by_ip(ip).is_none());
        assert_eq!(index.conflict(ip).unwrap().len(), 2);
        let captured: Vec<_> = index.captured().map(|w| w.key()).collect();
        assert_eq!(captured, ["amb/b", "amb/c"]);
    }

    #[test]
    fn a_terminating_pod_gives_its_address_way() {
        let amb = ns("amb", true);
        let mut old = p("old", "amb", "", false, "10.0.0.1", "n1");
        old.metadata.deletion_timestamp = Some("2026-01-01T00:00:00Z".into());
        let new = p("new", "amb", "", false, "10.0.0.1", "n1");
        let (index, warnings) = WorkloadIndex::build("n1", "cluster.local", [&old, &new], [&amb]);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            index.by_ip("10.0.0.1".parse().unwrap()).unwrap().name,
            "new"
        );
    }

    #[test]
    fn a_pod_defined_twice_keeps_its_first_definition() {
        let amb = ns("amb", true);
        let first = p("x", "amb", "", false, "10.0.0.1", "n1");
        let second = p("x", "amb", "", false, "10.0.0.9", "n1");
        let (index, warnings) =
            WorkloadIndex::build("n1", "cluster.local", [&first, &second], [&amb]);
        // Not a conflict of addresses: the second definition is not looked at.
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(index.has_duplicates());
        let (index, _) = WorkloadIndex::build("n1", "cluster.local", [&first], [&amb]);
        assert!(!index.has_duplicates());
        assert!(index.by_ip("10.0.0.1".parse().unwrap()).is_some());
        assert!(index.by_ip("10.0.0.9".parse().unwrap()).is_none());
    }

    /// A rebuild keeps the workloads of pods that did not change (the same
    /// `Arc`) and remakes those that did, for each field a workload is made of.
    #[test]
    fn a_rebuild_keeps_unchanged_workloads_and_remakes_changed_ones() {
        let amb = ns("amb", true);
        let unlabelled = ns("amb", false);
        let pods = [
            p("a", "amb", "", false, "10.0.0.1", "n1"),
            p("b", "amb", "", false, "10.0.0.2", "n1"),
        ];
        let (first, _) = WorkloadIndex::build("n1", "cluster.local", &pods, [&amb]);
        let a = |i: &WorkloadIndex| i.get("amb/a").unwrap().clone();
        let (same, _) = first.rebuild("n1", "cluster.local", &pods, [&amb]);
        assert!(Arc::ptr_eq(&a(&first), &a(&same)));
        assert!(Arc::ptr_eq(
            same.by_ip("10.0.0.1".parse().unwrap()).unwrap(),
            &a(&first)
        ));

        type Change = (&'static str, fn(&mut Pod));
        let changes: [Change; 7] = [
            ("address", |p| {
                p.status.as_mut().unwrap().pod_ip = Some("10.0.0.9".into())
            }),
            ("label", |p| {
                p.metadata
                    .labels
                    .get_or_insert_default()
                    .insert("app".into(), "web".into());
            }),
            ("node", |p| {
                p.spec.as_mut().unwrap().node_name = Some("n2".into())
            }),
            ("service account", |p| {
                p.spec.as_mut().unwrap().service_account_name = Some("other".into())
            }),
            ("deletion", |p| {
                p.metadata.deletion_timestamp = Some("2026-01-01T00:00:00Z".into())
            }),
            ("opt-out", |p| {
                p.metadata
                    .labels
                    .get_or_insert_default()
                    .insert(DATAPLANE_MODE_LABEL.into(), DATAPLANE_MODE_NONE.into());
            }),
            ("controller", |p| {
                p.metadata.owner_references = Some(vec![crate::k8s::OwnerReference {
                    api_version: "apps/v1".into(),
                    kind: "StatefulSet".into(),
                    name: "web".into(),
                    controller: Some(true),
                }]);
            }),
        ];
        for (what, change) in changes {
            let mut changed = pods.clone();
            change(&mut changed[0]);
            let (next, _) = first.rebuild("n1", "cluster.local", &changed, [&amb]);
            let (fresh, _) = WorkloadIndex::build("n1", "cluster.local", &changed, [&amb]);
            assert!(!Arc::ptr_eq(&a(&first), &a(&next)), "{what}");
            assert_eq!(a(&next), a(&fresh), "{what}");
            let b = |i: &WorkloadIndex| i.get("amb/b").unwrap().clone();
            assert!(Arc::ptr_eq(&b(&first), &b(&next)), "{what}");
        }
        // The namespace's label decides enrollment too; so does the trust domain.
        for (td, namespace) in [("cluster.local", &unlabelled), ("example.org", &amb)] {
            let (next, _) = first.rebuild("n1", td, &pods, [namespace]);
            let (fresh, _) = WorkloadIndex::build("n1", td, &pods, [namespace]);
            assert!(!Arc::ptr_eq(&a(&first), &a(&next)), "{td}");
            assert_eq!(a(&next), a(&fresh), "{td}");
        }
        assert!(
            !first
                .rebuild("n1", "cluster.local", &pods, [&unlabelled])
                .0
                .get("amb/a")
                .unwrap()
                .enrollment
                .is_enrolled()
        );

        // `status.podIPs` (as the CNI overlay writes it) wins over `podIP`: the
        // same address there keeps the workload, another or a second one does not.
        let with_ips = |ips: &[&str]| {
            let mut pod = pods[0].clone();
            pod.status.as_mut().unwrap().pod_ips = Some(
                ips.iter()
                    .map(|ip| crate::k8s::PodIP { ip: ip.to_string() })
                    .collect(),
            );
            [pod, pods[1].clone()]
        };
        let (next, _) = first.rebuild("n1", "cluster.local", &with_ips(&["10.0.0.1"]), [&amb]);
        assert!(Arc::ptr_eq(&a(&first), &a(&next)));
        for ips in [
            &["10.0.0.7"][..],
            &["10.0.0.1", "fd00::1"],
            &["not an address"],
        ] {
            let changed = with_ips(ips);
            let (next, _) = first.rebuild("n1", "cluster.local", &changed, [&amb]);
            let (fresh, _) = WorkloadIndex::build("n1", "cluster.local", &changed, [&amb]);
            assert_eq!(a(&next), a(&fresh), "{ips:?}");
            // Unparsable entries are skipped: `podIP` then stands.
            let unchanged = ips == ["not an address"];
            assert_eq!(Arc::ptr_eq(&a(&first), &a(&next)), unchanged, "{ips:?}");
        }

        // No label map at all is the same as an empty one.
        let mut unlabelled = pods.clone();
        unlabelled[0].metadata.labels = None;
        let (next, _) = first.rebuild("n1", "cluster.local", &unlabelled, [&amb]);
        assert!(Arc::ptr_eq(&a(&first), &a(&next)));
    }

    /// What an index serves, comparable: its workloads, each address's owner
    /// (the workload itself, not only its name), the contested addresses'
    /// claimants, conflicts, duplicated pods, warnings and captured pods.
    fn served(index: &WorkloadIndex) -> impl PartialEq + std::fmt::Debug {
        let owners: BTreeMap<IpAddr, Workload> = index
            .by_ip
            .iter()
            .map(|(ip, w)| (*ip, (**w).clone()))
            .collect();
        let workloads: Vec<Workload> = index.workloads().map(|w| (**w).clone()).collect();
        let contested: BTreeMap<IpAddr, Vec<Workload>> = index
            .contested
            .iter()
            .map(|(ip, c)| (*ip, c.values().map(|w| (**w).clone()).collect()))
            .collect();
        let captured: Vec<String> = index.captured().map(|w| w.key().to_string()).collect();
        (
            workloads,
            owners,
            contested,
            index.conflicts.clone(),
            index.duplicated.clone(),
            index.warnings(),
            captured,
        )
    }

    /// Pod by pod updates give the index a build from the same pods gives,
    /// through conflicts of two and three pods, terminating claimants,
    /// hostNetwork and finished pods, duplicates, address and node changes,
    /// several addresses and one listed twice, and a namespace the source has
    /// no object for.
    #[test]
    fn updates_make_the_index_a_build_makes() {
        let amb = ns("amb", true);
        let key = |pod: &Pod| {
            format!(
                "{}/{}",
                pod.metadata.namespace_or_default(),
                pod.metadata.name.as_deref().unwrap()
            )
        };
        let terminating = |mut pod: Pod| {
            pod.metadata.deletion_timestamp = Some("2026-01-01T00:00:00Z".into());
            pod
        };
        let finished = |mut pod: Pod| {
            pod.status.as_mut().unwrap().phase = Some("Failed".into());
            pod
        };
        let with_ips = |mut pod: Pod, ips: &[&str]| {
            pod.status.as_mut().unwrap().pod_ips = Some(
                ips.iter()
                    .map(|ip| crate::k8s::PodIP { ip: ip.to_string() })
                    .collect(),
            );
            pod
        };
        let pa = |name: &str, ip: &str| p(name, "amb", "", false, ip, "n1");
        // Each step replaces (or adds) the definitions of one pod, or removes
        // them.
        let steps: Vec<(&str, Vec<Pod>)> = vec![
            ("amb/a", vec![pa("a", "10.0.0.1")]),
            ("amb/b", vec![pa("b", "10.0.0.1")]),
            ("amb/c", vec![p("c", "amb", "", false, "10.0.0.1", "n2")]),
            ("amb/b", vec![terminating(pa("b", "10.0.0.1"))]),
            ("amb/c", vec![]),
            ("amb/a", vec![terminating(pa("a", "10.0.0.1"))]),
            ("amb/h", vec![p("h", "amb", "", true, "10.0.0.1", "n1")]),
            ("amb/b", vec![]),
            ("amb/h", vec![pa("h", "10.0.0.1")]),
            ("amb/d", vec![pa("d", "10.0.0.4"), pa("d", "10.0.0.5")]),
            (
                "amb/d",
                vec![finished(pa("d", "10.0.0.4")), pa("d", "10.0.0.5")],
            ),
            ("amb/e", vec![finished(pa("e", "10.0.0.5"))]),
            (
                "amb/a",
                vec![p("a", "amb", "app: web", false, "10.0.0.5", "n1")],
            ),
            ("amb/d", vec![pa("d", "10.0.0.6")]),
            ("amb/a", vec![pa("a", "10.0.0.6")]),
            ("amb/f", vec![pa("f", "10.0.0.6")]),
            ("amb/f", vec![p("f", "amb", "", false, "10.0.0.6", "n2")]),
            (
                "amb/g",
                vec![with_ips(
                    pa("g", "10.0.0.7"),
                    &["10.0.0.7", "10.0.0.7", "fd00::7"],
                )],
            ),
            ("amb/i", vec![with_ips(pa("i", "10.0.0.8"), &["fd00::7"])]),
            ("amb/g", vec![with_ips(pa("g", "10.0.0.7"), &["10.0.0.9"])]),
            (
                "plain/j",
                vec![p("j", "plain", "", false, "10.0.0.9", "n1")],
            ),
            ("amb/a", vec![]),
            ("amb/h", vec![]),
            ("amb/d", vec![]),
        ];
        let mut pods: Vec<Pod> = Vec::new();
        let mut index = WorkloadIndex::build("n1", "cluster.local", &pods, [&amb]).0;
        let mut seen_conflict = false;
        for (i, (changed, definitions)) in steps.into_iter().enumerate() {
            // The test's source keeps a changed pod's definitions last; any
            // order a source keeps will do.
            pods.retain(|p| key(p) != changed);
            pods.extend(definitions);
            let removals = index.removals();
            let had = index.get(changed).is_some();
            let namespace = changed.starts_with("amb/").then_some(&amb);
            index.update(
                "cluster.local",
                changed,
                pods.iter().filter(|p| key(p) == changed),
                namespace,
            );
            let (built, _) = WorkloadIndex::build("n1", "cluster.local", &pods, [&amb]);
            assert_eq!(served(&index), served(&built), "step {i} ({changed})");
            let gone = had && index.get(changed).is_none();
            assert_eq!(index.removals() > removals, gone, "step {i} ({changed})");
            seen_conflict |= !index.conflicts.is_empty();
        }
        assert!(seen_conflict);
    }

    #[test]
    fn finished_pods_are_not_workloads() {
        let mut done = p("done", "amb", "", false, "10.0.0.1", "n1");
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let (index, _) = WorkloadIndex::build("n1", "cluster.local", [&done], [&ns("amb", true)]);
        assert!(index.by_ip("10.0.0.1".parse().unwrap()).is_none());
    }

    /// Pod `name` with `labels` (YAML flow-map entries) and the owner
    /// references `owners` (`kind`, `name`, `controller`).
    fn owned(name: &str, labels: &str, owners: &[(&str, &str, Option<bool>)]) -> Pod {
        let mut pod = p(name, "amb", labels, false, "10.0.0.1", "n1");
        pod.metadata.owner_references = Some(
            owners
                .iter()
                .map(|(kind, name, controller)| crate::k8s::OwnerReference {
                    api_version: "apps/v1".into(),
                    kind: kind.to_string(),
                    name: name.to_string(),
                    controller: *controller,
                })
                .collect(),
        );
        pod
    }

    fn named(pod: &Pod) -> (&str, &str) {
        let w = owning_workload(pod);
        (w.name, w.kind)
    }

    /// Every kind of controller names the workload as Istio's
    /// `GetDeployMetaFromPod` does.
    #[test]
    fn owners_name_the_workload() {
        let hash = "pod-template-hash: 5d8f9c7b6";
        let cases: [(Pod, (&str, &str)); 12] = [
            // A bare pod, even one whose name looks generated.
            (
                p("web-5d8f9c7b6-x2x9q", "amb", hash, false, "10.0.0.1", "n1"),
                ("web-5d8f9c7b6-x2x9q", "Pod"),
            ),
            // A Deployment's ReplicaSet: `-<hash>` stripped.
            (
                owned(
                    "reviews-v1-5d8f9c7b6-x2x9q",
                    hash,
                    &[("ReplicaSet", "reviews-v1-5d8f9c7b6", Some(true))],
                ),
                ("reviews-v1", "Deployment"),
            ),
            // A ReplicaSet without the label, or whose name does not end with
            // it, is its own workload, whatever its name looks like.
            (
                owned(
                    "web-7c9d8-abcde",
                    "",
                    &[("ReplicaSet", "web-7c9d8", Some(true))],
                ),
                ("web-7c9d8", "ReplicaSet"),
            ),
            (
                owned(
                    "web-7c9d8-abcde",
                    hash,
                    &[("ReplicaSet", "web-7c9d8", Some(true))],
                ),
                ("web-7c9d8", "ReplicaSet"),
            ),
            // The hash without a `-` before it: the name is kept whole.
            (
                owned(
                    "web5d8f9c7b6-abcde",
                    hash,
                    &[("ReplicaSet", "web5d8f9c7b6", Some(true))],
                ),
                ("web5d8f9c7b6", "Deployment"),
            ),
            (
                owned("db-0", "", &[("StatefulSet", "db", Some(true))]),
                ("db", "StatefulSet"),
            ),
            // A StatefulSet whose name ends like a hash or a schedule keeps it.
            (
                owned(
                    "db-5d8f9c7b6-0",
                    hash,
                    &[("StatefulSet", "db-5d8f9c7b6", Some(true))],
                ),
                ("db-5d8f9c7b6", "StatefulSet"),
            ),
            (
                owned("agent-x7k2p", "", &[("DaemonSet", "agent", Some(true))]),
                ("agent", "DaemonSet"),
            ),
            (
                owned("migrate-v2-abcde", "", &[("Job", "migrate-v2", Some(true))]),
                ("migrate-v2", "Job"),
            ),
            // A CronJob's Job: `-<8 to 10 digits>` stripped.
            (
                owned(
                    "backup-29145600-abcde",
                    "",
                    &[("Job", "backup-29145600", Some(true))],
                ),
                ("backup", "CronJob"),
            ),
            (
                owned(
                    "legacy-1-abcde",
                    "deploymentconfig: legacy",
                    &[("ReplicationController", "legacy-1", Some(true))],
                ),
                ("legacy", "DeploymentConfig"),
            ),
            (
                owned(
                    "plain-abcde",
                    "",
                    &[("ReplicationController", "plain", Some(true))],
                ),
                ("plain", "ReplicationController"),
            ),
        ];
        for (pod, want) in &cases {
            assert_eq!(named(pod), *want, "{:?}", pod.metadata.name);
        }
    }

    /// Only the controller counts; the workload-name label wins; an Argo
    /// Rollout's ReplicaSet is stripped by its own hash label.
    #[test]
    fn the_controller_and_the_workload_name_label_decide() {
        // Owners that are not the controller are not read.
        let pod = owned(
            "web-0",
            "",
            &[
                ("ConfigMap", "settings", None),
                ("StatefulSet", "other", Some(false)),
            ],
        );
        assert_eq!(named(&pod), ("web-0", "Pod"));
        let pod = owned(
            "web-0",
            "",
            &[
                ("ConfigMap", "settings", None),
                ("StatefulSet", "web", Some(true)),
            ],
        );
        assert_eq!(named(&pod), ("web", "StatefulSet"));
        // A controller without a name leaves the pod's.
        let pod = owned("web-0", "", &[("StatefulSet", "", Some(true))]);
        assert_eq!(named(&pod), ("web-0", "StatefulSet"));
        // Labelled, whatever the owner; an empty label is not a name.
        let pod = owned(
            "db-0",
            "service.istio.io/workload-name: database",
            &[("StatefulSet", "db", Some(true))],
        );
        assert_eq!(named(&pod), ("database", "StatefulSet"));
        let pod = owned(
            "db-0",
            "service.istio.io/workload-name: ''",
            &[("StatefulSet", "db", Some(true))],
        );
        assert_eq!(named(&pod), ("db", "StatefulSet"));
        let pod = owned(
            "canary-6b7f9-abcde",
            "rollouts-pod-template-hash: 6b7f9",
            &[("ReplicaSet", "canary-6b7f9", Some(true))],
        );
        assert_eq!(named(&pod), ("canary", "Rollout"));
    }

    /// Istio's `(.+)-\d{8,10}$`: a name before the `-`, then 8 to 10 ASCII
    /// digits and nothing else.
    #[test]
    fn cron_job_suffixes() {
        for (job, want) in [
            ("backup-29145600", Some("backup")),
            ("backup-1234567890", Some("backup")),
            ("nightly-backup-123456789", Some("nightly-backup")),
            ("a-b-12345678", Some("a-b")),
            ("backup-1234567", None),
            ("backup-12345678901", None),
            ("backup-2914560a", None),
            ("backup-٢٩١٤٥٦٠٠", None),
            ("-29145600", None),
            ("29145600", None),
            ("backup", None),
        ] {
            assert_eq!(cron_job_of(job), want, "{job}");
        }
    }

    /// The canonical labels' precedence, and the defaults: the workload's name
    /// (not the pod's) and `latest`.
    #[test]
    fn canonical_labels_follow_istio() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = labels(&[]);
        assert_eq!(canonical_service(&none, "reviews"), "reviews");
        assert_eq!(canonical_revision(&none), "latest");
        let app = labels(&[("app", "web"), ("version", "v1")]);
        assert_eq!(canonical_service(&app, "reviews"), "web");
        assert_eq!(canonical_revision(&app), "v1");
        let k8s = labels(&[
            ("app", "web"),
            ("version", "v1"),
            ("app.kubernetes.io/name", "shop-web"),
            ("app.kubernetes.io/version", "1.2"),
        ]);
        assert_eq!(canonical_service(&k8s, "reviews"), "shop-web");
        assert_eq!(canonical_revision(&k8s), "1.2");
        let mut istio = k8s.clone();
        istio.insert(
            "service.istio.io/canonical-name".into(),
            "storefront".into(),
        );
        istio.insert(
            "service.istio.io/canonical-revision".into(),
            "2024-06".into(),
        );
        assert_eq!(canonical_service(&istio, "reviews"), "storefront");
        assert_eq!(canonical_revision(&istio), "2024-06");
        // Present counts, even empty, as in Istio.
        let empty = labels(&[("app", ""), ("version", "v1")]);
        assert_eq!(canonical_service(&empty, "reviews"), "");

        // Made once with the workload, from its owner.
        let pod = owned(
            "reviews-v1-5d8f9c7b6-x2x9q",
            "pod-template-hash: 5d8f9c7b6",
            &[("ReplicaSet", "reviews-v1-5d8f9c7b6", Some(true))],
        );
        let (index, _) = WorkloadIndex::build("n1", "cluster.local", [&pod], [&ns("amb", true)]);
        let w = index.get("amb/reviews-v1-5d8f9c7b6-x2x9q").unwrap();
        assert_eq!(w.name, "reviews-v1-5d8f9c7b6-x2x9q");
        assert_eq!(w.workload_name, "reviews-v1");
        assert_eq!(w.workload_kind, "Deployment");
        assert_eq!(w.canonical_service, "reviews-v1");
        assert_eq!(w.canonical_revision, "latest");
        let dump = serde_json::to_value(w.as_ref()).unwrap();
        assert_eq!(dump["workload_name"], "reviews-v1");
        assert_eq!(dump["workload_kind"], "Deployment");
        assert_eq!(dump["name"], "reviews-v1-5d8f9c7b6-x2x9q");
    }
}
