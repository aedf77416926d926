//! Istio's policies from the Kubernetes API: the two API versions merged, the
//! objects compiled, and whether the policies can be known.
//!
//! `security.istio.io` serves the same objects under `v1` and `v1beta1` when
//! its CRDs have both versions (Istio 1.22 and later), and only `v1beta1` on
//! older Istio; a CRD that is not installed answers `404 Not Found`. Each
//! version is watched, and the objects merged by namespace/name with `v1`
//! preferred, so that no policy counts twice and none is missed whichever
//! version the cluster serves.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta as ApiObjectMeta;

use super::kinds::{IstioObject, meta_of};
use crate::{
    authz::{
        MtlsPolicy, Policy,
        spec::{AuthorizationPolicy, PeerAuthentication},
    },
    state::PoliciesUnknown,
};

/// The longest wait between two lists of an Istio kind whose CRD is not
/// installed (the list answered 404): installing Istio's CRDs later takes
/// effect within this time, without restarting the agent.
pub(super) const NOT_INSTALLED_RETRY: Duration = Duration::from_secs(10);

/// What policies are unknown while the Istio kinds have not all been listed.
pub(super) const NOT_LISTED_WHAT: &str =
    "the Kubernetes API's AuthorizationPolicy and PeerAuthentication lists";
/// Why, then.
pub(super) const NOT_LISTED_WHY: &str = "not listed yet";

/// Whether a watch's error says the resource is not served (404 Not Found: its
/// CRD is not installed, or was removed).
pub(super) fn is_not_found(e: &kube::runtime::watcher::Error) -> bool {
    use kube::runtime::watcher::Error as W;
    // By code too: a Status without a reason (as kube-rs makes one of a body
    // that is not a Status) says 404 only so.
    let not_found = |s: &kube::core::Status| s.code == 404 || s.is_not_found();
    match e {
        W::InitialListFailed(kube::Error::Api(s))
        | W::WatchStartFailed(kube::Error::Api(s))
        | W::WatchFailed(kube::Error::Api(s)) => not_found(s),
        W::WatchError(s) => not_found(s),
        _ => false,
    }
}

/// The delay before the next list: the backoff's `delay`, at most
/// [`NOT_INSTALLED_RETRY`] after a 404.
pub(super) fn retry_delay(delay: Duration, not_found: bool) -> Duration {
    if not_found {
        delay.min(NOT_INSTALLED_RETRY)
    } else {
        delay
    }
}

/// An Istio object of either version, as read from its store.
#[derive(Clone, Debug)]
pub(super) struct Object {
    pub metadata: ApiObjectMeta,
    pub spec: Option<serde_json::Value>,
}

impl Object {
    pub(super) fn of(o: &impl IstioObject) -> Object {
        let (metadata, spec) = o.parts();
        Object {
            metadata: metadata.clone(),
            spec: spec.cloned(),
        }
    }

    fn key(&self) -> (String, String) {
        (
            self.metadata.namespace.clone().unwrap_or_default(),
            self.metadata.name.clone().unwrap_or_default(),
        )
    }
}

/// The objects of both versions, one per namespace/name (`preferred`'s,
/// `v1`, over `other`'s), in that order.
pub(super) fn merge_versions(preferred: Vec<Object>, other: Vec<Object>) -> Vec<Object> {
    let mut merged: BTreeMap<(String, String), Object> = BTreeMap::new();
    for o in other {
        merged.insert(o.key(), o);
    }
    for o in preferred {
        merged.insert(o.key(), o);
    }
    merged.into_values().collect()
}

/// A policy that cannot be used: its kind and `namespace/name`
/// (`AuthorizationPolicy shop/x`), and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Refused {
    pub what: String,
    pub why: String,
}

