//! A directory of Kubernetes manifests as a workload source (no cluster needed):
//! [`ManifestSource`].
//!
//! Every `*.yaml`, `*.yml` and `*.json` file in the directory (not its
//! subdirectories; hidden files are skipped) is read as a multi-document YAML
//! stream. Documents of kind `Pod`, `Namespace`, `Service` and `Node` (API
//! version `v1`), `EndpointSlice` (`discovery.k8s.io/v1`), `AuthorizationPolicy`
//! and `PeerAuthentication` (`security.istio.io/v1` or `v1beta1`) are used,
//! `List` documents are unpacked, and other kinds are ignored. A file that fails to
//! parse is reported with its path, the line and what is wrong; the objects it held
//! before keep being used until it is fixed. A changed (or removed) file is applied
//! once it has stayed the same for [`SETTLE`], so a file rewritten in place is not
//! read half-written, unless inotify reported the change complete (closed after
//! writing, or renamed into place: [`Completions`]), which is read at once; files that cannot be read (a dangling symlink, a FIFO, more
//! than [`MAX_FILE_SIZE`]) are reported and keep their last objects.
//!
//! Files are re-read only when their size, modification time or inode changed.
//! When watched, a rescan looks only at the files inotify named since the last
//! one (one `stat` each), and at every file (listing the directory, one `stat`
//! per file) at the first rescan, after an event that names no manifest of the
//! directory but may change them (the event queue overflowed, a ConfigMap
//! volume swapped its `..data` link, the directory itself was moved or removed),
//! after [`ManifestDir::resync`] (the source's periodic resync while nothing
//! changes, every [`RESYNC`]: [`ManifestSource`]) and once [`FULL_RESCAN_MAX_AGE`] has passed since the last
//! such full rescan. Parsing is in [`parse`].

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use crate::k8s::{EndpointSlice, Namespace, Node, Pod, Service};

use crate::authz::{MtlsPolicy, Policy};

mod parse;
mod source;
mod watch;

pub use parse::{ManifestError, Objects, Problem, parse};
pub use source::ManifestSource;
#[cfg(test)]
use watch::watch;
pub use watch::{Completions, Watch};

/// Largest manifest file read (bytes).
pub const MAX_FILE_SIZE: u64 = 16 * 1024 * 1024;

/// Reads a manifest without blocking on files that are not regular files on disk
/// (a symlink to `/proc/kmsg`, a FIFO) and without reading more than
/// [`MAX_FILE_SIZE`].
fn read_manifest(path: &Path) -> Result<String, String> {
    use std::{io::Read, os::unix::fs::OpenOptionsExt};
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("reading: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("reading: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_FILE_SIZE {
        return Err(format!(
            "{} bytes; manifests over {MAX_FILE_SIZE} bytes are refused",
            meta.len()
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_SIZE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("reading: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_SIZE {
        return Err(format!("more than {MAX_FILE_SIZE} bytes; refused"));
    }
    String::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))
}

/// What identifies a version of a file without reading it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Stamp {
    len: u64,
    mtime_ns: i128,
    ino: u64,
}

#[derive(Debug)]
struct FileState {
    stamp: Stamp,
    objects: Objects,
    error: Option<ManifestError>,
    /// Whether `objects` came from a successful parse (not just the empty default
    /// of a file that was broken when first seen).
    good: bool,
    /// Whether the version read names `AuthorizationPolicy` or
    /// `PeerAuthentication`.
    mentions_policy: bool,
    /// The entry is a directory, FIFO or the like with a manifest's name: never
    /// read, so that it adds no object and hides none (what an earlier good
    /// version held stays, as for any file that cannot be read).
    not_regular: bool,
}

/// A change seen but not applied yet: the file's new version (`None`: gone) and
/// when it was first seen.
#[derive(Debug)]
struct Pending {
    stamp: Option<Stamp>,
    since: Instant,
    /// Held to settle although inotify reported it complete (it drops objects).
    held: bool,
}

/// How long a file must keep the same version (size, mtime, inode), or stay gone,
/// before the change is applied. A file rewritten in place is briefly empty or
/// half-written; applying that would un-enroll its pods.
pub const SETTLE: Duration = Duration::from_millis(100);

/// How long a change that has not settled may hold up detaching pods.
pub const MAX_SETTLE_HOLD: Duration = Duration::from_secs(2);

/// Whether a change may be applied: [`ManifestDir::settled_change`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settle {
    /// Not yet.
    Wait,
    /// It kept the same version for the settling time (or is the first scan).
    Settled,
    /// inotify reported it complete.
    Complete,
}

/// The manifests directory with the last good objects of each file.
#[derive(Debug)]
pub struct ManifestDir {
    dir: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    pending: BTreeMap<PathBuf, Pending>,
    settle: Duration,
    scanned: bool,
    /// When the last rescan that looked at every file (listed the directory)
    /// ran.
    full_scan_at: Option<Instant>,
    /// What inotify says of the files' last changes, when watched.
    completions: Option<Completions>,
}

/// The result of a rescan.
#[derive(Debug, Default)]
pub struct Rescan {
    /// Whether any file's objects changed (added, removed, or re-read successfully).
    pub changed: bool,
    /// Which objects changed; `None` at the first rescan: everything is new.
    pub changes: Option<Changes>,
    /// Problems found in files that changed since the last rescan.
    pub errors: Vec<ManifestError>,
    /// Changes wait for their files to settle: rescan again after [`SETTLE`].
    pub unsettled: bool,
}

/// Which objects a rescan changed, found by comparing each changed file's
/// objects before and after.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// The pods (`namespace/name`) whose definitions in some file were added,
    /// removed or changed.
    pub pods: BTreeSet<String>,
    /// Some Namespace object was added, removed or changed.
    pub namespaces: bool,
    /// Some Service or EndpointSlice was added, removed or changed.
    pub services: bool,
    /// Some Node was added, removed or changed.
    pub nodes: bool,
}

