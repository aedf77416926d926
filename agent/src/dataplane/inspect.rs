//! `podlink inspect`: what the pins and the node's interfaces say, read without an
//! agent and without changing anything — enrolled pods, their attachments (TCX
//! links or `cls_bpf` filters) and counters, and what does not add up.
//!
//! It reads the pin directory's maps (`pods`, `pod_counters`; per-CPU counters are
//! summed) and link pins (`BPF_OBJ_GET`, then `BPF_OBJ_GET_INFO_BY_FD` for the link
//! and program ids), podlink's `cls_bpf` filters on the node's interfaces (route
//! netlink dumps of the qdiscs and filters, [`super::tc`]), and the node's
//! interfaces (a route netlink dump of the links): run it in the node's network
//! namespace, where the interface indexes mean something.

use crate::error::IoError;
use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
};

use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData},
    programs::{
        links::{FdLink, PinnedLink},
        loaded_programs,
    },
};
use podlink_common::{
    LAYOUT_VERSION, LINKS_DIR, MAP_COUNTERS, MAP_PODS, POD_DNS_CAPTURE, POD_DRAINING, POD_ENROLLED,
    POD_HAS_IPV4, POD_HAS_IPV6, PodCounters, PodInfo,
};
use serde::Serialize;

use super::{
    Program,
    error::{Error, Result},
    layout::{check_pinned_layouts, read_counters_of},
    net,
    netlink::Netlink,
    pins::{self, parse_link_pin_name},
    tc::{self, Tc},
};

/// Everything `podlink inspect` reports. Its JSON form (`--json`) is a stable
/// document: fields are only ever added.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Inspection {
    /// The pin directory read.
    pub pin_dir: PathBuf,
    /// The layout found: `"v2"`, `"v1"` (the previous version, until an agent
    /// migrates it), `"unversioned"` (before layout versions), or `null` when
    /// nothing is pinned.
    pub layout: Option<String>,
    /// Entries of the `pods` map, by host veth index.
    pub pods: Vec<PodReport>,
    /// Pinned TCX links, by host veth index and program.
    pub links: Vec<LinkReport>,
    /// podlink's `cls_bpf` filters on the node's interfaces, by interface index
    /// and program.
    pub filters: Vec<FilterReport>,
    /// What does not add up; empty when all is consistent.
    pub problems: Vec<Problem>,
}

/// One entry of the `pods` map.
#[derive(Clone, Debug, Serialize)]
pub struct PodReport {
    /// The host veth's interface index (the map key).
    pub ifindex: u32,
    /// Its name in this network namespace; `null` when no interface has the index.
    pub interface: Option<String>,
    /// The pod's IPv4 address (when `has_ipv4`).
    pub ipv4: Option<Ipv4Addr>,
    /// The pod's IPv6 address (when `has_ipv6`).
    pub ipv6: Option<Ipv6Addr>,
    /// The flags set: `enrolled`, `has_ipv4`, `has_ipv6`, unknown bits as hex.
    pub flags: Vec<String>,
    /// The agent's number for the workload.
    pub workload_id: u32,
    /// Packets by outcome and drop reason, summed over CPUs, every counter of
    /// [`PodCounters`] in declaration order; `null` without a counters entry.
    pub counters: Option<serde_json::Map<String, serde_json::Value>>,
}

/// One pinned link.
#[derive(Clone, Debug, Serialize)]
pub struct LinkReport {
    /// The interface index in the pin's name.
    pub ifindex: u32,
    /// Its name in this network namespace; `null` when no interface has the index.
    pub interface: Option<String>,
    /// `from_pod` (TC ingress) or `to_pod` (TC egress).
    pub program: Program,
    /// The pin.
    pub pin: PathBuf,
    /// The kernel's link id (as `bpftool link` lists it); `null` if unreadable.
    pub link_id: Option<u32>,
    /// The id of the program the link runs; `null` if unreadable.
    pub program_id: Option<u32>,
    /// That program's name (`from_pod`, `to_pod`); `null` if unknown.
    pub program_name: Option<String>,
    /// Why the link could not be read, if it could not.
    pub error: Option<String>,
}

