//! The pin layout and its versions.
//!
//! Pins live under `<pin-dir>/v<N>/`, `N` being [`LAYOUT_VERSION`]:
//! * `v<N>/<map>` for each map in [`MAP_NAMES`];
//! * `v<N>/links/<ifindex>_<program>` for each TCX link.
//!
//! Earlier layouts are migrated by renaming pins on the bpffs (`rename(2)`; the
//! map or link object is the same, so pods' entries carry over and every link
//! stays attached), then the links are adopted as after any restart. A map whose
//! layout changed cannot be renamed: it stays until the agent has loaded its
//! programs (with a new map) and copied its entries over (see [`super::layout`]),
//! then goes with its directory ([`finish_migration`]):
//! * the layout before versions (issue 2) had version 1's maps and links directly
//!   under `<pin-dir>`;
//! * version 1 ([`OLDEST_LAYOUT_VERSION`]) differs from version 2 in the value of
//!   `captured_flows` (a `u8`, since the host veth's ifindex);
//! * version 2 differs from version 3 in the value of `pod_counters` (14
//!   counters, since 13: `dropped_ipv6` went when IPv6 TCP was captured);
//! * version 3 ([`podlink_common::PREVIOUS_LAYOUT_VERSION`]) differs from
//!   version 4 in the value of `pod_counters` (13 counters, since 14:
//!   `captured_dns` came last, when DNS got a counter of its own).
//!
//! Old counters are copied field by field, so that the counters `podlink
//! inspect` and the metrics show go on from where they were.
//!
//! Each step is idempotent: an agent stopped halfway finishes the move on its next
//! start. A `v<M>` of any other version makes the agent refuse to start: it cannot
//! know that layout.
//!
//! The pin directory itself is locked (`flock(2)` on the directory) by the agent
//! using it, so that `podlink uninstall` can tell that one is running.

use crate::error::IoError;
use std::{
    fs::{self, File},
    io,
    path::{Path, PathBuf},
};

use nix::fcntl::{Flock, FlockArg};
use podlink_common::{
    LAYOUT_VERSION, LINKS_DIR, MAP_CAPTURED_FLOWS, MAP_COUNTERS, MAP_NAMES, OLDEST_LAYOUT_VERSION,
};

use super::{
    Program,
    error::{Error, Result},
    layout::{check_pinned_layouts, same_layout},
};

/// The layout of the pins of the first agents, directly under the pin directory:
/// version 1's maps and links.
pub const UNVERSIONED_LAYOUT: u32 = 1;

/// The directory of this agent's layout: `<pin_dir>/v<LAYOUT_VERSION>`.
pub fn versioned_dir(pin_dir: &Path) -> PathBuf {
    layout_dir(pin_dir, LAYOUT_VERSION)
}

/// The directory of layout `version`: `<pin_dir>/v<version>`.
pub fn layout_dir(pin_dir: &Path, version: u32) -> PathBuf {
    pin_dir.join(format!("v{version}"))
}

/// Whether this podlink knows layout `version`: its own, and the earlier ones
/// (from [`OLDEST_LAYOUT_VERSION`]), which it migrates.
pub fn is_known_version(version: u32) -> bool {
    (OLDEST_LAYOUT_VERSION..=LAYOUT_VERSION).contains(&version)
}

/// A layout found under the pin directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundLayout {
    /// Where its maps and `links` are: `v<N>`, or the pin directory itself.
    pub dir: PathBuf,
    /// The version of its maps' layouts.
    pub version: u32,
    /// What it is, for messages: "pin layout version 1", "the unversioned pin
    /// layout" (empty for this agent's own).
    pub what: String,
}

/// The earlier layouts in `contents`, in the order they are migrated and read:
/// the newest version first, the unversioned layout last, so that where two pin
/// the same map or link, the newer one's is kept.
pub fn earlier_layouts(pin_dir: &Path, contents: &PinDirContents) -> Vec<FoundLayout> {
    let mut earlier = Vec::new();
    for &version in contents.versions.iter().rev() {
        if version < LAYOUT_VERSION && is_known_version(version) {
            earlier.push(FoundLayout {
                dir: layout_dir(pin_dir, version),
                version,
                what: format!("pin layout version {version}"),
            });
        }
    }
    if contents.legacy {
        earlier.push(FoundLayout {
            dir: pin_dir.to_path_buf(),
            version: UNVERSIONED_LAYOUT,
            what: "the unversioned pin layout".into(),
        });
    }
    earlier
}

