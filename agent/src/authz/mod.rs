//! Layer-4 authorization with Istio `AuthorizationPolicy`, and the refusal of
//! plaintext where Istio `PeerAuthentication` makes mutual TLS `STRICT`
//! ([`MtlsPolicies`]; its semantics are in `mtls`).
//!
//! Policies are read from the workload source ([`spec`] has the resource as
//! written), compiled into [`Policy`] once, and evaluated by the proxy for every
//! inbound connection (HBONE stream, plaintext connection, or a connection between
//! two pods of this node) with [`PolicySet::decide`]; [`DenialCounts`] counts the
//! denials by policy. A plaintext connection (no peer identity) to a port where
//! the PeerAuthentication in effect is `STRICT` is denied first
//! ([`Denial::MtlsStrict`]).
//!
//! The compiled model is in `policy`, its compilation from the resource in
//! `compile` (errors in `error`), and evaluation in `evaluate`.
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

mod compile;
mod error;
mod evaluate;
mod mtls;
mod policy;
pub mod spec;
mod xds;

pub use xds::from_istiod;

pub use error::{CompileError, FieldError, LabelProblem, SetWarning};
pub use evaluate::{Decision, Denial, DenialCounts, Destination, PolicySet, Request};
pub use mtls::{EffectiveMtls, MtlsError, MtlsMode, MtlsPolicies, MtlsPolicy, MtlsScope};
pub use policy::{Action, IstiodScope, Note, Policy, Scope};

/// Istio's default root namespace: policies there apply mesh-wide.
pub const DEFAULT_ROOT_NAMESPACE: &str = "istio-system";

#[cfg(test)]
mod mtls_tests;
#[cfg(test)]
mod tests;
