//! Watching the manifests directory with inotify (inotify(7)): which changes
//! wake the agent, and which of them are complete, so that they are read without
//! waiting for [`SETTLE`](super::SETTLE).

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use notify::Watcher;
use tokio::sync::mpsc;

use super::{Stamp, is_manifest, stamp_of};

/// What inotify said of the directory's files since the last rescan, filled by
/// [`watch`] (or by a test calling [`Completions::record`]).
///
/// * Which files' last changes are complete: closed after writing
///   (`IN_CLOSE_WRITE`) or renamed into place (`IN_MOVED_TO`), and not opened
///   for writing since (see inotify(7)). Such a change is read at once, without
///   waiting for [`SETTLE`](super::SETTLE).
/// * Which manifests any event named, so that a rescan looks at those files
///   only (see [`ManifestDir::rescan`](super::ManifestDir::rescan)); an event
///   that cannot be tied to files (the event queue overflowed, a ConfigMap
///   volume swapped its data directory, the watch failed) makes the next rescan
///   look at every file.
#[derive(Clone, Debug, Default)]
pub struct Completions(Arc<std::sync::Mutex<Events>>);

#[derive(Debug, Default)]
struct Events {
    /// Per file, the version whose change inotify reported complete (`None`:
    /// changed again since, not complete).
    complete: HashMap<PathBuf, Option<Stamp>>,
    /// Manifests named by an event since the last [`Completions::take_changed`].
    changed: HashSet<PathBuf>,
    /// Some event since then may have changed any file.
    everything: bool,
    /// The watched directory itself was removed or moved away: the watch ended
    /// with it.
    watch_lost: bool,
}

impl Completions {
    fn events(&self) -> std::sync::MutexGuard<'_, Events> {
        self.0.lock().expect("completions lock")
    }

    /// Whether `stamp` is the version of `path` that inotify reported complete:
    /// a later write (even one whose event is still on its way) changes the
    /// version.
    pub(super) fn is_complete(&self, path: &Path, stamp: Stamp) -> bool {
        self.events().complete.get(path) == Some(&Some(stamp))
    }

    /// The manifests events named since the last call, or `None` if some event
    /// may have changed any file; starts a new record either way.
    pub(super) fn take_changed(&self) -> Option<HashSet<PathBuf>> {
        let mut events = self.events();
        let changed = std::mem::take(&mut events.changed);
        (!std::mem::take(&mut events.everything)).then_some(changed)
    }

    /// Records that any file may have changed.
    pub(super) fn record_everything(&self) {
        self.events().everything = true;
    }

    /// Whether the watched directory was removed or moved away (`IN_DELETE_SELF`,
    /// `IN_MOVE_SELF`) since [`Completions::rewatched`]: its watch ended, and a
    /// directory made again under its name needs a new one.
    pub fn watch_lost(&self) -> bool {
        self.events().watch_lost
    }

    /// Records that the directory is watched again.
    pub fn rewatched(&self) {
        self.events().watch_lost = false;
    }

    /// Records an inotify event on manifests; returns whether it completes a
    /// change.
    pub(super) fn record(&self, event: &notify::Event) -> bool {
        use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
        // The kernel's queue overflowed (`IN_Q_OVERFLOW`): events were lost.
        if event.paths.is_empty() || event.need_rescan() {
            self.record_everything();
            return false;
        }
        let complete = match event.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => true,
            // Opening reads nothing into the file: another reader (a second
            // agent on the same directory, a backup tool) must not undo a
            // completion. A write after the open reports a data change.
            EventKind::Access(_) => return false,
            EventKind::Create(_) | EventKind::Modify(ModifyKind::Data(_)) => false,
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_)) => {
                let mut events = self.events();
                for path in &event.paths {
                    events.complete.remove(path);
                    events.changed.insert(path.clone());
                }
                return false;
            }
            // Metadata (a mode or owner change) leaves the version as it was.
            _ => {
                self.events().changed.extend(event.paths.iter().cloned());
                return false;
            }
        };
        // A rename names the source first: the file now in place is the last path.
        let Some(path) = event.paths.last() else {
            return false;
        };
        // The version completed, as the next scan will see it.
        let stamp = complete.then(|| stamp_of(path).ok()).flatten();
        let mut events = self.events();
        events.changed.extend(event.paths.iter().cloned());
        events.complete.insert(path.clone(), stamp);
        stamp.is_some()
    }
}

/// Watches `dir` and sends on every change (creations, writes, renames,
/// removals) whether it completes a file (see [`Completions`], which it fills),
/// coalesced: a full channel means a rescan is already pending.
///
/// The returned watcher must be kept alive.
///
/// # Errors
/// When inotify cannot watch the directory.
pub fn watch(
    dir: &Path,
    completions: Completions,
) -> notify::Result<(notify::RecommendedWatcher, mpsc::Receiver<bool>)> {
    let (tx, rx) = mpsc::channel(16);
    let watched = dir.to_path_buf();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let (changes, complete) = match &event {
            // Not a manifest: a writer's temporary file, whose rename into place is
            // the change, or a ConfigMap volume's `..data` link and dated
            // directory, whose swap changes every file behind the links.
            Ok(e) if !e.paths.is_empty() && !e.paths.iter().any(|p| is_manifest(p)) => {
                // Kubernetes' atomic writer names these `..data`, `..data_tmp` and
                // `..<timestamp>`.
                // An event on the directory itself (moved, removed) may change
                // every file as well.
                let swap = e.paths.iter().any(|p| {
                    *p == watched
                        || p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(".."))
                }) && !matches!(e.kind, notify::EventKind::Access(_));
                if swap {
                    completions.record_everything();
                }
                if e.paths.contains(&watched)
                    && matches!(
                        e.kind,
                        notify::EventKind::Remove(_)
                            | notify::EventKind::Modify(notify::event::ModifyKind::Name(_))
                    )
                {
                    completions.events().watch_lost = true;
                }
                (swap, false)
            }
            Ok(e) => {
                let complete = completions.record(e);
                // Opening and reading (our own rescans among them) change nothing;
                // waking on them would make every rescan trigger the next.
                (
                    complete || !matches!(e.kind, notify::EventKind::Access(_)),
                    complete,
                )
            }
            Err(_) => {
                completions.record_everything();
                (true, false)
            }
        };
        if changes {
            let _ = tx.try_send(complete);
        }
    })?;
    watcher.watch(dir, notify::RecursiveMode::NonRecursive)?;
    Ok((watcher, rx))
}

/// How long to wait after a change for related changes (an editor's write and
/// rename) before rescanning.
pub const DEBOUNCE: Duration = Duration::from_millis(20);
