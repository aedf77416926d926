//! Evaluation: the [`PolicySet`] of the mesh decides a [`Request`] to a workload,
//! in Istio's order: plaintext refused where PeerAuthentication makes mutual
//! TLS `STRICT` (as istiod's conversion for ztunnel makes it a DENY of
//! connections without a peer identity), then DENY, then ALLOW; AUDIT
//! reported.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use super::{Action, MtlsMode, MtlsPolicies, MtlsPolicy, Policy, SetWarning};
use crate::identity::SpiffeId;

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

impl Request<'_> {
    /// The connection as access and denial logs name it: `source (identity) to
    /// destination port N`, the destination being the workload's `namespace/name`
    /// when it is known (`destination`), else its address.
    pub fn describe(&self, destination: Option<&str>) -> String {
        let source = self
            .source
            .map_or_else(|| "plaintext".to_string(), ToString::to_string);
        let destination =
            destination.map_or_else(|| self.destination_ip.to_string(), str::to_string);
        format!(
            "{} ({source}) to {destination} port {}",
            self.source_ip, self.destination_port
        )
    }
}

/// The workload a request goes to, as policies select it: an enrolled pod of
/// this node.
#[derive(Clone, Copy, Debug)]
pub struct Destination<'a> {
    /// Its namespace.
    pub namespace: &'a str,
    /// Its labels, which policies' selectors match.
    pub labels: &'a BTreeMap<String, String>,
    /// The policies istiod selected for it (`namespace/name`, workload xDS
    /// `authorization_policies`); empty without istiod.
    pub named: &'a [String],
}

/// The outcome of evaluating a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Why the request is denied; `None`: allowed.
    denial: Option<Denial>,
    /// AUDIT policies that matched (`namespace/name`).
    pub audited: Vec<String>,
    /// Dry-run policies that apply, each with the decision it would have made
    /// (`namespace/name would deny`, …): logged, not enforced.
    pub dry_run: Vec<String>,
}

/// Why a request was denied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denial {
    /// A DENY (or CUSTOM) policy matched: its `namespace/name`.
    Policy(String),
    /// ALLOW policies apply to the workload and none matched: their names.
    NoAllowMatch(Vec<String>),
    /// The policies cannot be known (a broken manifest holds some, or a
    /// policy of the workload's namespace or the root namespace cannot be
    /// compiled): denied until it is fixed. The reason.
    Unknown(String),
    /// A plaintext request (no peer identity) to a port where mutual TLS is
    /// `STRICT`: the `namespace/name` of the PeerAuthentication that set the
    /// mode (the mesh-wide one when no other sets it).
    MtlsStrict(String),
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::Policy(p) => write!(f, "denied by policy {p}"),
            Denial::NoAllowMatch(ps) => {
                write!(f, "no ALLOW policy matched (policies {})", ps.join(", "))
            }
            Denial::Unknown(why) => write!(f, "authorization policies unknown: {why}"),
            Denial::MtlsStrict(p) => write!(
                f,
                "plaintext refused: mTLS is STRICT (PeerAuthentication {p})"
            ),
        }
    }
}

impl Denial {
    /// The name to count the denial under: the AuthorizationPolicy's or
    /// PeerAuthentication's `namespace/name`, or `allow-policies` /
    /// `unknown-policies`.
    pub fn policy(&self) -> &str {
        match self {
            Denial::Policy(p) | Denial::MtlsStrict(p) => p,
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

    /// `Ok` when the request may go ahead.
    ///
    /// # Errors
    /// Why it may not.
    pub fn into_result(self) -> Result<(), Denial> {
        self.denial.map_or(Ok(()), Err)
    }
}

/// All policies of the mesh: AuthorizationPolicies and PeerAuthentications.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    /// The namespace whose policies apply mesh-wide.
    root_namespace: String,
    policies: Vec<Arc<Policy>>,
    mtls: MtlsPolicies,
    /// Set when some policies cannot be known: every request is denied.
    unknown: Option<String>,
    /// Namespaces some of whose policies cannot be known, with the reason:
    /// requests to their workloads are denied (to every workload when the
    /// root namespace is one).
    unknown_in: BTreeMap<String, String>,
}

impl PolicySet {
    /// A set of AuthorizationPolicies `policies` and PeerAuthentications
    /// `mtls`, those of `root_namespace` applying mesh-wide.
    /// AuthorizationPolicies that share a `namespace/name` are all kept, with a
    /// warning: dropping one could cancel a DENY. The PeerAuthentications'
    /// warnings are [`MtlsPolicies::build`]'s.
    pub fn build(
        root_namespace: &str,
        policies: impl IntoIterator<Item = Arc<Policy>>,
        mtls: impl IntoIterator<Item = Arc<MtlsPolicy>>,
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
        let (mtls, mtls_warnings) = MtlsPolicies::build(root_namespace, mtls);
        set.mtls = mtls;
        warnings.extend(mtls_warnings);
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

    /// Marks the policies of `namespace` unknown, for `reason` (a policy of
    /// it that cannot be compiled): requests to its workloads are denied, to
    /// every workload when it is the root namespace (its policies may apply
    /// mesh-wide).
    pub fn deny_namespace_unknown(&mut self, namespace: &str, reason: String) {
        self.unknown_in.insert(namespace.to_string(), reason);
    }

    /// The namespaces whose policies cannot be known, with the reason, by
    /// namespace ([`PolicySet::deny_namespace_unknown`]).
    pub fn unknown_namespaces(&self) -> &BTreeMap<String, String> {
        &self.unknown_in
    }

    /// Why requests to a workload of `namespace` are denied whatever the
    /// policies, if they are: the policies unknown everywhere, in the root
    /// namespace, or in `namespace`.
    pub fn unknown_for(&self, namespace: &str) -> Option<&str> {
        self.unknown
            .as_deref()
            .or_else(|| {
                self.unknown_in
                    .get(&self.root_namespace)
                    .map(String::as_str)
            })
            .or_else(|| self.unknown_in.get(namespace).map(String::as_str))
    }

    /// The namespace whose policies apply mesh-wide.
    pub fn root_namespace(&self) -> &str {
        &self.root_namespace
    }

    /// The AuthorizationPolicies.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.policies.iter()
    }

