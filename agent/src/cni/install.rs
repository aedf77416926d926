//! Installing podlink-cni on a node (`podlink agent --install-cni`): the binary
//! into the runtime's CNI plugin directory, and an entry, last in `plugins`, in
//! the node's network configuration list: the first `*.conflist` of the CNI
//! configuration directory in lexical order, the one runtimes use (CNI spec 1.0,
//! "Section 1: Network configuration format"; libcni's `ConfFiles` sorts them).
//!
//! Both steps are idempotent and atomic (a temporary file renamed into place), and
//! the agent repeats them periodically ([`CHECK_INTERVAL`]): the primary CNI
//! plugin may rewrite its conflist and drop podlink's entry.

use crate::error::IoError;
use std::{
    fs,
    io::{self, Read as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Value, json};

use super::{ConflistError, DEFAULT_SOCKET, Error, Install, PLUGIN_TYPE, Result, write_atomically};

/// How often the agent re-checks its installation.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// `text` (a conflist) with podlink-cni's entry last in `plugins`, naming the
/// agent's socket `socket` (`"socket"`, left out when it is
/// [`DEFAULT_SOCKET`]); `None` when it already has exactly that. Earlier
/// podlink-cni entries are removed; every other key and plugin is kept, in its
/// order.
///
/// # Errors
/// When `text` is not a JSON object with a `plugins` array, or its
/// `cniVersion` is one podlink-cni does not speak (every ADD and DEL on the
/// node would then fail).
pub fn with_plugin(text: &str, socket: &Path) -> Result<Option<String>, ConflistError> {
    let mut conf: Value =
        serde_json::from_str(text).map_err(|error| ConflistError::NotJson { error })?;
    let Some(object) = conf.as_object_mut() else {
        return Err(ConflistError::NotAnObject);
    };
    let version = object
        .get("cniVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !super::plugin::SUPPORTED_VERSIONS.contains(&version) {
        return Err(ConflistError::UnsupportedVersion {
            version: version.to_string(),
        });
    }
    let Some(plugins) = object.get_mut("plugins").and_then(Value::as_array_mut) else {
        return Err(ConflistError::NoPlugins);
    };
    let mut entry = json!({ "type": PLUGIN_TYPE });
    if socket != Path::new(DEFAULT_SOCKET) {
        entry["socket"] = json!(socket);
    }
    let ours = |p: &Value| p.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE);
    if plugins.last() == Some(&entry) && plugins.iter().filter(|p| ours(p)).count() == 1 {
        return Ok(None);
    }
    plugins.retain(|p| !ours(p));
    plugins.push(entry);
    let mut out =
        serde_json::to_string_pretty(&conf).map_err(|error| ConflistError::Encode { error })?;
    if text.ends_with('\n') {
        out.push('\n');
    }
    Ok(Some(out))
}

/// The configuration runtimes use: the first file of `conf_dir` in lexical
/// order among `*.conf`, `*.conflist` and `*.json` together (libcni's
/// `ConfFiles`, as containerd and CRI-O call it). podlink-cni can chain only
/// into a configuration list.
///
/// # Errors
/// When the directory cannot be read ([`Error::Io`]), holds no configuration
/// ([`Error::NoConfiguration`]: the primary CNI plugin has not written it yet),
/// or its first one is not a `*.conflist` ([`Error::SinglePlugin`]).
pub fn first_conflist(conf_dir: &Path) -> Result<PathBuf> {
    let entries = fs::read_dir(conf_dir).map_err(IoError::at("reading", conf_dir))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x == "conflist" || x == "conf" || x == "json")
                && p.is_file()
        })
        .collect();
    files.sort();
    let first = files
        .into_iter()
        .next()
        .ok_or_else(|| Error::NoConfiguration {
            dir: conf_dir.to_path_buf(),
        })?;
    if first.extension().is_some_and(|x| x != "conflist") {
        return Err(Error::SinglePlugin { path: first });
    }
    Ok(first)
}

/// Makes sure the first conflist of `conf_dir` ends with podlink-cni's entry.
/// Returns the file when it was changed.
///
/// # Errors
/// No conflist ([`first_conflist`]'s errors), or one that cannot be read or
/// written ([`Error::Io`]) or parsed ([`Error::NotAConflist`]), named.
pub fn ensure_conflist(conf_dir: &Path, socket: &Path) -> Result<Option<PathBuf>> {
    let path = first_conflist(conf_dir)?;
    let text = fs::read_to_string(&path).map_err(IoError::at("reading", &path))?;
    let new = with_plugin(&text, socket).map_err(|error| Error::NotAConflist {
        path: path.clone(),
        error,
    })?;
    match new {
        Some(new) => {
            write_atomically(&path, &new)?;
            Ok(Some(path))
        }
        None => Ok(None),
    }
}

