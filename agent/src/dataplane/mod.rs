//! The kernel side: loading the TC programs, pinning their maps and links, attaching
//! them to the host veths of enrolled pods, and writing the maps.
//!
//! Pins (under the pin directory, default `/sys/fs/bpf/podlink`, in the directory
//! of the layout version, see [`pins`]):
//! * `v2/<map>` for each map in [`podlink_common::MAP_NAMES`], readable with
//!   `bpftool map dump pinned <pin-dir>/v2/<map>` (field names from BTF);
//! * `v2/links/<ifindex>_<program>` for each TCX link, so that capture outlives the
//!   agent: while no proxy listens, enrolled pods' new connections are dropped
//!   (fail closed), never sent in plain text.
//!
//! The agent holds a lock on the pin directory while it runs ([`pins::lock`]).
//!
//! A new agent on the same pins reuses the maps and moves each pinned link to its
//! freshly loaded program with `BPF_LINK_UPDATE` (atomic: no packet sees no
//! program).
//!
//! How the programs are attached follows [`AttachMode`] (`podlink agent
//! --attach-mode`): TCX links, pinned, where the kernel has them (6.6 and later);
//! below 6.6 (or with `--attach-mode cls-bpf`) netlink `cls_bpf` filters on a
//! `clsact` qdisc ([`tc`]), at podlink's own priority and handle. Filters are not
//! tied to a process either: they stay attached when the agent exits, and a new
//! agent finds them on the node's interfaces and replaces their programs in place
//! (no packet sees no program). Either way capture outlives the agent and fails
//! closed while none runs. The `clsact` qdiscs podlink adds are recorded in the
//! state directory ([`clsact`]) for `podlink uninstall`; the agent never deletes
//! one.
//!
//! An agent started in the other mode than the previous one (on a kernel with
//! both) takes its attachments over: it adopts them as they are, then, pod by pod,
//! attaches its own kind and only then removes the previous kind, so that no pod
//! is uncaptured meanwhile nor left with both.

pub mod audit;
mod bpffs;
pub mod clsact;
mod error;
pub mod inspect;
pub mod journal;
mod layout;
pub mod net;
pub mod netlink;
pub mod pins;
pub mod preflight;
mod program;
pub mod rcu;
pub mod tc;

use audit::{AttachmentFact, Finding, Owned, PodFacts, Reason};
use clsact::ClsactRecord;
pub use error::{Error, IoError, Result};
use journal::SysctlJournal;
use layout::{cidr_key, with_node_addrs};
use pins::{link_pin_name, parse_link_pin_name};
pub use program::Program;
use rcu::ExpeditedAttach;

use std::{
    collections::{HashMap, HashSet},
    fmt,
    fs::{self, File},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsFd,
    path::{Path, PathBuf},
    sync::Arc,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap as BpfHashMap, LpmTrie, MapData, MapError, PerCpuHashMap, PerCpuValues,
        lpm_trie::Key,
    },
    programs::{
        LinkOrder, SchedClassifier,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
    },
    util::KernelVersion,
};
use nix::fcntl::Flock;
use podlink_common::{
    CONFIG_DRAINING, Config, FlowKey, LAYOUT_VERSION, LINKS_DIR, MAP_CAPTURED_FLOWS, MAP_CONFIG,
    MAP_COUNTERS, MAP_EXCLUDED_CIDRS, MAP_EXCLUDED_PORTS, MAP_NAMES, MAP_PODS, MAX_NODE_ADDRS,
    POD_DNS_CAPTURE, POD_DRAINING, POD_ENROLLED, POD_HAS_IPV4, POD_HAS_IPV6, PodCounters, PodInfo,
    ipv4_mapped,
};

/// The pin directory by default (on the host's bpffs).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/podlink";
/// The state directory by default (the sysctl journal; a tmpfs, as the sysctls it
/// records do not outlive a reboot either).
pub const DEFAULT_STATE_DIR: &str = "/run/podlink";

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at build time.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/podlink-ebpf"));

/// The embedded eBPF object (empty when the agent was built without it).
pub fn ebpf_object() -> &'static [u8] {
    EBPF_OBJECT
}

/// What the dataplane is configured with at start.
#[derive(Clone, Debug)]
pub struct DataplaneConfig {
    /// The bpffs directory for map and link pins (the layout's own directory,
    /// `v<N>`, is made below it).
    pub pin_dir: PathBuf,
    /// The node's state directory: the sysctl journal (where the host veths' and
    /// the node's sysctls are recorded before they are changed) and the record of
    /// expedited grace periods ([`rcu`]).
    pub state_dir: PathBuf,
    /// Written to the config map at load, with `node_addrs`.
    pub config: Config,
    /// The node's own addresses (connections from them to a pod are not
    /// captured), IPv4 first ([`netlink::NodeNetwork::addrs`]); the config map
    /// holds the first [`MAX_NODE_ADDRS`].
    pub node_addrs: Vec<IpAddr>,
    /// Destination prefixes that bypass capture.
    pub excluded_cidrs: Vec<ipnet::IpNet>,
    /// Destination ports that bypass capture.
    pub excluded_ports: Vec<u16>,
    /// Whether TCX attachments run with expedited RCU grace periods ([`rcu`]).
    pub expedite_attach: bool,
    /// How the programs are attached.
    pub attach_mode: AttachMode,
}

/// How the programs are attached to the host veths (`podlink agent
/// --attach-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachMode {
    /// TCX links where the kernel has them (6.6 and later), else `cls_bpf`
    /// filters.
    #[default]
    Auto,
    /// TCX links, pinned (kernel 6.6 or later; the agent refuses to start
    /// without).
    Tcx,
    /// Netlink `cls_bpf` filters on a `clsact` qdisc, on any kernel (for
    /// tooling that expects tc filters).
    ClsBpf,
}

/// The first kernel with TCX links (`BPF_LINK_TYPE_TCX`, Linux 6.6).
pub const TCX_KERNEL: KernelVersion = KernelVersion::new(6, 6, 0);

impl AttachMode {
    /// The kind of attachment this mode gives on a kernel of version `kernel`
    /// (`None`: unknown; then `auto` takes `cls_bpf`, which every kernel has).
    ///
    /// # Errors
    /// [`Error::NoTcx`] for [`AttachMode::Tcx`] on a kernel older than
    /// [`TCX_KERNEL`].
    pub fn resolve(self, kernel: Option<KernelVersion>) -> Result<LinkKind> {
        let tcx = kernel.map(|k| k >= TCX_KERNEL);
        match (self, tcx) {
            (AttachMode::Auto, Some(true)) => Ok(LinkKind::Tcx),
            (AttachMode::Auto, _) | (AttachMode::ClsBpf, _) => Ok(LinkKind::ClsBpf),
            (AttachMode::Tcx, Some(false)) => Err(Error::NoTcx {
                kernel: kernel.map(|k| k.to_string()).unwrap_or_default(),
            }),
            (AttachMode::Tcx, _) => Ok(LinkKind::Tcx),
        }
    }
}

/// The kind of one attachment of a program to a host veth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// A TCX link, pinned under `links/`.
    Tcx,
    /// podlink's `cls_bpf` filter ([`tc`]).
    ClsBpf,
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkKind::Tcx => "TCX links",
            LinkKind::ClsBpf => "cls_bpf filters",
        })
    }
}

