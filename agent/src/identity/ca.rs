//! The certificate authority that signs workload certificates.
//!
//! Files (PEM, as `podlink ca init` writes them and as a Kubernetes Secret mounts
//! them): `ca.crt` holds the signing CA certificate first, then any further trust
//! anchors; `ca.key` holds the CA's PKCS #8 private key.
//!
//! Workload certificates follow Istio's profile: no subject, one URI SAN with the
//! SPIFFE ID, key usages digitalSignature and keyEncipherment, extended key usages
//! serverAuth and clientAuth, ECDSA P-256.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, SystemTime},
};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, pem::PemObject};
use thiserror::Error;
use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509Certificate, X509Name};

use super::SpiffeId;

/// File name of the CA certificate (and further trust anchors) in a CA directory.
pub const CA_CERT_FILE: &str = "ca.crt";
/// File name of the CA private key in a CA directory.
pub const CA_KEY_FILE: &str = "ca.key";

/// How long a development CA made by [`init`] is valid.
const DEV_CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Workload certificates start this much in the past, for clocks that disagree.
const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);
/// The shortest time the signing CA certificate must still be valid for a
/// workload certificate to be issued: certificates end when it does, and are
/// renewed at half their lifetime, so a CA about to expire would have them
/// renewed ever more often.
const MIN_CA_REMAINING: Duration = Duration::from_secs(2 * 60);

/// Errors of CA files and certificate issuance; each names the file or the
/// identity concerned.
#[derive(Debug, Error)]
pub enum CaError {
    #[error("reading {path}: {source}")]
    /// A CA file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    /// A CA file could not be written.
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    #[error("{path} already exists; remove it first to make a new CA")]
    /// `ca init` would overwrite this file.
    Exists {
        /// The existing file.
        path: PathBuf,
    },
    #[error("{path} holds no PEM certificate")]
    /// The certificate file holds no certificate.
    NoCertificate {
        /// The certificate file.
        path: PathBuf,
    },
    #[error("{path}: {what}")]
    /// A file's content is not usable; `what` says why.
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    #[error("{key} does not belong to the first certificate in {cert}")]
    /// The key does not match the certificate.
    KeyMismatch {
        /// The key file.
        key: PathBuf,
        /// The certificate file.
        cert: PathBuf,
    },
    #[error("issuing a certificate for {id}: {source}")]
    /// Signing a workload certificate failed.
    Issue {
        /// The SPIFFE ID being issued.
        id: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
    #[error(
        "the CA certificate is valid only until {} (less than {} s from now): no workload certificate is issued from it; put a CA with a later notAfter in place",
        humantime::format_rfc3339_seconds(*not_after),
        MIN_CA_REMAINING.as_secs()
    )]
    /// The signing CA certificate expires too soon to issue from.
    Expiring {
        /// The CA certificate's `notAfter`.
        not_after: SystemTime,
    },
    #[error("making the CA: {0}")]
    /// Generating a CA failed.
    Generate(rcgen::Error),
}

/// A workload's certificate chain and private key.
#[derive(Debug)]
pub struct WorkloadCertificate {
    /// The identity in the certificate's URI SAN.
    pub id: SpiffeId,
    /// The leaf first, then the CA certificate that signed it.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's PKCS #8 private key.
    pub key: PrivateKeyDer<'static>,
    /// End of validity.
    pub not_after: SystemTime,
}

/// A loaded CA: signs workload certificates and provides the trust anchors.
pub struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    roots: Vec<CertificateDer<'static>>,
    /// The signing certificate's `notAfter`: no workload certificate outlives it.
    not_after: SystemTime,
    /// Whether a certificate was cut short to `not_after` yet: the warning is
    /// given once per CA, not once per certificate.
    clamp_warned: AtomicBool,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