/// The plugin binary to install: `install.plugin`, else `podlink-cni` beside
/// the running executable.
///
/// # Errors
/// When the running executable cannot be found ([`Error::CurrentExe`]).
pub fn plugin_source(install: &Install) -> Result<PathBuf> {
    match &install.plugin {
        Some(p) => Ok(p.clone()),
        None => Ok(std::env::current_exe()
            .map_err(|error| Error::CurrentExe { error })?
            .with_file_name(PLUGIN_TYPE)),
    }
}

fn same_contents(a: &Path, b: &Path) -> io::Result<bool> {
    let (ma, mb) = (fs::metadata(a)?, fs::metadata(b)?);
    if ma.len() != mb.len() {
        return Ok(false);
    }
    let (mut fa, mut fb) = (fs::File::open(a)?, fs::File::open(b)?);
    let (mut ba, mut bb) = (vec![0; 64 * 1024], vec![0; 64 * 1024]);
    loop {
        let n = fa.read(&mut ba)?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
    }
}

/// Copies the plugin binary into `bin_dir` as `podlink-cni` (mode 0755), by
/// rename, unless an identical file is there. Returns whether it copied.
///
/// # Errors
/// A missing source ([`Error::MissingBinary`]), one that cannot be copied
/// ([`Error::Copy`]), a directory that cannot be made or written ([`Error::Io`],
/// [`Error::MakeExecutable`]), named.
pub fn ensure_binary(source: &Path, bin_dir: &Path) -> Result<bool> {
    let target = bin_dir.join(PLUGIN_TYPE);
    if !source.is_file() {
        return Err(Error::MissingBinary {
            path: source.to_path_buf(),
        });
    }
    if target.is_file() && same_contents(source, &target).unwrap_or(false) {
        return Ok(false);
    }
    fs::create_dir_all(bin_dir).map_err(IoError::at("creating", bin_dir))?;
    // A name no runtime runs, in the same directory (same file system).
    let tmp = bin_dir.join(format!(".{PLUGIN_TYPE}.podlink-partial"));
    fs::copy(source, &tmp).map_err(|error| Error::Copy {
        from: source.to_path_buf(),
        to: tmp.clone(),
        error,
    })?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)).map_err(|error| {
        Error::MakeExecutable {
            path: tmp.clone(),
            error,
        }
    })?;
    fs::File::open(&tmp).and_then(|f| f.sync_all()).ok();
    fs::rename(&tmp, &target).map_err(IoError::at("replacing", &target))?;
    Ok(true)
}

/// Installs podlink-cni: the binary, then the conflist entry (so a runtime never
/// finds the entry without the binary). Returns what was done, a line each.
///
/// # Errors
/// The first step that failed, named ([`ensure_binary`]'s and
/// [`ensure_conflist`]'s errors).
pub fn install(install: &Install, socket: &Path) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let source = plugin_source(install)?;
    if ensure_binary(&source, &install.bin_dir)? {
        done.push(format!(
            "installed {} as {}",
            source.display(),
            install.bin_dir.join(PLUGIN_TYPE).display()
        ));
    }
    if let Some(path) = ensure_conflist(&install.conf_dir, socket)? {
        done.push(format!("added {PLUGIN_TYPE} to {}", path.display()));
    }
    Ok(done)
}