/// One of podlink's `cls_bpf` filters.
#[derive(Clone, Debug, Serialize)]
pub struct FilterReport {
    /// The interface's index.
    pub ifindex: u32,
    /// Its name in this network namespace; `null` when no interface has the index.
    pub interface: Option<String>,
    /// `from_pod` (on `ingress`) or `to_pod` (on `egress`).
    pub program: Program,
    /// `ingress` or `egress`: where on the `clsact` qdisc it is.
    pub direction: &'static str,
    /// Its priority (`tc filter show … pref`): [`tc::FILTER_PRIORITY`].
    pub priority: u16,
    /// Its handle, in hex as `tc filter show` prints it: [`tc::FILTER_HANDLE`].
    pub handle: String,
    /// The id of the program it runs; `null` if the kernel did not say.
    pub program_id: Option<u32>,
    /// That program's name; `null` if unknown.
    pub program_name: Option<String>,
    /// Whether it is in direct-action mode.
    pub direct_action: bool,
}

/// Something inconsistent in the pins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// `link_interface_gone`, `link_interface_not_veth`, `link_without_pod`,
    /// `filter_without_pod`, `pod_interface_gone`, `pod_without_links` (a program
    /// with neither a link nor a filter), `pod_attached_twice` (a program with
    /// both: an agent switching attach modes stopped half way),
    /// `unversioned_pins_left`, `previous_layout_pins_left`.
    pub kind: &'static str,
    /// The interface index concerned (0 when none).
    pub ifindex: u32,
    /// A sentence for humans.
    pub message: String,
}

/// The names of the flags set in `flags`.
fn flag_names(flags: u32) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = flags;
    for (bit, name) in [
        (POD_ENROLLED, "enrolled"),
        (POD_HAS_IPV4, "has_ipv4"),
        (POD_HAS_IPV6, "has_ipv6"),
        (POD_DRAINING, "draining"),
        (POD_DNS_CAPTURE, "dns_capture"),
    ] {
        if flags & bit != 0 {
            names.push(name.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        names.push(format!("{rest:#x}"));
    }
    names
}

fn pod_report(ifindex: u32, info: &PodInfo, interface: Option<String>) -> PodReport {
    let mapped = Ipv6Addr::from(info.ipv4);
    PodReport {
        ifindex,
        interface,
        ipv4: (info.flags & POD_HAS_IPV4 != 0)
            .then(|| mapped.to_ipv4_mapped())
            .flatten(),
        ipv6: (info.flags & POD_HAS_IPV6 != 0).then(|| Ipv6Addr::from(info.ipv6)),
        flags: flag_names(info.flags),
        workload_id: info.workload_id,
        counters: None,
    }
}

/// Sums per-CPU counters, named.
fn summed(per_cpu: &[PodCounters]) -> serde_json::Map<String, serde_json::Value> {
    let mut total = PodCounters::default();
    per_cpu.iter().for_each(|cpu| total.add(cpu));
    total
        .named()
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.into()))
        .collect()
}

