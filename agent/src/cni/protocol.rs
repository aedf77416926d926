//! What podlink-cni and the agent say to each other on the agent's Unix socket
//! (`--cni-socket`, [`super::DEFAULT_SOCKET`] by default).
//!
//! One connection carries one exchange: the plugin writes one [`Request`] as a
//! JSON object (at most [`MAX_MESSAGE`] bytes, ended by a newline or by shutting
//! down its writing side), the agent writes one [`Reply`] as a JSON object and a
//! newline, and closes. Both carry `"version": 1` ([`PROTOCOL_VERSION`]); a peer
//! refuses other versions with an error naming them. This protocol is podlink's
//! own: the CNI specification only defines how the runtime runs the plugin.

use std::{net::IpAddr, time::Duration};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The protocol version both sides put in `version`.
pub const PROTOCOL_VERSION: u32 = 1;
/// The largest request or reply, in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// How long the agent waits for a connection's request before it answers with an
/// error and closes.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the agent waits, on ADD, for the pod's object to reach its workload
/// source and for the pod's links to be attached.
pub const ENROLL_WAIT: Duration = Duration::from_secs(5);
/// How long the plugin waits for the agent's reply (more than [`ENROLL_WAIT`]:
/// the agent answers every ADD by then).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a request cannot be read ([`Request::parse`]); the agent sends the
/// message back in a [`Reply::Error`].
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The bytes are not JSON.
    #[error("the request is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// The JSON is not an object.
    #[error("the request is not a JSON object")]
    NotAnObject,
    /// `version` is absent.
    #[error("the request has no `version`")]
    NoVersion,
    /// `version` is not [`PROTOCOL_VERSION`].
    #[error(
        "protocol version {version} is not supported (this agent speaks version {PROTOCOL_VERSION})"
    )]
    UnsupportedVersion {
        /// The `version` given, as JSON.
        version: Value,
    },
    /// A field is missing or mistyped, or unknown (`command`).
    #[error("malformed request: {0}")]
    Malformed(serde_json::Error),
    /// `namespace` or `name` is empty (Kubernetes object names never are).
    #[error("malformed request: `{field}` is empty")]
    EmptyField {
        /// `namespace` or `name`.
        field: &'static str,
    },
}

/// Why a reply cannot be read ([`Reply::parse`]).
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    /// The bytes are not JSON.
    #[error("the reply is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// `version` is absent or not [`PROTOCOL_VERSION`].
    #[error("the agent speaks protocol version {version}, this plugin {PROTOCOL_VERSION}")]
    UnsupportedVersion {
        /// The `version` given, as JSON (`null` when absent).
        version: Value,
    },
    /// `status` is unknown, or a field is missing or mistyped.
    #[error("malformed reply: {0}")]
    Malformed(serde_json::Error),
}

/// The CNI operation the plugin runs (CNI spec 1.0, "CNI Operations").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    /// `ADD`: enroll the pod if it should be; answered once its links exist.
    Add,
    /// `DEL`: forget what ADD reported (idempotent; an unknown pod is fine).
    Del,
    /// `CHECK`: whether a pod that should be enrolled is attached.
    Check,
}

/// A request of the plugin, for one pod.
///
/// ```json
/// {"version": 1, "command": "ADD", "containerId": "c0ffee", "namespace": "apps",
///  "name": "web-0", "ips": ["10.244.1.7"], "hostInterface": "veth1a2b3c4d"}
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// `ADD`, `DEL` or `CHECK`.
    pub command: Command,
    /// `CNI_CONTAINERID`: the pod sandbox; DEL forgets only what this sandbox's
    /// ADD reported.
    pub container_id: String,
    /// The pod's namespace (`K8S_POD_NAMESPACE` of `CNI_ARGS`).
    pub namespace: String,
    /// The pod's name (`K8S_POD_NAME` of `CNI_ARGS`).
    pub name: String,
    /// The pod's addresses from `prevResult.ips` (without prefix lengths).
    #[serde(default)]
    pub ips: Vec<IpAddr>,
    /// The host side of the pod's interface: the `prevResult.interfaces` entry
    /// without a `sandbox`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_interface: Option<String>,
}

impl Request {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Parses a request.
    ///
    /// # Errors
    /// What is wrong ([`RequestError`]): not JSON, no or another `version`, a
    /// missing, mistyped or empty field. Its message is sent back in a
    /// [`Reply::Error`].
    pub fn parse(bytes: &[u8]) -> Result<Request, RequestError> {
        let value: Value = serde_json::from_slice(bytes).map_err(RequestError::NotJson)?;
        if !value.is_object() {
            return Err(RequestError::NotAnObject);
        }
        match value.get("version") {
            None => return Err(RequestError::NoVersion),
            Some(v) if v.as_u64() == Some(u64::from(PROTOCOL_VERSION)) => {}
            Some(v) => {
                return Err(RequestError::UnsupportedVersion { version: v.clone() });
            }
        }
        let request: Request = serde_json::from_value(value).map_err(RequestError::Malformed)?;
        // A pod's namespace and name are never empty (Kubernetes object names).
        for (field, value) in [("namespace", &request.namespace), ("name", &request.name)] {
            if value.is_empty() {
                return Err(RequestError::EmptyField { field });
            }
        }
        Ok(request)
    }
}

