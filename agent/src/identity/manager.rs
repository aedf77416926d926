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

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant, SystemTime},
};

use rustls::{ClientConfig, ServerConfig, sign::CertifiedKey};
use tokio::sync::{Notify, mpsc, watch};

use super::{
    SpiffeId,
    ca::{CaError, WorkloadCertificate},
    istio_ca::IstioCaError,
    source::{self, CertSource, Trust},
    tls,
};

/// A connection needing a certificate whose issuance failed less than this long
/// ago fails at once with that error, instead of asking the CA again.
const FAILED_RECENTLY: Duration = Duration::from_secs(1);
/// Background retries after a failure: the first after this long, doubling.
const RETRY_MIN: Duration = Duration::from_secs(1);
/// The longest wait between background retries.
const RETRY_MAX: Duration = Duration::from_secs(15);
/// The refresher looks at the certificates at least this often.
const REFRESH_MAX_SLEEP: Duration = Duration::from_secs(30);
/// The trust files are checked this often even without a change event (events
/// can be lost, and a watch on a directory that does not exist yet fails).
const CA_POLL: Duration = Duration::from_secs(5);
/// After a change, the files must read the same twice this far apart before they
/// are loaded (a writer that replaces `ca.crt` and `ca.key` one after the other).
const CA_SETTLE: Duration = Duration::from_millis(100);

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

/// Errors of the certificate manager.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
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

/// The last failed issuance, while no later one succeeded.
struct Failure {
    reason: String,
    at: Instant,
    /// Consecutive failures.
    count: u32,
}

impl Failure {
    fn retry_at(&self) -> Instant {
        let exp = self.count.saturating_sub(1).min(16);
        self.at + (RETRY_MIN * 2u32.pow(exp)).min(RETRY_MAX)
    }

    fn unavailable(&self, id: &SpiffeId) -> IdentityError {
        IdentityError::Unavailable {
            id: id.to_string(),
            ago_ms: self.at.elapsed().as_millis(),
            reason: self.reason.clone(),
        }
    }
}

impl SlotState {
    /// The current certificate, if it is still valid.
    fn usable(&self) -> Option<Arc<WorkloadIdentity>> {
        self.current
            .clone()
            .filter(|c| SystemTime::now() < c.not_after)
    }

