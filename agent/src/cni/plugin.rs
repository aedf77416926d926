//! The `podlink-cni` plugin: a chained CNI plugin (CNI spec 1.0, "Section 2:
//! Execution Protocol" and "Section 4: Plugin Delegation"), run by the container
//! runtime after the plugin that made the pod's interface.
//!
//! * `ADD` reads the pod's addresses and host interface from `prevResult`
//!   ("Section 5: Result Types") and the pod's name from `CNI_ARGS`
//!   (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`, as kubelet's runtimes set them), asks
//!   the agent on its socket ([`super::protocol`]) to enroll the pod, and prints
//!   `prevResult` unchanged once the agent answered that the pod is attached or
//!   needs nothing.
//! * When the agent cannot be reached, the plugin decides from the agent's
//!   enrollment snapshot ([`super::snapshot`]): a pod to be enrolled fails (fail
//!   closed, error code 11: the runtime tries again); a pod that needs nothing
//!   passes untouched; without a snapshot every pod fails.
//! * `DEL` tells the agent and always succeeds (idempotent: the agent forgets
//!   the pod's reported addresses; an unreachable agent has nothing to undo).
//! * `CHECK` asks the agent whether a pod to be enrolled is attached.
//! * `VERSION` lists [`SUPPORTED_VERSIONS`].
//!
//! Errors ([`PluginError`]) are printed on stdout as the spec's error object ("Section 6: Error
//! codes"): `{"cniVersion", "code", "msg", "details"}`, with a non-zero exit.
//!
//! The plugin's configuration (its entry of the conflist) may carry `"socket"`:
//! the agent's socket, [`super::DEFAULT_SOCKET`] otherwise.

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::IpAddr,
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
};

use serde::Serialize;
use serde_json::{Value, json};

use super::{
    DEFAULT_SOCKET,
    protocol::{self, Command, Reply, Request},
    snapshot::Snapshot,
};

/// The CNI versions whose configurations and results podlink-cni reads (CNI spec
/// 1.0 and the 0.3/0.4 results of the same shape).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// CNI error code 1: incompatible CNI version.
pub const INCOMPATIBLE_VERSION: u32 = 1;
/// CNI error code 2: unsupported field in the network configuration.
pub const UNSUPPORTED_FIELD: u32 = 2;
/// CNI error code 4: invalid necessary environment variables.
pub const INVALID_ENVIRONMENT: u32 = 4;
/// CNI error code 5: I/O failure (reading stdin).
pub const IO_FAILURE: u32 = 5;
/// CNI error code 6: failed to decode content.
pub const DECODING_FAILURE: u32 = 6;
/// CNI error code 7: invalid network configuration.
pub const INVALID_NETWORK_CONFIG: u32 = 7;
/// CNI error code 11: try again later (the agent cannot be reached, or has not
/// seen the pod yet, and the pod is to be enrolled).
pub const TRY_AGAIN_LATER: u32 = 11;
/// podlink-cni's own code (CNI spec: codes of 100 and more are the plugin's):
/// the agent refused to enroll the pod (e.g. attaching failed).
pub const AGENT_REFUSED: u32 = 999;

/// The largest configuration read on stdin, in bytes.
pub const MAX_STDIN: usize = 1 << 20;

/// A CNI error ("Section 6: Error codes"): printed on stdout as
/// `{"cniVersion": …, "code": …, "msg": …, "details": …}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CniError {
    /// The configuration's `cniVersion` when supported, else `1.0.0`.
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    /// The error code (see the constants of this module).
    pub code: u32,
    /// A short message.
    pub msg: String,
    /// More on it (may be empty).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl From<PluginError> for CniError {
    /// The error object of `error`, in version `1.0.0` (the configuration's
    /// once it is read).
    fn from(error: PluginError) -> Self {
        CniError {
            cni_version: "1.0.0".into(),
            code: error.code(),
            msg: error.to_string(),
            details: error.details(),
        }
    }
}

impl CniError {
    /// The error object in the configuration's `cniVersion`.
    fn in_version(mut self, cni_version: &str) -> Self {
        cni_version.clone_into(&mut self.cni_version);
        self
    }
}

