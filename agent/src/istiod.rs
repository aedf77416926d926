//! What the clients of istiod share (the Istio CA client,
//! [`crate::identity::istio_ca`], and the workload xDS client, [`crate::xds`]):
//! the address, a gRPC endpoint over TLS verified against the mesh's root
//! certificates, and the call metadata istiod authenticates.
//!
//! istiod serves both on port 15012 over TLS with a certificate issued by the
//! mesh's CA (verified against the `istio-ca-root-cert` bundle, `--ca-root-cert`).
//! Each call carries `authorization: Bearer <token>`, the node agent's projected
//! service account token (audience `istio-ca`), read from its file on every call
//! since the kubelet rotates it, and `clusterid: <cluster ID>` (ztunnel's
//! `src/identity/auth.rs` and `src/xds/client.rs`).

use std::{path::Path, time::Duration};

use tonic::{
    metadata::MetadataMap,
    transport::{Certificate, ClientTlsConfig, Endpoint},
};

/// Time allowed to connect (TCP and TLS) to istiod.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The host of `address`, which must be `https://host:port` (brackets of an IPv6
/// literal removed): the name istiod's certificate is verified for.
///
/// # Errors
/// What is wrong with the address, as a sentence fragment.
pub fn host_of(address: &str) -> Result<String, String> {
    let uri: http::Uri = address.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("https") {
        return Err("the scheme must be https".into());
    }
    if uri.port_u16().is_none() {
        return Err("a port is required (istiod serves on 15012)".into());
    }
    Ok(uri
        .host()
        .ok_or("no host")?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string())
}

/// An endpoint for `address` (`https://host:port`, see [`host_of`]) over TLS
/// verified against `roots_pem` for the name `host`, with [`CONNECT_TIMEOUT`].
/// Not connected yet; the caller adds its timeouts.
///
/// # Errors
/// What is wrong with the address or the TLS settings, as a sentence fragment.
pub fn endpoint(address: &str, host: &str, roots_pem: &[u8]) -> Result<Endpoint, String> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(roots_pem))
        .domain_name(host.to_string());
    Ok(Endpoint::from_shared(address.to_string())
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| format!("TLS settings: {e}"))?
        .connect_timeout(CONNECT_TIMEOUT))
}

/// The bearer token in `path`, trimmed.
///
/// # Errors
/// Reading failed, or the file is empty, as a sentence fragment.
pub fn read_token(path: &Path) -> Result<String, String> {
    let token = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let token = token.trim();
    if token.is_empty() {
        return Err("the file is empty".into());
    }
    Ok(token.to_string())
}

/// Why the call metadata could not be made.
#[derive(Debug, PartialEq, Eq)]
pub enum MetadataError {
    /// The token is not a valid header value.
    Token,
    /// The cluster ID is not a valid header value.
    ClusterId,
}

/// Adds `authorization: Bearer <token>` and `clusterid: <cluster_id>` to `metadata`.
///
/// # Errors
/// Which of the two is not a valid header value.
pub fn insert_credentials(
    metadata: &mut MetadataMap,
    token: &str,
    cluster_id: &str,
) -> Result<(), MetadataError> {
    metadata.insert(
        "authorization",
        format!("Bearer {token}")
            .parse()
            .map_err(|_| MetadataError::Token)?,
    );
    metadata.insert(
        "clusterid",
        cluster_id.parse().map_err(|_| MetadataError::ClusterId)?,
    );
    Ok(())
}

/// An error with its sources, `a: b: c`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    crate::error::Chain(e).to_string()
}

/// A gRPC status as text: its message, and the transport error under it if any
/// (tonic keeps it as the status's source: `transport error: …`).
pub fn status_text(status: &tonic::Status) -> String {
    let mut text = status.message().to_string();
    if let Some(source) = std::error::Error::source(status) {
        text = format!("{text}: {}", error_chain(source));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_must_be_https_with_a_port() {
        for (address, want) in [
            ("http://istiod:15012", "https"),
            ("https://istiod", "port"),
            ("not a url", "not a URL"),
        ] {
            let err = host_of(address).unwrap_err();
            assert!(err.contains(want), "{address}: {err}");
        }
        assert_eq!(
            host_of("https://istiod.istio-system.svc:15012").unwrap(),
            "istiod.istio-system.svc"
        );
        assert_eq!(host_of("https://[fd00::1]:15012").unwrap(), "fd00::1");
    }

    #[test]
    fn credentials_are_bearer_and_clusterid() {
        let mut metadata = MetadataMap::new();
        insert_credentials(&mut metadata, "tok", "Kubernetes").unwrap();
        assert_eq!(metadata.get("authorization").unwrap(), "Bearer tok");
        assert_eq!(metadata.get("clusterid").unwrap(), "Kubernetes");
        assert_eq!(
            insert_credentials(&mut metadata, "a\nb", "c"),
            Err(MetadataError::Token)
        );
        assert_eq!(
            insert_credentials(&mut metadata, "a", "c\n"),
            Err(MetadataError::ClusterId)
        );
    }
}