/// Writes a new development CA (`ca.crt`, `ca.key`) into `out`, creating it. Refuses
/// to overwrite existing files. The key file is readable by its owner only.
///
/// # Errors
/// [`CaError::Exists`] if a file is present; I/O errors name the path.
pub fn init(out: &Path) -> Result<(PathBuf, PathBuf), CaError> {
    let cert_path = out.join(CA_CERT_FILE);
    let key_path = out.join(CA_KEY_FILE);
    for path in [&cert_path, &key_path] {
        if path.exists() {
            return Err(CaError::Exists { path: path.clone() });
        }
    }
    fs::create_dir_all(out).map_err(|source| CaError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    let (cert_pem, key_pem) = generate_ca("podlink development CA")?;
    write_private(&key_path, key_pem.as_bytes())?;
    fs::write(&cert_path, cert_pem).map_err(|source| CaError::Write {
        path: cert_path.clone(),
        source,
    })?;
    Ok((cert_path, key_path))
}

/// Makes a self-signed CA certificate and key, both PEM.
pub fn generate_ca(common_name: &str) -> Result<(String, String), CaError> {
    generate_ca_valid_for(common_name, DEV_CA_LIFETIME)
}

/// [`generate_ca`], valid for `lifetime` from now.
fn generate_ca_valid_for(
    common_name: &str,
    lifetime: Duration,
) -> Result<(String, String), CaError> {
    let key = KeyPair::generate().map_err(CaError::Generate)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "podlink");
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = SystemTime::now();
    params.not_before = (now - CLOCK_SKEW).into();
    params.not_after = (now + lifetime).into();
    let cert = params.self_signed(&key).map_err(CaError::Generate)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), CaError> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let err = |source| CaError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(err)?;
    f.write_all(bytes).map_err(err)
}

