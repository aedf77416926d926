//! The preflight: whether this kernel has what podlink's programs need, checked
//! before they are loaded, so that a missing piece is named — with what needs it
//! and the Linux release it came in — instead of surfacing as an aya error or a
//! verifier dump.
//!
//! What is needed is read from the embedded eBPF object itself ([`Needs`]): its
//! programs' type (TC classifiers), its maps' types, the helpers each program
//! calls, and whether it has CO-RE relocations (which would need the kernel's
//! own BTF, `/sys/kernel/btf/vmlinux`; podlink's programs have none, so BTF is
//! reported but not required). What the kernel offers comes from the probes of
//! a [`Kernel`] ([`HostKernel`] on a real one):
//!
//! * program, map and helper support with aya's feature probes (each loads a
//!   trivial program or makes a one-entry map, then drops it, libbpf's way);
//! * TCX with a `BPF_PROG_QUERY` of `lo`'s TCX ingress (`EINVAL` before 6.6, or
//!   without `CONFIG_NET_XGRESS`), which changes nothing;
//! * without TCX, the `clsact` qdisc (`sch_ingress`) and the `bpf` classifier
//!   (`cls_bpf`) by adding them in a network namespace made for the probe and
//!   gone with it: the kernel loads either module on demand as it would for a
//!   real attachment, and nothing else on the node changes;
//! * the bpffs of the pin directory with `statfs`, and `/proc/filesystems`.
//!
//! A probe that cannot tell (it fails with an unexpected error) is decided by the
//! kernel's version when the facility's first release is known, and is otherwise
//! given the benefit of the doubt and logged as a warning: the real load then
//! says the rest. The releases below are those of the commits that added each
//! facility (also tabled in bcc's `docs/kernel-versions.md`); docs/operating.md
//! ("Kernel requirements") lists them.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::{self, Write as _},
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    maps::MapType,
    programs::{ProgramError, ProgramType, SchedClassifier, TcAttachType},
    sys::{BpfHelper, SyscallError, is_helper_supported, is_map_supported, is_program_supported},
    util::KernelVersion,
};
use aya_obj::{
    Object, ProgramSection,
    generated::{BPF_CALL, BPF_JMP, bpf_map_type},
};
use serde::Serialize;

use super::{AttachMode, bpffs};
use crate::error::Chain;

/// Where the kernel exposes its own BTF (`CONFIG_DEBUG_INFO_BTF`).
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// A Linux release, `(major, minor)`.
type Release = (u8, u8);

/// The release TCX came in: commit e420bed02507 ("bpf: Add fd-based tcx
/// multi-prog infra with link support").
const TCX_SINCE: Release = (6, 6);

/// A helper podlink's programs call: what it is for and the release that added
/// it (the commit named).
struct HelperInfo {
    helper: BpfHelper,
    /// Its C name.
    name: &'static str,
    /// What the programs call it for, as "to …".
    purpose: &'static str,
    since: Release,
}

/// The helpers the programs call (checked against the object by a unit test).
const HELPERS: &[HelperInfo] = &[
    // d0003ec01c66 ("bpf: expand BPF syscall with program load/unload").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_map_lookup_elem,
        name: "bpf_map_lookup_elem",
        purpose: "to read the maps",
        since: (3, 19),
    },
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_map_update_elem,
        name: "bpf_map_update_elem",
        purpose: "to remember the flows the proxy took over",
        since: (3, 19),
    },
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_map_delete_elem,
        name: "bpf_map_delete_elem",
        purpose: "to forget flows that are not captured",
        since: (3, 19),
    },
    // 27b29f63058d ("bpf: add bpf_redirect() helper").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_redirect,
        name: "bpf_redirect",
        purpose: "to bounce packets into the host veth's ingress",
        since: (4, 4),
    },
    // 05c74e5e53f6 ("bpf: add bpf_skb_load_bytes helper").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_skb_load_bytes,
        name: "bpf_skb_load_bytes",
        purpose: "to read IPv6 extension headers",
        since: (4, 5),
    },
    // 608cd71a9c7c ("tc: bpf: generalize pedit action").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_skb_store_bytes,
        name: "bpf_skb_store_bytes",
        purpose: "to give DNS answers their port 53 back",
        since: (4, 1),
    },
    // 91bc4822c3d6 ("tc: bpf: add checksum helpers").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_l4_csum_replace,
        name: "bpf_l4_csum_replace",
        purpose: "to update DNS answers' UDP checksum",
        since: (4, 1),
    },
    // d2485c4242a8 ("bpf: add bpf_skb_change_type helper").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_skb_change_type,
        name: "bpf_skb_change_type",
        purpose: "to address bounced packets to this host",
        since: (4, 8),
    },
    // 36bbef52c7eb ("bpf: direct packet write and access for helpers for clsact
    // progs").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_skb_pull_data,
        name: "bpf_skb_pull_data",
        purpose: "to read headers outside the linear data",
        since: (4, 9),
    },
    // 6acc9b432e67 ("bpf: Add helper to retrieve socket in BPF").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_sk_release,
        name: "bpf_sk_release",
        purpose: "to release the sockets it looked up",
        since: (4, 20),
    },
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_sk_lookup_udp,
        name: "bpf_sk_lookup_udp",
        purpose: "to find the agent's DNS socket",
        since: (4, 20),
    },
    // edbf8c01de5a ("bpf: add skc_lookup_tcp helper").
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_skc_lookup_tcp,
        name: "bpf_skc_lookup_tcp",
        purpose: "to find the proxy's listeners and sockets",
        since: (5, 2),
    },
    // cf7fbe660f2d ("bpf: Add socket assign support"), merged for 5.7, for TCP
    // and UDP sockets alike (not `SO_REUSEPORT` ones until 6.5: the agent's
    // sockets are not).
    HelperInfo {
        helper: BpfHelper::BPF_FUNC_sk_assign,
        name: "bpf_sk_assign",
        purpose: "to steer connections to the proxy's sockets",
        since: (5, 7),
    },
];

/// The map types the programs use: the kernel's name and the release that added
/// it (hash and array: 0f8e4bd8a1fc, 28fbcfa08d8e; per-CPU hash: 824bd0ce6c7c;
/// LRU hash: 29ba732acbee; LPM trie: b95a5c4db09b).
const MAP_TYPES: &[(MapType, &str, Release)] = &[
    (MapType::Hash, "hash", (3, 19)),
    (MapType::Array, "array", (3, 19)),
    (MapType::PerCpuHash, "percpu_hash", (4, 6)),
    (MapType::LruHash, "lru_hash", (4, 10)),
    (MapType::LpmTrie, "lpm_trie", (4, 11)),
];

