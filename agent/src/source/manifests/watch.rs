//! Watching the manifests directory with inotify (inotify(7)): which changes
//! wake the agent, and which of them are complete, so that they are read without
//! waiting for [`SETTLE`](super::SETTLE). A [`Watch`] follows the directory by
//! name: one removed, or moved away, and made again is watched again.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use notify::Watcher;
use tokio::sync::mpsc;

use super::{Stamp, is_manifest, stamp_of};

/// What inotify said of the directory's files since the last rescan, filled by
/// a [`Watch`] (or by a test calling `Completions::record`).
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
/// coalesced: a full channel means a rescan is already pending. Sets `lost` when
/// the directory itself is removed or moved away (`IN_DELETE_SELF`,
/// `IN_MOVE_SELF`): this watch ended with it.
///
/// The returned watcher must be kept alive.
///
/// # Errors
/// When inotify cannot watch the directory.
pub(super) fn watch(
    dir: &Path,
    completions: Completions,
    lost: Arc<AtomicBool>,
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
                    lost.store(true, Ordering::Relaxed);
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
const DEBOUNCE: Duration = Duration::from_millis(20);

/// A directory's device and inode, if it can be read.
fn inode_of(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

/// Watches a manifests directory by its name, with inotify. After the directory
/// is removed, or moved away, and made again under the same name, the next
/// [`Watch::renew`] watches the new one (the old inotify watch ends with the old
/// directory).
#[derive(Debug)]
pub struct Watch {
    dir: PathBuf,
    completions: Completions,
    /// Keeps the inotify watch alive.
    watcher: notify::RecommendedWatcher,
    /// Change notifications: whether the change completes a file.
    events: mpsc::Receiver<bool>,
    /// The watched directory's device and inode.
    inode: Option<(u64, u64)>,
    /// Set by this watch when the directory itself went away (each watch has its
    /// own: an old watch's late events cannot mark the new one lost).
    lost: Arc<AtomicBool>,
}

impl Watch {
    /// Watches `dir`, filling `completions` with what inotify says of its files.
    ///
    /// # Errors
    /// When inotify cannot watch the directory.
    pub fn new(dir: &Path, completions: Completions) -> notify::Result<Self> {
        let inode = inode_of(dir);
        let lost = Arc::default();
        let (watcher, events) = watch(dir, completions.clone(), Arc::clone(&lost))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            completions,
            watcher,
            events,
            inode,
            lost,
        })
    }

    /// Waits for the next change, with the writer's related changes coalesced:
    /// a file closed after writing or renamed into place returns at once, other
    /// changes after `DEBOUNCE` (20 ms) more.
    pub async fn changed(&mut self) {
        let Some(mut complete) = self.events.recv().await else {
            return std::future::pending().await;
        };
        while let Ok(next) = self.events.try_recv() {
            complete |= next;
        }
        if !complete {
            tokio::time::sleep(DEBOUNCE).await;
            while self.events.try_recv().is_ok() {}
        }
    }

    /// Watches the directory again if it was removed, or moved away, and made
    /// again since it was watched. A directory that is not there (yet), or cannot
    /// be watched, is looked at again at the next call; the caller's full
    /// rescans see its files meanwhile.
    pub fn renew(&mut self) {
        // The inode alone may not tell: a directory made again at once often
        // gets the inode number the removed one had.
        let now = inode_of(&self.dir);
        if now.is_none() || (now == self.inode && !self.lost.load(Ordering::Relaxed)) {
            return;
        }
        let lost = Arc::default();
        match watch(&self.dir, self.completions.clone(), Arc::clone(&lost)) {
            Ok((watcher, events)) => {
                tracing::info!(dir = %self.dir.display(), "the manifests directory was made again; watching the new one");
                self.watcher = watcher;
                self.events = events;
                self.inode = now;
                self.lost = lost;
            }
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), "the manifests directory was made again and cannot be watched: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::manifests::ManifestDir;

    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  namespace: default\nspec:\n  nodeName: node-1\nstatus:\n  podIP: 10.0.0.5\n";

    /// A manifests directory removed, or moved away, and made again under the
    /// same name is watched again once renewed: a manifest written into it wakes
    /// the watch (the old inotify watch went with the old directory).
    #[tokio::test]
    async fn a_manifests_directory_made_again_is_watched_again() {
        for moved in [false, true] {
            made_again_is_watched_again(moved).await;
        }
    }

    async fn made_again_is_watched_again(moved: bool) {
        let guard = tempfile::tempdir().unwrap();
        let path = guard.path().join("manifests");
        std::fs::create_dir(&path).unwrap();
        let completions = Completions::default();
        let mut dir = ManifestDir::new(&path)
            .unwrap()
            .with_completions(completions.clone());
        let mut watch = Watch::new(&path, completions).unwrap();
        if moved {
            std::fs::rename(&path, guard.path().join("manifests.old")).unwrap();
        } else {
            std::fs::remove_dir(&path).unwrap();
        }
        std::fs::create_dir(&path).unwrap();
        // The old watch reports the removal; that is not what is waited for.
        tokio::time::sleep(Duration::from_millis(200)).await;
        while watch.events.try_recv().is_ok() {}
        watch.renew();
        assert!(
            !watch.lost.load(Ordering::Relaxed),
            "moved away: {moved}: watched again, the watch is no longer lost"
        );
        std::fs::write(path.join("pod.yaml"), POD).unwrap();
        tokio::time::timeout(Duration::from_secs(5), watch.changed())
            .await
            .unwrap_or_else(|_| panic!("moved away: {moved}: a manifest written into the directory made again woke nothing"));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut errors = Vec::new();
        while dir.pods().count() == 0 && std::time::Instant::now() < deadline {
            errors.extend(dir.rescan().errors);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(dir.pods().count(), 1, "moved away: {moved}: {errors:?}");
    }
}