/// What went wrong in a run of the plugin; [`PluginError::code`] is its CNI
/// error code, the message the error object's `msg`.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// `CNI_COMMAND` is not set (code 4).
    #[error("CNI_COMMAND is not set")]
    NoCommand,
    /// `CNI_COMMAND` is none the plugin knows (code 4).
    #[error(
        "unknown CNI_COMMAND {0:?}: podlink-cni supports ADD, DEL, CHECK, VERSION, STATUS and GC"
    )]
    UnknownCommand(String),
    /// An environment variable the command requires is unset or empty (code 4).
    #[error("{variable} is not set (required for {command:?})")]
    MissingVariable {
        /// `CNI_CONTAINERID`, `CNI_NETNS` or `CNI_IFNAME`.
        variable: &'static str,
        /// The command that requires it.
        command: Command,
    },
    /// An entry of `CNI_ARGS` is not `KEY=VALUE` (code 4).
    #[error("CNI_ARGS has {pair:?}, not KEY=VALUE")]
    CniArgs {
        /// The entry.
        pair: String,
    },
    /// Reading stdin failed (code 5).
    #[error("reading stdin: {0}")]
    Stdin(std::io::Error),
    /// The configuration on stdin is over [`MAX_STDIN`] bytes (code 6).
    #[error("the network configuration is over {MAX_STDIN} bytes")]
    ConfigTooLarge,
    /// The configuration is not JSON (code 6); the parser's message is the
    /// details.
    #[error("the network configuration on stdin is not JSON")]
    ConfigNotJson(serde_json::Error),
    /// The configuration is not a JSON object (code 6).
    #[error("the network configuration on stdin is not a JSON object")]
    ConfigNotAnObject,
    /// `cniVersion` is not a string (code 7).
    #[error("`cniVersion` is not a string")]
    VersionNotAString,
    /// `cniVersion` is absent (code 7).
    #[error("the network configuration has no `cniVersion`")]
    NoVersion,
    /// `cniVersion` is not one of [`SUPPORTED_VERSIONS`] (code 1).
    #[error(
        "CNI version {0} is not supported: podlink-cni supports {supported}",
        supported = SUPPORTED_VERSIONS.join(", ")
    )]
    UnsupportedVersion(String),
    /// `socket` is not a non-empty string (code 7).
    #[error("`socket` of podlink-cni's configuration must be a non-empty string (a path)")]
    Socket,
    /// `prevResult` is not an object (code 7).
    #[error("`prevResult` is not a JSON object (a CNI result)")]
    PrevResultNotAnObject,
    /// ADD without `prevResult` (code 7).
    #[error(
        "no `prevResult`: podlink-cni is a chained plugin and must come after the plugin that makes the pod's interface"
    )]
    NoPrevResult,
    /// `prevResult.ips` is not an array (code 7).
    #[error("prevResult.ips is not an array")]
    IpsNotAnArray,
    /// An entry of `prevResult.ips` has no `address` string (code 7).
    #[error("prevResult.ips[{index}] has no address")]
    NoAddress {
        /// The entry's index.
        index: usize,
    },
    /// An `address` of `prevResult.ips` is not an address (code 7).
    #[error("prevResult.ips[{index}].address {address:?} is not an address")]
    BadAddress {
        /// The entry's index.
        index: usize,
        /// The address as given.
        address: String,
    },
    /// The request would be over [`protocol::MAX_MESSAGE`] bytes (code 7).
    #[error(
        "the request to the podlink agent for pod {pod} would be {size} bytes, over its limit of {limit}: the prevResult's addresses or interface name, CNI_CONTAINERID, or the pod's namespace or name in CNI_ARGS, are too long",
        limit = protocol::MAX_MESSAGE
    )]
    RequestTooLarge {
        /// The pod's `namespace/name`.
        pod: String,
        /// The request's size, in bytes.
        size: usize,
    },
    /// The agent answered with an error (code 11 when `retry`, else 999).
    #[error("podlink agent: pod {pod}: {message}")]
    Agent {
        /// The pod's `namespace/name` (the agent's messages do not name it).
        pod: String,
        /// The agent's message.
        message: String,
        /// Whether trying again later may succeed.
        retry: bool,
    },
    /// The agent cannot be reached, and its snapshot enrolls the pod (code 11);
    /// why it cannot be reached is the details.
    #[error(
        "pod {pod} is to be enrolled ({reason}) but the podlink agent cannot be reached on {}: failing closed until it is back",
        socket.display()
    )]
    Unreachable {
        /// The pod's `namespace/name`.
        pod: String,
        /// Why the snapshot enrolls it.
        reason: String,
        /// The agent's socket.
        socket: PathBuf,
        /// Why it cannot be reached.
        why: Box<AgentUnreachable>,
    },
    /// The agent cannot be reached and left no snapshot (code 11).
    #[error(
        "the podlink agent cannot be reached on {} and left no enrollment snapshot ({}): failing closed for pod {pod}, whose enrollment cannot be known",
        socket.display(),
        snapshot.display()
    )]
    NoSnapshot {
        /// The pod's `namespace/name`.
        pod: String,
        /// The agent's socket.
        socket: PathBuf,
        /// Where the snapshot would be.
        snapshot: PathBuf,
        /// Why the agent cannot be reached.
        why: Box<AgentUnreachable>,
    },
    /// The agent cannot be reached and its snapshot cannot be read (code 11).
    #[error(
        "the podlink agent cannot be reached on {} and its enrollment snapshot is unreadable: failing closed for pod {pod}",
        socket.display()
    )]
    SnapshotUnreadable {
        /// The pod's `namespace/name`.
        pod: String,
        /// The agent's socket.
        socket: PathBuf,
        /// Why the agent cannot be reached.
        why: Box<AgentUnreachable>,
        /// Why the snapshot cannot be read ([`Snapshot::read`]).
        error: super::Error,
    },
}

