//! The CNI side of podlink: the chained plugin `podlink-cni` ([`plugin`]), the
//! protocol it speaks with the agent ([`protocol`]), the agent's socket
//! ([`socket`]), enrollment-on-ADD ([`enroller`]) with the addresses the plugin
//! reports laid over the source's pods ([`overlay`]), the enrollment snapshot the plugin reads while
//! the agent is down ([`snapshot`]), installing the plugin ([`install`]), and
//! taking it out of a node's CNI network configuration lists, for `podlink
//! uninstall` (here). Their errors are [`Error`] (of a conflist's text,
//! [`ConflistError`]).
//!
//! A network configuration list (CNI spec 1.0, "Network Configuration Lists") is a
//! JSON object whose `plugins` array holds one object per plugin, each with a
//! `type` naming the plugin binary; the runtime reads every `*.conflist` of its
//! configuration directory (`/etc/cni/net.d` by default).

use crate::error::IoError;
use std::{
    fs,
    io::{self, Write as _},
    path::{Path, PathBuf},
};

use serde_json::Value;

pub use self::error::{ConflistError, Error, Result};

pub mod enroller;
mod error;
pub mod install;
pub mod overlay;
pub mod plugin;
pub mod protocol;
pub mod snapshot;
pub mod socket;

/// The `type` of podlink's chained plugin in a conflist.
pub const PLUGIN_TYPE: &str = "podlink-cni";
/// The CNI configuration directory of container runtimes by default.
pub const DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
/// The CNI plugin binary directory of container runtimes by default.
pub const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";
/// The Unix socket on which the agent answers podlink-cni by default.
pub const DEFAULT_SOCKET: &str = "/var/run/podlink/cni.sock";

/// Where to install the podlink-cni plugin.
#[derive(Clone, Debug)]
pub struct Install {
    /// The plugin binary to copy; `None`: `podlink-cni` beside the running
    /// executable.
    pub plugin: Option<PathBuf>,
    /// The runtime's CNI plugin directory (`/opt/cni/bin`).
    pub bin_dir: PathBuf,
    /// The runtime's CNI configuration directory (`/etc/cni/net.d`).
    pub conf_dir: PathBuf,
}

/// `text` (a conflist) without its `plugins` entries of type [`PLUGIN_TYPE`]; `None`
/// when it has none. Everything else is kept in its order (`serde_json` with
/// `preserve_order`), printed with two-space indents.
///
/// # Errors
/// When `text` is not a JSON object, or its `plugins` is not an array.
pub fn without_plugin(text: &str) -> Result<Option<String>, ConflistError> {
    let mut conf: Value =
        serde_json::from_str(text).map_err(|error| ConflistError::NotJson { error })?;
    let Some(object) = conf.as_object_mut() else {
        return Err(ConflistError::NotAnObject);
    };
    let Some(plugins) = object.get_mut("plugins") else {
        return Ok(None);
    };
    let Some(plugins) = plugins.as_array_mut() else {
        return Err(ConflistError::PluginsNotAnArray);
    };
    let before = plugins.len();
    plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE));
    if plugins.len() == before {
        return Ok(None);
    }
    let mut out =
        serde_json::to_string_pretty(&conf).map_err(|error| ConflistError::Encode { error })?;
    if text.ends_with('\n') {
        out.push('\n');
    }
    Ok(Some(out))
}

/// Replaces `path` by a file holding `text`, by rename (never half written),
/// keeping its permissions. A symbolic link is followed: its target is
/// replaced, the link stays.
///
/// # Errors
/// [`Error::Io`] following the link, writing the temporary file or renaming it;
/// [`Error::NoFileName`] for a path without one.
pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let resolved;
    let path = if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        resolved = fs::canonicalize(path).map_err(IoError::at("following the link", path))?;
        resolved.as_path()
    } else {
        path
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::NoFileName {
            path: path.to_path_buf(),
        })?
        .to_string_lossy();
    // Not `*.conflist`: a runtime reading the directory meanwhile ignores it.
    let tmp = path.with_file_name(format!(".{name}.podlink-partial"));
    let mut file = fs::File::create(&tmp).map_err(IoError::at("writing", &tmp))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(IoError::at("writing", &tmp))?;
    if let Ok(meta) = fs::metadata(path) {
        let _ = fs::set_permissions(&tmp, meta.permissions());
    }
    fs::rename(&tmp, path).map_err(IoError::at("replacing", path))?;
    Ok(())
}