/// What [`Dataplane::reconcile`] may detach and remove besides attaching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Everything not wanted.
    All,
    /// This agent's own attachments only: map entries and links of a previous agent
    /// stay, as the workload source cannot tell yet whether their pods are gone
    /// (a manifest broken since start-up).
    OwnOnly,
    /// Nothing: a change to the workload source is settling, and a pod missing from
    /// it may be missing only for the moment.
    Nothing,
}

/// A pod the dataplane should capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedPod {
    /// `namespace/name`, for logs (the workload's own key, shared).
    pub workload: Arc<str>,
    /// The agent's number for the workload (`PodInfo::workload_id`).
    pub workload_id: u32,
    /// The pod's IPv4 address, if it has one (an IPv6-only pod has none: the
    /// programs then let no IPv4 leave the pod). A pod has at least one of
    /// `ipv4` and `ipv6`.
    pub ipv4: Option<Ipv4Addr>,
    /// The pod's IPv6 address, if it has one (`status.podIPs`): the programs
    /// let IPv6 leave the pod only from it (or from a link-local address).
    pub ipv6: Option<Ipv6Addr>,
    /// The host veth.
    pub ifname: Arc<str>,
    /// The host veth's interface index in the node namespace.
    pub ifindex: u32,
    /// The pod left the mesh and drains ([`POD_DRAINING`]): the flows the
    /// proxy carries go on through it, new ones are not captured.
    pub draining: bool,
    /// Its DNS queries go to the agent's DNS server ([`POD_DNS_CAPTURE`]; the
    /// programs capture them only when the config map names a DNS port).
    pub dns_capture: bool,
}

impl CapturedPod {
    /// The pod's addresses: IPv4's, then IPv6's.
    pub fn addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.ipv4
            .map(IpAddr::V4)
            .into_iter()
            .chain(self.ipv6.map(IpAddr::V6))
    }

    /// The pod's addresses for logs: `10.244.1.5`, `10.244.1.5,fd00::5`.
    pub fn addrs_text(&self) -> String {
        self.addrs()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn info(&self) -> PodInfo {
        PodInfo {
            ipv4: self.ipv4.map_or([0; 16], |a| ipv4_mapped(a.octets())),
            ipv6: self.ipv6.map_or([0; 16], |a| a.octets()),
            flags: POD_ENROLLED
                | if self.ipv4.is_some() { POD_HAS_IPV4 } else { 0 }
                | if self.ipv6.is_some() { POD_HAS_IPV6 } else { 0 }
                | if self.draining { POD_DRAINING } else { 0 }
                | if self.dns_capture { POD_DNS_CAPTURE } else { 0 },
            workload_id: self.workload_id,
        }
    }
}

enum Link {
    /// A TCX link, pinned at the path.
    Pinned { path: PathBuf, _fd: FdLink },
    /// podlink's `cls_bpf` filter for the program on the interface. Nothing is
    /// held: dropping it detaches nothing ([`Dataplane::detach_links`] deletes
    /// it).
    Filter { ifindex: u32, program: Program },
}

impl Link {
    fn kind(&self) -> LinkKind {
        match self {
            Link::Pinned { .. } => LinkKind::Tcx,
            Link::Filter { .. } => LinkKind::ClsBpf,
        }
    }

    /// The program it attaches (for a pinned link, from its pin's name).
    fn program(&self) -> Option<Program> {
        match self {
            Link::Pinned { path, .. } => Some(parse_link_pin_name(path.file_name()?.to_str()?)?.1),
            Link::Filter { program, .. } => Some(*program),
        }
    }
}

/// What enrolling does for one program of a pod in mode `mode`, given what a
/// previous agent left attached (`previous`): whether that attachment is kept
/// as it is (true), or a new one of `mode`'s kind is made (false) — after which
/// a previous attachment of the other kind is removed.
fn keeps_previous(mode: LinkKind, previous: Option<LinkKind>) -> bool {
    previous == Some(mode)
}

struct Attachment {
    pod: CapturedPod,
    links: Vec<Link>,
}

/// Copies the captured flows of earlier layouts' maps (`old_flows`) into the loaded
/// `captured_flows`, each with its pod's host veth from `pods` (the previous
/// agent's entries), and logs what was copied.
fn carry_flows(
    ebpf: &mut Ebpf,
    pods: &BpfHashMap<MapData, u32, PodInfo>,
    old_flows: &[PathBuf],
) -> Result<()> {
    let pods: Vec<(u32, PodInfo)> = pods
        .iter()
        .collect::<Result<_, _>>()
        .map_err(Error::map("reading", MAP_PODS))?;
    let mut flows: BpfHashMap<&mut MapData, FlowKey, u32> =
        BpfHashMap::try_from(ebpf.map_mut(MAP_CAPTURED_FLOWS).ok_or_else(|| {
            Error::MissingMap {
                map: MAP_CAPTURED_FLOWS.to_string(),
            }
        })?)
        .map_err(Error::map("opening", MAP_CAPTURED_FLOWS))?;
    for old in old_flows {
        let (copied, left_out) =
            layout::carry_captured_flows(old, &mut flows, &pods).map_err(|e| {
                Error::CarryFlows {
                    path: old.clone(),
                    error: Box::new(e),
                }
            })?;
        tracing::info!(
            from = %old.display(),
            copied,
            left_out,
            "captured flows carried over to layout version {LAYOUT_VERSION}"
        );
    }
    Ok(())
}

/// The loaded programs, their maps and the current attachments.
pub struct Dataplane {
    ebpf: Ebpf,
    /// The layout's directory, `<pin-dir>/v<N>`.
    pins: PathBuf,
    journal: SysctlJournal,
    /// The pin directory's lock, held while this agent runs.
    _lock: Flock<File>,
    config: Config,
    pods: BpfHashMap<MapData, u32, PodInfo>,
    counters: PerCpuHashMap<MapData, u32, PodCounters>,
    config_map: Array<MapData, Config>,
    attached: HashMap<u32, Attachment>,
    /// Attachments of a previous agent (pinned links and filters), moved to this
    /// agent's programs, not yet claimed by a pod.
    adopted: HashMap<(u32, Program), Link>,
    /// The pods map's entries of a previous agent were swept (once the workload
    /// source could tell which pods are gone), the whole map read and every stale
    /// entry removed. Only this agent writes the map while it holds the pin
    /// directory's lock, and it tracks what it wrote for a pod whose enrollment
    /// failed (`unattached`), so no untracked entry appears later and the map
    /// (one system call per key) is not walked again.
    previous_swept: bool,
    /// Pods (by host veth ifindex) whose map entries this agent wrote but whose
    /// enrollment failed after that: retried while wanted, removed when not. Their
    /// entries stay meanwhile, so that a pod a previous agent captured (its links
    /// adopted) stays captured.
    unattached: HashSet<u32>,
    /// How this agent attaches.
    mode: LinkKind,
    /// podlink's filters and `clsact` qdiscs.
    tc: tc::Tc,
    /// The `clsact` qdiscs podlink added.
    clsact: ClsactRecord,
    rcu: ExpeditedAttach,
}

