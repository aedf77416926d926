//! Running commands and code inside network namespaces, and a registry of what the
//! test bed created so that it can be removed even after a panic or a Ctrl-C.

use std::{
    fs::File,
    io,
    os::fd::AsRawFd,
    process::{Command, Output},
    sync::Mutex,
};

use anyhow::{Context, Result, bail};

/// Something the test bed made that must be undone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resource {
    /// A named network namespace (`/run/netns/<name>`).
    Netns(String),
    /// A mount point (bpffs).
    Mount(std::path::PathBuf),
    /// A directory tree.
    Dir(std::path::PathBuf),
    /// A process to kill.
    Process(u32),
}

static CREATED: Mutex<Vec<Resource>> = Mutex::new(Vec::new());

/// Records a resource for [`cleanup`].
pub fn register(resource: Resource) {
    CREATED.lock().unwrap().push(resource);
}

/// Forgets a resource that was cleaned up normally.
pub fn unregister(resource: &Resource) {
    CREATED.lock().unwrap().retain(|r| r != resource);
}

/// Removes one resource, ignoring errors (it may be gone already).
pub fn remove(resource: &Resource) {
    match resource {
        Resource::Process(pid) => {
            // SAFETY: sending a signal to a pid.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        Resource::Netns(name) => {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
        Resource::Mount(path) => {
            let _ = Command::new("umount").arg("-l").arg(path).output();
        }
        Resource::Dir(path) => {
            let _ = std::fs::remove_dir_all(path);
        }
    }
    unregister(resource);
}

/// Removes everything still registered, newest first (processes, then namespaces,
/// then mounts and directories). Safe to call from a signal-handling thread.
pub fn cleanup() {
    let mut all = std::mem::take(&mut *CREATED.lock().unwrap());
    all.sort_by_key(|r| match r {
        Resource::Process(_) => 0,
        Resource::Netns(_) => 1,
        Resource::Mount(_) => 2,
        Resource::Dir(_) => 3,
    });
    for r in &all {
        remove(r);
    }
}

/// Runs a command, failing with its stderr.
pub fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd
        .output()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// `ip <args>`.
pub fn ip(args: &[&str]) -> Result<Output> {
    run(Command::new("ip").args(args))
}

/// `sysctl -q -w <settings>` inside network namespace `netns` (each setting
/// `key=value`, e.g. `net.ipv6.conf.all.forwarding=1`).
pub fn sysctl(netns: &str, settings: &[&str]) -> Result<()> {
    run(command_in(netns, "sysctl")
        .args(["-q", "-w"])
        .args(settings))
    .map(drop)
}

/// A command run inside network namespace `netns` (`ip netns exec`).
pub fn command_in(netns: &str, program: &str) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns, program]);
    cmd
}

/// Runs `f` on a new thread that has entered network namespace `netns`; sockets it
/// creates belong to that namespace and can be used from any thread afterwards.
pub fn in_netns<T, F>(netns: &str, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> io::Result<T> + Send + 'static,
{
    let file = File::open(format!("/run/netns/{netns}"))?;
    std::thread::spawn(move || {
        // SAFETY: setns on this thread only, with a valid namespace fd.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        f()
    })
    .join()
    .map_err(|_| io::Error::other("thread in network namespace panicked"))?
}

/// Spawns a long-running thread inside network namespace `netns`.
pub fn spawn_in_netns<F>(netns: &str, f: F) -> io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    let file = File::open(format!("/run/netns/{netns}"))?;
    Ok(std::thread::spawn(move || {
        // SAFETY: setns on this thread only, with a valid namespace fd.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            eprintln!(
                "setns into a test namespace failed: {}",
                io::Error::last_os_error()
            );
            return;
        }
        f()
    }))
}
