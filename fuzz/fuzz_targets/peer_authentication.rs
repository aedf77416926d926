//! A `PeerAuthentication` as written (YAML): deserialized (`authz::spec`),
//! compiled (`authz::MtlsPolicy::compile`), and what compiles gives every port of
//! a pod of namespace `shop` its mode (`authz::MtlsPolicies::effective`).
#![no_main]

use std::{collections::BTreeMap, sync::Arc};

use libfuzzer_sys::fuzz_target;
use podlink_agent::authz::{DEFAULT_ROOT_NAMESPACE, MtlsMode, MtlsPolicies, MtlsPolicy, spec};

fuzz_target!(|data: &str| {
    let Ok(written) = serde_yaml_ng::from_str::<spec::PeerAuthentication>(data) else {
        return;
    };
    let Ok(policy) = MtlsPolicy::compile(&written) else {
        return;
    };
    let _ = policy.to_string();
    let (set, _) = MtlsPolicies::build(DEFAULT_ROOT_NAMESPACE, [Arc::new(policy)]);
    let labels = BTreeMap::from([("app".to_string(), "web".to_string())]);
    for namespace in ["shop", DEFAULT_ROOT_NAMESPACE] {
        for port in [1, 80, 8080, 65535] {
            let effective = set.effective(namespace, &labels, port);
            assert_ne!(effective.mode, MtlsMode::Unset);
        }
    }
    let _ = set.overlaps([("shop", &labels)]);
});
