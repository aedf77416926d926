//! Unit tests of the certificate manager.

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