/// `o` as the resource type `T` reads it: its spec read from the JSON the API
/// gave, its metadata made by `with_meta` from the API's.
fn read<T: serde::de::DeserializeOwned>(
    kind: &str,
    o: &Object,
    with_meta: impl FnOnce(T, crate::k8s::ObjectMeta) -> T,
) -> Result<T, Refused> {
    let spec = o
        .spec
        .clone()
        .unwrap_or_else(|| serde_json::Value::Object(Default::default()));
    serde_json::from_value::<T>(serde_json::json!({ "spec": spec }))
        .map(|t| with_meta(t, meta_of(&o.metadata)))
        .map_err(|e| Refused {
            what: who(kind, o),
            why: format!("spec: {e}"),
        })
}

/// `Kind namespace/name`.
fn who(kind: &str, o: &Object) -> String {
    let (namespace, name) = o.key();
    format!("{kind} {namespace}/{name}")
}

/// Compiles AuthorizationPolicies; those that cannot be read or compiled are
/// refused, naming the policy and the error.
pub(super) fn compile_policies(objects: &[Object]) -> (Vec<Arc<Policy>>, Vec<Refused>) {
    let mut policies = Vec::new();
    let mut refused = Vec::new();
    for o in objects {
        let compiled = read::<AuthorizationPolicy>("AuthorizationPolicy", o, |p, metadata| {
            AuthorizationPolicy { metadata, ..p }
        })
        .and_then(|p| {
            Policy::compile(&p).map_err(|e| Refused {
                what: who("AuthorizationPolicy", o),
                why: e.to_string(),
            })
        });
        match compiled {
            Ok(p) => policies.push(Arc::new(p)),
            Err(r) => refused.push(r),
        }
    }
    (policies, refused)
}

/// Compiles PeerAuthentications, as [`compile_policies`].
pub(super) fn compile_mtls_policies(objects: &[Object]) -> (Vec<Arc<MtlsPolicy>>, Vec<Refused>) {
    let mut policies = Vec::new();
    let mut refused = Vec::new();
    for o in objects {
        let compiled = read::<PeerAuthentication>("PeerAuthentication", o, |p, metadata| {
            PeerAuthentication { metadata, ..p }
        })
        .and_then(|p| {
            MtlsPolicy::compile(&p).map_err(|e| Refused {
                what: who("PeerAuthentication", o),
                why: e.to_string(),
            })
        });
        match compiled {
            Ok(p) => policies.push(Arc::new(p)),
            Err(r) => refused.push(r),
        }
    }
    (policies, refused)
}

