//! The `AuthorizationPolicy` resource as written (`security.istio.io/v1`, the same
//! schema as `v1beta1`), field for field.
//!
//! Source: Istio reference, "Configuration" → "Security" → "Authorization Policy"
//! (<https://istio.io/latest/docs/reference/config/security/authorization-policy/>).
//! Unknown fields are refused: a misspelt field that was silently ignored would
//! widen a rule.

use std::collections::BTreeMap;

use crate::k8s::ObjectMeta;
use serde::Deserialize;

/// An `AuthorizationPolicy` object: metadata and spec.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct AuthorizationPolicy {
    /// `metadata` (name and namespace are used).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `spec`; absent means `{}` (for ALLOW: allow nothing).
    #[serde(default)]
    pub spec: PolicySpec,
}

/// `spec` of an AuthorizationPolicy.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicySpec {
    /// `selector.matchLabels`: the workloads of the namespace it applies to.
    pub selector: Option<Selector>,
    /// A gateway, waypoint or service the policy is attached to instead of workloads.
    pub target_ref: Option<serde_yaml_ng::Value>,
    /// As `targetRef`, several.
    pub target_refs: Option<Vec<serde_yaml_ng::Value>>,
    /// `ALLOW` (default), `DENY`, `AUDIT` or `CUSTOM`.
    pub action: Option<String>,
    /// The external authorizer of a `CUSTOM` policy.
    pub provider: Option<serde_yaml_ng::Value>,
    /// Rules; a request matches the policy when it matches any rule. A null item
    /// (`- ` with nothing after it) is kept as `None` so it can be refused.
    pub rules: Option<Vec<Option<RuleSpec>>>,
}

/// `spec.selector`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Selector {
    /// Labels a workload must all carry.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One rule: `from`, `to` and `when` must all match.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleSpec {
    /// Sources; any one matching suffices. Absent: any source.
    pub from: Option<Vec<Option<FromSpec>>>,
    /// Operations; any one matching suffices. Absent: any operation.
    pub to: Option<Vec<Option<ToSpec>>>,
    /// Conditions; all must match.
    pub when: Option<Vec<Option<ConditionSpec>>>,
}

/// `rules[].from[]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FromSpec {
    /// The source's attributes.
    pub source: Option<SourceSpec>,
}

/// `rules[].from[].source`: every field set must match.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(missing_docs)]
pub struct SourceSpec {
    pub principals: Option<Vec<String>>,
    pub not_principals: Option<Vec<String>>,
    pub request_principals: Option<Vec<String>>,
    pub not_request_principals: Option<Vec<String>>,
    pub namespaces: Option<Vec<String>>,
    pub not_namespaces: Option<Vec<String>>,
    pub service_accounts: Option<Vec<String>>,
    pub not_service_accounts: Option<Vec<String>>,
    pub ip_blocks: Option<Vec<String>>,
    pub not_ip_blocks: Option<Vec<String>>,
    pub remote_ip_blocks: Option<Vec<String>>,
    pub not_remote_ip_blocks: Option<Vec<String>>,
}

/// `rules[].to[]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ToSpec {
    /// The operation's attributes.
    pub operation: Option<OperationSpec>,
}

/// `rules[].to[].operation`: every field set must match.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(missing_docs)]
pub struct OperationSpec {
    pub hosts: Option<Vec<String>>,
    pub not_hosts: Option<Vec<String>>,
    pub ports: Option<Vec<String>>,
    pub not_ports: Option<Vec<String>>,
    pub methods: Option<Vec<String>>,
    pub not_methods: Option<Vec<String>>,
    pub paths: Option<Vec<String>>,
    pub not_paths: Option<Vec<String>>,
}

/// `rules[].when[]`: the attribute `key` must be one of `values` (if given) and
/// none of `notValues` (if given).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ConditionSpec {
    /// Attribute name, e.g. `source.ip`, `request.headers[x-user]`.
    pub key: String,
    /// Accepted values.
    pub values: Option<Vec<String>>,
    /// Refused values.
    pub not_values: Option<Vec<String>>,
}

/// A `PeerAuthentication` object (`security.istio.io/v1`, the same schema as
/// `v1beta1`): which mutual TLS mode a workload's inbound connections need.
///
/// Source: Istio reference, "Configuration" → "Security" → "PeerAuthentication"
/// (<https://istio.io/latest/docs/reference/config/security/peer_authentication/>).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PeerAuthentication {
    /// `metadata` (name and namespace are used).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `spec`; absent means `{}` (mode `UNSET`: inherit).
    #[serde(default)]
    pub spec: PeerAuthenticationSpec,
}

/// `spec` of a PeerAuthentication.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PeerAuthenticationSpec {
    /// `selector.matchLabels`: the workloads it applies to; absent, the whole
    /// namespace (the whole mesh in the root namespace).
    pub selector: Option<Selector>,
    /// `mtls.mode` for every port.
    pub mtls: Option<MutualTls>,
    /// `portLevelMtls`: modes by target port (the pod's port, as a string key
    /// of a YAML/JSON map); only with a selector.
    pub port_level_mtls: Option<BTreeMap<String, MutualTls>>,
}

/// `spec.mtls` / a `portLevelMtls` value.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MutualTls {
    /// `UNSET` (default: inherit), `DISABLE`, `PERMISSIVE` or `STRICT`.
    pub mode: Option<String>,
}
