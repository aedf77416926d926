//! The dataplane's self-audit: what the kernel has, compared with what the agent
//! attached, so that a pod cannot silently fall out of the mesh (a link detached
//! by hand, a deleted map entry, a host veth replaced while the pod stays
//! "enrolled").
//!
//! [`super::Dataplane::audit`] reads the facts of each pod it captured and of
//! what podlink left in the kernel (a few system calls per pod: the interface's
//! name by index, one pods-map lookup, one `bpf_link_info` per TCX link or one
//! dump of podlink's `cls_bpf` filters, the keys of the pods map, the `links/`
//! directory); the functions here turn facts into [`Finding`]s, without the
//! kernel, and [`super::Dataplane::repair`] repairs one. The reconciler logs and
//! counts each repair (`podlink_repairs_total{reason}`).

use std::{collections::HashSet, fmt, sync::Arc};

use podlink_common::PodInfo;

use super::{CapturedPod, Program};

/// What was wrong: the `reason` label of `podlink_repairs_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A pod's pinned TCX link is no longer attached to its host veth (`bpftool
    /// link detach`: the link stays pinned, defunct). Repaired by a new link.
    LinkDetached,
    /// A pod's TCX link is attached but its pin is gone, so that it would go with
    /// this agent. Repaired by a new, pinned link.
    LinkUnpinned,
    /// podlink's `cls_bpf` filter for a program is missing from a pod's host
    /// veth. Repaired by a new filter.
    FilterMissing,
    /// A pod's link or filter runs another program than this agent's. Repaired by
    /// attaching this agent's.
    ProgramReplaced,
    /// A pod's pods-map entry is missing. Repaired by writing it.
    MapEntryMissing,
    /// A pod's pods-map entry differs from the pod (addresses, flags, workload
    /// id). Repaired by writing it.
    MapEntryWrong,
    /// The host veth a pod was captured on is gone (deleted, or deleted and made
    /// again: a new interface index). Repaired by removing what podlink had for
    /// it; the pod is captured on the interface its host route leads to.
    VethReplaced,
    /// The host route to a pod's address leads to another interface than the one
    /// it was captured on, which still exists. Repaired by removing what podlink
    /// had on the old one; the pod is captured on the new one.
    RouteMoved,
    /// A pods-map entry for an interface podlink captures nothing on. Removed
    /// (with its counters).
    StaleMapEntry,
    /// A pinned TCX link of podlink's for an interface it captures nothing on (or
    /// not this link). Its pin is removed, which detaches it.
    StaleLink,
    /// A `cls_bpf` filter of podlink's that no captured pod has (or on a pod
    /// captured by TCX links). Deleted.
    StaleFilter,
}

impl Reason {
    /// Every reason, in a fixed order.
    pub const ALL: [Reason; 11] = [
        Reason::LinkDetached,
        Reason::LinkUnpinned,
        Reason::FilterMissing,
        Reason::ProgramReplaced,
        Reason::MapEntryMissing,
        Reason::MapEntryWrong,
        Reason::VethReplaced,
        Reason::RouteMoved,
        Reason::StaleMapEntry,
        Reason::StaleLink,
        Reason::StaleFilter,
    ];

    /// The label value: `link_detached`, `link_unpinned`, `filter_missing`,
    /// `program_replaced`, `map_entry_missing`, `map_entry_wrong`,
    /// `veth_replaced`, `route_moved`, `stale_map_entry`, `stale_link`,
    /// `stale_filter`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::LinkDetached => "link_detached",
            Reason::LinkUnpinned => "link_unpinned",
            Reason::FilterMissing => "filter_missing",
            Reason::ProgramReplaced => "program_replaced",
            Reason::MapEntryMissing => "map_entry_missing",
            Reason::MapEntryWrong => "map_entry_wrong",
            Reason::VethReplaced => "veth_replaced",
            Reason::RouteMoved => "route_moved",
            Reason::StaleMapEntry => "stale_map_entry",
            Reason::StaleLink => "stale_link",
            Reason::StaleFilter => "stale_filter",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One discrepancy, with what its repair needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// What was wrong.
    pub reason: Reason,
    /// The interface (index in the node namespace) the kernel object is for.
    pub ifindex: u32,
    /// The program, for a link or filter.
    pub program: Option<Program>,
    /// The captured pod concerned (`namespace/name`), if any.
    pub workload: Option<Arc<str>>,
    /// Its host veth's name, if a pod is concerned.
    pub ifname: Option<Arc<str>>,
    /// What was seen, for the log.
    pub detail: String,
}