/// Why the policies cannot be known, if they cannot: the Istio kinds are not
/// all listed yet (`listed` false), or some policy was refused (all of them
/// are named).
pub(super) fn policies_unknown(listed: bool, refused: &[&Refused]) -> Option<PoliciesUnknown> {
    if !listed {
        return Some(PoliciesUnknown {
            what: NOT_LISTED_WHAT.into(),
            why: NOT_LISTED_WHY.into(),
        });
    }
    if refused.is_empty() {
        return None;
    }
    Some(PoliciesUnknown {
        what: refused
            .iter()
            .map(|r| r.what.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        why: refused
            .iter()
            .map(|r| r.why.as_str())
            .collect::<Vec<_>>()
            .join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(ns: &str, name: &str, spec: serde_json::Value) -> Object {
        Object {
            metadata: ApiObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(spec),
        }
    }

    #[test]
    fn versions_merge_by_name_with_v1_preferred() {
        let v1 = vec![
            object("shop", "a", serde_json::json!({"action": "DENY"})),
            object("bank", "c", serde_json::json!({})),
        ];
        let beta = vec![
            object("shop", "a", serde_json::json!({"action": "ALLOW"})),
            object("shop", "b", serde_json::json!({})),
        ];
        let merged = merge_versions(v1, beta);
        let names: Vec<_> = merged.iter().map(|o| o.key()).collect();
        assert_eq!(
            names,
            [
                ("bank".to_string(), "c".to_string()),
                ("shop".into(), "a".into()),
                ("shop".into(), "b".into())
            ]
        );
        assert_eq!(merged[1].spec.as_ref().unwrap()["action"], "DENY");
        // Old Istio: v1beta1 alone.
        let merged = merge_versions(Vec::new(), vec![object("shop", "b", serde_json::json!({}))]);
        assert_eq!(merged.len(), 1);
        // The same objects under both versions count once.
        let same = vec![object("shop", "a", serde_json::json!({}))];
        let (policies, refused) = compile_policies(&merge_versions(same.clone(), same));
        assert_eq!((policies.len(), refused.len()), (1, 0));
    }

    #[test]
    fn a_404_is_not_found_and_retried_within_ten_seconds() {
        use kube::runtime::watcher::Error as W;
        let status = |code: u16, reason: &str| {
            Box::new(kube::core::Status {
                code,
                reason: reason.into(),
                ..Default::default()
            })
        };
        assert!(is_not_found(&W::InitialListFailed(kube::Error::Api(
            status(404, "NotFound")
        ))));
        assert!(is_not_found(&W::WatchError(status(404, ""))));
        assert!(!is_not_found(&W::InitialListFailed(kube::Error::Api(
            status(403, "Forbidden")
        ))));
        assert!(!is_not_found(&W::NoResourceVersion));
        assert_eq!(
            retry_delay(Duration::from_secs(30), true),
            Duration::from_secs(10)
        );
        assert_eq!(
            retry_delay(Duration::from_secs(3), true),
            Duration::from_secs(3)
        );
        assert_eq!(
            retry_delay(Duration::from_secs(30), false),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn a_policy_that_cannot_be_compiled_makes_policies_unknown() {
        let objects = vec![
            object(
                "shop",
                "good",
                serde_json::json!({"action": "DENY", "rules": [{}]}),
            ),
            object("shop", "x", serde_json::json!({"action": "ALLOWW"})),
            object("shop", "typo", serde_json::json!({"rule": []})),
        ];
        let (policies, refused) = compile_policies(&objects);
        assert_eq!(policies.len(), 1);
        assert_eq!(policies[0].to_string(), "shop/good");
        assert_eq!(refused.len(), 2);
        assert_eq!(refused[0].what, "AuthorizationPolicy shop/x");
        assert!(refused[0].why.contains("spec.action"), "{:?}", refused[0]);
        assert!(
            refused[1].why.contains("unknown field `rule`"),
            "{:?}",
            refused[1]
        );
        let unknown = policies_unknown(true, &refused.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(
            unknown.what,
            "AuthorizationPolicy shop/x, AuthorizationPolicy shop/typo"
        );
        assert!(unknown.why.contains("ALLOWW"), "{unknown:?}");

        let (mtls, refused) = compile_mtls_policies(&[
            object(
                "shop",
                "strict",
                serde_json::json!({"mtls": {"mode": "STRICT"}}),
            ),
            object(
                "shop",
                "bad",
                serde_json::json!({"mtls": {"mode": "STRICTER"}}),
            ),
        ]);
        assert_eq!(mtls.len(), 1);
        assert_eq!(refused[0].what, "PeerAuthentication shop/bad");
        assert!(refused[0].why.contains("STRICTER"), "{:?}", refused[0]);

        // An object without a spec is `{}`.
        let (policies, refused) = compile_policies(&[Object {
            spec: None,
            ..object("shop", "nothing", serde_json::json!({}))
        }]);
        assert_eq!((policies.len(), refused.len()), (1, 0));
    }

    #[test]
    fn policies_are_unknown_until_listed_and_known_without_refusals() {
        let unknown = policies_unknown(false, &[]).unwrap();
        assert_eq!(unknown.what, NOT_LISTED_WHAT);
        assert_eq!(unknown.why, NOT_LISTED_WHY);
        assert_eq!(policies_unknown(true, &[]), None);
    }
}