impl Dataplane {
    /// Locks the pin directory, migrates an earlier pin layout (version 1, or the
    /// unversioned one; see [`pins`]), loads the programs (reusing pinned maps),
    /// carries an earlier layout's captured flows over, writes the config map and
    /// adopts the pinned links of a previous agent.
    ///
    /// # Errors
    /// When the pin directory cannot be put on a bpffs, another agent holds it, it
    /// holds pins of an unknown layout version or maps of an incompatible layout, the
    /// object was not embedded, or the kernel refuses the programs or maps.
    pub fn load(cfg: &DataplaneConfig) -> Result<Self> {
        if EBPF_OBJECT.is_empty() {
            return Err(Error::NoObject);
        }
        // What the kernel lacks is named before anything is loaded.
        let preflight = preflight::run(&cfg.pin_dir, cfg.attach_mode)?;
        for unsure in &preflight.unsure {
            tracing::warn!("preflight: could not tell, taken as present: {unsure}");
        }
        tracing::info!("preflight: {}", preflight.summary);
        if let Some(error) = preflight.error() {
            return Err(error);
        }
        // Before anything is changed: a mode this kernel lacks is refused.
        let kernel = KernelVersion::current().ok();
        let mode = cfg.attach_mode.resolve(kernel)?;
        tracing::info!(
            kernel = %kernel.map(|k| k.to_string()).unwrap_or_else(|| "unknown".into()),
            attach_mode = ?cfg.attach_mode,
            "programs are attached as {mode}"
        );
        bpffs::ensure(&cfg.pin_dir)?;
        let lock = pins::lock(&cfg.pin_dir)?;
        let prepared = pins::prepare(&cfg.pin_dir)?;
        let pin_dir = prepared.dir;
        let mut loader = EbpfLoader::new();
        let pin_paths: Vec<(&str, PathBuf)> = MAP_NAMES
            .iter()
            .map(|name| (*name, pin_dir.join(name)))
            .collect();
        for (name, path) in &pin_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .load(EBPF_OBJECT)
            .map_err(|error| Error::LoadObject {
                pin_dir: pin_dir.clone(),
                error: Box::new(error),
            })?;
        for program in Program::ALL {
            classifier(&mut ebpf, program)?
                .load()
                .map_err(|error| preflight::load_error(program, error))?;
        }
        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name).ok_or_else(|| Error::MissingMap {
                map: name.to_string(),
            })
        };
        let pods: BpfHashMap<MapData, u32, PodInfo> =
            BpfHashMap::try_from(take(&mut ebpf, MAP_PODS)?)
                .map_err(Error::map("opening", MAP_PODS))?;
        if prepared.migrated {
            // Without the old flows, packets of connections open across the upgrade
            // whose proxy socket is gone pass instead of being dropped (see
            // `carry_captured_flows`): a failure is no reason to leave the node
            // without its proxy. The old flows are dropped, not tried again later,
            // when they could steer a new connection of the same 4-tuple.
            if let Err(e) = carry_flows(&mut ebpf, &pods, &prepared.old_flows) {
                tracing::warn!(
                    "captured flows of the earlier pin layout not carried over (packets of connections open across the upgrade may pass once their proxy socket is gone): {e}"
                );
            }
        }
        let mut counters = PerCpuHashMap::try_from(take(&mut ebpf, MAP_COUNTERS)?)
            .map_err(Error::map("opening", MAP_COUNTERS))?;
        if prepared.migrated {
            // Counters lost only restart from zero (pods get entries at enrollment).
            for (old, version) in &prepared.old_counters {
                match layout::carry_counters(old, *version, &mut counters) {
                    Ok(copied) => tracing::info!(
                        from = %old.display(),
                        copied,
                        "counters carried over to layout version {LAYOUT_VERSION}"
                    ),
                    Err(e) => tracing::warn!(
                        from = %old.display(),
                        "counters of the earlier pin layout not carried over (they restart from zero): {e}"
                    ),
                }
            }
            let old: Vec<PathBuf> = prepared
                .old_flows
                .iter()
                .cloned()
                .chain(prepared.old_counters.iter().map(|(pin, _)| pin.clone()))
                .collect();
            pins::finish_migration(&cfg.pin_dir, &old)?;
        }
        let config = with_node_addrs(cfg.config, &cfg.node_addrs);
        let mut config_map: Array<MapData, Config> = Array::try_from(take(&mut ebpf, MAP_CONFIG)?)
            .map_err(Error::map("opening", MAP_CONFIG))?;
        config_map
            .set(0, config, 0)
            .map_err(Error::map("writing", MAP_CONFIG))?;
        // The exclusions are this agent's flags: forget those of a previous agent.
        let mut excluded_cidrs: LpmTrie<MapData, [u8; 16], u8> =
            LpmTrie::try_from(take(&mut ebpf, MAP_EXCLUDED_CIDRS)?)
                .map_err(Error::map("opening", MAP_EXCLUDED_CIDRS))?;
        let old: Vec<Key<[u8; 16]>> = excluded_cidrs.keys().filter_map(Result::ok).collect();
        for key in old {
            let _ = excluded_cidrs.remove(&key);
        }
        for net in &cfg.excluded_cidrs {
            let key = cidr_key(net);
            let prefix_len = key.prefix_len;
            excluded_cidrs
                .insert(&Key::new(prefix_len, key.addr), 1, 0)
                .map_err(|error| Error::Exclude {
                    entry: net.to_string(),
                    error,
                })?;
        }
        let mut excluded_ports: BpfHashMap<MapData, u16, u8> =
            BpfHashMap::try_from(take(&mut ebpf, MAP_EXCLUDED_PORTS)?)
                .map_err(Error::map("opening", MAP_EXCLUDED_PORTS))?;
        let old: Vec<u16> = excluded_ports.keys().filter_map(Result::ok).collect();
        for port in old {
            let _ = excluded_ports.remove(&port);
        }
        for port in &cfg.excluded_ports {
            excluded_ports
                .insert(port, 1, 0)
                .map_err(|error| Error::Exclude {
                    entry: format!("port {port}"),
                    error,
                })?;
        }
        if cfg.expedite_attach && mode == LinkKind::ClsBpf {
            // cls_bpf_change() frees what it replaces after a grace period,
            // without waiting for it.
            tracing::info!(
                "--expedite-attach concerns TCX links only: not used with cls_bpf filters"
            );
        }
        let rcu =
            ExpeditedAttach::new(&cfg.state_dir, cfg.expedite_attach && mode == LinkKind::Tcx);
        match rcu.recover() {
            Ok(true) => tracing::warn!(
                "put {} back to 0: an earlier agent stopped while it had it at 1",
                rcu::KNOB
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!("checking {}: {e}", rcu::KNOB),
        }
        let mut dataplane = Dataplane {
            ebpf,
            pins: pin_dir,
            journal: SysctlJournal::new(&cfg.state_dir),
            _lock: lock,
            config,
            pods,
            counters,
            config_map,
            attached: HashMap::new(),
            adopted: HashMap::new(),
            previous_swept: false,
            unattached: HashSet::new(),
            mode,
            tc: tc::Tc::open().map_err(Error::tc("opening a route netlink socket"))?,
            clsact: ClsactRecord::new(&cfg.state_dir),
            rcu,
        };
        dataplane.adopt_pinned_links()?;
        dataplane.adopt_filters()?;
        match dataplane.clsact.prune() {
            Ok(0) => {}
            Ok(dropped) => {
                tracing::debug!(dropped, "dropped the clsact records of gone interfaces")
            }
            Err(e) => tracing::warn!("pruning the clsact record: {e}"),
        }
        Ok(dataplane)
    }

    fn program(&mut self, program: Program) -> Result<&mut SchedClassifier> {
        classifier(&mut self.ebpf, program)
    }

    /// How this agent attaches the programs.
    pub fn link_kind(&self) -> LinkKind {
        self.mode
    }

    /// Moves every pinned link of a previous agent to this agent's programs.
    fn adopt_pinned_links(&mut self) -> Result<()> {
        let dir = self.pins.join(LINKS_DIR);
        for entry in fs::read_dir(&dir).map_err(IoError::at("reading", &dir))? {
            let path = entry.map_err(IoError::at("reading", &dir))?.path();
            let Some((ifindex, program)) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(parse_link_pin_name)
            else {
                continue;
            };
            match self.adopt_link(&path, program) {
                Ok(fd) => {
                    tracing::info!(ifindex, program = program.name(), "adopted pinned link");
                    self.adopted
                        .insert((ifindex, program), Link::Pinned { path, _fd: fd });
                }
                Err(e) => {
                    // The interface went away with its pod: the link is defunct.
                    tracing::info!(path = %path.display(), "removing stale link pin: {e}");
                    let _ = fs::remove_file(&path);
                }
            }
        }
        Ok(())
    }

    fn adopt_link(&mut self, path: &Path, program: Program) -> Result<FdLink> {
        let pinned = PinnedLink::from_pin(path).map_err(|error| Error::OpenLinkPin {
            path: path.to_path_buf(),
            error,
        })?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned))
            .map_err(|error| Error::Link { program, error })?;
        let prog = self.program(program)?;
        let program_error = |action| {
            move |error| Error::Program {
                action,
                program,
                error,
            }
        };
        let id = prog
            .attach_to_link(link)
            .map_err(program_error("moving a pinned link to"))?;
        let link = prog
            .take_link(id)
            .map_err(program_error("taking the link of"))?;
        FdLink::try_from(link).map_err(|error| Error::Link { program, error })
    }

    /// Replaces the program of every `cls_bpf` filter of a previous agent on the
    /// node's interfaces ([`tc::Tc::podlink_filters`]) with this agent's, in
    /// place. A filter whose program cannot be replaced is left as it is (and
    /// replaced again when its pod is enrolled).
    ///
    /// # Errors
    /// When the filters cannot be listed.
    fn adopt_filters(&mut self) -> Result<()> {
        let found = self
            .tc
            .podlink_filters()
            .map_err(Error::tc("listing podlink's cls_bpf filters"))?;
        for filter in found {
            let (ifindex, program) = (filter.ifindex, filter.program);
            match self.replace_filter(ifindex, program) {
                Ok(()) => {
                    tracing::info!(ifindex, program = program.name(), "adopted cls_bpf filter");
                    self.adopted
                        .insert((ifindex, program), Link::Filter { ifindex, program });
                }
                // Deleted since it was listed (with its interface).
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) => {}
                Err(e) => tracing::warn!(
                    ifindex,
                    program = program.name(),
                    "the cls_bpf filter of a previous agent keeps its program: {e}"
                ),
            }
        }
        Ok(())
    }

    /// Replaces the program of podlink's filter for `program` on `ifindex` with
    /// this agent's.
    fn replace_filter(&mut self, ifindex: u32, program: Program) -> std::io::Result<()> {
        let prog = classifier(&mut self.ebpf, program).map_err(std::io::Error::other)?;
        let fd = prog.fd().map_err(std::io::Error::other)?;
        self.tc
            .attach(ifindex, program, fd.as_fd(), tc::How::Replace)
    }

    /// Attaches `program` to the host veth as this agent's kind of attachment.
    fn attach(&mut self, ifname: &str, ifindex: u32, program: Program) -> Result<Link> {
        match self.mode {
            LinkKind::Tcx => self.attach_tcx(ifname, ifindex, program),
            LinkKind::ClsBpf => self.attach_filter(ifname, ifindex, program),
        }
    }

    fn attach_tcx(&mut self, ifname: &str, ifindex: u32, program: Program) -> Result<Link> {
        let prog = self.program(program)?;
        // Before other programs, so that capture decides first; packets it passes
        // go on to them (TCX_NEXT).
        let id = prog
            .attach_with_options(
                ifname,
                program.attach_type(),
                TcAttachOptions::TcxOrder(LinkOrder::first()),
            )
            .map_err(|error| Error::Attach {
                program,
                interface: ifname.to_string(),
                error,
            })?;
        let link = prog.take_link(id).map_err(|error| Error::Program {
            action: "taking the link of",
            program,
            error,
        })?;
        let path = self
            .pins
            .join(LINKS_DIR)
            .join(link_pin_name(ifindex, program));
        let _ = fs::remove_file(&path);
        let pinned = FdLink::try_from(link)
            .map_err(|error| Error::Link { program, error })?
            .pin(&path)
            .map_err(|error| Error::PinLink {
                path: path.clone(),
                error,
            })?;
        Ok(Link::Pinned {
            path,
            _fd: FdLink::from(pinned),
        })
    }

    /// Adds a `clsact` qdisc to the host veth if it has none (recording it), then
    /// podlink's filter for `program`. A filter of podlink's already there (an
    /// earlier agent's that was not adopted) gets this agent's program in place;
    /// another filter at podlink's priority and handle is an error.
    fn attach_filter(&mut self, ifname: &str, ifindex: u32, program: Program) -> Result<Link> {
        let attach_error = |error| Error::AttachFilter {
            program,
            interface: ifname.to_string(),
            error,
        };
        let added = self
            .tc
            .add_clsact(ifindex)
            .map_err(Error::tc(format!("adding a clsact qdisc to {ifname}")))?;
        if added {
            // Without the record, uninstall leaves the (empty) qdisc in place.
            if let Err(e) = self.clsact.add(ifindex, ifname) {
                tracing::warn!(ifname, "recording the clsact qdisc podlink added: {e}");
            }
        }
        let prog = classifier(&mut self.ebpf, program)?;
        let fd = prog.fd().map_err(|error| Error::Program {
            action: "using",
            program,
            error,
        })?;
        match self
            .tc
            .attach(ifindex, program, fd.as_fd(), tc::How::Create)
        {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let ours = self
                    .tc
                    .podlink_filters_on(ifindex)
                    .map_err(Error::tc(format!("listing the filters of {ifname}")))?
                    .iter()
                    .any(|f| f.program == program);
                if !ours {
                    return Err(Error::FilterTaken {
                        program,
                        interface: ifname.to_string(),
                        direction: match program {
                            Program::FromPod => "ingress",
                            Program::ToPod => "egress",
                        },
                    });
                }
                self.replace_filter(ifindex, program)
                    .map_err(attach_error)?;
            }
            Err(e) => return Err(attach_error(e)),
        }
        Ok(Link::Filter { ifindex, program })
    }

    /// Writes `pod`'s map entries, its host veth's sysctls, and attaches both
    /// programs: a previous agent's attachment of this agent's kind is kept, one
    /// of the other kind is removed once both programs are attached. On error the
    /// pod is `unattached` (its entries removed if an attachment failed).
    fn enroll(&mut self, pod: &CapturedPod) -> Result<()> {
        self.unattached.insert(pod.ifindex);
        let info = pod.info();
        self.pods
            .insert(pod.ifindex, info, 0)
            .map_err(Error::map("writing", MAP_PODS))?;
        if self.counters.get(&pod.ifindex, 0).is_err() {
            let cpus = aya::util::nr_cpus().map_err(|(what, e)| IoError::at("reading", what)(e))?;
            let zero = PerCpuValues::try_from(vec![PodCounters::default(); cpus])
                .map_err(|error| Error::PerCpu { error })?;
            self.counters
                .insert(pod.ifindex, zero, 0)
                .map_err(Error::map("writing", MAP_COUNTERS))?;
        }
        net::apply_host_veth_sysctls(&self.journal, &pod.ifname, pod.ifindex)?;
        let mut links = Vec::new();
        // A previous agent's attachments of the other kind, removed once this
        // agent's are in place.
        let mut superseded: Vec<((u32, Program), Link)> = Vec::new();
        // Adopted links are not attached again: no grace period to expedite.
        let attaching = Program::ALL.iter().any(|p| {
            let previous = self.adopted.get(&(pod.ifindex, *p)).map(Link::kind);
            !keeps_previous(self.mode, previous)
        });
        let window = attaching.then(|| self.rcu.begin());
        for program in Program::ALL {
            let key = (pod.ifindex, program);
            let previous = self.adopted.remove(&key);
            if keeps_previous(self.mode, previous.as_ref().map(Link::kind)) {
                links.extend(previous);
                continue;
            }
            match self.attach(&pod.ifname, pod.ifindex, program) {
                Ok(link) => {
                    links.push(link);
                    superseded.extend(previous.map(|l| (key, l)));
                }
                Err(e) => {
                    // The other kind's attachments stay: they are a previous
                    // agent's, removed once the pod is gone or attached.
                    self.adopted.extend(superseded);
                    self.adopted.extend(previous.map(|l| (key, l)));
                    self.detach_links(links);
                    let _ = self.pods.remove(&pod.ifindex);
                    let _ = self.counters.remove(&pod.ifindex);
                    return Err(e);
                }
            }
        }
        drop(window);
        if !superseded.is_empty() {
            tracing::info!(
                workload = %pod.workload,
                ifname = %pod.ifname,
                "moved from a previous agent's {} to {}",
                superseded[0].1.kind(),
                self.mode
            );
            self.detach_links(superseded.into_iter().map(|(_, l)| l).collect());
        }
        self.unattached.remove(&pod.ifindex);
        self.attached.insert(
            pod.ifindex,
            Attachment {
                pod: pod.clone(),
                links,
            },
        );
        Ok(())
    }

    /// Detaches `links`: a TCX link by removing its pin (the last reference goes
    /// with the descriptor), a filter by deleting it.
    fn detach_links(&mut self, links: Vec<Link>) {
        for link in links {
            match link {
                Link::Pinned { path, _fd } => {
                    let _ = fs::remove_file(&path);
                    // Dropping the last reference detaches the link.
                    drop(_fd);
                }
                Link::Filter { ifindex, program } => {
                    if let Err(e) = self.tc.detach(ifindex, program) {
                        tracing::warn!(
                            ifindex,
                            program = program.name(),
                            "deleting the cls_bpf filter: {e}"
                        );
                    }
                }
            }
        }
    }

    fn unenroll(&mut self, ifindex: u32) {
        self.unattached.remove(&ifindex);
        if let Some(attachment) = self.attached.remove(&ifindex) {
            self.detach_links(attachment.links);
            tracing::info!(workload = %attachment.pod.workload, ifname = %attachment.pod.ifname, "detached");
            // A qdisc podlink added went with the interface, if it is gone.
            let added = clsact::Added {
                ifindex,
                name: attachment.pod.ifname.to_string(),
            };
            if !added.exists() {
                let _ = self.clsact.remove(ifindex);
            }
        }
        let _ = self.pods.remove(&ifindex);
        let _ = self.counters.remove(&ifindex);
    }

    /// Detaches and removes this agent's pods not in `wanted`, and unless
    /// `keep_previous`, the map entries and attachments (pinned links, filters) of
    /// a previous agent that no wanted pod claims.
    fn remove_unwanted(
        &mut self,
        wanted_by_ifindex: &HashMap<u32, &CapturedPod>,
        keep_previous: bool,
    ) {
        let gone: Vec<u32> = self
            .attached
            .keys()
            .chain(&self.unattached)
            .filter(|i| !wanted_by_ifindex.contains_key(i))
            .copied()
            .collect();
        for ifindex in gone {
            self.unenroll(ifindex);
        }
        if keep_previous {
            return;
        }
        // Entries of a previous agent for pods that are gone.
        if !self.previous_swept {
            // Swept again at the next reconcile unless the whole map was read and
            // every stale entry is gone.
            let mut complete = true;
            let mut stale = Vec::new();
            for key in self.pods.keys() {
                match key {
                    Ok(i) if !wanted_by_ifindex.contains_key(&i) => stale.push(i),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("reading the pods map's keys: {e}");
                        complete = false;
                        break;
                    }
                }
            }
            for ifindex in stale {
                self.unenroll(ifindex);
                if !matches!(self.pods.get(&ifindex, 0), Err(MapError::KeyNotFound)) {
                    tracing::warn!(ifindex, "removing a previous agent's pods map entry failed");
                    complete = false;
                }
            }
            self.previous_swept = complete;
        }
        let unclaimed: Vec<(u32, Program)> = self
            .adopted
            .keys()
            .filter(|(i, _)| !wanted_by_ifindex.contains_key(i))
            .copied()
            .collect();
        let links = unclaimed
            .iter()
            .filter_map(|key| self.adopted.remove(key))
            .collect();
        self.detach_links(links);
    }

    /// Makes the attachments and map entries match `wanted`: new pods are written to
    /// the maps and then attached, gone pods are detached and then removed from the
    /// maps, changed pods are updated. Returns the pods that could not be attached,
    /// with the reason; the others are in place.
    /// `removal` limits what may be detached and removed.
    pub fn reconcile(
        &mut self,
        wanted: &[CapturedPod],
        removal: Removal,
    ) -> Vec<(CapturedPod, Error)> {
        let wanted_by_ifindex: HashMap<u32, &CapturedPod> =
            wanted.iter().map(|p| (p.ifindex, p)).collect();
        match removal {
            Removal::All => self.remove_unwanted(&wanted_by_ifindex, false),
            Removal::OwnOnly => self.remove_unwanted(&wanted_by_ifindex, true),
            Removal::Nothing => {}
        }
        let mut failures = Vec::new();
        for pod in wanted {
            match self.attached.get(&pod.ifindex) {
                Some(a) if a.pod == *pod => continue,
                Some(_) => {
                    // Same interface, new facts (address, id): rewrite the entry.
                    if let Err(e) = self.pods.insert(pod.ifindex, pod.info(), 0) {
                        failures.push((pod.clone(), Error::map("updating", MAP_PODS)(e)));
                        continue;
                    }
                    if let Some(a) = self.attached.get_mut(&pod.ifindex) {
                        a.pod = pod.clone();
                    }
                }
                None => match self.enroll(pod) {
                    Ok(()) => {
                        tracing::info!(workload = %pod.workload, ifname = %pod.ifname, ip = %pod.addrs_text(), "attached");
                    }
                    Err(e) => failures.push((pod.clone(), e)),
                },
            }
        }
        failures
    }

    /// Compares what the kernel has with what this agent attached, for the pods
    /// it captured and for what podlink left in the kernel, and returns the
    /// discrepancies ([`audit`]); [`Dataplane::repair`] repairs each.
    ///
    /// For each captured pod still `wanted` as it was: whether its host veth's
    /// index still names it (`if_indextoname(3)`), its pods-map entry,
    /// and each program's attachment: a TCX link still attached to the host veth
    /// (`bpf_link_info`'s `tcx.ifindex`, [`crate::sys::tcx_link_target`]),
    /// running this agent's program, its pin present; or podlink's `cls_bpf`
    /// filter there, running this agent's program. A captured pod wanted on
    /// another interface had its host veth replaced or its host route moved. A
    /// pod no longer wanted is left to [`Dataplane::reconcile`]. Then what
    /// nothing of podlink's owns: pods-map entries (once a previous agent's were
    /// swept), link pins under `links/`, podlink's filters on the node's
    /// interfaces. What cannot be read is logged and left unchecked.
    ///
    /// Costs, per captured pod, one `if_indextoname`, one map lookup and, per
    /// TCX link, three `bpf()` calls, a `close` and a `stat` of its pin; for the node, one walk of the pods map's keys,
    /// one read of `links/` and one dump of the qdiscs (two of filters per
    /// interface with a `clsact` qdisc).
    pub fn audit(&mut self, wanted: &[CapturedPod]) -> Vec<Finding> {
        let wanted_by_workload: HashMap<&str, &CapturedPod> =
            wanted.iter().map(|p| (&*p.workload, p)).collect();
        let ours: HashMap<Program, u32> = Program::ALL
            .into_iter()
            .filter_map(|p| Some((p, self.program(p).ok()?.info().ok()?.id())))
            .collect();
        let filters = match self.tc.podlink_filters() {
            Ok(filters) => Some(filters),
            Err(e) => {
                tracing::warn!("audit: listing podlink's cls_bpf filters: {e}");
                None
            }
        };
        let mut found = Vec::new();
        let mut ifindexes: Vec<u32> = self.attached.keys().copied().collect();
        ifindexes.sort_unstable();
        for ifindex in ifindexes {
            let Some(attachment) = self.attached.get(&ifindex) else {
                continue;
            };
            let pod = &attachment.pod;
            // The same interface: its index still names it (an index may name
            // another interface later, or be looked up where it means another).
            let veth_exists = nix::net::if_::if_indextoname(ifindex)
                .is_ok_and(|name| name.to_str() == Ok(&*pod.ifname));
            match wanted_by_workload.get(&*pod.workload) {
                // Leaving: the reconcile's.
                None => continue,
                Some(w) if w.ifindex != ifindex => {
                    found.push(audit::check_placement(pod, w, veth_exists));
                    continue;
                }
                // New facts: the reconcile rewrites the entry.
                Some(w) if **w != *pod => continue,
                Some(_) => {}
            }
            let entry = match self.pods.get(&ifindex, 0) {
                Ok(entry) => Some(entry),
                Err(MapError::KeyNotFound) => None,
                Err(e) => {
                    tracing::warn!(workload = %pod.workload, "audit: reading the pods map: {e}");
                    continue;
                }
            };
            let attachments = attachment
                .links
                .iter()
                .filter_map(|link| {
                    let program = link.program()?;
                    let fact = link_fact(
                        link,
                        ifindex,
                        ours.get(&program).copied(),
                        filters.as_deref(),
                    );
                    Some((program, fact))
                })
                .collect();
            let facts = PodFacts {
                veth_exists,
                entry,
                attachments,
            };
            found.extend(audit::check_pod(pod, &facts));
        }
        found.extend(audit::check_leftovers(
            &self.owned(),
            self.previous_swept
                .then(|| self.pods_keys())
                .flatten()
                .as_deref(),
            &self.link_pins(),
            filters
                .map(|f| f.iter().map(|f| (f.ifindex, f.program)).collect::<Vec<_>>())
                .as_deref(),
        ));
        found
    }

    /// What podlink owns in the kernel: the interfaces of its attached, waiting
    /// and adopted pods, and the links and filters it holds.
    fn owned(&self) -> Owned {
        let mut owned = Owned::default();
        let attached = self
            .attached
            .iter()
            .flat_map(|(i, a)| a.links.iter().map(move |l| (*i, l)));
        let adopted = self.adopted.iter().map(|((i, _), l)| (*i, l));
        for (ifindex, link) in attached.chain(adopted) {
            owned.interfaces.insert(ifindex);
            let Some(program) = link.program() else {
                continue;
            };
            match link.kind() {
                LinkKind::Tcx => owned.links.insert((ifindex, program)),
                LinkKind::ClsBpf => owned.filters.insert((ifindex, program)),
            };
        }
        owned.interfaces.extend(self.attached.keys());
        owned.interfaces.extend(&self.unattached);
        owned
    }

    /// The pods map's keys, or `None` if they cannot all be read.
    fn pods_keys(&self) -> Option<Vec<u32>> {
        match self.pods.keys().collect::<Result<Vec<u32>, _>>() {
            Ok(keys) => Some(keys),
            Err(e) => {
                tracing::warn!("audit: reading the pods map's keys: {e}");
                None
            }
        }
    }

    /// The link pins under `links/`: interface and program.
    fn link_pins(&self) -> Vec<(u32, Program)> {
        let dir = self.pins.join(LINKS_DIR);
        match fs::read_dir(&dir) {
            Ok(entries) => entries
                .filter_map(|e| parse_link_pin_name(e.ok()?.file_name().to_str()?))
                .collect(),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "audit: reading the link pins: {e}");
                Vec::new()
            }
        }
    }

    /// Repairs what `finding` found ([`Dataplane::audit`]): a replaced veth or
    /// moved route by removing what podlink had on the old interface (as for a
    /// pod that left; the next [`Dataplane::reconcile`] captures the pod where
    /// its host route leads); a map entry by writing the pod's; a link or filter
    /// by attaching this agent's program anew (a new pinned link in place of the
    /// old one, which is let go); a stale entry, pin or filter by removing it
    /// (the entry with its counters).
    ///
    /// # Errors
    /// A failed map write, attachment, pin removal or filter deletion.
    pub fn repair(&mut self, finding: &Finding) -> Result<()> {
        let ifindex = finding.ifindex;
        match finding.reason {
            Reason::VethReplaced | Reason::RouteMoved => self.unenroll(ifindex),
            Reason::MapEntryMissing | Reason::MapEntryWrong => {
                if let Some(a) = self.attached.get(&ifindex) {
                    self.pods
                        .insert(ifindex, a.pod.info(), 0)
                        .map_err(Error::map("writing", MAP_PODS))?;
                }
            }
            // Still attached: pinned again (the kernel refuses the same program
            // twice on a device, EEXIST).
            Reason::LinkUnpinned => {
                if let Some(program) = finding.program {
                    self.repin(ifindex, program)?;
                }
            }
            Reason::LinkDetached | Reason::FilterMissing | Reason::ProgramReplaced => {
                if let Some(program) = finding.program {
                    self.reattach(ifindex, program)?;
                }
            }
            Reason::StaleMapEntry => {
                match self.pods.remove(&ifindex) {
                    Ok(()) | Err(MapError::KeyNotFound) => {}
                    Err(e) => return Err(Error::map("removing from", MAP_PODS)(e)),
                }
                let _ = self.counters.remove(&ifindex);
            }
            Reason::StaleLink => {
                if let Some(program) = finding.program {
                    let path = self
                        .pins
                        .join(LINKS_DIR)
                        .join(link_pin_name(ifindex, program));
                    match fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(IoError::at("removing", &path)(e).into()),
                    }
                }
            }
            Reason::StaleFilter => {
                if let Some(program) = finding.program {
                    self.tc.detach(ifindex, program).map_err(Error::tc(format!(
                        "deleting the {program} cls_bpf filter of interface {ifindex}"
                    )))?;
                }
            }
        }
        Ok(())
    }

    /// Pins again the TCX link of `program` of the pod captured on `ifindex`,
    /// whose pin is gone while it is still attached. If pinning fails the link
    /// is let go and the pod detached, to be captured anew by the next
    /// reconcile.
    fn repin(&mut self, ifindex: u32, program: Program) -> Result<()> {
        let Some(a) = self.attached.get_mut(&ifindex) else {
            return Ok(());
        };
        let Some(i) = a.links.iter().position(|l| l.program() == Some(program)) else {
            return Ok(());
        };
        if !matches!(a.links[i], Link::Pinned { .. }) {
            return Ok(());
        }
        let Link::Pinned { path, _fd } = a.links.remove(i) else {
            return Ok(());
        };
        match _fd.pin(&path) {
            Ok(pinned) => {
                a.links.insert(
                    i,
                    Link::Pinned {
                        path,
                        _fd: FdLink::from(pinned),
                    },
                );
                Ok(())
            }
            Err(error) => {
                self.unenroll(ifindex);
                Err(Error::PinLink { path, error })
            }
        }
    }

    /// Attaches `program` anew to the host veth of the pod captured on
    /// `ifindex`, in place of its attachment: a new pinned TCX link (the old one,
    /// whose pin the new one takes, is let go: detached if it was still
    /// attached), or podlink's filter made or given this agent's program.
    fn reattach(&mut self, ifindex: u32, program: Program) -> Result<()> {
        let Some(ifname) = self.attached.get(&ifindex).map(|a| a.pod.ifname.clone()) else {
            return Ok(());
        };
        let link = self.attach(&ifname, ifindex, program)?;
        if let Some(a) = self.attached.get_mut(&ifindex) {
            match a.links.iter_mut().find(|l| l.program() == Some(program)) {
                Some(old) => drop(std::mem::replace(old, link)),
                None => a.links.push(link),
            }
        }
        Ok(())
    }

    /// Marks the proxy as draining in the config map ([`CONFIG_DRAINING`]): from
    /// now on the programs hand no new connection to the listeners, which may then
    /// accept what is queued and close without resetting anything.
    ///
    /// # Errors
    /// A failed map update.
    pub fn set_draining(&mut self) -> Result<()> {
        let config = Config {
            flags: self.config.flags | CONFIG_DRAINING,
            ..self.config
        };
        self.config_map
            .set(0, config, 0)
            .map_err(Error::map("writing", MAP_CONFIG))?;
        self.config = config;
        Ok(())
    }

    /// Writes the node's addresses into the config map if they changed: the first
    /// [`MAX_NODE_ADDRS`] of `addrs` (IPv4 first, as
    /// [`netlink::NodeNetwork::addrs`] has them); a warning names the others.
    ///
    /// # Errors
    /// A failed map update.
    pub fn set_node_addrs(&mut self, addrs: &[IpAddr]) -> Result<()> {
        let config = with_node_addrs(self.config, addrs);
        if config != self.config {
            if let Some(dropped) = addrs.get(MAX_NODE_ADDRS..) {
                tracing::warn!(
                    count = addrs.len(),
                    dropped = %dropped
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                    "the node has more addresses than the config map holds; connections from the others are captured"
                );
            }
            self.config_map
                .set(0, config, 0)
                .map_err(Error::map("writing", MAP_CONFIG))?;
            self.config = config;
        }
        Ok(())
    }

    /// The journal of the sysctls this node's agent changed, in the state
    /// directory.
    pub fn journal(&self) -> &SysctlJournal {
        &self.journal
    }

    /// The pods currently attached.
    pub fn attached(&self) -> impl Iterator<Item = &CapturedPod> {
        self.attached.values().map(|a| &a.pod)
    }

    /// A second handle on the loaded map `name` — `pods`, `pod_counters` or
    /// `captured_flows` — (a duplicated descriptor), to read it elsewhere (metrics read the counters at scrape time) while this
    /// dataplane writes it.
    ///
    /// # Errors
    /// No such map in the object, another map, or the descriptor cannot be
    /// duplicated.
    pub fn map_handle(&self, name: &str) -> Result<MapData> {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        let missing = || Error::MissingMap {
            map: name.to_string(),
        };
        let name: &'static str = MAP_NAMES
            .into_iter()
            .find(|n| *n == name)
            .ok_or_else(missing)?;
        let dup = |data: &MapData| -> Result<MapData> {
            let fd = data
                .fd()
                .as_fd()
                .try_clone_to_owned()
                .map_err(|error| Error::DupMap { map: name, error })?;
            MapData::from_fd(fd).map_err(Error::map("reopening", name))
        };
        match name {
            MAP_PODS => dup(self.pods.map()),
            MAP_COUNTERS => dup(self.counters.map()),
            _ => {
                let map = self.ebpf.map(name).ok_or_else(missing)?;
                let flows: BpfHashMap<&MapData, podlink_common::FlowKey, u32> =
                    BpfHashMap::try_from(map).map_err(Error::map("opening", name))?;
                dup(flows.map())
            }
        }
    }
}

