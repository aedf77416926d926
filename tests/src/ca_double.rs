//! A CA double: an Istio-compatible CA for the tests, written independently of the
//! agent's client so that the two check each other.
//!
//! It serves `istio.v1.auth.IstioCertificateService/CreateCertificate` (istio/api
//! `security/v1alpha1/ca.proto`) as gRPC over HTTP/2 + TLS, with h2 and
//! tokio-rustls directly: a request is one length-prefixed protobuf message; the
//! answer is the message then the `grpc-status` trailer, or a trailers-only error.
//! It has a CA of its own (made by rcgen) that signs both its serving certificate
//! (for its IP address) and the workload certificates; [`CaDouble::root_pem`] is
//! the trust bundle to give the agents.
//!
//! Each request must carry `authorization: Bearer <token>` with the expected token
//! (else `UNAUTHENTICATED`, 16), a CSR whose only SAN is the
//! `metadata.ImpersonatedIdentity` (else `PERMISSION_DENIED`, 7); the certificate
//! is valid for the requested `validity_duration`. Every request is recorded.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use bytes::{Buf, Bytes, BytesMut};
use h2::server::SendResponse;
use http::{HeaderMap, Request, Response};
use prost::Message;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::netns;

/// The gRPC path served.
const PATH: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// `istio.v1.auth.IstioCertificateRequest` (fields 1, 3, 4).
#[derive(Clone, PartialEq, prost::Message)]
struct IstioCertificateRequest {
    #[prost(string, tag = "1")]
    csr: String,
    #[prost(int64, tag = "3")]
    validity_duration: i64,
    #[prost(message, optional, tag = "4")]
    metadata: Option<prost_types::Struct>,
}

/// `istio.v1.auth.IstioCertificateResponse` (field 1).
#[derive(Clone, PartialEq, prost::Message)]
struct IstioCertificateResponse {
    #[prost(string, repeated, tag = "1")]
    cert_chain: Vec<String>,
}

/// One `CreateCertificate` request as the double saw it.
#[derive(Clone, Debug)]
pub struct CaRequest {
    /// The client's address (the agent's node).
    pub peer: SocketAddr,
    /// The bearer token sent (`authorization: Bearer <token>`), if any.
    pub token: Option<String>,
    /// The `clusterid` header, if any.
    pub cluster_id: Option<String>,
    /// `metadata.ImpersonatedIdentity`, if any.
    pub impersonated: Option<String>,
    /// The URI SANs of the CSR.
    pub csr_uris: Vec<String>,
    /// The requested validity, seconds.
    pub validity_secs: i64,
    /// `None` when a certificate was issued; else the gRPC status code and
    /// message answered.
    pub refused: Option<(u32, String)>,
}

struct Shared {
    token: String,
    issuer: Issuer<'static, KeyPair>,
    root_pem: String,
    requests: Vec<CaRequest>,
}

/// A running CA double; stops when dropped.
pub struct CaDouble {
    /// `https://<ip>:<port>`, for `--ca-address`.
    pub address: String,
    /// The double's root certificate (PEM), for `--ca-root-cert`.
    pub root_pem: String,
    shared: Arc<Mutex<Shared>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl CaDouble {
    /// Starts a double listening on `addr` inside network namespace `netns`,
    /// accepting the bearer token `token`.
    ///
    /// # Errors
    /// Making the certificates or binding the address.
    pub fn start(netns_name: &str, addr: SocketAddr, token: &str) -> Result<Self> {
        let ca_key = KeyPair::generate().context("CA key")?;
        let mut ca_params = CertificateParams::default();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "CA double root");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).context("CA certificate")?;
        let root_pem = ca_cert.pem();
        let issuer = Issuer::new(ca_params, ca_key);

        let server_key = KeyPair::generate().context("server key")?;
        let mut server_params = CertificateParams::default();
        server_params.subject_alt_names = vec![SanType::IpAddress(addr.ip())];
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server_params
            .signed_by(&server_key, &issuer)
            .context("server certificate")?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![server_cert.der().clone(), ca_cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
            )?;
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

