//! `podlink uninstall`: removes from a node everything podlink's agent made there,
//! with the agent stopped, so that pods talk directly again.
//!
//! In order: every link pin (which detaches the TCX links), map pin and layout
//! directory under the pin directory; podlink's `cls_bpf` filters on every
//! interface, then the `clsact` qdiscs podlink added (as recorded in the state
//! directory, [`crate::dataplane::clsact`]) where no other filter is left on them —
//! a `clsact` qdisc that was there before podlink, or that holds someone else's
//! filters, stays; the policy routing rules and the routes of
//! podlink's table (IPv4's and IPv6's); `/sys/kernel/rcu_expedited` if an agent was killed while it
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

use anyhow::{Result, bail};
use podlink_common::{REDIRECT_MARK, REDIRECT_MARK_MASK, ROUTE_TABLE, RULE_PRIORITY};

use crate::{
    cni,
    dataplane::{
        Program,
        clsact::ClsactRecord,
        journal::{Restored, SysctlJournal},
        net,
        netlink::Netlink,
        pins,
        rcu::{self, ExpeditedAttach},
        tc::Tc,
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
    let (removed, failed) = remove_filters(&ClsactRecord::new(&cfg.state_dir));
    done.extend(removed);
    failures.extend(failed);
    match Netlink::blocking(async |netlink| {
        net::remove_policy_routing(
            netlink,
            REDIRECT_MARK,
            REDIRECT_MARK_MASK,
            ROUTE_TABLE,
            RULE_PRIORITY,
        )
        .await
    }) {
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
        let (removed, failed) = remove_cni_socket(&cfg.cni_socket);
        done.extend(removed.iter().map(|p| format!("removed {}", p.display())));
        failures.extend(failed);
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

/// Deletes podlink's `cls_bpf` filters on every interface of the network
/// namespace, then, of the `clsact` qdiscs `record` says podlink added, those on
/// which no filter is left (and the record). Returns what was done and, each
/// named, what failed.
fn remove_filters(record: &ClsactRecord) -> (Vec<String>, Vec<String>) {
    let (mut done, mut failures) = (Vec::new(), Vec::new());
    let mut tc = match Tc::open() {
        Ok(tc) => tc,
        Err(e) => {
            failures.push(format!("opening a route netlink socket: {e}"));
            return (done, failures);
        }
    };
    let name = |ifindex: u32| {
        nix::net::if_::if_indextoname(ifindex)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("interface {ifindex}"))
    };
    match tc.podlink_filters() {
        Ok(filters) => {
            for f in filters {
                let direction = match f.program {
                    Program::FromPod => "ingress",
                    Program::ToPod => "egress",
                };
                match tc.detach(f.ifindex, f.program) {
                    Ok(true) => done.push(format!(
                        "removed the cls_bpf filter {} at {direction} of {}",
                        f.program,
                        name(f.ifindex)
                    )),
                    Ok(false) => {}
                    Err(e) => failures.push(format!(
                        "removing the cls_bpf filter {} at {direction} of {}: {e}",
                        f.program,
                        name(f.ifindex)
                    )),
                }
            }
        }
        Err(e) => failures.push(format!("listing podlink's cls_bpf filters: {e}")),
    }
    let entries = match record.entries() {
        Ok(entries) => entries,
        Err(e) => {
            failures.push(format!("reading the record of clsact qdiscs: {e:#}"));
            return (done, failures);
        }
    };
    for added in entries {
        if added.exists() {
            let mut left = 0;
            let mut unreadable = None;
            for program in Program::ALL {
                match tc.filters(added.ifindex, program) {
                    Ok(found) => left += found.len(),
                    Err(e) => unreadable = Some(e),
                }
            }
            if let Some(e) = unreadable {
                failures.push(format!(
                    "listing the filters of {} before deleting its clsact qdisc: {e}",
                    added.name
                ));
                continue;
            }
            if left > 0 {
                done.push(format!(
                    "left the clsact qdisc of {}: other filters are on it",
                    added.name
                ));
            } else {
                match tc.remove_clsact(added.ifindex) {
                    Ok(true) => done.push(format!(
                        "removed the clsact qdisc of {} (podlink added it)",
                        added.name
                    )),
                    Ok(false) => {}
                    Err(e) => {
                        failures.push(format!("removing the clsact qdisc of {}: {e}", added.name));
                        continue;
                    }
                }
            }
        }
        if let Err(e) = record.remove(added.ifindex) {
            failures.push(format!("{e:#}"));
        }
    }
    if let Err(e) = record.remove_dir() {
        failures.push(format!("{e:#}"));
    }
    (done, failures)
}

/// Removes what podlink's CNI socket leaves on a node: the socket file if no one
/// accepts on it (an agent that was killed left it), then the enrollment
/// snapshot beside it (only if it is one) and its partial copy from an
/// interrupted write. A socket still served keeps all three: an agent (with
/// another pin directory) uses them. Returns what was removed and, each named,
/// what could not be.
fn remove_cni_socket(socket: &Path) -> (Vec<PathBuf>, Vec<String>) {
    use std::os::unix::fs::FileTypeExt;
    let (mut removed, mut failures) = (Vec::new(), Vec::new());
    let mut remove = |path: &Path, failures: &mut Vec<String>| match fs::remove_file(path) {
        Ok(()) => removed.push(path.to_path_buf()),
        Err(e) => failures.push(format!("removing {}: {e}", path.display())),
    };
    match fs::symlink_metadata(socket) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => failures.push(format!("reading {}: {e}", socket.display())),
        Ok(meta) if !meta.file_type().is_socket() => failures.push(format!(
            "{} is not a socket; left in place",
            socket.display()
        )),
        Ok(_) => match is_served(socket) {
            Ok(false) => remove(socket, &mut failures),
            Ok(true) => {
                failures.push(format!(
                    "{} is served (an agent runs with another pin directory?); it and the enrollment snapshot beside it are left in place",
                    socket.display()
                ));
                return (removed, failures);
            }
            Err(e) => failures.push(format!("connecting to {}: {e}", socket.display())),
        },
    }
    let snapshot = cni::snapshot::Snapshot::path_for(socket);
    let partial = snapshot.with_file_name(format!(".{}.podlink-partial", cni::snapshot::FILE_NAME));
    for path in [&snapshot, &partial] {
        match fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => failures.push(format!("reading {}: {e}", path.display())),
            Ok(_) if *path == partial || is_snapshot(path) => remove(path, &mut failures),
            Ok(_) => failures.push(format!(
                "{} is not podlink's enrollment snapshot; left in place",
                path.display()
            )),
        }
    }
    (removed, failures)
}

