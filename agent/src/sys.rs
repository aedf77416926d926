//! The agent's thin layer of raw system calls: every `unsafe` block of the agent
//! outside the eBPF loader's own crate (aya) and the YAML event reader
//! (`source/manifests/parse.rs`) is here, each with the reason it is sound. The
//! rest of the crate is `#![deny(unsafe_code)]`: sockets go through socket2 and
//! nix, whose setters are safe.

#![allow(
    unsafe_code,
    reason = "the agent's one layer of raw libc calls, each with a SAFETY comment"
)]

/// Gives the heap memory freed so far back to the system (malloc_trim(3)), where
/// glibc's allocator is in use; nothing elsewhere.
pub fn release_freed_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes a plain size (the padding to keep) and has no
    // preconditions; it only walks the allocator's own arenas under their locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Sets glibc's `M_ARENA_MAX` to `arenas` (mallopt(3)), where glibc's allocator
/// is in use; nothing elsewhere. Takes effect for arenas made afterwards: call it
/// before any thread starts.
pub fn set_malloc_arena_max(arenas: libc::c_int) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes two plain integers and has no preconditions; an
    // unknown parameter or value is reported by its return value, not undefined.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, arenas);
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = arenas;
}

/// Moves the calling thread alone into a new network namespace
/// (unshare(2), `CLONE_NEWNET`; needs `CAP_SYS_ADMIN`). For tests.
///
/// # Errors
/// The system call's error (`EPERM` without the capability).
#[cfg(test)]
pub(crate) fn unshare_network_namespace() -> std::io::Result<()> {
    // SAFETY: unshare takes a flag word and touches no memory of the caller;
    // CLONE_NEWNET changes only the calling thread's network namespace.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
