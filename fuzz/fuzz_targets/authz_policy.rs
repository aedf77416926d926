//! An `AuthorizationPolicy` as written (YAML, the resource of the workload
//! source): deserialized (`authz::spec`), compiled (`authz::Policy::compile`),
//! and what compiles decides connections of every kind to a pod of namespace
//! `shop` (`authz::PolicySet::decide`).
#![no_main]

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use libfuzzer_sys::fuzz_target;
use podlink_agent::{
    authz::{DEFAULT_ROOT_NAMESPACE, Destination, Policy, PolicySet, Request, spec},
    identity::SpiffeId,
};

fuzz_target!(|data: &str| {
    let Ok(written) = serde_yaml_ng::from_str::<spec::AuthorizationPolicy>(data) else {
        return;
    };
    let Ok(policy) = Policy::compile(&written) else {
        return;
    };
    let _ = policy.to_string();
    let (set, _) = PolicySet::build(DEFAULT_ROOT_NAMESPACE, [Arc::new(policy)], []);
    let labels = BTreeMap::from([("app".to_string(), "web".to_string())]);
    let client = SpiffeId::new("cluster.local", "shop", "client");
    let sources: [(IpAddr, Option<&SpiffeId>); 3] = [
        ("10.244.2.1".parse().unwrap(), Some(&client)),
        ("fd00:1::1".parse().unwrap(), Some(&client)),
        ("10.244.2.1".parse().unwrap(), None),
    ];
    for (source_ip, source) in sources {
        for destination_port in [1, 80, 8080, 65535] {
            let request = Request {
                source_ip,
                source,
                destination_ip: "10.244.1.2".parse().unwrap(),
                destination_port,
            };
            for namespace in ["shop", DEFAULT_ROOT_NAMESPACE] {
                let destination = Destination {
                    namespace,
                    labels: &labels,
                    named: &[],
                };
                let _ = set.decide(Some(destination), &request).into_result();
            }
        }
    }
});
