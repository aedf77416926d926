//! A local CA's files, or a trust bundle: the input is `ca.crt` (PEM
//! certificates, the signing CA first) followed by `ca.key` (from its
//! `-----BEGIN PRIVATE KEY-----` line on), checked and loaded as the agent loads
//! `--ca-dir` (`identity::ca::CertificateAuthority::from_pem`); the certificates alone are read as
//! an Istio root bundle is (`identity::ca::parse_ca_bundle`). A CA that loads
//! issues a workload certificate that carries its identity.
#![no_main]

use std::{path::Path, time::Duration};

use libfuzzer_sys::fuzz_target;
use podlink_agent::identity::{SpiffeId, ca, tls};

const KEY_START: &[u8] = b"-----BEGIN PRIVATE KEY-----";

fuzz_target!(|data: &[u8]| {
    let at = data
        .windows(KEY_START.len())
        .position(|w| w == KEY_START)
        .unwrap_or(data.len());
    let (cert, key) = data.split_at(at);
    if let Ok(roots) = ca::parse_ca_bundle(Path::new("roots.pem"), cert) {
        let _ = tls::root_store(&roots);
    }
    let Ok(authority) =
        ca::CertificateAuthority::from_pem(Path::new("ca.crt"), cert, Path::new("ca.key"), key)
    else {
        return;
    };
    let _ = tls::root_store(authority.roots());
    let id = SpiffeId::new("cluster.local", "shop", "web");
    if let Ok(issued) = authority.issue(&id, Duration::from_secs(3600)) {
        assert_eq!(tls::peer_identity(Some(issued.chain.as_slice())), Ok(id));
    }
});