/// `BPF_PROG_TYPE_SCHED_CLS`: cls_bpf runs eBPF since e2e9b6541dd4 ("cls_bpf: add
/// initial eBPF support for programmable classifiers").
const SCHED_CLS_SINCE: Release = (4, 1);
/// The `clsact` qdisc: 1f211a1b929c ("net, sched: add clsact qdisc").
const CLSACT_SINCE: Release = (4, 5);
/// cls_bpf's direct-action mode, which podlink's filters use (`tc::Tc::attach`): 045efa82ff56
/// ("cls_bpf: introduce integrated actions").
const CLS_BPF_SINCE: Release = (4, 4);
/// The BPF filesystem: b2197755b263 ("bpf: add support for persistent maps/progs").
const BPFFS_SINCE: Release = (4, 4);
/// `/sys/kernel/btf/vmlinux`: 341dfcf8d78e ("btf: expose BTF info through sysfs").
const VMLINUX_BTF_SINCE: Release = (5, 4);

/// The answer of one probe.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Probe {
    /// The kernel has it.
    Yes,
    /// The kernel lacks it.
    No,
    /// The probe could not tell: its error.
    Unknown(String),
}

impl Probe {
    /// The answer of an aya feature probe.
    fn of<E: std::error::Error + 'static>(answer: Result<bool, E>) -> Self {
        match answer {
            Ok(true) => Probe::Yes,
            Ok(false) => Probe::No,
            Err(e) => Probe::Unknown(Chain(&e).to_string()),
        }
    }
}

/// Where the pin directory stands with respect to a BPF filesystem.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bpffs {
    /// The pin directory (or its nearest existing ancestor) is on a bpffs
    /// mounted at this path.
    Mounted(PathBuf),
    /// It is not, but the kernel has the filesystem: the agent mounts one
    /// ([`bpffs::ensure`]).
    Mountable,
    /// The kernel has no BPF filesystem (`/proc/filesystems` does not list it).
    Missing,
}

/// What probing for the classic TC attachment found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClassicTc {
    /// The `clsact` qdisc (module `sch_ingress`).
    pub clsact: Probe,
    /// The `bpf` classifier (module `cls_bpf`).
    pub cls_bpf: Probe,
}

/// The kernel as the preflight sees it: each method one probe. [`HostKernel`]
/// probes the running kernel; the unit tests give a made-up one.
pub trait Kernel {
    /// The release, as `uname -r` prints it.
    fn release(&self) -> String;
    /// The version, if it can be read (Debian's and Ubuntu's real one, not the
    /// ABI release of `uname -r`).
    fn version(&self) -> Option<KernelVersion>;
    /// Whether the kernel's own BTF is there ([`VMLINUX_BTF`]).
    fn vmlinux_btf(&self) -> bool;
    /// The bpffs under `pin_dir`.
    fn bpffs(&self, pin_dir: &Path) -> Bpffs;
    /// Whether programs of type `program_type` load.
    fn program_type(&self, program_type: ProgramType) -> Probe;
    /// Whether maps of type `map_type` can be made.
    fn map_type(&self, map_type: MapType) -> Probe;
    /// Whether programs of type `program_type` may call `helper`.
    fn helper(&self, program_type: ProgramType, helper: BpfHelper) -> Probe;
    /// Whether TCX is there.
    fn tcx(&self) -> Probe;
    /// Whether the `clsact` qdisc and the `bpf` classifier are there.
    fn classic_tc(&self) -> ClassicTc;
}

/// What the eBPF object needs of the kernel, read from the object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// The programs, by name: all TC classifiers.
    pub programs: Vec<String>,
    /// Each map type the object's maps have (as the kernel numbers it), with the
    /// maps of that type.
    pub map_types: BTreeMap<u32, Vec<String>>,
    /// Each helper called (by its number), with the programs that call it.
    pub helpers: BTreeMap<u32, BTreeSet<String>>,
    /// Whether the object has CO-RE relocations, which need the kernel's BTF.
    pub core_relocations: bool,
}

/// The object could not be read as podlink's.
#[derive(Debug, thiserror::Error)]
pub enum NeedsError {
    /// It is not an eBPF object aya can parse.
    #[error("parsing the eBPF object: {}", Chain(.0))]
    Parse(#[from] aya_obj::ParseError),
    /// A program is not a TC classifier (the preflight probes those only).
    #[error("program {0} of the eBPF object is not a TC classifier")]
    NotClassifier(String),
}

impl Needs {
    /// Reads what `object` (an eBPF ELF object) needs.
    ///
    /// A helper call is a `BPF_JMP | BPF_CALL` instruction with source register 0
    /// (1 calls a BPF function, 2 a kfunc), the helper's number in `imm`
    /// (include/uapi/linux/bpf.h). Calls from functions that are no program's
    /// entry (BPF-to-BPF subprograms) are counted for every program.
    ///
    /// # Errors
    /// When the object does not parse, or has a program that is not a TC
    /// classifier.
    pub fn of_object(object: &[u8]) -> Result<Self, NeedsError> {
        let obj = Object::parse(object)?;
        let mut needs = Needs {
            core_relocations: obj.has_btf_relocations(),
            ..Needs::default()
        };
        let mut entries = BTreeMap::new();
        for (name, program) in &obj.programs {
            if !matches!(program.section, ProgramSection::SchedClassifier) {
                return Err(NeedsError::NotClassifier(name.clone()));
            }
            needs.programs.push(name.clone());
            entries.insert((program.section_index, program.address), name.clone());
        }
        needs.programs.sort();
        for (name, map) in &obj.maps {
            needs
                .map_types
                .entry(map.map_type())
                .or_default()
                .push(name.clone());
        }
        for names in needs.map_types.values_mut() {
            names.sort();
        }
        let call = (BPF_JMP | BPF_CALL) as u8;
        for (key, function) in &obj.functions {
            let callers: Vec<String> = match entries.get(key) {
                Some(name) => vec![name.clone()],
                None => needs.programs.clone(),
            };
            for insn in &function.instructions {
                if insn.code == call && insn.src_reg() == 0 {
                    needs
                        .helpers
                        .entry(insn.imm as u32)
                        .or_default()
                        .extend(callers.iter().cloned());
                }
            }
        }
        Ok(needs)
    }
}

/// Something the kernel lacks that podlink needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Missing {
    /// What: `bpf_sk_assign`, `the lpm_trie map type`, …
    pub what: String,
    /// What needs it, as "by from_pod to …" or "to …".
    pub needed: String,
    /// The Linux release it came in, `5.7`, if known.
    pub since: Option<String>,
    /// How it was found missing when its probe could not tell.
    pub detail: Option<String>,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (needed {}", self.what, self.needed)?;
        if let Some(since) = &self.since {
            write!(f, "; Linux {since}+")?;
        }
        if let Some(detail) = &self.detail {
            write!(f, "; {detail}")?;
        }
        f.write_str(")")
    }
}