impl PluginError {
    /// The CNI error code ("Section 6: Error codes", and [`AGENT_REFUSED`]).
    pub fn code(&self) -> u32 {
        match self {
            PluginError::NoCommand
            | PluginError::UnknownCommand(_)
            | PluginError::MissingVariable { .. }
            | PluginError::CniArgs { .. } => INVALID_ENVIRONMENT,
            PluginError::Stdin(_) => IO_FAILURE,
            PluginError::ConfigTooLarge
            | PluginError::ConfigNotJson(_)
            | PluginError::ConfigNotAnObject => DECODING_FAILURE,
            PluginError::UnsupportedVersion(_) => INCOMPATIBLE_VERSION,
            PluginError::VersionNotAString
            | PluginError::NoVersion
            | PluginError::Socket
            | PluginError::PrevResultNotAnObject
            | PluginError::NoPrevResult
            | PluginError::IpsNotAnArray
            | PluginError::NoAddress { .. }
            | PluginError::BadAddress { .. }
            | PluginError::RequestTooLarge { .. } => INVALID_NETWORK_CONFIG,
            PluginError::Agent { retry: true, .. }
            | PluginError::Unreachable { .. }
            | PluginError::NoSnapshot { .. }
            | PluginError::SnapshotUnreadable { .. } => TRY_AGAIN_LATER,
            PluginError::Agent { retry: false, .. } => AGENT_REFUSED,
        }
    }

    /// The error object's `details`: the cause the message does not give
    /// (empty when none).
    pub fn details(&self) -> String {
        match self {
            PluginError::ConfigNotJson(e) => e.to_string(),
            PluginError::Unreachable { why, .. } | PluginError::NoSnapshot { why, .. } => {
                why.to_string()
            }
            PluginError::SnapshotUnreadable { why, error, .. } => format!("{why}; {error}"),
            _ => String::new(),
        }
    }
}

/// Why the agent could not be asked (one exchange on its socket): the plugin then takes it as
/// unreachable.
#[derive(Debug, thiserror::Error)]
pub enum AgentUnreachable {
    /// Connecting to its socket failed.
    #[error("connecting to {}: {error}", socket.display())]
    Connect {
        /// The agent's socket.
        socket: PathBuf,
        /// The failure.
        error: std::io::Error,
    },
    /// Sending the request or reading the reply failed.
    #[error("talking to the agent on {}: {error}", socket.display())]
    Exchange {
        /// The agent's socket.
        socket: PathBuf,
        /// The failure.
        error: std::io::Error,
    },
    /// The reply is over [`protocol::MAX_MESSAGE`] bytes.
    #[error("the agent's reply is over {} bytes", protocol::MAX_MESSAGE)]
    ReplyTooLarge,
    /// The reply cannot be read.
    #[error(transparent)]
    Reply(#[from] protocol::ReplyError),
}

/// What the plugin found in its environment and configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Invocation {
    command: Command,
    container_id: String,
    socket: PathBuf,
    /// `(namespace, name)` from `CNI_ARGS`; `None`: not a Kubernetes pod.
    pod: Option<(String, String)>,
    /// `prevResult` as given (printed back by ADD).
    prev_result: Option<Value>,
}

/// One exchange with the agent: `ask(socket, line)` sends `line` (a request as
/// JSON and a newline) to the agent's socket `socket` and reads its reply.
pub type Ask = dyn Fn(&Path, &[u8]) -> Result<Reply, AgentUnreachable>;

/// Runs the plugin: `env` looks up environment variables, `stdin` is the
/// configuration. Returns what to print on stdout on success (nothing for DEL
/// and CHECK).
///
/// # Errors
/// The CNI error to print (with a non-zero exit).
pub fn run(env: &dyn Fn(&str) -> Option<String>, stdin: &[u8]) -> Result<String, CniError> {
    run_with(env, stdin, &ask)
}

