//! A client of an Istio-compatible CA (istiod): workload certificates from
//! `IstioCertificateService/CreateCertificate`, as ztunnel gets them.
//!
//! Protocol (istio/api `security/v1alpha1/ca.proto`, package `istio.v1.auth`):
//! gRPC over HTTP/2 + TLS, one unary call per certificate. The request carries a
//! PEM CSR (ECDSA P-256, no subject, one URI SAN: the workload's SPIFFE ID), the
//! requested validity in seconds, and `metadata.ImpersonatedIdentity` = that SPIFFE
//! ID: the node agent asks on behalf of the workloads of its node. The call's
//! metadata carries `authorization: Bearer <token>` (the node agent's Kubernetes
//! service account token, read from its file on every request, since the kubelet
//! rotates it) and `clusterid: <cluster id>` (ztunnel's `src/identity/auth.rs`).
//! The response's `cert_chain` is PEM, leaf first; an entry may hold several
//! certificates (roots concatenated), so every entry is split.
//!
//! The CA server's TLS certificate is verified against the mesh trust bundle
//! (`--ca-root-cert`), which also verifies the returned chains.

use std::{
    path::PathBuf,
    sync::Mutex,
    time::{Duration, SystemTime},
};

use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};
use rustls::{RootCertStore, server::ParsedCertificate};
use rustls_pki_types::{
    CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime, pem::PemObject,
};
use thiserror::Error;
use tonic::transport::Channel;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::{SpiffeId, ca::WorkloadCertificate, ca::spiffe_id_of, tls};
use crate::istiod;

/// The messages of `istio.v1.auth` (istio/api `security/v1alpha1/ca.proto`), with
/// the proto's field numbers.
pub mod proto {
    /// `IstioCertificateRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct IstioCertificateRequest {
        /// `string csr = 1`: the PEM certificate signing request.
        #[prost(string, tag = "1")]
        pub csr: String,
        /// `int64 validity_duration = 3`: requested validity, seconds.
        #[prost(int64, tag = "3")]
        pub validity_duration: i64,
        /// `google.protobuf.Struct metadata = 4`: `ImpersonatedIdentity` is the
        /// SPIFFE ID the certificate is for.
        #[prost(message, optional, tag = "4")]
        pub metadata: Option<prost_types::Struct>,
    }

    /// `IstioCertificateResponse` (field 2, `root_cert`, is not used: the trust
    /// bundle comes from `--ca-root-cert`).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct IstioCertificateResponse {
        /// `repeated string cert_chain = 1`: PEM, leaf first.
        #[prost(string, repeated, tag = "1")]
        pub cert_chain: Vec<String>,
    }

    /// The gRPC path of `CreateCertificate`.
    pub const CREATE_CERTIFICATE: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";
}

/// Default file of the node agent's token (a projected service account token
/// with audience `istio-ca`, where ztunnel reads it).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/tokens/istio-token";
/// Default cluster ID (Istio's default).
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";
/// Time allowed for one `CreateCertificate` call.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How to reach the Istio CA.
#[derive(Clone, Debug)]
pub struct IstioCaConfig {
    /// `https://host:port` of the CA (istiod: port 15012).
    pub address: String,
    /// PEM bundle of the mesh's root certificates: verifies the CA server and the
    /// issued chains. Watched and reloaded.
    pub root_cert: PathBuf,
    /// File of the bearer token, read on every request.
    pub token_file: PathBuf,
    /// Sent as the `clusterid` header.
    pub cluster_id: String,
}