/// How the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachPath {
    /// TCX links, pinned.
    Tcx,
    /// Netlink `cls_bpf` filters on a `clsact` qdisc.
    ClsBpf,
}

/// One check of the report: a program type, map type, helper or other facility.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// What was checked: `program type sched_cls`, `map type lpm_trie`,
    /// `helper bpf_sk_assign`, `TCX`, `BTF`, …
    pub what: String,
    /// What needs it ("by from_pod to …"), empty for what is only reported.
    pub needed: String,
    /// The Linux release it came in, if known.
    pub since: Option<String>,
    /// The probe's answer.
    pub found: Probe,
}

/// What the preflight found. Its JSON form (`podlink preflight --json`) is a
/// stable document: fields are only ever added.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The kernel's release (`uname -r`).
    pub release: String,
    /// Its version (`6.1.158` on Debian's `6.1.0-50-cloud-amd64`), if read.
    pub version: Option<String>,
    /// How the programs would be attached, if they can be.
    pub attach: Option<AttachPath>,
    /// Whether the kernel's BTF is there.
    pub btf: bool,
    /// Whether the object needs it (CO-RE relocations).
    pub btf_needed: bool,
    /// The bpffs under the pin directory.
    pub bpffs: Bpffs,
    /// Every check, in order: program type, map types, helpers, attachment,
    /// BTF.
    pub checks: Vec<Check>,
    /// What is missing; the agent does not start unless it is empty.
    pub missing: Vec<Missing>,
    /// Probes that could not tell, taken as present: their checks.
    pub unsure: Vec<String>,
    /// The report in one line, as the agent logs it.
    pub summary: String,
}

/// The verdict on one needed facility.
enum Verdict {
    Present,
    Absent {
        detail: Option<String>,
    },
    /// The probe failed and the version cannot decide: taken as present.
    Unsure,
}

fn release_text((major, minor): Release) -> String {
    format!("{major}.{minor}")
}

/// Decides on a facility of release `since` from its probe and, when the probe
/// could not tell, the kernel's `version`.
fn decide(found: &Probe, since: Option<Release>, version: Option<&KernelVersion>) -> Verdict {
    match found {
        Probe::Yes => Verdict::Present,
        Probe::No => Verdict::Absent { detail: None },
        Probe::Unknown(error) => match (since, version) {
            (Some((major, minor)), Some(version))
                if *version < KernelVersion::new(major, minor, 0) =>
            {
                Verdict::Absent {
                    detail: Some(format!(
                        "its probe failed ({error}) and this kernel is {version}"
                    )),
                }
            }
            _ => Verdict::Unsure,
        },
    }
}

/// Builds the report as the checks are made.
struct Assessor<'a> {
    version: Option<&'a KernelVersion>,
    checks: Vec<Check>,
    missing: Vec<Missing>,
    unsure: Vec<String>,
}

impl Assessor<'_> {
    /// Records the check of `what` (needed `needed`, since `since`) and its
    /// verdict; returns whether it is present (or taken as present).
    fn check(
        &mut self,
        what: String,
        needed: String,
        since: Option<Release>,
        found: Probe,
    ) -> bool {
        let present = match decide(&found, since, self.version) {
            Verdict::Present => true,
            Verdict::Absent { detail } => {
                self.missing.push(Missing {
                    what: what.clone(),
                    needed: needed.clone(),
                    since: since.map(release_text),
                    detail,
                });
                false
            }
            Verdict::Unsure => {
                if let Probe::Unknown(error) = &found {
                    self.unsure.push(format!("{what}: {error}"));
                }
                true
            }
        };
        self.checks.push(Check {
            what,
            needed,
            since: since.map(release_text),
            found,
        });
        present
    }
}

/// "by from_pod" or "by from_pod and to_pod".
fn by(programs: &BTreeSet<String>) -> String {
    let names: Vec<&str> = programs.iter().map(String::as_str).collect();
    match names.as_slice() {
        [] => String::new(),
        [one] => format!("by {one}"),
        [rest @ .., last] => format!("by {} and {last}", rest.join(", ")),
    }
}

