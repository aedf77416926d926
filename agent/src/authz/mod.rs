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

use crate::{identity::SpiffeId, k8s::names};
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
            let net = v
                .parse::<IpNet>()
                .or_else(|_| v.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| format!("{field}: {v:?} is not an IP address or CIDR block"))?;
            match net {
                // Traffic is matched in its IPv4 form: a mapped address would
                // never match.
                IpNet::V6(v6) if v6.addr().to_ipv4_mapped().is_some() => Err(format!(
                    "{field}: {v:?} is an IPv4-mapped IPv6 address; write it as IPv4"
                )),
                net => Ok(net),
            }
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

/// `namespace/service-account` pairs; a bare name is in the policy's namespace (as
/// istiod reads it).
fn parse_service_accounts(
    field: &str,
    values: &[String],
    namespace: &str,
) -> Result<Vec<(String, String)>, String> {
    values
        .iter()
        .map(|v| match v.split_once('/') {
            None => Ok((namespace.to_string(), v.clone())),
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                Ok((ns.to_string(), sa.to_string()))
            }
            _ => Err(format!(
                "{field}: {v:?} is not of the form [<namespace>/]<service account>"
            )),
        })
        .collect()
}

fn patterns(values: &[String]) -> Result<Vec<Pattern>, String> {
    Ok(values.iter().map(|p| Pattern::new(p)).collect())
}

fn principals(values: &[String]) -> Result<Vec<Pattern>, String> {
    Ok(values.iter().map(|p| Pattern::principal(p)).collect())
}

/// Compiles one policy. Errors name the field and value that is wrong.
struct Compiler {
    /// Request-level fields are dropped (DENY, AUDIT) instead of never matching.
    widen: bool,
    /// The policy's namespace.
    namespace: String,
    notes: Vec<String>,
}

impl Compiler {
    /// Adds a check for field `name` (at `at`) given as `values`, `negated` for
    /// the `not*` forms. An empty list or an empty value is refused, as Istio's
    /// validation refuses it: neither can say what was meant.
    fn field<T>(
        checks: &mut Vec<Check>,
        (at, name): (&str, &str),
        values: &Option<Vec<String>>,
        negated: bool,
        make: impl Fn(&str, &[String]) -> Result<T, String>,
        test: impl Fn(T) -> Test,
    ) -> Result<(), String> {
        let Some(values) = values else {
            return Ok(());
        };
        let field = format!("{at}.{name}");
        if values.is_empty() {
            return Err(format!("{field} is an empty list"));
        }
        if let Some(i) = values.iter().position(|v| v.trim().is_empty()) {
            return Err(format!("{field}[{i}] is empty"));
        }
        checks.push(Check {
            test: test(make(&field, values)?),
            negated,
        });
        Ok(())
    }

