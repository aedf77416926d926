//! Istio `PeerAuthentication`: the mutual TLS mode a workload's inbound
//! connections need, compiled from the resource ([`super::spec::PeerAuthentication`]).
//!
//! Source: Istio reference, "PeerAuthentication"
//! (<https://istio.io/latest/docs/reference/config/security/peer_authentication/>),
//! and istiod's conversion of PeerAuthentication for ztunnel
//! (`pilot/pkg/serviceregistry/kube/controller/ambient/authorization.go`).
//!
//! [`MtlsPolicies`] holds the mesh's policies by level and answers the mode in
//! effect for a workload's port ([`MtlsPolicies::effective`]):
//!
//! * Levels: a policy with a selector, in the workload's namespace, matching its
//!   labels (workload level) over the one without a selector in its namespace
//!   (namespace level) over the one without a selector in the root namespace
//!   (mesh level). A policy with a selector in the root namespace applies to no
//!   workload, as in Istio (istiod skips it at every level).
//! * `UNSET` (or no `mtls`) inherits from the next level; nothing set is
//!   `PERMISSIVE`. The workload-level policy's `portLevelMtls` entry for the
//!   connection's destination port on the pod (the target port) comes before its
//!   `mtls.mode`; an `UNSET` entry inherits too.
//! * A `namespace/name` defined twice (a manifests directory, or two API
//!   versions' objects): its definitions with one selector are enforced as
//!   one, the strictest mode of each (`STRICT` over `PERMISSIVE`/`DISABLE`
//!   over `UNSET`) for `mtls.mode` and for each port, with a warning.
//! * Several policies at one level: Istio enforces the oldest. podlink does not
//!   know creation times: it enforces the first by `namespace/name` and warns.
//! * `DISABLE` accepts plaintext, as `PERMISSIVE` does (as in ztunnel: there is
//!   no mutual TLS to turn off on a plaintext connection, and HBONE is always
//!   mutual TLS).

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    sync::Arc,
};

use serde::Serialize;
use thiserror::Error;

use super::{
    LabelProblem, SetWarning,
    compile::label_problem,
    spec::{MutualTls, PeerAuthentication},
};

/// A mutual TLS mode (`spec.mtls.mode`); serialized as Istio writes it
/// (`STRICT`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum MtlsMode {
    /// `UNSET` (or absent): inherit from the parent scope (workload → namespace
    /// → mesh); PERMISSIVE when nothing sets a mode.
    #[default]
    Unset,
    /// `DISABLE`: connections are not required to use mutual TLS.
    Disable,
    /// `PERMISSIVE`: plaintext and mutual TLS are both accepted.
    Permissive,
    /// `STRICT`: only mutual TLS; plaintext inbound connections are refused.
    Strict,
}

/// Why [`MtlsPolicy::compile`] refused a PeerAuthentication.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum MtlsError {
    /// `metadata.name` is absent or empty.
    #[error("PeerAuthentication has no metadata.name")]
    NoName,
    /// A mode is not one Istio defines.
    #[error(
        "PeerAuthentication {policy}: {field} {value:?} is not one of UNSET, DISABLE, PERMISSIVE, STRICT"
    )]
    UnknownMode {
        /// The policy's `namespace/name`.
        policy: String,
        /// The field's path (`spec.mtls.mode`, `spec.portLevelMtls.8080.mode`).
        field: String,
        /// The mode as written.
        value: String,
    },
    /// A key of `spec.portLevelMtls` is not a port number 1–65535.
    #[error(
        "PeerAuthentication {policy}: spec.portLevelMtls key {key:?} is not a port number 1-65535"
    )]
    BadPort {
        /// The policy's `namespace/name`.
        policy: String,
        /// The key as written.
        key: String,
    },
    /// `spec.portLevelMtls` without a selector, or with a selector without labels
    /// (Istio's validation refuses it).
    #[error("PeerAuthentication {policy}: spec.portLevelMtls needs spec.selector")]
    PortsWithoutSelector {
        /// The policy's `namespace/name`.
        policy: String,
    },
    /// A selector label is not valid Kubernetes syntax.
    #[error("PeerAuthentication {policy}: spec.selector.matchLabels: {problem}")]
    Selector {
        /// The policy's `namespace/name`.
        policy: String,
        /// What is wrong with the label.
        problem: LabelProblem,
    },
}

