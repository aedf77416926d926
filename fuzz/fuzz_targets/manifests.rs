//! A manifest file of the `--manifests` directory: multi-document YAML of Pods,
//! Namespaces, Services, EndpointSlices, Nodes, AuthorizationPolicies,
//! PeerAuthentications and Lists (`source::manifests::parse`). What parses is
//! indexed as the agent indexes it.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use podlink_agent::{
    authz::{DEFAULT_ROOT_NAMESPACE, PolicySet},
    source::manifests,
    state::WorkloadIndex,
};

fuzz_target!(|data: &str| {
    if let Ok(objects) = manifests::parse(Path::new("fuzz.yaml"), data) {
        let _ = WorkloadIndex::build("n1", "cluster.local", &objects.pods, &objects.namespaces);
        let _ = PolicySet::build(
            DEFAULT_ROOT_NAMESPACE,
            objects.policies,
            objects.mtls_policies,
        );
    }
});