    /// How long until the refresher should issue again (zero: now).
    fn due_in(&self) -> Duration {
        match (&self.current, &self.failure) {
            (_, Some(failure)) => failure.retry_at().saturating_duration_since(Instant::now()),
            (Some(current), None) => current
                .renew_at
                .duration_since(SystemTime::now())
                .unwrap_or_default(),
            (None, None) => Duration::ZERO,
        }
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
    pub fn new(
        source: CertSource,
        trust_domain: &str,
        lifetime: Duration,
    ) -> Result<Self, IdentityError> {
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
    /// [`IdentityError::Unavailable`] when an issuance failed less than a second
    /// ago (also the one this request waited for).
    pub async fn identity(&self, id: &SpiffeId) -> Result<Arc<WorkloadIdentity>, IdentityError> {
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
    pub fn server_config(
        &self,
        identity: &WorkloadIdentity,
    ) -> Result<Arc<ServerConfig>, IdentityError> {
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
        .map_err(|source| IdentityError::Tls {
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
    ) -> Result<Arc<ClientConfig>, IdentityError> {
        let identity = self.identity(src).await?;
        let roots = self.inner.generation().trust.store.clone();
        let config =
            tls::client_config(identity.key.clone(), roots, dst.clone()).map_err(|source| {
                IdentityError::Tls {
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

    /// The background refresher: issues prefetched identities, renews
    /// certificates past half their lifetime, retries failures with backoff, and
    /// drops expired certificates.
    async fn refresh(&self) {
        loop {
            let mut sleep = REFRESH_MAX_SLEEP;
            let mut due = Vec::new();
            for slot in self.inner.snapshot() {
                let mut state = slot.state.lock().expect("certificate slot lock");
                if let Some(current) = &state.current {
                    match current.not_after.duration_since(SystemTime::now()) {
                        Ok(left) => sleep = sleep.min(left),
                        Err(_) => {
                            tracing::error!(
                                "the workload certificate of {} expired at {} and could not be renewed; connections needing it fail until a new one is issued{}",
                                slot.id,
                                rfc3339(current.not_after),
                                state
                                    .failure
                                    .as_ref()
                                    .map(|f| format!(" (last error: {})", f.reason))
                                    .unwrap_or_default()
                            );
                            state.current = None;
                        }
                    }
                }
                let due_in = state.due_in();
                if due_in.is_zero() {
                    due.push(slot.clone());
                } else {
                    sleep = sleep.min(due_in);
                }
            }
            if due.is_empty() {
                tokio::select! {
                    () = tokio::time::sleep(sleep) => {}
                    () = self.inner.wake.notified() => {}
                }
                continue;
            }
            let mut renewals = tokio::task::JoinSet::new();
            for slot in due {
                let this = self.clone();
                renewals.spawn(async move { this.renew(&slot).await });
            }
            while renewals.join_next().await.is_some() {}
        }
    }

    /// Issues a certificate for `slot` if it is (still) due; logs a failure.
    async fn renew(&self, slot: &Arc<Slot>) {
        let _issuing = slot.issuing.lock().await;
        let previous = {
            let state = slot.state.lock().expect("certificate slot lock");
            if !state.due_in().is_zero() {
                return;
            }
            state.current.clone()
        };
        if let Err(e) = self.inner.issue(slot).await {
            let (count, retry_in) = {
                let state = slot.state.lock().expect("certificate slot lock");
                let failure = state.failure.as_ref().expect("a failure was recorded");
                (
                    failure.count,
                    failure.retry_at().saturating_duration_since(Instant::now()),
                )
            };
            match previous.filter(|p| SystemTime::now() < p.not_after) {
                Some(previous) => tracing::warn!(
                    "renewing the workload certificate of {} failed ({count} in a row); keeping the current one, valid until {}; retrying in {:.1} s: {e}",
                    slot.id,
                    rfc3339(previous.not_after),
                    retry_in.as_secs_f64(),
                ),
                None => tracing::warn!(
                    "issuing the workload certificate of {} failed ({count} in a row); retrying in {:.1} s: {e}",
                    slot.id,
                    retry_in.as_secs_f64(),
                ),
            }
        }
    }

    /// Checks the trust files now; if they changed and are valid, puts them in
    /// force and reissues every cached certificate. Returns how many were
    /// reissued, or `None` when the files are unchanged.
    ///
    /// # Errors
    /// Files that cannot be read or are not valid, naming the file and what is
    /// wrong; the trust in force is then kept.
    pub async fn reload(&self) -> Result<Option<usize>, IdentityError> {
        let source = &self.inner.source;
        let mut contents = source.read()?;
        loop {
            if contents == self.inner.generation().trust.contents() {
                return Ok(None);
            }
            tokio::time::sleep(CA_SETTLE).await;
            let again = source.read()?;
            if again == contents {
                break;
            }
            contents = again;
        }
        let trust = source.parse(contents)?;
        let anchors = trust.roots.len();
        let number = {
            let mut current = self.inner.trust.write().expect("trust lock");
            let number = current.number + 1;
            *current = Arc::new(Generation { trust, number });
            number
        };
        let mut reissues = tokio::task::JoinSet::new();
        for slot in self.inner.snapshot() {
            let this = self.clone();
            reissues.spawn(async move {
                let _issuing = slot.issuing.lock().await;
                let fresh = {
                    let state = slot.state.lock().expect("certificate slot lock");
                    state.current.as_ref().map(|c| c.generation) >= Some(number)
                };
                if fresh {
                    return true;
                }
                match this.inner.issue(&slot).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(
                            "reissuing the workload certificate of {} under the new CA failed; keeping the current one while it is valid: {e}",
                            slot.id
                        );
                        false
                    }
                }
            });
        }
        let (mut reissued, mut failed) = (0, 0);
        while let Some(done) = reissues.join_next().await {
            match done {
                Ok(true) => reissued += 1,
                _ => failed += 1,
            }
        }
        tracing::info!(
            "CA changed: reissued {reissued} workload certificates{} ({}, {anchors} trust anchors)",
            if failed > 0 {
                format!(", {failed} failed")
            } else {
                String::new()
            },
            source.describe(),
        );
        self.inner.changes.send_replace(number);
        Ok(Some(reissued))
    }

    /// Watches the trust files' directories (a Kubernetes Secret mount swaps its
    /// `..data` symlink) and polls them; reloads on a change, logging a refusal
    /// once per distinct error.
    async fn watch_trust(&self) {
        let (tx, mut events) = mpsc::channel(1);
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let change = match event {
                Ok(e) => !matches!(e.kind, notify::EventKind::Access(_)),
                Err(_) => true,
            };
            if change {
                let _ = tx.try_send(());
            }
        });
        let _watcher = match watcher {
            Ok(mut watcher) => {
                for dir in source::parent_dirs(&self.inner.source.files()) {
                    if let Err(e) = notify::Watcher::watch(
                        &mut watcher,
                        &dir,
                        notify::RecursiveMode::NonRecursive,
                    ) {
                        tracing::warn!(
                            "watching {}: {e}; checking it every {CA_POLL:?} instead",
                            dir.display()
                        );
                    }
                }
                Some(watcher)
            }
            Err(e) => {
                tracing::warn!(
                    "watching the CA files: {e}; checking them every {CA_POLL:?} instead"
                );
                None
            }
        };
        let mut last_error: Option<String> = None;
        loop {
            tokio::select! {
                Some(()) = events.recv() => {}
                () = tokio::time::sleep(CA_POLL) => {}
            }
            match self.reload().await {
                Ok(_) => last_error = None,
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_ref() != Some(&text) {
                        tracing::error!(
                            "CA files refused, keeping the CA in force ({}): {text}",
                            self.inner.source.describe()
                        );
                        last_error = Some(text);
                    }
                }
            }
        }
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
    async fn issue(&self, slot: &Slot) -> Result<Arc<WorkloadIdentity>, IdentityError> {
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
    fn try_fail(&self) -> Result<(), IdentityError> {
        if self
            .fail_issuance
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(IdentityError::Unavailable {
                id: "test".into(),
                ago_ms: 0,
                reason: "injected failure".into(),
            });
        }
        Ok(())
    }

    #[cfg(not(test))]
    fn try_fail(&self) -> Result<(), IdentityError> {
        Ok(())
    }

    fn build(
        &self,
        cert: WorkloadCertificate,
        generation: &Generation,
    ) -> Result<Arc<WorkloadIdentity>, IdentityError> {
        let tls_err = |source| IdentityError::Tls {
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

#[cfg(test)]
mod tests {
    use std::{fs, path::Path};

    use super::*;
    use crate::identity::ca::{CA_CERT_FILE, CA_KEY_FILE, generate_ca, init, spiffe_id_of};

    fn manager(lifetime: Duration) -> (CertManager, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path()).unwrap();
        let source = CertSource::Local {
            dir: dir.path().to_path_buf(),
        };
        (
            CertManager::new(source, "cluster.local", lifetime).unwrap(),
            dir,
        )
    }

    fn id(sa: &str) -> SpiffeId {
        SpiffeId::new("cluster.local", "ns", sa)
    }

    /// Polls `check` every 10 ms until it holds; panics with `what` after 10 s.
    async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !check() {
            assert!(Instant::now() < deadline, "never happened: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Replaces a file by rename, as a careful writer does.
    fn replace(path: &Path, text: &str) {
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, path).unwrap();
    }

    #[tokio::test]
    async fn caches_and_issues_once_for_concurrent_requests() {
        let (m, _dir) = manager(Duration::from_secs(3600));
        let requests: Vec<_> = (0..16)
            .map(|_| {
                let m = m.clone();
                tokio::spawn(async move { m.identity(&id("sa")).await.unwrap() })
            })
            .collect();
        let mut issued = Vec::new();
        for r in requests {
            issued.push(r.await.unwrap());
        }
        assert!(issued.iter().all(|i| Arc::ptr_eq(i, &issued[0])));
        let again = m.identity(&id("sa")).await.unwrap();
        assert!(Arc::ptr_eq(&again, &issued[0]));
        assert!(again.renew_at < again.not_after);
        assert_eq!(spiffe_id_of(&again.key.cert[0]).unwrap(), id("sa"));
    }

    #[tokio::test]
    async fn prefetches_and_renews_in_the_background() {
        let (m, _dir) = manager(Duration::from_millis(600));
        let runner = tokio::spawn({
            let m = m.clone();
            async move { m.run().await }
        });
        m.prefetch([id("sa")]);
        eventually("prefetched", || m.cached(&id("sa")).is_some()).await;
        let first = m.cached(&id("sa")).unwrap();
        eventually("renewed", || {
            m.cached(&id("sa"))
                .is_some_and(|c| !Arc::ptr_eq(&c, &first))
        })
        .await;
        let second = m.cached(&id("sa")).unwrap();
        assert!(second.not_after > first.not_after);
        assert_ne!(first.key.cert[0], second.key.cert[0]);
        runner.abort();
    }

    #[tokio::test]
    async fn keeps_the_old_certificate_while_renewal_fails_and_drops_it_once_expired() {
        let (m, _dir) = manager(Duration::from_millis(800));
        let first = m.identity(&id("sa")).await.unwrap();
        m.inner
            .fail_issuance
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let runner = tokio::spawn({
            let m = m.clone();
            async move { m.run().await }
        });
        let slot = m.inner.slot(&id("sa")).0;
        let failures = || {
            slot.state
                .lock()
                .unwrap()
                .failure
                .as_ref()
                .map_or(0, |f| f.count)
        };
        eventually("a renewal failed", || failures() > 0).await;
        if SystemTime::now() < first.not_after {
            let kept = m.identity(&id("sa")).await.unwrap();
            assert!(Arc::ptr_eq(&kept, &first));
        }
        eventually("the expired certificate dropped", || {
            m.cached(&id("sa")).is_none()
        })
        .await;
        let err = m.identity(&id("sa")).await.unwrap_err().to_string();
        assert!(err.contains("injected failure"), "{err}");
        // Issuance works again: the retry brings a certificate back.
        m.inner
            .fail_issuance
            .store(false, std::sync::atomic::Ordering::Relaxed);
        eventually("issued again", || m.cached(&id("sa")).is_some()).await;
        runner.abort();
    }

    #[tokio::test]
    async fn a_ca_change_reissues_and_a_bad_one_is_refused() {
        let (m, dir) = manager(Duration::from_secs(3600));
        let (cert, key) = (dir.path().join(CA_CERT_FILE), dir.path().join(CA_KEY_FILE));
        let old_cert = fs::read_to_string(&cert).unwrap();
        let old_key = fs::read_to_string(&key).unwrap();
        let (new_cert, new_key) = generate_ca("new").unwrap();
        let first = m.identity(&id("sa")).await.unwrap();
        assert_eq!(m.reload().await.unwrap(), None);

        // Phase 1: both roots trusted, the old one signs.
        replace(&cert, &format!("{old_cert}{new_cert}"));
        assert_eq!(m.reload().await.unwrap(), Some(1));
        assert_eq!(m.roots().len(), 2);
        let second = m.identity(&id("sa")).await.unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(*m.ca_changes().borrow(), 2);

        // Phase 2: the new one signs.
        replace(&cert, &format!("{new_cert}{old_cert}"));
        replace(&key, &new_key);
        assert_eq!(m.reload().await.unwrap(), Some(1));
        let third = m.identity(&id("sa")).await.unwrap();
        assert_eq!(third.key.cert[1], m.roots()[0]);
        assert_ne!(third.key.cert[1], second.key.cert[1]);

        // Garbage is refused, naming the file; the CA in force stays.
        replace(&cert, "garbage");
        let err = m.reload().await.unwrap_err().to_string();
        assert!(
            err.contains("ca.crt") && err.contains("no PEM certificate"),
            "{err}"
        );
        assert!(Arc::ptr_eq(&m.identity(&id("sa")).await.unwrap(), &third));
        // A key of another CA is refused too.
        replace(&cert, &new_cert);
        replace(&key, &old_key);
        let err = m.reload().await.unwrap_err().to_string();
        assert!(err.contains("does not belong"), "{err}");
        assert_eq!(m.roots().len(), 2);
    }

    #[tokio::test]
    async fn client_configs_present_the_source_identity() {
        let (m, _dir) = manager(Duration::from_secs(3600));
        m.client_config(&id("a"), &id("b")).await.unwrap();
        assert!(m.cached(&id("a")).is_some());
        m.retain(|i| *i != id("a"));
        assert!(m.cached(&id("a")).is_none());
    }

    /// A TLS handshake of a client presenting `client` and trusting `roots`
    /// against `server` (which must present `sa`).
    async fn handshake(
        server: Arc<ServerConfig>,
        client: Arc<CertifiedKey>,
        roots: Arc<rustls::RootCertStore>,
    ) -> Result<(), String> {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let accept = tokio::spawn(async move {
            tokio_rustls::TlsAcceptor::from(server)
                .accept(a)
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        });
        let config = tls::client_config(client, roots, id("sa")).unwrap();
        let name = rustls_pki_types::ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
        // The client's stream lives until the server is done (it writes session
        // tickets after the handshake).
        let connected = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, b)
            .await
            .map_err(|e| e.to_string());
        let accepted = accept.await.unwrap();
        accepted.and(connected.map(drop))
    }

    fn client_key(dir: &Path, sa: &str) -> Arc<CertifiedKey> {
        let ca = crate::identity::ca::CertificateAuthority::load(dir).unwrap();
        let cert = ca.issue(&id(sa), Duration::from_secs(600)).unwrap();
        let key = tls::provider()
            .key_provider
            .load_private_key(cert.key)
            .unwrap();
        Arc::new(CertifiedKey::new(cert.chain, key))
    }

    #[tokio::test]
    async fn inbound_trusts_only_the_roots_in_force_even_when_the_reissue_fails() {
        let (m, dir) = manager(Duration::from_secs(3600));
        let (cert, key) = (dir.path().join(CA_CERT_FILE), dir.path().join(CA_KEY_FILE));
        let old_client = client_key(dir.path(), "peer");
        let old_root = m.roots();
        m.identity(&id("sa")).await.unwrap();
        // The CA is replaced while issuing fails (a CA that cannot be reached).
        m.inner
            .fail_issuance
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let (new_cert, new_key) = generate_ca("new").unwrap();
        replace(&cert, &new_cert);
        replace(&key, &new_key);
        m.reload().await.unwrap();
        let new_client = client_key(dir.path(), "peer");
        let current = m.identity(&id("sa")).await.unwrap();
        // The server still presents the old certificate (clients trust both roots
        // here), but trusts only the new root.
        let both = tls::root_store(&[old_root, m.roots()].concat()).unwrap();
        let server = m.server_config(&current).unwrap();
        let accepted = handshake(server.clone(), new_client, both.clone()).await;
        assert!(accepted.is_ok(), "{accepted:?}");
        let refused = handshake(server, old_client, both).await.unwrap_err();
        assert!(
            refused.contains("UnknownIssuer") || refused.contains("unknown"),
            "{refused}"
        );
    }
}
