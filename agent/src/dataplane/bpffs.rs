//! Making sure the pin directory is on a BPF filesystem.
//!
//! `ip netns exec` gives its command a private view of `/sys` in which no bpffs is
//! mounted, so an agent started that way mounts one itself. Note that a bpffs
//! mounted inside such a private mount namespace, and every pin in it, goes away
//! with the namespace; the test bed therefore mounts each node's bpffs in the root
//! mount namespace and passes its path as `--pin-dir`.

use crate::error::IoError;
use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use super::error::Result;
use nix::{
    mount::{MsFlags, mount},
    sys::statfs::{BPF_FS_MAGIC, statfs},
};

fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC)
}

/// The mount point of the bpffs that `pin_dir` (or its nearest existing ancestor)
/// is on, if it is on one: the highest ancestor on the same bpffs (same device).
pub fn mount_point(pin_dir: &Path) -> Option<PathBuf> {
    let existing = pin_dir.ancestors().find(|p| p.exists())?;
    if !is_bpffs(existing) {
        return None;
    }
    let dev = std::fs::metadata(existing).ok()?.dev();
    let mut at = existing;
    while let Some(parent) = at.parent()
        && is_bpffs(parent)
        && std::fs::metadata(parent).is_ok_and(|m| m.dev() == dev)
    {
        at = parent;
    }
    Some(at.to_path_buf())
}

/// Whether the kernel has the BPF filesystem: `/proc/filesystems` lists `bpf`
/// (`nodev\tbpf`).
pub fn kernel_has_bpffs() -> bool {
    std::fs::read_to_string("/proc/filesystems").is_ok_and(|s| {
        s.lines()
            .any(|line| line.split_whitespace().last() == Some("bpf"))
    })
}

/// Whether this process's mount namespace differs from init's.
fn in_private_mount_namespace() -> bool {
    match (
        std::fs::read_link("/proc/self/ns/mnt"),
        std::fs::read_link("/proc/1/ns/mnt"),
    ) {
        (Ok(own), Ok(init)) => own != init,
        _ => false,
    }
}

/// Ensures `pin_dir` exists on a bpffs: if its nearest existing ancestor is not on
/// one, a bpffs is mounted at `/sys/fs/bpf` (when `pin_dir` is below it) or at
/// `pin_dir` itself.
///
/// # Errors
/// When the directory cannot be created or the mount fails (needs
/// `CAP_SYS_ADMIN`).
pub fn ensure(pin_dir: &Path) -> Result<()> {
    let existing = pin_dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    if !is_bpffs(existing) {
        let sys_fs_bpf = Path::new("/sys/fs/bpf");
        let target = if pin_dir.starts_with(sys_fs_bpf) && sys_fs_bpf.is_dir() {
            sys_fs_bpf
        } else {
            std::fs::create_dir_all(pin_dir).map_err(IoError::at("creating", pin_dir))?;
            pin_dir
        };
        mount(
            Some("bpf"),
            target,
            Some("bpf"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=0700"),
        )
        .map_err(|e| IoError::at("mounting a bpffs at", target)(e.into()))?;
        tracing::info!(path = %target.display(), "mounted a bpffs");
        if in_private_mount_namespace() {
            tracing::warn!(
                path = %target.display(),
                "the bpffs was mounted in this agent's own mount namespace (as `ip netns exec` makes one): its pins, and with them capture, end when the agent exits; mount a bpffs shared with the host at the pin directory to keep pods captured (fail closed) across restarts"
            );
        }
    }
    std::fs::create_dir_all(pin_dir).map_err(IoError::at("creating", pin_dir))?;
    Ok(())
}
