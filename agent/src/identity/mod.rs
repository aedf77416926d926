//! Workload identity: SPIFFE IDs, the CA, workload certificates and the TLS
//! configurations HBONE uses.

pub mod ca;
pub mod manager;
mod spiffe;
pub mod tls;

pub use manager::{CertManager, WorkloadIdentity};
pub use spiffe::{DEFAULT_TRUST_DOMAIN, SpiffeId, SpiffeIdError};