/// Removes the [`PLUGIN_TYPE`] entries from every `*.conflist` in `conf_dir`,
/// rewriting only the files that had one. A missing directory has none.
/// Returns the files changed.
///
/// # Errors
/// A conflist that cannot be read ([`Error::Io`]), parsed ([`Error::NotAConflist`],
/// named, with what is wrong) or written ([`Error::Io`], named).
pub fn remove_plugin(conf_dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(conf_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(IoError::at("reading", conf_dir)(e).into()),
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "conflist") && p.is_file())
        .collect();
    files.sort();
    let mut changed = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).map_err(IoError::at("reading", &path))?;
        let new = without_plugin(&text).map_err(|error| Error::NotAConflist {
            path: path.clone(),
            error,
        })?;
        if let Some(new) = new {
            write_atomically(&path, &new)?;
            changed.push(path);
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFLIST: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "k8s-pod-network",
  "plugins": [
    {
      "type": "ptp",
      "ipam": {
        "type": "host-local",
        "subnet": "10.244.1.0/24"
      }
    },
    {
      "type": "podlink-cni",
      "log_level": "info"
    },
    {
      "type": "portmap",
      "capabilities": {
        "portMappings": true
      }
    }
  ]
}
"#;

    #[test]
    fn only_the_plugin_entry_goes_and_the_rest_keeps_its_order() {
        let out = without_plugin(CONFLIST).unwrap().unwrap();
        let expected = CONFLIST.replace(
            "    {\n      \"type\": \"podlink-cni\",\n      \"log_level\": \"info\"\n    },\n",
            "",
        );
        assert_eq!(out, expected);
        assert_eq!(without_plugin(&out).unwrap(), None);
    }

    #[test]
    fn bad_conflists_are_refused_with_the_reason() {
        assert!(format!("{:#}", without_plugin("[]").unwrap_err()).contains("not a JSON object"));
        assert!(
            format!("{:#}", without_plugin(r#"{"plugins": {}}"#).unwrap_err())
                .contains("`plugins` is not an array")
        );
        assert_eq!(without_plugin(r#"{"type": "ptp"}"#).unwrap(), None);
    }

    #[test]
    fn only_conflists_with_the_plugin_are_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let ours = dir.path().join("10-net.conflist");
        let other = dir.path().join("20-other.conflist");
        let single = dir.path().join("30-single.conf");
        fs::write(&ours, CONFLIST).unwrap();
        let untouched = CONFLIST.replace("podlink-cni", "other-cni");
        fs::write(&other, &untouched).unwrap();
        fs::write(&single, r#"{"type": "podlink-cni"}"#).unwrap();
        assert_eq!(remove_plugin(dir.path()).unwrap(), vec![ours.clone()]);
        assert!(!fs::read_to_string(&ours).unwrap().contains(PLUGIN_TYPE));
        assert_eq!(fs::read_to_string(&other).unwrap(), untouched);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 3);
        assert!(remove_plugin(dir.path()).unwrap().is_empty());
        assert!(
            remove_plugin(&dir.path().join("absent"))
                .unwrap()
                .is_empty()
        );
        fs::write(&other, "{").unwrap();
        let error = format!("{:#}", remove_plugin(dir.path()).unwrap_err());
        assert_eq!(
            error,
            format!(
                "{} is not a CNI network configuration list: not JSON: EOF while parsing an object at line 1 column 1",
                other.display()
            )
        );
    }
}