/// What the kernel has of `link`, one of the attachments of the pod captured
/// on `ifindex`: `ours` is this agent's program's id (`None`: unknown, not
/// compared), `filters` podlink's filters on the node (`None`: not listed, a
/// filter is then taken as in place).
fn link_fact(
    link: &Link,
    ifindex: u32,
    ours: Option<u32>,
    filters: Option<&[tc::Filter]>,
) -> AttachmentFact {
    let other = |id: u32| ours.is_some_and(|ours| ours != id);
    match link {
        Link::Pinned { path, _fd } => {
            let target = _fd
                .info()
                .map_err(std::io::Error::other)
                .and_then(|info| crate::sys::tcx_link_target(info.id()));
            match target {
                Ok((attached_to, _)) if attached_to != ifindex => AttachmentFact::Detached,
                Ok((_, program_id)) if other(program_id) => {
                    AttachmentFact::OtherProgram(program_id)
                }
                Ok(_) if !path.exists() => AttachmentFact::Unpinned,
                Ok(_) => AttachmentFact::Ours,
                Err(e) => {
                    tracing::warn!(path = %path.display(), "audit: reading the link's info: {e}");
                    AttachmentFact::Detached
                }
            }
        }
        Link::Filter { ifindex, program } => {
            let Some(filters) = filters else {
                return AttachmentFact::Ours;
            };
            match filters
                .iter()
                .find(|f| f.ifindex == *ifindex && f.program == *program)
            {
                None => AttachmentFact::Missing,
                Some(tc::Filter {
                    program_id: Some(id),
                    ..
                }) if other(*id) => AttachmentFact::OtherProgram(*id),
                Some(_) => AttachmentFact::Ours,
            }
        }
    }
}

