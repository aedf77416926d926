//! Layer-4 authorization with Istio `AuthorizationPolicy`.
//!
//! Policies are read from the workload source ([`spec`] has the resource as
//! written), compiled into [`Policy`] once, and evaluated by the proxy for every
//! inbound connection (HBONE stream, plaintext connection, or a connection between
//! two pods of this node) with [`PolicySet::evaluate`].
//!
//! Semantics follow Istio ("Security" → "Authorization" and the AuthorizationPolicy
//! reference, <https://istio.io/latest/docs/reference/config/security/authorization-policy/>):
//!
//! * Scope: a policy in the root namespace (`istio-system` by default) without a
//!   selector applies to the whole mesh; one with `selector.matchLabels` applies to
//!   the matching workloads of every namespace. Elsewhere a policy applies to its
//!   namespace's workloads, or to those its selector matches. A policy with
//!   `targetRef`/`targetRefs` is attached to a gateway, waypoint or service and
//!   applies to no workload here.
//! * Order: a matching `DENY` policy denies; otherwise, if any `ALLOW` policy
//!   applies to the workload, one must match; otherwise the request is allowed.
//!   `AUDIT` policies never change the outcome: a match is reported.
//! * An `ALLOW` policy without rules (`spec: {}`) matches nothing, so it denies
//!   everything; a rule `{}` matches everything.
//! * A rule matches when its `from` (any entry), `to` (any entry) and `when` (all
//!   conditions) match; within an entry every field set must match; a field
//!   matches when any of its values does; a `not*` field matches when none does.
//! * Strings (principals, namespaces) match exactly, by prefix (`abc*`), by suffix
//!   (`*abc`), or by presence (`*`). Principals are written `<trust
//!   domain>/ns/<namespace>/sa/<service account>`; a `spiffe://` prefix is ignored.
//! * A plaintext connection has no principal and no namespace: `principals`,
//!   `namespaces` and `serviceAccounts` never match it, and their `not*` forms
//!   always do (so `DENY` with `notPrincipals: ["*"]` refuses plaintext, as in
//!   Istio).
//!
//! A layer-4 proxy cannot see request attributes (`methods`, `paths`, `hosts`,
//! `requestPrincipals`, `request.*` conditions and so on). As ztunnel does, a
//! source, operation or condition using them never matches in an `ALLOW` policy,
//! and is enforced on its layer-4 fields alone in a `DENY` (and `AUDIT`) policy, so
//! the result errs towards denying. Each such case is recorded in the policy's
//! [`Policy::notes`], which the agent logs once. `CUSTOM` policies (an external
//! authorizer) are enforced as `DENY` policies on their layer-4 fields: podlink
//! never asks an external authorizer, and never allows in its place.

pub mod spec;

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use serde::Serialize;

use crate::identity::SpiffeId;
use spec::{AuthorizationPolicy, ConditionSpec, OperationSpec, RuleSpec, SourceSpec};

/// Istio's default root namespace: policies there apply mesh-wide.
pub const DEFAULT_ROOT_NAMESPACE: &str = "istio-system";

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
}

/// A string pattern: exact, `prefix*`, `*suffix`, or `*` (present).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pattern {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Present,
}