/// Why a certificate could not be had from the Istio CA; each names the CA address
/// and, where there is one, the identity.
#[derive(Debug, Error)]
pub enum IstioCaError {
    #[error("Istio CA address {address:?}: {what}")]
    /// `--ca-address` is not usable.
    Address {
        /// The address given.
        address: String,
        /// What is wrong.
        what: String,
    },
    #[error(
        "certificate for {id} from the Istio CA {address}: reading the token file {path}: {what}"
    )]
    /// The token file cannot be read, is empty, or is not a valid header value.
    Token {
        /// The CA address.
        address: String,
        /// The identity asked for.
        id: String,
        /// The token file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    #[error("certificate for {id}: making the CSR: {source}")]
    /// Generating the key or the CSR failed.
    Csr {
        /// The identity asked for.
        id: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
    #[error("certificate for {id}: the Istio CA {address} refused or failed: {code:?}: {message}")]
    /// The call failed: a gRPC status from the CA (UNAUTHENTICATED, …) or from the
    /// transport (UNAVAILABLE for an unreachable CA, CANCELLED on a timeout).
    Rpc {
        /// The CA address.
        address: String,
        /// The identity asked for.
        id: String,
        /// The gRPC status code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    #[error("certificate for {id} from the Istio CA {address} refused: {what}")]
    /// The CA answered with a chain that is not usable for `id`.
    Response {
        /// The CA address.
        address: String,
        /// The identity asked for.
        id: String,
        /// What is wrong with the chain.
        what: String,
    },
}

/// A client of `IstioCertificateService`. The gRPC channel is made lazily and
/// again when the trust bundle changes.
pub struct IstioCaClient {
    config: IstioCaConfig,
    host: String,
    /// The trust bundle PEM the channel was made with, and the channel.
    channel: Mutex<Option<(Vec<u8>, Channel)>>,
}

impl std::fmt::Debug for IstioCaClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IstioCaClient")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl IstioCaClient {
    /// A client for `config`; nothing is connected yet.
    ///
    /// # Errors
    /// [`IstioCaError::Address`] unless the address is `https://host:port`.
    pub fn new(config: IstioCaConfig) -> Result<Self, IstioCaError> {
        let host = istiod::host_of(&config.address).map_err(|what| IstioCaError::Address {
            address: config.address.clone(),
            what,
        })?;
        Ok(Self {
            config,
            host,
            channel: Mutex::new(None),
        })
    }

    /// The settings.
    pub fn config(&self) -> &IstioCaConfig {
        &self.config
    }

    fn channel(&self, roots_pem: &[u8]) -> Result<Channel, IstioCaError> {
        let mut cached = self.channel.lock().expect("CA channel lock");
        if let Some((pem, channel)) = cached.as_ref()
            && pem == roots_pem
        {
            return Ok(channel.clone());
        }
        let bad = |what: String| IstioCaError::Address {
            address: self.config.address.clone(),
            what,
        };
        let channel = istiod::endpoint(&self.config.address, &self.host, roots_pem)
            .map_err(bad)?
            .timeout(REQUEST_TIMEOUT)
            .connect_lazy();
        *cached = Some((roots_pem.to_vec(), channel.clone()));
        Ok(channel)
    }

    /// Asks the CA for a certificate for `id`, valid for `lifetime` (the CA may
    /// shorten it); checks the answer against `roots` (whose PEM is `roots_pem`).
    ///
    /// # Errors
    /// [`IstioCaError`] naming the CA address, the identity and what failed.
    pub async fn create_certificate(
        &self,
        roots_pem: &[u8],
        roots: &RootCertStore,
        id: &SpiffeId,
        lifetime: Duration,
    ) -> Result<WorkloadCertificate, IstioCaError> {
        let address = &self.config.address;
        let (csr, key) = make_csr(id).map_err(|source| IstioCaError::Csr {
            id: id.to_string(),
            source,
        })?;
        let token_err = |what: String| IstioCaError::Token {
            address: address.clone(),
            id: id.to_string(),
            path: self.config.token_file.clone(),
            what,
        };
        let token = istiod::read_token(&self.config.token_file).map_err(token_err)?;
        let rpc_err = |status: tonic::Status| IstioCaError::Rpc {
            address: address.clone(),
            id: id.to_string(),
            code: status.code(),
            message: status.message().to_string(),
        };
        let mut request = tonic::Request::new(proto::IstioCertificateRequest {
            csr,
            validity_duration: lifetime.as_secs().try_into().unwrap_or(i64::MAX),
            metadata: Some(impersonation(id)),
        });
        istiod::insert_credentials(request.metadata_mut(), &token, &self.config.cluster_id)
            .map_err(|e| match e {
                istiod::MetadataError::Token => {
                    token_err("the token is not a valid header value".into())
                }
                istiod::MetadataError::ClusterId => rpc_err(tonic::Status::invalid_argument(
                    "the cluster ID is not a valid header value",
                )),
            })?;
        let mut grpc = tonic::client::Grpc::new(self.channel(roots_pem)?);
        grpc.ready().await.map_err(|e| {
            rpc_err(tonic::Status::unavailable(format!(
                "connecting: {}",
                istiod::error_chain(&e)
            )))
        })?;
        let path = http::uri::PathAndQuery::from_static(proto::CREATE_CERTIFICATE);
        let codec = tonic_prost::ProstCodec::<
            proto::IstioCertificateRequest,
            proto::IstioCertificateResponse,
        >::default();
        let response = grpc
            .unary(request, path, codec)
            .await
            .map_err(|status| {
                rpc_err(tonic::Status::new(
                    status.code(),
                    istiod::status_text(&status),
                ))
            })?
            .into_inner();
        let (chain, not_after) =
            check_chain(&response.cert_chain, id, &key, roots, SystemTime::now()).map_err(
                |what| IstioCaError::Response {
                    address: address.clone(),
                    id: id.to_string(),
                    what,
                },
            )?;
        Ok(WorkloadCertificate {
            id: id.clone(),
            chain,
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_after,
        })
    }
}

/// `metadata` with `ImpersonatedIdentity` = `id` (a string value).
fn impersonation(id: &SpiffeId) -> prost_types::Struct {
    prost_types::Struct {
        fields: [(
            "ImpersonatedIdentity".to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(id.to_string())),
            },
        )]
        .into(),
    }
}

