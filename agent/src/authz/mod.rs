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

mod error;
pub mod spec;

pub use error::{CompileError, FieldError, LabelProblem, SetWarning};

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use serde::Serialize;

use crate::{identity::SpiffeId, k8s::names};
use spec::{AuthorizationPolicy, ConditionSpec, OperationSpec, PolicySpec, RuleSpec, SourceSpec};

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
    pub notes: Vec<Note>,
    #[serde(skip)]
    rules: Vec<Rule>,
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

/// Keys of `when` conditions a layer-4 proxy can evaluate.
const L4_KEYS: [&str; 6] = [
    "source.ip",
    "remote.ip",
    "source.namespace",
    "source.principal",
    "destination.ip",
    "destination.port",
];

/// The path of `at` (a path inside `spec`) from the object's root, as errors name
/// fields.
fn spec_path(at: &str) -> String {
    format!("spec.{at}")
}

fn parse_nets(field: &str, values: &[String]) -> Result<Vec<IpNet>, FieldError> {
    values
        .iter()
        .map(|v| {
            let net = v
                .parse::<IpNet>()
                .or_else(|_| v.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| FieldError::NotAnAddress {
                    field: field.to_string(),
                    value: v.clone(),
                })?;
            match net {
                // Traffic is matched in its IPv4 form: a mapped address would
                // never match.
                IpNet::V6(v6) if v6.addr().to_ipv4_mapped().is_some() => {
                    Err(FieldError::MappedAddress {
                        field: field.to_string(),
                        value: v.clone(),
                    })
                }
                net => Ok(net),
            }
        })
        .collect()
}

fn parse_ports(field: &str, values: &[String]) -> Result<Vec<u16>, FieldError> {
    values
        .iter()
        .map(|v| match v.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(FieldError::NotAPort {
                field: field.to_string(),
                value: v.clone(),
            }),
        })
        .collect()
}

/// `namespace/service-account` pairs; a bare name is in the policy's namespace (as
/// istiod reads it).
fn parse_service_accounts(
    field: &str,
    values: &[String],
    namespace: &str,
) -> Result<Vec<(String, String)>, FieldError> {
    values
        .iter()
        .map(|v| match v.split_once('/') {
            None => Ok((namespace.to_string(), v.clone())),
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                Ok((ns.to_string(), sa.to_string()))
            }
            _ => Err(FieldError::NotAServiceAccount {
                field: field.to_string(),
                value: v.clone(),
            }),
        })
        .collect()
}

fn patterns(_field: &str, values: &[String]) -> Result<Vec<Pattern>, FieldError> {
    Ok(values.iter().map(|p| Pattern::new(p)).collect())
}

fn principals(_field: &str, values: &[String]) -> Result<Vec<Pattern>, FieldError> {
    Ok(values.iter().map(|p| Pattern::principal(p)).collect())
}

/// Compiles one policy. Errors name the field and value that is wrong.
struct Compiler {
    /// Request-level fields are dropped (DENY, AUDIT) instead of never matching.
    widen: bool,
    /// The policy's namespace.
    namespace: String,
    notes: Vec<Note>,
}