/// A compiled PeerAuthentication.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MtlsPolicy {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `spec.selector.matchLabels`, if there is a selector with labels (a
    /// selector without labels is none, as in Istio).
    pub selector: Option<BTreeMap<String, String>>,
    /// `spec.mtls.mode`.
    pub mode: MtlsMode,
    /// `spec.portLevelMtls`: modes by the workload's (target) port.
    pub port_modes: BTreeMap<u16, MtlsMode>,
}

impl fmt::Display for MtlsPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn parse_mode(policy: &str, field: String, m: &MutualTls) -> Result<MtlsMode, MtlsError> {
    match m.mode.as_deref().unwrap_or("UNSET") {
        "UNSET" => Ok(MtlsMode::Unset),
        "DISABLE" => Ok(MtlsMode::Disable),
        "PERMISSIVE" => Ok(MtlsMode::Permissive),
        "STRICT" => Ok(MtlsMode::Strict),
        other => Err(MtlsError::UnknownMode {
            policy: policy.to_string(),
            field,
            value: other.to_string(),
        }),
    }
}

impl MtlsPolicy {
    /// Compiles a PeerAuthentication read from the workload source.
    ///
    /// # Errors
    /// [`MtlsError`]: no name, a mode Istio does not define, a port key that is
    /// not a port, port-level modes without a selector, a bad selector label.
    pub fn compile(p: &PeerAuthentication) -> Result<Self, MtlsError> {
        let name = p.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err(MtlsError::NoName);
        }
        let namespace = p.metadata.namespace_or_default().to_string();
        let policy = format!("{namespace}/{name}");
        let spec = &p.spec;
        for (key, value) in spec.selector.iter().flat_map(|s| &s.match_labels) {
            if let Some(problem) = label_problem(key, value) {
                return Err(MtlsError::Selector { policy, problem });
            }
        }
        let mode = match &spec.mtls {
            Some(m) => parse_mode(&policy, "spec.mtls.mode".into(), m)?,
            None => MtlsMode::Unset,
        };
        let selector = spec
            .selector
            .as_ref()
            .map(|s| s.match_labels.clone())
            .filter(|labels| !labels.is_empty());
        let mut port_modes = BTreeMap::new();
        if let Some(ports) = spec.port_level_mtls.as_ref().filter(|p| !p.is_empty()) {
            if selector.is_none() {
                return Err(MtlsError::PortsWithoutSelector { policy });
            }
            for (key, m) in ports {
                let port = key.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                    MtlsError::BadPort {
                        policy: policy.clone(),
                        key: key.clone(),
                    }
                })?;
                port_modes.insert(
                    port,
                    parse_mode(&policy, format!("spec.portLevelMtls.{key}.mode"), m)?,
                );
            }
        }
        Ok(MtlsPolicy {
            namespace,
            name,
            selector,
            mode,
            port_modes,
        })
    }
}

/// Which workloads a PeerAuthentication applies to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MtlsScope {
    /// Every workload of the mesh (root namespace, no selector).
    Mesh,
    /// Every workload of the namespace (no selector).
    Namespace(String),
    /// The workloads of `namespace` whose labels include `labels`.
    Workload {
        /// The policy's namespace.
        namespace: String,
        /// Labels the workload must carry.
        labels: BTreeMap<String, String>,
    },
    /// A selector in the root namespace: no workload (Istio ignores it).
    Ignored,
}

impl MtlsPolicy {
    /// The workloads the policy applies to, given the mesh's root namespace.
    pub fn scope(&self, root_namespace: &str) -> MtlsScope {
        match &self.selector {
            Some(_) if self.namespace == root_namespace => MtlsScope::Ignored,
            Some(labels) => MtlsScope::Workload {
                namespace: self.namespace.clone(),
                labels: labels.clone(),
            },
            None if self.namespace == root_namespace => MtlsScope::Mesh,
            None => MtlsScope::Namespace(self.namespace.clone()),
        }
    }

    /// Whether its selector (which it must have) matches `labels`.
    fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector
            .iter()
            .flatten()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// The mode in effect on a workload's port ([`MtlsPolicies::effective`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EffectiveMtls<'a> {
    /// `DISABLE`, `PERMISSIVE` or `STRICT`, never `UNSET`.
    pub mode: MtlsMode,
    /// The policy that set it; `None` when none did (`PERMISSIVE`).
    pub set_by: Option<&'a MtlsPolicy>,
}