impl Changes {
    /// Records a file's change from `old` to `new` objects (`None`: no file).
    fn record(&mut self, old: Option<&Objects>, new: Option<&Objects>) {
        let none = Objects::default();
        let (old, new) = (old.unwrap_or(&none), new.unwrap_or(&none));
        self.namespaces |= old.namespaces != new.namespaces;
        self.services |= old.services != new.services || old.endpoint_slices != new.endpoint_slices;
        self.nodes |= old.nodes != new.nodes;
        // Each pod's definitions in the file, in order.
        fn by_key(pods: &[Pod]) -> HashMap<String, Vec<&Pod>> {
            let mut by_key: HashMap<String, Vec<&Pod>> = HashMap::new();
            for pod in pods {
                if let Some(key) = pod.key() {
                    by_key.entry(key).or_default().push(pod);
                }
            }
            by_key
        }
        let (before, after) = (by_key(&old.pods), by_key(&new.pods));
        for (key, defs) in &before {
            if after.get(key) != Some(defs) {
                self.pods.insert(key.clone());
            }
        }
        for key in after.into_keys() {
            if !before.contains_key(&key) {
                self.pods.insert(key);
            }
        }
    }
}

/// Why a manifest's version cannot be had.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Unreadable {
    /// A directory, FIFO, socket or device with a manifest's name: never read,
    /// so it holds no object.
    NotRegular,
    /// It cannot be looked at (a dangling symlink, no permission): what it
    /// holds is unknown.
    Error(String),
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreadable::NotRegular => f.write_str("not a regular file"),
            Unreadable::Error(e) => write!(f, "cannot be read: {e}"),
        }
    }
}

/// The version of the file at `path`, following symlinks (ConfigMap mounts are
/// symlinks), or why it cannot be read.
fn stamp_of(path: &Path) -> Result<Stamp, Unreadable> {
    match fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(Stamp {
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ino: meta.ino(),
        }),
        Ok(_) => Err(Unreadable::NotRegular),
        Err(e) => Err(Unreadable::Error(e.to_string())),
    }
}

fn is_manifest(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    !name.starts_with('.')
        && (name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".json"))
}