/// The agent's answer.
///
/// ```json
/// {"version": 1, "status": "enrolled", "interface": "veth1a2b3c4d"}
/// {"version": 1, "status": "not_enrolled", "reason": "pod opted out"}
/// {"version": 1, "status": "removed"}
/// {"version": 1, "status": "error", "message": "…", "retry": true}
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Reply {
    /// ADD: the pod's map entry and both links exist (on this host interface).
    /// CHECK: they still do.
    Enrolled {
        /// The host veth the programs are attached to.
        interface: String,
    },
    /// The pod is not to be enrolled: nothing was done.
    NotEnrolled {
        /// Why (e.g. `pod opted out`).
        reason: String,
    },
    /// DEL: done (also when the pod was unknown).
    Removed,
    /// The request failed; `retry`: the condition may pass (the runtime should
    /// try again later, CNI error code 11). The message does not name the pod:
    /// the plugin, which sent its name, puts it in front.
    Error {
        /// What went wrong.
        message: String,
        /// Whether trying again later may succeed.
        #[serde(default)]
        retry: bool,
    },
}

/// A [`Reply`] as sent: with `version`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ReplyMessage {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The reply.
    #[serde(flatten)]
    pub reply: Reply,
}

impl Reply {
    /// The reply's JSON line (with `version`, ending in a newline).
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(&ReplyMessage {
            version: PROTOCOL_VERSION,
            reply: self.clone(),
        })
        .unwrap_or_else(|_| r#"{"version":1,"status":"error","message":"unprintable"}"#.into());
        line.push('\n');
        line
    }

    /// Parses a reply line.
    ///
    /// # Errors
    /// What is wrong ([`ReplyError`]): not JSON, another protocol version, or an
    /// unknown `status`.
    pub fn parse(bytes: &[u8]) -> Result<Reply, ReplyError> {
        let value: Value = serde_json::from_slice(bytes).map_err(ReplyError::NotJson)?;
        if value.get("version").and_then(Value::as_u64) != Some(u64::from(PROTOCOL_VERSION)) {
            return Err(ReplyError::UnsupportedVersion {
                version: value.get("version").cloned().unwrap_or(Value::Null),
            });
        }
        let message: ReplyMessage = serde_json::from_value(value).map_err(ReplyError::Malformed)?;
        Ok(message.reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_ones_are_named() {
        let request = Request {
            version: 1,
            command: Command::Add,
            container_id: "c1".into(),
            namespace: "apps".into(),
            name: "web".into(),
            ips: vec!["10.244.1.7".parse().unwrap()],
            host_interface: Some("veth0".into()),
        };
        let text = serde_json::to_string(&request).unwrap();
        assert!(text.contains(r#""command":"ADD""#), "{text}");
        assert!(text.contains(r#""containerId":"c1""#), "{text}");
        assert_eq!(Request::parse(text.as_bytes()).unwrap(), request);
        let err = |s: &str| Request::parse(s.as_bytes()).unwrap_err().to_string();
        assert!(err("{").contains("not JSON"));
        assert!(err("[]").contains("not a JSON object"));
        assert!(err(r#"{"command":"ADD"}"#).contains("no `version`"));
        assert!(err(r#"{"version":2}"#).contains("protocol version 2"));
        assert_eq!(
            err(r#"{"version":"1"}"#),
            r#"protocol version "1" is not supported (this agent speaks version 1)"#
        );
        assert!(matches!(
            Request::parse(
                br#"{"version":1,"command":"ADD","containerId":"c","namespace":"n","name":""}"#
            ),
            Err(RequestError::EmptyField { field: "name" })
        ));
        assert!(err(r#"{"version":1,"command":"ADD"}"#).contains("containerId"));
        assert!(
            err(r#"{"version":1,"command":"NUKE","containerId":"c","namespace":"n","name":"p"}"#)
                .contains("NUKE")
        );
        assert!(
            err(r#"{"version":1,"command":"ADD","containerId":"c","namespace":"","name":"p"}"#)
                .contains("`namespace` is empty")
        );
        assert!(
            err(r#"{"version":1,"command":"ADD","containerId":"c","namespace":"n","name":""}"#)
                .contains("`name` is empty")
        );
    }

    #[test]
    fn replies_round_trip() {
        for reply in [
            Reply::Enrolled {
                interface: "veth0".into(),
            },
            Reply::NotEnrolled {
                reason: "pod opted out".into(),
            },
            Reply::Removed,
            Reply::Error {
                message: "no".into(),
                retry: true,
            },
        ] {
            let line = reply.to_line();
            assert!(line.starts_with(r#"{"version":1,"status":"#), "{line}");
            assert!(line.ends_with('\n'));
            assert_eq!(Reply::parse(line.as_bytes()).unwrap(), reply);
        }
        assert!(
            Reply::parse(br#"{"version":7,"status":"removed"}"#)
                .unwrap_err()
                .to_string()
                .contains("version 7")
        );
    }
}