/// The pin name of a TCX link: `<ifindex>_<program>`.
pub fn link_pin_name(ifindex: u32, program: Program) -> String {
    format!("{ifindex}_{program}")
}

/// The interface index and program of a link pin name, if it is one of podlink's
/// (`7_from_pod` → `(7, Program::FromPod)`).
pub fn parse_link_pin_name(name: &str) -> Option<(u32, Program)> {
    let (ifindex, program) = name.split_once('_')?;
    let program = Program::from_name(program)?;
    Some((ifindex.parse().ok()?, program))
}

/// The version of a layout directory name (`v1` → 1).
fn parse_version(name: &str) -> Option<u32> {
    let digits = name.strip_prefix('v')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// What a pin directory holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PinDirContents {
    /// Versions of the `v<N>` directories, ascending.
    pub versions: Vec<u32>,
    /// Whether maps or the `links` directory of the unversioned layout are there.
    pub legacy: bool,
}

/// Lists the layouts under `pin_dir` (nothing when it does not exist).
///
/// # Errors
/// When the directory cannot be read.
pub fn survey(pin_dir: &Path) -> Result<PinDirContents> {
    let mut contents = PinDirContents::default();
    let entries = match fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(contents),
        Err(e) => return Err(IoError::at("reading", pin_dir)(e).into()),
    };
    for entry in entries {
        let entry = entry.map_err(IoError::at("reading", pin_dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(version) = parse_version(&name) {
            contents.versions.push(version);
        } else if name == LINKS_DIR || MAP_NAMES.contains(&name.as_ref()) {
            contents.legacy = true;
        }
    }
    contents.versions.sort_unstable();
    Ok(contents)
}

/// Refuses layouts this podlink does not know: any `v<M>` other than its own and
/// the earlier ones it migrates (the agent before it changes anything, `podlink inspect`
/// before it reads).
///
/// # Errors
/// Names the unknown layout's directory and what to do about it.
pub(crate) fn refuse_other_versions(pin_dir: &Path, contents: &PinDirContents) -> Result<()> {
    if let Some(&other) = contents.versions.iter().find(|v| !is_known_version(**v)) {
        return Err(Error::UnknownLayout {
            dir: layout_dir(pin_dir, other),
            version: other,
        });
    }
    Ok(())
}

/// This agent's layout directory, ready, and what is left of an earlier layout's
/// migration.
#[derive(Debug)]
pub(super) struct Prepared {
    /// `<pin_dir>/v<LAYOUT_VERSION>`, with its `links` directory.
    pub dir: PathBuf,
    /// Whether an earlier layout was found (and its pins moved): the migration is
    /// to be ended with [`finish_migration`].
    pub migrated: bool,
    /// The `captured_flows` maps of earlier layouts (version 1's, the unversioned
    /// layout's), whose flows are to be copied into this layout's map once the
    /// programs are loaded, before [`finish_migration`] removes them.
    pub old_flows: Vec<PathBuf>,
    /// The `pod_counters` maps of earlier layouts (versions 1 to 3, the
    /// unversioned layout) with their layout versions, newest first, whose
    /// counters are to be copied into this layout's map, likewise.
    pub old_counters: Vec<(PathBuf, u32)>,
}

/// Makes `<pin_dir>/v<N>/links` ready for this agent: refuses unknown versions and
/// moves earlier versions' and the unversioned layout's pins into it, but for the
/// maps whose layout changed since (see [`Prepared::old_flows`] and
/// [`Prepared::old_counters`]). Nothing is made or moved
/// unless this layout's maps and every earlier layout's are as expected.
///
/// # Errors
/// A pin directory of an unknown layout version, earlier maps of an unexpected
/// layout, or a failed rename or directory creation.
pub(super) fn prepare(pin_dir: &Path) -> Result<Prepared> {
    let contents = survey(pin_dir)?;
    refuse_other_versions(pin_dir, &contents)?;
    let earlier = earlier_layouts(pin_dir, &contents);
    let dir = versioned_dir(pin_dir);
    // Before anything moves: a migration keeps this layout's maps over earlier
    // ones of the same name, and the programs reuse them.
    check_pinned_layouts(&dir, LAYOUT_VERSION)?;
    for layout in &earlier {
        check_pinned_layouts(&layout.dir, layout.version).map_err(|e| Error::Migrate {
            layout: layout.what.clone(),
            error: Box::new(e),
        })?;
    }
    let links = dir.join(LINKS_DIR);
    fs::create_dir_all(&links).map_err(IoError::at("creating", &links))?;
    let (mut old_flows, mut old_counters) = (Vec::new(), Vec::new());
    for layout in &earlier {
        migrate(layout, &dir)?;
        let changed = |name| {
            let path = layout.dir.join(name);
            (!same_layout(name, layout.version) && path.exists()).then_some(path)
        };
        old_flows.extend(changed(MAP_CAPTURED_FLOWS));
        old_counters.extend(changed(MAP_COUNTERS).map(|path| (path, layout.version)));
    }
    Ok(Prepared {
        dir,
        migrated: !earlier.is_empty(),
        old_flows,
        old_counters,
    })
}

/// Moves the pins of an earlier layout (checked by [`prepare`]) into `dir`, but
/// for the maps whose layout changed since. Each step is a rename, and a pin
/// already in `dir` is kept (the old one removed), so that the move is idempotent.
fn migrate(layout: &FoundLayout, dir: &Path) -> Result<()> {
    let from = &layout.dir;
    let mut moved = 0;
    for name in MAP_NAMES
        .into_iter()
        .filter(|n| same_layout(n, layout.version))
    {
        let (old, new) = (from.join(name), dir.join(name));
        if !old.exists() {
            continue;
        }
        if new.exists() {
            // A map this layout already has (an earlier move): it stays.
            fs::remove_file(&old).map_err(IoError::at("removing", &old))?;
        } else {
            rename(&old, &new)?;
            moved += 1;
        }
    }
    let old_links = from.join(LINKS_DIR);
    if old_links.is_dir() {
        for entry in fs::read_dir(&old_links).map_err(IoError::at("reading", &old_links))? {
            let old = entry.map_err(IoError::at("reading", &old_links))?.path();
            let Some(name) = old.file_name() else {
                continue;
            };
            let new = dir.join(LINKS_DIR).join(name);
            if new.exists() {
                // A second link on the same hook: the one in this layout stays.
                let _ = fs::remove_file(&old);
            } else {
                rename(&old, &new)?;
                moved += 1;
            }
        }
        fs::remove_dir(&old_links).map_err(IoError::at("removing", &old_links))?;
    }
    tracing::info!(
        from = %from.display(),
        to = %dir.display(),
        pins = moved,
        "migrated {} to layout version {LAYOUT_VERSION}",
        layout.what
    );
    Ok(())
}

/// Renames the pin `from` to `to`.
fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(|error| Error::Rename {
        from: from.to_path_buf(),
        to: to.to_path_buf(),
        error,
    })
}

