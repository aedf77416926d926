//! Where workload certificates come from: the local CA of `--ca-dir`, which signs
//! in the agent, or an Istio CA (`--ca-address`), asked over gRPC. Either way the
//! trust comes from files that are watched and reloaded ([`CertSource::files`]).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;

use super::{
    Error, SpiffeId,
    ca::{self, CA_CERT_FILE, CA_KEY_FILE, CaError, CertificateAuthority, WorkloadCertificate},
    istio_ca::IstioCaClient,
    tls,
};

/// A source of workload certificates.
#[derive(Debug)]
pub enum CertSource {
    /// The CA in this directory (`ca.crt`: the signing CA certificate first, then
    /// further trust anchors; `ca.key`) signs in the agent.
    Local {
        /// The directory.
        dir: PathBuf,
    },
    /// An Istio CA signs CSRs; its root bundle file is the trust.
    Istio(IstioCaClient),
}

/// The trust in force: what the source's files held at one time.
pub struct Trust {
    /// The trust anchors (the mesh trust bundle).
    pub roots: Vec<CertificateDer<'static>>,
    /// The same as a rustls root store.
    pub store: Arc<RootCertStore>,
    /// The local CA, in local mode.
    signer: Option<CertificateAuthority>,
    /// The files' contents this was loaded from, in [`CertSource::files`] order.
    contents: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust")
            .field("roots", &self.roots.len())
            .field("signer", &self.signer.is_some())
            .finish_non_exhaustive()
    }
}

impl Trust {
    /// The contents of the files this trust was loaded from.
    pub fn contents(&self) -> &[Vec<u8>] {
        &self.contents
    }
}

impl CertSource {
    /// The files the trust is loaded from: `ca.crt` and `ca.key`, or the Istio root
    /// bundle.
    pub fn files(&self) -> Vec<PathBuf> {
        match self {
            Self::Local { dir } => vec![dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE)],
            Self::Istio(client) => vec![client.config().root_cert.clone()],
        }
    }

    /// What the source is, for logs: `CA directory <dir>` or `Istio CA <address>`.
    pub fn describe(&self) -> String {
        match self {
            Self::Local { dir } => format!("CA directory {}", dir.display()),
            Self::Istio(client) => format!("Istio CA {}", client.config().address),
        }
    }

    /// Reads the files (see [`CertSource::files`]).
    ///
    /// # Errors
    /// A file that cannot be read, named.
    pub fn read(&self) -> Result<Vec<Vec<u8>>, CaError> {
        self.files().iter().map(|p| ca::read_file(p)).collect()
    }

    /// Reads and checks the files.
    ///
    /// # Errors
    /// As [`CertSource::parse`].
    pub fn load(&self) -> Result<Trust, Error> {
        self.parse(self.read()?)
    }

    /// Checks file contents read by [`CertSource::read`] and makes them the trust.
    ///
    /// # Errors
    /// [`Error::Ca`] naming the file and what is wrong with it (not PEM, not
    /// a CA certificate, expired, a key that does not match), or a root rustls
    /// cannot use.
    pub fn parse(&self, contents: Vec<Vec<u8>>) -> Result<Trust, Error> {
        let files = self.files();
        let (roots, signer) = match self {
            Self::Local { .. } => {
                let ca = CertificateAuthority::from_pem(
                    &files[0],
                    &contents[0],
                    &files[1],
                    &contents[1],
                )?;
                (ca.roots().to_vec(), Some(ca))
            }
            Self::Istio(_) => (ca::parse_ca_bundle(&files[0], &contents[0])?, None),
        };
        let store = tls::root_store(&roots).map_err(|e| {
            Error::Ca(CaError::Invalid {
                path: files[0].clone(),
                what: format!("not usable as a trust anchor: {e}"),
            })
        })?;
        Ok(Trust {
            roots,
            store,
            signer,
            contents,
        })
    }

    /// A certificate for `id`, valid for `lifetime` (an Istio CA may shorten it),
    /// issued under `trust`.
    ///
    /// # Errors
    /// Signing errors, or the Istio CA's ([`IstioCaError`](super::istio_ca::IstioCaError)), naming the identity.
    pub async fn issue(
        &self,
        trust: &Trust,
        id: &SpiffeId,
        lifetime: Duration,
    ) -> Result<WorkloadCertificate, Error> {
        match self {
            Self::Local { .. } => {
                let signer = trust
                    .signer
                    .as_ref()
                    .expect("a local source's trust has a signer");
                Ok(signer.issue(id, lifetime)?)
            }
            Self::Istio(client) => Ok(client
                .create_certificate(&trust.contents[0], &trust.store, id, lifetime)
                .await?),
        }
    }
}

/// The directories holding `files`, each once: watching those (not the files)
/// sees a Kubernetes Secret's `..data` symlink being swapped.
pub fn parent_dirs(files: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for file in files {
        let dir = file
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}
