//! rustls configurations for HBONE: TLS 1.3 only, mutual authentication, ALPN `h2`,
//! and SPIFFE identity checks on both sides.
//!
//! * The client (outbound) presents the source workload's certificate and accepts
//!   only a server whose certificate chains to the mesh roots and carries exactly
//!   the destination workload's SPIFFE ID.
//! * The server (inbound) presents the destination workload's certificate and
//!   accepts only clients whose certificate chains to the mesh roots and carries a
//!   SPIFFE ID of the mesh's trust domain.

use std::sync::Arc;

use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, Error as TlsError,
    OtherError, RootCertStore, ServerConfig, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls13_signature},
    pki_types::{CertificateDer, ServerName, UnixTime},
    server::{
        ParsedCertificate, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
    sign::CertifiedKey,
};

use super::{SpiffeId, ca::spiffe_id_of};

/// ALPN protocol of HBONE (HTTP/2).
pub const ALPN_H2: &[u8] = b"h2";

/// The process-wide crypto provider (ring).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A trust bundle as a rustls root store.
///
/// # Errors
/// A root that rustls cannot use as a trust anchor.
pub fn root_store(roots: &[CertificateDer<'static>]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for root in roots {
        store.add(root.clone())?;
    }
    Ok(Arc::new(store))
}

fn identity_error(what: String) -> TlsError {
    TlsError::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(
        std::io::Error::other(what),
    ))))
}

/// Server configuration presenting `key` and requiring a client certificate of
/// `trust_domain` signed by `roots`.
///
/// # Errors
/// A root store rustls refuses.
pub fn server_config(
    key: Arc<CertifiedKey>,
    roots: Arc<RootCertStore>,
    trust_domain: &str,
) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let inner = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| TlsError::General(format!("client verifier: {e}")))?;
    let verifier = Arc::new(SpiffeClientVerifier {
        inner,
        trust_domain: trust_domain.to_string(),
    });
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(SingleCert(key)));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(config)
}

/// Client configuration presenting `key` and requiring the server to be `expected`.
///
/// # Errors
/// None in practice (TLS 1.3 is always supported by the ring provider).
pub fn client_config(
    key: Arc<CertifiedKey>,
    roots: Arc<RootCertStore>,
    expected: SpiffeId,
) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let verifier = Arc::new(SpiffeServerVerifier {
        roots,
        expected,
        algs: provider.signature_verification_algorithms,
    });
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(Arc::new(SingleCert(key)));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    // HBONE connections are pooled; resumption would only save a handshake rarely
    // and would outlive certificate rotation.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