/// Checks `kernel` against `needs`, with the pins under `pin_dir`, for the
/// programs attached as `mode` asks (`cls-bpf` checks the clsact qdisc and
/// cls_bpf even where TCX exists).
pub fn assess(needs: &Needs, kernel: &dyn Kernel, pin_dir: &Path, mode: AttachMode) -> Report {
    let release = kernel.release();
    let version = kernel.version();
    let mut a = Assessor {
        version: version.as_ref(),
        checks: Vec::new(),
        missing: Vec::new(),
        unsure: Vec::new(),
    };
    let all: BTreeSet<String> = needs.programs.iter().cloned().collect();

    // Without the program type nothing else can be probed: every probe loads a
    // program of it. A probe that fails here (no bpf(2), not permitted) fails
    // the real load too: it is missing whatever the version says.
    let what = "program type sched_cls".to_string();
    let needed = format!("{} to load at all", by(&all));
    let loads = match kernel.program_type(ProgramType::SchedClassifier) {
        Probe::Unknown(error) => {
            a.missing.push(Missing {
                what: what.clone(),
                needed: needed.clone(),
                since: Some(release_text(SCHED_CLS_SINCE)),
                detail: Some(format!("loading a trivial one failed: {error}")),
            });
            a.checks.push(Check {
                what,
                needed,
                since: Some(release_text(SCHED_CLS_SINCE)),
                found: Probe::Unknown(error),
            });
            false
        }
        found => a.check(what, needed, Some(SCHED_CLS_SINCE), found),
    };

    let mut map_count = 0;
    let mut helper_count = 0;
    if loads {
        for (number, maps) in &needs.map_types {
            let known = bpf_map_type::try_from(*number)
                .ok()
                .and_then(|t| MapType::try_from(t).ok());
            let info = MAP_TYPES.iter().find(|(t, ..)| Some(*t) == known);
            let name = info.map_or_else(|| format!("#{number}"), |(_, name, _)| name.to_string());
            let found = known.map_or_else(
                || Probe::Unknown(format!("map type {number} is unknown to aya")),
                |t| kernel.map_type(t),
            );
            map_count += 1;
            a.check(
                format!("the {name} map type"),
                format!("for {}", map_list(maps)),
                info.map(|(.., since)| *since),
                found,
            );
        }
        for (number, programs) in &needs.helpers {
            helper_count += 1;
            let Some(info) = HELPERS.iter().find(|h| h.helper as u32 == *number) else {
                a.check(
                    format!("helper #{number}"),
                    by(programs),
                    None,
                    Probe::Unknown("not in podlink's table of helpers".to_string()),
                );
                continue;
            };
            let found = kernel.helper(ProgramType::SchedClassifier, info.helper);
            a.check(
                info.name.to_string(),
                format!("{} {}", by(programs), info.purpose),
                Some(info.since),
                found,
            );
        }
    }

    // The attachment: TCX, else cls_bpf on clsact. A TCX probe that cannot
    // tell is decided by the version: TCX from 6.6 on, cls_bpf before (or when
    // the version is unknown too).
    let tcx = kernel.tcx();
    if let Probe::Unknown(error) = &tcx {
        a.unsure.push(format!("TCX: {error}"));
    }
    let tcx_present = match (&tcx, version.as_ref()) {
        (Probe::Yes, _) => true,
        (Probe::No, _) | (Probe::Unknown(_), None) => false,
        (Probe::Unknown(_), Some(v)) => *v >= KernelVersion::new(TCX_SINCE.0, TCX_SINCE.1, 0),
    };
    a.checks.push(Check {
        what: "TCX".to_string(),
        needed: "to attach the programs as pinned links (else cls_bpf)".to_string(),
        since: Some(release_text(TCX_SINCE)),
        found: tcx,
    });
    let attach = if tcx_present && mode != AttachMode::ClsBpf {
        Some(AttachPath::Tcx)
    } else {
        let classic = kernel.classic_tc();
        let needed = format!(
            "to attach the programs without TCX (Linux {}+)",
            release_text(TCX_SINCE)
        );
        let clsact = a.check(
            "the clsact qdisc (sch_ingress, CONFIG_NET_SCH_INGRESS)".to_string(),
            needed.clone(),
            Some(CLSACT_SINCE),
            classic.clsact,
        );
        let cls_bpf = a.check(
            "the bpf classifier (cls_bpf, CONFIG_NET_CLS_BPF)".to_string(),
            needed,
            Some(CLS_BPF_SINCE),
            classic.cls_bpf,
        );
        (clsact && cls_bpf).then_some(AttachPath::ClsBpf)
    };

    let btf = kernel.vmlinux_btf();
    if needs.core_relocations {
        a.check(
            format!("BTF at {VMLINUX_BTF} (CONFIG_DEBUG_INFO_BTF)"),
            "for the programs' CO-RE relocations".to_string(),
            Some(VMLINUX_BTF_SINCE),
            if btf { Probe::Yes } else { Probe::No },
        );
    } else {
        a.checks.push(Check {
            what: format!("BTF at {VMLINUX_BTF}"),
            needed: String::new(),
            since: Some(release_text(VMLINUX_BTF_SINCE)),
            found: if btf { Probe::Yes } else { Probe::No },
        });
    }

    let bpffs = kernel.bpffs(pin_dir);
    a.check(
        "the BPF filesystem (bpffs)".to_string(),
        format!("to pin the maps and links under {}", pin_dir.display()),
        Some(BPFFS_SINCE),
        if bpffs == Bpffs::Missing {
            Probe::No
        } else {
            Probe::Yes
        },
    );

    let mut report = Report {
        release,
        version: version.map(|v| v.to_string()),
        attach,
        btf,
        btf_needed: needs.core_relocations,
        bpffs,
        checks: a.checks,
        missing: a.missing,
        unsure: a.unsure,
        summary: String::new(),
    };
    report.summary = report.summarise(map_count, helper_count);
    report
}

/// "the pods map", "the excluded_ports and pods maps", "the config map and the
/// .rodata.cst16 data" (sections of global data are maps of the object too).
fn map_list(names: &[String]) -> String {
    let (data, maps): (Vec<&str>, Vec<&str>) = names
        .iter()
        .map(String::as_str)
        .partition(|n| n.starts_with('.'));
    let and = |names: &[&str]| match names {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    };
    let mut parts = Vec::new();
    if !maps.is_empty() {
        parts.push(format!("the {} map{}", and(&maps), plural(maps.len())));
    }
    if !data.is_empty() {
        parts.push(format!("the {} data", and(&data)));
    }
    parts.join(" and ")
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

impl Report {
    /// "kernel 6.1.0-50-cloud-amd64 (6.1.158): cls_bpf on clsact (no TCX), BTF
    /// (not needed), bpffs at /sys/fs/bpf, 5 map types, 10 helpers".
    fn summarise(&self, maps: usize, helpers: usize) -> String {
        let mut s = format!("kernel {}", self.release);
        if let Some(v) = &self.version
            && !self.release.starts_with(v.as_str())
        {
            let _ = write!(s, " ({v})");
        }
        s.push_str(": ");
        s.push_str(match self.attach {
            Some(AttachPath::Tcx) => "TCX",
            Some(AttachPath::ClsBpf) => "cls_bpf on clsact (no TCX)",
            None => "no way to attach",
        });
        s.push_str(match (self.btf, self.btf_needed) {
            (true, true) => ", BTF",
            (true, false) => ", BTF (not needed)",
            (false, true) => ", no BTF",
            (false, false) => ", no BTF (not needed)",
        });
        match &self.bpffs {
            Bpffs::Mounted(at) => {
                let _ = write!(s, ", bpffs at {}", at.display());
            }
            Bpffs::Mountable => s.push_str(", bpffs to be mounted"),
            Bpffs::Missing => s.push_str(", no bpffs"),
        }
        let _ = write!(
            s,
            ", {maps} map type{}, {helpers} helper{}",
            plural(maps),
            plural(helpers)
        );
        if !self.unsure.is_empty() {
            let _ = write!(s, ", {} not probed", self.unsure.len());
        }
        if !self.missing.is_empty() {
            let _ = write!(s, "; {} missing", self.missing.len());
        }
        s
    }

    /// The report as a table for humans, then the summary and what is missing.
    pub fn to_table(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .checks
            .iter()
            .map(|c| {
                vec![
                    c.what.clone(),
                    match &c.found {
                        Probe::Yes => "yes".to_string(),
                        Probe::No => "NO".to_string(),
                        Probe::Unknown(e) => format!("unknown: {e}"),
                    },
                    c.since.clone().unwrap_or_else(|| "-".to_string()),
                    c.needed.clone(),
                ]
            })
            .collect();
        let mut out = super::inspect::table(&["CHECK", "FOUND", "SINCE", "NEEDED"], &rows);
        let _ = writeln!(out, "\n{}", self.summary);
        for m in &self.missing {
            let _ = writeln!(out, "missing: {m}");
        }
        out
    }

    /// The error to stop with when something is missing.
    pub fn error(&self) -> Option<super::Error> {
        (!self.missing.is_empty()).then(|| super::Error::Preflight {
            release: self.release.clone(),
            missing: self.missing.clone(),
        })
    }
}

/// The running kernel.
pub struct HostKernel;

/// How long the classic TC probe may take (a module load included).
const CLASSIC_TC_TIMEOUT: Duration = Duration::from_secs(10);

impl Kernel for HostKernel {
    fn release(&self) -> String {
        match std::fs::read_to_string("/proc/sys/kernel/osrelease") {
            Ok(s) => s.trim().to_string(),
            Err(e) => format!("(release unknown: {e})"),
        }
    }

    fn version(&self) -> Option<KernelVersion> {
        KernelVersion::current().ok()
    }

    fn vmlinux_btf(&self) -> bool {
        Path::new(VMLINUX_BTF).exists()
    }

    fn bpffs(&self, pin_dir: &Path) -> Bpffs {
        if let Some(at) = bpffs::mount_point(pin_dir) {
            Bpffs::Mounted(at)
        } else if bpffs::kernel_has_bpffs() {
            Bpffs::Mountable
        } else {
            Bpffs::Missing
        }
    }

    fn program_type(&self, program_type: ProgramType) -> Probe {
        match is_program_supported(program_type) {
            Err(ProgramError::SyscallError(SyscallError { call, io_error }))
                if io_error.raw_os_error() == Some(libc::EPERM) =>
            {
                Probe::Unknown(format!(
                    "`{call}` failed: {io_error}; run as root, or with CAP_BPF and CAP_NET_ADMIN"
                ))
            }
            answer => Probe::of(answer),
        }
    }

    fn map_type(&self, map_type: MapType) -> Probe {
        Probe::of(is_map_supported(map_type))
    }

    fn helper(&self, program_type: ProgramType, helper: BpfHelper) -> Probe {
        Probe::of(is_helper_supported(program_type, helper))
    }

    fn tcx(&self) -> Probe {
        // The query names an interface; `lo` is in every network namespace.
        match SchedClassifier::query_tcx("lo", TcAttachType::Ingress) {
            Ok(_) => Probe::Yes,
            Err(ProgramError::SyscallError(SyscallError { io_error, .. }))
                if io_error.raw_os_error() == Some(libc::EINVAL) =>
            {
                Probe::No
            }
            Err(e) => Probe::Unknown(Chain(&e).to_string()),
        }
    }

    fn classic_tc(&self) -> ClassicTc {
        let probe = std::thread::spawn(|| {
            if let Err(e) = crate::sys::unshare_network_namespace() {
                let unknown = Probe::Unknown(format!(
                    "making a network namespace to probe in (unshare): {e}"
                ));
                return ClassicTc {
                    clsact: unknown.clone(),
                    cls_bpf: unknown,
                };
            }
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let unknown = Probe::Unknown(format!("starting a runtime: {e}"));
                    return ClassicTc {
                        clsact: unknown.clone(),
                        cls_bpf: unknown,
                    };
                }
            };
            runtime.block_on(async {
                match tokio::time::timeout(CLASSIC_TC_TIMEOUT, classic_tc_probe()).await {
                    Ok(found) => found,
                    Err(_) => {
                        let unknown = Probe::Unknown(format!(
                            "no answer within {}",
                            humantime::format_duration(CLASSIC_TC_TIMEOUT)
                        ));
                        ClassicTc {
                            clsact: unknown.clone(),
                            cls_bpf: unknown,
                        }
                    }
                }
            })
        });
        probe.join().unwrap_or_else(|_| {
            let unknown = Probe::Unknown("the probe's thread panicked".to_string());
            ClassicTc {
                clsact: unknown.clone(),
                cls_bpf: unknown,
            }
        })
    }
}

