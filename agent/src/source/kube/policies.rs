//! Istio's policies from the Kubernetes API: the API version read, the
//! objects compiled (the last version of each that compiled kept), and which
//! policies cannot be known.
//!
//! `security.istio.io` serves the same stored objects under `v1` and
//! `v1beta1` when its CRDs have both versions (Istio 1.22 and later), and only
//! `v1beta1` on older Istio; a CRD that is not installed answers `404 Not
//! Found`. Each version is watched; the `v1` store is read while `v1` is
//! served (listed), else the `v1beta1` store ([`choose_version`]): the two
//! stores are never merged, so that an object deleted from one is not kept by
//! the other lagging behind.
//!
//! An object that cannot be compiled is refused. If a version of it (same
//! kind and `namespace/name`) compiled before, that last good version stays
//! in force ([`LastGood`]); else the policies of its namespace are unknown
//! (mesh-wide for the root namespace's), never the whole mesh's: one
//! namespace's broken policy denies that namespace's pods only.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::Duration,
};

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
pub(super) struct Object<'a> {
    pub metadata: Cow<'a, ApiObjectMeta>,
    pub spec: Option<Cow<'a, serde_json::Value>>,
}

impl<'a> Object<'a> {
    /// `o` as an [`Object`], borrowing its metadata and spec (the store's
    /// objects are read on every change of their kind: nothing is copied).
    pub(super) fn of(o: &'a impl IstioObject) -> Object<'a> {
        let (metadata, spec) = o.parts();
        Object {
            metadata: Cow::Borrowed(metadata),
            spec: spec.map(Cow::Borrowed),
        }
    }

    fn key(&self) -> (String, String) {
        let (namespace, name) = self.key_ref();
        (namespace.to_string(), name.to_string())
    }

    /// `(namespace, name)`, borrowed.
    fn key_ref(&self) -> (&str, &str) {
        (
            self.metadata.namespace.as_deref().unwrap_or_default(),
            self.metadata.name.as_deref().unwrap_or_default(),
        )
    }
}

/// The API version whose store is read for an Istio kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Version {
    V1,
    V1beta1,
    /// Neither is served: the kind is empty.
    Neither,
}

/// The version to read: `v1` while it is served (listed, and its CRD
/// installed), else `v1beta1` while it is, else none.
pub(super) fn choose_version(v1_served: bool, v1beta1_served: bool) -> Version {
    if v1_served {
        Version::V1
    } else if v1beta1_served {
        Version::V1beta1
    } else {
        Version::Neither
    }
}

/// What the Istio watches' flags said when a delta was made: whether every
/// Istio kind was listed, and the version read of each kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PolicyLists {
    pub listed: bool,
    pub policies: Version,
    pub mtls: Version,
}

/// Which kinds (AuthorizationPolicy, PeerAuthentication) to read again
/// although no watch recorded a change of them, given the flags `sent` with
/// the last delta and those read `now` (before the pending changes are
/// taken): both when the policies became listed (or stopped being), a kind
/// when the version to read changed. A watch publishes its flags and records
/// its list in two steps, so the flags may say listed while the list is not
/// recorded yet; the stores hold the list by then, and reading them again
/// keeps a delta from saying the policies are known with the ones read
/// before the list.
pub(super) fn rereads(sent: Option<PolicyLists>, now: PolicyLists) -> (bool, bool) {
    let Some(sent) = sent else {
        return (true, true);
    };
    let listed = sent.listed != now.listed;
    (
        listed || sent.policies != now.policies,
        listed || sent.mtls != now.mtls,
    )
}

/// The objects of the version chosen ([`choose_version`]), sorted by
/// namespace/name.
pub(super) fn objects_of<'a>(
    version: Version,
    v1: Vec<Object<'a>>,
    v1beta1: Vec<Object<'a>>,
) -> Vec<Object<'a>> {
    let mut objects = match version {
        Version::V1 => v1,
        Version::V1beta1 => v1beta1,
        Version::Neither => Vec::new(),
    };
    objects.sort_by(|a, b| a.key_ref().cmp(&b.key_ref()));
    objects
}

/// A policy that cannot be used: its namespace, its kind and
/// `namespace/name` (`AuthorizationPolicy shop/x`), and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Refused {
    pub namespace: String,
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
        .as_deref()
        .cloned()
        .unwrap_or_else(|| serde_json::Value::Object(Default::default()));
    serde_json::from_value::<T>(serde_json::json!({ "spec": spec }))
        .map(|t| with_meta(t, meta_of(&o.metadata)))
        .map_err(|e| refused(kind, o, format!("spec: {e}")))
}

