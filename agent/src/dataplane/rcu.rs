//! Expedited RCU grace periods while TCX links are attached.
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
//! `synchronize_rcu()` expedited: about 0.05 ms per attachment here, paid for with
//! an IPI to each busy CPU. podlink sets it to `1` only around its own attach calls
//! and puts `0` back, so that the rest of the node keeps normal grace periods:
//!
//! * An agent writes `1` only where it read `0`, and always writes `0` after its
//!   attachments. Two agents that overlap (an upgrade, test beds on one machine)
//!   therefore end at `0` whatever the interleaving; at worst one's attachment
//!   takes a normal grace period. (No lock can order them: every network
//!   namespace's sysfs mount has its own inode for the knob.)
//! * A knob at `1` that this agent did not set (the node administrator's) is left
//!   alone. One set to `1` by the administrator inside an agent's window of about
//!   0.1 ms would be put back to `0`.
//! * Before setting it, the agent marks a file (`rcu_expedited.set` in its state
//!   directory) held, and marks it released once `0` is back: its first byte is
//!   `1` or `0`. An agent killed inside the window leaves it held, and the next
//!   agent on that state directory (at start) or `podlink uninstall` puts `0`
//!   back. An agent with another state directory cannot tell that `1` from the
//!   administrator's and leaves it. The file is made at the first window and kept
//!   open: making and removing it around every window cost a third of the agent's
//!   CPU while pods were enrolled one after the other on ext4, whose inode
//!   allocation looks past every inode freed in the last seconds. A marker of an
//!   earlier version (present only while held, with other text) counts as held.
//! * With `rcupdate.rcu_normal=1` the kernel ignores the knob: attachments then
//!   take the normal grace period.
//!
//! Detaching is not expedited: the last reference of a pinned link goes in a
//! kernel worker after the pin's inode is freed (itself after a grace period), not
//! within the agent's call.
//!
//! Opt-in, with `podlink agent --expedite-attach`: every RCU grace period on the
//! node is expedited inside the window, and a pod's enrollment takes 16 to 32 ms
//! without it, well within what pod start-up tolerates.

use crate::error::IoError;
use std::{
    fs::{self, File},
    io,
    os::unix::fs::{FileExt, MetadataExt},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
};

use super::error::{Error, Result};

/// The kernel's knob.
pub const KNOB: &str = "/sys/kernel/rcu_expedited";
/// Name of the marker file in the state directory: present while (or since) an
/// agent had the knob at `1`.
pub const MARKER_FILE: &str = "rcu_expedited.set";

/// The marker's first byte while an agent has the knob at `1`.
const HELD: u8 = b'1';
/// The marker's first byte once the agent put `0` back.
const RELEASED: u8 = b'0';

/// Whether the marker in `state_dir` says an agent has the knob at `1`: it exists
/// and its first byte is not `0` (an empty marker was made by a window that never
/// set the knob; an earlier version's, present only while held, starts otherwise).
///
/// # Errors
/// When the marker exists but cannot be read.
pub fn marker_held(state_dir: &Path) -> Result<bool> {
    held_at(&state_dir.join(MARKER_FILE))
}

