//! Workload certificates, per SPIFFE ID: issued on demand (once, however many
//! connections ask at the same time), cached, renewed in the background once half
//! their lifetime has passed, and reissued at once when the CA changes.
//!
//! * A renewal that fails is logged and retried with backoff; the current
//!   certificate stays in use while it is valid, and is dropped (an error) once it
//!   has expired: connections needing it then fail until one is issued.
//! * The trust (the CA files, or the Istio root bundle) is watched: a change is
//!   checked, and either refused (an error naming the file and what is wrong; the
//!   current trust stays) or put in force for all new TLS configurations, every
//!   cached certificate being reissued under it ("CA changed: reissued N workload
//!   certificates").
//!
//! ztunnel (`src/identity/manager.rs`) works the same way: certificates fetched
//! per identity on demand or prefetched for the node's workloads, refreshed at half
//! life in the background.
//!
//! This module holds the cache and issuance; `renewal` the background refresher
//! and its backoff, `reload` the trust's watch and reload.

mod reload;
mod renewal;
#[cfg(test)]
mod tests;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime},
};

use rustls::{ClientConfig, ServerConfig, sign::CertifiedKey};
use tokio::sync::{Notify, watch};

use self::renewal::Failure;
use super::{
    Error, SpiffeId,
    ca::WorkloadCertificate,
    source::{CertSource, Trust},
    tls,
};

/// A connection needing a certificate whose issuance failed less than this long
/// ago fails at once with that error, instead of asking the CA again.
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

/// A workload's certificate with the TLS configuration built from it.
#[derive(Debug)]
pub struct WorkloadIdentity {
    /// The identity in the certificate.
    pub id: SpiffeId,
    /// Certificate chain and signing key, for rustls.
    pub key: Arc<CertifiedKey>,
    /// Server configuration presenting this identity (inbound HBONE), trusting the
    /// roots in force when it was issued.
    pub server: Arc<ServerConfig>,
    /// End of the certificate's validity.
    pub not_after: SystemTime,
    /// When the background refresher replaces it (half its remaining lifetime
    /// after issuance).
    pub renew_at: SystemTime,
    /// The trust generation it was issued under.
    generation: u64,
}

/// Issues, caches, renews and reissues workload certificates from a
/// [`CertSource`]. Cloning gives another handle to the same manager.
#[derive(Clone)]
pub struct CertManager {
    inner: Arc<Inner>,
}

struct Inner {
    source: CertSource,
    trust_domain: String,
    lifetime: Duration,
    trust: RwLock<Arc<Generation>>,
    slots: Mutex<HashMap<SpiffeId, Arc<Slot>>>,
    /// Wakes the refresher (a new identity to prefetch).
    wake: Notify,
    /// The trust generation, bumped after each change's reissue.
    changes: watch::Sender<u64>,
    #[cfg(test)]
    fail_issuance: std::sync::atomic::AtomicBool,
}

/// A trust and its number (1 at start, +1 per change).
struct Generation {
    trust: Trust,
    number: u64,
}

/// One identity's certificate and its issuance state.
struct Slot {
    id: SpiffeId,
    state: Mutex<SlotState>,
    /// Held while a certificate for this identity is being issued: concurrent
    /// requests wait and share the result.
    issuing: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct SlotState {
    current: Option<Arc<WorkloadIdentity>>,
    /// Issuance attempts so far: a request that waited for another's attempt tells
    /// by this that it failed.
    attempts: u64,
    failure: Option<Failure>,
}

impl SlotState {
    /// The current certificate, if it is still valid.
    fn usable(&self) -> Option<Arc<WorkloadIdentity>> {
        self.current
            .clone()
            .filter(|c| SystemTime::now() < c.not_after)
    }
}

fn rfc3339(t: SystemTime) -> humantime::Rfc3339Timestamp {
    humantime::format_rfc3339_seconds(t)
}

impl CertManager {
    /// A manager issuing certificates from `source`, asking for `lifetime` (renewed
    /// at half of it), for the mesh's `trust_domain`. Loads the trust now.
    ///
    /// # Errors
    /// Trust files that cannot be read or are not usable, naming the file.
    pub fn new(source: CertSource, trust_domain: &str, lifetime: Duration) -> Result<Self, Error> {
        let trust = source.load()?;
        Ok(Self {
            inner: Arc::new(Inner {
                source,
                trust_domain: trust_domain.to_string(),
                lifetime,
                trust: RwLock::new(Arc::new(Generation { trust, number: 1 })),
                slots: Mutex::new(HashMap::new()),
                wake: Notify::new(),
                changes: watch::Sender::new(1),
                #[cfg(test)]
                fail_issuance: Default::default(),
            }),
        })
    }