/// `o`, of `kind`, refused for `why`.
fn refused(kind: &str, o: &Object, why: String) -> Refused {
    Refused {
        namespace: o.key().0,
        what: who(kind, o),
        why,
    }
}

/// `Kind namespace/name`.
fn who(kind: &str, o: &Object) -> String {
    let (namespace, name) = o.key();
    format!("{kind} {namespace}/{name}")
}

/// Compiles an AuthorizationPolicy object, or says why it is refused.
pub(super) fn compile_policy(o: &Object) -> Result<Arc<Policy>, Refused> {
    let kind = "AuthorizationPolicy";
    let p =
        read::<AuthorizationPolicy>(kind, o, |p, metadata| AuthorizationPolicy { metadata, ..p })?;
    Policy::compile(&p)
        .map(Arc::new)
        .map_err(|e| refused(kind, o, e.to_string()))
}

/// Compiles a PeerAuthentication object, as [`compile_policy`].
pub(super) fn compile_mtls_policy(o: &Object) -> Result<Arc<MtlsPolicy>, Refused> {
    let kind = "PeerAuthentication";
    let p =
        read::<PeerAuthentication>(kind, o, |p, metadata| PeerAuthentication { metadata, ..p })?;
    MtlsPolicy::compile(&p)
        .map(Arc::new)
        .map_err(|e| refused(kind, o, e.to_string()))
}

/// What [`LastGood::compile`] made of the objects of one kind.
#[derive(Debug)]
pub(super) struct Compiled<P> {
    /// The policies in force: each object's, or its last good version's.
    pub policies: Vec<Arc<P>>,
    /// Objects refused with no good version: their namespace's policies are
    /// unknown.
    pub refused: Vec<Refused>,
    /// Objects refused whose last good version stays in force.
    pub held: Vec<Refused>,
}

/// The last version that compiled of each object of one kind, by
/// namespace/name, while the object exists.
#[derive(Debug)]
pub(super) struct LastGood<P> {
    /// By namespace/name: the last good version, and the resourceVersion it
    /// was compiled from.
    last: BTreeMap<(String, String), (Option<String>, Arc<P>)>,
}

impl<P> Default for LastGood<P> {
    fn default() -> Self {
        LastGood {
            last: BTreeMap::new(),
        }
    }
}