    /// Names of the fields among `fields` that are set; an empty list is refused.
    fn request_fields<'a>(
        at: &str,
        fields: &[(&Option<Vec<String>>, &'a str)],
    ) -> Result<Vec<&'a str>, String> {
        let mut set = Vec::new();
        for (values, name) in fields {
            if let Some(values) = values {
                if values.is_empty() {
                    return Err(format!("{at}.{name} is an empty list"));
                }
                set.push(*name);
            }
        }
        Ok(set)
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
        let mut c = Vec::new();
        let ns = self.namespace.clone();
        let sas = |field: &str, v: &[String]| parse_service_accounts(field, v, &ns);
        let p = |_: &str, v: &[String]| principals(v);
        let n = |_: &str, v: &[String]| patterns(v);
        Self::field(
            &mut c,
            (at, "principals"),
            &s.principals,
            false,
            p,
            Test::Principal,
        )?;
        Self::field(
            &mut c,
            (at, "notPrincipals"),
            &s.not_principals,
            true,
            p,
            Test::Principal,
        )?;
        Self::field(
            &mut c,
            (at, "namespaces"),
            &s.namespaces,
            false,
            n,
            Test::Namespace,
        )?;
        Self::field(
            &mut c,
            (at, "notNamespaces"),
            &s.not_namespaces,
            true,
            n,
            Test::Namespace,
        )?;
        Self::field(
            &mut c,
            (at, "serviceAccounts"),
            &s.service_accounts,
            false,
            sas,
            Test::ServiceAccount,
        )?;
        Self::field(
            &mut c,
            (at, "notServiceAccounts"),
            &s.not_service_accounts,
            true,
            sas,
            Test::ServiceAccount,
        )?;
        // Without X-Forwarded-For, the remote address is the connection's source.
        for (values, negated, name) in [
            (&s.ip_blocks, false, "ipBlocks"),
            (&s.not_ip_blocks, true, "notIpBlocks"),
            (&s.remote_ip_blocks, false, "remoteIpBlocks"),
            (&s.not_remote_ip_blocks, true, "notRemoteIpBlocks"),
        ] {
            Self::field(
                &mut c,
                (at, name),
                values,
                negated,
                parse_nets,
                Test::SourceIp,
            )?;
        }
        let unseen = Self::request_fields(
            at,
            &[
                (&s.request_principals, "requestPrincipals"),
                (&s.not_request_principals, "notRequestPrincipals"),
            ],
        )?;
        if c.is_empty() && unseen.is_empty() {
            return Err(format!(
                "{at} has no fields (Istio refuses an empty source)"
            ));
        }
        c.extend(self.unseen(at, &unseen));
        Ok(c)
    }

    fn operation(&mut self, at: &str, o: &OperationSpec) -> Result<Vec<Check>, String> {
        let mut c = Vec::new();
        Self::field(
            &mut c,
            (at, "ports"),
            &o.ports,
            false,
            parse_ports,
            Test::DestinationPort,
        )?;
        Self::field(
            &mut c,
            (at, "notPorts"),
            &o.not_ports,
            true,
            parse_ports,
            Test::DestinationPort,
        )?;
        let unseen = Self::request_fields(
            at,
            &[
                (&o.hosts, "hosts"),
                (&o.not_hosts, "notHosts"),
                (&o.methods, "methods"),
                (&o.not_methods, "notMethods"),
                (&o.paths, "paths"),
                (&o.not_paths, "notPaths"),
            ],
        )?;
        if c.is_empty() && unseen.is_empty() {
            return Err(format!(
                "{at} has no fields (Istio refuses an empty operation)"
            ));
        }
        c.extend(self.unseen(at, &unseen));
        Ok(c)
    }

    fn condition(&mut self, at: &str, cond: &ConditionSpec) -> Result<Vec<Check>, String> {
        let key = cond.key.as_str();
        if key.trim().is_empty() {
            return Err(format!("{at}: condition has an empty key"));
        }
        if cond.values.is_none() && cond.not_values.is_none() {
            return Err(format!(
                "{at}: condition on {key:?} has neither values nor notValues"
            ));
        }
        let mut c = Vec::new();
        for (values, negated, name) in [
            (&cond.values, false, "values"),
            (&cond.not_values, true, "notValues"),
        ] {
            let f = (at, name);
            match key {
                "source.ip" | "remote.ip" => {
                    Self::field(&mut c, f, values, negated, parse_nets, Test::SourceIp)?
                }
                "destination.ip" => {
                    Self::field(&mut c, f, values, negated, parse_nets, Test::DestinationIp)?
                }
                "destination.port" => Self::field(
                    &mut c,
                    f,
                    values,
                    negated,
                    parse_ports,
                    Test::DestinationPort,
                )?,
                "source.namespace" => Self::field(
                    &mut c,
                    f,
                    values,
                    negated,
                    |_, v| patterns(v),
                    Test::Namespace,
                )?,
                "source.principal" => Self::field(
                    &mut c,
                    f,
                    values,
                    negated,
                    |_, v| principals(v),
                    Test::Principal,
                )?,
                _ => {
                    Self::request_fields(at, &[(values, name)])?;
                }
            }
        }
        if !L4_KEYS.contains(&key) {
            return Ok(self
                .unseen(&format!("{at} (key {key})"), &[key])
                .into_iter()
                .collect());
        }
        Ok(c)
    }

