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