/// [`run`] with `ask` in place of the exchange with the agent on its socket.
/// The fuzz target of `fuzz/` answers there without a socket.
///
/// # Errors
/// As [`run`].
pub fn run_with(
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &[u8],
    ask: &Ask,
) -> Result<String, CniError> {
    let Some(command) = env("CNI_COMMAND") else {
        return Err(PluginError::NoCommand.into());
    };
    let command = match command.as_str() {
        "VERSION" => return Ok(version(stdin)),
        // CNI 1.1: podlink-cni holds no resources a runtime could collect, and
        // is ready whenever it can run (the agent's absence is decided per ADD).
        "STATUS" | "GC" => return Ok(String::new()),
        "ADD" => Command::Add,
        "DEL" => Command::Del,
        "CHECK" => Command::Check,
        other => return Err(PluginError::UnknownCommand(other.to_string()).into()),
    };
    let result = configured(command, env, stdin, ask);
    match result {
        // A failing DEL blocks the sandbox's teardown: it is best effort.
        Err(e) if command == Command::Del => {
            eprintln!(
                "podlink-cni: DEL: {} ({}); nothing undone",
                e.msg, e.details
            );
            Ok(String::new())
        }
        other => other,
    }
}

/// [`run`] past the command: the configuration, then the operation.
fn configured(
    command: Command,
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &[u8],
    ask: &Ask,
) -> Result<String, CniError> {
    let config: Value = serde_json::from_slice(stdin).map_err(PluginError::ConfigNotJson)?;
    let Some(config) = config.as_object() else {
        return Err(PluginError::ConfigNotAnObject.into());
    };
    let cni_version = match config.get("cniVersion") {
        Some(Value::String(v)) => v.clone(),
        Some(_) => return Err(PluginError::VersionNotAString.into()),
        None => return Err(PluginError::NoVersion.into()),
    };
    if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
        return Err(PluginError::UnsupportedVersion(cni_version).into());
    }
    invocation(command, env, config)
        .and_then(|invocation| execute(&invocation, ask))
        .map_err(|e| CniError::from(e).in_version(&cni_version))
}

/// The `VERSION` answer ("Section 2: VERSION"): the versions supported, with
/// the `cniVersion` of the input when it gives one.
fn version(stdin: &[u8]) -> String {
    let asked = serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| {
            v.get("cniVersion")
                .and_then(Value::as_str)
                .map(String::from)
        })
        .filter(|v| SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| "1.0.0".into());
    json!({"cniVersion": asked, "supportedVersions": SUPPORTED_VERSIONS}).to_string()
}

/// Reads `CNI_ARGS`: `KEY=VALUE` pairs separated by `;` ("Section 2: Parameters").
fn cni_args(args: &str) -> Result<HashMap<String, String>, PluginError> {
    let mut map = HashMap::new();
    for pair in args.split(';').filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(PluginError::CniArgs {
                pair: pair.to_string(),
            });
        };
        map.insert(key.to_string(), value.to_string());
    }
    Ok(map)
}

fn invocation(
    command: Command,
    env: &dyn Fn(&str) -> Option<String>,
    config: &serde_json::Map<String, Value>,
) -> Result<Invocation, PluginError> {
    // "Section 2: Parameters": which variables each operation requires.
    let required: &[&str] = match command {
        Command::Add | Command::Check => &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"],
        Command::Del => &["CNI_CONTAINERID", "CNI_IFNAME"],
    };
    for &variable in required {
        if env(variable).is_none_or(|v| v.is_empty()) {
            return Err(PluginError::MissingVariable { variable, command });
        }
    }
    let container_id = env("CNI_CONTAINERID").unwrap_or_default();
    let args = cni_args(&env("CNI_ARGS").unwrap_or_default())?;
    let pod = match (args.get("K8S_POD_NAMESPACE"), args.get("K8S_POD_NAME")) {
        (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => {
            Some((ns.clone(), name.clone()))
        }
        _ => None,
    };
    let socket = match config.get("socket") {
        None => PathBuf::from(DEFAULT_SOCKET),
        Some(Value::String(s)) if !s.is_empty() => PathBuf::from(s),
        Some(_) => return Err(PluginError::Socket),
    };
    let prev_result = config.get("prevResult").cloned();
    if command != Command::Del && prev_result.as_ref().is_some_and(|r| !r.is_object()) {
        return Err(PluginError::PrevResultNotAnObject);
    }
    if command == Command::Add && prev_result.is_none() {
        return Err(PluginError::NoPrevResult);
    }
    Ok(Invocation {
        command,
        container_id,
        socket,
        pod,
        prev_result,
    })
}

/// The pod's addresses (without prefix lengths) and host interface (the
/// interface without `sandbox`) in a result ("Section 5: Result Types").
fn addresses(result: &Value) -> Result<(Vec<IpAddr>, Option<String>), PluginError> {
    let mut ips = Vec::new();
    if let Some(list) = result.get("ips") {
        let list = list.as_array().ok_or(PluginError::IpsNotAnArray)?;
        for (index, entry) in list.iter().enumerate() {
            let address = entry
                .get("address")
                .and_then(Value::as_str)
                .ok_or(PluginError::NoAddress { index })?;
            let ip = address
                .split('/')
                .next()
                .and_then(|a| a.parse::<IpAddr>().ok())
                .ok_or_else(|| PluginError::BadAddress {
                    index,
                    address: address.to_string(),
                })?;
            ips.push(ip);
        }
    }
    let host_interface = result
        .get("interfaces")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|i| {
            i.get("sandbox")
                .and_then(Value::as_str)
                .unwrap_or("")
                .is_empty()
        })
        .and_then(|i| i.get("name").and_then(Value::as_str))
        .map(String::from);
    Ok((ips, host_interface))
}