/// Reads a file whole, naming it on failure.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, CaError> {
    fs::read(path).map_err(|source| CaError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Parses a PEM bundle of CA certificates (`ca.crt`, or an Istio root bundle read
/// from `path`): at least one certificate, each a CA certificate valid now.
///
/// # Errors
/// [`CaError::NoCertificate`] or [`CaError::Invalid`], naming `path` and, for a
/// certificate that is not usable, its position in the file (from 1).
pub fn parse_ca_bundle(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CaError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| CaError::Invalid {
            path: path.to_path_buf(),
            what: format!("malformed PEM: {}", pem_error(&e)),
        })?;
    if certs.is_empty() {
        return Err(CaError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    for (i, der) in certs.iter().enumerate() {
        check_ca_certificate(der).map_err(|what| CaError::Invalid {
            path: path.to_path_buf(),
            what: format!("certificate {}: {what}", i + 1),
        })?;
    }
    Ok(certs)
}

/// A PEM error in words (rustls-pki-types prints the missing marker as bytes).
pub(crate) fn pem_error(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error;
    match e {
        Error::MissingSectionEnd { end_marker } => format!(
            "the section {:?} has no END line (truncated?)",
            String::from_utf8_lossy(end_marker)
        ),
        Error::IllegalSectionStart { line } => {
            format!("illegal BEGIN line {:?}", String::from_utf8_lossy(line))
        }
        other => other.to_string(),
    }
}

impl CertificateAuthority {
    /// Loads `ca.crt` and `ca.key` from `dir`.
    ///
    /// # Errors
    /// Missing or unreadable files, a `ca.crt` without a valid CA certificate, an
    /// expired CA, or a key that does not match the certificate; each error names
    /// the file and what is wrong.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem = read_file(&cert_path)?;
        let key_pem = read_file(&key_path)?;
        Self::from_pem(&cert_path, &cert_pem, &key_path, &key_pem)
    }

    /// A CA from the contents of its certificate bundle (`ca.crt`: the signing CA
    /// certificate first, then further trust anchors, all PEM) and of its PKCS #8
    /// key (`ca.key`, PEM). The paths only name the files in errors.
    ///
    /// # Errors
    /// As [`CertificateAuthority::load`].
    pub fn from_pem(
        cert_path: &Path,
        cert_pem: &[u8],
        key_path: &Path,
        key_pem: &[u8],
    ) -> Result<Self, CaError> {
        let invalid = |path: &Path, what: String| CaError::Invalid {
            path: path.to_path_buf(),
            what,
        };
        let certs = parse_ca_bundle(cert_path, cert_pem)?;
        let first = certs[0].clone();
        let key_text = std::str::from_utf8(key_pem)
            .map_err(|_| invalid(key_path, "not PEM text (not UTF-8)".into()))?;
        let key = KeyPair::from_pem(key_text)
            .map_err(|e| invalid(key_path, format!("not a PKCS #8 private key: {e}")))?;
        let (_, parsed) = X509Certificate::from_der(&first)
            .map_err(|e| invalid(cert_path, format!("malformed certificate: {e}")))?;
        if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(CaError::KeyMismatch {
                key: key_path.to_path_buf(),
                cert: cert_path.to_path_buf(),
            });
        }
        check_encodable_subject(parsed.subject()).map_err(|what| {
            invalid(
                cert_path,
                format!("cannot sign with this certificate: {what}"),
            )
        })?;
        let not_after = u64::try_from(parsed.validity().not_after.timestamp())
            .map_or(SystemTime::UNIX_EPOCH, |secs| {
                SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
            });
        let issuer = Issuer::from_ca_cert_der(&first, key)
            .map_err(|e| invalid(cert_path, format!("cannot sign with this certificate: {e}")))?;
        Ok(Self {
            issuer,
            cert: first,
            roots: certs,
            not_after,
            clamp_warned: AtomicBool::new(false),
        })
    }

    /// The trust anchors peers' certificates must chain to.
    pub fn roots(&self) -> &[CertificateDer<'static>] {
        &self.roots
    }

    /// Issues a certificate for `id`, valid for `lifetime` from now, or until the
    /// CA certificate expires if that is sooner (with a warning).
    ///
    /// # Errors
    /// [`CaError::Expiring`] when the CA certificate expires within
    /// [`MIN_CA_REMAINING`] (2 minutes); [`CaError::Issue`] if the identity cannot
    /// be encoded or signing fails.
    pub fn issue(&self, id: &SpiffeId, lifetime: Duration) -> Result<WorkloadCertificate, CaError> {
        let issue_err = |source| CaError::Issue {
            id: id.to_string(),
            source,
        };
        let key = KeyPair::generate().map_err(issue_err)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names =
            vec![SanType::URI(id.to_string().try_into().map_err(issue_err)?)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let now = SystemTime::now();
        if self.not_after < now + MIN_CA_REMAINING {
            return Err(CaError::Expiring {
                not_after: self.not_after,
            });
        }
        let mut not_after = now + lifetime;
        if self.not_after < not_after {
            let until = humantime::format_rfc3339_seconds(self.not_after);
            if self.clamp_warned.swap(true, Ordering::Relaxed) {
                tracing::debug!(
                    "the workload certificate of {id} ends with the CA certificate, at {until}"
                );
            } else {
                tracing::warn!(
                    "the CA certificate is valid only until {until}: workload certificates (the first for {id}) end then too, before their lifetime of {} s; put a CA with a later notAfter in place",
                    lifetime.as_secs()
                );
            }
            not_after = self.not_after;
        }
        params.not_before = (now - CLOCK_SKEW).into();
        params.not_after = not_after.into();
        let cert = params.signed_by(&key, &self.issuer).map_err(issue_err)?;
        Ok(WorkloadCertificate {
            id: id.clone(),
            chain: vec![cert.der().clone(), self.cert.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_after,
        })
    }
}

/// Checks that `der` is a CA certificate valid now.
fn check_ca_certificate(der: &CertificateDer<'_>) -> Result<(), String> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| format!("malformed: {e}"))?;
    let is_ca = cert
        .basic_constraints()
        .ok()
        .flatten()
        .is_some_and(|bc| bc.value.ca);
    if !is_ca {
        return Err("not a CA certificate (basicConstraints cA is not set)".into());
    }
    if !cert.validity().is_valid() {
        return Err(format!(
            "not valid now (valid from {} to {})",
            cert.validity().not_before,
            cert.validity().not_after
        ));
    }
    Ok(())
}

/// Checks that a CA certificate's `subject` can be written again: rcgen writes
/// it as the issuer of every certificate it signs, and panics (yasna's
/// `write_oid`, rcgen's `DistinguishedName::from_name`) on what x509-parser
/// reads but DER cannot hold: an empty relative distinguished name, or an
/// attribute type OID that cannot be encoded (X.690 §8.19.4: the first arc 0, 1
/// or 2, the second below 40 unless the first is 2, the two together in 64 bits).
fn check_encodable_subject(subject: &X509Name<'_>) -> Result<(), String> {
    for rdn in subject.iter() {
        if rdn.iter().next().is_none() {
            return Err("the subject has an empty relative distinguished name".into());
        }
        for attribute in rdn.iter() {
            let oid = attribute.attr_type();
            let arcs: Option<Vec<u64>> = oid.iter().map(Iterator::collect);
            let encodable = match arcs.as_deref() {
                Some([first, second, ..]) => {
                    *first < 3 && (*first == 2 || *second < 40) && *second < u64::MAX - 80
                }
                _ => false,
            };
            if !encodable {
                return Err(format!(
                    "the subject has an attribute type OID that cannot be encoded ({oid})"
                ));
            }
        }
    }
    Ok(())
}

/// Why a peer certificate carries no usable SPIFFE ID.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PeerIdentityError {
    #[error("malformed certificate: {0}")]
    /// The certificate does not parse.
    Malformed(String),
    #[error("no URI SAN with a SPIFFE ID")]
    /// No `spiffe://` URI SAN.
    Missing,
    #[error("more than one SPIFFE ID in the URI SANs")]
    /// Several `spiffe://` URI SANs.
    Ambiguous,
    #[error(transparent)]
    /// The URI SAN is not a workload SPIFFE ID.
    Invalid(#[from] super::SpiffeIdError),
}

/// The SPIFFE ID in a certificate's URI SAN (exactly one `spiffe://` URI).
///
/// # Errors
/// [`PeerIdentityError`] when the certificate does not parse or does not carry
/// exactly one valid workload SPIFFE ID.
pub fn spiffe_id_of(der: &CertificateDer<'_>) -> Result<SpiffeId, PeerIdentityError> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| PeerIdentityError::Malformed(e.to_string()))?;
    let mut found = None;
    for ext in cert.extensions() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext.parsed_extension() {
            for name in &san.general_names {
                if let GeneralName::URI(uri) = name
                    && uri.starts_with("spiffe://")
                {
                    if found.is_some() {
                        return Err(PeerIdentityError::Ambiguous);
                    }
                    found = Some(SpiffeId::parse(uri)?);
                }
            }
        }
    }
    found.ok_or(PeerIdentityError::Missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory, removed when the guard drops (also when a test fails).
    fn temp_dir() -> (tempfile::TempDir, PathBuf) {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path().join("ca");
        (guard, dir)
    }

    #[test]
    fn init_load_and_issue() {
        let (_guard, dir) = temp_dir();
        init(&dir).unwrap();
        let mode = fs::metadata(dir.join(CA_KEY_FILE)).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        let ca = CertificateAuthority::load(&dir).unwrap();
        let id = SpiffeId::new("cluster.local", "default", "web");
        let cert = ca.issue(&id, Duration::from_secs(3600)).unwrap();
        assert_eq!(spiffe_id_of(&cert.chain[0]).unwrap(), id);
        assert_eq!(cert.chain[1], ca.roots()[0]);
        // A second init refuses to overwrite.
        assert!(matches!(init(&dir), Err(CaError::Exists { .. })));
    }

    /// No workload certificate outlives the CA certificate that signed it, and
    /// none is issued from a CA about to expire.
    #[test]
    fn certificates_end_with_their_ca() {
        let id = SpiffeId::new("cluster.local", "default", "web");
        let ca_of = |lifetime| {
            let (cert, key) = generate_ca_valid_for("short", lifetime).unwrap();
            CertificateAuthority::from_pem(
                Path::new("ca.crt"),
                cert.as_bytes(),
                Path::new("ca.key"),
                key.as_bytes(),
            )
            .unwrap()
        };
        let ca = ca_of(Duration::from_secs(600));
        assert!(!ca.clamp_warned.load(Ordering::Relaxed));
        let cert = ca.issue(&id, Duration::from_secs(24 * 3600)).unwrap();
        assert_eq!(cert.not_after, ca.not_after);
        // Warned of once; later certificates are cut short too.
        assert!(ca.clamp_warned.load(Ordering::Relaxed));
        let other = SpiffeId::new("cluster.local", "default", "db");
        let again = ca.issue(&other, Duration::from_secs(24 * 3600)).unwrap();
        assert_eq!(again.not_after, ca.not_after);
        let (_, leaf) = X509Certificate::from_der(&cert.chain[0]).unwrap();
        let (_, signer) = X509Certificate::from_der(&cert.chain[1]).unwrap();
        assert_eq!(leaf.validity().not_after, signer.validity().not_after);
        // A lifetime within the CA's is kept.
        let cert = ca.issue(&id, Duration::from_secs(60)).unwrap();
        assert!(cert.not_after < ca.not_after);
        let expiring = ca_of(Duration::from_secs(60));
        let err = expiring.issue(&id, Duration::from_secs(3600)).unwrap_err();
        assert!(matches!(err, CaError::Expiring { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("put a CA with a later notAfter in place")
        );
    }

    #[test]
    fn load_names_what_is_wrong() {
        let (_guard, dir) = temp_dir();
        fs::create_dir_all(&dir).unwrap();
        let err = CertificateAuthority::load(&dir).unwrap_err().to_string();
        assert!(err.contains("ca.crt"), "{err}");

        fs::write(dir.join(CA_CERT_FILE), "not pem").unwrap();
        fs::write(dir.join(CA_KEY_FILE), "not pem").unwrap();
        let err = CertificateAuthority::load(&dir).unwrap_err().to_string();
        assert!(err.contains("holds no PEM certificate"), "{err}");

        // A key from another CA.
        let (cert, _) = generate_ca("one").unwrap();
        let (_, other_key) = generate_ca("two").unwrap();
        fs::write(dir.join(CA_CERT_FILE), cert).unwrap();
        fs::write(dir.join(CA_KEY_FILE), other_key).unwrap();
        let err = CertificateAuthority::load(&dir).unwrap_err();
        assert!(matches!(err, CaError::KeyMismatch { .. }), "{err}");

        // A certificate that is not a CA's.
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["leaf.example".to_string()])
            .unwrap()
            .self_signed(&leaf_key)
            .unwrap();
        fs::write(dir.join(CA_CERT_FILE), leaf.pem()).unwrap();
        fs::write(dir.join(CA_KEY_FILE), leaf_key.serialize_pem()).unwrap();
        let err = CertificateAuthority::load(&dir).unwrap_err().to_string();
        assert!(err.contains("not a CA certificate"), "{err}");
    }

    /// A CA certificate whose subject x509-parser reads but DER cannot encode
    /// again (an attribute type OID of first arc 4: `06 03 bd 04 03`) is
    /// refused when loaded, naming the problem: rcgen writes the subject as the
    /// issuer of every certificate it signs, and panicked there (found by the
    /// fuzz target `trust_bundle`; the input as it found it).
    #[test]
    fn a_subject_that_cannot_be_encoded_again_is_refused_at_load() {
        const INPUT: &str = "\
-----BEGIN CERTIFICATE-----
MIIByjCCAXGgAwIBAgIUDQxk1xjaFfqigRwdWHJPnsZtp0wwCgYIKoZIzj0EAwMw
MjEWBMQGA1UECgwNY2x1c3Rlci5sb2NhbDEYMBYGAEww1UAPcG9kbGluayBmdXp6
IENBMCAXDTI2MTIwNDE1Mzk1NloYDzIxMjYxMTEwMTUzOTU2WjAyMRYwFAYDVQQK
DA1jbHVzdGVyLmxvY2FsMRgwFgYDvQQDDA9wb2RsaW5rIGZ1enogQ0EwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAARt2f1OdSrVG32sC6SPd5zx4b3+ZZfeZU38IkQ1
sd4t1GK+6H4/NAxQUdkuah63DUzoCprNKDeC8a1NFecbebQzo2MwYTAdBgNVHQ4E
FgQUnhkae9wm0fItv17krnQkkvM02PkwHwYDVR0jBBgwFoakAnhUe9wm0fItv17k
rnQkkvM02PkwDwYDVR0TAQH/BAUwAwEB/zAOBgNVHQ8BAf8EBAMCAQYwCgYIKoZI
zj0EAwIDRwAwRAIgdeu7id5ZF/Xffm8SyQVxeCsmzzBTGDfdwxS4mwo9UGICIFT7
601Ry7P/uoAoO8tF9iy6AW6LYBWXvyU9ruTiQrh6
-----END CERTIFICATE-----
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQga/gQ0nS+WDcp2aiF
kHGtGG7b+TzBkyYl2zM5uTd1p8ehRANCAARt2f1OdSrVG32sC6SPd5zx4b3+ZZfe
ZU38IkQ1sd4t1GK+6H4/NAxQUdkuah63DUzoCprNKDeC8a1NFecbebQz
-----END PRIVATE KEY-----
";
        let (cert, key) = INPUT.split_at(INPUT.find("-----BEGIN PRIVATE KEY-----").unwrap());
        let loaded = CertificateAuthority::from_pem(
            Path::new("ca.crt"),
            cert.as_bytes(),
            Path::new("ca.key"),
            key.as_bytes(),
        );
        match loaded {
            Ok(ca) => {
                let id = SpiffeId::new("cluster.local", "default", "web");
                let issued = ca.issue(&id, Duration::from_secs(3600)).map(|_| ());
                panic!("loaded; issuing gave {issued:?}");
            }
            Err(err) => {
                let err = err.to_string();
                assert!(err.contains("ca.crt"), "{err}");
                assert!(err.contains("cannot sign with this certificate"), "{err}");
                assert!(err.contains("4.29.4.3"), "{err}");
            }
        }
    }
}
