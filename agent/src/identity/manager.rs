//! Workload certificates, issued on demand per SPIFFE ID, cached, and reissued once
//! half their lifetime has passed.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use rustls::{ClientConfig, RootCertStore, ServerConfig, sign::CertifiedKey};

use super::{
    SpiffeId,
    ca::{CaError, CertificateAuthority},
    tls,
};

/// A workload's certificate with the TLS configuration built from it.
#[derive(Debug)]
pub struct WorkloadIdentity {
    /// The identity in the certificate.
    pub id: SpiffeId,
    /// Certificate chain and signing key, for rustls.
    pub key: Arc<CertifiedKey>,
    /// Server configuration presenting this identity (inbound HBONE).
    pub server: Arc<ServerConfig>,
    /// End of the certificate's validity.
    pub not_after: SystemTime,
    /// When the certificate is replaced by a new one (half its lifetime).
    pub renew_at: SystemTime,
}

/// Errors of the certificate manager.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    /// Issuing the certificate failed.
    Ca(#[from] CaError),
    #[error("TLS configuration for {id}: {source}")]
    /// Building a TLS configuration failed.
    Tls {
        /// The identity the configuration is for.
        id: String,
        /// rustls's error.
        source: rustls::Error,
    },
}

/// Issues and caches workload certificates from a [`CertificateAuthority`].
pub struct CertManager {
    ca: CertificateAuthority,
    roots: Arc<RootCertStore>,
    trust_domain: String,
    lifetime: Duration,
    cache: Mutex<HashMap<SpiffeId, Arc<WorkloadIdentity>>>,
}

impl CertManager {
    /// A manager issuing certificates valid for `lifetime` (renewed at half of it).
    ///
    /// # Errors
    /// A trust anchor rustls cannot use.
    pub fn new(
        ca: CertificateAuthority,
        trust_domain: &str,
        lifetime: Duration,
    ) -> Result<Self, IdentityError> {
        let roots = tls::root_store(ca.roots()).map_err(|source| IdentityError::Tls {
            id: "trust bundle".into(),
            source,
        })?;
        Ok(Self {
            ca,
            roots,
            trust_domain: trust_domain.to_string(),
            lifetime,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The trust domain peers must belong to.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The current certificate of `id`, issuing one if none is cached or the cached
    /// one is past half its lifetime.
    ///
    /// # Errors
    /// Issuance or TLS configuration failures, naming the identity.
    pub fn identity(&self, id: &SpiffeId) -> Result<Arc<WorkloadIdentity>, IdentityError> {
        let now = SystemTime::now();
        let mut cache = self.cache.lock().expect("certificate cache lock");
        if let Some(cached) = cache.get(id)
            && now < cached.renew_at
        {
            return Ok(cached.clone());
        }
        let cert = self.ca.issue(id, self.lifetime)?;
        let tls_err = |source| IdentityError::Tls {
            id: id.to_string(),
            source,
        };
        let signing_key = tls::provider()
            .key_provider
            .load_private_key(cert.key)
            .map_err(tls_err)?;
        let key = Arc::new(CertifiedKey::new(cert.chain, signing_key));
        let server = tls::server_config(key.clone(), self.roots.clone(), &self.trust_domain)
            .map_err(tls_err)?;
        let identity = Arc::new(WorkloadIdentity {
            id: id.clone(),
            key,
            server: Arc::new(server),
            not_after: cert.not_after,
            renew_at: now + self.lifetime / 2,
        });
        tracing::debug!(%id, "issued workload certificate");
        cache.insert(id.clone(), identity.clone());
        Ok(identity)
    }

    /// Client configuration presenting `src` and requiring the server to be `dst`.
    ///
    /// # Errors
    /// As [`CertManager::identity`].
    pub fn client_config(
        &self,
        src: &SpiffeId,
        dst: &SpiffeId,
    ) -> Result<Arc<ClientConfig>, IdentityError> {
        let identity = self.identity(src)?;
        let config = tls::client_config(identity.key.clone(), self.roots.clone(), dst.clone())
            .map_err(|source| IdentityError::Tls {
                id: src.to_string(),
                source,
            })?;
        Ok(Arc::new(config))
    }

    /// Drops cached certificates of identities not in `keep`.
    pub fn retain(&self, keep: impl Fn(&SpiffeId) -> bool) {
        self.cache
            .lock()
            .expect("certificate cache lock")
            .retain(|id, _| keep(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ca::init;

    fn manager(lifetime: Duration) -> (CertManager, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path()).unwrap();
        let ca = CertificateAuthority::load(dir.path()).unwrap();
        (
            CertManager::new(ca, "cluster.local", lifetime).unwrap(),
            dir,
        )
    }

    #[test]
    fn caches_until_half_life() {
        let (m, _dir) = manager(Duration::from_secs(3600));
        let id = SpiffeId::new("cluster.local", "ns", "sa");
        let a = m.identity(&id).unwrap();
        let b = m.identity(&id).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.renew_at < a.not_after);
    }

    #[test]
    fn reissues_after_half_life() {
        let (m, _dir) = manager(Duration::from_millis(200));
        let id = SpiffeId::new("cluster.local", "ns", "sa");
        let a = m.identity(&id).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        let b = m.identity(&id).unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert_ne!(a.key.cert[0], b.key.cert[0]);
    }
}