/// Ends a migration ([`Prepared::migrated`]) once the maps of `old` (the old
/// flows and counters) are copied: removes those pins, and the earlier versions'
/// directories when nothing else is left in them (what podlink does not name
/// stays, and so does its directory).
///
/// # Errors
/// A pin that cannot be removed.
pub(super) fn finish_migration(pin_dir: &Path, old: &[PathBuf]) -> Result<()> {
    for map in old {
        fs::remove_file(map).map_err(IoError::at("removing", map))?;
    }
    for version in OLDEST_LAYOUT_VERSION..LAYOUT_VERSION {
        let earlier = layout_dir(pin_dir, version);
        if earlier.is_dir() {
            // Fails, and leaves it, when something else is still in it.
            let _ = fs::remove_dir(&earlier);
        }
    }
    Ok(())
}

/// Takes the exclusive lock of `pin_dir` (which must exist), held as long as the
/// returned value lives.
///
/// # Errors
/// When another process holds it (an agent running on this pin directory), naming
/// the directory; or when the directory cannot be opened.
pub fn lock(pin_dir: &Path) -> Result<Flock<File>> {
    let dir = File::open(pin_dir).map_err(IoError::at("opening", pin_dir))?;
    match Flock::lock(dir, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(Error::PinDirLocked {
            pin_dir: pin_dir.to_path_buf(),
        }),
        Err((_, e)) => Err(IoError::at("locking", pin_dir)(e.into()).into()),
    }
}