/// Adds a `clsact` qdisc to `lo` of the (new, empty) network namespace of the
/// calling thread, then a `bpf` filter at its ingress that names no program
/// (file descriptor -1). The kernel looks the filter's kind up (loading
/// `cls_bpf` on demand) before it reads the descriptor: `ENOENT` means no such
/// classifier ("TC classifier not found", `tcf_proto_lookup_ops`), `EBADF` the
/// classifier refusing the descriptor (`cls_bpf_prog_from_efd`). For the qdisc,
/// `ENOENT` likewise means no such kind (`qdisc_lookup_ops` after
/// `request_module("sch_clsact")`, an alias of `sch_ingress`).
async fn classic_tc_probe() -> ClassicTc {
    use futures_util::StreamExt;
    use rtnetlink::{
        packet_core::{
            NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
        },
        packet_route::{
            RouteNetlinkMessage,
            tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
        },
    };

    /// `lo` of a new network namespace.
    const LO: i32 = 1;
    /// `ETH_P_ALL`, network order, as a filter's protocol.
    const ETH_P_ALL: u16 = 0x0003;

    let unknown = |e: &dyn fmt::Display| Probe::Unknown(e.to_string());
    let (connection, mut handle, _) = match rtnetlink::new_connection() {
        Ok(c) => c,
        Err(e) => {
            return ClassicTc {
                clsact: unknown(&format_args!("opening a route netlink socket: {e}")),
                cls_bpf: unknown(&"not probed"),
            };
        }
    };
    tokio::spawn(connection);
    // The request's errno, 0 when acknowledged.
    let mut request = async |message: RouteNetlinkMessage| -> Result<i32, String> {
        let mut req = NetlinkMessage::from(message);
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
        let mut replies = handle.request(req).map_err(|e| e.to_string())?;
        while let Some(reply) = replies.next().await {
            if let NetlinkPayload::Error(e) = reply.payload {
                return Ok(-e.raw_code());
            }
        }
        Ok(0)
    };

    let mut qdisc = TcMessage::with_index(LO);
    qdisc.header.parent = TcHandle::CLSACT;
    qdisc.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    qdisc
        .attributes
        .push(TcAttribute::Kind("clsact".to_string()));
    let clsact = match request(RouteNetlinkMessage::NewQueueDiscipline(qdisc)).await {
        Ok(0) => Probe::Yes,
        Ok(libc::ENOENT) => Probe::No,
        Ok(errno) => unknown(&std::io::Error::from_raw_os_error(errno)),
        Err(e) => unknown(&e),
    };
    if clsact != Probe::Yes {
        return ClassicTc {
            clsact,
            cls_bpf: unknown(&"not probed: no clsact qdisc"),
        };
    }

    let mut filter = TcMessage::with_index(LO);
    filter.header.parent = TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_INGRESS,
    };
    filter.header.info = u32::from(TcHandle {
        major: 1,
        minor: ETH_P_ALL.to_be(),
    });
    filter.attributes.push(TcAttribute::Kind("bpf".to_string()));
    filter.attributes.push(TcAttribute::Options(vec![
        TcOption::Bpf(TcFilterBpfOption::ProgFd(u32::MAX)),
        TcOption::Bpf(TcFilterBpfOption::ProgName("preflight".to_string())),
        TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
    ]));
    let cls_bpf = match request(RouteNetlinkMessage::NewTrafficFilter(filter)).await {
        Ok(libc::EBADF) => Probe::Yes,
        Ok(libc::ENOENT) => Probe::No,
        Ok(0) => unknown(&"the kernel took a filter without a program"),
        Ok(errno) => unknown(&std::io::Error::from_raw_os_error(errno)),
        Err(e) => unknown(&e),
    };
    ClassicTc { clsact, cls_bpf }
}

