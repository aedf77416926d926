//! Expedited RCU grace periods while TCX links are attached and detached.
//!
//! Attaching or detaching a TCX program swaps the device's `bpf_mprog` entry and
//! then waits for a full RCU grace period with `synchronize_rcu()`, holding RTNL
//! (`tcx_entry_sync()` in `include/net/tcx.h`, called from `kernel/bpf/tcx.c`).
//! A normal grace period lasts several scheduler ticks: 8–16 ms per link measured
//! on a 2-vCPU VM with `HZ=250`, two links per pod, so most of a pod's enrollment.
//! The kernel's own netdevice code waits with `synchronize_net()`, which is
//! expedited while RTNL is held; the TCX path is not.
//!
//! `/sys/kernel/rcu_expedited` (the runtime form of the `rcupdate.rcu_expedited`
//! boot parameter, `Documentation/admin-guide/kernel-parameters.txt`) makes every
//! `synchronize_rcu()` expedited: tens of microseconds, paid for with an IPI to
//! each busy CPU. podlink sets it to `1` only around its own attach and detach
//! calls and puts `0` back, so that the rest of the node keeps normal grace
//! periods:
//!
//! * The knob is `flock(2)`ed while podlink has it at `1`, so that two agents (an
//!   upgrade, or test beds on one machine) never restore each other's value.
//! * Before setting it, the agent writes a marker file (`rcu_expedited.set` in its
//!   state directory); an agent killed inside the window leaves the marker, and the
//!   next agent (or `podlink uninstall`) puts `0` back.
//! * A knob already at `1` (set by the node's administrator) is left alone, and
//!   with `rcupdate.rcu_normal=1` the kernel ignores it: attachments then just
//!   take the normal grace period.
//!
//! Turned off with `podlink agent --no-expedite-attach`.

use std::{
    fs::{self, File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::{Context, Result};
use nix::fcntl::{Flock, FlockArg};

/// The kernel's knob.
pub const KNOB: &str = "/sys/kernel/rcu_expedited";
/// Name of the marker file in the state directory: present while (or since) an
/// agent had the knob at `1`.
pub const MARKER_FILE: &str = "rcu_expedited.set";

/// Expedites the grace periods of this agent's attachments (see the module
/// documentation).
#[derive(Debug)]
pub struct ExpeditedAttach {
    knob: PathBuf,
    marker: PathBuf,
    /// Cleared after the first failure to use the knob (not writable in this
    /// container, no such file), so that the warning is given once.
    enabled: AtomicBool,
}

/// The window in which the knob is `1`: restores `0` and unlocks when dropped.
#[must_use = "the grace periods are expedited until this is dropped"]
pub struct Window {
    held: Option<(Flock<File>, PathBuf)>,
}

impl ExpeditedAttach {
    /// For the agent whose state directory is `state_dir`, with the kernel's knob.
    /// `enabled: false` never touches the knob.
    pub fn new(state_dir: &Path, enabled: bool) -> Self {
        Self::with_knob(Path::new(KNOB), state_dir, enabled)
    }

    fn with_knob(knob: &Path, state_dir: &Path, enabled: bool) -> Self {
        Self {
            knob: knob.to_path_buf(),
            marker: state_dir.join(MARKER_FILE),
            enabled: AtomicBool::new(enabled),
        }
    }

    /// Puts the knob back to `0` if an earlier agent was killed while it had it at
    /// `1` (its marker is still there). Returns whether it did.
    ///
    /// # Errors
    /// When the knob cannot be locked, read or written, or the marker not removed.
    pub fn recover(&self) -> Result<bool> {
        if !self.marker.exists() {
            return Ok(false);
        }
        let mut knob = lock(&self.knob)?;
        let restored = read_value(&mut knob)? == "1";
        if restored {
            write_value(&mut knob, "0")?;
        }
        fs::remove_file(&self.marker)
            .with_context(|| format!("removing {}", self.marker.display()))?;
        Ok(restored)
    }

    /// Sets the knob to `1` until the returned window is dropped, if it is `0`.
    /// Never fails: when the knob cannot be used, attachments take the normal
    /// grace period, and the reason is logged once.
    pub fn begin(&self) -> Window {
        if !self.enabled.load(Ordering::Relaxed) {
            return Window { held: None };
        }
        match self.try_begin() {
            Ok(window) => window,
            Err(e) => {
                self.enabled.store(false, Ordering::Relaxed);
                tracing::warn!(
                    "attachments take normal RCU grace periods (8-16 ms each): {} cannot be used: {e:#}",
                    self.knob.display()
                );
                Window { held: None }
            }
        }
    }

    fn try_begin(&self) -> Result<Window> {
        let mut knob = lock(&self.knob)?;
        if read_value(&mut knob)? != "0" {
            // The administrator's setting: already expedited, or theirs to keep.
            return Ok(Window { held: None });
        }
        if let Some(dir) = self.marker.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        fs::write(&self.marker, format!("{} was 0\n", self.knob.display()))
            .with_context(|| format!("writing {}", self.marker.display()))?;
        if let Err(e) = write_value(&mut knob, "1") {
            let _ = fs::remove_file(&self.marker);
            return Err(e);
        }
        Ok(Window {
            held: Some((knob, self.marker.clone())),
        })
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if let Some((mut knob, marker)) = self.held.take() {
            match write_value(&mut knob, "0") {
                // The marker stays when this failed, for the next agent.
                Ok(()) => {
                    let _ = fs::remove_file(&marker);
                }
                Err(e) => tracing::warn!("putting the RCU knob back: {e:#}"),
            }
        }
    }
}

fn lock(path: &Path) -> Result<Flock<File>> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .with_context(|| format!("locking {}", path.display()))
}

fn read_value(file: &mut File) -> Result<String> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0))?;
    file.read_to_string(&mut text).context("reading the knob")?;
    Ok(text.trim().to_string())
}