/// Reads the pins under `pin_dir` (nothing is changed). An absent or empty
/// directory gives an empty report.
///
/// # Errors
/// A layout version this podlink does not know, maps of an incompatible layout,
/// unreadable maps, or a failed dump of the node's interfaces.
pub fn inspect(pin_dir: &Path) -> Result<Inspection> {
    let mut report = Inspection {
        pin_dir: pin_dir.to_path_buf(),
        ..Default::default()
    };
    let interfaces = Netlink::blocking(async |netlink| net::interfaces(netlink).await)?;
    let name_of = |ifindex: u32| interfaces.get(&ifindex).map(|(name, _)| name.clone());
    let program_names = program_names();
    let mut filters: Vec<FilterReport> = Tc::open()
        .and_then(|mut tc| tc.podlink_filters())
        .map_err(Error::tc("listing podlink's cls_bpf filters"))?
        .into_iter()
        .map(|f| FilterReport {
            ifindex: f.ifindex,
            interface: name_of(f.ifindex),
            program: f.program,
            direction: direction(f.program),
            priority: tc::FILTER_PRIORITY,
            handle: format!("{:#x}", tc::FILTER_HANDLE),
            program_id: f.program_id,
            program_name: f.program_id.and_then(|id| program_names.get(&id).cloned()),
            direct_action: f.direct_action,
        })
        .collect();
    filters.sort_by_key(|f| (f.ifindex, f.program));
    report.filters = filters;
    let contents = pins::survey(pin_dir)?;
    pins::refuse_other_versions(pin_dir, &contents)?;
    // The newest layout found is read (as the agent keeps the newest pins);
    // what is left of older ones is reported. A `v<N>/` without its pods map yet
    // (a migration stopped before its first rename) is not read over them.
    let mut layouts = pins::earlier_layouts(pin_dir, &contents);
    let current = pins::versioned_dir(pin_dir);
    if contents.versions.contains(&LAYOUT_VERSION)
        && (layouts.is_empty() || current.join(MAP_PODS).exists())
    {
        layouts.insert(
            0,
            pins::FoundLayout {
                dir: current,
                version: LAYOUT_VERSION,
                what: String::new(),
            },
        );
    }
    let Some((read, left)) = layouts.split_first() else {
        return Ok(report);
    };
    for layout in left {
        let kind = if layout.dir == pin_dir {
            "unversioned_pins_left"
        } else {
            "previous_layout_pins_left"
        };
        report.problems.push(Problem {
            kind,
            ifindex: 0,
            message: format!(
                "pins of {} are left under {}; the next agent moves them",
                layout.what,
                layout.dir.display()
            ),
        });
    }
    let (dir, version) = (read.dir.clone(), read.version);
    report.layout = Some(if dir == pin_dir {
        "unversioned".into()
    } else {
        format!("v{version}")
    });
    check_pinned_layouts(&dir, version)?;

    let mut pods: BTreeMap<u32, PodReport> = BTreeMap::new();
    let pods_pin = dir.join(MAP_PODS);
    if pods_pin.exists() {
        let reading = || Error::map_pin("reading", &pods_pin);
        let map: BpfHashMap<MapData, u32, PodInfo> = BpfHashMap::try_from(
            Map::from_map_data(
                MapData::from_pin(&pods_pin).map_err(Error::map_pin("opening", &pods_pin))?,
            )
            .map_err(reading())?,
        )
        .map_err(reading())?;
        for entry in map.iter() {
            let (ifindex, info) = entry.map_err(reading())?;
            pods.insert(ifindex, pod_report(ifindex, &info, name_of(ifindex)));
        }
    }
    let counters_pin = dir.join(MAP_COUNTERS);
    if counters_pin.exists() {
        // An earlier layout's counters are shown as the agent will carry them
        // over.
        let per_cpu = read_counters_of(&counters_pin, version)?;
        for (ifindex, values) in per_cpu {
            if let Some(pod) = pods.get_mut(&ifindex) {
                pod.counters = Some(summed(&values));
            }
        }
    }

    let links_dir = dir.join(LINKS_DIR);
    let mut links = Vec::new();
    if links_dir.is_dir() {
        for entry in fs::read_dir(&links_dir).map_err(IoError::at("reading", &links_dir))? {
            let pin = entry.map_err(IoError::at("reading", &links_dir))?.path();
            let Some((ifindex, program)) = pin
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(parse_link_pin_name)
            else {
                continue;
            };
            let info = PinnedLink::from_pin(&pin)
                .map(FdLink::from)
                .and_then(|link| link.info());
            let (link_id, program_id, error) = match info {
                Ok(info) => (Some(info.id()), Some(info.program_id()), None),
                Err(e) => (None, None, Some(e.to_string())),
            };
            links.push(LinkReport {
                ifindex,
                interface: name_of(ifindex),
                program,
                pin,
                link_id,
                program_id,
                program_name: program_id.and_then(|id| program_names.get(&id).cloned()),
                error,
            });
        }
    }
    links.sort_by_key(|l| (l.ifindex, l.program));

    report.problems.extend(problems(
        &pods.values().cloned().collect::<Vec<_>>(),
        &links,
        &report.filters,
        &interfaces,
    ));
    report.pods = pods.into_values().collect();
    report.links = links;
    Ok(report)
}

/// Where on the `clsact` qdisc `program`'s filter is.
fn direction(program: Program) -> &'static str {
    match program {
        Program::FromPod => "ingress",
        Program::ToPod => "egress",
    }
}

