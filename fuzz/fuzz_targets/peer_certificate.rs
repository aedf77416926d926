//! A peer's certificate (DER), as the HBONE server and client read the
//! identity of the other end (`identity::tls::peer_identity`), and its URI SAN
//! as a SPIFFE ID (`identity::SpiffeId::parse`), which prints back as it was
//! written.
#![no_main]

use libfuzzer_sys::fuzz_target;
use podlink_agent::identity::{SpiffeId, tls};
use rustls_pki_types::CertificateDer;

fuzz_target!(|data: &[u8]| {
    let cert = CertificateDer::from(data);
    let _ = tls::peer_identity(Some(std::slice::from_ref(&cert)));
    if let Ok(uri) = std::str::from_utf8(data)
        && let Ok(id) = SpiffeId::parse(uri)
    {
        assert_eq!(id.to_string(), uri);
    }
});
