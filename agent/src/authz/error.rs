//! Why an `AuthorizationPolicy` cannot be compiled, and the warnings a set of
//! policies gives.
//!
//! The messages are those the agent logs and the manifest source reports for a
//! broken file: each names the policy, the field (its path from the object's
//! root, e.g. `spec.rules[0].from[0].source.principals`) and what is wrong with
//! it.

use thiserror::Error;

/// Why [`Policy::compile`](super::Policy::compile) refused a policy.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CompileError {
    /// `metadata.name` is absent or empty.
    #[error("AuthorizationPolicy has no metadata.name")]
    NoName,
    /// A field of the spec is wrong.
    #[error("AuthorizationPolicy {policy}: {problem}")]
    Field {
        /// The policy's `namespace/name`.
        policy: String,
        /// What is wrong, and where.
        problem: FieldError,
    },
}

/// What is wrong with one field of an `AuthorizationPolicy`'s spec. `field` is the
/// field's path from the object's root (`spec.rules[0].to[0].operation.ports`).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FieldError {
    /// `spec.action` is not one Istio defines.
    #[error("spec.action {value:?} is not one of ALLOW, DENY, AUDIT, CUSTOM")]
    UnknownAction {
        /// The action as written.
        value: String,
    },
    /// A list is present but empty: it cannot say what was meant (Istio's
    /// validation refuses it too).
    #[error("{field} is an empty list")]
    EmptyList {
        /// The list's path.
        field: String,
    },
    /// A value of a list is empty or blank.
    #[error("{field}[{index}] is empty")]
    EmptyValue {
        /// The list's path.
        field: String,
        /// The value's index in it.
        index: usize,
    },
    /// A rule is null (`- ` with nothing after it).
    #[error("{field} is empty (write {{}} for a rule that matches everything)")]
    EmptyRule {
        /// The rule's path, `spec.rules[i]`.
        field: String,
    },
    /// A condition is null.
    #[error("{field} is empty")]
    EmptyCondition {
        /// The condition's path, `spec.rules[i].when[j]`.
        field: String,
    },
    /// A `from` entry without `source`, or a `to` entry without `operation`.
    #[error("{field} is missing")]
    Missing {
        /// The missing field's path.
        field: String,
    },
    /// A source or operation sets no field (Istio refuses it).
    #[error("{field} has no fields (Istio refuses an empty {kind})")]
    NoFields {
        /// Its path.
        field: String,
        /// `source` or `operation`.
        kind: &'static str,
    },
    /// A value is neither an IP address nor a CIDR block.
    #[error("{field}: {value:?} is not an IP address or CIDR block")]
    NotAnAddress {
        /// The list's path.
        field: String,
        /// The value as written.
        value: String,
    },
    /// An IPv4-mapped IPv6 address or block: traffic is matched in its IPv4 form,
    /// so it would never match.
    #[error("{field}: {value:?} is an IPv4-mapped IPv6 address; write it as IPv4")]
    MappedAddress {
        /// The list's path.
        field: String,
        /// The value as written.
        value: String,
    },
    /// A value is not a port number (1-65535).
    #[error("{field}: {value:?} is not a port number (1-65535)")]
    NotAPort {
        /// The list's path.
        field: String,
        /// The value as written.
        value: String,
    },
    /// A value is not `[<namespace>/]<service account>`.
    #[error("{field}: {value:?} is not of the form [<namespace>/]<service account>")]
    NotAServiceAccount {
        /// The list's path.
        field: String,
        /// The value as written.
        value: String,
    },
    /// A condition's `key` is empty or blank.
    #[error("{field}: condition has an empty key")]
    EmptyConditionKey {
        /// The condition's path, `spec.rules[i].when[j]`.
        field: String,
    },
    /// A condition has neither `values` nor `notValues`.
    #[error("{field}: condition on {key:?} has neither values nor notValues")]
    ConditionWithoutValues {
        /// The condition's path, `spec.rules[i].when[j]`.
        field: String,
        /// The condition's key.
        key: String,
    },
    /// A `targetRef`/`targetRefs` entry lacks `kind` or `name`.
    #[error("spec.targetRef(s) entries need a kind and a name")]
    UnnamedTarget,
    /// Both `selector` and `targetRef`/`targetRefs` are set.
    #[error("spec.selector and spec.targetRef(s) cannot both be set")]
    SelectorAndTarget,
    /// A label of `spec.selector.matchLabels` is not valid Kubernetes syntax: it
    /// matches no pod, so the selector would select nothing.
    #[error("spec.selector.matchLabels: {0}")]
    Selector(LabelProblem),
}

/// What is wrong with a label `key: value` of a selector, by Kubernetes' syntax
/// ([`names::is_label_key`](crate::k8s::names::is_label_key),
/// [`names::is_label_value`](crate::k8s::names::is_label_value)).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LabelProblem {
    /// The key is not a valid label key.
    #[error("the label key {key:?} is not a valid label key")]
    Key {
        /// The key as written.
        key: String,
    },
    /// The value is not a valid label value.
    #[error("the value {value:?} of label {key:?} is not a valid label value")]
    Value {
        /// The label's key.
        key: String,
        /// The value as written.
        value: String,
    },
}

/// A warning about a set of policies, from [`PolicySet::build`](super::PolicySet::build).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SetWarning {
    /// Several policies share a `namespace/name`; all are enforced, since dropping
    /// one could cancel a DENY.
    #[error("AuthorizationPolicy {policy} is defined more than once; every definition is enforced")]
    Duplicate {
        /// The `namespace/name`.
        policy: String,
    },
    /// A PeerAuthentication's `namespace/name` is defined more than once; its
    /// definitions with one selector are enforced as one, the strictest mode
    /// of each level and port.
    #[error(
        "PeerAuthentication {policy} is defined more than once; the strictest mode its definitions give (for the policy and for each port) is enforced"
    )]
    MtlsDuplicate {
        /// The `namespace/name`.
        policy: String,
    },
    /// Several PeerAuthentications apply at one level (mesh-wide, to a
    /// namespace, or to the same pods); Istio enforces the oldest, podlink the
    /// first by name.
    #[error(
        "PeerAuthentications {} all apply {level}; {} is enforced, the first by name (Istio enforces the oldest; podlink does not know creation times)",
        policies.join(", "),
        policies.first().map_or("", String::as_str)
    )]
    MtlsOverlap {
        /// Where they apply: `mesh-wide`, `to namespace <ns>`, `to the same pods
        /// of this node`.
        level: String,
        /// Their `namespace/name`s, sorted.
        policies: Vec<String>,
    },
    /// A PeerAuthentication with a selector in the root namespace applies to no
    /// workload (as in Istio).
    #[error(
        "PeerAuthentication {policy} has a selector in the root namespace: as in Istio, it applies to no workload"
    )]
    MtlsRootSelector {
        /// The `namespace/name`.
        policy: String,
    },
}