/// Whether someone listens on the Unix socket `path`: a connection is accepted
/// or queued, or the queue is full (`EAGAIN` from a non-blocking connect, which
/// never waits). `ECONNREFUSED`: no one.
///
/// # Errors
/// Any other error of `connect(2)`.
fn is_served(path: &Path) -> std::io::Result<bool> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let probe = Socket::new(Domain::UNIX, Type::STREAM.nonblocking(), None)?;
    match probe.connect(&SockAddr::unix(path)?) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether `path` holds an enrollment snapshot (a JSON object with its fields),
/// of any format version.
fn is_snapshot(path: &Path) -> bool {
    let Ok(text) = fs::read(path) else {
        return false;
    };
    serde_json::from_slice::<serde_json::Value>(&text).is_ok_and(|v| {
        ["version", "node", "ambientNamespaces"]
            .iter()
            .all(|k| v.get(k).is_some())
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn a_left_socket_and_the_snapshot_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("cni.sock");
        // Nothing there: nothing to do.
        assert_eq!(remove_cni_socket(&socket), (vec![], vec![]));
        drop(UnixListener::bind(&socket).unwrap());
        let snapshot = cni::snapshot::Snapshot {
            version: cni::snapshot::SNAPSHOT_VERSION,
            node: "n1".into(),
            ..Default::default()
        };
        snapshot
            .write(&cni::snapshot::Snapshot::path_for(&socket))
            .unwrap();
        let partial = dir.path().join(".enrollment.json.podlink-partial");
        fs::write(&partial, "{").unwrap();
        let (removed, failures) = remove_cni_socket(&socket);
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(removed.len(), 3, "{removed:?}");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn what_is_not_podlinks_or_still_served_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("cni.sock");
        let served = UnixListener::bind(&socket).unwrap();
        let other = dir.path().join("enrollment.json");
        fs::write(&other, r#"{"someone": "else"}"#).unwrap();
        let partial = dir.path().join(".enrollment.json.podlink-partial");
        fs::write(&partial, "{").unwrap();
        // Served: the socket, and what is beside it, are the serving agent's.
        let (removed, failures) = remove_cni_socket(&socket);
        assert!(removed.is_empty(), "{removed:?}");
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("is served"), "{failures:?}");
        assert!(socket.exists() && other.exists() && partial.exists());
        drop(served);
        // Not served any more: the socket and the partial copy go; a file that
        // is not a snapshot stays.
        let (removed, failures) = remove_cni_socket(&socket);
        assert_eq!(removed, vec![socket.clone(), partial.clone()]);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("not podlink's enrollment snapshot"));
        assert!(other.exists());

        // A socket path that is a regular file is left as it is.
        fs::write(&socket, "data").unwrap();
        let (_, failures) = remove_cni_socket(&socket);
        assert!(
            failures.iter().any(|f| f.contains("is not a socket")),
            "{failures:?}"
        );
        assert_eq!(fs::read_to_string(&socket).unwrap(), "data");
    }
}