        let listener = netns::in_netns(netns_name, move || {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .with_context(|| format!("binding the CA double to {addr} in {netns_name}"))?;
        let shared = Arc::new(Mutex::new(Shared {
            token: token.to_string(),
            issuer,
            root_pem: root_pem.clone(),
            requests: Vec::new(),
        }));
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let thread = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the CA double");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                    loop {
                        let (tcp, peer) = tokio::select! {
                            accepted = listener.accept() => match accepted {
                                Ok(accepted) => accepted,
                                Err(_) => continue,
                            },
                            _ = &mut stopped => break,
                        };
                        let acceptor = acceptor.clone();
                        let shared = shared.clone();
                        tokio::spawn(async move {
                            let _ = serve_connection(acceptor, tcp, peer, shared).await;
                        });
                    }
                });
            })
        };
        Ok(Self {
            address: format!("https://{addr}"),
            root_pem,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The requests so far, oldest first.
    pub fn requests(&self) -> Vec<CaRequest> {
        self.shared.lock().unwrap().requests.clone()
    }
}

impl Drop for CaDouble {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve_connection(
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    shared: Arc<Mutex<Shared>>,
) -> Result<()> {
    let tls = acceptor.accept(tcp).await?;
    let mut conn = h2::server::handshake(tls).await?;
    while let Some(request) = conn.accept().await {
        let (request, respond) = request?;
        let shared = shared.clone();
        tokio::spawn(async move {
            let _ = serve_request(request, respond, peer, shared).await;
        });
    }
    Ok(())
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn serve_request(
    request: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    peer: SocketAddr,
    shared: Arc<Mutex<Shared>>,
) -> Result<()> {
    let (parts, mut body) = request.into_parts();
    let mut data = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    if parts.uri.path() != PATH {
        return refuse(respond, 12, "unknown method");
    }
    // One uncompressed length-prefixed message.
    if data.len() < 5 || data[0] != 0 {
        return refuse(respond, 3, "not one uncompressed gRPC message");
    }
    let mut frame = data.freeze();
    frame.advance(1);
    let len = frame.get_u32() as usize;
    if frame.len() != len {
        return refuse(respond, 3, "gRPC message length mismatch");
    }
    let message = match IstioCertificateRequest::decode(frame) {
        Ok(message) => message,
        Err(e) => return refuse(respond, 3, &format!("malformed request: {e}")),
    };
    let token = header(&parts.headers, "authorization")
        .map(|v| v.strip_prefix("Bearer ").map(str::to_string).unwrap_or(v));
    let impersonated = message
        .metadata
        .as_ref()
        .and_then(|m| m.fields.get("ImpersonatedIdentity"))
        .and_then(|v| match &v.kind {
            Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    let csr = CertificateSigningRequestParams::from_pem(&message.csr);
    let csr_uris = csr
        .as_ref()
        .map(|c| {
            c.params
                .subject_alt_names
                .iter()
                .filter_map(|san| match san {
                    SanType::URI(uri) => Some(uri.as_str().to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let mut shared = shared.lock().unwrap();
    let mut record = CaRequest {
        peer,
        token: token.clone(),
        cluster_id: header(&parts.headers, "clusterid"),
        impersonated: impersonated.clone(),
        csr_uris,
        validity_secs: message.validity_duration,
        refused: None,
    };
    let outcome = (|| {
        if token.as_deref() != Some(shared.token.as_str()) {
            return Err((
                16,
                "authentication failure: unknown bearer token".to_string(),
            ));
        }
        let mut csr = csr.map_err(|e| (3, format!("malformed CSR: {e}")))?;
        let Some(identity) = impersonated else {
            return Err((3, "no ImpersonatedIdentity in the metadata".to_string()));
        };
        if record.csr_uris != [identity.clone()] {
            return Err((
                7,
                format!(
                    "the CSR's SANs {:?} are not the impersonated identity {identity}",
                    record.csr_uris
                ),
            ));
        }
        let validity = u64::try_from(message.validity_duration)
            .ok()
            .filter(|v| *v > 0)
            .ok_or((3, "validity_duration must be positive".to_string()))?;
        let now = SystemTime::now();
        csr.params.not_before = (now - Duration::from_secs(60)).into();
        csr.params.not_after = (now + Duration::from_secs(validity)).into();
        csr.params.is_ca = IsCa::ExplicitNoCa;
        csr.params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        csr.params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = csr
            .signed_by(&shared.issuer)
            .map_err(|e| (13, format!("signing: {e}")))?;
        Ok(vec![leaf.pem(), shared.root_pem.clone()])
    })();
    record.refused = outcome.as_ref().err().cloned();
    shared.requests.push(record);
    drop(shared);
    match outcome {
        Err((code, message)) => refuse(respond, code, &message),
        Ok(cert_chain) => {
            let body = IstioCertificateResponse { cert_chain }.encode_to_vec();
            let mut framed = BytesMut::with_capacity(body.len() + 5);
            framed.extend_from_slice(&[0]);
            framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
            framed.extend_from_slice(&body);
            let response = Response::builder()
                .header("content-type", "application/grpc")
                .body(())?;
            let mut send = respond.send_response(response, false)?;
            send.send_data(framed.freeze(), false)?;
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", "0".parse()?);
            send.send_trailers(trailers)?;
            Ok(())
        }
    }
}

/// A trailers-only gRPC error.
fn refuse(mut respond: SendResponse<Bytes>, code: u32, message: &str) -> Result<()> {
    let response = Response::builder()
        .header("content-type", "application/grpc")
        .header("grpc-status", code.to_string())
        .header("grpc-message", message.replace(['\r', '\n'], " "))
        .body(())?;
    respond.send_response(response, true)?;
    Ok(())
}