/// Removes the installed binary `bin_dir/podlink-cni` (for `podlink uninstall`);
/// `Ok(None)` when there is none.
///
/// # Errors
/// When it exists and cannot be removed ([`Error::Io`]).
pub fn remove_binary(bin_dir: &Path) -> Result<Option<PathBuf>> {
    let target = bin_dir.join(PLUGIN_TYPE);
    match fs::remove_file(&target) {
        Ok(()) => Ok(Some(target)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(IoError::at("removing", target)(e).into()),
    }
}

/// Installs podlink-cni (see [`install`]) and keeps it installed: re-checked
/// every [`CHECK_INTERVAL`] in a task (a new binary beside the agent is copied
/// again by the next agent start; the task restores a missing or truncated one
/// and the conflist entry). Call within a tokio runtime.
///
/// # Errors
/// When the binary cannot be installed. A missing or broken conflist is logged
/// and retried: the primary CNI plugin may write it later.
pub fn start(install: Install, socket: PathBuf) -> Result<tokio::task::JoinHandle<()>> {
    let source = plugin_source(&install)?;
    if ensure_binary(&source, &install.bin_dir)? {
        tracing::info!(
            from = %source.display(),
            to = %install.bin_dir.join(PLUGIN_TYPE).display(),
            "installed the CNI plugin"
        );
    }
    let mut last_error = None;
    check_conflist(&install.conf_dir, &socket, &mut last_error);
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(CHECK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let target = install.bin_dir.join(PLUGIN_TYPE);
            let intact = match (fs::metadata(&source), fs::metadata(&target)) {
                (Ok(a), Ok(b)) => a.len() == b.len(),
                _ => false,
            };
            if !intact {
                match ensure_binary(&source, &install.bin_dir) {
                    Ok(_) => tracing::info!(to = %target.display(), "reinstalled the CNI plugin"),
                    Err(e) => note(&mut last_error, e.to_string()),
                }
            }
            check_conflist(&install.conf_dir, &socket, &mut last_error);
        }
    }))
}

/// Logs an installation problem once while it lasts.
fn note(last: &mut Option<String>, message: String) {
    if last.as_deref() != Some(message.as_str()) {
        tracing::warn!(
            "CNI plugin installation: {message}; retrying every {} s",
            CHECK_INTERVAL.as_secs()
        );
        *last = Some(message);
    }
}