/// How strict `mode` is: `STRICT` over `PERMISSIVE` and `DISABLE` (which
/// accept the same connections) over `UNSET`.
fn strictness(mode: MtlsMode) -> u8 {
    match mode {
        MtlsMode::Unset => 0,
        MtlsMode::Disable | MtlsMode::Permissive => 1,
        MtlsMode::Strict => 2,
    }
}

/// The stricter of `a` and `b`; `a` when they are as strict.
fn stricter(a: MtlsMode, b: MtlsMode) -> MtlsMode {
    if strictness(b) > strictness(a) { b } else { a }
}

/// `all` (sorted by `namespace/name`, a name's definitions in the source's
/// order) with the definitions of one name and one selector merged into the
/// first: the strictest `spec.mtls.mode`, and for each port of
/// `spec.portLevelMtls` the strictest mode given for it (a port only one
/// definition names keeps its mode). Definitions of one name with different
/// selectors apply at different levels or to different pods: each is kept.
/// A [`SetWarning::MtlsDuplicate`] for each name defined more than once.
fn merge_duplicates(
    all: Vec<Arc<MtlsPolicy>>,
    warnings: &mut Vec<SetWarning>,
) -> Vec<Arc<MtlsPolicy>> {
    let mut merged: Vec<Arc<MtlsPolicy>> = Vec::with_capacity(all.len());
    // The index in `merged` where the current name's definitions start.
    let mut start = 0;
    for p in all {
        let same_name = merged
            .get(start)
            .is_some_and(|q| q.namespace == p.namespace && q.name == p.name);
        if !same_name {
            start = merged.len();
            merged.push(p);
            continue;
        }
        let policy = p.to_string();
        if !warnings
            .iter()
            .any(|w| matches!(w, SetWarning::MtlsDuplicate { policy: q } if *q == policy))
        {
            warnings.push(SetWarning::MtlsDuplicate { policy });
        }
        let Some(q) = merged[start..]
            .iter_mut()
            .find(|q| q.selector == p.selector)
        else {
            merged.push(p);
            continue;
        };
        let q = Arc::make_mut(q);
        q.mode = stricter(q.mode, p.mode);
        for (port, mode) in &p.port_modes {
            let m = q.port_modes.entry(*port).or_insert(*mode);
            *m = stricter(*m, *mode);
        }
    }
    merged
}

/// The mesh's PeerAuthentications, by level (module documentation).
#[derive(Clone, Debug, Default)]
pub struct MtlsPolicies {
    /// Every policy given, sorted by `namespace/name`, the definitions of one
    /// name with one selector merged into one ([`merge_duplicates`]).
    all: Vec<Arc<MtlsPolicy>>,
    /// The mesh-level policy enforced.
    mesh: Option<Arc<MtlsPolicy>>,
    /// The namespace-level policy enforced, by namespace.
    namespaces: HashMap<String, Arc<MtlsPolicy>>,
    /// Workload-level policies by namespace, sorted by name (the first that
    /// selects a workload is enforced on it).
    selectors: HashMap<String, Vec<Arc<MtlsPolicy>>>,
}

impl MtlsPolicies {
    /// The set of `policies`, those of `root_namespace` without a selector
    /// applying mesh-wide. Warnings: a name defined more than once (its
    /// definitions with one selector are enforced as one, the strictest mode
    /// of each level and port: [`merge_duplicates`]), several policies at the mesh or a namespace's
    /// level (the first by name is enforced), a selector in the root namespace
    /// (it applies to no workload).
    pub fn build(
        root_namespace: &str,
        policies: impl IntoIterator<Item = Arc<MtlsPolicy>>,
    ) -> (Self, Vec<SetWarning>) {
        let mut all: Vec<Arc<MtlsPolicy>> = policies.into_iter().collect();
        // Stable: a name's definitions keep the source's order.
        all.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut warnings = Vec::new();
        let mut set = MtlsPolicies::default();
        let mut mesh = Vec::new();
        let mut namespaces: BTreeMap<&str, Vec<&Arc<MtlsPolicy>>> = BTreeMap::new();
        let all = merge_duplicates(all, &mut warnings);
        for p in &all {
            match p.scope(root_namespace) {
                MtlsScope::Mesh => mesh.push(p),
                MtlsScope::Namespace(_) => namespaces.entry(&p.namespace).or_default().push(p),
                MtlsScope::Workload { .. } => set
                    .selectors
                    .entry(p.namespace.clone())
                    .or_default()
                    .push(p.clone()),
                MtlsScope::Ignored => warnings.push(SetWarning::MtlsRootSelector {
                    policy: p.to_string(),
                }),
            }
        }
        let mut first = |level: String, ps: &[&Arc<MtlsPolicy>]| {
            if ps.len() > 1 {
                warnings.push(SetWarning::MtlsOverlap {
                    level,
                    policies: ps.iter().map(ToString::to_string).collect(),
                });
            }
            ps.first().map(|p| Arc::clone(p))
        };
        set.mesh = first("mesh-wide".into(), &mesh);
        for (ns, ps) in namespaces {
            if let Some(p) = first(format!("to namespace {ns}"), &ps) {
                set.namespaces.insert(ns.to_string(), p);
            }
        }
        set.all = all;
        (set, warnings)
    }

