//! SPIFFE IDs of Kubernetes workloads.
//!
//! Istio names a workload by its namespace and service account:
//! `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>` (SPIFFE ID
//! standard, <https://github.com/spiffe/spiffe/blob/main/standards/SPIFFE-ID.md>;
//! Istio's identity format in "Security" → "Istio identity").

use std::fmt;

use thiserror::Error;

/// The trust domain of a cluster that does not configure one.
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

/// A workload identity: `spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    trust_domain: String,
    namespace: String,
    service_account: String,
}

/// Why a string is not a workload SPIFFE ID.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpiffeIdError {
    #[error("{0:?} does not start with spiffe://")]
    /// The URI is not a `spiffe://` URI.
    Scheme(String),
    #[error("{0:?} has an empty or invalid trust domain")]
    /// The trust domain is empty or has characters other than `[a-z0-9._-]`.
    TrustDomain(String),
    #[error("{0:?} is not of the form spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>")]
    /// The path is not `/ns/<namespace>/sa/<service-account>`.
    Path(String),
}

impl SpiffeId {
    /// The identity of `service_account` in `namespace` within `trust_domain`.
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Self {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        }
    }

    /// Parses a URI such as `spiffe://cluster.local/ns/default/sa/web`.
    ///
    /// # Errors
    /// [`SpiffeIdError`] naming what is wrong with `uri`.
    pub fn parse(uri: &str) -> Result<Self, SpiffeIdError> {
        let rest = uri
            .strip_prefix("spiffe://")
            .ok_or_else(|| SpiffeIdError::Scheme(uri.to_string()))?;
        let (td, path) = rest.split_once('/').unwrap_or((rest, ""));
        let td_ok = !td.is_empty()
            && td
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b));
        if !td_ok {
            return Err(SpiffeIdError::TrustDomain(uri.to_string()));
        }
        let segments: Vec<&str> = path.split('/').collect();
        match segments.as_slice() {
            ["ns", ns, "sa", sa] if valid_segment(ns) && valid_segment(sa) => {
                Ok(Self::new(td, ns, sa))
            }
            _ => Err(SpiffeIdError::Path(uri.to_string())),
        }
    }

    /// The trust domain, e.g. `cluster.local`.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The Kubernetes namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The Kubernetes service account.
    pub fn service_account(&self) -> &str {
        &self.service_account
    }
}

/// A path segment per the SPIFFE ID standard: non-empty, no `.`/`..`, and only
/// letters, digits, `.`, `-` and `_`.
fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
        assert_eq!(id.trust_domain(), "cluster.local");
        assert_eq!(id.namespace(), "default");
        assert_eq!(id.service_account(), "web");
        assert_eq!(id.to_string(), "spiffe://cluster.local/ns/default/sa/web");
        assert_eq!(id, SpiffeId::new("cluster.local", "default", "web"));
    }

    #[test]
    fn refuses_malformed_ids() {
        for (uri, want) in [
            ("https://cluster.local/ns/a/sa/b", "spiffe://"),
            ("spiffe:///ns/a/sa/b", "trust domain"),
            ("spiffe://Cluster.Local/ns/a/sa/b", "trust domain"),
            ("spiffe://cluster.local/ns/a", "form"),
            ("spiffe://cluster.local/ns/a/sa/b/extra", "form"),
            ("spiffe://cluster.local/ns//sa/b", "form"),
            ("spiffe://cluster.local/ns/../sa/b", "form"),
            ("spiffe://cluster.local/sa/b/ns/a", "form"),
        ] {
            let err = SpiffeId::parse(uri).unwrap_err().to_string();
            assert!(err.contains(want), "{uri}: {err}");
        }
    }
}