impl Finding {
    fn of_pod(reason: Reason, pod: &CapturedPod, program: Option<Program>, detail: String) -> Self {
        Finding {
            reason,
            ifindex: pod.ifindex,
            program,
            workload: Some(pod.workload.clone()),
            ifname: Some(pod.ifname.clone()),
            detail,
        }
    }

    fn stale(reason: Reason, ifindex: u32, program: Option<Program>, detail: String) -> Self {
        Finding {
            reason,
            ifindex,
            program,
            workload: None,
            ifname: None,
            detail,
        }
    }
}

/// What the kernel has of one of a pod's attachments (a program on its host
/// veth).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachmentFact {
    /// Attached to the host veth, running this agent's program (and pinned, for
    /// a TCX link).
    Ours,
    /// A TCX link no longer attached to the host veth (`bpf_link_info`'s
    /// `tcx.ifindex` is 0 or another interface's).
    Detached,
    /// A TCX link attached, whose pin is gone.
    Unpinned,
    /// No podlink `cls_bpf` filter for the program on the host veth.
    Missing,
    /// Attached, running the program of this id, not this agent's.
    OtherProgram(u32),
}

/// What the kernel has of one captured pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// Whether the pod's host veth index still names it (`if_indextoname(3)`
    /// gives its name).
    pub veth_exists: bool,
    /// The pod's pods-map entry (`None`: there is none).
    pub entry: Option<PodInfo>,
    /// Each program's attachment.
    pub attachments: Vec<(Program, AttachmentFact)>,
}

/// What is wrong with captured `pod` given `facts`: its host veth gone
/// ([`Reason::VethReplaced`], alone: nothing else of it matters then), its map
/// entry missing or wrong, each attachment that is not [`AttachmentFact::Ours`].
pub fn check_pod(pod: &CapturedPod, facts: &PodFacts) -> Vec<Finding> {
    if !facts.veth_exists {
        return vec![Finding::of_pod(
            Reason::VethReplaced,
            pod,
            None,
            format!("host veth {} (index {}) is gone", pod.ifname, pod.ifindex),
        )];
    }
    let mut found = Vec::new();
    match facts.entry {
        None => found.push(Finding::of_pod(
            Reason::MapEntryMissing,
            pod,
            None,
            "the pods map has no entry for the host veth".into(),
        )),
        Some(entry) if entry != pod.info() => found.push(Finding::of_pod(
            Reason::MapEntryWrong,
            pod,
            None,
            format!("the pods map's entry is {entry:?}, not {:?}", pod.info()),
        )),
        Some(_) => {}
    }
    for (program, fact) in &facts.attachments {
        let (reason, detail) = match fact {
            AttachmentFact::Ours => continue,
            AttachmentFact::Detached => (
                Reason::LinkDetached,
                format!("its {program} TCX link is pinned but no longer attached"),
            ),
            AttachmentFact::Unpinned => (
                Reason::LinkUnpinned,
                format!("its {program} TCX link lost its pin"),
            ),
            AttachmentFact::Missing => (
                Reason::FilterMissing,
                format!("podlink's {program} cls_bpf filter is missing"),
            ),
            AttachmentFact::OtherProgram(id) => (
                Reason::ProgramReplaced,
                format!("its {program} attachment runs program {id}, not this agent's"),
            ),
        };
        found.push(Finding::of_pod(reason, pod, Some(*program), detail));
    }
    found
}