fn held_at(marker: &Path) -> Result<bool> {
    match fs::read(marker) {
        Ok(text) => Ok(text.first().is_some_and(|b| *b != RELEASED)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(IoError::at("reading", marker)(e).into()),
    }
}

/// Expedites the grace periods of this agent's attachments (see the module
/// documentation).
#[derive(Debug)]
pub struct ExpeditedAttach {
    knob: PathBuf,
    marker: PathBuf,
    /// The marker, open from the first window on.
    marker_file: Mutex<Option<Arc<File>>>,
    /// Cleared after the first failure to use the knob (not writable in this
    /// container, no such file), so that the warning is given once.
    enabled: AtomicBool,
}

/// The window in which the knob is `1`: restores `0` when dropped.
#[must_use = "the grace periods are expedited until this is dropped"]
pub struct Window {
    /// The knob and the marker, when this window set the knob.
    held: Option<(PathBuf, Arc<File>)>,
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
            marker_file: Mutex::new(None),
            enabled: AtomicBool::new(enabled),
        }
    }

    /// Puts the knob back to `0` if an earlier agent was killed while it had it at
    /// `1` (its marker is still held). Returns whether it did.
    ///
    /// # Errors
    /// When the knob cannot be read or written, or the marker not removed.
    pub fn recover(&self) -> Result<bool> {
        if !self.marker.exists() {
            return Ok(false);
        }
        let restored = self.marker_held()? && read_value(&self.knob)? == "1";
        if restored {
            write_value(&self.knob, "0")?;
        }
        *self
            .marker_file
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        match fs::remove_file(&self.marker) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(IoError::at("removing", &self.marker)(e).into()),
        }
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
                    "attachments take normal RCU grace periods (8-16 ms each): {} cannot be used: {e}",
                    self.knob.display()
                );
                Window { held: None }
            }
        }
    }

    fn try_begin(&self) -> Result<Window> {
        match read_value(&self.knob)?.as_str() {
            "0" => {}
            // Ours: a window whose end failed to write 0 left its marker held.
            "1" if self.marker_held()? => {}
            // The administrator's setting: already expedited, or theirs to keep.
            _ => return Ok(Window { held: None }),
        }
        let marker = self.marker_file()?;
        mark(&marker, HELD).map_err(IoError::at("writing", &self.marker))?;
        if let Err(e) = write_value(&self.knob, "1") {
            let _ = mark(&marker, RELEASED);
            return Err(e);
        }
        Ok(Window {
            held: Some((self.knob.clone(), marker)),
        })
    }

    /// The marker, made (with its directory) and opened at the first call, and
    /// made again when the open one no longer has a name (removed by hand, or by
    /// the start of an agent on the same state directory): a window marked in a
    /// file nobody can find would leave a killed agent's `1` unrepaired.
    fn marker_file(&self) -> Result<Arc<File>> {
        let mut open = self
            .marker_file
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(file) = &*open
            && file.metadata().is_ok_and(|m| m.nlink() > 0)
        {
            return Ok(file.clone());
        }
        if let Some(dir) = self.marker.parent() {
            fs::create_dir_all(dir).map_err(IoError::at("creating", dir))?;
        }
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.marker)
            .map_err(IoError::at("opening", &self.marker))?;
        let file = Arc::new(file);
        *open = Some(file.clone());
        Ok(file)
    }

    /// Whether this agent's marker is held ([`marker_held`]).
    fn marker_held(&self) -> Result<bool> {
        held_at(&self.marker)
    }
}

/// Writes the marker's first byte (`HELD` or `RELEASED`).
fn mark(marker: &File, state: u8) -> io::Result<()> {
    marker.write_all_at(&[state], 0)
}

impl Drop for Window {
    fn drop(&mut self) {
        if let Some((knob, marker)) = self.held.take() {
            match write_value(&knob, "0") {
                // The marker stays held when this failed, for the next window or
                // agent.
                Ok(()) => {
                    if let Err(e) = mark(&marker, RELEASED) {
                        tracing::warn!("marking the RCU knob released: {e}");
                    }
                }
                Err(e) => tracing::warn!("putting the RCU knob back: {e}"),
            }
        }
    }
}

fn read_value(knob: &Path) -> Result<String> {
    Ok(fs::read_to_string(knob)
        .map_err(IoError::at("reading", knob))?
        .trim()
        .to_string())
}

