//! Watching the manifests directory with inotify (inotify(7)): which changes
//! wake the agent, and which of them are complete, so that they are read without
//! waiting for [`SETTLE`](super::SETTLE).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use notify::Watcher;
use tokio::sync::mpsc;

use super::{Stamp, is_manifest, stamp_of};

/// Files whose last change inotify reported complete: closed after writing
/// (`IN_CLOSE_WRITE`) or renamed into place (`IN_MOVED_TO`), and not opened for
/// writing since (see inotify(7)). Such a change is read at once, without
/// waiting for [`SETTLE`](super::SETTLE). Filled by [`watch`].
#[derive(Clone, Debug, Default)]
pub struct Completions(Arc<std::sync::Mutex<HashMap<PathBuf, Option<Stamp>>>>);

impl Completions {
    /// Whether `stamp` is the version of `path` that inotify reported complete:
    /// a later write (even one whose event is still on its way) changes the
    /// version.
    pub(super) fn is_complete(&self, path: &Path, stamp: Stamp) -> bool {
        self.0.lock().expect("completions lock").get(path) == Some(&Some(stamp))
    }

    /// Records an inotify event; returns whether it completes a change.
    pub(super) fn record(&self, event: &notify::Event) -> bool {
        use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
        let complete = match event.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => true,
            // Opening reads nothing into the file: another reader (a second
            // agent on the same directory, a backup tool) must not undo a
            // completion. A write after the open reports a data change.
            EventKind::Access(AccessKind::Open(_)) => return false,
            EventKind::Create(_) | EventKind::Modify(ModifyKind::Data(_)) => false,
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_)) => {
                let mut files = self.0.lock().expect("completions lock");
                for path in &event.paths {
                    files.remove(path);
                }
                return false;
            }
            _ => return false,
        };
        // A rename names the source first: the file now in place is the last path.
        let Some(path) = event.paths.last() else {
            return false;
        };
        // The version completed, as the next scan will see it.
        let stamp = complete.then(|| stamp_of(path).ok()).flatten();
        self.0
            .lock()
            .expect("completions lock")
            .insert(path.clone(), stamp);
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
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let (changes, complete) = match &event {
            // Not a manifest: a writer's temporary file, whose rename into place is
            // the change, or a ConfigMap volume's `..data` link and dated
            // directory, whose swap changes every file behind the links.
            Ok(e) if !e.paths.is_empty() && !e.paths.iter().any(|p| is_manifest(p)) => {
                // Kubernetes' atomic writer names these `..data`, `..data_tmp` and
                // `..<timestamp>`.
                let swap = e.paths.iter().any(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(".."))
                }) && !matches!(e.kind, notify::EventKind::Access(_));
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
            Err(_) => (true, false),
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
