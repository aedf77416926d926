//! The compiled policy: what it applies to ([`Scope`]), what it does
//! ([`Action`]), and its rules as checks on a [`Request`]'s layer-4 attributes.

use std::{collections::BTreeMap, fmt};

use ipnet::IpNet;
use serde::Serialize;

use super::Request;

/// What a policy does when it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Action {
    /// The request is allowed if it matches (and no DENY policy does).
    Allow,
    /// The request is denied if it matches.
    Deny,
    /// A match is reported; the outcome does not change.
    Audit,
}

/// Which workloads a policy applies to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Every workload of the mesh (root namespace, no selector).
    Mesh,
    /// Workloads whose labels include `labels`, in `namespace` (or in every
    /// namespace when `None`: a selector in the root namespace).
    Selector {
        /// The namespace, or `None` for all.
        namespace: Option<String>,
        /// Labels the workload must carry.
        labels: BTreeMap<String, String>,
    },
    /// Every workload of the namespace.
    Namespace(String),
    /// Attached to a gateway, waypoint or service (`targetRef`): no workload here.
    Targeted,
    /// Chosen by istiod for the workloads that name it (workload xDS scope
    /// `WORKLOAD_SELECTOR`: each selected workload lists it).
    Named,
}

/// How istiod scoped a policy it sends (workload xDS `istio.security.Scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IstiodScope {
    /// `GLOBAL`: every workload of the mesh.
    Global,
    /// `NAMESPACE`: every workload of the policy's namespace.
    Namespace,
    /// `WORKLOAD_SELECTOR`: the workloads that list it in their
    /// `authorization_policies`.
    WorkloadSelector,
}

/// A string pattern: exact, `prefix*`, `*suffix`, or `*` (present).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Pattern {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Present,
}

impl Pattern {
    pub(super) fn new(s: &str) -> Self {
        if s == "*" {
            Pattern::Present
        } else if let Some(p) = s.strip_suffix('*') {
            Pattern::Prefix(p.to_string())
        } else if let Some(p) = s.strip_prefix('*') {
            Pattern::Suffix(p.to_string())
        } else {
            Pattern::Exact(s.to_string())
        }
    }

    pub(super) fn principal(s: &str) -> Self {
        Self::new(s.strip_prefix("spiffe://").unwrap_or(s))
    }

    fn matches(&self, value: &str) -> bool {
        match self {
            Pattern::Exact(p) => value == p,
            Pattern::Prefix(p) => value.starts_with(p.as_str()),
            Pattern::Suffix(p) => value.ends_with(p.as_str()),
            Pattern::Present => !value.is_empty(),
        }
    }
}

/// One attribute test. `negated` tests match when the positive form does not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Test {
    Principal(Vec<Pattern>),
    Namespace(Vec<Pattern>),
    /// `namespace/service-account` pairs.
    ServiceAccount(Vec<(String, String)>),
    SourceIp(Vec<IpNet>),
    DestinationIp(Vec<IpNet>),
    DestinationPort(Vec<u16>),
    /// Uses attributes a layer-4 proxy cannot see.
    Never,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Check {
    pub(super) test: Test,
    pub(super) negated: bool,
}

impl Check {
    fn matches(&self, req: &Request<'_>) -> bool {
        let principal = req
            .source
            .map(|id| id.to_string()["spiffe://".len()..].to_string());
        let positive = match &self.test {
            Test::Principal(ps) => principal
                .as_deref()
                .is_some_and(|p| ps.iter().any(|pat| pat.matches(p))),
            Test::Namespace(ps) => req
                .source
                .is_some_and(|id| ps.iter().any(|pat| pat.matches(id.namespace()))),
            Test::ServiceAccount(sas) => req.source.is_some_and(|id| {
                sas.iter()
                    .any(|(ns, sa)| id.namespace() == ns && id.service_account() == sa)
            }),
            Test::SourceIp(nets) => nets.iter().any(|n| n.contains(&req.source_ip)),
            Test::DestinationIp(nets) => nets.iter().any(|n| n.contains(&req.destination_ip)),
            Test::DestinationPort(ports) => ports.contains(&req.destination_port),
            Test::Never => return false,
        };
        positive != self.negated
    }
}

/// A compiled rule: each of `from` and `to` is a list of alternatives (`None`: any),
/// each alternative a list of checks that must all hold; `when` checks must all
/// hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Rule {
    pub(super) from: Option<Vec<Vec<Check>>>,
    pub(super) to: Option<Vec<Vec<Check>>>,
    pub(super) when: Vec<Check>,
    /// Further groups that must all match, each a list of alternatives (any)
    /// of checks (all): istiod's clauses ([`super::from_istiod`]).
    pub(super) also: Vec<Vec<Vec<Check>>>,
}

impl Rule {
    fn matches(&self, req: &Request<'_>) -> bool {
        let any = |alternatives: &Option<Vec<Vec<Check>>>| {
            alternatives.as_ref().is_none_or(|alts| {
                alts.iter()
                    .any(|checks| checks.iter().all(|c| c.matches(req)))
            })
        };
        any(&self.from)
            && any(&self.to)
            && self.when.iter().all(|c| c.matches(req))
            && self.also.iter().all(|alts| {
                alts.iter()
                    .any(|checks| checks.iter().all(|c| c.matches(req)))
            })
    }
}

