//! The agent's thin layer of raw system and C library calls: every `unsafe`
//! block of the agent outside the eBPF loader's own crate (aya) is here, each
//! with the reason it is sound. The
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

/// Fixes glibc's `M_MMAP_THRESHOLD` at `mmap_bytes` and `M_TRIM_THRESHOLD` at
/// `trim_bytes` (mallopt(3)), where glibc's allocator is in use; nothing
/// elsewhere. Setting them turns off glibc's dynamic thresholds: otherwise
/// freeing one large block (a config dump of a big cluster, a list's buffer)
/// raises the mmap threshold to that block's size, and blocks below it come
/// from the heap, where they stay resident once freed.
pub fn set_malloc_thresholds(mmap_bytes: libc::c_int, trim_bytes: libc::c_int) {
    #[cfg(target_env = "gnu")]
    // SAFETY: as in set_malloc_arena_max: two plain integers, no preconditions.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap_bytes);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim_bytes);
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = (mmap_bytes, trim_bytes);
}

/// Moves the calling thread alone into a new network namespace
/// (unshare(2), `CLONE_NEWNET`; needs `CAP_SYS_ADMIN`): for tests, and for the
/// preflight's probe of the classic TC attachment.
///
/// # Errors
/// The system call's error (`EPERM` without the capability).
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

/// The nesting of the YAML document `text`, checked with the YAML parser that
/// `serde_yaml_ng` uses (libyaml, as `unsafe-libyaml`), event by event, stopping at
/// the first collection deeper than `max_depth`: its 1-based line is returned.
/// Reading it as the parser does leaves no text it would nest that this check
/// reads otherwise (quotes, comments, plain scalars). A document the parser
/// refuses passes (`None`): the deserializer reports the same error with its
/// location. An FFI layer: libyaml's event API (unsafe-libyaml) has no safe
/// wrapper.
pub fn yaml_too_deep(text: &str, max_depth: usize) -> Option<usize> {
    use std::mem::MaybeUninit;

    use unsafe_libyaml::{
        YAML_MAPPING_END_EVENT, YAML_MAPPING_START_EVENT, YAML_SEQUENCE_END_EVENT,
        YAML_SEQUENCE_START_EVENT, YAML_STREAM_END_EVENT, yaml_event_delete, yaml_event_t,
        yaml_parser_delete, yaml_parser_initialize, yaml_parser_parse,
        yaml_parser_set_input_string, yaml_parser_t,
    };

    let mut parser = MaybeUninit::<yaml_parser_t>::uninit();
    // SAFETY: libyaml's event API used as documented: the parser is initialised
    // before use and deleted once, each event that was parsed is deleted once, and
    // `text` outlives the parser reading it.
    unsafe {
        if yaml_parser_initialize(parser.as_mut_ptr()).fail {
            return None;
        }
        let parser = parser.as_mut_ptr();
        yaml_parser_set_input_string(parser, text.as_ptr(), text.len() as _);
        let mut depth = 0usize;
        let mut result = None;
        loop {
            let mut event = MaybeUninit::<yaml_event_t>::uninit();
            if yaml_parser_parse(parser, event.as_mut_ptr()).fail {
                break;
            }
            let event = event.as_mut_ptr();
            let kind = (*event).type_;
            let line = (*event).start_mark.line;
            yaml_event_delete(event);
            match kind {
                YAML_SEQUENCE_START_EVENT | YAML_MAPPING_START_EVENT => {
                    depth += 1;
                    if depth > max_depth {
                        result = Some(usize::try_from(line).unwrap_or(usize::MAX - 1) + 1);
                        break;
                    }
                }
                YAML_SEQUENCE_END_EVENT | YAML_MAPPING_END_EVENT => {
                    depth = depth.saturating_sub(1);
                }
                YAML_STREAM_END_EVENT => break,
                _ => {}
            }
        }
        yaml_parser_delete(parser);
        result
    }
}

/// The interface the TCX link of id `link_id` is attached to and the program it
/// runs: `tcx.ifindex` and `prog_id` of its `bpf_link_info`
/// (`BPF_LINK_GET_FD_BY_ID`, then `BPF_OBJ_GET_INFO_BY_FD`; bpf(2)). The
/// interface is 0 once the link is detached: `tcx_link_fill_info()`
/// (`kernel/bpf/tcx.c`) reads it from the link's device, which detaching the link
/// (`BPF_LINK_DETACH`, as `bpftool link detach` does) or deleting the interface
/// clears. aya's `LinkInfo` gives a link's id and program but not the fields of
/// its type, and its `FdLink` does not lend its descriptor.
///
/// # Errors
/// The system calls' errors (`ENOENT`: no link of that id any more).
pub fn tcx_link_target(link_id: u32) -> std::io::Result<(u32, u32)> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_link_info};

    // SAFETY: a plain C union of integers, for which all zeroes is a valid
    // value (the kernel requires the fields a command does not use to be zero).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.__bindgen_anon_6.__bindgen_anon_1.link_id = link_id;
    // SAFETY: `attr` is a valid `bpf_attr` of the size passed, read by the
    // kernel only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_LINK_GET_FD_BY_ID as libc::c_long,
            std::ptr::from_mut(&mut attr),
            size_of::<bpf_attr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: on success BPF_LINK_GET_FD_BY_ID returns a new descriptor, owned by
    // nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(rc as libc::c_int) };
    // SAFETY: as `attr` above: plain C structs and unions of integers.
    let mut info: bpf_link_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = size_of::<bpf_link_info>() as u32;
    attr.info.info = std::ptr::from_mut(&mut info) as u64;
    // SAFETY: `attr` is a valid `bpf_attr` of the size passed, naming a buffer
    // (`info`) of `info_len` bytes that lives across the call; the kernel writes
    // at most `info_len` bytes there and reads `attr` only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD as libc::c_long,
            std::ptr::from_mut(&mut attr),
            size_of::<bpf_attr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: reading a union of integers: any bits are a valid `u32`; for a TCX
    // link the kernel filled the `tcx` member.
    let ifindex = unsafe { info.__bindgen_anon_1.tcx.ifindex };
    Ok((ifindex, info.prog_id))
}

/// `fd` registered with the current tokio runtime's reactor, to await its
/// readiness. Must be called on a runtime with I/O enabled.
///
/// # Errors
/// The registration's error (`epoll_ctl`).
pub fn watch_fd(
    fd: std::os::fd::OwnedFd,
) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    // SAFETY: the `OwnedFd` owns its descriptor, which stays open and the same
    // for as long as the `AsyncFd` holds it.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(std::io::Error::from)
}