    /// The trust domain peers must belong to.
    pub fn trust_domain(&self) -> &str {
        &self.inner.trust_domain
    }

    /// The trust anchors in force (DER), signing CA first in local mode.
    pub fn roots(&self) -> Vec<rustls_pki_types::CertificateDer<'static>> {
        self.inner.generation().trust.roots.clone()
    }

    /// The trust generation: 1 at start, then one more after each CA change has
    /// been put in force and the certificates reissued. Changes when the CA does.
    pub fn ca_changes(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// The certificate of `id`, issuing one if none is cached or the cached one
    /// has expired. A certificate past half its lifetime is still returned: the
    /// background refresher ([`CertManager::run`]) replaces it.
    ///
    /// # Errors
    /// Issuance or TLS configuration failures, naming the identity;
    /// [`Error::Unavailable`] when an issuance failed less than a second
    /// ago (also the one this request waited for).
    pub async fn identity(&self, id: &SpiffeId) -> Result<Arc<WorkloadIdentity>, Error> {
        let slot = self.inner.slot(id).0;
        let seen = {
            let state = slot.state.lock().expect("certificate slot lock");
            if let Some(current) = state.usable() {
                return Ok(current);
            }
            // Until the background retry is due, connections fail at once
            // instead of each asking the CA again.
            if let Some(failure) = &state.failure
                && (failure.at.elapsed() < FAILED_RECENTLY || Instant::now() < failure.retry_at())
            {
                return Err(failure.unavailable(id));
            }
            state.attempts
        };
        let _issuing = slot.issuing.lock().await;
        {
            let state = slot.state.lock().expect("certificate slot lock");
            if let Some(current) = state.usable() {
                return Ok(current);
            }
            if state.attempts != seen
                && let Some(failure) = &state.failure
            {
                return Err(failure.unavailable(id));
            }
        }
        self.inner.issue(&slot).await
    }

    /// Server configuration presenting `identity` and trusting the roots in force
    /// now: the one built with the certificate, or, when the trust changed since
    /// and the reissue has not happened yet (a CA that cannot be reached), one
    /// built now, so a removed root is never trusted a moment longer.
    ///
    /// # Errors
    /// A TLS configuration rustls refuses, naming the identity.
    pub fn server_config(&self, identity: &WorkloadIdentity) -> Result<Arc<ServerConfig>, Error> {
        let generation = self.inner.generation();
        if identity.generation == generation.number {
            return Ok(identity.server.clone());
        }
        tls::server_config(
            identity.key.clone(),
            generation.trust.store.clone(),
            &self.inner.trust_domain,
        )
        .map(Arc::new)
        .map_err(|source| Error::Tls {
            id: identity.id.to_string(),
            source,
        })
    }

    /// The cached certificate of `id`, if any, without issuing one.
    pub fn cached(&self, id: &SpiffeId) -> Option<Arc<WorkloadIdentity>> {
        let slots = self.inner.slots.lock().expect("certificate cache lock");
        let slot = slots.get(id)?;
        let state = slot.state.lock().expect("certificate slot lock");
        state.current.clone()
    }

    /// Client configuration presenting `src` and requiring the server to be `dst`,
    /// trusting the roots in force now.
    ///
    /// # Errors
    /// As [`CertManager::identity`].
    pub async fn client_config(
        &self,
        src: &SpiffeId,
        dst: &SpiffeId,
    ) -> Result<Arc<ClientConfig>, Error> {
        let identity = self.identity(src).await?;
        let roots = self.inner.generation().trust.store.clone();
        let config =
            tls::client_config(identity.key.clone(), roots, dst.clone()).map_err(|source| {
                Error::Tls {
                    id: src.to_string(),
                    source,
                }
            })?;
        Ok(Arc::new(config))
    }

    /// Has certificates issued in the background for `ids` (this node's workloads),
    /// so that their first connections find them ready.
    pub fn prefetch(&self, ids: impl IntoIterator<Item = SpiffeId>) {
        let mut added = false;
        for id in ids {
            added |= self.inner.slot(&id).1;
        }
        if added {
            self.inner.wake.notify_one();
        }
    }

    /// Drops cached certificates of identities not in `keep`.
    pub fn retain(&self, keep: impl Fn(&SpiffeId) -> bool) {
        self.inner
            .slots
            .lock()
            .expect("certificate cache lock")
            .retain(|id, _| keep(id));
    }

    /// Renews certificates and watches the trust files, until dropped. Runs in a
    /// task of its own.
    pub async fn run(&self) {
        tokio::join!(self.refresh(), self.watch_trust());
    }
}

impl Inner {
    fn generation(&self) -> Arc<Generation> {
        self.trust.read().expect("trust lock").clone()
    }

