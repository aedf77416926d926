//! The errors of installing podlink-cni, editing conflists, the agent's CNI
//! socket and the enrollment snapshot.
//!
//! Each variant names what it was doing and on what: the file, the directory,
//! the conflist, the socket; its message ends with its cause (see
//! [`crate::error`]).

use std::{io, path::PathBuf};

pub use crate::error::IoError;

use super::{plugin::SUPPORTED_VERSIONS, snapshot::SNAPSHOT_VERSION};

/// The results of the CNI side's files and socket.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong installing podlink-cni, editing a conflist, binding the
/// agent's CNI socket, or reading or writing the enrollment snapshot.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file system operation failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A file to replace has no file name (it ends in `..`, or is `/`).
    #[error("{path} has no file name")]
    NoFileName {
        /// The path.
        path: PathBuf,
    },
    /// A conflist cannot be edited (named, with what is wrong).
    #[error("{path} is not a CNI network configuration list: {error}")]
    NotAConflist {
        /// The conflist.
        path: PathBuf,
        /// What is wrong with its text.
        error: ConflistError,
    },
    /// The CNI configuration directory holds no configuration (yet).
    #[error(
        "no CNI configuration in {dir}: podlink-cni chains after the node's primary CNI plugin, whose configuration list is not there (yet)"
    )]
    NoConfiguration {
        /// The CNI configuration directory (`/etc/cni/net.d`).
        dir: PathBuf,
    },
    /// The configuration runtimes use is a single-plugin `*.conf` or `*.json`.
    #[error(
        "the node's CNI configuration {path} (the first one, which runtimes use) is a single-plugin configuration: podlink-cni can only be chained into a configuration list (*.conflist); not installing"
    )]
    SinglePlugin {
        /// The configuration file.
        path: PathBuf,
    },
    /// The running executable, beside which the plugin binary is, is unknown.
    #[error("finding the running executable: {error}")]
    CurrentExe {
        /// The system call's error.
        error: io::Error,
    },
    /// The plugin binary to install is not there.
    #[error("the podlink-cni binary {path} is missing (give --cni-plugin)")]
    MissingBinary {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// Copying the plugin binary into the CNI plugin directory failed.
    #[error("copying {from} to {to}: {error}")]
    Copy {
        /// The plugin binary.
        from: PathBuf,
        /// The temporary file in the CNI plugin directory.
        to: PathBuf,
        /// The system call's error.
        error: io::Error,
    },
    /// The copied plugin binary could not be made mode 0755.
    #[error("making {path} executable: {error}")]
    MakeExecutable {
        /// The temporary file in the CNI plugin directory.
        path: PathBuf,
        /// The system call's error.
        error: io::Error,
    },
    /// The CNI socket's path holds something else than a socket.
    #[error("{path} exists and is not a socket: not replacing it")]
    NotASocket {
        /// The socket's path.
        path: PathBuf,
    },
    /// The enrollment snapshot is not JSON of its shape.
    #[error("{path} is not an enrollment snapshot: {error}")]
    NotASnapshot {
        /// The snapshot file.
        path: PathBuf,
        /// The parser's error.
        error: serde_json::Error,
    },
    /// The enrollment snapshot has a format version this podlink does not know.
    #[error("{path} has version {version}, not {SNAPSHOT_VERSION}")]
    SnapshotVersion {
        /// The snapshot file.
        path: PathBuf,
        /// Its `version`.
        version: u32,
    },
    /// The enrollment snapshot could not be encoded.
    #[error("encoding the enrollment snapshot: {error}")]
    EncodeSnapshot {
        /// The encoder's error.
        error: serde_json::Error,
    },
}

/// Why the text of a conflist cannot be edited ([`super::without_plugin`],
/// [`super::install::with_plugin`]); [`Error::NotAConflist`] names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConflistError {
    /// The text is not JSON.
    #[error("not JSON: {error}")]
    NotJson {
        /// The parser's error.
        error: serde_json::Error,
    },
    /// The text is JSON but not an object.
    #[error("not a JSON object")]
    NotAnObject,
    /// `plugins` is there but not an array.
    #[error("`plugins` is not an array")]
    PluginsNotAnArray,
    /// `plugins` is absent or not an array (podlink-cni cannot be added).
    #[error("no `plugins` array")]
    NoPlugins,
    /// `cniVersion` is absent or one podlink-cni does not speak (every ADD and
    /// DEL on the node would fail).
    #[error(
        "its cniVersion {version:?} is not one podlink-cni supports ({}): not adding podlink-cni",
        SUPPORTED_VERSIONS.join(", ")
    )]
    UnsupportedVersion {
        /// The `cniVersion` given (empty when absent or not a string).
        version: String,
    },
    /// The edited conflist could not be encoded.
    #[error("encoding the conflist: {error}")]
    Encode {
        /// The encoder's error.
        error: serde_json::Error,
    },
}
