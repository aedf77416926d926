//! Policies as istiod sends them: workload xDS `istio.security.Authorization`
//! (Istio's `pkg/workloadapi/security/authorization.proto`, as ztunnel reads
//! it in `src/rbac.rs`), compiled into the same [`Policy`] as an
//! AuthorizationPolicy object.
//!
//! istiod has already reduced the AuthorizationPolicy to layer 4: a policy has
//! rules (any matches), a rule has clauses (all must match), a clause has
//! matches (any), and a match has fields (all set ones must match; within one,
//! any value; a `not_` field, none). A rule without clauses matches every
//! request; a policy without rules matches none. Scope (`GLOBAL`,
//! `NAMESPACE`, `WORKLOAD_SELECTOR`) replaces the selector: a selected policy
//! applies to the workloads that list it ([`IstiodScope`]).
//!
//! What podlink does not know is handled so that it denies rather than
//! allows: an action it does not know is enforced as DENY; a string match of
//! a kind it does not know makes its entry never match in an ALLOW policy and
//! is left out of a DENY one ([`Note::Unknown`]). A scope it does not know, or
//! an address that is not one, refuses the resource (the caller NACKs it and
//! denies the policy's namespace meanwhile).

use ipnet::IpNet;
use std::net::IpAddr;

use super::{
    Action, IstiodScope, Note, Policy,
    policy::{Check, Pattern, Rule, Test},
};
use crate::xds::proto::security::{
    self as xds, Authorization, StringMatch, string_match::MatchType,
};

/// Compiles a policy istiod sent.
///
/// # Errors
/// Why the resource is refused: no name or namespace, a scope podlink does
/// not know, an address that is neither 4 nor 16 bytes or a prefix longer than
/// its address, a port above 65535.
pub fn from_istiod(a: &Authorization) -> Result<Policy, String> {
    if a.name.is_empty() || a.namespace.is_empty() {
        return Err("name and namespace must be set".to_string());
    }
    let scope = match xds::Scope::try_from(a.scope) {
        Ok(xds::Scope::Global) => IstiodScope::Global,
        Ok(xds::Scope::Namespace) => IstiodScope::Namespace,
        Ok(xds::Scope::WorkloadSelector) => IstiodScope::WorkloadSelector,
        Err(_) => return Err(format!("scope {} is not known to podlink", a.scope)),
    };
    let mut notes = Vec::new();
    let action = match xds::Action::try_from(a.action) {
        Ok(xds::Action::Allow) => Action::Allow,
        Ok(xds::Action::Deny) => Action::Deny,
        Err(_) => {
            notes.push(Note::Unknown {
                at: "action".to_string(),
                what: format!("action {}", a.action),
                widened: true,
            });
            Action::Deny
        }
    };
    let widen = action != Action::Allow;
    let mut rules = Vec::with_capacity(a.rules.len());
    for (r, rule) in a.rules.iter().enumerate() {
        let mut also = Vec::with_capacity(rule.clauses.len());
        for (c, clause) in rule.clauses.iter().enumerate() {
            let mut alternatives = Vec::with_capacity(clause.matches.len());
            for (m, matched) in clause.matches.iter().enumerate() {
                let at = format!("rules[{r}].clauses[{c}].matches[{m}]");
                alternatives.push(checks(&at, matched, widen, &mut notes)?);
            }
            also.push(alternatives);
        }
        rules.push(Rule {
            also,
            ..Rule::default()
        });
    }
    Ok(Policy {
        namespace: a.namespace.clone(),
        name: a.name.clone(),
        action,
        selector: None,
        targeted: false,
        notes,
        istiod_scope: Some(scope),
        dry_run: a.dry_run,
        rules,
    })
}