    /// The PeerAuthentications.
    pub fn mtls(&self) -> &MtlsPolicies {
        &self.mtls
    }

    /// Decides `req` by the policies that apply to `destination`, the enrolled
    /// pod of this node it goes to; `None` when the address is not one (any
    /// more), which is denied as [`Denial::Unknown`].
    pub fn decide(&self, destination: Option<Destination<'_>>, req: &Request<'_>) -> Decision {
        match destination {
            Some(d) => self.evaluate(d.namespace, d.labels, d.named, req),
            None => Decision {
                denial: Some(Denial::Unknown(format!(
                    "{} is not an enrolled pod of this node",
                    req.destination_ip
                ))),
                audited: Vec::new(),
                dry_run: Vec::new(),
            },
        }
    }

    /// Decides a request to a workload in `namespace` with `labels`: a
    /// plaintext request (`req.source` is `None`) to a port where mutual TLS is
    /// `STRICT` ([`MtlsPolicies::effective`]) is denied, before
    /// AuthorizationPolicies are (AUDIT matches are still reported). Requests
    /// with a peer identity (HBONE, or between two pods of this node) are never
    /// refused for it.
    ///
    /// `named` are the policies istiod selected for the workload
    /// ([`Destination::named`]). A dry-run policy does not change the outcome:
    /// the decision it would make is reported in [`Decision::dry_run`] (a
    /// matching DENY would deny; an ALLOW would allow when it matches, else
    /// deny).
    pub fn evaluate(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        named: &[String],
        req: &Request<'_>,
    ) -> Decision {
        if let Some(why) = self.unknown_for(namespace) {
            return Decision {
                denial: Some(Denial::Unknown(why.to_string())),
                audited: Vec::new(),
                dry_run: Vec::new(),
            };
        }
        let (dry, applicable): (Vec<&Arc<Policy>>, Vec<&Arc<Policy>>) = self
            .policies
            .iter()
            .filter(|p| p.applies_to(&self.root_namespace, namespace, labels, named))
            .partition(|p| p.dry_run);
        let dry_run = dry
            .into_iter()
            .filter_map(|p| {
                let would = match (p.action, p.matches(req)) {
                    (Action::Deny, true) => "would deny",
                    (Action::Allow, true) => "would allow",
                    (Action::Allow, false) => "would deny (no rule matches)",
                    _ => return None,
                };
                Some(format!("{p} {would}"))
            })
            .collect();
        let mut allow_policies = Vec::new();
        let mut allowed = false;
        let mut audited = Vec::new();
        let mut denial = None;
        if req.source.is_none() {
            let mtls = self.mtls.effective(namespace, labels, req.destination_port);
            if let (MtlsMode::Strict, Some(p)) = (mtls.mode, mtls.set_by) {
                denial = Some(Denial::MtlsStrict(p.to_string()));
            }
        }
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
        Decision {
            denial,
            audited,
            dry_run,
        }
    }
}

/// Connections denied so far, counted by the policy that denied them
/// ([`Denial::policy`]).
#[derive(Debug, Default)]
pub struct DenialCounts(Mutex<BTreeMap<String, u64>>);

impl DenialCounts {
    /// Counts `denial`; returns how many its policy has denied so far, this one
    /// included.
    pub fn count(&self, denial: &Denial) -> u64 {
        let mut counts = self.0.lock().expect("denials lock");
        let n = counts.entry(denial.policy().to_string()).or_default();
        *n += 1;
        *n
    }

    /// The counts, by policy (an AuthorizationPolicy's or PeerAuthentication's
    /// `namespace/name`, or `allow-policies` when no ALLOW policy matched, or
    /// `unknown-policies`), sorted by it.
    pub fn by_policy(&self) -> Vec<(String, u64)> {
        let counts = self.0.lock().expect("denials lock");
        counts.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}