impl ManifestDir {
    /// A source for `dir`, not read yet. Changes apply once settled for [`SETTLE`];
    /// the first scan applies what it finds at once.
    ///
    /// # Errors
    /// When `dir` is not a readable directory.
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        Self::with_settle(dir, SETTLE)
    }

    /// As [`ManifestDir::new`] with another settling time.
    ///
    /// # Errors
    /// When `dir` is not a readable directory.
    pub fn with_settle(dir: &Path, settle: Duration) -> std::io::Result<Self> {
        fs::read_dir(dir)?;
        Ok(Self {
            // As inotify names the files (see `Completions`).
            dir: std::path::absolute(dir)?,
            files: BTreeMap::new(),
            pending: BTreeMap::new(),
            settle,
            scanned: false,
            full_scan_at: None,
            completions: None,
        })
    }

    /// Reads changes that inotify reported complete at once (see [`Completions`]).
    #[must_use]
    pub fn with_completions(mut self, completions: Completions) -> Self {
        self.completions = Some(completions);
        self
    }

    /// The watched directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifests of the directory: each file's version, or why it cannot be
    /// read (a dangling symlink, a directory or FIFO with a manifest's name).
    fn stamps(&self) -> std::io::Result<HashMap<PathBuf, Result<Stamp, Unreadable>>> {
        let mut seen = HashMap::new();
        for entry in fs::read_dir(&self.dir)?.flatten() {
            let path = entry.path();
            if !is_manifest(&path) {
                continue;
            }
            let stamp = stamp_of(&path);
            seen.insert(path, stamp);
        }
        Ok(seen)
    }

    /// The files a rescan looks at: `None` for every file (the directory is
    /// listed), else those inotify named since the last rescan and those whose
    /// change waits or that could not be read. Every file at the first rescan,
    /// without inotify, after an event that names no manifest but may change
    /// them, after
    /// [`ManifestDir::resync`], once [`FULL_RESCAN_MAX_AGE`] has
    /// passed since the last full rescan, and when the directory is no longer
    /// one (the full rescan reports it).
    fn scope(&self, now: Instant) -> Option<HashSet<PathBuf>> {
        let changed = self.completions.as_ref()?.take_changed()?;
        if !self.scanned
            || self
                .full_scan_at
                .is_none_or(|at| now.duration_since(at) >= FULL_RESCAN_MAX_AGE)
            || !fs::metadata(&self.dir).is_ok_and(|m| m.is_dir())
        {
            return None;
        }
        let mut scope: HashSet<PathBuf> = changed
            .into_iter()
            .filter(|p| is_manifest(p) && p.parent() == Some(self.dir.as_path()))
            .collect();
        scope.extend(self.pending.keys().cloned());
        scope.extend(
            self.files
                .iter()
                .filter(|(_, f)| f.stamp == Stamp::default())
                .map(|(p, _)| p.clone()),
        );
        Some(scope)
    }

    /// The versions of the files in `scope` that exist (as [`stamps`] would list
    /// them).
    ///
    /// [`stamps`]: ManifestDir::stamps
    fn stamps_of(scope: &HashSet<PathBuf>) -> HashMap<PathBuf, Result<Stamp, Unreadable>> {
        scope
            .iter()
            .filter(|p| {
                !matches!(fs::symlink_metadata(p), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
            })
            .map(|p| (p.clone(), stamp_of(p)))
            .collect()
    }

    /// Whether a change to `path` (new version `stamp`) may be applied now, and
    /// why; records it as pending otherwise. A version held back although
    /// complete (see [`rescan`]) waits out its settling time.
    ///
    /// [`rescan`]: ManifestDir::rescan
    fn settled_change(&mut self, path: &Path, stamp: Option<Stamp>, now: Instant) -> Settle {
        if !self.scanned {
            return Settle::Settled;
        }
        let complete = stamp.is_some_and(|stamp| {
            self.completions
                .as_ref()
                .is_some_and(|c| c.is_complete(path, stamp))
        });
        match self.pending.get(path) {
            // Seen by a scan before its completion event came: complete now.
            Some(p) if p.stamp == stamp && complete && !p.held => {
                self.pending.remove(path);
                Settle::Complete
            }
            Some(p) if p.stamp == stamp => {
                if now.duration_since(p.since) >= self.settle {
                    self.pending.remove(path);
                    Settle::Settled
                } else {
                    Settle::Wait
                }
            }
            _ if complete => {
                self.pending.remove(path);
                Settle::Complete
            }
            _ => {
                self.pending.insert(
                    path.to_path_buf(),
                    Pending {
                        stamp,
                        since: now,
                        held: false,
                    },
                );
                Settle::Wait
            }
        }
    }

    /// Re-reads files that changed (once settled) and forgets files that are gone.
    /// Looks at the files inotify named, or at every file (see the module's
    /// documentation).
    pub fn rescan(&mut self) -> Rescan {
        let mut rescan = Rescan {
            changes: self.scanned.then(Changes::default),
            ..Rescan::default()
        };
        let now = Instant::now();
        let scope = self.scope(now);
        let seen = match &scope {
            Some(scope) => Self::stamps_of(scope),
            None => match self.stamps() {
                Ok(seen) => {
                    self.full_scan_at = Some(now);
                    seen
                }
                Err(e) => {
                    // What made this rescan look at every file still holds.
                    self.full_scan_at = None;
                    rescan.errors.push(ManifestError {
                        file: self.dir.clone(),
                        line: 0,
                        problem: Problem::Unreadable(format!("reading the directory: {e}")),
                    });
                    return rescan;
                }
            },
        };
        let looked_at = |path: &PathBuf| scope.as_ref().is_none_or(|s| s.contains(path));
        // Changes that undid themselves (a file that came and went) are no longer
        // pending.
        self.pending.retain(|path, _| {
            !looked_at(path) || seen.contains_key(path) || self.files.contains_key(path)
        });
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| looked_at(p) && !seen.contains_key(*p))
            .cloned()
            .collect();
        for path in gone {
            if self.settled_change(&path, None, now) != Settle::Wait {
                if let (Some(file), Some(changes)) = (self.files.remove(&path), &mut rescan.changes)
                {
                    changes.record(Some(&file.objects), None);
                }
                rescan.changed = true;
            } else {
                rescan.unsettled = true;
            }
        }
        for (path, stamp) in seen {
            let stamp = match stamp {
                Ok(stamp) => stamp,
                Err(why) => {
                    // Not a file that can be read: a problem with it, not a deletion.
                    // What it held before stays.
                    self.pending.remove(&path);
                    let error = ManifestError {
                        file: path.clone(),
                        line: 0,
                        problem: Problem::Unreadable(why.to_string()),
                    };
                    let state = self.files.entry(path).or_insert_with(|| FileState {
                        stamp: Stamp::default(),
                        objects: Objects::default(),
                        error: None,
                        good: false,
                        mentions_policy: true,
                        not_regular: false,
                    });
                    // A directory or FIFO is never read and holds nothing, so that
                    // a stray one neither denies every request nor stops detaching.
                    state.not_regular = why == Unreadable::NotRegular;
                    if !state.good && !state.not_regular {
                        // It cannot be looked at: what it holds is unknown.
                        state.mentions_policy = true;
                    }
                    state.stamp = Stamp::default();
                    if state.error.as_ref() != Some(&error) {
                        rescan.errors.push(error.clone());
                        state.error = Some(error);
                    }
                    continue;
                }
            };
            if self.files.get(&path).is_some_and(|f| f.stamp == stamp) {
                self.pending.remove(&path);
                continue;
            }
            let settle = self.settled_change(&path, Some(stamp), now);
            if settle == Settle::Wait {
                rescan.unsettled = true;
                continue;
            }
            // Until the file is read, it may hold anything.
            let mut mentions_policy = true;
            let result = read_manifest(&path)
                .map_err(|message| ManifestError {
                    file: path.clone(),
                    line: 0,
                    problem: Problem::Unreadable(message),
                })
                .and_then(|text| {
                    mentions_policy =
                        text.contains("AuthorizationPolicy") || text.contains("PeerAuthentication");
                    parse(&path, &text)
                });
            // Written to while being read: read it again once it settles.
            let now_stamp = stamp_of(&path).ok();
            if self.scanned && now_stamp != Some(stamp) {
                self.pending.insert(
                    path,
                    Pending {
                        stamp: now_stamp,
                        since: now,
                        held: false,
                    },
                );
                rescan.unsettled = true;
                continue;
            }
            // A complete write that drops objects may be a file emptied before it is
            // written again (`> file`, then appends): applying it would un-enroll
            // pods for a moment. Such a change waits to settle; one that adds or
            // changes objects is applied at once.
            if settle == Settle::Complete
                && let Ok(objects) = &result
                && objects.len() < self.files.get(&path).map_or(0, |f| f.objects.len())
            {
                self.pending.insert(
                    path,
                    Pending {
                        stamp: Some(stamp),
                        since: now,
                        held: true,
                    },
                );
                rescan.unsettled = true;
                continue;
            }
            match result {
                Ok(objects) => {
                    if let Some(changes) = &mut rescan.changes {
                        changes.record(self.files.get(&path).map(|f| &f.objects), Some(&objects));
                    }
                    self.files.insert(
                        path,
                        FileState {
                            stamp,
                            objects,
                            error: None,
                            good: true,
                            mentions_policy,
                            not_regular: false,
                        },
                    );
                    rescan.changed = true;
                }
                Err(error) => {
                    rescan.errors.push(error.clone());
                    // Keep what the file held before; remember the stamp so the
                    // same error is reported once.
                    let (objects, good) = self
                        .files
                        .remove(&path)
                        .map(|f| (f.objects, f.good))
                        .unwrap_or_default();
                    self.files.insert(
                        path,
                        FileState {
                            stamp,
                            objects,
                            error: Some(error),
                            good,
                            mentions_policy,
                            not_regular: false,
                        },
                    );
                }
            }
        }
        self.scanned = true;
        rescan
    }

    /// Makes the next rescan look at every file, whatever inotify named.
    pub fn resync(&mut self) {
        self.full_scan_at = None;
    }

    /// Whether a change is waiting to settle (for at most [`MAX_SETTLE_HOLD`]): a
    /// pod missing from the objects may be missing only for the moment. A file
    /// that keeps changing for longer does not hold up the others.
    pub fn settling(&self) -> bool {
        let now = Instant::now();
        self.pending
            .values()
            .any(|p| now.duration_since(p.since) < MAX_SETTLE_HOLD)
    }

    /// Whether a file is broken without a good version to stand in for it (as when
    /// the agent starts with a broken file): pods it would name are unknown. A
    /// directory or FIFO with a manifest's name names none.
    pub fn incomplete(&self) -> bool {
        self.files
            .values()
            .any(|f| !f.good && f.error.is_some() && !f.not_regular)
    }

    /// All pods of all files (the last good version of each).
    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.files.values().flat_map(|f| &f.objects.pods)
    }

    /// Pods defined more than once (by namespace and name; finished pods do not
    /// count, as they name no workload): one warning per pod, naming every file
    /// that defines it, a file once per definition, in file name order. The
    /// workload index uses the first definition and skips the others.
    pub fn duplicate_pods(&self) -> Vec<String> {
        let mut defined: BTreeMap<(&str, &str), Vec<&Path>> = BTreeMap::new();
        for (path, file) in &self.files {
            for pod in &file.objects.pods {
                let Some(name) = pod.metadata.name.as_deref() else {
                    continue;
                };
                if crate::state::is_finished(pod) {
                    continue;
                }
                let namespace = pod.metadata.namespace_or_default();
                defined.entry((namespace, name)).or_default().push(path);
            }
        }
        defined
            .into_iter()
            .filter(|(_, files)| files.len() > 1)
            .map(|((namespace, name), files)| {
                let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
                format!(
                    "pod {namespace}/{name} is defined {} times, in {}; the first definition is used",
                    files.len(),
                    files.join(", ")
                )
            })
            .collect()
    }

    /// All namespaces of all files.
    pub fn namespaces(&self) -> impl Iterator<Item = &Namespace> {
        self.files.values().flat_map(|f| &f.objects.namespaces)
    }

    /// All Services of all files.
    pub fn services(&self) -> impl Iterator<Item = &Service> {
        self.files.values().flat_map(|f| &f.objects.services)
    }

    /// All EndpointSlices of all files.
    pub fn endpoint_slices(&self) -> impl Iterator<Item = &EndpointSlice> {
        self.files.values().flat_map(|f| &f.objects.endpoint_slices)
    }

    /// All authorization policies of all files.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.files.values().flat_map(|f| &f.objects.policies)
    }

    /// All PeerAuthentications of all files.
    pub fn mtls_policies(&self) -> impl Iterator<Item = &Arc<MtlsPolicy>> {
        self.files.values().flat_map(|f| &f.objects.mtls_policies)
    }

    /// All Nodes of all files.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.files.values().flat_map(|f| &f.objects.nodes)
    }

    /// A file that is broken, has no good version, and names `AuthorizationPolicy`
    /// or `PeerAuthentication`, or cannot be read at all: the policies it holds
    /// are unknown, so the proxy
    /// must not guess that they allow. Returns the first such file's error.
    pub fn policies_unknown(&self) -> Option<&ManifestError> {
        self.files
            .values()
            .find(|f| !f.good && f.mentions_policy && !f.not_regular)
            .and_then(|f| f.error.as_ref())
    }

    /// Files whose current version has a problem.
    pub fn errors(&self) -> impl Iterator<Item = &ManifestError> {
        self.files.values().filter_map(|f| f.error.as_ref())
    }
}