/// Removes every pin podlink makes under `pin_dir`, of any layout version: link
/// pins first (a TCX link is detached when its last reference, the pin, goes), then
/// map pins, then the directories, `pin_dir` itself last when it ends up empty.
/// Entries podlink does not name (`v<N>`, `links`, map names) are left alone.
/// Returns what was removed. Idempotent.
///
/// # Errors
/// A pin or directory that cannot be removed.
pub fn remove_all(pin_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let contents = survey(pin_dir)?;
    let mut roots: Vec<PathBuf> = contents
        .versions
        .iter()
        .map(|v| layout_dir(pin_dir, *v))
        .collect();
    if contents.legacy {
        roots.push(pin_dir.to_path_buf());
    }
    for root in &roots {
        let links = root.join(LINKS_DIR);
        if links.is_dir() {
            remove_tree(&links, &mut removed)?;
        }
    }
    for root in &roots {
        if root == pin_dir {
            for name in MAP_NAMES {
                let path = pin_dir.join(name);
                if path.exists() {
                    fs::remove_file(&path).map_err(IoError::at("removing", &path))?;
                    removed.push(path);
                }
            }
        } else {
            remove_tree(root, &mut removed)?;
        }
    }
    if pin_dir.is_dir()
        && fs::read_dir(pin_dir)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false)
    {
        // A mount point cannot be removed; it stays, empty.
        if fs::remove_dir(pin_dir).is_ok() {
            removed.push(pin_dir.to_path_buf());
        }
    }
    Ok(removed)
}