    /// Every policy, sorted by `namespace/name`.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<MtlsPolicy>> {
        self.all.iter()
    }

    /// Whether `policy` (one of [`MtlsPolicies::policies`]) is enforced on the
    /// workloads of its level: not a second definition, not passed over for
    /// another of its level, not a selector in the root namespace. A
    /// workload-level one may still be passed over on a workload another
    /// selects too ([`MtlsPolicies::overlaps`]).
    pub fn in_effect(&self, policy: &Arc<MtlsPolicy>) -> bool {
        let same = |p: &Arc<MtlsPolicy>| Arc::ptr_eq(p, policy);
        self.mesh.as_ref().is_some_and(same)
            || self.namespaces.get(&policy.namespace).is_some_and(same)
            || self
                .selectors
                .get(&policy.namespace)
                .is_some_and(|ps| ps.iter().any(same))
    }

    /// The workload-level policies of `namespace` that select a workload with
    /// `labels`, the enforced one first.
    fn selecting<'s, 'l>(
        &'s self,
        namespace: &str,
        labels: &'l BTreeMap<String, String>,
    ) -> impl Iterator<Item = &'s Arc<MtlsPolicy>> + use<'s, 'l> {
        self.selectors
            .get(namespace)
            .into_iter()
            .flatten()
            .filter(move |p| p.selects(labels))
    }

    /// The mode in effect on `port` (the connection's destination port on the
    /// pod) of a workload in `namespace` with `labels`, and the policy that set
    /// it (module documentation).
    pub fn effective(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        port: u16,
    ) -> EffectiveMtls<'_> {
        let workload = self.selecting(namespace, labels).next();
        let port_mode = workload.and_then(|p| Some((p.port_modes.get(&port)?, p)));
        // From the most specific: the first mode set is in effect.
        [
            port_mode.map(|(mode, p)| (*mode, p)),
            workload.map(|p| (p.mode, p)),
            self.namespaces.get(namespace).map(|p| (p.mode, p)),
            self.mesh.as_ref().map(|p| (p.mode, p)),
        ]
        .into_iter()
        .flatten()
        .find(|(mode, _)| *mode != MtlsMode::Unset)
        .map_or(
            EffectiveMtls {
                mode: MtlsMode::Permissive,
                set_by: None,
            },
            |(mode, p)| EffectiveMtls {
                mode,
                set_by: Some(p),
            },
        )
    }

    /// A warning for each set of workload-level policies that select one of
    /// `workloads` (namespace, labels) together; the first by name is enforced
    /// on it. Each set is reported once, however many workloads it selects.
    pub fn overlaps<'a>(
        &self,
        workloads: impl IntoIterator<Item = (&'a str, &'a BTreeMap<String, String>)>,
    ) -> Vec<SetWarning> {
        let mut seen = std::collections::BTreeSet::new();
        for (namespace, labels) in workloads {
            let names: Vec<String> = self
                .selecting(namespace, labels)
                .map(ToString::to_string)
                .collect();
            if names.len() > 1 {
                seen.insert(names);
            }
        }
        seen.into_iter()
            .map(|policies| SetWarning::MtlsOverlap {
                level: "to the same pods of this node".into(),
                policies,
            })
            .collect()
    }
}
