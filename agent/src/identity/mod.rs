//! Workload identity: SPIFFE IDs, the CA (local, or an Istio CA), workload
//! certificates and the TLS configurations HBONE uses.

pub mod ca;
pub mod istio_ca;
pub mod manager;
pub mod source;
mod spiffe;
pub mod tls;

pub use manager::{CertManager, IdentityError, WorkloadIdentity};
pub use source::CertSource;
pub use spiffe::{DEFAULT_TRUST_DOMAIN, SpiffeId, SpiffeIdError};