/// The SPIFFE ID of a verified peer (its first certificate).
///
/// # Errors
/// When the peer sent no certificate or it carries no workload SPIFFE ID.
pub fn peer_identity(certs: Option<&[CertificateDer<'_>]>) -> Result<SpiffeId, String> {
    let leaf = certs
        .and_then(|c| c.first())
        .ok_or("the peer presented no certificate")?;
    spiffe_id_of(leaf).map_err(|e| e.to_string())
}

#[derive(Debug)]
struct SingleCert(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for SingleCert {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

impl rustls::client::ResolvesClientCert for SingleCert {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Verifies the server's chain to the mesh roots and its SPIFFE ID. Server names are
/// not used: HBONE peers are named by SPIFFE ID, not DNS.
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: Arc<RootCertStore>,
    expected: SpiffeId,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        let id = spiffe_id_of(end_entity)
            .map_err(|e| identity_error(format!("server certificate: {e}")))?;
        if id != self.expected {
            return Err(identity_error(format!(
                "server identity {id} is not the destination's {}",
                self.expected
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        Err(TlsError::General("TLS 1.2 is not accepted".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// WebPKI client verification to the mesh roots, plus: the client's SPIFFE ID must
/// belong to the mesh's trust domain.
#[derive(Debug)]
struct SpiffeClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domain: String,
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, TlsError> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let id = spiffe_id_of(end_entity)
            .map_err(|e| identity_error(format!("client certificate: {e}")))?;
        if id.trust_domain() != self.trust_domain {
            return Err(identity_error(format!(
                "client identity {id} is not in trust domain {}",
                self.trust_domain
            )));
        }
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    use super::*;
    use crate::identity::ca::{CertificateAuthority, init};

    /// A local CA for tests, with its roots.
    pub(crate) struct Mesh {
        ca: CertificateAuthority,
        pub(crate) roots: Arc<RootCertStore>,
        _dir: tempfile::TempDir,
    }

    impl Mesh {
        pub(crate) fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            init(dir.path()).unwrap();
            let ca = CertificateAuthority::load(dir.path()).unwrap();
            let roots = root_store(ca.roots()).unwrap();
            Self {
                ca,
                roots,
                _dir: dir,
            }
        }

        /// The server configuration of `server` and the client configuration of
        /// `client` expecting it, both of this CA.
        pub(crate) fn configs(
            &self,
            server: &SpiffeId,
            client: &SpiffeId,
        ) -> (ServerConfig, ClientConfig) {
            let server_config =
                server_config(self.key(server), self.roots.clone(), "cluster.local").unwrap();
            let client_config =
                client_config(self.key(client), self.roots.clone(), server.clone()).unwrap();
            (server_config, client_config)
        }

        /// A certificate of `id` from the CA, with its key.
        pub(crate) fn key(&self, id: &SpiffeId) -> Arc<CertifiedKey> {
            let cert = self.ca.issue(id, Duration::from_secs(600)).unwrap();
            let key = provider().key_provider.load_private_key(cert.key).unwrap();
            Arc::new(CertifiedKey::new(cert.chain, key))
        }
    }

    /// Runs one handshake; returns the server's view of the client identity or the
    /// error either side saw.
    async fn handshake(server: ServerConfig, client: ClientConfig) -> Result<SpiffeId, String> {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let acceptor = TlsAcceptor::from(Arc::new(server));
        let connector = TlsConnector::from(Arc::new(client));
        let server = tokio::spawn(async move {
            let mut tls = acceptor.accept(a).await.map_err(|e| e.to_string())?;
            let id = peer_identity(tls.get_ref().1.peer_certificates())?;
            assert_eq!(tls.get_ref().1.alpn_protocol(), Some(ALPN_H2));
            let mut buf = [0; 4];
            tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
            tls.write_all(b"pong").await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(id)
        });
        let name = ServerName::IpAddress(std::net::Ipv4Addr::new(10, 0, 0, 1).into());
        let client_result = async {
            let mut tls = connector
                .connect(name, b)
                .await
                .map_err(|e| e.to_string())?;
            tls.write_all(b"ping").await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
            let mut buf = [0; 4];
            tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
            assert_eq!(&buf, b"pong");
            Ok::<_, String>(())
        }
        .await;
        let server_result = server.await.unwrap();
        match (client_result, server_result) {
            (Ok(()), server) => server,
            (Err(c), Ok(_)) => Err(c),
            (Err(c), Err(s)) => Err(format!("client: {c}; server: {s}")),
        }
    }

    #[tokio::test]
    async fn mutual_tls_with_expected_identities() {
        let mesh = Mesh::new();
        let client_id = SpiffeId::new("cluster.local", "ns1", "client");
        let server_id = SpiffeId::new("cluster.local", "ns2", "server");
        let (server, client) = mesh.configs(&server_id, &client_id);
        assert_eq!(handshake(server, client).await.unwrap(), client_id);
    }

    #[tokio::test]
    async fn client_refuses_a_server_with_another_identity() {
        let mesh = Mesh::new();
        let server = server_config(
            mesh.key(&SpiffeId::new("cluster.local", "ns2", "impostor")),
            mesh.roots.clone(),
            "cluster.local",
        )
        .unwrap();
        let client = client_config(
            mesh.key(&SpiffeId::new("cluster.local", "ns1", "client")),
            mesh.roots.clone(),
            SpiffeId::new("cluster.local", "ns2", "server"),
        )
        .unwrap();
        let err = handshake(server, client).await.unwrap_err();
        assert!(err.contains("is not the destination's"), "{err}");
    }

    #[tokio::test]
    async fn server_refuses_a_client_of_another_ca() {
        let mesh = Mesh::new();
        let other = Mesh::new();
        let server_id = SpiffeId::new("cluster.local", "ns2", "server");
        let server =
            server_config(mesh.key(&server_id), mesh.roots.clone(), "cluster.local").unwrap();
        // The client trusts the server's CA but its own certificate is from another CA.
        let client = client_config(
            other.key(&SpiffeId::new("cluster.local", "ns1", "client")),
            mesh.roots.clone(),
            server_id,
        )
        .unwrap();
        let err = handshake(server, client).await.unwrap_err();
        // Both development CAs share a name, so the chain is built and then fails
        // on the signature; with different names it would be UnknownIssuer.
        assert!(err.contains("invalid peer certificate"), "{err}");
    }

    #[tokio::test]
    async fn server_refuses_a_client_of_another_trust_domain() {
        let mesh = Mesh::new();
        let server_id = SpiffeId::new("cluster.local", "ns2", "server");
        let server =
            server_config(mesh.key(&server_id), mesh.roots.clone(), "cluster.local").unwrap();
        let client = client_config(
            mesh.key(&SpiffeId::new("other.domain", "ns1", "client")),
            mesh.roots.clone(),
            server_id,
        )
        .unwrap();
        let err = handshake(server, client).await.unwrap_err();
        assert!(err.contains("not in trust domain cluster.local"), "{err}");
    }
}