fn execute(inv: &Invocation, ask: &Ask) -> Result<String, PluginError> {
    let passthrough = || {
        inv.prev_result
            .as_ref()
            .map(Value::to_string)
            .unwrap_or_default()
    };
    let Some((namespace, name)) = inv.pod.clone() else {
        // Not a Kubernetes pod: nothing of podlink's to do.
        return Ok(if inv.command == Command::Add {
            passthrough()
        } else {
            String::new()
        });
    };
    let (ips, host_interface) = match &inv.prev_result {
        // DEL needs no addresses (the agent forgets the pod by its sandbox).
        Some(_) if inv.command == Command::Del => (Vec::new(), None),
        Some(result) => addresses(result)?,
        None => (Vec::new(), None),
    };
    let request = Request {
        version: protocol::PROTOCOL_VERSION,
        command: inv.command,
        container_id: inv.container_id.clone(),
        namespace: namespace.clone(),
        name: name.clone(),
        ips,
        host_interface,
    };
    let key = request.key();
    // The agent reads at most MAX_MESSAGE bytes and resets a longer request, which
    // would read here as an agent that cannot be reached.
    let mut line = serde_json::to_vec(&request).expect("a request serializes");
    line.push(b'\n');
    let size = line.len();
    if size > protocol::MAX_MESSAGE {
        let error = PluginError::RequestTooLarge { pod: key, size };
        if inv.command == Command::Del {
            eprintln!("podlink-cni: DEL: {error}; nothing to undo");
            return Ok(String::new());
        }
        return Err(error);
    }
    match ask(&inv.socket, &line) {
        Ok(Reply::Enrolled { .. } | Reply::NotEnrolled { .. } | Reply::Removed) => {
            Ok(if inv.command == Command::Add {
                passthrough()
            } else {
                String::new()
            })
        }
        // The agent's messages do not name the pod: its request did.
        Ok(Reply::Error { message, retry }) => Err(PluginError::Agent {
            pod: key,
            message,
            retry,
        }),
        Err(unreachable) if inv.command == Command::Del => {
            // Nothing to undo without the agent: it forgets the pod by itself.
            eprintln!("podlink-cni: DEL of {key}: {unreachable}; nothing to undo");
            Ok(String::new())
        }
        Err(unreachable) => {
            let snapshot_path = Snapshot::path_for(&inv.socket);
            match Snapshot::read(&snapshot_path) {
                Ok(Some(snapshot)) => match snapshot.enrolls(&namespace, &name) {
                    None => {
                        eprintln!(
                            "podlink-cni: {unreachable}; pod {key} is not enrolled by the agent's last snapshot ({}): leaving it untouched",
                            snapshot_path.display()
                        );
                        Ok(if inv.command == Command::Add {
                            passthrough()
                        } else {
                            String::new()
                        })
                    }
                    Some(reason) => Err(PluginError::Unreachable {
                        pod: key,
                        reason,
                        socket: inv.socket.clone(),
                        why: Box::new(unreachable),
                    }),
                },
                Ok(None) => Err(PluginError::NoSnapshot {
                    pod: key,
                    socket: inv.socket.clone(),
                    snapshot: snapshot_path,
                    why: Box::new(unreachable),
                }),
                Err(error) => Err(PluginError::SnapshotUnreadable {
                    pod: key,
                    socket: inv.socket.clone(),
                    why: Box::new(unreachable),
                    error,
                }),
            }
        }
    }
}