/// What is wrong when `attached` (captured on its host veth) is wanted at
/// another interface (`wanted`), given whether `attached`'s host veth still
/// exists: it was replaced ([`Reason::VethReplaced`]) or the host route moved
/// ([`Reason::RouteMoved`]).
pub fn check_placement(attached: &CapturedPod, wanted: &CapturedPod, veth_exists: bool) -> Finding {
    if veth_exists {
        Finding::of_pod(
            Reason::RouteMoved,
            attached,
            None,
            format!(
                "the host route to {} leads to {} (index {}), not to the host veth it was captured on",
                wanted.addrs_text(),
                wanted.ifname,
                wanted.ifindex
            ),
        )
    } else {
        Finding::of_pod(
            Reason::VethReplaced,
            attached,
            None,
            format!(
                "host veth {} (index {}) is gone; the pod's host route leads to {} (index {})",
                attached.ifname, attached.ifindex, wanted.ifname, wanted.ifindex
            ),
        )
    }
}

/// What podlink owns in the kernel, for [`check_leftovers`].
#[derive(Debug, Default)]
pub struct Owned {
    /// Interfaces with an attached (or waiting, or adopted) pod: their map
    /// entries are wanted.
    pub interfaces: HashSet<u32>,
    /// The TCX link pins held: `(ifindex, program)`.
    pub links: HashSet<(u32, Program)>,
    /// The `cls_bpf` filters held: `(ifindex, program)`.
    pub filters: HashSet<(u32, Program)>,
}

