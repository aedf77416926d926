//! The sysctl journal: which sysctls podlink changed, from what, to what, kept in a
//! file that outlives the agent so that `podlink uninstall` can put them back.
//!
//! The file is `<state-dir>/sysctls.json` (default state directory
//! `/run/podlink`, one per node network namespace), rewritten by rename on every
//! new entry:
//!
//! ```json
//! {
//!   "version": 1,
//!   "sysctls": [
//!     { "name": "net.ipv4.tcp_early_demux", "original": "1", "set": "0" },
//!     { "name": "net.ipv4.conf.veth1a2b.accept_local", "original": "0", "set": "1",
//!       "interface": { "name": "veth1a2b", "ifindex": 7 } }
//!   ]
//! }
//! ```
//!
//! An entry is written before the sysctl is changed, and only when podlink changes
//! the value; the first original value recorded is kept across agent restarts.
//! Restoring writes `original` back only where the value is still `set` (nobody
//! changed it since) and, for an interface's sysctl, only while the interface with
//! that index still exists.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// Version of the journal file's format.
const FORMAT_VERSION: u32 = 1;
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

#[derive(Debug, Default, Serialize, Deserialize)]
struct JournalFile {
    version: u32,
    sysctls: Vec<SysctlChange>,
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
}

impl SysctlJournal {
    /// The journal in `state_dir` (created when the first entry is written), for
    /// the sysctls of the current network namespace (`/proc/sys`).
    pub fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join(JOURNAL_FILE),
            proc_sys: PathBuf::from("/proc/sys"),
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
            .with_context(|| format!("reading {name}"))?
            .trim()
            .to_string())
    }

    fn write(&self, name: &str, value: &str) -> Result<()> {
        fs::write(self.sysctl_path(name), value).with_context(|| format!("setting {name}={value}"))
    }

    /// The entries recorded so far (none when there is no file).
    ///
    /// # Errors
    /// When the file cannot be read, or is not a journal of a known format (named).
    pub fn entries(&self) -> Result<Vec<SysctlChange>> {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", self.path.display())),
        };
        let file: JournalFile = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a sysctl journal", self.path.display()))?;
        if file.version != FORMAT_VERSION {
            bail!(
                "{} has format version {}, this podlink knows {FORMAT_VERSION}",
                self.path.display(),
                file.version
            );
        }
        Ok(file.sysctls)
    }

    fn store(&self, sysctls: Vec<SysctlChange>) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let text = serde_json::to_string_pretty(&JournalFile {
            version: FORMAT_VERSION,
            sysctls,
        })?;
        let tmp = self.path.with_extension("json.partial");
        fs::write(&tmp, text + "\n").with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, &self.path).with_context(|| format!("writing {}", self.path.display()))
    }

    /// Sets sysctl `name` to `value`, first recording its original value when this
    /// changes it. `interface` names the interface it belongs to.
    /// Returns the value it had.
    ///
    /// # Errors
    /// When the sysctl cannot be read or written, or the journal cannot be written
    /// (then the sysctl is left unchanged).
    pub fn set(&self, name: &str, value: &str, interface: Option<Interface>) -> Result<String> {
        let previous = self.read(name)?;
        if previous == value {
            return Ok(previous);
        }
        let mut entries = self.entries()?;
        let known = entries
            .iter()
            .any(|e| e.name == name && e.interface == interface && e.set == value);
        if !known {
            entries.retain(|e| e.name != name);
            // Entries of interfaces that are gone are of no more use.
            entries.retain(|e| {
                e.interface
                    .as_ref()
                    .is_none_or(|i| interface_index(&i.name) == Some(i.ifindex))
            });
            entries.push(SysctlChange {
                name: name.to_string(),
                original: previous.clone(),
                set: value.to_string(),
                interface,
            });
            self.store(entries)?;
        }
        self.write(name, value)?;
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
        match fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", self.path.display())),
        }
        Ok(done)
    }
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
    fn a_foreign_file_is_refused_by_name() {
        let (_dir, j) = fake(&[]);
        fs::create_dir_all(j.path().parent().unwrap()).unwrap();
        fs::write(j.path(), "not json").unwrap();
        let error = format!("{:#}", j.entries().unwrap_err());
        assert!(error.contains(&j.path().display().to_string()), "{error}");
    }
}
