//! The record of the `clsact` qdiscs podlink added to host veths for its
//! `cls_bpf` filters ([`super::tc`]), kept in the state directory so that
//! `podlink uninstall` deletes those and no others: a `clsact` qdisc that was
//! there before podlink belongs to someone else and stays.
//!
//! One file per interface, `<state-dir>/clsact/<ifindex>`, holding the interface's
//! name: written once the qdisc is added (an agent stopped in between leaves a
//! qdisc the record does not name, which uninstall leaves in place, rather than a
//! record of a qdisc someone else added). An entry names its interface only while
//! an interface with that name has that index: a pod's host veth goes with its
//! qdisc when the pod is deleted, and its index may be given to another
//! interface. Entries of interfaces that are gone are dropped when the agent
//! starts and when it detaches a pod whose interface is gone.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use crate::error::IoError;

use super::error::Result;

/// The record's directory in the state directory.
pub const RECORD_DIR: &str = "clsact";

/// One recorded qdisc: the interface's index and its name when the qdisc was
/// added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Added {
    /// The interface's index.
    pub ifindex: u32,
    /// Its name then.
    pub name: String,
}

impl Added {
    /// Whether the interface is still there: its name has its index.
    pub fn exists(&self) -> bool {
        nix::net::if_::if_nametoindex(self.name.as_str()).ok() == Some(self.ifindex)
    }
}

/// The record of one node (one state directory).
#[derive(Clone, Debug)]
pub struct ClsactRecord {
    dir: PathBuf,
}

impl ClsactRecord {
    /// The record in `state_dir` (made when the first entry is written).
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(RECORD_DIR),
        }
    }

    /// The record's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records that podlink added a `clsact` qdisc to interface `ifindex`, named
    /// `name`.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn add(&self, ifindex: u32, name: &str) -> Result<()> {
        fs::create_dir_all(&self.dir).map_err(IoError::at("creating", &self.dir))?;
        let path = self.dir.join(ifindex.to_string());
        fs::write(&path, name).map_err(IoError::at("writing", &path))?;
        Ok(())
    }

    /// Forgets interface `ifindex`'s entry, if any.
    ///
    /// # Errors
    /// When the file exists but cannot be removed.
    pub fn remove(&self, ifindex: u32) -> Result<()> {
        let path = self.dir.join(ifindex.to_string());
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IoError::at("removing", &path)(e).into()),
        }
    }

    /// The entries, by interface index; files that are not entries are skipped.
    /// None without a record.
    ///
    /// # Errors
    /// When the directory or an entry cannot be read.
    pub fn entries(&self) -> Result<Vec<Added>> {
        let listing = match fs::read_dir(&self.dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(IoError::at("reading", &self.dir)(e).into()),
        };
        let mut entries = Vec::new();
        for entry in listing {
            let path = entry.map_err(IoError::at("reading", &self.dir))?.path();
            let Some(ifindex) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let name = fs::read_to_string(&path).map_err(IoError::at("reading", &path))?;
            entries.push(Added {
                ifindex,
                name: name.trim().to_string(),
            });
        }
        entries.sort_by_key(|a| a.ifindex);
        Ok(entries)
    }

    /// Drops the entries whose interface is gone ([`Added::exists`]); returns how
    /// many.
    ///
    /// # Errors
    /// When the record cannot be read or an entry removed.
    pub fn prune(&self) -> Result<usize> {
        let mut dropped = 0;
        for added in self.entries()? {
            if !added.exists() {
                self.remove(added.ifindex)?;
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// Removes the record's directory once empty (`podlink uninstall`).
    ///
    /// # Errors
    /// When it cannot be removed for another reason than being absent.
    pub fn remove_dir(&self) -> Result<()> {
        match fs::remove_dir(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IoError::at("removing", &self.dir)(e).into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_their_interfaces_until_they_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let record = ClsactRecord::new(&dir.path().join("state"));
        assert_eq!(record.entries().unwrap(), []);
        let lo = nix::net::if_::if_nametoindex("lo").unwrap();
        record.add(lo, "lo").unwrap();
        // An index no interface has (the pod's veth was deleted).
        record.add(999_999, "veth0gone").unwrap();
        // Not an entry: left alone.
        fs::write(record.dir().join("notes"), "x").unwrap();
        let entries = record.entries().unwrap();
        assert_eq!(
            entries,
            [
                Added {
                    ifindex: lo,
                    name: "lo".into()
                },
                Added {
                    ifindex: 999_999,
                    name: "veth0gone".into()
                }
            ]
        );
        assert!(entries[0].exists() && !entries[1].exists());
        // Another name at a recorded index is another interface.
        assert!(
            !Added {
                ifindex: lo,
                name: "eth9".into()
            }
            .exists()
        );
        assert_eq!(record.prune().unwrap(), 1);
        assert_eq!(record.entries().unwrap().len(), 1);
        record.remove(lo).unwrap();
        record.remove(lo).unwrap();
        fs::remove_file(record.dir().join("notes")).unwrap();
        record.remove_dir().unwrap();
        record.remove_dir().unwrap();
        assert!(!record.dir().exists());
    }
}