/// How long connecting to the agent's socket may take.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// One exchange with the agent: sends `line` (a request as JSON and a newline).
///
/// # Errors
/// Why it could not be had (the agent is then taken as unreachable).
fn ask(socket: &Path, line: &[u8]) -> Result<Reply, AgentUnreachable> {
    // Not a plain connect: with the agent wedged and its listen backlog full it
    // would block for ever. A full backlog fails at once (EAGAIN) this way.
    let connect = || -> std::io::Result<UnixStream> {
        let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
        s.connect_timeout(&socket2::SockAddr::unix(socket)?, CONNECT_TIMEOUT)?;
        s.set_nonblocking(false)?;
        Ok(UnixStream::from(std::os::fd::OwnedFd::from(s)))
    };
    let mut stream = connect().map_err(|error| AgentUnreachable::Connect {
        socket: socket.to_path_buf(),
        error,
    })?;
    let io = |error| AgentUnreachable::Exchange {
        socket: socket.to_path_buf(),
        error,
    };
    stream
        .set_read_timeout(Some(protocol::REPLY_TIMEOUT))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(protocol::REQUEST_TIMEOUT))
        .map_err(io)?;
    stream.write_all(line).map_err(io)?;
    stream.shutdown(std::net::Shutdown::Write).map_err(io)?;
    let mut reply = Vec::new();
    stream
        .take(protocol::MAX_MESSAGE as u64 + 1)
        .read_to_end(&mut reply)
        .map_err(io)?;
    if reply.len() > protocol::MAX_MESSAGE {
        return Err(AgentUnreachable::ReplyTooLarge);
    }
    Ok(Reply::parse(&reply)?)
}

