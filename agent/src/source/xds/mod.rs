//! Istio's control plane (istiod) as a source: the workloads, services and
//! authorization policies it pushes over workload xDS ([`crate::xds`]),
//! converted ([`convert`]) into what [`crate::state::State`] holds, beside this
//! node's pods from the Kubernetes API (their enrollment and the CNI path
//! need the Pod objects), as ztunnel's node is fed.
//!
//! [`MeshHandler`] is the xDS client's handler: it keeps istiod's resources
//! and publishes them whole after each response. [`IstiodSource`] sends the
//! Kubernetes source's deltas with istiod's view laid on, and without what
//! istiod says instead (Services, EndpointSlices, AuthorizationPolicies and
//! PeerAuthentications, which istiod sends as services and policies): each
//! delta carries
//! the latest [`Mesh`] when it changed, and the policies istiod sent that
//! podlink refused (their namespace is denied meanwhile, as a refused
//! AuthorizationPolicy object's). Until istiod's first responses of both
//! types were answered, `istiod` is listed as unlisted (the agent is not
//! ready) and the view is incomplete (no pod is taken as gone). An enrolled
//! pod of this node is captured once istiod lists it as a mesh workload.

pub mod convert;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, PoisonError},
};

use tokio::{sync::watch, task::JoinHandle};

use super::{CaptureReporter, Opened, Source};
use crate::{
    authz,
    state::{Completeness, Delta, Mesh, PoliciesUnknown},
    xds::{
        ConnectionState, Handler, Refused, XdsClient,
        proto::{security::Authorization, workload::Address, workload::address::Type},
    },
};

/// What the handler publishes after each response.
#[derive(Clone, Debug, Default)]
pub struct Published {
    /// istiod's view, whole.
    pub mesh: Arc<Mesh>,
    /// Policies refused, by namespace (the first refused one of each).
    pub policies_unknown_in: BTreeMap<String, PoliciesUnknown>,
}

/// Keeps what istiod pushes, converted, and publishes it after each response.
pub struct MeshHandler {
    trust_domain: String,
    mesh: Mesh,
    /// Refused policies by resource name: (namespace, why).
    refused_policies: BTreeMap<String, (String, String)>,
    published: watch::Sender<Published>,
}

impl MeshHandler {
    /// A handler making SPIFFE IDs in `trust_domain` for workloads that name
    /// none, and the receiver of what it publishes.
    pub fn new(trust_domain: &str) -> (Self, watch::Receiver<Published>) {
        let (published, rx) = watch::channel(Published::default());
        (
            Self {
                trust_domain: trust_domain.to_string(),
                mesh: Mesh::default(),
                refused_policies: BTreeMap::new(),
                published,
            },
            rx,
        )
    }

    fn publish(&self) {
        let mut unknown = BTreeMap::new();
        for (name, (namespace, why)) in &self.refused_policies {
            unknown
                .entry(namespace.clone())
                .or_insert_with(|| PoliciesUnknown {
                    what: format!("istiod's authorization policy {name}"),
                    why: why.clone(),
                });
        }
        self.published.send_replace(Published {
            mesh: Arc::new(self.mesh.clone()),
            policies_unknown_in: unknown,
        });
    }
}

/// Removes `name` from `map`, copying the map first only when it has `name`
/// and the last published view shares it ([`Arc::make_mut`]): a push touches
/// only the kinds it changes.
fn remove<V: Clone>(map: &mut Arc<BTreeMap<String, V>>, name: &str) {
    if map.contains_key(name) {
        Arc::make_mut(map).remove(name);
    }
}

impl Handler for MeshHandler {
    fn addresses(&mut self, updated: Vec<(String, Address)>, removed: Vec<String>) -> Vec<Refused> {
        let mut refused = Vec::new();
        for name in removed {
            remove(&mut self.mesh.workloads, &name);
            remove(&mut self.mesh.services, &name);
        }
        for (name, address) in updated {
            // An address is a workload or a service; the same name may change
            // from one to the other.
            remove(&mut self.mesh.workloads, &name);
            remove(&mut self.mesh.services, &name);
            match address.r#type {
                Some(Type::Workload(w)) => match convert::workload(&w, &self.trust_domain) {
                    Ok(w) => {
                        Arc::make_mut(&mut self.mesh.workloads).insert(name, w);
                    }
                    Err(why) => refused.push(Refused::new(name, format!("workload: {why}"))),
                },
                Some(Type::Service(s)) => match convert::service(&s) {
                    Ok(s) => {
                        Arc::make_mut(&mut self.mesh.services).insert(name, s);
                    }
                    Err(why) => refused.push(Refused::new(name, format!("service: {why}"))),
                },
                None => refused.push(Refused::new(name, "neither a workload nor a service")),
            }
        }
        for r in &refused {
            tracing::warn!(resource = %r.name, "istiod's address refused: {}", r.why);
        }
        self.publish();
        refused
    }

    fn authorizations(
        &mut self,
        updated: Vec<(String, Authorization)>,
        removed: Vec<String>,
    ) -> Vec<Refused> {
        let mut refused = Vec::new();
        for name in removed {
            remove(&mut self.mesh.policies, &name);
            self.refused_policies.remove(&name);
        }
        for (name, policy) in updated {
            match authz::from_istiod(&policy) {
                Ok(p) => {
                    for note in &p.notes {
                        tracing::warn!(policy = %p, "istiod's authorization policy: {note}");
                    }
                    self.refused_policies.remove(&name);
                    Arc::make_mut(&mut self.mesh.policies).insert(name, Arc::new(p));
                }
                Err(why) => {
                    // Denied rather than allowed: its namespace's policies are
                    // unknown while it is refused.
                    tracing::error!(resource = %name, "istiod's authorization policy refused: {why}; inbound connections to its namespace's pods are denied until it is fixed or removed");
                    remove(&mut self.mesh.policies, &name);
                    self.refused_policies
                        .insert(name.clone(), (policy.namespace.clone(), why.clone()));
                    refused.push(Refused::new(name, why));
                }
            }
        }
        self.publish();
        refused
    }

    fn connection(&mut self, state: &ConnectionState) {
        match state {
            ConnectionState::Connected { address } => {
                tracing::info!(%address, "connected to istiod's workload xDS");
            }
            ConnectionState::Lost { why } => {
                tracing::warn!(
                    "istiod's workload xDS is unreachable ({why}); serving with the last state it sent, retrying"
                );
            }
        }
    }
}