/// The checks of one match, all of which must hold.
fn checks(
    at: &str,
    m: &xds::Match,
    widen: bool,
    notes: &mut Vec<Note>,
) -> Result<Vec<Check>, String> {
    let mut checks = Vec::new();
    let mut push = |test: Test, negated: bool| checks.push(Check { test, negated });
    let mut strings = |field: &str, values: &[StringMatch], principal: bool| {
        let mut patterns = Vec::with_capacity(values.len());
        let mut unknown = false;
        for (i, v) in values.iter().enumerate() {
            match pattern(v, principal) {
                Some(p) => patterns.push(p),
                None => {
                    unknown = true;
                    notes.push(Note::Unknown {
                        at: format!("{at}.{field}[{i}]"),
                        what:
                            "a string match of another kind than exact, prefix, suffix or presence"
                                .to_string(),
                        widened: widen,
                    });
                }
            }
        }
        (patterns, unknown)
    };
    let mut never = false;
    for (field, values, negated, principal) in [
        ("namespaces", &m.namespaces, false, false),
        ("not_namespaces", &m.not_namespaces, true, false),
        ("principals", &m.principals, false, true),
        ("not_principals", &m.not_principals, true, true),
    ] {
        if values.is_empty() {
            continue;
        }
        let (patterns, unknown) = strings(field, values, principal);
        // An ALLOW entry with a value podlink cannot evaluate never matches; a
        // DENY one is kept on the values it can.
        never |= unknown && !widen;
        if !patterns.is_empty() {
            push(
                if principal {
                    Test::Principal(patterns)
                } else {
                    Test::Namespace(patterns)
                },
                negated,
            );
        }
    }
    for (values, negated) in [
        (&m.service_accounts, false),
        (&m.not_service_accounts, true),
    ] {
        if !values.is_empty() {
            let pairs = values
                .iter()
                .map(|sa| (sa.namespace.clone(), sa.service_account.clone()))
                .collect();
            push(Test::ServiceAccount(pairs), negated);
        }
    }
    for (field, values, negated, source) in [
        ("source_ips", &m.source_ips, false, true),
        ("not_source_ips", &m.not_source_ips, true, true),
        ("destination_ips", &m.destination_ips, false, false),
        ("not_destination_ips", &m.not_destination_ips, true, false),
    ] {
        if values.is_empty() {
            continue;
        }
        let nets = values
            .iter()
            .enumerate()
            .map(|(i, a)| net(a).map_err(|why| format!("{at}.{field}[{i}]: {why}")))
            .collect::<Result<Vec<_>, _>>()?;
        push(
            if source {
                Test::SourceIp(nets)
            } else {
                Test::DestinationIp(nets)
            },
            negated,
        );
    }
    for (field, values, negated) in [
        ("destination_ports", &m.destination_ports, false),
        ("not_destination_ports", &m.not_destination_ports, true),
    ] {
        if values.is_empty() {
            continue;
        }
        let ports = values
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                u16::try_from(p).map_err(|_| format!("{at}.{field}[{i}]: port {p} is above 65535"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        push(Test::DestinationPort(ports), negated);
    }
    if never {
        checks.push(Check {
            test: Test::Never,
            negated: false,
        });
    }
    Ok(checks)
}

/// The pattern of a string match; `None` for a kind podlink does not know
/// (no `match_type`, as a newer Istio's kind decodes). Principals are written
/// `<trust domain>/ns/<namespace>/sa/<service account>`; a `spiffe://` prefix
/// is dropped.
fn pattern(m: &StringMatch, principal: bool) -> Option<Pattern> {
    let strip = |s: &str| {
        if principal {
            s.strip_prefix("spiffe://").unwrap_or(s).to_string()
        } else {
            s.to_string()
        }
    };
    Some(match m.match_type.as_ref()? {
        MatchType::Exact(s) => Pattern::Exact(strip(s)),
        MatchType::Prefix(s) => Pattern::Prefix(strip(s)),
        MatchType::Suffix(s) => Pattern::Suffix(s.clone()),
        MatchType::Presence(_) => Pattern::Present,
    })
}

/// An address and prefix length (`length` 0: the whole address, as istiod
/// sends single addresses).
fn net(a: &xds::Address) -> Result<IpNet, String> {
    let ip = match a.address.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(a.address.as_slice()).expect("4 bytes")),
        16 => IpAddr::from(<[u8; 16]>::try_from(a.address.as_slice()).expect("16 bytes")),
        n => return Err(format!("an address of {n} bytes (4 or 16 expected)")),
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let len = if a.length == 0 { max } else { a.length };
    let len = u8::try_from(len)
        .ok()
        .filter(|l| u32::from(*l) <= max)
        .ok_or_else(|| {
            format!(
                "prefix length {} is longer than the address ({max})",
                a.length
            )
        })?;
    Ok(IpNet::new(ip, len).expect("length checked").trunc())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{authz::Request, identity::SpiffeId};
    use xds::{Address, Clause, Match, Rule as XdsRule, ServiceAccountMatch};

    fn exact(s: &str) -> StringMatch {
        StringMatch {
            match_type: Some(MatchType::Exact(s.to_string())),
        }
    }

    fn policy(action: xds::Action, scope: xds::Scope, rules: Vec<XdsRule>) -> Authorization {
        Authorization {
            name: "p".to_string(),
            namespace: "shop".to_string(),
            scope: scope as i32,
            action: action as i32,
            rules,
            ..Default::default()
        }
    }

    fn rule(clauses: Vec<Vec<Match>>) -> XdsRule {
        XdsRule {
            clauses: clauses
                .into_iter()
                .map(|matches| Clause { matches })
                .collect(),
        }
    }

    fn request<'a>(source: Option<&'a SpiffeId>, port: u16) -> Request<'a> {
        Request {
            source_ip: "10.0.0.1".parse().unwrap(),
            source,
            destination_ip: "10.0.0.2".parse().unwrap(),
            destination_port: port,
        }
    }

    /// Clauses are all needed, matches within a clause any; a not_ field
    /// matches when none of its values does.
    #[test]
    fn clauses_and_matches_combine_as_istio_says() {
        let front = SpiffeId::new("cluster.local", "web", "front");
        let other = SpiffeId::new("cluster.local", "web", "other");
        let p = from_istiod(&policy(
            xds::Action::Allow,
            xds::Scope::Namespace,
            vec![rule(vec![
                vec![
                    Match {
                        principals: vec![exact("spiffe://cluster.local/ns/web/sa/front")],
                        ..Default::default()
                    },
                    Match {
                        service_accounts: vec![ServiceAccountMatch {
                            namespace: "web".to_string(),
                            service_account: "batch".to_string(),
                        }],
                        ..Default::default()
                    },
                ],
                vec![Match {
                    destination_ports: vec![8080],
                    ..Default::default()
                }],
            ])],
        ))
        .unwrap();
        assert!(p.matches(&request(Some(&front), 8080)));
        assert!(!p.matches(&request(Some(&front), 9090)));
        assert!(!p.matches(&request(Some(&other), 8080)));
        assert!(!p.matches(&request(None, 8080)));
        let batch = SpiffeId::new("cluster.local", "web", "batch");
        assert!(p.matches(&request(Some(&batch), 8080)));

        let deny = from_istiod(&policy(
            xds::Action::Deny,
            xds::Scope::Global,
            vec![rule(vec![vec![Match {
                not_source_ips: vec![Address {
                    address: vec![10, 0, 0, 0],
                    length: 8,
                }],
                ..Default::default()
            }]])],
        ))
        .unwrap();
        assert_eq!(deny.action, Action::Deny);
        assert!(!deny.matches(&request(None, 80)), "10.0.0.1 is in 10/8");
        // A rule without clauses matches everything; a policy without rules
        // nothing.
        let all = from_istiod(&policy(
            xds::Action::Deny,
            xds::Scope::Global,
            vec![rule(vec![])],
        ))
        .unwrap();
        assert!(all.matches(&request(None, 1)));
        let none = from_istiod(&policy(xds::Action::Allow, xds::Scope::Global, vec![])).unwrap();
        assert!(!none.matches(&request(None, 1)));
    }

    /// Scopes decide which workloads a policy applies to.
    #[test]
    fn scopes_select_as_istiod_means() {
        let labels = Default::default();
        let global = from_istiod(&policy(xds::Action::Deny, xds::Scope::Global, vec![])).unwrap();
        assert!(global.applies_to("istio-system", "anything", &labels, &[]));
        let ns = from_istiod(&policy(xds::Action::Deny, xds::Scope::Namespace, vec![])).unwrap();
        assert!(ns.applies_to("istio-system", "shop", &labels, &[]));
        assert!(!ns.applies_to("istio-system", "web", &labels, &[]));
        let selected = from_istiod(&policy(
            xds::Action::Deny,
            xds::Scope::WorkloadSelector,
            vec![],
        ))
        .unwrap();
        assert!(!selected.applies_to("istio-system", "shop", &labels, &[]));
        assert!(selected.applies_to("istio-system", "shop", &labels, &["shop/p".to_string()]));
        assert!(!selected.applies_to("istio-system", "shop", &labels, &["web/p".to_string()]));
    }

    /// What podlink does not know denies rather than allows.
    #[test]
    fn unknown_values_deny_rather_than_allow() {
        let mut a = policy(xds::Action::Allow, xds::Scope::Global, vec![]);
        a.action = 7;
        let p = from_istiod(&a).unwrap();
        assert_eq!(p.action, Action::Deny);
        assert!(p.notes[0].to_string().contains("action 7 is not known"));

        let unknown_kind = StringMatch { match_type: None };
        let who = SpiffeId::new("cluster.local", "web", "front");
        let m = Match {
            principals: vec![unknown_kind],
            destination_ports: vec![80],
            ..Default::default()
        };
        let allow = from_istiod(&policy(
            xds::Action::Allow,
            xds::Scope::Global,
            vec![rule(vec![vec![m.clone()]])],
        ))
        .unwrap();
        assert!(!allow.matches(&request(Some(&who), 80)), "allows less");
        let deny = from_istiod(&policy(
            xds::Action::Deny,
            xds::Scope::Global,
            vec![rule(vec![vec![m]])],
        ))
        .unwrap();
        assert!(deny.matches(&request(Some(&who), 80)), "denies more");
        assert!(deny.notes[0].to_string().contains("principals[0]"));

        let mut a = policy(xds::Action::Allow, xds::Scope::Global, vec![]);
        a.scope = 9;
        assert_eq!(
            from_istiod(&a).unwrap_err(),
            "scope 9 is not known to podlink"
        );
        let bad = from_istiod(&policy(
            xds::Action::Deny,
            xds::Scope::Global,
            vec![rule(vec![vec![Match {
                source_ips: vec![Address {
                    address: vec![1, 2, 3],
                    length: 0,
                }],
                ..Default::default()
            }]])],
        ))
        .unwrap_err();
        assert_eq!(
            bad,
            "rules[0].clauses[0].matches[0].source_ips[0]: an address of 3 bytes (4 or 16 expected)"
        );
    }
}