impl<P> LastGood<P> {
    /// Compiles `objects` (one per namespace/name) with `compile`: an object
    /// that compiles is in force and kept as its last good version; one that
    /// does not is refused, and its last good version, if it has one, stays
    /// in force. The versions of objects gone are forgotten. An object whose
    /// `resourceVersion` is that of its last good version is that version
    /// (the API server changes it with every change of the object): it is
    /// not compiled again, so a change of one policy compiles one policy.
    pub(super) fn compile(
        &mut self,
        objects: &[Object<'_>],
        compile: impl Fn(&Object<'_>) -> Result<Arc<P>, Refused>,
    ) -> Compiled<P> {
        let mut compiled = Compiled {
            policies: Vec::with_capacity(objects.len()),
            refused: Vec::new(),
            held: Vec::new(),
        };
        let keys: BTreeSet<(String, String)> = objects.iter().map(Object::key).collect();
        self.last.retain(|k, _| keys.contains(k));
        for o in objects {
            let rv = o.metadata.resource_version.as_ref();
            if let Some((Some(last_rv), p)) = self.last.get(&o.key())
                && Some(last_rv) == rv
            {
                compiled.policies.push(p.clone());
                continue;
            }
            match compile(o) {
                Ok(p) => {
                    self.last.insert(o.key(), (rv.cloned(), p.clone()));
                    compiled.policies.push(p);
                }
                Err(r) => match self.last.get(&o.key()).map(|(_, p)| p) {
                    Some(p) => {
                        compiled.policies.push(p.clone());
                        compiled.held.push(r);
                    }
                    None => compiled.refused.push(r),
                },
            }
        }
        compiled
    }
}

/// The warning for an object refused whose last good version stays in force.
pub(super) fn held_message(r: &Refused) -> String {
    format!(
        "{} cannot be compiled ({}): its new version is refused and the previous one stays in force until it is fixed",
        r.what, r.why
    )
}

/// Why the policies cannot be known: all of them while the Istio kinds are
/// not all listed yet (`listed` false); those of each namespace with `refused`
/// objects (all of which are named).
pub(super) fn policies_unknown(
    listed: bool,
    refused: &[&Refused],
) -> (Option<PoliciesUnknown>, BTreeMap<String, PoliciesUnknown>) {
    let all = (!listed).then(|| PoliciesUnknown {
        what: NOT_LISTED_WHAT.into(),
        why: NOT_LISTED_WHY.into(),
    });
    let mut by_namespace: BTreeMap<String, Vec<&Refused>> = BTreeMap::new();
    for r in refused {
        by_namespace.entry(r.namespace.clone()).or_default().push(r);
    }
    let in_namespaces = by_namespace
        .into_iter()
        .map(|(namespace, refused)| {
            let unknown = PoliciesUnknown {
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
            };
            (namespace, unknown)
        })
        .collect();
    (all, in_namespaces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(ns: &str, name: &str, spec: serde_json::Value) -> Object<'static> {
        Object {
            metadata: Cow::Owned(ApiObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..Default::default()
            }),
            spec: Some(Cow::Owned(spec)),
        }
    }

    /// Compiles AuthorizationPolicies with no version kept before.
    fn compile_policies(objects: &[Object<'_>]) -> (Vec<Arc<Policy>>, Vec<Refused>) {
        let c = LastGood::default().compile(objects, compile_policy);
        (c.policies, c.refused)
    }

    /// An object whose resourceVersion is that of its last good version is
    /// not compiled again; a new resourceVersion is.
    #[test]
    fn an_unchanged_object_is_not_compiled_again() {
        let at = |rv: &str| {
            let mut o = object(
                "shop",
                "x",
                serde_json::json!({"action": "DENY", "rules": [{}]}),
            );
            o.metadata.to_mut().resource_version = Some(rv.into());
            o
        };
        let compiles = std::cell::Cell::new(0);
        let counting = |o: &Object| {
            compiles.set(compiles.get() + 1);
            compile_policy(o)
        };
        let mut last = LastGood::default();
        let first = last.compile(&[at("7")], counting).policies;
        let again = last.compile(&[at("7")], counting).policies;
        assert_eq!(compiles.get(), 1);
        assert!(Arc::ptr_eq(&first[0], &again[0]));
        last.compile(&[at("8")], counting);
        assert_eq!(compiles.get(), 2);
    }

    #[test]
    fn the_v1_store_is_read_while_v1_is_served() {
        assert_eq!(choose_version(true, true), Version::V1);
        assert_eq!(choose_version(true, false), Version::V1);
        assert_eq!(choose_version(false, true), Version::V1beta1);
        assert_eq!(choose_version(false, false), Version::Neither);
        let v1 = vec![
            object("shop", "a", serde_json::json!({"action": "DENY"})),
            object("bank", "c", serde_json::json!({})),
        ];
        // v1beta1 lags: it still has `shop/b`, deleted.
        let beta = vec![
            object("shop", "a", serde_json::json!({"action": "ALLOW"})),
            object("shop", "b", serde_json::json!({})),
        ];
        let read = objects_of(Version::V1, v1.clone(), beta.clone());
        let names: Vec<_> = read.iter().map(|o| o.key()).collect();
        assert_eq!(
            names,
            [
                ("bank".to_string(), "c".to_string()),
                ("shop".into(), "a".into())
            ]
        );
        assert_eq!(read[1].spec.as_ref().unwrap()["action"], "DENY");
        // Old Istio: v1beta1 alone.
        assert_eq!(objects_of(Version::V1beta1, Vec::new(), beta).len(), 2);
        assert!(objects_of(Version::Neither, v1, Vec::new()).is_empty());
    }

    /// Whenever the policies become listed, or the version read changes, the
    /// kinds are read again, whether or not the watch recorded its list yet.
    #[test]
    fn kinds_are_read_again_when_listed_turns() {
        let lists = |listed, policies, mtls| PolicyLists {
            listed,
            policies,
            mtls,
        };
        let not_listed = lists(false, Version::V1beta1, Version::Neither);
        assert_eq!(rereads(None, not_listed), (true, true));
        assert_eq!(rereads(Some(not_listed), not_listed), (false, false));
        let listed = lists(true, Version::V1beta1, Version::Neither);
        assert_eq!(rereads(Some(not_listed), listed), (true, true));
        assert_eq!(rereads(Some(listed), not_listed), (true, true));
        let v1 = lists(true, Version::V1, Version::Neither);
        assert_eq!(rereads(Some(listed), v1), (true, false));
        let mtls_v1 = lists(true, Version::V1, Version::V1);
        assert_eq!(rereads(Some(v1), mtls_v1), (false, true));
    }

    /// An object edited into one that does not compile keeps its last good
    /// version in force; a new one refused has none; a deleted one's is
    /// forgotten.
    #[test]
    fn the_last_good_version_stays_in_force() {
        let mut last = LastGood::default();
        let good = object(
            "shop",
            "x",
            serde_json::json!({"action": "DENY", "rules": [{}]}),
        );
        let bad = object("shop", "x", serde_json::json!({"action": "ALLOWW"}));
        let c = last.compile(std::slice::from_ref(&good), compile_policy);
        assert_eq!((c.policies.len(), c.refused.len(), c.held.len()), (1, 0, 0));
        let c = last.compile(std::slice::from_ref(&bad), compile_policy);
        assert_eq!(c.policies.len(), 1);
        assert_eq!(c.policies[0].action, crate::authz::Action::Deny);
        assert!(c.refused.is_empty());
        assert_eq!(c.held[0].what, "AuthorizationPolicy shop/x");
        let message = held_message(&c.held[0]);
        assert!(
            message.contains("AuthorizationPolicy shop/x cannot be compiled"),
            "{message}"
        );
        assert!(message.contains("ALLOWW"), "{message}");
        assert!(
            message.contains("the previous one stays in force"),
            "{message}"
        );
        // Deleted, then created again broken: no good version.
        let c = last.compile(&[], compile_policy);
        assert!(c.policies.is_empty());
        let c = last.compile(std::slice::from_ref(&bad), compile_policy);
        assert_eq!((c.policies.len(), c.refused.len(), c.held.len()), (0, 1, 0));
        // PeerAuthentications likewise.
        let mut last = LastGood::default();
        let strict = object("shop", "m", serde_json::json!({"mtls": {"mode": "STRICT"}}));
        let stricter = object(
            "shop",
            "m",
            serde_json::json!({"mtls": {"mode": "STRICTER"}}),
        );
        last.compile(&[strict], compile_mtls_policy);
        let c = last.compile(&[stricter], compile_mtls_policy);
        assert_eq!(c.policies[0].mode, crate::authz::MtlsMode::Strict);
        assert!(c.held[0].why.contains("STRICTER"), "{:?}", c.held);
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
        let (all, unknown) = policies_unknown(true, &refused.iter().collect::<Vec<_>>());
        assert_eq!(all, None);
        assert_eq!(unknown.len(), 1);
        let unknown = &unknown["shop"];
        assert_eq!(
            unknown.what,
            "AuthorizationPolicy shop/x, AuthorizationPolicy shop/typo"
        );
        assert!(unknown.why.contains("ALLOWW"), "{unknown:?}");

        let c = LastGood::default().compile(
            &[
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
            ],
            compile_mtls_policy,
        );
        let (mtls, refused) = (c.policies, c.refused);
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
    fn policies_are_unknown_until_listed_and_by_namespace_once_refused() {
        let (all, in_namespaces) = policies_unknown(false, &[]);
        let all = all.unwrap();
        assert_eq!(all.what, NOT_LISTED_WHAT);
        assert_eq!(all.why, NOT_LISTED_WHY);
        assert!(in_namespaces.is_empty());
        assert_eq!(policies_unknown(true, &[]), (None, BTreeMap::new()));
        let refused = |ns: &str, name: &str| Refused {
            namespace: ns.into(),
            what: format!("AuthorizationPolicy {ns}/{name}"),
            why: format!("{name} is bad"),
        };
        let (a, b, c) = (
            refused("shop", "a"),
            refused("bank", "b"),
            refused("shop", "c"),
        );
        let (all, in_namespaces) = policies_unknown(true, &[&a, &b, &c]);
        assert_eq!(all, None, "never the whole mesh");
        assert_eq!(in_namespaces.keys().collect::<Vec<_>>(), ["bank", "shop"]);
        assert_eq!(
            in_namespaces["shop"].what,
            "AuthorizationPolicy shop/a, AuthorizationPolicy shop/c"
        );
        assert_eq!(in_namespaces["shop"].why, "a is bad; c is bad");
    }
}
