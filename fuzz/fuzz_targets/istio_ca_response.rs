//! The Istio CA's answer to `CreateCertificate`: the `IstioCertificateResponse`
//! protobuf message (`identity::istio_ca::proto`) and its `cert_chain` checked
//! as the agent checks it (`identity::istio_ca::check_chain`) for the identity
//! `spiffe://cluster.local/ns/shop/sa/web`, the CSR's key and the mesh roots of
//! `fuzz/fixtures/` (test-only keys), at a fixed time.
#![no_main]

use std::{
    sync::LazyLock,
    time::{Duration, SystemTime},
};

use libfuzzer_sys::fuzz_target;
use podlink_agent::identity::{
    SpiffeId,
    istio_ca::{check_chain, proto::IstioCertificateResponse},
    tls,
};
use prost::Message;
use rcgen::KeyPair;
use rustls::RootCertStore;
use rustls_pki_types::{CertificateDer, pem::PemObject};

struct Fixture {
    id: SpiffeId,
    key: KeyPair,
    roots: std::sync::Arc<RootCertStore>,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    let roots: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(include_bytes!("../fixtures/ca.crt"))
            .collect::<Result<_, _>>()
            .expect("the fixture CA parses");
    Fixture {
        id: SpiffeId::new("cluster.local", "shop", "web"),
        key: KeyPair::from_pem(include_str!("../fixtures/workload.key")).expect("the fixture key"),
        roots: tls::root_store(&roots).expect("the fixture roots"),
    }
});

/// 2030-01-01T00:00:00Z: within the fixture certificates' validity.
const NOW: Duration = Duration::from_secs(1_893_456_000);

fuzz_target!(|data: &[u8]| {
    let Ok(response) = IstioCertificateResponse::decode(data) else {
        return;
    };
    let f = &*FIXTURE;
    if let Ok((chain, _)) = check_chain(
        &response.cert_chain,
        &f.id,
        &f.key,
        &f.roots,
        SystemTime::UNIX_EPOCH + NOW,
    ) {
        assert_eq!(tls::peer_identity(Some(chain.as_slice())), Ok(f.id.clone()));
    }
});
