//! Workload identity: SPIFFE IDs, the CA (local, or an Istio CA), workload
//! certificates and the TLS configurations HBONE uses.

pub mod ca;
pub mod istio_ca;
pub mod manager;
pub mod source;
mod spiffe;
pub mod tls;

pub use manager::{CertManager, WorkloadIdentity};
pub use source::CertSource;
pub use spiffe::{DEFAULT_TRUST_DOMAIN, SpiffeId, SpiffeIdError};

use ca::CaError;
use istio_ca::IstioCaError;

/// Errors of workload identity: loading the trust, issuing a certificate, building
/// its TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    /// A CA file is not usable, or signing failed.
    Ca(#[from] CaError),
    #[error(transparent)]
    /// The Istio CA did not issue a usable certificate.
    IstioCa(#[from] IstioCaError),
    #[error("TLS configuration for {id}: {source}")]
    /// Building a TLS configuration failed.
    Tls {
        /// The identity the configuration is for.
        id: String,
        /// rustls's error.
        source: rustls::Error,
    },
    #[error("no certificate for {id}: the last attempt, {ago_ms} ms ago, failed: {reason}")]
    /// The last issuance failed a moment ago (see [`CertManager::identity`]).
    Unavailable {
        /// The identity.
        id: String,
        /// How long ago the attempt failed, milliseconds.
        ago_ms: u128,
        /// Its error.
        reason: String,
    },
}
