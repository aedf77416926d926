//! The sysctl journal: which sysctls podlink changed, from what, to what, kept in a
//! file that outlives the agent so that `podlink uninstall` can put them back.
//!
//! The file is `<state-dir>/sysctls.json` (default state directory
//! `/run/podlink`, one per node network namespace), in JSON Lines: a header, then
//! one entry per line. A new entry (or batch of entries) is appended, so a pod's
//! enrollment costs one small write however many pods the node has; a later
//! entry for the same sysctl replaces the earlier one. The file is rewritten (by
//! rename) when entries of gone interfaces are dropped and when it holds the
//! older single-document format (version 1, still read).
//!
//! ```json
//! {"version":2}
//! {"name":"net.ipv4.tcp_early_demux","original":"1","set":"0"}
//! {"name":"net.ipv4.conf.veth1a2b.accept_local","original":"0","set":"1","interface":{"name":"veth1a2b","ifindex":7}}
//! ```
//!
//! A last line cut short (an append interrupted by a crash, or one that failed
//! part way) is ignored: its sysctl was not changed yet. The next change then
//! rewrites the file (by rename) rather than appending after the fragment. An
//! empty file (created but never written before a power loss) holds no entries.
//! Nothing is synced to disk: the default state directory is a tmpfs, whose
//! contents go with the sysctls they describe at a reboot.
//!
//! An entry is written before the sysctl is changed, and only when podlink changes
//! the value; the first original value recorded is kept across agent restarts.
//! Restoring writes `original` back only where the value is still `set` (nobody
//! changed it since) and, for an interface's sysctl, only while the interface with
//! that index still exists.

use crate::error::IoError;
use std::{
    collections::HashMap,
    fs, io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use serde::{Deserialize, Serialize};

use super::error::{Error, Result};

/// Version of the journal file's format: JSON Lines.
const FORMAT_VERSION: u32 = 2;
/// The earlier format, one JSON document `{"version":1,"sysctls":[...]}`: read,
/// and rewritten in the current one at the next change.
const FORMAT_VERSION_DOCUMENT: u32 = 1;
/// The format versions read, for messages.
const KNOWN_VERSIONS: &str = "1 and 2";
/// Name of the journal file in the state directory.
pub const JOURNAL_FILE: &str = "sysctls.json";

/// An interface a sysctl belongs to (`net.ipv4.conf.<name>.*`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interface {
    /// The interface name, as in the sysctl's name.
    pub name: String,
    /// Its index in the node's network namespace when the sysctl was changed.
    pub ifindex: u32,
}

/// One sysctl podlink changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SysctlChange {
    /// Dotted name (`net.ipv4.tcp_early_demux`).
    pub name: String,
    /// The value before podlink changed it.
    pub original: String,
    /// The value podlink set.
    pub set: String,
    /// The interface the sysctl belongs to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<Interface>,
}

#[derive(Debug, Default, Deserialize)]
struct JournalFile {
    version: u32,
    sysctls: Vec<SysctlChange>,
}

/// The first line of the current format.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Header {
    version: u32,
}

/// Entries below which gone interfaces are not looked for.
const PRUNE_MIN_ENTRIES: usize = 64;

/// What this process knows of the file.
#[derive(Debug, Default)]
struct Cache {
    /// The file's entries, once read.
    entries: Option<Vec<SysctlChange>>,
    /// How many entries were left by the last pass over gone interfaces.
    len_after_prune: usize,
    /// The file holds `entries` in the current format: new ones may be appended.
    appendable: bool,
}

/// What restoring did with one entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restored {
    /// The original value was written back.
    Restored(SysctlChange),
    /// Left: the value is no longer podlink's (someone changed it since).
    ChangedSince {
        /// The entry.
        change: SysctlChange,
        /// The value found.
        current: String,
    },
    /// Left: the interface is gone (or its name now belongs to another one).
    InterfaceGone(SysctlChange),
}

/// The journal of one node (one state directory).
#[derive(Clone, Debug)]
pub struct SysctlJournal {
    path: PathBuf,
    proc_sys: PathBuf,
    /// Shared by the clones, which all write the same file.
    cache: Arc<Mutex<Cache>>,
}