impl Compiler {
    /// Adds a check for field `name` (at `at`, a path inside `spec`) given as
    /// `values`, `negated` for the `not*` forms. An empty list or an empty value
    /// is refused, as Istio's validation refuses it: neither can say what was
    /// meant.
    fn field<T>(
        checks: &mut Vec<Check>,
        (at, name): (&str, &str),
        values: &Option<Vec<String>>,
        negated: bool,
        make: impl Fn(&str, &[String]) -> Result<T, FieldError>,
        test: impl Fn(T) -> Test,
    ) -> Result<(), FieldError> {
        let Some(values) = values else {
            return Ok(());
        };
        let field = spec_path(&format!("{at}.{name}"));
        if values.is_empty() {
            return Err(FieldError::EmptyList { field });
        }
        if let Some(index) = values.iter().position(|v| v.trim().is_empty()) {
            return Err(FieldError::EmptyValue { field, index });
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
    ) -> Result<Vec<&'a str>, FieldError> {
        let mut set = Vec::new();
        for (values, name) in fields {
            if let Some(values) = values {
                if values.is_empty() {
                    return Err(FieldError::EmptyList {
                        field: spec_path(&format!("{at}.{name}")),
                    });
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
        self.notes.push(Note::Unseen {
            at: at.to_string(),
            fields: fields.join(", "),
            widened: self.widen,
        });
        (!self.widen).then_some(Check {
            test: Test::Never,
            negated: false,
        })
    }

    fn source(&mut self, at: &str, s: &SourceSpec) -> Result<Vec<Check>, FieldError> {
        let mut c = Vec::new();
        let ns = self.namespace.clone();
        let sas = |field: &str, v: &[String]| parse_service_accounts(field, v, &ns);
        Self::field(
            &mut c,
            (at, "principals"),
            &s.principals,
            false,
            principals,
            Test::Principal,
        )?;
        Self::field(
            &mut c,
            (at, "notPrincipals"),
            &s.not_principals,
            true,
            principals,
            Test::Principal,
        )?;
        Self::field(
            &mut c,
            (at, "namespaces"),
            &s.namespaces,
            false,
            patterns,
            Test::Namespace,
        )?;
        Self::field(
            &mut c,
            (at, "notNamespaces"),
            &s.not_namespaces,
            true,
            patterns,
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
            return Err(FieldError::NoFields {
                field: spec_path(at),
                kind: "source",
            });
        }
        c.extend(self.unseen(at, &unseen));
        Ok(c)
    }

    fn operation(&mut self, at: &str, o: &OperationSpec) -> Result<Vec<Check>, FieldError> {
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
            return Err(FieldError::NoFields {
                field: spec_path(at),
                kind: "operation",
            });
        }
        c.extend(self.unseen(at, &unseen));
        Ok(c)
    }

    fn condition(&mut self, at: &str, cond: &ConditionSpec) -> Result<Vec<Check>, FieldError> {
        let key = cond.key.as_str();
        if key.trim().is_empty() {
            return Err(FieldError::EmptyConditionKey {
                field: spec_path(at),
            });
        }
        if cond.values.is_none() && cond.not_values.is_none() {
            return Err(FieldError::ConditionWithoutValues {
                field: spec_path(at),
                key: key.to_string(),
            });
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
                "source.namespace" => {
                    Self::field(&mut c, f, values, negated, patterns, Test::Namespace)?
                }
                "source.principal" => {
                    Self::field(&mut c, f, values, negated, principals, Test::Principal)?
                }
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

    fn rule(&mut self, i: usize, r: &RuleSpec) -> Result<Rule, FieldError> {
        let mut rule = Rule::default();
        if let Some(from) = &r.from {
            if from.is_empty() {
                return Err(FieldError::EmptyList {
                    field: spec_path(&format!("rules[{i}].from")),
                });
            }
            let mut alts = Vec::new();
            for (j, entry) in from.iter().enumerate() {
                let at = format!("rules[{i}].from[{j}].source");
                let source = entry
                    .as_ref()
                    .and_then(|e| e.source.as_ref())
                    .ok_or_else(|| FieldError::Missing {
                        field: spec_path(&at),
                    })?;
                alts.push(self.source(&at, source)?);
            }
            rule.from = Some(alts);
        }
        if let Some(to) = &r.to {
            if to.is_empty() {
                return Err(FieldError::EmptyList {
                    field: spec_path(&format!("rules[{i}].to")),
                });
            }
            let mut alts = Vec::new();
            for (j, entry) in to.iter().enumerate() {
                let at = format!("rules[{i}].to[{j}].operation");
                let op = entry
                    .as_ref()
                    .and_then(|e| e.operation.as_ref())
                    .ok_or_else(|| FieldError::Missing {
                        field: spec_path(&at),
                    })?;
                alts.push(self.operation(&at, op)?);
            }
            rule.to = Some(alts);
        }
        for (j, c) in r.when.iter().flatten().enumerate() {
            let at = format!("rules[{i}].when[{j}]");
            let c = c.as_ref().ok_or_else(|| FieldError::EmptyCondition {
                field: spec_path(&at),
            })?;
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
    /// [`CompileError::NoName`] without a name; otherwise
    /// [`CompileError::Field`], naming the field and the value that is wrong: an
    /// unknown action, an address that is not an IP or CIDR block, a port that is
    /// not a number, a condition without values, an empty list, and so on.
    pub fn compile(p: &AuthorizationPolicy) -> Result<Self, CompileError> {
        let name = p.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err(CompileError::NoName);
        }
        let namespace = p.metadata.namespace_or_default().to_string();
        Self::compile_spec(namespace.clone(), name.clone(), &p.spec).map_err(|problem| {
            CompileError::Field {
                policy: format!("{namespace}/{name}"),
                problem,
            }
        })
    }

    /// [`Policy::compile`] once the policy is named.
    fn compile_spec(
        namespace: String,
        name: String,
        spec: &PolicySpec,
    ) -> Result<Self, FieldError> {
        let mut notes = Vec::new();
        let action = match spec.action.as_deref().unwrap_or("ALLOW") {
            "ALLOW" => Action::Allow,
            "DENY" => Action::Deny,
            "AUDIT" => Action::Audit,
            "CUSTOM" => {
                notes.push(Note::Custom);
                Action::Deny
            }
            other => {
                return Err(FieldError::UnknownAction {
                    value: other.to_string(),
                });
            }
        };
        let target_refs: Vec<&serde_yaml_ng::Value> = spec
            .target_ref
            .iter()
            .chain(spec.target_refs.iter().flatten())
            .collect();
        if spec.target_refs.as_ref().is_some_and(Vec::is_empty) {
            return Err(FieldError::EmptyList {
                field: "spec.targetRefs".to_string(),
            });
        }
        for r in &target_refs {
            let named = |key: &str| {
                r.get(key)
                    .and_then(serde_yaml_ng::Value::as_str)
                    .is_some_and(|v| !v.is_empty())
            };
            if !named("kind") || !named("name") {
                return Err(FieldError::UnnamedTarget);
            }
        }
        for (key, value) in spec.selector.iter().flat_map(|s| &s.match_labels) {
            if let Some(problem) = label_problem(key, value) {
                return Err(FieldError::Selector(problem));
            }
        }
        let targeted = !target_refs.is_empty();
        if targeted && spec.selector.is_some() {
            return Err(FieldError::SelectorAndTarget);
        }
        if targeted {
            notes.push(Note::Targeted);
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
                None => Err(FieldError::EmptyRule {
                    field: spec_path(&format!("rules[{i}]")),
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
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
    ) -> (Self, Vec<SetWarning>) {
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
                warnings.push(SetWarning::Duplicate { policy: key });
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
fn label_problem(key: &str, value: &str) -> Option<LabelProblem> {
    if !names::is_label_key(key) {
        return Some(LabelProblem::Key {
            key: key.to_string(),
        });
    }
    if !names::is_label_value(value) {
        return Some(LabelProblem::Value {
            key: key.to_string(),
            value: value.to_string(),
        });
    }
    None
}
