//! `podlink uninstall`: removes from a node everything podlink's agent made there,
//! with the agent stopped, so that pods talk directly again.
//!
//! In order: every link pin (which detaches the TCX links), map pin and layout
//! directory under the pin directory; the policy routing rule and the route of
//! podlink's table; `/sys/kernel/rcu_expedited` if an agent was killed while it
//! had it at 1; the sysctls recorded in the state directory's journal (restored
//! where they still have podlink's value); the `podlink-cni` entries of
//! the CNI configuration lists; then, once no step failed, the `podlink-cni`
//! binary (given its directory), the enrollment snapshot beside the agent's CNI
//! socket and a socket file a killed agent left; last the state directory, if
//! empty. Every other step runs even when an earlier one fails; running it again
//! finishes what is left and otherwise does nothing.
//!
//! It refuses to run while an agent holds the pin directory's lock: that agent
//! would attach pods again. Stop the agent (the DaemonSet) first.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use podlink_common::{REDIRECT_MARK, REDIRECT_MARK_MASK, ROUTE_TABLE, RULE_PRIORITY};

use crate::{
    cni,
    dataplane::{
        journal::{Restored, SysctlJournal},
        net, pins,
        rcu::{self, ExpeditedAttach},
    },
};

/// Where podlink's traces on a node are.
#[derive(Clone, Debug)]
pub struct UninstallConfig {
    /// The agent's pin directory (`--pin-dir`).
    pub pin_dir: PathBuf,
    /// The agent's state directory (`--state-dir`), holding the sysctl journal.
    pub state_dir: PathBuf,
    /// The CNI configuration directory whose `*.conflist` files may name
    /// `podlink-cni`.
    pub cni_conf_dir: PathBuf,
    /// The CNI plugin directory podlink-cni was installed into; `None`: the
    /// binary is left in place.
    pub cni_bin_dir: Option<PathBuf>,
    /// The agent's podlink-cni socket (`--cni-socket`): a socket file a killed
    /// agent left there, and the enrollment snapshot beside it, are removed.
    pub cni_socket: PathBuf,
}

/// Removes podlink from this node (run in the node's network namespace). Returns
/// what was done, a line each.
///
/// # Errors
/// When an agent runs on the pin directory (nothing is done then); otherwise the
/// steps that failed, each named, after all steps ran.
pub fn uninstall(cfg: &UninstallConfig) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let mut failures = Vec::new();
    let _lock = if cfg.pin_dir.is_dir() {
        Some(pins::lock(&cfg.pin_dir)?)
    } else {
        None
    };
    match pins::remove_all(&cfg.pin_dir) {
        Ok(removed) => done.extend(
            removed
                .into_iter()
                .map(|p| format!("removed pin {}", p.display())),
        ),
        Err(e) => failures.push(format!("removing pins: {e:#}")),
    }
    match net::remove_policy_routing(
        REDIRECT_MARK,
        REDIRECT_MARK_MASK,
        ROUTE_TABLE,
        RULE_PRIORITY,
    ) {
        Ok(removed) => done.extend(removed.into_iter().map(|r| format!("removed {r}"))),
        Err(e) => failures.push(format!("removing policy routing: {e:#}")),
    }
    // An agent killed while it had the RCU knob at 1 left a marker.
    match ExpeditedAttach::new(&cfg.state_dir, true).recover() {
        Ok(true) => done.push(format!("restored {}=0", rcu::KNOB)),
        Ok(false) => {}
        Err(e) => failures.push(format!("restoring {}: {e:#}", rcu::KNOB)),
    }
    let journal = SysctlJournal::new(&cfg.state_dir);
    match journal.restore() {
        Ok(restored) => {
            for r in restored {
                done.push(match r {
                    Restored::Restored(c) => {
                        format!(
                            "restored {}={} (podlink had set {})",
                            c.name, c.original, c.set
                        )
                    }
                    Restored::ChangedSince { change, current } => format!(
                        "left {}={current}: changed since podlink set {}",
                        change.name, change.set
                    ),
                    Restored::InterfaceGone(c) => {
                        format!("left {}: its interface is gone", c.name)
                    }
                });
            }
        }
        Err(e) => failures.push(format!("restoring sysctls: {e:#}")),
    }
    match cni::remove_plugin(&cfg.cni_conf_dir) {
        Ok(changed) => done.extend(
            changed
                .into_iter()
                .map(|p| format!("removed {} from {}", cni::PLUGIN_TYPE, p.display())),
        ),
        Err(e) => failures.push(format!("editing the CNI configuration: {e:#}")),
    }
    // The binary, and the snapshot the plugin reads while the agent is away, only
    // after the entries naming the plugin are gone.
    if failures.is_empty() {
        if let Some(bin_dir) = &cfg.cni_bin_dir {
            match cni::install::remove_binary(bin_dir) {
                Ok(Some(path)) => done.push(format!("removed {}", path.display())),
                Ok(None) => {}
                Err(e) => failures.push(format!("removing the CNI plugin: {e:#}")),
            }
        }
        match remove_cni_socket(&cfg.cni_socket) {
            Ok(removed) => done.extend(removed.iter().map(|p| format!("removed {}", p.display()))),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    // The state directory goes too once empty (it may be shared: not forced).
    if fs::remove_dir(&cfg.state_dir).is_ok() {
        done.push(format!("removed {}", cfg.state_dir.display()));
    }
    if !failures.is_empty() {
        bail!(
            "uninstall incomplete (run it again once fixed):\n{}\ndone meanwhile:\n{}",
            failures.join("\n"),
            done.join("\n")
        );
    }
    Ok(done)
}

/// Removes the enrollment snapshot beside `socket` and the socket file itself if
/// one is there (left by an agent that was killed; a running agent holds the pin
/// directory's lock, so none serves it now). Returns what was removed.
///
/// # Errors
/// A file that exists and cannot be removed, or a `socket` path that is not a
/// socket.
fn remove_cni_socket(socket: &Path) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::FileTypeExt;
    let mut removed = Vec::new();
    let snapshot = cni::snapshot::Snapshot::path_for(socket);
    for (path, is_socket) in [(snapshot, false), (socket.to_path_buf(), true)] {
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => bail!("reading {}: {e}", path.display()),
        };
        if is_socket && !meta.file_type().is_socket() {
            bail!("{} is not a socket; left in place", path.display());
        }
        fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        removed.push(path);
    }
    Ok(removed)
}