fn check_conflist(conf_dir: &Path, socket: &Path, last_error: &mut Option<String>) {
    match ensure_conflist(conf_dir, socket) {
        Ok(Some(path)) => {
            tracing::info!(conflist = %path.display(), "added podlink-cni to the CNI configuration");
            *last_error = None;
        }
        Ok(None) => *last_error = None,
        Err(e) => note(last_error, e.to_string()),
    }
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
      "type": "portmap",
      "capabilities": {
        "portMappings": true
      }
    }
  ]
}
"#;

    #[test]
    fn the_entry_goes_last_and_everything_else_stays() {
        let socket = Path::new("/run/x/cni.sock");
        let out = with_plugin(CONFLIST, socket).unwrap().unwrap();
        let expected = CONFLIST.replace(
            "        \"portMappings\": true\n      }\n    }\n  ]",
            "        \"portMappings\": true\n      }\n    },\n    {\n      \"type\": \"podlink-cni\",\n      \"socket\": \"/run/x/cni.sock\"\n    }\n  ]",
        );
        assert_eq!(out, expected);
        // Idempotent.
        assert_eq!(with_plugin(&out, socket).unwrap(), None);
        // Removing it gives the original back.
        assert_eq!(
            super::super::without_plugin(&out).unwrap().unwrap(),
            CONFLIST
        );
        // The default socket is not written; another socket replaces the entry.
        let default = with_plugin(CONFLIST, Path::new(DEFAULT_SOCKET))
            .unwrap()
            .unwrap();
        assert!(!default.contains("socket"), "{default}");
        let moved = with_plugin(&out, Path::new("/other.sock"))
            .unwrap()
            .unwrap();
        assert_eq!(moved.matches("podlink-cni").count(), 1);
        assert!(moved.contains("/other.sock"));
        // An entry not last is moved last.
        let v: Value = serde_json::from_str(&out).unwrap();
        let mut plugins = v["plugins"].as_array().unwrap().clone();
        plugins.rotate_right(1);
        let mut first = v.clone();
        first["plugins"] = Value::Array(plugins);
        let fixed = with_plugin(&first.to_string(), socket).unwrap().unwrap();
        let fixed: Value = serde_json::from_str(&fixed).unwrap();
        assert_eq!(fixed, v);
    }

    #[test]
    fn bad_conflists_are_refused() {
        let s = Path::new(DEFAULT_SOCKET);
        assert!(format!("{:#}", with_plugin("{", s).unwrap_err()).contains("not JSON"));
        assert!(format!("{:#}", with_plugin("[]", s).unwrap_err()).contains("not a JSON object"));
        assert!(
            format!(
                "{:#}",
                with_plugin(r#"{"cniVersion":"1.0.0","type":"ptp"}"#, s).unwrap_err()
            )
            .contains("no `plugins` array")
        );
        // A version the plugin would refuse on every ADD and DEL.
        assert!(
            format!(
                "{:#}",
                with_plugin(r#"{"cniVersion":"2.0.0","plugins":[]}"#, s).unwrap_err()
            )
            .contains("not one podlink-cni supports")
        );
    }

    #[test]
    fn a_single_plugin_configuration_first_is_refused_and_links_are_followed() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("05-a.conf"), r#"{"type":"bridge"}"#).unwrap();
        fs::write(dir.path().join("10-b.conflist"), CONFLIST).unwrap();
        let error = format!("{:#}", first_conflist(dir.path()).unwrap_err());
        assert!(
            error.contains("05-a.conf") && error.contains("single-plugin"),
            "{error}"
        );
        // A conflist that is a link: its target gets the entry, the link stays.
        fs::remove_file(dir.path().join("05-a.conf")).unwrap();
        let target = dir.path().join("real.json.txt");
        fs::write(&target, CONFLIST).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("01-net.conflist")).unwrap();
        let changed = ensure_conflist(dir.path(), Path::new(DEFAULT_SOCKET)).unwrap();
        assert_eq!(changed, Some(dir.path().join("01-net.conflist")));
        assert!(
            fs::symlink_metadata(dir.path().join("01-net.conflist"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert!(fs::read_to_string(&target).unwrap().contains(PLUGIN_TYPE));
        assert_eq!(
            fs::read_to_string(dir.path().join("10-b.conflist")).unwrap(),
            CONFLIST
        );
    }

    #[test]
    fn installs_into_the_first_conflist_and_copies_the_binary() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("net.d");
        let bin = dir.path().join("bin");
        fs::create_dir_all(&conf).unwrap();
        let socket = dir.path().join("cni.sock");
        let plugin = dir.path().join("podlink-cni-build");
        fs::write(&plugin, b"#!/bin/true\n").unwrap();
        let install_cfg = Install {
            plugin: Some(plugin.clone()),
            bin_dir: bin.clone(),
            conf_dir: conf.clone(),
        };
        // No conflist: a clear error (after the binary is in place).
        let error = format!("{:#}", install(&install_cfg, &socket).unwrap_err());
        assert!(error.contains("no CNI configuration"), "{error}");
        assert!(bin.join(PLUGIN_TYPE).is_file());
        let mode = fs::metadata(bin.join(PLUGIN_TYPE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);

        fs::write(conf.join("20-b.conflist"), CONFLIST).unwrap();
        fs::write(conf.join("10-a.conflist"), CONFLIST).unwrap();
        fs::write(conf.join("30-c.conf"), r#"{"type":"bridge"}"#).unwrap();
        let done = install(&install_cfg, &socket).unwrap();
        assert_eq!(done.len(), 1, "{done:?}");
        assert!(done[0].contains("10-a.conflist"), "{done:?}");
        assert!(
            fs::read_to_string(conf.join("10-a.conflist"))
                .unwrap()
                .contains(PLUGIN_TYPE)
        );
        assert_eq!(
            fs::read_to_string(conf.join("20-b.conflist")).unwrap(),
            CONFLIST
        );
        assert!(install(&install_cfg, &socket).unwrap().is_empty());
        // Only the conflists and the binary are there: no temporary files left.
        assert_eq!(fs::read_dir(&conf).unwrap().count(), 3);
        assert_eq!(fs::read_dir(&bin).unwrap().count(), 1);
        // A new build is copied again.
        fs::write(&plugin, b"#!/bin/false\n").unwrap();
        assert_eq!(install(&install_cfg, &socket).unwrap().len(), 1);
        assert_eq!(fs::read(bin.join(PLUGIN_TYPE)).unwrap(), b"#!/bin/false\n");
        // A primary plugin rewriting its file drops the entry; it comes back.
        fs::write(conf.join("10-a.conflist"), CONFLIST).unwrap();
        assert_eq!(install(&install_cfg, &socket).unwrap().len(), 1);
        // A broken conflist is named.
        fs::write(conf.join("10-a.conflist"), "{").unwrap();
        let error = format!("{:#}", install(&install_cfg, &socket).unwrap_err());
        assert!(error.contains("10-a.conflist"), "{error}");
        assert_eq!(remove_binary(&bin).unwrap(), Some(bin.join(PLUGIN_TYPE)));
        assert_eq!(remove_binary(&bin).unwrap(), None);
    }
}
