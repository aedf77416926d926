//! Compilation of an `AuthorizationPolicy` as written ([`spec`](super::spec))
//! into a [`Policy`]: every field checked as Istio's validation checks it, and the
//! fields a layer-4 proxy cannot see handled as ztunnel does (see the module
//! documentation of [`authz`](super)).

use std::net::IpAddr;

use ipnet::IpNet;

use super::{
    Action, CompileError, FieldError, LabelProblem, Note, Policy,
    policy::{Check, Pattern, Rule, Test},
    spec::{AuthorizationPolicy, ConditionSpec, OperationSpec, PolicySpec, RuleSpec, SourceSpec},
};
use crate::k8s::names;

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
            istiod_scope: None,
            dry_run: false,
            rules,
        })
    }
}

/// What is wrong with a label `key: value` of a selector, by Kubernetes' syntax
/// ([`names::is_label_key`], [`names::is_label_value`]). Such a label matches no
/// pod, so a selector with one would select nothing.
pub(super) fn label_problem(key: &str, value: &str) -> Option<LabelProblem> {
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