impl SysctlJournal {
    /// The journal in `state_dir` (created when the first entry is written), for
    /// the sysctls of the current network namespace (`/proc/sys`).
    pub fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join(JOURNAL_FILE),
            proc_sys: PathBuf::from("/proc/sys"),
            cache: Arc::default(),
        }
    }

    /// The journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn sysctl_path(&self, name: &str) -> PathBuf {
        self.proc_sys.join(name.replace('.', "/"))
    }

    /// Reads a sysctl (trimmed).
    ///
    /// # Errors
    /// When it does not exist or cannot be read.
    pub fn read(&self, name: &str) -> Result<String> {
        Ok(fs::read_to_string(self.sysctl_path(name))
            .map_err(|error| Error::ReadSysctl {
                name: name.to_string(),
                error,
            })?
            .trim()
            .to_string())
    }

    fn write(&self, name: &str, value: &str) -> Result<()> {
        fs::write(self.sysctl_path(name), value).map_err(|error| Error::SetSysctl {
            name: name.to_string(),
            value: value.to_string(),
            error,
        })
    }

    /// The entries recorded so far (none when there is no file).
    ///
    /// # Errors
    /// When the file cannot be read, or is not a journal of a known format (named,
    /// with the line at fault).
    pub fn entries(&self) -> Result<Vec<SysctlChange>> {
        Ok(self.read_file()?.0)
    }

    /// The entries, and whether the file can be appended to: it is in the current
    /// format and ends with a whole line.
    fn read_file(&self) -> Result<(Vec<SysctlChange>, bool)> {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), false)),
            Err(e) => return Err(IoError::at("reading", &self.path)(e).into()),
        };
        if text
            .trim_matches(|c: char| c.is_whitespace() || c == '\0')
            .is_empty()
        {
            return Ok((Vec::new(), false));
        }
        let not_a_journal = |line, error| Error::NotAJournal {
            path: self.path.clone(),
            line,
            error,
        };
        let unknown_version = |version| Error::JournalVersion {
            path: self.path.clone(),
            version,
            known: KNOWN_VERSIONS,
        };
        let first = text.lines().next().unwrap_or_default();
        let Ok(header) = serde_json::from_str::<Header>(first) else {
            let file: JournalFile =
                serde_json::from_str(&text).map_err(|e| not_a_journal(None, e))?;
            if file.version != FORMAT_VERSION_DOCUMENT {
                return Err(unknown_version(file.version));
            }
            return Ok((file.sysctls, false));
        };
        if header.version != FORMAT_VERSION {
            return Err(unknown_version(header.version));
        }
        // Later entries for a sysctl replace earlier ones.
        let mut entries: Vec<Option<SysctlChange>> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let lines: Vec<&str> = text.split('\n').collect();
        for (i, line) in lines.iter().enumerate().skip(1) {
            if line.trim().is_empty() {
                continue;
            }
            let change: SysctlChange = match serde_json::from_str(line) {
                Ok(change) => change,
                // Cut short by a crash while it was appended: not applied yet.
                Err(_) if i == lines.len() - 1 => break,
                Err(e) => return Err(not_a_journal(Some(i + 1), e)),
            };
            if let Some(earlier) = by_name.insert(change.name.clone(), entries.len()) {
                entries[earlier] = None;
            }
            entries.push(Some(change));
        }
        Ok((
            entries.into_iter().flatten().collect(),
            text.ends_with('\n'),
        ))
    }

    /// Rewrites the file with `sysctls` (by rename).
    fn store(&self, sysctls: &[SysctlChange]) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir).map_err(IoError::at("creating", dir))?;
        let mut text = serde_json::to_string(&Header {
            version: FORMAT_VERSION,
        })
        .map_err(|error| Error::Encode { error })?;
        text.push('\n');
        append_lines(&mut text, sysctls)?;
        let tmp = self.path.with_extension("json.partial");
        fs::write(&tmp, text).map_err(IoError::at("writing", &tmp))?;
        fs::rename(&tmp, &self.path).map_err(IoError::at("writing", &self.path))?;
        Ok(())
    }

    /// Appends `sysctls` to the file in one write. Returns false if the file is
    /// gone (it must be written whole).
    fn append(&self, sysctls: &[SysctlChange]) -> Result<bool> {
        use std::io::Write;
        let mut file = match fs::OpenOptions::new().append(true).open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(IoError::at("writing", &self.path)(e).into()),
        };
        let mut text = String::new();
        append_lines(&mut text, sysctls)?;
        file.write_all(text.as_bytes())
            .map_err(IoError::at("writing", &self.path))?;
        Ok(true)
    }

    /// Sets sysctl `name` to `value`, first recording its original value when this
    /// changes it. `interface` names the interface it belongs to.
    /// Returns the value it had.
    ///
    /// # Errors
    /// When the sysctl cannot be read or written, or the journal cannot be written
    /// (then the sysctl is left unchanged).
    pub fn set(&self, name: &str, value: &str, interface: Option<Interface>) -> Result<String> {
        let mut previous = self.set_all(vec![(name.to_string(), value, interface)])?;
        Ok(previous.pop().unwrap_or_default())
    }

    /// [`set`](Self::set) for several sysctls, with one write of the journal.
    /// Returns the values they had, in order.
    ///
    /// The entries are kept in memory after the first read (the agent is the
    /// file's only writer while it runs), so a change costs one write of the file.
    /// Entries of interfaces that are gone are dropped whenever the entries have
    /// doubled since the last such pass (and from 64 entries on), which bounds the
    /// stale ones to about half of the file at an amortised constant cost per
    /// change.
    ///
    /// # Errors
    /// As for [`set`](Self::set); the journal is written before any sysctl.
    pub fn set_all(&self, changes: Vec<(String, &str, Option<Interface>)>) -> Result<Vec<String>> {
        let mut previous = Vec::with_capacity(changes.len());
        let mut pending = Vec::new();
        for (name, value, interface) in changes {
            let current = self.read(&name)?;
            if current != value {
                pending.push((name, value, interface, current.clone()));
            }
            previous.push(current);
        }
        if pending.is_empty() {
            return Ok(previous);
        }
        let mut guard = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let cache = &mut *guard;
        let entries = match &mut cache.entries {
            Some(entries) => entries,
            None => {
                let (entries, appendable) = self.read_file()?;
                cache.appendable = appendable;
                cache.entries.insert(entries)
            }
        };
        let new: Vec<SysctlChange> = pending
            .iter()
            .filter(|(name, value, interface, _)| {
                !entries
                    .iter()
                    .any(|e| e.name == *name && e.interface == *interface && e.set == *value)
            })
            .map(|(name, value, interface, current)| SysctlChange {
                name: name.clone(),
                original: current.clone(),
                set: value.to_string(),
                interface: interface.clone(),
            })
            .collect();
        if !new.is_empty() {
            let names: std::collections::HashSet<String> =
                new.iter().map(|n| n.name.clone()).collect();
            let replaces = |e: &SysctlChange| names.contains(&e.name);
            let after = entries.len() - entries.iter().filter(|e| replaces(e)).count() + new.len();
            let prune = after >= (2 * cache.len_after_prune).max(PRUNE_MIN_ENTRIES);
            let appended = !prune && cache.appendable && {
                // A failed append may leave part of a line: write the file whole
                // from then on.
                let appended = self.append(&new);
                cache.appendable = matches!(appended, Ok(true));
                appended?
            };
            if appended {
                entries.retain(|e| !replaces(e));
                entries.extend(new);
            } else {
                let mut all: Vec<SysctlChange> = entries
                    .iter()
                    .filter(|e| !replaces(e))
                    .cloned()
                    .chain(new)
                    .collect();
                if prune {
                    // Entries of interfaces that are gone are of no more use.
                    all.retain(|e| {
                        e.interface
                            .as_ref()
                            .is_none_or(|i| interface_index(&i.name) == Some(i.ifindex))
                    });
                }
                self.store(&all)?;
                if prune {
                    cache.len_after_prune = all.len();
                }
                *entries = all;
                cache.appendable = true;
            }
        }
        drop(guard);
        for (name, value, _, _) in &pending {
            self.write(name, value)?;
        }
        Ok(previous)
    }

    /// Writes every recorded original value back where the value is still
    /// podlink's, then removes the journal. Idempotent: without a journal there is
    /// nothing to do.
    ///
    /// # Errors
    /// An unreadable journal; a sysctl that cannot be written back (the journal is
    /// then kept, so a second run retries).
    pub fn restore(&self) -> Result<Vec<Restored>> {
        let mut done = Vec::new();
        for change in self.entries()? {
            if let Some(interface) = &change.interface
                && interface_index(&interface.name) != Some(interface.ifindex)
            {
                done.push(Restored::InterfaceGone(change));
                continue;
            }
            let current = match self.read(&change.name) {
                Ok(current) => current,
                Err(_) if change.interface.is_some() => {
                    done.push(Restored::InterfaceGone(change));
                    continue;
                }
                Err(e) => return Err(e),
            };
            if current != change.set {
                done.push(Restored::ChangedSince { change, current });
                continue;
            }
            self.write(&change.name, &change.original)?;
            done.push(Restored::Restored(change));
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        *cache = Cache::default();
        match fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(IoError::at("removing", &self.path)(e).into()),
        }
        Ok(done)
    }
}