/// A compiled AuthorizationPolicy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Policy {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The action taken on a match.
    pub action: Action,
    /// `spec.selector.matchLabels`, if there is a selector.
    pub selector: Option<BTreeMap<String, String>>,
    /// Attached to a gateway, waypoint or service (`targetRef`), not to workloads.
    pub targeted: bool,
    /// How the policy was adapted to layer 4 (fields that cannot be enforced, and
    /// what was done instead), for the log and the config dump.
    pub notes: Vec<Note>,
    /// How istiod scoped it, for a policy from istiod (then `selector` and
    /// `targeted` are not used); `None` for one compiled from an
    /// AuthorizationPolicy object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub istiod_scope: Option<IstiodScope>,
    /// A dry-run policy (istiod's `dry_run`): the
    /// decision it would make is logged, never enforced.
    pub dry_run: bool,
    #[serde(skip)]
    pub(super) rules: Vec<Rule>,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How a policy was adapted to layer 4: logged once, and listed in the config
/// dump (as its text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// Fields a layer-4 proxy cannot see are set on an entry.
    Unseen {
        /// The entry, a path inside `spec` (`rules[1].to[0].operation`, or
        /// `rules[0].when[0] (key request.method)` for a condition).
        at: String,
        /// The fields, joined with ", ".
        fields: String,
        /// The entry is enforced on its other fields alone (DENY, AUDIT, CUSTOM:
        /// denies more); otherwise it never matches (ALLOW: allows less).
        widened: bool,
    },
    /// `action: CUSTOM`, enforced as DENY.
    Custom,
    /// `targetRef`/`targetRefs`: not enforced here.
    Targeted,
    /// istiod sent a value podlink does not know (a newer Istio's): in a
    /// string match, the entry is enforced on its other fields (DENY) or never
    /// matches (ALLOW); as the action, the policy is enforced as DENY.
    Unknown {
        /// Where, a path inside the resource (`rules[0].clauses[1].matches[0].principals[2]`, `action`).
        at: String,
        /// What was not known.
        what: String,
        /// See [`Note::Unseen::widened`].
        widened: bool,
    },
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Note::Unseen {
                at,
                fields,
                widened: true,
            } => write!(
                f,
                "{at}: {fields} cannot be seen by a layer-4 proxy; enforced on the other fields alone (denies more)"
            ),
            Note::Unseen {
                at,
                fields,
                widened: false,
            } => write!(
                f,
                "{at}: {fields} cannot be seen by a layer-4 proxy; this entry never matches (allows less)"
            ),
            Note::Custom => f.write_str(
                "action CUSTOM: no external authorizer is asked; enforced as DENY on the layer-4 fields",
            ),
            Note::Unknown {
                at,
                what,
                widened: true,
            } => write!(
                f,
                "{at}: {what} is not known to podlink; enforced on the other fields alone (denies more)"
            ),
            Note::Unknown {
                at,
                what,
                widened: false,
            } => write!(
                f,
                "{at}: {what} is not known to podlink; this entry never matches (allows less)"
            ),
            Note::Targeted => f.write_str(
                "targetRef: attached to a gateway, waypoint or service, not to workloads; not enforced here",
            ),
        }
    }
}

impl Serialize for Note {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl Policy {
    /// The workloads the policy applies to, given the mesh's root namespace.
    pub fn scope(&self, root_namespace: &str) -> Scope {
        match self.istiod_scope {
            Some(IstiodScope::Global) => return Scope::Mesh,
            Some(IstiodScope::Namespace) => return Scope::Namespace(self.namespace.clone()),
            Some(IstiodScope::WorkloadSelector) => return Scope::Named,
            None => {}
        }
        let in_root = self.namespace == root_namespace;
        match &self.selector {
            _ if self.targeted => Scope::Targeted,
            Some(labels) => Scope::Selector {
                namespace: (!in_root).then(|| self.namespace.clone()),
                labels: labels.clone(),
            },
            None if in_root => Scope::Mesh,
            None => Scope::Namespace(self.namespace.clone()),
        }
    }

    /// Whether the policy applies to a workload in `namespace` with `labels`,
    /// for which istiod selected the policies `named` (`namespace/name`).
    pub fn applies_to(
        &self,
        root_namespace: &str,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        named: &[String],
    ) -> bool {
        match self.istiod_scope {
            Some(IstiodScope::Global) => return true,
            Some(IstiodScope::Namespace) => return self.namespace == namespace,
            Some(IstiodScope::WorkloadSelector) => {
                return named.iter().any(|n| {
                    n.split_once('/')
                        .is_some_and(|(ns, name)| ns == self.namespace && name == self.name)
                });
            }
            None => {}
        }
        if self.targeted || (self.namespace != root_namespace && self.namespace != namespace) {
            return false;
        }
        self.selector
            .iter()
            .flatten()
            .all(|(k, v)| labels.get(k) == Some(v))
    }

    /// Whether `req` matches any rule.
    pub fn matches(&self, req: &Request<'_>) -> bool {
        self.rules.iter().any(|r| r.matches(req))
    }
}