fn write_value(knob: &Path, value: &str) -> Result<()> {
    fs::write(knob, value).map_err(|error| Error::WriteValue {
        path: knob.to_path_buf(),
        value: value.to_string(),
        error,
    })
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

    /// Puts a marker with `text` in place, as an earlier agent left it.
    fn plant_marker(e: &ExpeditedAttach, text: &str) {
        fs::create_dir_all(e.marker.parent().unwrap()).unwrap();
        fs::write(&e.marker, text).unwrap();
    }

    /// The marker an earlier version made, only while it held the knob at 1.
    fn earlier_versions_marker(dir: &tempfile::TempDir) -> String {
        format!("{} was 0\n", dir.path().display())
    }

    /// The next window takes a held knob at 1 for its own, and puts 0 back.
    fn assert_next_window_takes_it_up(dir: &tempfile::TempDir, e: &ExpeditedAttach) {
        let window = e.begin();
        assert!(window.held.is_some());
        drop(window);
        assert_eq!(knob(dir), "0");
        assert!(!e.marker_held().unwrap());
    }

    #[test]
    fn a_window_sets_the_knob_and_puts_it_back() {
        let (dir, e) = bed("0");
        let window = e.begin();
        assert_eq!(knob(&dir), "1");
        assert!(e.marker_held().unwrap());
        drop(window);
        assert_eq!(knob(&dir), "0");
        assert!(!e.marker_held().unwrap());
        // Later windows mark the same file: none is made or removed.
        let inode = || fs::metadata(&e.marker).unwrap().ino();
        let first = inode();
        let window = e.begin();
        assert!(e.marker_held().unwrap());
        assert_eq!(inode(), first);
        drop(window);
        assert_eq!(fs::read(&e.marker).unwrap(), [RELEASED]);
        assert_eq!(inode(), first);
    }

    #[test]
    fn an_administrators_value_is_left_alone() {
        let (dir, e) = bed("1");
        let window = e.begin();
        assert!(!e.marker_held().unwrap());
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
        // The agent is killed: the window's end never runs.
        std::mem::forget(window);
        assert_eq!(knob(&dir), "1");
        assert!(e.recover().unwrap());
        assert_eq!(knob(&dir), "0");
        assert!(!e.marker.exists());
        // Nothing left to do.
        assert!(!e.recover().unwrap());
    }

    #[test]
    fn a_window_whose_end_failed_is_taken_up_by_the_next() {
        let (dir, e) = bed("0");
        std::mem::forget(e.begin());
        // Still 1 with this agent's marker: its own, not the administrator's.
        assert_next_window_takes_it_up(&dir, &e);
    }

    #[test]
    fn overlapping_agents_end_at_zero() {
        let (dir, a) = bed("0");
        let b = ExpeditedAttach::with_knob(
            &dir.path().join("rcu_expedited"),
            &dir.path().join("other-state"),
            true,
        );
        // a opens, b opens while the knob is a's 1 (left to a), a closes, then b
        // opens and closes on its own.
        let wa = a.begin();
        let wb = b.begin();
        assert!(wb.held.is_none());
        drop(wa);
        drop(wb);
        assert_eq!(knob(&dir), "0");
        drop(b.begin());
        assert_eq!(knob(&dir), "0");
        assert!(!a.marker_held().unwrap() && !b.marker_held().unwrap());
    }

    #[test]
    fn a_removed_marker_is_made_again_for_the_next_window() {
        let (dir, e) = bed("0");
        drop(e.begin());
        fs::remove_file(&e.marker).unwrap();
        // Killed inside the next window: its marker must be found.
        std::mem::forget(e.begin());
        assert!(e.marker_held().unwrap());
        assert!(e.recover().unwrap());
        assert_eq!(knob(&dir), "0");
    }

    #[test]
    fn an_empty_marker_is_not_held() {
        // Made by a window killed before it marked it: the knob was not set.
        let (dir, e) = bed("1");
        plant_marker(&e, "");
        assert!(!e.recover().unwrap());
        assert_eq!(knob(&dir), "1");
        assert!(!e.marker.exists());
    }

    #[test]
    fn a_window_takes_up_an_earlier_versions_held_marker() {
        let (dir, e) = bed("1");
        plant_marker(&e, &earlier_versions_marker(&dir));
        assert_next_window_takes_it_up(&dir, &e);
    }

    #[test]
    fn an_earlier_versions_marker_counts_as_held() {
        let (dir, e) = bed("1");
        plant_marker(&e, &earlier_versions_marker(&dir));
        assert!(e.recover().unwrap());
        assert_eq!(knob(&dir), "0");
        assert!(!e.marker.exists());
    }

    #[test]
    fn a_released_marker_leaves_the_administrators_value() {
        let (dir, e) = bed("0");
        drop(e.begin());
        // The administrator sets 1 after the window: not this agent's to undo.
        fs::write(dir.path().join("rcu_expedited"), "1\n").unwrap();
        assert!(!e.recover().unwrap());
        assert_eq!(knob(&dir), "1");
        // The marker is gone, and the next window makes it again.
        assert!(!e.marker.exists());
        fs::write(dir.path().join("rcu_expedited"), "0\n").unwrap();
        let window = e.begin();
        assert!(e.marker_held().unwrap());
        drop(window);
        assert!(!e.marker_held().unwrap());
    }
}