impl Pattern {
    fn new(s: &str) -> Self {
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

    fn principal(s: &str) -> Self {
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
enum Test {
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
struct Check {
    test: Test,
    negated: bool,
}

/// The connection attributes a policy is evaluated against.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The client's address.
    pub source_ip: IpAddr,
    /// The client's proven identity (its certificate's SPIFFE ID, or its pod's
    /// identity for a connection between two pods of this node); `None` for
    /// plaintext.
    pub source: Option<&'a SpiffeId>,
    /// The destination pod's address.
    pub destination_ip: IpAddr,
    /// The destination port.
    pub destination_port: u16,
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
struct Rule {
    from: Option<Vec<Vec<Check>>>,
    to: Option<Vec<Vec<Check>>>,
    when: Vec<Check>,
}

impl Rule {
    fn matches(&self, req: &Request<'_>) -> bool {
        let any = |alternatives: &Option<Vec<Vec<Check>>>| {
            alternatives.as_ref().is_none_or(|alts| {
                alts.iter()
                    .any(|checks| checks.iter().all(|c| c.matches(req)))
            })
        };
        any(&self.from) && any(&self.to) && self.when.iter().all(|c| c.matches(req))
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
    pub notes: Vec<String>,
    #[serde(skip)]
    rules: Vec<Rule>,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Keys of `when` conditions a layer-4 proxy can evaluate.
const L4_KEYS: [&str; 6] = [
    "source.ip",
    "remote.ip",
    "source.namespace",
    "source.principal",
    "destination.ip",
    "destination.port",
];

fn parse_nets(field: &str, values: &[String]) -> Result<Vec<IpNet>, String> {
    values
        .iter()
        .map(|v| {
            v.parse::<IpNet>()
                .or_else(|_| v.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| format!("{field}: {v:?} is not an IP address or CIDR block"))
        })
        .collect()
}

fn parse_ports(field: &str, values: &[String]) -> Result<Vec<u16>, String> {
    values
        .iter()
        .map(|v| match v.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(format!("{field}: {v:?} is not a port number (1-65535)")),
        })
        .collect()
}

fn parse_service_accounts(field: &str, values: &[String]) -> Result<Vec<(String, String)>, String> {
    values
        .iter()
        .map(|v| match v.split_once('/') {
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                Ok((ns.to_string(), sa.to_string()))
            }
            _ => Err(format!(
                "{field}: {v:?} is not of the form <namespace>/<service account>"
            )),
        })
        .collect()
}

/// Compiles one policy. Errors name the field and value that is wrong.
struct Compiler {
    /// Request-level fields are dropped (DENY, AUDIT) instead of never matching.
    widen: bool,
    notes: Vec<String>,
}

impl Compiler {
    /// Adds checks for a field given as `values` (positive) or `not_values`.
    fn field<T>(
        checks: &mut Vec<Check>,
        values: &Option<Vec<String>>,
        negated: bool,
        make: impl Fn(&[String]) -> Result<T, String>,
        test: impl Fn(T) -> Test,
    ) -> Result<(), String> {
        if let Some(values) = values {
            checks.push(Check {
                test: test(make(values)?),
                negated,
            });
        }
        Ok(())
    }

    /// Handles fields a layer-4 proxy cannot see: `None` when the entry is kept
    /// without them (DENY), `Some(Never)` when it never matches (ALLOW).
    fn unseen(&mut self, at: &str, fields: &[&str]) -> Option<Check> {
        if fields.is_empty() {
            return None;
        }
        let fields = fields.join(", ");
        if self.widen {
            self.notes.push(format!(
                "{at}: {fields} cannot be seen by a layer-4 proxy; enforced on the other fields alone (denies more)"
            ));
            None
        } else {
            self.notes.push(format!(
                "{at}: {fields} cannot be seen by a layer-4 proxy; this entry never matches (allows less)"
            ));
            Some(Check {
                test: Test::Never,
                negated: false,
            })
        }
    }

    fn source(&mut self, at: &str, s: &SourceSpec) -> Result<Vec<Check>, String> {
        let mut checks = Vec::new();
        let principals = |v: &[String]| Ok(v.iter().map(|p| Pattern::principal(p)).collect());
        let patterns = |v: &[String]| Ok(v.iter().map(|p| Pattern::new(p)).collect());
        let f = |name: &str| format!("{at}.{name}");
        Self::field(
            &mut checks,
            &s.principals,
            false,
            principals,
            Test::Principal,
        )?;
        Self::field(
            &mut checks,
            &s.not_principals,
            true,
            principals,
            Test::Principal,
        )?;
        Self::field(&mut checks, &s.namespaces, false, patterns, Test::Namespace)?;
        Self::field(
            &mut checks,
            &s.not_namespaces,
            true,
            patterns,
            Test::Namespace,
        )?;
        let sas = |name: &'static str| {
            let field = f(name);
            move |v: &[String]| parse_service_accounts(&field, v)
        };
        Self::field(
            &mut checks,
            &s.service_accounts,
            false,
            sas("serviceAccounts"),
            Test::ServiceAccount,
        )?;
        Self::field(
            &mut checks,
            &s.not_service_accounts,
            true,
            sas("notServiceAccounts"),
            Test::ServiceAccount,
        )?;
        for (values, negated, name) in [
            (&s.ip_blocks, false, "ipBlocks"),
            (&s.not_ip_blocks, true, "notIpBlocks"),
            (&s.remote_ip_blocks, false, "remoteIpBlocks"),
            (&s.not_remote_ip_blocks, true, "notRemoteIpBlocks"),
        ] {
            let field = f(name);
            Self::field(
                &mut checks,
                values,
                negated,
                |v| parse_nets(&field, v),
                Test::SourceIp,
            )?;
        }
        let mut unseen = Vec::new();
        if s.request_principals.is_some() {
            unseen.push("requestPrincipals");
        }
        if s.not_request_principals.is_some() {
            unseen.push("notRequestPrincipals");
        }
        checks.extend(self.unseen(at, &unseen));
        Ok(checks)
    }

    fn operation(&mut self, at: &str, o: &OperationSpec) -> Result<Vec<Check>, String> {
        let mut checks = Vec::new();
        for (values, negated, name) in
            [(&o.ports, false, "ports"), (&o.not_ports, true, "notPorts")]
        {
            let field = format!("{at}.{name}");
            Self::field(
                &mut checks,
                values,
                negated,
                |v| parse_ports(&field, v),
                Test::DestinationPort,
            )?;
        }
        let unseen: Vec<&str> = [
            (o.hosts.is_some(), "hosts"),
            (o.not_hosts.is_some(), "notHosts"),
            (o.methods.is_some(), "methods"),
            (o.not_methods.is_some(), "notMethods"),
            (o.paths.is_some(), "paths"),
            (o.not_paths.is_some(), "notPaths"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect();
        checks.extend(self.unseen(at, &unseen));
        Ok(checks)
    }

    fn condition(&mut self, at: &str, c: &ConditionSpec) -> Result<Vec<Check>, String> {
        let key = c.key.as_str();
        if c.values.is_none() && c.not_values.is_none() {
            return Err(format!(
                "{at}: condition on {key:?} has neither values nor notValues"
            ));
        }
        if !L4_KEYS.contains(&key) {
            if key.is_empty() {
                return Err(format!("{at}: condition has an empty key"));
            }
            return Ok(self
                .unseen(&format!("{at} (key {key})"), &[key])
                .into_iter()
                .collect());
        }
        let mut checks = Vec::new();
        for (values, negated) in [(&c.values, false), (&c.not_values, true)] {
            let field = format!("{at}.{}", if negated { "notValues" } else { "values" });
            match key {
                "source.ip" | "remote.ip" => Self::field(
                    &mut checks,
                    values,
                    negated,
                    |v| parse_nets(&field, v),
                    Test::SourceIp,
                )?,
                "destination.ip" => Self::field(
                    &mut checks,
                    values,
                    negated,
                    |v| parse_nets(&field, v),
                    Test::DestinationIp,
                )?,
                "destination.port" => Self::field(
                    &mut checks,
                    values,
                    negated,
                    |v| parse_ports(&field, v),
                    Test::DestinationPort,
                )?,
                "source.namespace" => Self::field(
                    &mut checks,
                    values,
                    negated,
                    |v| Ok(v.iter().map(|p| Pattern::new(p)).collect()),
                    Test::Namespace,
                )?,
                _ => Self::field(
                    &mut checks,
                    values,
                    negated,
                    |v| Ok(v.iter().map(|p| Pattern::principal(p)).collect()),
                    Test::Principal,
                )?,
            }
        }
        Ok(checks)
    }

    fn rule(&mut self, i: usize, r: &RuleSpec) -> Result<Rule, String> {
        let mut rule = Rule::default();
        if let Some(from) = &r.from {
            let mut alts = Vec::new();
            for (j, entry) in from.iter().enumerate() {
                let at = format!("rules[{i}].from[{j}].source");
                let source = entry.source.clone().unwrap_or_default();
                alts.push(self.source(&at, &source)?);
            }
            rule.from = (!alts.is_empty()).then_some(alts);
        }
        if let Some(to) = &r.to {
            let mut alts = Vec::new();
            for (j, entry) in to.iter().enumerate() {
                let at = format!("rules[{i}].to[{j}].operation");
                let op = entry.operation.clone().unwrap_or_default();
                alts.push(self.operation(&at, &op)?);
            }
            rule.to = (!alts.is_empty()).then_some(alts);
        }
        for (j, c) in r.when.iter().flatten().enumerate() {
            let checks = self.condition(&format!("rules[{i}].when[{j}]"), c)?;
            rule.when.extend(checks);
        }
        Ok(rule)
    }
}

impl Policy {
    /// Compiles a policy read from the workload source.
    ///
    /// # Errors
    /// A message naming the field and the value that is wrong: no name, an unknown
    /// action, an address that is not an IP or CIDR block, a port that is not a
    /// number, a condition without values.
    pub fn compile(p: &AuthorizationPolicy) -> Result<Self, String> {
        let name = p.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err("AuthorizationPolicy has no metadata.name".into());
        }
        let namespace = p
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let who = format!("AuthorizationPolicy {namespace}/{name}");
        let spec = &p.spec;
        let mut notes = Vec::new();
        let action = match spec.action.as_deref().unwrap_or("ALLOW") {
            "ALLOW" => Action::Allow,
            "DENY" => Action::Deny,
            "AUDIT" => Action::Audit,
            "CUSTOM" => {
                notes.push("action CUSTOM: no external authorizer is asked; enforced as DENY on the layer-4 fields".to_string());
                Action::Deny
            }
            other => {
                return Err(format!(
                    "{who}: spec.action {other:?} is not one of ALLOW, DENY, AUDIT, CUSTOM"
                ));
            }
        };
        let targeted =
            spec.target_ref.is_some() || spec.target_refs.as_ref().is_some_and(|t| !t.is_empty());
        if targeted {
            notes.push("targetRef: attached to a gateway, waypoint or service, not to workloads; not enforced here".to_string());
        }
        let mut compiler = Compiler {
            widen: action != Action::Allow,
            notes,
        };
        let rules = spec
            .rules
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, r)| compiler.rule(i, r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{who}: spec.{e}"))?;
        Ok(Self {
            namespace,
            name,
            action,
            selector: spec.selector.as_ref().map(|s| s.match_labels.clone()),
            targeted,
            notes: compiler.notes,
            rules,
        })
    }

    /// The workloads the policy applies to, given the mesh's root namespace.
    pub fn scope(&self, root_namespace: &str) -> Scope {
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

    /// Whether the policy applies to a workload in `namespace` with `labels`.
    pub fn applies_to(
        &self,
        root_namespace: &str,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> bool {
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

/// The outcome of evaluating a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Why the request is denied; `None`: allowed.
    denial: Option<Denial>,
    /// AUDIT policies that matched (`namespace/name`).
    pub audited: Vec<String>,
}

/// Why a request was denied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denial {
    /// A DENY (or CUSTOM) policy matched: its `namespace/name`.
    Policy(String),
    /// ALLOW policies apply to the workload and none matched: their names.
    NoAllowMatch(Vec<String>),
    /// The policies cannot be known (a broken manifest holds some): everything is
    /// denied until it is fixed. The reason.
    Unknown(String),
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::Policy(p) => write!(f, "denied by policy {p}"),
            Denial::NoAllowMatch(ps) => {
                write!(f, "no ALLOW policy matched (policies {})", ps.join(", "))
            }
            Denial::Unknown(why) => write!(f, "authorization policies unknown: {why}"),
        }
    }
}

impl Denial {
    /// The name to count the denial under: the policy's `namespace/name`, or
    /// `allow-policies` / `unknown-policies`.
    pub fn policy(&self) -> &str {
        match self {
            Denial::Policy(p) => p,
            Denial::NoAllowMatch(_) => "allow-policies",
            Denial::Unknown(_) => "unknown-policies",
        }
    }
}

impl Decision {
    /// Whether the request may go ahead.
    pub fn allowed(&self) -> bool {
        self.denial.is_none()
    }

    /// Why it may not.
    pub fn denied_by(&self) -> Option<&Denial> {
        self.denial.as_ref()
    }
}

/// All policies of the mesh.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    /// The namespace whose policies apply mesh-wide.
    root_namespace: String,
    policies: Vec<Arc<Policy>>,
    /// Set when some policies cannot be known: every request is denied.
    unknown: Option<String>,
}

impl PolicySet {
    /// A set of `policies`, those of `root_namespace` applying mesh-wide; a second
    /// policy with the same `namespace/name` is dropped with a warning (the first,
    /// in source order, is kept).
    pub fn build(
        root_namespace: &str,
        policies: impl IntoIterator<Item = Arc<Policy>>,
    ) -> (Self, Vec<String>) {
        let mut seen = HashMap::new();
        let mut warnings = Vec::new();
        let mut set = PolicySet {
            root_namespace: root_namespace.to_string(),
            ..Default::default()
        };
        for p in policies {
            let key = p.to_string();
            if seen.insert(key.clone(), ()).is_some() {
                warnings.push(format!(
                    "AuthorizationPolicy {key} is defined more than once; the first definition is used"
                ));
                continue;
            }
            set.policies.push(p);
        }
        (set, warnings)
    }

    /// Marks the set incomplete: every request is denied, for `reason`.
    pub fn deny_all_unknown(&mut self, reason: String) {
        self.unknown = Some(reason);
    }

    /// Why every request is denied, when the policies cannot be known.
    pub fn unknown(&self) -> Option<&str> {
        self.unknown.as_deref()
    }

    /// The namespace whose policies apply mesh-wide.
    pub fn root_namespace(&self) -> &str {
        &self.root_namespace
    }

    /// The policies.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.policies.iter()
    }

    /// Decides a request to a workload in `namespace` with `labels`.
    pub fn evaluate(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        req: &Request<'_>,
    ) -> Decision {
        if let Some(why) = &self.unknown {
            return Decision {
                denial: Some(Denial::Unknown(why.clone())),
                audited: Vec::new(),
            };
        }
        let applicable = self
            .policies
            .iter()
            .filter(|p| p.applies_to(&self.root_namespace, namespace, labels));
        let mut allow_policies = Vec::new();
        let mut allowed = false;
        let mut audited = Vec::new();
        let mut denial = None;
        for p in applicable {
            match p.action {
                Action::Deny if denial.is_none() && p.matches(req) => {
                    denial = Some(Denial::Policy(p.to_string()));
                }
                Action::Allow => {
                    allow_policies.push(p.to_string());
                    allowed = allowed || p.matches(req);
                }
                Action::Audit if p.matches(req) => audited.push(p.to_string()),
                _ => {}
            }
        }
        if denial.is_none() && !allow_policies.is_empty() && !allowed {
            denial = Some(Denial::NoAllowMatch(allow_policies));
        }
        Decision { denial, audited }
    }
}

#[cfg(test)]
mod tests;