/// Writes each of `sysctls` as a line of JSON.
fn append_lines(text: &mut String, sysctls: &[SysctlChange]) -> Result<()> {
    for change in sysctls {
        text.push_str(&serde_json::to_string(change).map_err(|error| Error::Encode { error })?);
        text.push('\n');
    }
    Ok(())
}

fn interface_index(name: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A journal over a fake `/proc/sys` holding `sysctls`.
    fn fake(sysctls: &[(&str, &str)]) -> (tempfile::TempDir, SysctlJournal) {
        let dir = tempfile::tempdir().unwrap();
        let journal = SysctlJournal {
            path: dir.path().join("state").join(JOURNAL_FILE),
            proc_sys: dir.path().join("proc"),
            cache: Arc::default(),
        };
        for (name, value) in sysctls {
            let path = journal.sysctl_path(name);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, format!("{value}\n")).unwrap();
        }
        (dir, journal)
    }

    #[test]
    fn only_changes_are_recorded_and_the_first_original_is_kept() {
        let (_dir, j) = fake(&[
            ("net.ipv4.tcp_early_demux", "1"),
            ("net.ipv4.ip_forward", "1"),
        ]);
        assert_eq!(j.set("net.ipv4.ip_forward", "1", None).unwrap(), "1");
        assert!(!j.path().exists(), "nothing changed, nothing recorded");
        assert_eq!(j.set("net.ipv4.tcp_early_demux", "0", None).unwrap(), "1");
        assert_eq!(j.read("net.ipv4.tcp_early_demux").unwrap(), "0");
        // A restarted agent finds its own value: the original stays 1.
        assert_eq!(j.set("net.ipv4.tcp_early_demux", "0", None).unwrap(), "0");
        let entries = j.entries().unwrap();
        assert_eq!(
            entries,
            vec![SysctlChange {
                name: "net.ipv4.tcp_early_demux".into(),
                original: "1".into(),
                set: "0".into(),
                interface: None,
            }]
        );
    }

    #[test]
    fn restore_puts_back_only_what_is_still_podlinks() {
        let (_dir, j) = fake(&[
            ("net.ipv4.tcp_early_demux", "1"),
            ("net.ipv4.conf.all.rp_filter", "1"),
        ]);
        j.set("net.ipv4.tcp_early_demux", "0", None).unwrap();
        j.set("net.ipv4.conf.all.rp_filter", "2", None).unwrap();
        // Someone else changes rp_filter afterwards.
        j.write("net.ipv4.conf.all.rp_filter", "0").unwrap();
        let done = j.restore().unwrap();
        assert_eq!(done.len(), 2);
        assert!(matches!(&done[0], Restored::Restored(c) if c.name == "net.ipv4.tcp_early_demux"));
        assert!(matches!(&done[1], Restored::ChangedSince { current, .. } if current == "0"));
        assert_eq!(j.read("net.ipv4.tcp_early_demux").unwrap(), "1");
        assert_eq!(j.read("net.ipv4.conf.all.rp_filter").unwrap(), "0");
        assert!(!j.path().exists());
        assert!(
            j.restore().unwrap().is_empty(),
            "a second run has nothing to do"
        );
    }

    #[test]
    fn interface_sysctls_of_gone_interfaces_are_left() {
        let (_dir, j) = fake(&[("net.ipv4.conf.nosuchif0.accept_local", "0")]);
        let gone = Interface {
            name: "nosuchif0".into(),
            ifindex: 4242,
        };
        j.set("net.ipv4.conf.nosuchif0.accept_local", "1", Some(gone))
            .unwrap();
        let done = j.restore().unwrap();
        assert!(
            matches!(&done[..], [Restored::InterfaceGone(_)]),
            "{done:?}"
        );
        assert_eq!(j.read("net.ipv4.conf.nosuchif0.accept_local").unwrap(), "1");
    }

    #[test]
    fn a_batch_is_recorded_and_applied() {
        let (_dir, j) = fake(&[
            ("net.ipv4.conf.lo.rp_filter", "1"),
            ("net.ipv4.conf.lo.accept_local", "0"),
        ]);
        let lo = Interface {
            name: "lo".into(),
            ifindex: 1,
        };
        let previous = j
            .set_all(vec![
                ("net.ipv4.conf.lo.rp_filter".into(), "0", Some(lo.clone())),
                (
                    "net.ipv4.conf.lo.accept_local".into(),
                    "1",
                    Some(lo.clone()),
                ),
            ])
            .unwrap();
        assert_eq!(previous, ["1", "0"]);
        assert_eq!(j.read("net.ipv4.conf.lo.rp_filter").unwrap(), "0");
        assert_eq!(j.read("net.ipv4.conf.lo.accept_local").unwrap(), "1");
        // A second journal over the same file (another process) reads both.
        let other = SysctlJournal {
            cache: Arc::default(),
            ..j.clone()
        };
        let names: Vec<String> = other
            .entries()
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(
            names,
            [
                "net.ipv4.conf.lo.rp_filter",
                "net.ipv4.conf.lo.accept_local"
            ]
        );
    }

    #[test]
    fn gone_interfaces_are_dropped_once_the_entries_double() {
        // 40 sysctls of an interface that exists (lo is 1 in every namespace),
        // then sysctls of interfaces that do not.
        let live: Vec<String> = (0..40).map(|i| format!("net.ipv4.conf.lo.x{i}")).collect();
        let gone: Vec<String> = (0..100)
            .map(|i| format!("net.ipv4.conf.nosuchif{i}.accept_local"))
            .collect();
        let sysctls: Vec<(&str, &str)> = live
            .iter()
            .chain(&gone)
            .map(|n| (n.as_str(), "0"))
            .collect();
        let (_dir, j) = fake(&sysctls);
        let lo = Interface {
            name: "lo".into(),
            ifindex: 1,
        };
        for name in &live {
            j.set(name, "1", Some(lo.clone())).unwrap();
        }
        let mut counts = Vec::new();
        for (i, name) in gone.iter().enumerate() {
            let interface = Interface {
                name: format!("nosuchif{i}"),
                ifindex: 4242,
            };
            j.set(name, "1", Some(interface)).unwrap();
            counts.push(j.entries().unwrap().len());
        }
        // The first pass at 64 entries leaves the 40 live ones; the next waits for
        // twice that, 80.
        assert_eq!(counts[22], 63);
        assert_eq!(counts[23], 40);
        assert_eq!(counts[62], 79);
        assert_eq!(counts[63], 40);
        assert_eq!(counts[99], 76);
        let entries = j.entries().unwrap();
        assert!(live.iter().all(|n| entries.iter().any(|e| &e.name == n)));
    }

    #[test]
    fn nothing_is_changed_when_the_journal_cannot_be_written() {
        let (dir, j) = fake(&[("net.ipv4.conf.lo.rp_filter", "1")]);
        // The state directory is a file: the journal cannot be written.
        fs::write(dir.path().join("state"), "").unwrap();
        let lo = Interface {
            name: "lo".into(),
            ifindex: 1,
        };
        assert!(
            j.set("net.ipv4.conf.lo.rp_filter", "0", Some(lo.clone()))
                .is_err()
        );
        assert_eq!(j.read("net.ipv4.conf.lo.rp_filter").unwrap(), "1");
        // Nor is the failed entry remembered: once writable, it is recorded.
        fs::remove_file(dir.path().join("state")).unwrap();
        j.set("net.ipv4.conf.lo.rp_filter", "0", Some(lo)).unwrap();
        assert_eq!(j.entries().unwrap().len(), 1);
        assert_eq!(j.read("net.ipv4.conf.lo.rp_filter").unwrap(), "0");
    }

    #[test]
    fn changes_are_appended_and_a_later_entry_replaces_an_earlier_one() {
        let (_dir, j) = fake(&[
            ("net.ipv4.tcp_early_demux", "1"),
            ("net.ipv4.conf.lo.rp_filter", "1"),
        ]);
        let lo = |ifindex| Interface {
            name: "lo".into(),
            ifindex,
        };
        j.set("net.ipv4.tcp_early_demux", "0", None).unwrap();
        let first = fs::read_to_string(j.path()).unwrap();
        assert_eq!(first.lines().count(), 2, "{first}");
        j.set("net.ipv4.conf.lo.rp_filter", "0", Some(lo(7)))
            .unwrap();
        // The interface came back under another index: a new entry.
        j.write("net.ipv4.conf.lo.rp_filter", "1").unwrap();
        j.set("net.ipv4.conf.lo.rp_filter", "0", Some(lo(1)))
            .unwrap();
        let text = fs::read_to_string(j.path()).unwrap();
        assert!(text.starts_with(&first), "appended, not rewritten:\n{text}");
        assert_eq!(text.lines().count(), 4, "{text}");
        // Another process reads the last entry of each sysctl.
        let other = SysctlJournal {
            cache: Arc::default(),
            ..j.clone()
        };
        let entries = other.entries().unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
        assert_eq!(entries[1].interface, Some(lo(1)));
        assert_eq!(entries, j.cache.lock().unwrap().entries.clone().unwrap());
    }

    #[test]
    fn a_version_1_journal_is_read_and_rewritten_in_the_current_format() {
        let (_dir, j) = fake(&[
            ("net.ipv4.tcp_early_demux", "0"),
            ("net.ipv4.ip_forward", "0"),
        ]);
        fs::create_dir_all(j.path().parent().unwrap()).unwrap();
        let v1 = r#"{
  "version": 1,
  "sysctls": [
    { "name": "net.ipv4.tcp_early_demux", "original": "1", "set": "0" }
  ]
}
"#;
        fs::write(j.path(), v1).unwrap();
        assert_eq!(j.entries().unwrap().len(), 1);
        j.set("net.ipv4.ip_forward", "1", None).unwrap();
        let text = fs::read_to_string(j.path()).unwrap();
        assert!(text.starts_with("{\"version\":2}\n"), "{text}");
        let names: Vec<String> = j.entries().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["net.ipv4.tcp_early_demux", "net.ipv4.ip_forward"]);
        // What uninstall does with it: the original of each is back.
        j.restore().unwrap();
        assert_eq!(j.read("net.ipv4.tcp_early_demux").unwrap(), "1");
        assert_eq!(j.read("net.ipv4.ip_forward").unwrap(), "0");
    }

    #[test]
    fn a_last_line_cut_short_is_ignored_and_a_bad_line_elsewhere_is_refused() {
        let (_dir, j) = fake(&[]);
        fs::create_dir_all(j.path().parent().unwrap()).unwrap();
        let good = r#"{"name":"net.ipv4.ip_forward","original":"0","set":"1"}"#;
        fs::write(
            j.path(),
            format!("{{\"version\":2}}\n{good}\n{{\"name\":\"net.ipv4.tcp_ea"),
        )
        .unwrap();
        let entries = j.entries().unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].name, "net.ipv4.ip_forward");
        fs::write(
            j.path(),
            format!("{{\"version\":2}}\n{{\"name\":7}}\n{good}\n"),
        )
        .unwrap();
        let error = format!("{:#}", j.entries().unwrap_err());
        assert!(error.contains("line 2"), "{error}");
        fs::write(j.path(), "{\"version\":3}\n").unwrap();
        let error = format!("{:#}", j.entries().unwrap_err());
        assert!(error.contains("format version 3"), "{error}");
    }

    #[test]
    fn after_a_line_cut_short_the_next_change_rewrites_the_file() {
        let (_dir, j) = fake(&[
            ("net.ipv4.tcp_early_demux", "1"),
            ("net.ipv4.ip_forward", "0"),
        ]);
        fs::create_dir_all(j.path().parent().unwrap()).unwrap();
        // A power loss left an empty file: no entries, and a change is recorded.
        fs::write(j.path(), "").unwrap();
        assert_eq!(j.entries().unwrap(), []);
        j.set("net.ipv4.tcp_early_demux", "0", None).unwrap();
        // An append was cut short after it.
        let mut text = fs::read_to_string(j.path()).unwrap();
        text.push_str("{\"name\":\"net.ipv4.conf.lo.rp_f");
        fs::write(j.path(), &text).unwrap();
        let restarted = SysctlJournal {
            cache: Arc::default(),
            ..j.clone()
        };
        restarted.set("net.ipv4.ip_forward", "1", None).unwrap();
        let text = fs::read_to_string(j.path()).unwrap();
        assert!(!text.contains("rp_f"), "the fragment is gone:\n{text}");
        let names: Vec<String> = j.entries().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["net.ipv4.tcp_early_demux", "net.ipv4.ip_forward"]);
        // Appending works again after the rewrite.
        assert!(restarted.cache.lock().unwrap().appendable);
    }

    #[test]
    fn a_foreign_file_is_refused_by_name() {
        let (_dir, j) = fake(&[]);
        fs::create_dir_all(j.path().parent().unwrap()).unwrap();
        fs::write(j.path(), "not json").unwrap();
        let error = format!("{:#}", j.entries().unwrap_err());
        assert!(error.contains(&j.path().display().to_string()), "{error}");
    }
}