/// The inconsistencies between pods entries, links, filters and the node's
/// interfaces (index → name and kind).
fn problems(
    pods: &[PodReport],
    links: &[LinkReport],
    filters: &[FilterReport],
    interfaces: &HashMap<u32, (String, Option<String>)>,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    for link in links {
        let pin = link.pin.display();
        match interfaces.get(&link.ifindex) {
            None => problems.push(Problem {
                kind: "link_interface_gone",
                ifindex: link.ifindex,
                message: format!(
                    "{pin}: no interface has index {} any more (the pod's veth was deleted); the link is dangling",
                    link.ifindex
                ),
            }),
            Some((name, kind)) if kind.as_deref() != Some("veth") => problems.push(Problem {
                kind: "link_interface_not_veth",
                ifindex: link.ifindex,
                message: format!(
                    "{pin}: interface {} ({name}) is not a veth ({}); the index now belongs to another device",
                    link.ifindex,
                    kind.as_deref().unwrap_or("no kind")
                ),
            }),
            Some(_) => {}
        }
        if !pods.iter().any(|p| p.ifindex == link.ifindex) {
            problems.push(Problem {
                kind: "link_without_pod",
                ifindex: link.ifindex,
                message: format!(
                    "{pin}: the pods map has no entry for interface {}",
                    link.ifindex
                ),
            });
        }
    }
    for filter in filters {
        if !pods.iter().any(|p| p.ifindex == filter.ifindex) {
            problems.push(Problem {
                kind: "filter_without_pod",
                ifindex: filter.ifindex,
                message: format!(
                    "the {} filter at {} of {}: the pods map has no entry for interface {}",
                    filter.program,
                    filter.direction,
                    filter.interface.as_deref().unwrap_or("?"),
                    filter.ifindex
                ),
            });
        }
    }
    for pod in pods {
        let label = match &pod.interface {
            Some(name) => format!("pod entry {} ({name})", pod.ifindex),
            None => format!("pod entry {}", pod.ifindex),
        };
        if pod.interface.is_none() {
            problems.push(Problem {
                kind: "pod_interface_gone",
                ifindex: pod.ifindex,
                message: format!("{label}: no interface has this index any more"),
            });
        }
        let linked = |p: Program| {
            links
                .iter()
                .any(|l| l.ifindex == pod.ifindex && l.program == p)
        };
        let filtered = |p: Program| {
            filters
                .iter()
                .any(|f| f.ifindex == pod.ifindex && f.program == p)
        };
        let missing: Vec<&str> = Program::ALL
            .into_iter()
            .filter(|p| !linked(*p) && !filtered(*p))
            .map(Program::name)
            .collect();
        if !missing.is_empty() {
            problems.push(Problem {
                kind: "pod_without_links",
                ifindex: pod.ifindex,
                message: format!(
                    "{label}: no {} attached (neither a pinned TCX link nor a cls_bpf filter)",
                    missing.join(" or ")
                ),
            });
        }
        let twice: Vec<&str> = Program::ALL
            .into_iter()
            .filter(|p| linked(*p) && filtered(*p))
            .map(Program::name)
            .collect();
        if !twice.is_empty() {
            problems.push(Problem {
                kind: "pod_attached_twice",
                ifindex: pod.ifindex,
                message: format!(
                    "{label}: {} attached both as a pinned TCX link and as a cls_bpf filter; the next agent keeps the kind of its --attach-mode",
                    twice.join(" and ")
                ),
            });
        }
    }
    problems
}

/// `rows` under `headers`, in columns as wide as their widest cell.
pub(super) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:width$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

fn or_dash<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

impl Inspection {
    /// The report as tables for humans: pods, links, non-zero counters, problems.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let Some(layout) = &self.layout else {
            let _ = writeln!(out, "nothing pinned under {}", self.pin_dir.display());
            if !self.filters.is_empty() {
                let _ = writeln!(out, "\nFILTERS (cls_bpf)");
                out += &self.filters_table();
            }
            return out;
        };
        let _ = writeln!(
            out,
            "pin directory {} (layout {layout})\n",
            self.pin_dir.display()
        );
        let _ = writeln!(out, "PODS");
        let rows: Vec<Vec<String>> = self
            .pods
            .iter()
            .map(|p| {
                vec![
                    p.ifindex.to_string(),
                    or_dash(p.interface.as_ref()),
                    or_dash(p.ipv4),
                    or_dash(p.ipv6),
                    p.flags.join(","),
                    p.workload_id.to_string(),
                ]
            })
            .collect();
        out += &table(
            &["IFINDEX", "INTERFACE", "IPV4", "IPV6", "FLAGS", "WORKLOAD"],
            &rows,
        );
        let _ = writeln!(out, "\nLINKS");
        let rows: Vec<Vec<String>> = self
            .links
            .iter()
            .map(|l| {
                vec![
                    l.ifindex.to_string(),
                    or_dash(l.interface.as_ref()),
                    l.program.to_string(),
                    or_dash(l.link_id),
                    or_dash(l.program_id),
                    l.pin.display().to_string(),
                ]
            })
            .collect();
        out += &table(
            &["IFINDEX", "INTERFACE", "PROGRAM", "LINK", "PROG", "PIN"],
            &rows,
        );
        let _ = writeln!(out, "\nFILTERS (cls_bpf)");
        out += &self.filters_table();
        let _ = writeln!(
            out,
            "\nCOUNTERS (packets, summed over CPUs; zero counters left out)"
        );
        let rows: Vec<Vec<String>> = self
            .pods
            .iter()
            .flat_map(|p| {
                p.counters
                    .iter()
                    .flatten()
                    .filter(|(_, v)| v.as_u64() != Some(0))
                    .map(|(name, v)| vec![p.ifindex.to_string(), name.clone(), v.to_string()])
            })
            .collect();
        out += &table(&["IFINDEX", "COUNTER", "PACKETS"], &rows);
        let _ = writeln!(out, "\nPROBLEMS");
        if self.problems.is_empty() {
            let _ = writeln!(out, "none");
        }
        for problem in &self.problems {
            let _ = writeln!(out, "{}: {}", problem.kind, problem.message);
        }
        out
    }
}