    fn rule(&mut self, i: usize, r: &RuleSpec) -> Result<Rule, String> {
        let mut rule = Rule::default();
        if let Some(from) = &r.from {
            if from.is_empty() {
                return Err(format!("rules[{i}].from is an empty list"));
            }
            let mut alts = Vec::new();
            for (j, entry) in from.iter().enumerate() {
                let at = format!("rules[{i}].from[{j}].source");
                let source = entry
                    .as_ref()
                    .and_then(|e| e.source.as_ref())
                    .ok_or_else(|| format!("{at} is missing"))?;
                alts.push(self.source(&at, source)?);
            }
            rule.from = Some(alts);
        }
        if let Some(to) = &r.to {
            if to.is_empty() {
                return Err(format!("rules[{i}].to is an empty list"));
            }
            let mut alts = Vec::new();
            for (j, entry) in to.iter().enumerate() {
                let at = format!("rules[{i}].to[{j}].operation");
                let op = entry
                    .as_ref()
                    .and_then(|e| e.operation.as_ref())
                    .ok_or_else(|| format!("{at} is missing"))?;
                alts.push(self.operation(&at, op)?);
            }
            rule.to = Some(alts);
        }
        for (j, c) in r.when.iter().flatten().enumerate() {
            let at = format!("rules[{i}].when[{j}]");
            let c = c.as_ref().ok_or_else(|| format!("{at} is empty"))?;
            let checks = self.condition(&at, c)?;
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
        let namespace = p.metadata.namespace_or_default().to_string();
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
        let target_refs: Vec<&serde_yaml_ng::Value> = spec
            .target_ref
            .iter()
            .chain(spec.target_refs.iter().flatten())
            .collect();
        if spec.target_refs.as_ref().is_some_and(Vec::is_empty) {
            return Err(format!("{who}: spec.targetRefs is an empty list"));
        }
        for r in &target_refs {
            let named = |key: &str| {
                r.get(key)
                    .and_then(serde_yaml_ng::Value::as_str)
                    .is_some_and(|v| !v.is_empty())
            };
            if !named("kind") || !named("name") {
                return Err(format!(
                    "{who}: spec.targetRef(s) entries need a kind and a name"
                ));
            }
        }
        for (key, value) in spec.selector.iter().flat_map(|s| &s.match_labels) {
            if let Some(problem) = label_problem(key, value) {
                return Err(format!("{who}: spec.selector.matchLabels: {problem}"));
            }
        }
        let targeted = !target_refs.is_empty();
        if targeted && spec.selector.is_some() {
            return Err(format!(
                "{who}: spec.selector and spec.targetRef(s) cannot both be set"
            ));
        }
        if targeted {
            notes.push("targetRef: attached to a gateway, waypoint or service, not to workloads; not enforced here".to_string());
        }
        let mut compiler = Compiler {
            widen: action != Action::Allow,
            namespace: namespace.clone(),
            notes,
        };
        let rules = spec
            .rules
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, r)| match r {
                Some(r) => compiler.rule(i, r),
                None => Err(format!(
                    "rules[{i}] is empty (write {{}} for a rule that matches everything)"
                )),
            })
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
    /// A set of `policies`, those of `root_namespace` applying mesh-wide. Policies
    /// that share a `namespace/name` are all kept, with a warning: dropping one
    /// could cancel a DENY.
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
                // Dropping either could cancel a DENY: both are enforced.
                warnings.push(format!(
                    "AuthorizationPolicy {key} is defined more than once; every definition is enforced"
                ));
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

/// What is wrong with a label `key: value` of a selector, by Kubernetes' syntax
/// ([`names::is_label_key`], [`names::is_label_value`]). Such a label matches no
/// pod, so a selector with one would select nothing.
fn label_problem(key: &str, value: &str) -> Option<String> {
    if !names::is_label_key(key) {
        return Some(format!("the label key {key:?} is not a valid label key"));
    }
    if !names::is_label_value(value) {
        return Some(format!(
            "the value {value:?} of label {key:?} is not a valid label value"
        ));
    }
    None
}