/// Rescan period without any event, in case an event was lost.
pub const RESYNC: Duration = Duration::from_secs(2);

/// The longest time between two rescans that look at every file, however busy
/// the agent is (changes, settling files or a pod's retries keep it from
/// resyncing): the delay of a change no event in the directory names, such as a
/// manifest symlink's target outside it.
pub const FULL_RESCAN_MAX_AGE: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = parse::TEST_POD;

    #[test]
    fn broken_files_that_may_hold_policies_make_them_unknown() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        fs::write(dir.join("pod.yaml"), POD).unwrap();
        let deny = "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: d, namespace: shop}\nspec: {action: DENY, rules: [{}]}\n";
        fs::write(dir.join("deny.yaml"), deny).unwrap();
        let mut source = ManifestDir::new(dir).unwrap();
        source.rescan();
        assert_eq!(source.policies().count(), 1);
        assert!(source.policies_unknown().is_none());

        // A broken pod file says nothing about policies.
        fs::write(
            dir.join("other.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: [\n",
        )
        .unwrap();
        // A file naming AuthorizationPolicy, or one that cannot be read as text, may
        // hold any policy.
        for (name, bytes) in [
            ("bad.yaml", b"kind: AuthorizationPolicy\nspec: [\n".to_vec()),
            (
                "bad-pa.yaml",
                b"apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: p, namespace: shop}\nspec: {mtls: {mode: STRICTER}}\n".to_vec(),
            ),
            ("latin1.yaml", b"# caf\xe9\n".to_vec()),
        ] {
            let mut fresh = ManifestDir::new(dir).unwrap();
            fresh.rescan();
            assert!(fresh.policies_unknown().is_none());
            fs::write(dir.join(name), bytes).unwrap();
            let mut fresh = ManifestDir::new(dir).unwrap();
            fresh.rescan();
            let unknown = fresh.policies_unknown().expect(name);
            assert!(unknown.file.ends_with(name), "{unknown}");
            fs::remove_file(dir.join(name)).unwrap();
        }

        // A manifest that cannot be looked at (a dangling symlink) may hold any
        // policy; a directory or FIFO with a manifest's name is never read and
        // holds none, whatever stood at its name before.
        std::os::unix::fs::symlink(dir.join("missing.yaml"), dir.join("link.yaml")).unwrap();
        let mut fresh = ManifestDir::new(dir).unwrap();
        fresh.rescan();
        let unknown = fresh.policies_unknown().expect("dangling symlink");
        assert!(unknown.file.ends_with("link.yaml"), "{unknown}");
        fs::remove_file(dir.join("link.yaml")).unwrap();
        fs::create_dir(dir.join("link.yaml")).unwrap();
        nix::unistd::mkfifo(&dir.join("fifo.yaml"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let errors = fresh.rescan().errors;
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            fresh.policies_unknown().is_none(),
            "{:?}",
            fresh.policies_unknown()
        );
        assert_eq!(fresh.policies().count(), 1);
        // The broken pod file stops the agent from detaching others' pods ...
        assert!(fresh.incomplete());
        // ... a directory or FIFO does not; found so at a first scan too.
        fs::remove_file(dir.join("other.yaml")).unwrap();
        let mut fresh = ManifestDir::new(dir).unwrap();
        let not_regular = fresh
            .rescan()
            .errors
            .iter()
            .filter(|e| e.problem == Problem::Unreadable("not a regular file".into()))
            .count();
        assert_eq!(not_regular, 2);
        assert!(fresh.policies_unknown().is_none());
        assert!(!fresh.incomplete());
    }

    /// A pod defined more than once is warned about once, with every file that
    /// defines it; a finished pod of the same name does not count.
    #[test]
    fn duplicate_pods_are_named_with_their_files() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        // A first scan reads every file at once.
        let duplicates = || {
            let mut source = ManifestDir::new(dir).unwrap();
            source.rescan();
            source.duplicate_pods()
        };
        fs::write(dir.join("a.yaml"), POD).unwrap();
        let finished = format!("{POD}  phase: Succeeded\n");
        fs::write(dir.join("0-done.yaml"), finished).unwrap();
        let mut source = ManifestDir::new(dir).unwrap();
        assert!(source.rescan().errors.is_empty());
        assert_eq!(source.pods().count(), 2);
        assert!(source.duplicate_pods().is_empty());

        fs::write(dir.join("b.yaml"), format!("{POD}---\n{POD}")).unwrap();
        let (a, b) = (dir.join("a.yaml"), dir.join("b.yaml"));
        assert_eq!(
            duplicates(),
            [format!(
                "pod shop/web is defined 3 times, in {}, {}, {}; the first definition is used",
                a.display(),
                b.display(),
                b.display()
            )]
        );
        fs::remove_file(&a).unwrap();
        assert_eq!(
            duplicates(),
            [format!(
                "pod shop/web is defined 2 times, in {}, {}; the first definition is used",
                b.display(),
                b.display()
            )]
        );
    }

    /// A rescan says which pods changed, and whether namespaces, Services or
    /// mode labels did: per file, by comparing its objects before and after.
    #[test]
    fn a_rescan_names_what_changed() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        let pod = |name: &str, ip: &str, labels: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: shop, labels: {{{labels}}}}}\nspec: {{nodeName: node1}}\nstatus: {{podIP: {ip}}}\n"
            )
        };
        let namespace = "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n";
        let service = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";
        fs::write(dir.join("a.yaml"), pod("a", "10.1.1.1", "")).unwrap();
        fs::write(
            dir.join("b.yaml"),
            [pod("b", "10.1.1.2", ""), pod("c", "10.1.1.3", "")].join("---\n"),
        )
        .unwrap();
        let mut source = ManifestDir::with_settle(dir, Duration::ZERO).unwrap();
        let first = source.rescan();
        assert!(first.changed && first.changes.is_none(), "{first:?}");
        // Rescans until the change is applied (it settles first).
        let mut apply = |path: &str, text: Option<String>| {
            match text {
                Some(text) => fs::write(dir.join(path), text).unwrap(),
                None => fs::remove_file(dir.join(path)).unwrap(),
            }
            for _ in 0..10 {
                let rescan = source.rescan();
                assert!(rescan.errors.is_empty(), "{rescan:?}");
                if rescan.changed {
                    return rescan.changes.unwrap();
                }
            }
            panic!("{path} was not applied");
        };
        let pods = |changes: &Changes| changes.pods.iter().cloned().collect::<Vec<_>>();

        // One pod of two changed: only it.
        let changes = apply(
            "b.yaml",
            Some([pod("b", "10.1.1.9", ""), pod("c", "10.1.1.3", "")].join("---\n")),
        );
        assert_eq!(pods(&changes), ["shop/b"]);
        assert!(!changes.namespaces && !changes.services);
        // A new file: its pods, its namespace, its Service.
        let changes = apply(
            "c.yaml",
            Some([pod("d", "10.1.1.4", ""), namespace.into(), service.into()].join("---\n")),
        );
        assert_eq!(pods(&changes), ["shop/d"]);
        assert!(changes.namespaces && changes.services);
        // A pod opting out, then its file gone.
        let changes = apply(
            "a.yaml",
            Some(pod("a", "10.1.1.1", "istio.io/dataplane-mode: none")),
        );
        assert_eq!(pods(&changes), ["shop/a"]);
        assert!(!changes.namespaces);
        // Its label dropped again, in a file that now also holds a pod of the
        // default namespace.
        let unlabelled = format!(
            "{}---\napiVersion: v1\nkind: Pod\nmetadata: {{name: x}}\n",
            pod("a", "10.1.1.1", "")
        );
        let changes = apply("a.yaml", Some(unlabelled.clone()));
        assert_eq!(pods(&changes), ["default/x", "shop/a"]);
        // The same objects written again: read, but nothing changed.
        let changes = apply("a.yaml", Some(format!("# again\n{unlabelled}")));
        assert_eq!(changes, Changes::default());
        // Only the Service changed.
        let changes = apply(
            "c.yaml",
            Some(
                [
                    pod("d", "10.1.1.4", ""),
                    namespace.into(),
                    service.replace("80", "8080"),
                ]
                .join("---\n"),
            ),
        );
        assert!(changes.pods.is_empty() && changes.services && !changes.namespaces);
        let changes = apply("a.yaml", None);
        assert_eq!(pods(&changes), ["default/x", "shop/a"]);
        let changes = apply("c.yaml", None);
        assert_eq!(pods(&changes), ["shop/d"]);
        assert!(changes.namespaces && changes.services);
        // A broken file changes nothing and keeps its objects.
        fs::write(dir.join("b.yaml"), "kind: Pod\nmetadata: [\n").unwrap();
        for _ in 0..10 {
            let rescan = source.rescan();
            if !rescan.errors.is_empty() {
                assert!(!rescan.changed, "{rescan:?}");
                assert_eq!(rescan.changes, Some(Changes::default()));
                assert_eq!(source.pods().count(), 2);
                return;
            }
        }
        panic!("the broken file was not reported");
    }

    #[test]
    fn a_broken_file_keeps_its_last_good_objects() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        fs::write(dir.join("pod.yaml"), POD).unwrap();
        fs::write(dir.join(".hidden.yaml"), "{{{").unwrap();
        fs::write(dir.join("notes.txt"), "{{{").unwrap();
        let settle = Duration::from_millis(30);
        let mut source = ManifestDir::with_settle(dir, settle).unwrap();
        // The first scan applies at once.
        let first = source.rescan();
        assert!(first.changed && first.errors.is_empty(), "{first:?}");
        assert_eq!(source.pods().count(), 1);
        assert!(!source.settling() && !source.incomplete());

        // Unchanged: nothing re-read.
        let again = source.rescan();
        assert!(!again.changed && again.errors.is_empty() && !again.unsettled);

        // Rewritten in place, empty for a moment: not applied while it may still be
        // written; the pod stays.
        fs::write(dir.join("pod.yaml"), "").unwrap();
        let truncated = source.rescan();
        assert!(truncated.unsettled && !truncated.changed);
        assert_eq!(source.pods().count(), 1);
        assert!(source.settling());

        // Broken (and settled): reported once, objects kept.
        fs::write(
            dir.join("pod.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: [\n",
        )
        .unwrap();
        assert!(source.rescan().unsettled);
        std::thread::sleep(settle);
        let broken = source.rescan();
        assert_eq!(broken.errors.len(), 1, "{broken:?}");
        assert!(!broken.changed);
        assert_eq!(source.pods().count(), 1);
        assert_eq!(source.errors().count(), 1);
        assert!(source.rescan().errors.is_empty());
        assert!(!source.settling());
        assert!(
            !source.incomplete(),
            "a broken file with a good version stands in"
        );

        // Replaced by rename with a fixed version.
        let fixed = POD.replace("web", "web2");
        fs::write(dir.join("tmp.partial"), &fixed).unwrap();
        fs::rename(dir.join("tmp.partial"), dir.join("pod.yaml")).unwrap();
        assert!(source.rescan().unsettled);
        std::thread::sleep(settle);
        let renamed = source.rescan();
        assert!(renamed.changed && renamed.errors.is_empty());
        assert_eq!(
            source.pods().next().unwrap().metadata.name.as_deref(),
            Some("web2")
        );
        assert_eq!(source.errors().count(), 0);

        // Removed: applied once it stays gone.
        fs::remove_file(dir.join("pod.yaml")).unwrap();
        assert!(source.rescan().unsettled);
        assert_eq!(source.pods().count(), 1);
        std::thread::sleep(settle);
        assert!(source.rescan().changed);
        assert_eq!(source.pods().count(), 0);
        assert!(!source.settling());
    }

    #[tokio::test]
    async fn changes_inotify_reports_complete_are_read_at_once() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        // Settling would hold any other change for an hour.
        let completions = Completions::default();
        let mut source = ManifestDir::with_settle(dir, Duration::from_secs(3600))
            .unwrap()
            .with_completions(completions.clone());
        let (_watcher, mut events) = watch(dir, completions, Default::default()).unwrap();
        assert!(source.rescan().errors.is_empty());
        // Waits for the event that completes the change.
        let mut wait_complete = async || {
            let deadline = Duration::from_secs(5);
            loop {
                let complete = tokio::time::timeout(deadline, events.recv())
                    .await
                    .expect("no inotify event")
                    .unwrap();
                if complete {
                    // The rest of this change's events (a rename reports "to" and
                    // "both"), so that the next wait sees only the next change.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    while events.try_recv().is_ok() {}
                    return;
                }
            }
        };

        // Renamed into place (the temporary file's own events wake nobody).
        fs::write(dir.join(".pod.yaml.tmp"), POD).unwrap();
        fs::rename(dir.join(".pod.yaml.tmp"), dir.join("pod.yaml")).unwrap();
        wait_complete().await;
        let renamed = source.rescan();
        assert!(renamed.changed && !renamed.unsettled, "{renamed:?}");
        assert_eq!(source.pods().count(), 1);

        // Rewritten in place and closed.
        fs::write(dir.join("pod.yaml"), POD.replace("web", "web2")).unwrap();
        wait_complete().await;
        assert!(source.rescan().changed);
        assert_eq!(
            source.pods().next().unwrap().metadata.name.as_deref(),
            Some("web2")
        );

        // Emptied and closed (`> file`, before it is written again): a complete
        // change that drops objects waits to settle; the pod stays.
        fs::write(dir.join("pod.yaml"), "").unwrap();
        wait_complete().await;
        let emptied = source.rescan();
        assert!(emptied.unsettled && !emptied.changed, "{emptied:?}");
        assert_eq!(source.pods().count(), 1);
        fs::write(dir.join("pod.yaml"), POD.replace("web", "web2")).unwrap();
        wait_complete().await;
        source.rescan();

        // Opened for writing and not closed yet: waits to settle, the pod stays.
        let mut open = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(dir.join("pod.yaml"))
            .unwrap();
        std::io::Write::write_all(&mut open, b"kind: Pod\n").unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let writing = source.rescan();
        assert!(writing.unsettled && !writing.changed, "{writing:?}");
        assert_eq!(source.pods().count(), 1);
        drop(open);
    }

    /// A source for `dir` fed by `completions` (no watcher: the tests record the
    /// events), scanned once, and then a pod manifest written at `path`. Settling
    /// would hold any change not reported complete for an hour.
    fn scanned_with_a_new_pod_file(dir: &Path) -> (ManifestDir, Completions, PathBuf) {
        let completions = Completions::default();
        let mut source = ManifestDir::with_settle(dir, Duration::from_secs(3600))
            .unwrap()
            .with_completions(completions.clone());
        source.rescan();
        let path = std::path::absolute(dir.join("pod.yaml")).unwrap();
        fs::write(&path, POD).unwrap();
        (source, completions, path)
    }

    #[test]
    fn a_file_seen_before_its_completion_event_is_read_when_the_event_comes() {
        use notify::event::{AccessKind, AccessMode, EventKind};
        let guard = tempfile::tempdir().unwrap();
        let (mut source, completions, path) = scanned_with_a_new_pod_file(guard.path());
        // Its creation made a scan find it before the write completed: it waits.
        let created = notify::Event::new(EventKind::Create(notify::event::CreateKind::File))
            .add_path(path.clone());
        assert!(!completions.record(&created));
        assert!(source.rescan().unsettled);
        assert_eq!(source.pods().count(), 0);
        // Its own close-after-write then arrives.
        let closed = notify::Event::new(EventKind::Access(AccessKind::Close(AccessMode::Write)))
            .add_path(path.clone());
        assert!(completions.record(&closed));
        let read = source.rescan();
        assert!(read.changed && !read.unsettled, "{read:?}");
        assert_eq!(source.pods().count(), 1);
    }

    #[test]
    fn another_reader_opening_a_completed_file_does_not_hold_it_back() {
        use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
        let guard = tempfile::tempdir().unwrap();
        let (mut source, completions, path) = scanned_with_a_new_pod_file(guard.path());
        let renamed = notify::Event::new(EventKind::Modify(ModifyKind::Name(RenameMode::To)))
            .add_path(path.clone());
        assert!(completions.record(&renamed));
        // Another agent watching the same directory opens it to read it before
        // this one scans (found by `cargo xtask bench`: one enrollment in six
        // waited out the 100 ms settling time).
        let opened = notify::Event::new(EventKind::Access(AccessKind::Open(AccessMode::Any)))
            .add_path(path.clone());
        assert!(!completions.record(&opened));
        let read = source.rescan();
        assert!(read.changed && !read.unsettled, "{read:?}");
        assert_eq!(source.pods().count(), 1);
        // A write, though, does hold the next version back until it completes.
        fs::write(&path, POD.replace("web", "web2")).unwrap();
        let written = notify::Event::new(EventKind::Modify(ModifyKind::Data(
            notify::event::DataChange::Any,
        )))
        .add_path(path.clone());
        assert!(!completions.record(&written));
        assert!(source.rescan().unsettled);
    }

    #[test]
    fn a_rescan_looks_at_the_files_inotify_named_and_at_every_file_after_an_overflow_a_resync_or_a_while()
     {
        use notify::event::{AccessKind, AccessMode, EventKind, Flag, RemoveKind};
        let guard = tempfile::tempdir().unwrap();
        let dir = std::path::absolute(guard.path()).unwrap();
        let completions = Completions::default();
        let mut source = ManifestDir::with_settle(&dir, Duration::ZERO)
            .unwrap()
            .with_completions(completions.clone());
        let write = |file: &str, name: &str| {
            let path = dir.join(file);
            fs::write(&path, POD.replace("web", name)).unwrap();
            path
        };
        let names = |source: &ManifestDir| {
            let mut names: Vec<String> = source
                .pods()
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            names.sort();
            names
        };
        let a = write("a.yaml", "a");
        assert!(
            source.rescan().changed,
            "the first rescan lists the directory"
        );
        assert_eq!(names(&source), ["a"]);

        // Written, its event not recorded yet: not looked at.
        let b = write("b.yaml", "b");
        assert!(!source.rescan().changed);
        assert_eq!(names(&source), ["a"]);
        let closed = notify::Event::new(EventKind::Access(AccessKind::Close(AccessMode::Write)))
            .add_path(b.clone());
        assert!(completions.record(&closed));
        assert!(source.rescan().changed);
        assert_eq!(names(&source), ["a", "b"]);

        // Removed: the change waits to settle, and the rescan after looks at it
        // again although no event names it then.
        fs::remove_file(&a).unwrap();
        let removed = notify::Event::new(EventKind::Remove(RemoveKind::File)).add_path(a);
        assert!(!completions.record(&removed));
        assert!(source.rescan().unsettled);
        assert_eq!(names(&source), ["a", "b"]);
        assert!(source.rescan().changed);
        assert_eq!(names(&source), ["b"]);

        // The event queue overflowed (IN_Q_OVERFLOW): every file.
        write("c.yaml", "c");
        let overflow = notify::Event::new(EventKind::Other).set_flag(Flag::Rescan);
        assert!(!completions.record(&overflow));
        // Found (no completion known: it settles first), then read.
        assert!(source.rescan().unsettled);
        assert!(source.rescan().changed);
        assert_eq!(names(&source), ["b", "c"]);

        // No event, but a resync.
        write("d.yaml", "d");
        assert!(!source.rescan().changed);
        source.resync();
        assert!(source.rescan().unsettled);
        assert!(source.rescan().changed);
        assert_eq!(names(&source), ["b", "c", "d"]);

        // No event, but the last full rescan is too old.
        write("e.yaml", "e");
        assert!(!source.rescan().changed);
        source.full_scan_at = source.full_scan_at.map(|at| at - FULL_RESCAN_MAX_AGE);
        assert!(source.rescan().unsettled);
        assert!(source.rescan().changed);
        assert_eq!(names(&source), ["b", "c", "d", "e"]);
    }

    #[tokio::test]
    async fn a_config_map_volume_swapping_its_data_is_read_again() {
        use std::os::unix::fs::symlink;
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        // As the kubelet's atomic writer lays out a ConfigMap volume:
        // `pods.yaml -> ..data/pods.yaml`, `..data -> ..v<n>`.
        let version = |n: u32, name: &str| {
            let v = dir.join(format!("..v{n}"));
            fs::create_dir(&v).unwrap();
            fs::write(v.join("pods.yaml"), POD.replace("web", name)).unwrap();
            symlink(format!("..v{n}"), dir.join("..data_tmp")).unwrap();
            fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        };
        version(1, "one");
        symlink("..data/pods.yaml", dir.join("pods.yaml")).unwrap();
        let completions = Completions::default();
        let mut source = ManifestDir::with_settle(dir, Duration::from_millis(10))
            .unwrap()
            .with_completions(completions.clone());
        let (_watcher, mut events) = watch(dir, completions, Default::default()).unwrap();
        source.rescan();
        let name = |source: &ManifestDir| source.pods().next().unwrap().metadata.name.clone();
        assert_eq!(name(&source).as_deref(), Some("one"));

        // No event names `pods.yaml`; the swap of `..data` changes it.
        version(2, "two");
        tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .expect("no inotify event");
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Found changed, then read once it has settled.
        source.rescan();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(source.rescan().changed);
        assert_eq!(name(&source).as_deref(), Some("two"));
    }

    /// A `manifests` directory in a temporary one, watched through real inotify.
    type Watched = (
        tempfile::TempDir,
        PathBuf,
        Completions,
        notify::RecommendedWatcher,
        tokio::sync::mpsc::Receiver<bool>,
    );

    fn watched_dir() -> Watched {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path().join("manifests");
        fs::create_dir(&dir).unwrap();
        let completions = Completions::default();
        let (watcher, events) = watch(&dir, completions.clone(), Default::default()).unwrap();
        (guard, dir, completions, watcher, events)
    }

    #[tokio::test]
    async fn a_manifest_written_and_renamed_into_place_is_all_the_next_rescan_looks_at() {
        let (_guard, dir, completions, _watcher, mut events) = watched_dir();
        let mut source = ManifestDir::new(&dir)
            .unwrap()
            .with_completions(completions);
        source.rescan();
        fs::write(dir.join("pod.partial"), POD).unwrap();
        fs::rename(dir.join("pod.partial"), dir.join("pod.yaml")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .expect("no inotify event");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let scope = source.scope(Instant::now());
        assert_eq!(scope, Some(HashSet::from([dir.join("pod.yaml")])));
    }

    #[tokio::test]
    async fn the_directory_moved_away_makes_the_next_rescan_look_at_every_file() {
        let (guard, dir, completions, _watcher, mut events) = watched_dir();
        assert_eq!(completions.take_changed(), Some(HashSet::new()));
        fs::rename(&dir, guard.path().join("elsewhere")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .expect("no inotify event");
        assert_eq!(completions.take_changed(), None, "every file");
    }

    #[test]
    fn a_file_broken_from_the_start_leaves_the_source_incomplete() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        fs::write(dir.join("bad.yaml"), "kind: [").unwrap();
        let mut source = ManifestDir::new(dir).unwrap();
        assert_eq!(source.rescan().errors.len(), 1);
        assert!(source.incomplete());
    }

    #[test]
    fn files_that_cannot_be_read_are_reported_and_keep_their_objects() {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path();
        let pod = dir.join("pod.yaml");
        fs::write(&pod, POD).unwrap();
        let settle = Duration::from_millis(10);
        let mut source = ManifestDir::with_settle(dir, settle).unwrap();
        assert!(source.rescan().changed);

        // Replaced by a dangling symlink: reported, the pod stays.
        fs::remove_file(&pod).unwrap();
        std::os::unix::fs::symlink(dir.join("missing/pod.yaml"), &pod).unwrap();
        let rescan = source.rescan();
        assert_eq!(rescan.errors.len(), 1, "{rescan:?}");
        assert!(
            rescan.errors[0]
                .problem
                .to_string()
                .contains("cannot be read"),
            "{rescan:?}"
        );
        assert_eq!(source.pods().count(), 1);
        assert!(source.rescan().errors.is_empty(), "reported once");

        // A directory and a FIFO with manifest names, and a file over the limit.
        fs::create_dir(dir.join("dir.yaml")).unwrap();
        nix::unistd::mkfifo(&dir.join("fifo.yaml"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let big = fs::File::create(dir.join("big.yaml")).unwrap();
        big.set_len(MAX_FILE_SIZE + 1).unwrap();
        let mut messages: Vec<String> = Vec::new();
        for _ in 0..2 {
            messages.extend(source.rescan().errors.iter().map(ToString::to_string));
            std::thread::sleep(settle);
        }
        assert!(
            messages
                .iter()
                .any(|m| m.contains("dir.yaml:0: not a regular file")),
            "{messages:?}"
        );
        assert!(
            messages
                .iter()
                .any(|m| m.contains("fifo.yaml:0: not a regular file")),
            "{messages:?}"
        );
        assert!(
            messages
                .iter()
                .any(|m| m.contains("big.yaml:0:") && m.contains("refused")),
            "{messages:?}"
        );
        assert_eq!(source.pods().count(), 1);
    }
}