impl Inspection {
    fn filters_table(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .filters
            .iter()
            .map(|f| {
                vec![
                    f.ifindex.to_string(),
                    or_dash(f.interface.as_ref()),
                    f.program.to_string(),
                    f.direction.to_string(),
                    f.priority.to_string(),
                    f.handle.clone(),
                    or_dash(f.program_id),
                ]
            })
            .collect();
        table(
            &[
                "IFINDEX",
                "INTERFACE",
                "PROGRAM",
                "DIRECTION",
                "PREF",
                "HANDLE",
                "PROG",
            ],
            &rows,
        )
    }
}

/// The ids and names of the loaded programs (`bpftool prog`), for links' programs.
fn program_names() -> HashMap<u32, String> {
    loaded_programs()
        .filter_map(Result::ok)
        .map(|p| (p.id(), p.name_as_str().unwrap_or_default().to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ifindex: u32, interface: Option<&str>) -> PodReport {
        let info = PodInfo {
            ipv4: podlink_common::ipv4_mapped([10, 244, 1, 2]),
            flags: POD_ENROLLED | POD_HAS_IPV4,
            workload_id: 3,
            ..Default::default()
        };
        pod_report(ifindex, &info, interface.map(str::to_string))
    }

    fn link(ifindex: u32, program: Program) -> LinkReport {
        LinkReport {
            ifindex,
            interface: None,
            program,
            pin: PathBuf::from(format!("/pins/v2/links/{ifindex}_{program}")),
            link_id: Some(1),
            program_id: Some(2),
            program_name: Some(program.to_string()),
            error: None,
        }
    }

    #[test]
    fn pod_entries_read_as_addresses_and_flags() {
        let p = pod(7, Some("veth1"));
        assert_eq!(p.ipv4, Some(Ipv4Addr::new(10, 244, 1, 2)));
        assert_eq!(p.ipv6, None);
        assert_eq!(p.flags, ["enrolled", "has_ipv4"]);
        assert_eq!(flag_names(1 << 9 | POD_ENROLLED), ["enrolled", "0x200"]);
    }

    #[test]
    fn counters_are_summed_over_cpus_by_name() {
        let a = PodCounters {
            passed: 2,
            dropped_no_listener: 1,
            ..Default::default()
        };
        let b = PodCounters {
            passed: 3,
            ..Default::default()
        };
        let sums = summed(&[a, b]);
        assert_eq!(sums["passed"], 5);
        assert_eq!(sums["dropped_no_listener"], 1);
        assert_eq!(
            sums.keys().next().map(String::as_str),
            Some("captured_outbound")
        );
        assert_eq!(sums.len(), 14);
        assert!(!sums.contains_key("dropped_ipv6"));
    }

    #[test]
    fn inconsistencies_are_named() {
        let interfaces: HashMap<u32, (String, Option<String>)> = [
            (7, ("veth1".to_string(), Some("veth".to_string()))),
            (8, ("br0".to_string(), Some("bridge".to_string()))),
        ]
        .into();
        let pods = [pod(7, Some("veth1")), pod(9, None)];
        let links = [
            link(7, Program::FromPod),
            link(7, Program::ToPod),
            link(8, Program::FromPod),
            link(9, Program::FromPod),
        ];
        let found: Vec<(&str, u32)> = problems(&pods, &links, &[], &interfaces)
            .iter()
            .map(|p| (p.kind, p.ifindex))
            .collect();
        assert_eq!(
            found,
            [
                ("link_interface_not_veth", 8),
                ("link_without_pod", 8),
                ("link_interface_gone", 9),
                ("pod_interface_gone", 9),
                ("pod_without_links", 9),
            ]
        );
    }

    #[test]
    fn an_empty_pin_directory_reads_as_nothing_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let report = inspect(dir.path()).unwrap();
        assert!(report.layout.is_none() && report.pods.is_empty());
        assert!(report.to_table().starts_with("nothing pinned under"));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["layout"], serde_json::Value::Null);
        assert_eq!(json["problems"], serde_json::json!([]));
    }
}