/// The Kubernetes source with istiod's view laid on ([`Source`]).
pub struct IstiodSource {
    kube: Opened,
    published: watch::Receiver<Published>,
    ready: watch::Receiver<bool>,
    /// The last Kubernetes delta's carried fields, sent again with istiod's
    /// changes.
    carried: Delta,
    /// The mesh last sent.
    sent: Option<Arc<Mesh>>,
    /// Whether the Kubernetes source's first delta (its whole view) was sent.
    started: bool,
    reporter: Mutex<Option<Box<dyn CaptureReporter>>>,
    client: JoinHandle<()>,
}

impl Drop for IstiodSource {
    fn drop(&mut self) {
        self.client.abort();
    }
}

/// What the agent's readiness waits for while istiod has not answered both
/// types once.
pub const UNLISTED: &str = "istiod";

impl IstiodSource {
    /// Runs `client` with a [`MeshHandler`] making SPIFFE IDs in
    /// `trust_domain`, beside the Kubernetes source `kube` (started).
    pub fn start(mut kube: Opened, client: XdsClient, trust_domain: &str) -> Self {
        let (handler, published) = MeshHandler::new(trust_domain);
        let ready = client.ready();
        let client = tokio::spawn(client.run(handler));
        IstiodSource {
            reporter: Mutex::new(kube.reporter.take()),
            kube,
            published,
            ready,
            carried: Delta::default(),
            sent: None,
            started: false,
            client,
        }
    }

    /// The Kubernetes source's `delta` without what istiod says instead.
    fn without_istiods_kinds(mut delta: Delta) -> Delta {
        delta.services = None;
        delta.changed_services.clear();
        delta.endpoint_slices = None;
        delta.changed_endpoint_slices.clear();
        delta.policies = None;
        delta.mtls_policies = None;
        delta.policies_unknown = None;
        delta.policies_unknown_in.clear();
        delta.unlisted.retain(|u| {
            !super::kube::REPLACED_BY_ISTIOD
                .iter()
                .any(|k| k.resource == *u)
        });
        delta
    }

    /// `delta` with istiod's view and refusals laid on.
    fn laid(&mut self, mut delta: Delta) -> Delta {
        let published = self.published.borrow_and_update().clone();
        if self
            .sent
            .as_ref()
            .is_none_or(|m| !Arc::ptr_eq(m, &published.mesh))
        {
            self.sent = Some(published.mesh.clone());
            delta.mesh = Some(published.mesh);
        }
        for (namespace, unknown) in published.policies_unknown_in {
            delta
                .policies_unknown_in
                .entry(namespace)
                .or_insert(unknown);
        }
        if !*self.ready.borrow_and_update() {
            // Which pods istiod lists is not known yet: none is taken as gone.
            delta.completeness = Completeness::Incomplete;
            if !delta.unlisted.contains(&UNLISTED) {
                delta.unlisted.push(UNLISTED);
            }
        }
        delta
    }
}

impl Source for IstiodSource {
    async fn next(&mut self) -> Delta {
        let started = self.started;
        tokio::select! {
            delta = self.kube.deltas.recv() => {
                let Some(delta) = delta else {
                    // The Kubernetes source's task ended: nothing more comes.
                    return std::future::pending().await;
                };
                self.started = true;
                let delta = Self::without_istiods_kinds(delta);
                self.carried = Delta {
                    completeness: delta.completeness,
                    policies_unknown: delta.policies_unknown.clone(),
                    policies_unknown_in: delta.policies_unknown_in.clone(),
                    unlisted: delta.unlisted.clone(),
                    ..Delta::default()
                };
                self.laid(delta)
            }
            Ok(()) = self.published.changed(), if started => {
                let carried = self.carried.clone();
                self.laid(carried)
            }
            Ok(()) = self.ready.changed(), if started => {
                let carried = self.carried.clone();
                self.laid(carried)
            }
        }
    }

    fn lists_every_namespace(&self) -> bool {
        self.kube.lists_every_namespace
    }

    fn readiness_waits_for_whole_view(&self) -> bool {
        true
    }

    fn capture_reporter(&self) -> Option<Box<dyn CaptureReporter>> {
        self.reporter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}
