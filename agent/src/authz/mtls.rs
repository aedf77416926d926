//! Istio `PeerAuthentication`: the mutual TLS mode a workload's inbound
//! connections need, compiled from the resource ([`super::spec::PeerAuthentication`]).
//!
//! Source: Istio reference, "PeerAuthentication"
//! (<https://istio.io/latest/docs/reference/config/security/peer_authentication/>).

use std::{collections::BTreeMap, fmt};

use serde::Serialize;
use thiserror::Error;

use super::{
    LabelProblem,
    compile::label_problem,
    spec::{MutualTls, PeerAuthentication},
};

/// A mutual TLS mode (`spec.mtls.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum MtlsMode {
    /// `UNSET` (or absent): inherit from the parent scope (workload → namespace
    /// → mesh); PERMISSIVE when nothing sets a mode.
    #[default]
    Unset,
    /// `DISABLE`: connections are not required to use mutual TLS.
    Disable,
    /// `PERMISSIVE`: plaintext and mutual TLS are both accepted.
    Permissive,
    /// `STRICT`: only mutual TLS; plaintext inbound connections are refused.
    Strict,
}

/// Why [`MtlsPolicy::compile`] refused a PeerAuthentication.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum MtlsError {
    /// `metadata.name` is absent or empty.
    #[error("PeerAuthentication has no metadata.name")]
    NoName,
    /// A mode is not one Istio defines.
    #[error(
        "PeerAuthentication {policy}: {field} {value:?} is not one of UNSET, DISABLE, PERMISSIVE, STRICT"
    )]
    UnknownMode {
        /// The policy's `namespace/name`.
        policy: String,
        /// The field's path (`spec.mtls.mode`, `spec.portLevelMtls.8080.mode`).
        field: String,
        /// The mode as written.
        value: String,
    },
    /// A key of `spec.portLevelMtls` is not a port number 1–65535.
    #[error(
        "PeerAuthentication {policy}: spec.portLevelMtls key {key:?} is not a port number 1-65535"
    )]
    BadPort {
        /// The policy's `namespace/name`.
        policy: String,
        /// The key as written.
        key: String,
    },
    /// `spec.portLevelMtls` without a selector (Istio's validation refuses it).
    #[error("PeerAuthentication {policy}: spec.portLevelMtls needs spec.selector")]
    PortsWithoutSelector {
        /// The policy's `namespace/name`.
        policy: String,
    },
    /// A selector label is not valid Kubernetes syntax.
    #[error("PeerAuthentication {policy}: spec.selector.matchLabels: {problem}")]
    Selector {
        /// The policy's `namespace/name`.
        policy: String,
        /// What is wrong with the label.
        problem: LabelProblem,
    },
}

/// A compiled PeerAuthentication.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MtlsPolicy {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `spec.selector.matchLabels`, if there is a selector.
    pub selector: Option<BTreeMap<String, String>>,
    /// `spec.mtls.mode`.
    pub mode: MtlsMode,
    /// `spec.portLevelMtls`: modes by the workload's (target) port.
    pub port_modes: BTreeMap<u16, MtlsMode>,
}

impl fmt::Display for MtlsPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn parse_mode(policy: &str, field: String, m: &MutualTls) -> Result<MtlsMode, MtlsError> {
    match m.mode.as_deref().unwrap_or("UNSET") {
        "UNSET" => Ok(MtlsMode::Unset),
        "DISABLE" => Ok(MtlsMode::Disable),
        "PERMISSIVE" => Ok(MtlsMode::Permissive),
        "STRICT" => Ok(MtlsMode::Strict),
        other => Err(MtlsError::UnknownMode {
            policy: policy.to_string(),
            field,
            value: other.to_string(),
        }),
    }
}

impl MtlsPolicy {
    /// Compiles a PeerAuthentication read from the workload source.
    ///
    /// # Errors
    /// [`MtlsError`]: no name, a mode Istio does not define, a port key that is
    /// not a port, port-level modes without a selector, a bad selector label.
    pub fn compile(p: &PeerAuthentication) -> Result<Self, MtlsError> {
        let name = p.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err(MtlsError::NoName);
        }
        let namespace = p.metadata.namespace_or_default().to_string();
        let policy = format!("{namespace}/{name}");
        let spec = &p.spec;
        for (key, value) in spec.selector.iter().flat_map(|s| &s.match_labels) {
            if let Some(problem) = label_problem(key, value) {
                return Err(MtlsError::Selector { policy, problem });
            }
        }
        let mode = match &spec.mtls {
            Some(m) => parse_mode(&policy, "spec.mtls.mode".into(), m)?,
            None => MtlsMode::Unset,
        };
        let mut port_modes = BTreeMap::new();
        if let Some(ports) = &spec.port_level_mtls {
            if spec.selector.is_none() {
                return Err(MtlsError::PortsWithoutSelector { policy });
            }
            for (key, m) in ports {
                let port = key.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                    MtlsError::BadPort {
                        policy: policy.clone(),
                        key: key.clone(),
                    }
                })?;
                port_modes.insert(
                    port,
                    parse_mode(&policy, format!("spec.portLevelMtls.{key}.mode"), m)?,
                );
            }
        }
        Ok(MtlsPolicy {
            namespace,
            name,
            selector: spec.selector.as_ref().map(|s| s.match_labels.clone()),
            mode,
            port_modes,
        })
    }
}