/// Runs the preflight on this kernel for the embedded object, with the pins
/// under `pin_dir` and the programs attached as `mode` asks: the report,
/// whatever it found (see [`Report::error`]).
///
/// # Errors
/// When the binary has no eBPF object, or it cannot be read.
pub fn run(pin_dir: &Path, mode: AttachMode) -> super::Result<Report> {
    let object = super::ebpf_object();
    if object.is_empty() {
        return Err(super::Error::NoObject);
    }
    let needs = Needs::of_object(object).map_err(|error| super::Error::ObjectNeeds { error })?;
    Ok(assess(&needs, &HostKernel, pin_dir, mode))
}

/// How many lines of the verifier's log a load error carries.
const VERIFIER_TAIL_LINES: usize = 8;

/// The last `n` non-blank lines of a verifier log: where it stopped and why,
/// then its statistics.
fn verifier_tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The error of loading `program`: when the kernel refused it, the verifier's
/// last lines, its whole log logged at debug level.
pub fn load_error(program: super::Program, error: ProgramError) -> super::Error {
    match error {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            tracing::debug!(program = program.name(), "the verifier's log:\n{log}");
            super::Error::LoadProgram {
                program,
                io_error,
                verifier_tail: verifier_tail(&log, VERIFIER_TAIL_LINES),
            }
        }
        error => super::Error::Program {
            action: "loading",
            program,
            error,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::{cell::Cell, collections::HashMap};

    use super::*;

    /// A made-up kernel: everything present unless a field says otherwise.
    struct FakeKernel {
        release: &'static str,
        version: Option<KernelVersion>,
        btf: bool,
        bpffs: Bpffs,
        program_type: Probe,
        /// By map type number.
        maps: HashMap<u32, Probe>,
        helpers: HashMap<u32, Probe>,
        tcx: Probe,
        classic: ClassicTc,
        /// How many feature probes (map type, helper) and classic TC probes were made.
        probes: Cell<usize>,
        classic_probed: Cell<bool>,
    }

    impl FakeKernel {
        /// 6.12: TCX and everything else.
        fn modern() -> Self {
            FakeKernel {
                release: "6.12.48+deb13-amd64",
                version: Some(KernelVersion::new(6, 12, 48)),
                btf: true,
                bpffs: Bpffs::Mounted("/sys/fs/bpf".into()),
                program_type: Probe::Yes,
                maps: HashMap::new(),
                helpers: HashMap::new(),
                tcx: Probe::Yes,
                classic: ClassicTc {
                    clsact: Probe::Yes,
                    cls_bpf: Probe::Yes,
                },
                probes: Cell::new(0),
                classic_probed: Cell::new(false),
            }
        }

        /// Debian 12's 6.1: no TCX, the rest there.
        fn debian12() -> Self {
            FakeKernel {
                release: "6.1.0-50-cloud-amd64",
                version: Some(KernelVersion::new(6, 1, 158)),
                tcx: Probe::No,
                ..Self::modern()
            }
        }

        fn without_helper(mut self, helper: BpfHelper, found: Probe) -> Self {
            self.helpers.insert(helper as u32, found);
            self
        }
    }

    impl Kernel for FakeKernel {
        fn release(&self) -> String {
            self.release.to_string()
        }
        fn version(&self) -> Option<KernelVersion> {
            self.version
        }
        fn vmlinux_btf(&self) -> bool {
            self.btf
        }
        fn bpffs(&self, _pin_dir: &Path) -> Bpffs {
            self.bpffs.clone()
        }
        fn program_type(&self, program_type: ProgramType) -> Probe {
            assert_eq!(program_type, ProgramType::SchedClassifier);
            self.program_type.clone()
        }
        fn map_type(&self, map_type: MapType) -> Probe {
            self.probes.set(self.probes.get() + 1);
            self.maps
                .get(&(map_type as u32))
                .cloned()
                .unwrap_or(Probe::Yes)
        }
        fn helper(&self, program_type: ProgramType, helper: BpfHelper) -> Probe {
            assert_eq!(program_type, ProgramType::SchedClassifier);
            self.probes.set(self.probes.get() + 1);
            self.helpers
                .get(&(helper as u32))
                .cloned()
                .unwrap_or(Probe::Yes)
        }
        fn tcx(&self) -> Probe {
            self.tcx.clone()
        }
        fn classic_tc(&self) -> ClassicTc {
            self.classic_probed.set(true);
            self.classic.clone()
        }
    }

    /// What podlink's object needs, written out: its maps and helpers.
    fn needs() -> Needs {
        let both: BTreeSet<String> = ["from_pod".to_string(), "to_pod".to_string()].into();
        let from_pod: BTreeSet<String> = ["from_pod".to_string()].into();
        let to_pod: BTreeSet<String> = ["to_pod".to_string()].into();
        let maps = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        Needs {
            programs: vec!["from_pod".to_string(), "to_pod".to_string()],
            map_types: [
                (1, maps(&["excluded_ports", "pods"])),
                (2, maps(&["config"])),
                (5, maps(&["pod_counters"])),
                (9, maps(&["captured_flows"])),
                (11, maps(&["excluded_cidrs"])),
            ]
            .into(),
            helpers: [
                (BpfHelper::BPF_FUNC_map_lookup_elem, both.clone()),
                (BpfHelper::BPF_FUNC_map_update_elem, both.clone()),
                (BpfHelper::BPF_FUNC_map_delete_elem, both.clone()),
                (BpfHelper::BPF_FUNC_redirect, to_pod),
                (BpfHelper::BPF_FUNC_skb_load_bytes, both.clone()),
                (BpfHelper::BPF_FUNC_skb_change_type, from_pod.clone()),
                (BpfHelper::BPF_FUNC_skb_pull_data, both.clone()),
                (BpfHelper::BPF_FUNC_sk_release, both.clone()),
                (BpfHelper::BPF_FUNC_skc_lookup_tcp, both),
                (BpfHelper::BPF_FUNC_sk_assign, from_pod),
            ]
            .into_iter()
            .map(|(h, p)| (h as u32, p))
            .collect(),
            core_relocations: false,
        }
    }

    fn pin_dir() -> &'static Path {
        Path::new("/sys/fs/bpf/podlink")
    }

    #[test]
    fn preflight_finds_everything_on_a_tcx_kernel() {
        let kernel = FakeKernel::modern();
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.missing, [], "{}", report.to_table());
        assert!(report.unsure.is_empty());
        assert!(report.error().is_none());
        assert_eq!(report.attach, Some(AttachPath::Tcx));
        assert_eq!(
            report.summary,
            "kernel 6.12.48+deb13-amd64: TCX, BTF (not needed), bpffs at /sys/fs/bpf, 5 map types, 10 helpers"
        );
        // Every map type and helper probed; the classic attachment not needed.
        assert_eq!(kernel.probes.get(), 15);
        assert!(!kernel.classic_probed.get());
        let table = report.to_table();
        assert!(table.contains("bpf_sk_assign"), "{table}");
        assert!(
            table.contains("by from_pod to steer connections to the proxy's sockets"),
            "{table}"
        );
    }

    /// `--attach-mode cls-bpf` on a kernel with TCX: the classic attachment is
    /// what the agent will use, so it is what is checked and reported.
    #[test]
    fn preflight_checks_cls_bpf_when_asked_for_on_a_tcx_kernel() {
        let kernel = FakeKernel::modern();
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::ClsBpf);
        assert_eq!(report.missing, [], "{}", report.to_table());
        assert_eq!(report.attach, Some(AttachPath::ClsBpf));
        assert!(kernel.classic_probed.get());
    }

    #[test]
    fn preflight_takes_cls_bpf_on_debian_12() {
        let kernel = FakeKernel::debian12();
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.missing, [], "{}", report.to_table());
        assert_eq!(report.attach, Some(AttachPath::ClsBpf));
        assert!(kernel.classic_probed.get());
        // The ABI release does not say the version: both are given.
        assert_eq!(
            report.summary,
            "kernel 6.1.0-50-cloud-amd64 (6.1.158): cls_bpf on clsact (no TCX), BTF (not needed), bpffs at /sys/fs/bpf, 5 map types, 10 helpers"
        );
    }

    #[test]
    fn preflight_missing_btf_stops_only_an_object_that_needs_it() {
        let kernel = FakeKernel {
            btf: false,
            ..FakeKernel::modern()
        };
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.missing, []);
        assert!(
            report.summary.contains(", no BTF (not needed),"),
            "{}",
            report.summary
        );

        let core = Needs {
            core_relocations: true,
            ..needs()
        };
        let report = assess(&core, &kernel, pin_dir(), AttachMode::Auto);
        let error = report.error().expect("BTF is needed").to_string();
        assert_eq!(
            error,
            "kernel 6.12.48+deb13-amd64 lacks what podlink needs: BTF at /sys/kernel/btf/vmlinux (CONFIG_DEBUG_INFO_BTF) (needed for the programs' CO-RE relocations; Linux 5.4+). `podlink preflight` shows every check"
        );
    }

    #[test]
    fn preflight_names_a_missing_helper_and_what_needs_it() {
        let kernel = FakeKernel {
            release: "5.4.0-150-generic",
            version: Some(KernelVersion::new(5, 4, 0)),
            tcx: Probe::No,
            ..FakeKernel::modern()
        }
        .without_helper(BpfHelper::BPF_FUNC_sk_assign, Probe::No);
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.attach, Some(AttachPath::ClsBpf));
        assert_eq!(
            report.error().expect("sk_assign is missing").to_string(),
            "kernel 5.4.0-150-generic lacks what podlink needs: bpf_sk_assign (needed by from_pod to steer connections to the proxy's sockets; Linux 5.7+). `podlink preflight` shows every check"
        );
        assert!(
            report.summary.ends_with("; 1 missing"),
            "{}",
            report.summary
        );
    }

    #[test]
    fn preflight_without_tcx_and_cls_bpf_has_no_way_to_attach() {
        let kernel = FakeKernel {
            classic: ClassicTc {
                clsact: Probe::Yes,
                cls_bpf: Probe::No,
            },
            ..FakeKernel::debian12()
        };
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.attach, None);
        assert!(
            report.summary.contains(": no way to attach,"),
            "{}",
            report.summary
        );
        let missing: Vec<String> = report.missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            missing,
            [
                "the bpf classifier (cls_bpf, CONFIG_NET_CLS_BPF) (needed to attach the programs without TCX (Linux 6.6+); Linux 4.4+)"
            ]
        );

        // Without the qdisc, the classifier could not be probed: only the qdisc
        // is missing, the classifier is unsure.
        let kernel = FakeKernel {
            classic: ClassicTc {
                clsact: Probe::No,
                cls_bpf: Probe::Unknown("not probed: no clsact qdisc".to_string()),
            },
            ..FakeKernel::debian12()
        };
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.attach, None);
        let missing: Vec<&str> = report.missing.iter().map(|m| m.what.as_str()).collect();
        assert_eq!(
            missing,
            ["the clsact qdisc (sch_ingress, CONFIG_NET_SCH_INGRESS)"]
        );
        assert_eq!(
            report.unsure,
            ["the bpf classifier (cls_bpf, CONFIG_NET_CLS_BPF): not probed: no clsact qdisc"]
        );
    }

    #[test]
    fn preflight_decides_by_version_when_probes_cannot_tell() {
        // An old kernel whose helper and TCX probes fail: what came after its
        // version is missing, what came before is taken as present (and said to
        // be unsure), and the attachment falls back to cls_bpf.
        let failed = || Probe::Unknown("bpf_prog_load failed: Argument list too long".to_string());
        let kernel = FakeKernel {
            release: "5.4.0",
            version: Some(KernelVersion::new(5, 4, 0)),
            tcx: failed(),
            ..FakeKernel::modern()
        }
        .without_helper(BpfHelper::BPF_FUNC_sk_assign, failed())
        .without_helper(BpfHelper::BPF_FUNC_skc_lookup_tcp, failed());
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.attach, Some(AttachPath::ClsBpf));
        assert_eq!(
            report.error().expect("sk_assign came in 5.7").to_string(),
            "kernel 5.4.0 lacks what podlink needs: bpf_sk_assign (needed by from_pod to steer connections to the proxy's sockets; Linux 5.7+; its probe failed (bpf_prog_load failed: Argument list too long) and this kernel is 5.4.0). `podlink preflight` shows every check"
        );
        assert_eq!(
            report.unsure,
            [
                "bpf_skc_lookup_tcp: bpf_prog_load failed: Argument list too long",
                "TCX: bpf_prog_load failed: Argument list too long",
            ]
        );
        assert!(
            report.summary.ends_with(", 2 not probed; 1 missing"),
            "{}",
            report.summary
        );

        // A failing TCX probe on a 6.6+ kernel takes TCX.
        let kernel = FakeKernel {
            tcx: failed(),
            ..FakeKernel::modern()
        };
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.attach, Some(AttachPath::Tcx));
        assert!(!kernel.classic_probed.get());
    }

    #[test]
    fn preflight_stops_at_a_program_type_that_cannot_be_probed() {
        let kernel = FakeKernel {
            program_type: Probe::Unknown(
                "bpf_prog_load failed: Operation not permitted".to_string(),
            ),
            ..FakeKernel::modern()
        };
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        // Nothing else of bpf(2) was asked: it would fail the same way.
        assert_eq!(kernel.probes.get(), 0);
        assert_eq!(
            report.error().expect("cannot load").to_string(),
            "kernel 6.12.48+deb13-amd64 lacks what podlink needs: program type sched_cls (needed by from_pod and to_pod to load at all; Linux 4.1+; loading a trivial one failed: bpf_prog_load failed: Operation not permitted). `podlink preflight` shows every check"
        );
        assert!(
            report
                .summary
                .ends_with(", 0 map types, 0 helpers; 1 missing"),
            "{}",
            report.summary
        );
    }

    #[test]
    fn preflight_names_a_missing_map_type_and_bpffs() {
        let mut kernel = FakeKernel {
            bpffs: Bpffs::Missing,
            ..FakeKernel::modern()
        };
        kernel.maps.insert(MapType::LpmTrie as u32, Probe::No);
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        let missing: Vec<String> = report.missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            missing,
            [
                "the lpm_trie map type (needed for the excluded_cidrs map; Linux 4.11+)",
                "the BPF filesystem (bpffs) (needed to pin the maps and links under /sys/fs/bpf/podlink; Linux 4.4+)",
            ]
        );
        assert!(report.summary.contains(", no bpffs,"), "{}", report.summary);
        let table = report.to_table();
        assert!(
            table.contains("for the excluded_ports and pods maps"),
            "{table}"
        );
        // Global data sections are maps of the object too.
        assert_eq!(
            map_list(&["config".to_string(), ".rodata.cst16".to_string()]),
            "the config map and the .rodata.cst16 data"
        );

        // A pin directory not on a bpffs yet, on a kernel that has one, is fine:
        // the agent mounts it.
        let kernel = FakeKernel {
            bpffs: Bpffs::Mountable,
            ..FakeKernel::modern()
        };
        let report = assess(&needs(), &kernel, pin_dir(), AttachMode::Auto);
        assert_eq!(report.missing, []);
        assert!(
            report.summary.contains(", bpffs to be mounted,"),
            "{}",
            report.summary
        );
    }

    #[test]
    fn preflight_load_errors_keep_the_verifiers_last_lines() {
        let log = (1..=40)
            .map(|i| format!("{i}: (85) call bpf_sk_assign#124"))
            .chain([
                String::new(),
                "R2 type=scalar expected=sock_common, sock, tcp_sock, xdp_sock, ptr_, ptr_"
                    .to_string(),
                "processed 412 insns (limit 1000000) max_states_per_insn 2 total_states 31 peak_states 31 mark_read 9".to_string(),
                String::new(),
            ])
            .collect::<Vec<_>>()
            .join("\n");
        let tail = verifier_tail(&log, VERIFIER_TAIL_LINES);
        let lines: Vec<&str> = tail.lines().collect();
        assert_eq!(lines.len(), VERIFIER_TAIL_LINES);
        assert_eq!(lines[0], "35: (85) call bpf_sk_assign#124");
        assert!(lines[6].starts_with("R2 type=scalar"));
        assert!(lines[7].starts_with("processed 412 insns"));
        assert_eq!(verifier_tail("one\ntwo", 8), "one\ntwo");

        let error = load_error(
            crate::dataplane::Program::FromPod,
            ProgramError::LoadError {
                io_error: std::io::Error::from_raw_os_error(libc::EACCES),
                verifier_log: aya_obj::VerifierLog::new(log),
            },
        )
        .to_string();
        assert!(
            error.starts_with("loading program from_pod: the kernel refused it (Permission denied"),
            "{error}"
        );
        assert!(error.ends_with(&tail), "{error}");
        assert!(!error.contains("\n1: (85)"), "the whole log: {error}");
    }

    /// The embedded object's needs are what the table knows: every helper it
    /// calls has a purpose and a release, both programs are classifiers, and it
    /// has no CO-RE relocations (docs/operating.md says BTF is not needed).
    #[test]
    #[ignore = "needs the eBPF object (`cargo xtask test` embeds it)"]
    fn preflight_reads_the_objects_needs() {
        let object = crate::dataplane::ebpf_object();
        assert!(
            !object.is_empty(),
            "this build has no eBPF object: run `cargo xtask test`"
        );
        let needs = Needs::of_object(object).unwrap();
        assert_eq!(needs.programs, ["from_pod", "to_pod"]);
        assert!(
            !needs.core_relocations,
            "the object has CO-RE relocations now: BTF is needed (update docs/operating.md)"
        );
        let maps: BTreeSet<&str> = needs
            .map_types
            .values()
            .flatten()
            .map(String::as_str)
            .collect();
        for name in podlink_common::MAP_NAMES {
            assert!(maps.contains(name), "map {name} missing from {maps:?}");
        }
        for number in needs.map_types.keys() {
            let known = bpf_map_type::try_from(*number)
                .ok()
                .and_then(|t| MapType::try_from(t).ok());
            assert!(
                MAP_TYPES.iter().any(|(t, ..)| Some(*t) == known),
                "map type {number} is not in MAP_TYPES"
            );
        }
        for number in needs.helpers.keys() {
            assert!(
                HELPERS.iter().any(|h| h.helper as u32 == *number),
                "helper #{number} is called but not in HELPERS"
            );
        }
        let assign = &needs.helpers[&(BpfHelper::BPF_FUNC_sk_assign as u32)];
        assert_eq!(assign.iter().collect::<Vec<_>>(), ["from_pod"]);
        // The table has no helper the object does not call.
        assert_eq!(needs.helpers.len(), HELPERS.len(), "{:?}", needs.helpers);
    }

    /// The real probes on this kernel (the project's test machine: 6.18, TCX,
    /// BTF): everything present, nothing unsure, and the classic TC probe (not
    /// used with TCX) finds clsact and cls_bpf in its own network namespace.
    #[test]
    #[ignore = "needs root"]
    fn preflight_probes_this_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let report = run(dir.path(), AttachMode::Auto).unwrap();
        assert_eq!(report.missing, [], "{}", report.to_table());
        assert!(report.unsure.is_empty(), "{}", report.to_table());
        assert_eq!(
            report.attach,
            Some(AttachPath::Tcx),
            "{}",
            report.to_table()
        );
        assert!(report.btf, "{}", report.to_table());
        assert_ne!(report.bpffs, Bpffs::Missing);
        assert!(
            report
                .summary
                .starts_with(&format!("kernel {}: TCX,", HostKernel.release())),
            "{}",
            report.summary
        );
        assert_eq!(
            HostKernel.classic_tc(),
            ClassicTc {
                clsact: Probe::Yes,
                cls_bpf: Probe::Yes,
            }
        );
        // The pin directory's bpffs, where there is one.
        if let Some(at) = bpffs::mount_point(Path::new("/sys/fs/bpf/podlink")) {
            assert_eq!(
                HostKernel.bpffs(Path::new("/sys/fs/bpf/podlink")),
                Bpffs::Mounted(at)
            );
        }
    }
}