    /// The slot of `id`, and whether it was made now.
    fn slot(&self, id: &SpiffeId) -> (Arc<Slot>, bool) {
        let mut slots = self.slots.lock().expect("certificate cache lock");
        if let Some(slot) = slots.get(id) {
            return (slot.clone(), false);
        }
        let slot = Arc::new(Slot {
            id: id.clone(),
            state: Mutex::default(),
            issuing: tokio::sync::Mutex::new(()),
        });
        slots.insert(id.clone(), slot.clone());
        (slot, true)
    }

    fn snapshot(&self) -> Vec<Arc<Slot>> {
        self.slots
            .lock()
            .expect("certificate cache lock")
            .values()
            .cloned()
            .collect()
    }

    /// Issues a certificate for `slot` under the trust in force and records the
    /// outcome. The caller holds `slot.issuing`.
    async fn issue(&self, slot: &Slot) -> Result<Arc<WorkloadIdentity>, Error> {
        let generation = self.generation();
        let result = match self.try_fail() {
            Err(e) => Err(e),
            Ok(()) => self
                .source
                .issue(&generation.trust, &slot.id, self.lifetime)
                .await
                .and_then(|cert| self.build(cert, &generation)),
        };
        let mut state = slot.state.lock().expect("certificate slot lock");
        state.attempts += 1;
        match result {
            Ok(identity) => {
                tracing::info!(
                    "issued the workload certificate of {}, valid until {}",
                    slot.id,
                    rfc3339(identity.not_after)
                );
                state.current = Some(identity.clone());
                state.failure = None;
                Ok(identity)
            }
            Err(e) => {
                let count = state.failure.as_ref().map_or(1, |f| f.count + 1);
                state.failure = Some(Failure {
                    reason: e.to_string(),
                    at: Instant::now(),
                    count,
                });
                Err(e)
            }
        }
    }

    #[cfg(test)]
    fn try_fail(&self) -> Result<(), Error> {
        if self
            .fail_issuance
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(Error::Unavailable {
                id: "test".into(),
                ago_ms: 0,
                reason: "injected failure".into(),
            });
        }
        Ok(())
    }

    #[cfg(not(test))]
    fn try_fail(&self) -> Result<(), Error> {
        Ok(())
    }

    fn build(
        &self,
        cert: WorkloadCertificate,
        generation: &Generation,
    ) -> Result<Arc<WorkloadIdentity>, Error> {
        let tls_err = |source| Error::Tls {
            id: cert.id.to_string(),
            source,
        };
        let signing_key = tls::provider()
            .key_provider
            .load_private_key(cert.key)
            .map_err(tls_err)?;
        let key = Arc::new(CertifiedKey::new(cert.chain, signing_key));
        let server = tls::server_config(
            key.clone(),
            generation.trust.store.clone(),
            &self.trust_domain,
        )
        .map_err(tls_err)?;
        let now = SystemTime::now();
        let left = cert.not_after.duration_since(now).unwrap_or_default();
        Ok(Arc::new(WorkloadIdentity {
            id: cert.id,
            key,
            server: Arc::new(server),
            not_after: cert.not_after,
            renew_at: now + left / 2,
            generation: generation.number,
        }))
    }
}