/// Removes a directory of podlink's pins and everything in it.
fn remove_tree(dir: &Path, removed: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(IoError::at("reading", dir))? {
        let path = entry.map_err(IoError::at("reading", dir))?.path();
        if path.is_dir() {
            remove_tree(&path, removed)?;
        } else {
            fs::remove_file(&path).map_err(IoError::at("removing", &path))?;
            removed.push(path);
        }
    }
    fs::remove_dir(dir).map_err(IoError::at("removing", dir))?;
    removed.push(dir.to_path_buf());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use podlink_common::PREVIOUS_LAYOUT_VERSION;

    #[test]
    fn link_pin_names_round_trip() {
        assert_eq!(link_pin_name(7, Program::FromPod), "7_from_pod");
        assert_eq!(
            parse_link_pin_name("7_from_pod"),
            Some((7, Program::FromPod))
        );
        assert_eq!(parse_link_pin_name("12_to_pod"), Some((12, Program::ToPod)));
        assert_eq!(parse_link_pin_name("x_to_pod"), None);
        assert_eq!(parse_link_pin_name("7_other"), None);
    }

    #[test]
    fn version_names() {
        assert_eq!(parse_version("v1"), Some(1));
        assert_eq!(parse_version("v12"), Some(12));
        assert_eq!(parse_version("v"), None);
        assert_eq!(parse_version("v1a"), None);
        assert_eq!(parse_version("links"), None);
    }

    #[test]
    fn survey_tells_versions_from_the_unversioned_layout() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            survey(&dir.path().join("absent")).unwrap(),
            Default::default()
        );
        fs::create_dir(dir.path().join("v1")).unwrap();
        fs::create_dir(dir.path().join("other")).unwrap();
        assert_eq!(
            survey(dir.path()).unwrap(),
            PinDirContents {
                versions: vec![1],
                legacy: false
            }
        );
        fs::write(dir.path().join("pods"), "").unwrap();
        assert!(survey(dir.path()).unwrap().legacy);
    }

    #[test]
    fn a_newer_layout_is_refused_naming_path_and_versions() {
        let dir = tempfile::tempdir().unwrap();
        let newer = LAYOUT_VERSION + 1;
        fs::create_dir(dir.path().join(format!("v{newer}"))).unwrap();
        let error = format!("{:#}", prepare(dir.path()).unwrap_err());
        let path = dir.path().join(format!("v{newer}"));
        assert!(error.contains(&path.display().to_string()), "{error}");
        assert!(
            error.contains(&format!("layout version {newer}")),
            "{error}"
        );
        assert!(
            error.contains(&format!("layout version is {LAYOUT_VERSION}")),
            "{error}"
        );
        assert!(error.contains("newer podlink"), "{error}");
        // Nothing was made beside it.
        assert!(!versioned_dir(dir.path()).exists());
    }

    #[test]
    fn the_previous_layout_is_taken_and_an_older_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let previous = dir.path().join(format!("v{PREVIOUS_LAYOUT_VERSION}"));
        fs::create_dir_all(previous.join(LINKS_DIR)).unwrap();
        let prepared = prepare(dir.path()).unwrap();
        assert_eq!(prepared.dir, versioned_dir(dir.path()));
        assert!(prepared.dir.join(LINKS_DIR).is_dir());
        assert!(
            prepared.migrated,
            "an empty v1 is an earlier layout to finish"
        );
        assert!(prepared.old_flows.is_empty());
        // Its emptied links directory went; the directory itself goes once the
        // flows are carried.
        assert!(!previous.join(LINKS_DIR).exists());
        finish_migration(dir.path(), &prepared.old_flows).unwrap();
        assert!(!previous.exists());

        let older = dir.path().join("v0");
        fs::create_dir(&older).unwrap();
        let error = format!("{:#}", prepare(dir.path()).unwrap_err());
        assert!(error.contains(&older.display().to_string()), "{error}");
        assert!(error.contains("no migration from it"), "{error}");
    }

    #[test]
    fn earlier_layouts_are_taken_newest_first() {
        let dir = Path::new("/pins");
        let all = PinDirContents {
            versions: vec![
                OLDEST_LAYOUT_VERSION,
                PREVIOUS_LAYOUT_VERSION,
                LAYOUT_VERSION,
            ],
            legacy: true,
        };
        let found: Vec<(PathBuf, u32)> = earlier_layouts(dir, &all)
            .into_iter()
            .map(|l| (l.dir, l.version))
            .collect();
        assert_eq!(
            found,
            [
                (
                    layout_dir(dir, PREVIOUS_LAYOUT_VERSION),
                    PREVIOUS_LAYOUT_VERSION
                ),
                (
                    layout_dir(dir, OLDEST_LAYOUT_VERSION),
                    OLDEST_LAYOUT_VERSION
                ),
                (dir.to_path_buf(), UNVERSIONED_LAYOUT)
            ]
        );
        let current = PinDirContents {
            versions: vec![LAYOUT_VERSION],
            legacy: false,
        };
        assert!(earlier_layouts(dir, &current).is_empty());
    }

    #[test]
    fn every_earlier_version_is_known_and_migrated() {
        assert!((OLDEST_LAYOUT_VERSION..=LAYOUT_VERSION).all(is_known_version));
        assert!(!is_known_version(0));
        assert!(!is_known_version(LAYOUT_VERSION + 1));
        let dir = tempfile::tempdir().unwrap();
        for version in OLDEST_LAYOUT_VERSION..LAYOUT_VERSION {
            fs::create_dir_all(layout_dir(dir.path(), version).join(LINKS_DIR)).unwrap();
        }
        let prepared = prepare(dir.path()).unwrap();
        assert!(prepared.migrated);
        assert!(prepared.old_flows.is_empty() && prepared.old_counters.is_empty());
        finish_migration(dir.path(), &[]).unwrap();
        for version in OLDEST_LAYOUT_VERSION..LAYOUT_VERSION {
            assert!(!layout_dir(dir.path(), version).exists(), "v{version} left");
        }
        assert!(versioned_dir(dir.path()).join(LINKS_DIR).is_dir());
    }

    #[test]
    fn removal_leaves_what_podlink_does_not_name() {
        let dir = tempfile::tempdir().unwrap();
        let current = versioned_dir(dir.path());
        fs::create_dir_all(current.join(LINKS_DIR)).unwrap();
        fs::write(current.join(LINKS_DIR).join("7_from_pod"), "").unwrap();
        fs::write(current.join("pods"), "").unwrap();
        fs::write(dir.path().join("pods"), "").unwrap();
        fs::write(dir.path().join("someone_elses"), "").unwrap();
        let removed = remove_all(dir.path()).unwrap();
        assert!(removed.contains(&current.join(LINKS_DIR).join("7_from_pod")));
        assert!(removed.contains(&dir.path().join("pods")));
        assert!(!current.exists());
        assert!(dir.path().join("someone_elses").exists());
        assert!(remove_all(dir.path()).unwrap().is_empty());
        fs::remove_file(dir.path().join("someone_elses")).unwrap();
        assert_eq!(
            remove_all(dir.path()).unwrap(),
            vec![dir.path().to_path_buf()]
        );
    }
}
