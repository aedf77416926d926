//! What a source tells the state: the objects that changed since its last
//! delta, and how complete its view is.

use std::{collections::BTreeMap, sync::Arc};

use crate::{
    authz::{MtlsPolicy, Policy},
    k8s::{EndpointSlice, Namespace, Node, Pod, Service},
};

/// A change of what a source knows, as [`super::State::apply`] takes it.
///
/// Pods, Services and EndpointSlices may be carried one by one (the objects
/// themselves, keyed `namespace/name`) or as the whole set; namespaces, Nodes
/// and policies, which a cluster holds few of and whose indexes are rebuilt
/// whole, are carried as the whole set when any of them changed. `None` means
/// unchanged; a whole set is applied before the changes one by one.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    /// Every pod the source has, when it read them all anew (its first view, a
    /// Kubernetes watch that listed again): pods not in it are gone.
    pub all_pods: Option<Vec<Pod>>,
    /// Pods changed since the last delta: `namespace/name` with every definition
    /// the source has of it now, in the source's order (a manifests directory
    /// may define a pod twice: the first definition is used); none when it is
    /// gone.
    pub pods: Vec<(String, Vec<Pod>)>,
    /// Every Namespace object, when one was added, changed or removed (of two
    /// of one name, the last is used).
    pub namespaces: Option<Vec<Namespace>>,
    /// Every Service, when the source read them all anew.
    pub services: Option<Vec<Service>>,
    /// Services changed since the last delta: `namespace/name` with the
    /// object now, none when it is gone.
    pub changed_services: Vec<(String, Option<Service>)>,
    /// Every EndpointSlice (`discovery.k8s.io/v1`), when the source read them
    /// all anew.
    pub endpoint_slices: Option<Vec<EndpointSlice>>,
    /// EndpointSlices changed since the last delta, as
    /// [`Delta::changed_services`].
    pub changed_endpoint_slices: Vec<(String, Option<EndpointSlice>)>,
    /// Every authorization policy, when one changed.
    pub policies: Option<Vec<Arc<Policy>>>,
    /// Every PeerAuthentication, when one changed.
    pub mtls_policies: Option<Vec<Arc<MtlsPolicy>>>,
    /// Every Node, when one changed.
    pub nodes: Option<Vec<Node>>,
    /// How complete the source's view is now (carried by every delta).
    pub completeness: Completeness,
    /// Why the policies cannot be known now, if they cannot (carried by every
    /// delta): every inbound connection to this node's enrolled pods is then
    /// denied.
    pub policies_unknown: Option<PoliciesUnknown>,
    /// Policies the source refused, by the namespace they are in (carried by
    /// every delta; empty when there are none): inbound connections to the
    /// enrolled pods of that namespace are denied, to every enrolled pod when
    /// it is the root namespace ([`crate::authz::PolicySet::deny_namespace_unknown`]).
    /// Unlike [`Delta::policies_unknown`], they do not keep the view from
    /// being whole: one namespace's broken policy denies that namespace only.
    pub policies_unknown_in: BTreeMap<String, PoliciesUnknown>,
    /// What the source has not read once yet, as logs name it (the
    /// Kubernetes API's watches that have not listed: `nodes`, `services`, …;
    /// carried by every delta, empty once everything was listed). The agent
    /// is not ready while anything is left. Unlike [`Delta::completeness`] it
    /// holds back no removal: the Nodes, say, tell nothing of which pods are
    /// gone.
    pub unlisted: Vec<&'static str>,
    /// What istiod pushed (workload xDS), whole, when any of it changed.
    pub mesh: Option<Arc<Mesh>>,
}

/// What Istio's control plane says of the mesh (workload xDS), converted
/// ([`crate::source::xds`]): laid over what the other source says (its pods
/// keep their enrollment; see [`super::WorkloadIndex::lay_mesh`] and
/// [`super::service::ServiceIndex::lay_mesh`]).
/// Each kind is shared whole with the view before it when it did not change
/// (the same `Arc`), so that the state makes again only what depends on the
/// kinds that changed.
#[derive(Clone, Debug, Default)]
pub struct Mesh {
    /// Every workload, by resource name.
    pub workloads: Arc<BTreeMap<String, Arc<super::Workload>>>,
    /// Every service, by resource name.
    pub services: Arc<BTreeMap<String, Arc<super::service::MeshService>>>,
    /// Every authorization policy, by resource name.
    pub policies: Arc<BTreeMap<String, Arc<Policy>>>,
}

impl Delta {
    /// Whether the delta changes no object (it may still change the
    /// completeness or whether policies are known).
    pub fn has_no_objects(&self) -> bool {
        self.all_pods.is_none()
            && self.pods.is_empty()
            && self.namespaces.is_none()
            && self.services.is_none()
            && self.changed_services.is_empty()
            && self.endpoint_slices.is_none()
            && self.changed_endpoint_slices.is_empty()
            && self.mesh.is_none()
            && self.policies.is_none()
            && self.mtls_policies.is_none()
            && self.nodes.is_none()
    }
}

/// How complete a source's view is, which decides what the agent may take as
/// gone (see [`crate::dataplane::Removal`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Completeness {
    /// Not whole for now: the first lists are not done, or a change is
    /// settling. A pod missing from it may be missing only for the moment.
    #[default]
    Incomplete,
    /// Whole but for objects that cannot be read (a manifest broken since
    /// start-up): pods captured before this agent started may still be wanted.
    UnreadableParts,
    /// Whole.
    Complete,
}

/// Why the authorization policies (all of them, or those of a namespace:
/// [`Delta::policies_unknown_in`]) cannot be known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoliciesUnknown {
    /// What is broken, as logs name it: `/etc/podlink/manifests/p.yaml`,
    /// `AuthorizationPolicy shop/x`.
    pub what: String,
    /// Why, as the source found it.
    pub why: String,
}