fn write_value(file: &mut File, value: &str) -> Result<()> {
    file.seek(SeekFrom::Start(0))?;
    // A regular file (the tests' stand-in) is truncated; sysfs ignores it.
    let _ = file.set_len(0);
    file.write_all(value.as_bytes())
        .with_context(|| format!("writing {value} to the knob"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bed(value: &str) -> (tempfile::TempDir, ExpeditedAttach) {
        let dir = tempfile::tempdir().unwrap();
        let knob = dir.path().join("rcu_expedited");
        fs::write(&knob, format!("{value}\n")).unwrap();
        let e = ExpeditedAttach::with_knob(&knob, &dir.path().join("state"), true);
        (dir, e)
    }

    fn knob(dir: &tempfile::TempDir) -> String {
        fs::read_to_string(dir.path().join("rcu_expedited"))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn a_window_sets_the_knob_and_puts_it_back() {
        let (dir, e) = bed("0");
        let window = e.begin();
        assert_eq!(knob(&dir), "1");
        assert!(e.marker.exists());
        drop(window);
        assert_eq!(knob(&dir), "0");
        assert!(!e.marker.exists());
    }

    #[test]
    fn an_administrators_value_is_left_alone() {
        let (dir, e) = bed("1");
        let window = e.begin();
        assert!(!e.marker.exists());
        drop(window);
        assert_eq!(knob(&dir), "1");
    }

    #[test]
    fn disabled_never_touches_the_knob() {
        let dir = tempfile::tempdir().unwrap();
        let knob_path = dir.path().join("rcu_expedited");
        fs::write(&knob_path, "0").unwrap();
        let e = ExpeditedAttach::with_knob(&knob_path, dir.path(), false);
        let _window = e.begin();
        assert_eq!(knob(&dir), "0");
        assert!(!e.marker.exists());
    }

    #[test]
    fn a_missing_knob_turns_it_off_and_attachments_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let e = ExpeditedAttach::with_knob(&dir.path().join("absent"), dir.path(), true);
        drop(e.begin());
        assert!(!e.enabled.load(Ordering::Relaxed));
        assert!(!e.marker.exists());
    }

    #[test]
    fn a_killed_agents_window_is_closed_by_the_next() {
        let (dir, e) = bed("0");
        let window = e.begin();
        // The agent is killed: no drop, the lock goes with the process.
        let (file, _) = window_parts(window);
        drop(file);
        assert_eq!(knob(&dir), "1");
        assert!(e.recover().unwrap());
        assert_eq!(knob(&dir), "0");
        assert!(!e.marker.exists());
        // Nothing left to do.
        assert!(!e.recover().unwrap());
    }

    /// Takes a window apart, so that its drop does nothing (an agent that dies).
    fn window_parts(mut w: Window) -> (Flock<File>, PathBuf) {
        w.held.take().unwrap()
    }
}
