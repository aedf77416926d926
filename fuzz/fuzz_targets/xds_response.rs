//! A workload xDS response from istiod: the `DeltaDiscoveryResponse` protobuf
//! message, its resources decoded and handed to a handler, and the answer made
//! (`xds::handle_response`), twice in a row on the same held versions (as two
//! pushes on one stream). The handler refuses the resources whose name starts
//! with `refuse`. Checked: the answer carries the response's nonce and type, is
//! a NACK exactly when something was refused, and the held versions are of
//! resources that were in the responses.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use podlink_agent::xds::{
    Handler, Held, Refused, ResourceType, handle_response,
    proto::{discovery::DeltaDiscoveryResponse, security::Authorization, workload::Address},
};
use prost::Message;

struct Refuser;

fn refuse<T>(updated: Vec<(String, T)>) -> Vec<Refused> {
    updated
        .into_iter()
        .filter(|(name, _)| name.starts_with("refuse"))
        .map(|(name, _)| Refused::new(name, "refused"))
        .collect()
}

impl Handler for Refuser {
    fn addresses(&mut self, updated: Vec<(String, Address)>, _: Vec<String>) -> Vec<Refused> {
        refuse(updated)
    }

    fn authorizations(
        &mut self,
        updated: Vec<(String, Authorization)>,
        _: Vec<String>,
    ) -> Vec<Refused> {
        refuse(updated)
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(response) = DeltaDiscoveryResponse::decode(data) else {
        return;
    };
    let mut held = Held::default();
    let names: HashSet<String> = response.resources.iter().map(|r| r.name.clone()).collect();
    for _ in 0..2 {
        let answer = handle_response(&mut held, &mut Refuser, response.clone());
        assert_eq!(answer.request.response_nonce, response.nonce);
        assert_eq!(answer.request.type_url, response.type_url);
        assert_eq!(answer.is_ack(), answer.refused.is_empty());
        if let Some(detail) = &answer.request.error_detail {
            for r in &answer.refused {
                assert!(detail.message.contains(&r.name));
            }
        }
        for t in ResourceType::ALL {
            for name in held.versions(t).keys() {
                assert!(names.contains(name), "{name} held but never sent");
                assert!(!name.starts_with("refuse"));
            }
        }
    }
});