/// The object's `program`, a TC classifier.
fn classifier(ebpf: &mut Ebpf, program: Program) -> Result<&mut SchedClassifier> {
    ebpf.program_mut(program.name())
        .ok_or(Error::MissingProgram { program })?
        .try_into()
        .map_err(|error| Error::Program {
            action: "using the object's",
            program,
            error,
        })
}

/// What the dataplane's unit tests that need root share.
#[cfg(test)]
pub(crate) mod testing {
    use std::future::Future;

    /// Runs `test` on a thread of its own moved into a new network namespace
    /// (so the host's is left alone), on a current-thread runtime; a panic there
    /// is the caller's. Needs root (`unshare(CLONE_NEWNET)`).
    pub(crate) fn in_new_network_namespace<F, T>(test: F)
    where
        F: FnOnce() -> T + Send + 'static,
        T: Future<Output = ()>,
    {
        let thread = std::thread::spawn(|| {
            if let Err(e) = crate::sys::unshare_network_namespace() {
                panic!("unshare(CLONE_NEWNET): this test needs root: {e}");
            }
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(test());
        });
        if let Err(panic) = thread.join() {
            std::panic::resume_unwind(panic);
        }
    }

    /// Adds the IPv6 address `cidr` to `dev` without duplicate address
    /// detection and waits (at most 5 s) for its `local` route. The kernel
    /// adds that route from a work queue after the address (`addrconf_dad_work`
    /// even with `nodad`), so a connection made at once can fail with
    /// `ENETUNREACH`.
    pub(crate) fn add_ipv6_address(cidr: &str, dev: &str) {
        ip(&format!("-6 addr add {cidr} dev {dev} nodad"));
        let address = cidr.split('/').next().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ip(&format!("-6 route show table local {address}"))
            .trim()
            .is_empty()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "no local route for {address} 5 s after adding it to {dev}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Runs `ip ARGS` (split at spaces), asserts it succeeded, returns its
    /// standard output.
    pub(crate) fn ip(args: &str) -> String {
        let out = std::process::Command::new("ip")
            .args(args.split_whitespace())
            .output()
            .unwrap();
        assert!(out.status.success(), "ip {args}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` takes TCX from 6.6 on, `cls_bpf` below it or when the kernel's
    /// version is unknown; `tcx` is refused below 6.6, `cls-bpf` taken anywhere.
    #[test]
    fn attach_modes_resolve_by_kernel() {
        let old = Some(KernelVersion::new(6, 1, 0));
        let new = Some(KernelVersion::new(6, 6, 0));
        let newer = Some(KernelVersion::new(6, 18, 2));
        assert_eq!(AttachMode::Auto.resolve(old).unwrap(), LinkKind::ClsBpf);
        assert_eq!(AttachMode::Auto.resolve(new).unwrap(), LinkKind::Tcx);
        assert_eq!(AttachMode::Auto.resolve(newer).unwrap(), LinkKind::Tcx);
        assert_eq!(AttachMode::Auto.resolve(None).unwrap(), LinkKind::ClsBpf);
        for kernel in [old, new, None] {
            assert_eq!(
                AttachMode::ClsBpf.resolve(kernel).unwrap(),
                LinkKind::ClsBpf
            );
        }
        assert_eq!(AttachMode::Tcx.resolve(newer).unwrap(), LinkKind::Tcx);
        let refused = AttachMode::Tcx.resolve(old).unwrap_err().to_string();
        assert!(
            refused.contains("6.6") && refused.contains("6.1.0"),
            "{refused}"
        );
        // Unknown: tried (attaching says why if it fails).
        assert_eq!(AttachMode::Tcx.resolve(None).unwrap(), LinkKind::Tcx);
    }

    /// A previous agent's attachment is kept only when it is of this agent's
    /// kind; otherwise this agent attaches its own (and then removes the other).
    #[test]
    fn previous_attachments_are_kept_only_of_the_same_kind() {
        use LinkKind::{ClsBpf, Tcx};
        assert!(keeps_previous(Tcx, Some(Tcx)));
        assert!(keeps_previous(ClsBpf, Some(ClsBpf)));
        assert!(!keeps_previous(Tcx, Some(ClsBpf)));
        assert!(!keeps_previous(ClsBpf, Some(Tcx)));
        assert!(!keeps_previous(Tcx, None));
        assert!(!keeps_previous(ClsBpf, None));
    }

    /// A pod's map entry carries its IPv6 address, flagged, when it has one:
    /// the programs take IPv6 from the pod only from that address.
    #[test]
    fn a_pods_entry_carries_both_families() {
        let mut pod = CapturedPod {
            workload: "shop/web".into(),
            workload_id: 3,
            ipv4: Some(Ipv4Addr::new(10, 244, 1, 5)),
            ipv6: None,
            ifname: "veth5".into(),
            ifindex: 5,
            draining: false,
            dns_capture: false,
        };
        let info = pod.info();
        assert_eq!(info.flags, POD_ENROLLED | POD_HAS_IPV4);
        assert_eq!(info.ipv6, [0; 16]);
        assert_eq!(info.ipv4, ipv4_mapped([10, 244, 1, 5]));
        let v6: Ipv6Addr = "fd00:10:244:1::5".parse().unwrap();
        pod.ipv6 = Some(v6);
        let info = pod.info();
        assert_eq!(info.flags, POD_ENROLLED | POD_HAS_IPV4 | POD_HAS_IPV6);
        pod.dns_capture = true;
        assert_eq!(
            pod.info().flags,
            POD_ENROLLED | POD_HAS_IPV4 | POD_HAS_IPV6 | POD_DNS_CAPTURE
        );
        pod.dns_capture = false;
        assert_eq!(info.ipv6, v6.octets());
        assert_eq!(info.workload_id, 3);
        assert_eq!(pod.addrs_text(), "10.244.1.5,fd00:10:244:1::5");
        // IPv6 only.
        pod.ipv4 = None;
        let info = pod.info();
        assert_eq!(info.flags, POD_ENROLLED | POD_HAS_IPV6);
        // Leaving the mesh.
        pod.draining = true;
        assert_eq!(pod.info().flags, POD_ENROLLED | POD_HAS_IPV6 | POD_DRAINING);
        assert_eq!(info.ipv4, [0; 16]);
        assert_eq!(pod.addrs_text(), "fd00:10:244:1::5");
    }
}
