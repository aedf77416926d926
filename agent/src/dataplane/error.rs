//! The dataplane's errors.
//!
//! Each variant names what it was doing and on what: the program, the host veth,
//! the map, the pin or file; its message ends with its cause and the cause's own
//! causes (see [`crate::error`]).

use std::{io, path::PathBuf, time::Duration};

use aya::{
    EbpfError,
    maps::MapError,
    pin::PinError,
    programs::{ProgramError, links::LinkError},
};
use podlink_common::LAYOUT_VERSION;

use super::{
    Program,
    preflight::{Missing, NeedsError},
};
use crate::error::Chain;
pub use crate::error::IoError;

/// The dataplane's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to do about pins of layout `version`, which this podlink does not know.
fn layout_advice(version: u32) -> &'static str {
    if version > LAYOUT_VERSION {
        "it was made by a newer podlink: run that version, or remove it with `podlink uninstall` (this detaches capture)"
    } else {
        "this podlink has no migration from it: remove it with `podlink uninstall` (this detaches capture)"
    }
}

/// A map's layout: type, key size (bytes), value size (bytes), capacity
/// (entries).
pub type MapLayout<T = aya::maps::MapType> = (T, usize, usize, u32);

/// What went wrong in the dataplane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The binary was built without the eBPF object.
    #[error(
        "this podlink binary was built without its eBPF object; build it with `cargo xtask build`"
    )]
    NoObject,
    /// The kernel lacks something the programs need (found by the preflight,
    /// before they are loaded).
    #[error(
        "kernel {release} lacks what podlink needs: {}. `podlink preflight` shows every check",
        missing.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    Preflight {
        /// The kernel's release.
        release: String,
        /// What is missing, with what needs it.
        missing: Vec<Missing>,
    },
    /// The embedded object could not be read for what it needs.
    #[error("{error}")]
    ObjectNeeds {
        /// What failed.
        error: NeedsError,
    },
    /// The kernel refused to load a program: the verifier's last lines (its
    /// whole log is logged at debug level).
    #[error(
        "loading program {program}: the kernel refused it ({io_error}); the verifier's last lines (the whole log is logged at debug level):\n{verifier_tail}"
    )]
    LoadProgram {
        /// The program.
        program: Program,
        /// The error of `BPF_PROG_LOAD`.
        io_error: io::Error,
        /// The last lines of the verifier's log.
        verifier_tail: String,
    },
    /// The kernel refused the object or its maps.
    #[error("loading the eBPF object (maps pinned under {pin_dir}): {}", Chain(&**.error))]
    LoadObject {
        /// The layout's directory of the map pins.
        pin_dir: PathBuf,
        /// The loader's error (boxed: it is large).
        error: Box<EbpfError>,
    },
    /// The object lacks a program.
    #[error("program {program} missing from the object")]
    MissingProgram {
        /// The program.
        program: Program,
    },
    /// The object lacks a map.
    #[error("map {map} missing from the object")]
    MissingMap {
        /// The map's name.
        map: String,
    },
    /// A program could not be loaded or used (`action` says how).
    #[error("{action} program {program}: {}", Chain(.error))]
    Program {
        /// What was done with it: `loading`, `moving a pinned link to`, …
        action: &'static str,
        /// The program.
        program: Program,
        /// aya's error.
        error: ProgramError,
    },
    /// Attaching a program to a pod's host veth failed.
    #[error("attaching {program} to {interface}: {}", Chain(.error))]
    Attach {
        /// The program.
        program: Program,
        /// The host veth's name.
        interface: String,
        /// aya's error.
        error: ProgramError,
    },
    /// Attaching a program to a pod's host veth as a `cls_bpf` filter failed.
    #[error("attaching {program} to {interface} as a cls_bpf filter: {error}")]
    AttachFilter {
        /// The program.
        program: Program,
        /// The host veth's name.
        interface: String,
        /// The kernel's refusal.
        error: io::Error,
    },
    /// Another filter holds podlink's priority and handle on a host veth.
    #[error(
        "{interface} has a filter at {direction} with podlink's priority {} and handle {:#x} that is not podlink's {program}: remove it (tc filter del dev {interface} {direction} pref {} handle {:#x} bpf) or use --attach-mode tcx",
        super::tc::FILTER_PRIORITY,
        super::tc::FILTER_HANDLE,
        super::tc::FILTER_PRIORITY,
        super::tc::FILTER_HANDLE
    )]
    FilterTaken {
        /// The program.
        program: Program,
        /// The host veth's name.
        interface: String,
        /// `ingress` or `egress`.
        direction: &'static str,
    },
    /// A traffic-control request (a dump of filters or qdiscs, a qdisc added)
    /// failed.
    #[error("{request}: {error}")]
    Tc {
        /// What was asked: `dumping the cls_bpf filters`, `adding a clsact qdisc to …`.
        request: String,
        /// The kernel's or the socket's error.
        error: io::Error,
    },
    /// `--attach-mode tcx` on a kernel without TCX.
    #[error(
        "--attach-mode tcx needs TCX links, which came with Linux 6.6; this kernel is {kernel}: use --attach-mode auto or cls-bpf"
    )]
    NoTcx {
        /// The kernel's version.
        kernel: String,
    },
    /// A link is not of the kind expected (a TCX link of a TC program).
    #[error("the link of program {program}: {}", Chain(.error))]
    Link {
        /// The program.
        program: Program,
        /// aya's error.
        error: LinkError,
    },
    /// A TCX link could not be pinned.
    #[error("pinning {path}: {}", Chain(.error))]
    PinLink {
        /// The pin.
        path: PathBuf,
        /// aya's error.
        error: PinError,
    },
    /// A link pin could not be opened.
    #[error("opening the link pin {path}: {}", Chain(.error))]
    OpenLinkPin {
        /// The pin.
        path: PathBuf,
        /// aya's error.
        error: LinkError,
    },
    /// A loaded map could not be read or written.
    #[error("{action} the {map} map: {}", Chain(.error))]
    Map {
        /// `reading`, `writing`, `updating`, `opening`, …
        action: &'static str,
        /// The map's name.
        map: &'static str,
        /// aya's error.
        error: MapError,
    },
    /// A pinned map could not be opened or read.
    #[error("{action} {path}: {}", Chain(.error))]
    MapPin {
        /// `opening`, `reading`, `reading the pinned map`.
        action: &'static str,
        /// The pin.
        path: PathBuf,
        /// aya's error.
        error: MapError,
    },
    /// A map's descriptor could not be duplicated.
    #[error("duplicating the descriptor of the {map} map: {error}")]
    DupMap {
        /// The map's name.
        map: &'static str,
        /// The system call's error.
        error: io::Error,
    },
    /// An exclusion (`--exclude-cidr`, `--exclude-port`) could not be written.
    #[error("excluding {entry}: {}", Chain(.error))]
    Exclude {
        /// The prefix, or `port <N>`.
        entry: String,
        /// aya's error.
        error: MapError,
    },
    /// The per-CPU counters of a pod could not be made (the possible CPUs unknown).
    #[error("zeroing the per-CPU counters: {error}")]
    PerCpu {
        /// The error reading the possible CPUs.
        error: io::Error,
    },
    /// The pin directory holds pins of a layout version this podlink does not know.
    #[error(
        "{dir} holds pins of layout version {version}, but this podlink's layout version is {LAYOUT_VERSION}: {}",
        layout_advice(*version)
    )]
    UnknownLayout {
        /// The layout's directory, `<pin-dir>/v<version>`.
        dir: PathBuf,
        /// Its version.
        version: u32,
    },
    /// No map layouts are known for this layout version.
    #[error("no map layout is known for layout version {version}")]
    NoMapLayout {
        /// The version.
        version: u32,
    },
    /// A pinned map's layout is not this agent's.
    #[error(
        "the pinned map {path} ({:?}, key {} B, value {} B, {} entries) was made by an incompatible podlink; this agent expects {:?}, key {} B, value {} B, {} entries. Remove its pins with `podlink uninstall --pin-dir {pin_dir}` (this detaches capture) and start again",
        found.0, found.1, found.2, found.3,
        expected.0, expected.1, expected.2, expected.3
    )]
    IncompatibleMap {
        /// The pin.
        path: PathBuf,
        /// Its layout (the type `None` when the kernel's is unknown to aya).
        found: MapLayout<Option<aya::maps::MapType>>,
        /// The layout expected.
        expected: MapLayout,
        /// The pin directory to give `podlink uninstall`.
        pin_dir: PathBuf,
    },
    /// Moving an earlier layout's pins failed.
    #[error("migrating {layout}: {error}")]
    Migrate {
        /// The earlier layout: "pin layout version 1", "the unversioned pin layout".
        layout: String,
        /// What failed.
        error: Box<Error>,
    },
    /// Carrying the captured flows of an earlier layout's map failed.
    #[error("carrying the captured flows of {path}: {error}")]
    CarryFlows {
        /// The earlier map's pin.
        path: PathBuf,
        /// What failed.
        error: Box<Error>,
    },
    /// Another agent holds the pin directory's lock.
    #[error(
        "a podlink agent is running on the pin directory {pin_dir} (it holds its lock): stop it first"
    )]
    PinDirLocked {
        /// The pin directory.
        pin_dir: PathBuf,
    },
    /// A file system operation failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Renaming a pin failed.
    #[error("moving {from} to {to}: {error}")]
    Rename {
        /// The pin.
        from: PathBuf,
        /// Its new path.
        to: PathBuf,
        /// The system call's error.
        error: io::Error,
    },
    /// A file (`/sys/kernel/rcu_expedited`) could not be written.
    #[error("writing {value} to {path}: {error}")]
    WriteValue {
        /// The file.
        path: PathBuf,
        /// The value.
        value: String,
        /// The system call's error.
        error: io::Error,
    },
    /// A sysctl could not be read.
    #[error("reading {name}: {error}")]
    ReadSysctl {
        /// Its dotted name (`net.ipv4.ip_forward`).
        name: String,
        /// The system call's error.
        error: io::Error,
    },
    /// A sysctl could not be set.
    #[error("setting {name}={value}: {error}")]
    SetSysctl {
        /// Its dotted name.
        name: String,
        /// The value.
        value: String,
        /// The system call's error.
        error: io::Error,
    },
    /// The sysctl journal is not one (named, with the line at fault).
    #[error(
        "{path} is not a sysctl journal{}: {error}",
        line.map(|l| format!(", line {l}")).unwrap_or_default()
    )]
    NotAJournal {
        /// The file.
        path: PathBuf,
        /// The line at fault (from 1), if one.
        line: Option<usize>,
        /// The parser's error.
        error: serde_json::Error,
    },
    /// The sysctl journal has a format this podlink does not know.
    #[error("{path} has format version {version}, this podlink knows {known}")]
    JournalVersion {
        /// The file.
        path: PathBuf,
        /// Its version.
        version: u32,
        /// The versions known, for the message.
        known: &'static str,
    },
    /// A journal entry could not be encoded.
    #[error("encoding a sysctl journal entry: {error}")]
    Encode {
        /// The encoder's error.
        error: serde_json::Error,
    },
    /// A route netlink socket could not be opened.
    #[error("opening a route netlink socket: {error}")]
    NetlinkSocket {
        /// The system call's error.
        error: io::Error,
    },
    /// A route netlink request failed.
    #[error("{request}: {}", Chain(.error))]
    Netlink {
        /// What was asked: `dumping routes`, `adding the rule …`.
        request: String,
        /// The library's error.
        error: rtnetlink::Error,
    },
    /// A route netlink read did not end in time.
    #[error("no complete answer within {}", humantime::format_duration(*timeout))]
    NetlinkTimeout {
        /// The time allowed.
        timeout: Duration,
    },
    /// The network namespace has no loopback interface.
    #[error("no loopback interface (lo) in this network namespace")]
    NoLoopback,
    /// A runtime for the operator commands' route netlink requests could not be
    /// made.
    #[error("starting a runtime for route netlink: {error}")]
    Runtime {
        /// The error.
        error: io::Error,
    },
}

impl Error {
    /// An [`Error::Map`] for `action` on map `map`.
    pub(crate) fn map(action: &'static str, map: &'static str) -> impl FnOnce(MapError) -> Self {
        move |error| Error::Map { action, map, error }
    }

    /// An [`Error::MapPin`] for `action` on the pin `path`.
    pub(crate) fn map_pin(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(MapError) -> Self {
        let path = path.into();
        move |error| Error::MapPin {
            action,
            path,
            error,
        }
    }

    /// An [`Error::Tc`] for `request`.
    pub(crate) fn tc(request: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let request = request.into();
        move |error| Error::Tc { request, error }
    }

    /// An [`Error::Netlink`] for `request`.
    pub(crate) fn netlink(request: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> Self {
        let request = request.into();
        move |error| Error::Netlink { request, error }
    }
}