/// The plugin's `main`: reads stdin and the environment, prints the result or
/// the error object on stdout; returns the exit code (0 on success, 1 on error).
pub fn main() -> std::process::ExitCode {
    let mut stdin = Vec::new();
    let result = match std::io::stdin()
        .take(MAX_STDIN as u64 + 1)
        .read_to_end(&mut stdin)
    {
        Err(e) => Err(PluginError::Stdin(e).into()),
        Ok(_) if stdin.len() > MAX_STDIN => Err(PluginError::ConfigTooLarge.into()),
        Ok(_) => run(&|name| std::env::var(name).ok(), &stdin),
    };
    let mut out = std::io::stdout().lock();
    match result {
        Ok(text) => {
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            let text = serde_json::to_string(&error).unwrap_or_default();
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
            eprintln!("podlink-cni: {} (code {})", error.msg, error.code);
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, os::unix::net::UnixListener};

    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const PREV: &str = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"veth1234","mac":"aa:bb:cc:dd:ee:ff"},{"name":"eth0","mac":"11:22:33:44:55:66","sandbox":"/run/netns/p"}],"ips":[{"address":"10.244.1.7/24","gateway":"10.244.1.1","interface":1}]}"#;

    fn config(socket: &Path) -> String {
        format!(
            r#"{{"cniVersion":"1.0.0","name":"k8s","type":"podlink-cni","socket":{},"prevResult":{PREV}}}"#,
            serde_json::to_string(socket).unwrap()
        )
    }

    fn pod_env(command: &str) -> Vec<(&str, &str)> {
        vec![
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/run/netns/p"),
            ("CNI_IFNAME", "eth0"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=apps;K8S_POD_NAME=web",
            ),
        ]
    }

    #[test]
    fn version_lists_the_supported_versions() {
        let out = run(
            &env_of(&[("CNI_COMMAND", "VERSION")]),
            br#"{"cniVersion":"0.4.0"}"#,
        )
        .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(v["supportedVersions"][3], "1.0.0");
        assert!(run(&env_of(&[("CNI_COMMAND", "VERSION")]), b"").is_ok());
    }

    #[test]
    fn bad_input_gets_the_right_error_code() {
        let dir = tempfile::tempdir().unwrap();
        let good = config(&dir.path().join("cni.sock"));
        let code =
            |env: &[(&str, &str)], stdin: &str| run(&env_of(env), stdin.as_bytes()).unwrap_err();
        assert_eq!(code(&[], &good).code, INVALID_ENVIRONMENT);
        assert_eq!(
            code(&[("CNI_COMMAND", "FROB")], &good).code,
            INVALID_ENVIRONMENT
        );
        // CNI 1.1's STATUS and GC succeed; 1.1.0 configurations are spoken.
        for command in ["STATUS", "GC"] {
            assert_eq!(
                run(&env_of(&[("CNI_COMMAND", command)]), b"{}"),
                Ok(String::new())
            );
        }
        assert_eq!(
            code(
                &pod_env("ADD"),
                &good.replace("\"1.0.0\",\"name\"", "\"1.1.0\",\"name\"")
            )
            .code,
            TRY_AGAIN_LATER,
            "1.1.0 is refused"
        );
        // DEL never fails: a version it does not know, a broken prevResult.
        for stdin in [
            good.replace("\"1.0.0\",\"name\"", "\"9.9.9\",\"name\""),
            good.replace(r#""ips":["#, r#""ips":7,"x":["#),
            "{not json".to_string(),
        ] {
            assert_eq!(
                run(&env_of(&pod_env("DEL")), stdin.as_bytes()),
                Ok(String::new())
            );
        }
        // A request longer than the agent reads is refused here, by name, not
        // taken for an agent that cannot be reached; DEL still succeeds.
        let long_id = "c".repeat(protocol::MAX_MESSAGE);
        for command in ["ADD", "DEL"] {
            let mut env = pod_env(command);
            env[1] = ("CNI_CONTAINERID", long_id.as_str());
            let result = run(&env_of(&env), good.as_bytes());
            if command == "DEL" {
                assert_eq!(result, Ok(String::new()));
            } else {
                let e = result.unwrap_err();
                assert_eq!(e.code, INVALID_NETWORK_CONFIG, "{}", e.msg);
                assert!(e.msg.contains("over its limit of 65536"), "{}", e.msg);
            }
        }
        // A prevResult that is not a result.
        let e = code(
            &pod_env("ADD"),
            r#"{"cniVersion":"1.0.0","name":"k8s","type":"podlink-cni","prevResult":"x"}"#,
        );
        assert_eq!(e.code, INVALID_NETWORK_CONFIG);
        // VERSION answers in a version it speaks.
        let v: Value = serde_json::from_str(
            &run(
                &env_of(&[("CNI_COMMAND", "VERSION")]),
                br#"{"cniVersion":"garbage"}"#,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(v["cniVersion"], "1.0.0");
        let e = code(&pod_env("ADD"), "{not json");
        assert_eq!(
            (e.code, e.cni_version.as_str()),
            (DECODING_FAILURE, "1.0.0")
        );
        assert_eq!(code(&pod_env("ADD"), "[1]").code, DECODING_FAILURE);
        assert_eq!(
            code(&pod_env("ADD"), r#"{"name":"x"}"#).code,
            INVALID_NETWORK_CONFIG
        );
        let e = code(
            &pod_env("ADD"),
            &good.replace("\"1.0.0\",\"name\"", "\"9.9.9\",\"name\""),
        );
        assert_eq!(e.code, INCOMPATIBLE_VERSION);
        assert!(e.msg.contains("9.9.9"), "{e:?}");
        let mut missing = pod_env("ADD");
        missing.retain(|(k, _)| *k != "CNI_NETNS");
        let e = code(&missing, &good);
        assert_eq!(e.code, INVALID_ENVIRONMENT);
        assert!(e.msg.contains("CNI_NETNS"), "{e:?}");
        let mut bad_args = pod_env("ADD");
        bad_args[4].1 = "K8S_POD_NAME";
        assert_eq!(code(&bad_args, &good).code, INVALID_ENVIRONMENT);
        let no_prev = r#"{"cniVersion":"1.0.0","name":"k8s","type":"podlink-cni"}"#;
        let e = code(&pod_env("ADD"), no_prev);
        assert!(e.msg.contains("prevResult"), "{e:?}");
        assert_eq!(e.code, INVALID_NETWORK_CONFIG);
        let e = code(
            &pod_env("ADD"),
            &good.replace(r#""socket":"#, r#""socket":7,"x":"#),
        );
        assert_eq!(e.code, INVALID_NETWORK_CONFIG);
        let e = code(&pod_env("ADD"), &good.replace("10.244.1.7/24", "ten"));
        assert!(e.msg.contains("prevResult.ips[0]"), "{e:?}");
        // The error object's shape (spec "Error codes").
        let printed: Value = serde_json::to_value(&e).unwrap();
        assert_eq!(printed["cniVersion"], "1.0.0");
        assert_eq!(printed["code"], 7);
        assert!(printed["msg"].is_string());
    }

    #[test]
    fn errors_keep_their_codes_and_messages() {
        let e = PluginError::MissingVariable {
            variable: "CNI_NETNS",
            command: Command::Add,
        };
        assert_eq!(e.to_string(), "CNI_NETNS is not set (required for Add)");
        assert_eq!(e.code(), INVALID_ENVIRONMENT);
        let e = PluginError::Agent {
            pod: "apps/web".into(),
            message: "attaching failed".into(),
            retry: false,
        };
        assert_eq!(
            (e.code(), e.to_string().as_str()),
            (
                AGENT_REFUSED,
                "podlink agent: pod apps/web: attaching failed"
            )
        );
        assert_eq!(
            CniError::from(PluginError::UnsupportedVersion("9.9.9".into())).in_version("0.4.0"),
            CniError {
                cni_version: "0.4.0".into(),
                code: INCOMPATIBLE_VERSION,
                msg: "CNI version 9.9.9 is not supported: podlink-cni supports 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0".into(),
                details: String::new(),
            }
        );
        // Why the agent cannot be reached is the details.
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("cni.sock");
        let e = run(&env_of(&pod_env("ADD")), config(&socket).as_bytes()).unwrap_err();
        assert!(
            e.details
                .starts_with(&format!("connecting to {}: ", socket.display())),
            "{e:?}"
        );
    }

    #[test]
    fn prev_result_addresses_and_host_interface() {
        let (ips, host) = addresses(&serde_json::from_str(PREV).unwrap()).unwrap();
        assert_eq!(ips, vec!["10.244.1.7".parse::<IpAddr>().unwrap()]);
        assert_eq!(host.as_deref(), Some("veth1234"));
    }

    /// A fake agent answering `reply` to one request; returns what it received.
    fn fake_agent(socket: &Path, reply: Reply) -> std::thread::JoinHandle<Request> {
        let listener = UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buf = Vec::new();
            stream.read_to_end(&mut buf).unwrap();
            stream.write_all(reply.to_line().as_bytes()).unwrap();
            Request::parse(&buf).unwrap()
        })
    }

    #[test]
    fn add_asks_the_agent_and_returns_prev_result_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("cni.sock");
        let agent = fake_agent(
            &socket,
            Reply::Enrolled {
                interface: "veth1234".into(),
            },
        );
        let out = run(&env_of(&pod_env("ADD")), config(&socket).as_bytes()).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&out).unwrap(),
            serde_json::from_str::<Value>(PREV).unwrap()
        );
        let request = agent.join().unwrap();
        assert_eq!(request.key(), "apps/web");
        assert_eq!(request.container_id, "c1");
        assert_eq!(request.host_interface.as_deref(), Some("veth1234"));
        assert_eq!(request.ips.len(), 1);

        std::fs::remove_file(&socket).unwrap();
        let agent = fake_agent(
            &socket,
            Reply::Error {
                message: "not found in time".into(),
                retry: true,
            },
        );
        let e = run(&env_of(&pod_env("ADD")), config(&socket).as_bytes()).unwrap_err();
        assert_eq!(e.code, TRY_AGAIN_LATER);
        assert!(e.msg.contains("not found in time"), "{e:?}");
        agent.join().unwrap();
    }

    #[test]
    fn an_unreachable_agent_fails_closed_for_pods_to_enroll() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("cni.sock");
        let cfg = config(&socket);
        // No snapshot: every pod fails.
        let e = run(&env_of(&pod_env("ADD")), cfg.as_bytes()).unwrap_err();
        assert_eq!(e.code, TRY_AGAIN_LATER);
        assert!(e.msg.contains("no enrollment snapshot"), "{e:?}");
        // DEL always succeeds.
        assert_eq!(run(&env_of(&pod_env("DEL")), cfg.as_bytes()).unwrap(), "");
        let snapshot = Snapshot {
            version: 1,
            node: "n1".into(),
            ambient_namespaces: ["apps".to_string()].into(),
            ..Snapshot::default()
        };
        snapshot.write(&Snapshot::path_for(&socket)).unwrap();
        let e = run(&env_of(&pod_env("ADD")), cfg.as_bytes()).unwrap_err();
        assert_eq!(e.code, TRY_AGAIN_LATER);
        assert!(e.msg.contains("namespace apps"), "{e:?}");
        assert!(e.msg.contains(&socket.display().to_string()), "{e:?}");
        let mut other = pod_env("ADD");
        other[4].1 = "K8S_POD_NAMESPACE=plain;K8S_POD_NAME=web";
        let out = run(&env_of(&other), cfg.as_bytes()).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&out).unwrap(),
            serde_json::from_str::<Value>(PREV).unwrap()
        );
        // Not a Kubernetes pod: untouched.
        let mut bare = pod_env("ADD");
        bare.pop();
        assert!(run(&env_of(&bare), cfg.as_bytes()).is_ok());
    }
}