/// What the kernel has that nothing of podlink's owns: pods-map entries
/// (`map_keys`; `None` when they are not checked), link pins (`link_pins`),
/// filters (`filters`; `None` when they could not be listed).
pub fn check_leftovers(
    owned: &Owned,
    map_keys: Option<&[u32]>,
    link_pins: &[(u32, Program)],
    filters: Option<&[(u32, Program)]>,
) -> Vec<Finding> {
    let mut found = Vec::new();
    for ifindex in map_keys.into_iter().flatten() {
        if !owned.interfaces.contains(ifindex) {
            found.push(Finding::stale(
                Reason::StaleMapEntry,
                *ifindex,
                None,
                format!("a pods map entry for interface {ifindex}, where no pod is captured"),
            ));
        }
    }
    for (ifindex, program) in link_pins {
        if !owned.links.contains(&(*ifindex, *program)) {
            found.push(Finding::stale(
                Reason::StaleLink,
                *ifindex,
                Some(*program),
                format!(
                    "a pinned {program} link for interface {ifindex}, where podlink holds none"
                ),
            ));
        }
    }
    for (ifindex, program) in filters.into_iter().flatten() {
        if !owned.filters.contains(&(*ifindex, *program)) {
            found.push(Finding::stale(
                Reason::StaleFilter,
                *ifindex,
                Some(*program),
                format!("a {program} cls_bpf filter of podlink's on interface {ifindex}, where podlink holds none"),
            ));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn pod() -> CapturedPod {
        CapturedPod {
            workload: "shop/web".into(),
            workload_id: 3,
            ipv4: Some(Ipv4Addr::new(10, 244, 1, 5)),
            ipv6: None,
            ifname: "veth5".into(),
            ifindex: 5,
            draining: false,
            dns_capture: true,
        }
    }

    fn healthy(pod: &CapturedPod) -> PodFacts {
        PodFacts {
            veth_exists: true,
            entry: Some(pod.info()),
            attachments: Program::ALL
                .into_iter()
                .map(|p| (p, AttachmentFact::Ours))
                .collect(),
        }
    }

    fn reasons(found: &[Finding]) -> Vec<(Reason, Option<Program>)> {
        found.iter().map(|f| (f.reason, f.program)).collect()
    }

    #[test]
    fn a_healthy_pod_has_no_findings() {
        let pod = pod();
        assert_eq!(check_pod(&pod, &healthy(&pod)), []);
    }

    /// Each broken invariant is named, with the program for attachments.
    #[test]
    fn each_broken_invariant_is_a_finding() {
        let pod = pod();
        let mut facts = healthy(&pod);
        facts.entry = None;
        facts.attachments[0].1 = AttachmentFact::Detached;
        assert_eq!(
            reasons(&check_pod(&pod, &facts)),
            [
                (Reason::MapEntryMissing, None),
                (Reason::LinkDetached, Some(Program::FromPod))
            ]
        );
        let mut facts = healthy(&pod);
        let mut wrong = pod.info();
        wrong.workload_id = 9;
        facts.entry = Some(wrong);
        facts.attachments[1].1 = AttachmentFact::Missing;
        assert_eq!(
            reasons(&check_pod(&pod, &facts)),
            [
                (Reason::MapEntryWrong, None),
                (Reason::FilterMissing, Some(Program::ToPod))
            ]
        );
        let mut facts = healthy(&pod);
        facts.attachments[0].1 = AttachmentFact::Unpinned;
        facts.attachments[1].1 = AttachmentFact::OtherProgram(77);
        let found = check_pod(&pod, &facts);
        assert_eq!(
            reasons(&found),
            [
                (Reason::LinkUnpinned, Some(Program::FromPod)),
                (Reason::ProgramReplaced, Some(Program::ToPod))
            ]
        );
        assert!(found[1].detail.contains("77"), "{}", found[1].detail);
        assert_eq!(found[0].workload.as_deref(), Some("shop/web"));
        assert_eq!(found[0].ifindex, 5);
    }

    /// A gone host veth is the one finding: its links and entry go with it.
    #[test]
    fn a_gone_veth_is_the_only_finding() {
        let pod = pod();
        let facts = PodFacts {
            veth_exists: false,
            entry: None,
            attachments: Program::ALL
                .into_iter()
                .map(|p| (p, AttachmentFact::Detached))
                .collect(),
        };
        assert_eq!(
            reasons(&check_pod(&pod, &facts)),
            [(Reason::VethReplaced, None)]
        );
    }

    /// Wanted elsewhere: replaced if the old veth is gone, else the route moved.
    #[test]
    fn a_pod_wanted_elsewhere_was_replaced_or_moved() {
        let attached = pod();
        let wanted = CapturedPod {
            ifindex: 9,
            ifname: "veth9".into(),
            ..pod()
        };
        let found = check_placement(&attached, &wanted, false);
        assert_eq!(found.reason, Reason::VethReplaced);
        assert_eq!(found.ifindex, 5);
        let found = check_placement(&attached, &wanted, true);
        assert_eq!(found.reason, Reason::RouteMoved);
        assert_eq!(found.ifindex, 5);
        assert!(found.detail.contains("veth9"), "{}", found.detail);
    }

    /// Entries, pins and filters nothing owns are stale; owned ones are not.
    #[test]
    fn leftovers_are_what_nothing_owns() {
        let owned = Owned {
            interfaces: [5].into(),
            links: [(5, Program::FromPod), (5, Program::ToPod)].into(),
            filters: HashSet::new(),
        };
        let found = check_leftovers(
            &owned,
            Some(&[5, 8]),
            &[
                (5, Program::FromPod),
                (5, Program::ToPod),
                (8, Program::ToPod),
            ],
            Some(&[(5, Program::FromPod)]),
        );
        assert_eq!(
            found
                .iter()
                .map(|f| (f.reason, f.ifindex, f.program))
                .collect::<Vec<_>>(),
            [
                (Reason::StaleMapEntry, 8, None),
                (Reason::StaleLink, 8, Some(Program::ToPod)),
                (Reason::StaleFilter, 5, Some(Program::FromPod)),
            ]
        );
        // Unchecked maps and filters give nothing.
        assert_eq!(check_leftovers(&owned, None, &[], None), []);
    }

    #[test]
    fn reasons_have_distinct_labels() {
        let labels: HashSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), Reason::ALL.len());
        assert_eq!(Reason::LinkDetached.to_string(), "link_detached");
    }
}