/// A new ECDSA P-256 key and a PEM CSR for it: no subject, the SPIFFE ID as the
/// only (URI) SAN, as ztunnel makes them.
pub fn make_csr(id: &SpiffeId) -> Result<(String, KeyPair), rcgen::Error> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(id.to_string().try_into()?)];
    let csr = params.serialize_request(&key)?.pem()?;
    Ok((csr, key))
}

/// Checks a `cert_chain` answered for `id`: PEM certificates (an entry may hold
/// several), the leaf first; the leaf carries `id` and `key`'s public key, is
/// valid at `now`, and chains to `roots` through the others. Returns the chain to
/// present (DER, leaf first) and the leaf's end of validity.
///
/// # Errors
/// What is wrong, as a sentence fragment.
pub fn check_chain(
    entries: &[String],
    id: &SpiffeId,
    key: &KeyPair,
    roots: &RootCertStore,
    now: SystemTime,
) -> Result<(Vec<CertificateDer<'static>>, SystemTime), String> {
    let mut chain = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(entry.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| {
                format!(
                    "cert_chain entry {}: malformed PEM: {}",
                    i + 1,
                    super::ca::pem_error(&e)
                )
            })?;
        if certs.is_empty() {
            return Err(format!(
                "cert_chain entry {} holds no PEM certificate",
                i + 1
            ));
        }
        chain.extend(certs);
    }
    let leaf = chain.first().ok_or("the cert_chain is empty")?;
    let got = spiffe_id_of(leaf).map_err(|e| format!("leaf certificate: {e}"))?;
    if got != *id {
        return Err(format!("the leaf certificate is for {got}, not {id}"));
    }
    let (_, parsed) =
        X509Certificate::from_der(leaf).map_err(|e| format!("leaf certificate: {e}"))?;
    if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err("the leaf certificate is not for the key of the CSR".into());
    }
    let not_after = SystemTime::UNIX_EPOCH
        + Duration::from_secs(parsed.validity().not_after.timestamp().max(0) as u64);
    let unix_now = UnixTime::since_unix_epoch(
        now.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default(),
    );
    let end_entity =
        ParsedCertificate::try_from(leaf).map_err(|e| format!("leaf certificate: {e}"))?;
    rustls::client::verify_server_cert_signed_by_trust_anchor(
        &end_entity,
        roots,
        &chain[1..],
        unix_now,
        tls::provider().signature_verification_algorithms.all,
    )
    .map_err(|e| format!("the chain does not verify against the trust bundle: {e}"))?;
    Ok((chain, not_after))
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, IsCa, Issuer};

    use super::*;

    /// A CA signing CSRs, as a CA would.
    struct TestCa {
        issuer: Issuer<'static, KeyPair>,
        pem: String,
    }

    impl TestCa {
        fn new() -> Self {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::default();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            Self {
                pem: cert.pem(),
                issuer: Issuer::new(params, key),
            }
        }

        fn roots(&self) -> RootCertStore {
            let mut store = RootCertStore::empty();
            store
                .add(CertificateDer::from_pem_slice(self.pem.as_bytes()).unwrap())
                .unwrap();
            store
        }

        fn sign(&self, csr: &str) -> String {
            let mut csr = rcgen::CertificateSigningRequestParams::from_pem(csr).unwrap();
            csr.params.extended_key_usages = vec![
                rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            ];
            csr.signed_by(&self.issuer).unwrap().pem()
        }
    }

    fn id(sa: &str) -> SpiffeId {
        SpiffeId::new("cluster.local", "ns", sa)
    }

    #[test]
    fn csr_carries_the_identity_and_no_subject() {
        let (csr, _key) = make_csr(&id("web")).unwrap();
        let parsed = rcgen::CertificateSigningRequestParams::from_pem(&csr).unwrap();
        assert_eq!(
            parsed.params.subject_alt_names,
            vec![SanType::URI(id("web").to_string().try_into().unwrap())]
        );
        assert_eq!(parsed.params.distinguished_name.iter().count(), 0);
    }

    #[test]
    fn accepts_a_good_chain_also_with_roots_in_one_entry() {
        let ca = TestCa::new();
        let (csr, key) = make_csr(&id("web")).unwrap();
        let leaf = ca.sign(&csr);
        let (chain, _) = check_chain(
            std::slice::from_ref(&leaf),
            &id("web"),
            &key,
            &ca.roots(),
            SystemTime::now(),
        )
        .unwrap();
        assert_eq!(chain.len(), 1);
        let other = TestCa::new();
        let (chain, _) = check_chain(
            &[leaf, format!("{}{}", ca.pem, other.pem)],
            &id("web"),
            &key,
            &ca.roots(),
            SystemTime::now(),
        )
        .unwrap();
        assert_eq!(chain.len(), 3);
    }

    #[test]
    fn refuses_bad_chains_saying_why() {
        let ca = TestCa::new();
        let (csr, key) = make_csr(&id("web")).unwrap();
        let leaf = ca.sign(&csr);
        let check = |entries: &[String], id: &SpiffeId, key: &KeyPair, roots: &RootCertStore| {
            check_chain(entries, id, key, roots, SystemTime::now()).unwrap_err()
        };
        let err = check(&[], &id("web"), &key, &ca.roots());
        assert!(err.contains("empty"), "{err}");
        let err = check(&["garbage".into()], &id("web"), &key, &ca.roots());
        assert!(err.contains("no PEM certificate"), "{err}");
        let err = check(std::slice::from_ref(&leaf), &id("db"), &key, &ca.roots());
        assert!(
            err.contains("is for spiffe://cluster.local/ns/ns/sa/web, not"),
            "{err}"
        );
        let (_, other_key) = make_csr(&id("web")).unwrap();
        let err = check(
            std::slice::from_ref(&leaf),
            &id("web"),
            &other_key,
            &ca.roots(),
        );
        assert!(err.contains("not for the key of the CSR"), "{err}");
        let err = check(&[leaf], &id("web"), &key, &TestCa::new().roots());
        assert!(
            err.contains("does not verify against the trust bundle"),
            "{err}"
        );
    }

    #[test]
    fn refuses_addresses_that_are_not_https_with_a_port() {
        let config = |address: &str| IstioCaConfig {
            address: address.into(),
            root_cert: "/roots.pem".into(),
            token_file: DEFAULT_TOKEN_FILE.into(),
            cluster_id: DEFAULT_CLUSTER_ID.into(),
        };
        for (address, want) in [
            ("http://istiod:15012", "https"),
            ("https://istiod", "port"),
            ("not a url", "not a URL"),
        ] {
            let err = IstioCaClient::new(config(address)).unwrap_err().to_string();
            assert!(err.contains(want), "{address}: {err}");
        }
        IstioCaClient::new(config("https://istiod.istio-system.svc:15012")).unwrap();
    }
}
