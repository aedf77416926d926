//! The reconciler: reads the state, plans against the node's network, applies
//! the plan to the dataplane, and answers the podlink-cni plugin.
//!
//! What it does to the kernel goes through [`Capture`] (the eBPF dataplane,
//! or a fake in unit tests); the node's network is a value
//! ([`NodeNetwork`]) read by the loop ([`run`]). A pod is planned for capture
//! when it is this node's, enrolled, and a host route to one of its addresses
//! (IPv4's first, else IPv6's) leads to a veth of its own; it is enrolled with
//! its addresses of both families. The proxy is told of the workloads before
//! anything is attached, so a pod's first connection finds the proxy knowing
//! it. What may be detached follows how complete the source's view is
//! ([`Completeness`] → [`Removal`]).

pub mod run;
#[cfg(test)]
mod tests;

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    cni::enroller::{Attached, Enroller, SourceView},
    dataplane::{CapturedPod, Dataplane, Removal, audit::Finding, netlink::NodeNetwork},
    identity::SpiffeId,
    proxy::ProxyState,
    source::CaptureReporter,
    state::{Completeness, Delta, Refreshed, State, View},
    telemetry::metrics::Metrics,
};

/// What the reconciler does to the kernel.
pub trait Capture {
    /// Why an operation failed (named in logs and CNI answers).
    type Error: std::fmt::Display;

    /// Writes the node's own addresses (connections from them are not
    /// captured).
    ///
    /// # Errors
    /// A failed map write.
    fn set_node_addrs(&mut self, addrs: &[IpAddr]) -> Result<(), Self::Error>;

    /// Makes the attachments and map entries match `wanted` (attaching new
    /// pods, adopting a previous agent's pins, detaching others as far as
    /// `removal` allows); returns the pods that could not be attached.
    fn reconcile(
        &mut self,
        wanted: &[CapturedPod],
        removal: Removal,
    ) -> Vec<(CapturedPod, Self::Error)>;

    /// Compares what the kernel has with what was attached for the pods that
    /// were captured and are still `wanted` (the plan), and with what podlink
    /// left in the kernel; returns the discrepancies. None by default.
    fn audit(&mut self, wanted: &[CapturedPod]) -> Vec<Finding> {
        let _ = wanted;
        Vec::new()
    }

    /// Repairs what `finding` found (a pod whose attachment is dropped is
    /// captured again by the next [`Capture::reconcile`]).
    ///
    /// # Errors
    /// The repair failed (it is tried again at the next audit).
    fn repair(&mut self, finding: &Finding) -> Result<(), Self::Error> {
        let _ = finding;
        Ok(())
    }
}

impl Capture for Dataplane {
    type Error = crate::dataplane::Error;

    fn set_node_addrs(&mut self, addrs: &[IpAddr]) -> Result<(), Self::Error> {
        Dataplane::set_node_addrs(self, addrs)
    }

    fn reconcile(
        &mut self,
        wanted: &[CapturedPod],
        removal: Removal,
    ) -> Vec<(CapturedPod, Self::Error)> {
        Dataplane::reconcile(self, wanted, removal)
    }

    fn audit(&mut self, wanted: &[CapturedPod]) -> Vec<Finding> {
        Dataplane::audit(self, wanted)
    }

    fn repair(&mut self, finding: &Finding) -> Result<(), Self::Error> {
        Dataplane::repair(self, finding)
    }
}

/// What may be detached when the source's view is `completeness`.
pub fn removal(completeness: Completeness) -> Removal {
    match completeness {
        Completeness::Incomplete => Removal::Nothing,
        Completeness::UnreadableParts => Removal::OwnOnly,
        Completeness::Complete => Removal::All,
    }
}

/// Retry delays for pods that wait for their host veth (or failed to attach):
/// quick at first, then slower, so a pod that never gets one costs little.
pub const PENDING_RETRY_MIN: Duration = Duration::from_millis(200);
/// See [`PENDING_RETRY_MIN`].
pub const PENDING_RETRY_MAX: Duration = Duration::from_secs(5);
/// How long an enrolled pod of this node may have no host route (its sandbox
/// starting) before the agent warns that none leads to it.
pub const NO_ROUTE_WARNING: Duration = Duration::from_secs(30);
/// A pod that leaves the mesh drains for at least this long, even when the
/// proxy carries none of its connections: a connection the programs handed
/// to a listener a moment ago may not be accepted yet.
pub const LEAVE_SETTLE: Duration = Duration::from_secs(1);

/// The self-audit runs at most this often while the planned pods stay as they
/// were (or only gain pods) and its last repairs succeeded: a change of the
/// source that does not touch this node's pods (istiod pushing another node's
/// workload), or that enrolls one more, skips it.
pub const AUDIT_INTERVAL: Duration = Duration::from_secs(1);

/// Whether every pod of `before` is in `now` as it was: `now` at most adds
/// pods, which an audit would not check yet (it checks the pods captured and
/// still planned as they were), so that enrolling one more pod does not audit
/// all the others.
fn kept(before: &[CapturedPod], now: &[CapturedPod]) -> bool {
    let now: HashMap<&str, &CapturedPod> = now.iter().map(|p| (&*p.workload, p)).collect();
    before
        .iter()
        .all(|p| now.get(&*p.workload).is_some_and(|n| *n == p))
}

/// The last self-audit: when, of which planned pods, whether every repair
/// succeeded.
struct LastAudit {
    at: Instant,
    wanted: Vec<CapturedPod>,
    repaired: bool,
}

/// How pods that leave the mesh drain ([`Reconciler::drain_leaving`]).
pub struct LeaveDrain {
    /// How long a leaving pod's connections through the proxy may go on; zero:
    /// none, the pod is detached at once.
    pub bound: Duration,
    /// How long a leaving pod drains at least ([`LEAVE_SETTLE`] in the agent).
    pub settle: Duration,
    /// Whether the proxy carries a connection of the pod at an address.
    pub carries: Box<dyn Fn(IpAddr) -> bool + Send + Sync>,
}

/// The reconciler's state between two rounds.
pub struct Reconciler<C: Capture> {
    /// What the source sent, and the indexes made from it.
    pub state: State,
    /// The dataplane.
    pub capture: C,
    /// The pods podlink-cni told about: their reported addresses, the requests
    /// waiting for an answer, the enrollment snapshot.
    pub cni: Enroller,
    /// Tells the cluster which pods are captured (the Kubernetes source).
    reporter: Option<Box<dyn CaptureReporter>>,
    /// Whether the source lists every Namespace ([`crate::source::Source`]).
    lists_every_namespace: bool,
    /// Stable numbers of workloads (`namespace/name`) for the pods map.
    workload_ids: HashMap<String, u32>,
    next_id: u32,
    /// Some enrolled pod is not attached yet (no host veth, or an error): retry
    /// after this long.
    pending_retry: Option<Duration>,
    /// The enrollment snapshot may be out of date (not written while the
    /// source was incomplete, or its write failed): write it at the next change.
    snapshot_due: bool,
    /// The pods to capture, as last planned.
    wanted: Vec<CapturedPod>,
    /// Some pod waits for its host route (or the network could not be read).
    waiting: bool,
    /// Workloads already warned about (warnings are given once).
    warned: HashSet<String>,
    /// The index's [`crate::state::WorkloadIndex::removals`] when
    /// `workload_ids`, `warned` and `no_route_since` last dropped the workloads
    /// it no longer has.
    pruned_at: Option<u64>,
    /// When each enrolled local pod without a host route was first seen so
    /// ([`NO_ROUTE_WARNING`]).
    no_route_since: HashMap<String, Instant>,
    /// The planned pods attached by the last apply (`namespace/name`).
    attached: HashSet<Arc<str>>,
    /// The planned pods whose attach failed in the last apply, with the error.
    attach_errors: HashMap<String, String>,
    /// The host veths (ifindex) whose attach failed in the last apply: their
    /// names may have changed ([`Reconciler::take_failed_interfaces`]).
    failed_interfaces: Vec<u32>,
    /// How pods leaving the mesh drain.
    leave_drain: LeaveDrain,
    /// The pods leaving the mesh (by host veth ifindex), since when.
    leaving: HashMap<u32, Instant>,
    /// Where repairs are counted (`podlink_repairs_total`).
    metrics: Option<Arc<Metrics>>,
    /// The last self-audit ([`AUDIT_INTERVAL`]).
    last_audit: Option<LastAudit>,
}

impl<C: Capture> Reconciler<C> {
    /// A reconciler of `state` through `capture`, answering podlink-cni with
    /// `cni`; `reporter` and `lists_every_namespace` come from the source.
    pub fn new(
        state: State,
        capture: C,
        cni: Enroller,
        reporter: Option<Box<dyn CaptureReporter>>,
        lists_every_namespace: bool,
    ) -> Self {
        Reconciler {
            state,
            capture,
            cni,
            reporter,
            lists_every_namespace,
            workload_ids: HashMap::new(),
            next_id: 1,
            pending_retry: None,
            snapshot_due: false,
            wanted: Vec::new(),
            waiting: false,
            warned: HashSet::new(),
            pruned_at: None,
            no_route_since: HashMap::new(),
            attached: HashSet::new(),
            attach_errors: HashMap::new(),
            failed_interfaces: Vec::new(),
            leave_drain: LeaveDrain {
                bound: Duration::ZERO,
                settle: LEAVE_SETTLE,
                carries: Box::new(|_| false),
            },
            leaving: HashMap::new(),
            metrics: None,
            last_audit: None,
        }
    }

    /// Drains pods that leave the mesh as `leave_drain` says (by default they
    /// are detached at once).
    pub fn with_leave_drain(mut self, leave_drain: LeaveDrain) -> Self {
        self.leave_drain = leave_drain;
        self
    }

    /// Counts the self-audit's repairs in `metrics` from now on.
    pub fn count_repairs_in(&mut self, metrics: Arc<Metrics>) {
        self.metrics = Some(metrics);
    }

    /// Takes in a source's delta (made into indexes by the next
    /// [`Reconciler::refresh`]).
    pub fn apply_delta(&mut self, delta: Delta) {
        self.state.apply(delta);
    }

    /// Makes the state's indexes again from the deltas and the addresses
    /// podlink-cni reported since the last refresh, and writes the enrollment
    /// snapshot when the enrollment labels may have changed.
    pub fn refresh(&mut self) -> Refreshed {
        let reported = self.cni.take_changed();
        let refreshed = self.state.refresh(self.cni.addresses(), reported);
        if refreshed.enrollment_labels || self.snapshot_due {
            let complete = self.state.completeness() == Completeness::Complete;
            self.snapshot_due =
                !self
                    .cni
                    .update_snapshot(complete, self.state.pods(), self.state.namespaces());
        }
        refreshed
    }

    /// When to try again, while some enrolled pod is not attached.
    pub fn pending_retry(&self) -> Option<Duration> {
        self.pending_retry
    }

    /// The pods planned for capture.
    pub fn wanted(&self) -> &[CapturedPod] {
        &self.wanted
    }

    /// The host veths (ifindex) whose attach failed in the last apply: their
    /// names may have changed, to be asked again.
    pub fn take_failed_interfaces(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.failed_interfaces)
    }

    /// Notes that the node's network could not be read: a retry is due.
    pub fn network_unread(&mut self) {
        self.waiting = true;
    }

    /// Decides which pods to capture (their host veths) from the state and
    /// the node's `network`.
    pub fn plan(&mut self, network: &NodeNetwork) {
        self.wanted = self.wanted_pods(network);
    }

    /// Hands the proxy the workloads, the policies, the Services, the cluster's
    /// ranges, the DNS names and the planned pods' addresses (before anything is attached: a pod's first
    /// connection finds the proxy knowing it), and the certificates it needs.
    pub fn publish(&self, proxy: &ProxyState) {
        let addrs = |draining: bool| -> HashSet<IpAddr> {
            self.wanted
                .iter()
                .filter(|p| p.draining == draining)
                .flat_map(CapturedPod::addrs)
                .collect()
        };
        let (captured, draining) = (addrs(false), addrs(true));
        let view = proxy.view();
        let index = self.state.workloads();
        if !Arc::ptr_eq(&view.workloads, index)
            || !Arc::ptr_eq(&view.policies, self.state.policies())
            || !Arc::ptr_eq(&view.services, self.state.services())
            || *view.captured != captured
            || *view.draining != draining
            || !Arc::ptr_eq(&view.ranges, self.state.ranges())
            || !Arc::ptr_eq(&view.names, self.state.names())
        {
            proxy.update(View {
                workloads: index.clone(),
                captured: Arc::new(captured),
                draining: Arc::new(draining),
                policies: self.state.policies().clone(),
                services: self.state.services().clone(),
                ranges: self.state.ranges().clone(),
                names: self.state.names().clone(),
            });
            // Certificates are only needed for this node's enrolled workloads
            // (often many pods to one identity: each is copied once).
            let local: HashSet<&SpiffeId> = index
                .workloads()
                .filter(|w| w.enrollment.is_enrolled() && index.is_local(w))
                .map(|w| &w.identity)
                .collect();
            proxy.certs.retain(|id| local.contains(id));
            proxy.certs.prefetch(local.into_iter().cloned());
        }
    }

    /// Attaches the planned pods and detaches the others as far as the
    /// source's completeness allows; tells the reporter which pods are
    /// captured (once the source's view is whole); schedules a retry while
    /// some pod waits.
    pub fn apply(&mut self, network: &NodeNetwork) {
        let removal = removal(self.state.completeness());
        let mut retry = std::mem::take(&mut self.waiting);
        if let Err(e) = self.capture.set_node_addrs(&network.addrs) {
            tracing::warn!("writing node addresses: {e:#}");
        }
        if removal != Removal::All {
            tracing::debug!(
                ?removal,
                "workload source incomplete for now: detaching less"
            );
        }
        let mut captured: HashSet<Arc<str>> = self
            .wanted
            .iter()
            .filter(|p| !p.draining)
            .map(|p| p.workload.clone())
            .collect();
        self.attach_errors.clear();
        self.failed_interfaces.clear();
        let due = self.last_audit.as_ref().is_none_or(|last| {
            !last.repaired
                || !kept(&last.wanted, &self.wanted)
                || last.at.elapsed() >= AUDIT_INTERVAL
        });
        if due {
            let repaired = self.audit_and_repair();
            self.last_audit = Some(LastAudit {
                at: Instant::now(),
                wanted: self.wanted.clone(),
                repaired,
            });
            retry |= !repaired;
        }
        for (pod, error) in self.capture.reconcile(&self.wanted, removal) {
            tracing::warn!(workload = %pod.workload, ifname = %pod.ifname, "capture failed: {error:#}");
            captured.remove(&pod.workload);
            self.attach_errors
                .insert(pod.workload.to_string(), format!("{error:#}"));
            self.failed_interfaces.push(pod.ifindex);
            retry = true;
        }
        // Only a whole view may tell that a pod is not captured: a pod the
        // state does not know yet may still be (a previous agent's pins).
        if removal == Removal::All
            && let Some(reporter) = &mut self.reporter
        {
            reporter.captured(&captured);
        }
        self.attached = captured;
        // What is kept per workload goes with it.
        let index = self.state.workloads();
        if self.pruned_at != Some(index.removals()) {
            self.workload_ids.retain(|k, _| index.get(k).is_some());
            self.warned.retain(|k| index.get(k).is_some());
            self.no_route_since.retain(|k, _| index.get(k).is_some());
            self.pruned_at = Some(index.removals());
        }
        self.pending_retry = (retry || removal == Removal::Nothing).then(|| {
            self.pending_retry
                .map_or(PENDING_RETRY_MIN, |d| (d * 2).min(PENDING_RETRY_MAX))
        });
    }

    /// The self-audit, before attaching (once per [`AUDIT_INTERVAL`] while
    /// the planned pods stay as they were): each discrepancy between the kernel and
    /// what was attached for the planned pods ([`Capture::audit`]) is logged (a
    /// warning naming it), repaired and counted (`podlink_repairs_total`). A pod
    /// whose attachment the repair dropped (its host veth replaced, its host
    /// route moved) is captured again by the reconcile that follows. Returns
    /// false if a repair failed (tried again at the next audit).
    fn audit_and_repair(&mut self) -> bool {
        let mut repaired = true;
        for finding in self.capture.audit(&self.wanted) {
            let workload = finding.workload.as_deref().unwrap_or("-");
            let ifname = finding.ifname.as_deref().unwrap_or("-");
            let program = finding.program.map_or("-", |p| p.name());
            tracing::warn!(
                reason = %finding.reason,
                workload,
                ifname,
                ifindex = finding.ifindex,
                program,
                "audit: {}; repairing",
                finding.detail
            );
            match self.capture.repair(&finding) {
                Ok(()) => {
                    if let Some(metrics) = &self.metrics {
                        metrics.repaired(finding.reason);
                    }
                }
                Err(e) => {
                    tracing::warn!(reason = %finding.reason, workload, ifname, "repair failed: {e:#}");
                    repaired = false;
                }
            }
        }
        repaired
    }

    /// Answers the podlink-cni requests the last apply settled.
    pub fn answer_cni(&mut self) {
        let state = &self.state;
        let lists_every_namespace = self.lists_every_namespace;
        self.cni.answer(
            state.workloads(),
            Attached {
                wanted: &self.wanted,
                captured: &self.attached,
                errors: &self.attach_errors,
            },
            SourceView {
                complete: state.completeness() == Completeness::Complete,
                knows_namespace: &|ns| !lists_every_namespace || state.has_namespace(ns),
            },
        );
    }

    /// Warns once per workload.
    fn warn_once(&mut self, key: &str, message: &str) {
        if self.warned.insert(key.to_string()) {
            tracing::warn!(workload = %key, "{message}");
        }
    }

    /// The pods to capture: this node's enrolled workloads with a host route to a
    /// veth of their own, from their IPv4 address or else their IPv6 one, each
    /// with its addresses of both families. Sets `waiting` when some have none
    /// yet.
    fn wanted_pods(&mut self, network: &NodeNetwork) -> Vec<CapturedPod> {
        let index = self.state.workloads().clone();
        let mut wanted: Vec<CapturedPod> = Vec::with_capacity(self.wanted.len() + 1);
        let mut owners: HashMap<u32, &str> = HashMap::with_capacity(self.wanted.len() + 1);
        for workload in index.captured() {
            let key = workload.key();
            let (ipv4, ipv6) = (workload.ipv4(), workload.ipv6());
            // No allocation per pod and round: an array of both families.
            let families = [ipv4.map(IpAddr::V4), ipv6.map(IpAddr::V6)];
            let addrs = || families.iter().flatten();
            if addrs().next().is_none() {
                self.warn_once(
                    key,
                    "enrolled pod has neither an IPv4 nor an IPv6 address of its own (only IPv4-mapped ones); not capturing it",
                );
                continue;
            }
            // The first address with a host route (IPv4's when both have one).
            let Some((routed, ifindex)) =
                addrs().find_map(|a| Some((*a, *network.host_routes.get(a)?)))
            else {
                let shown = addrs()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",");
                tracing::debug!(workload = %key, ip = %shown, "no host route to this pod yet");
                self.waiting = true;
                let since = *self
                    .no_route_since
                    .entry(key.to_string())
                    .or_insert_with(Instant::now);
                if since.elapsed() >= NO_ROUTE_WARNING {
                    self.warn_once(key, &format!("enrolled pod at {shown} has had no host route for {} s: no veth of this node leads to it (is it running here?); it is captured once one does", NO_ROUTE_WARNING.as_secs()));
                }
                continue;
            };
            // A dual-stack pod's other host route leads to the same veth.
            if let Some((other, other_index)) = addrs()
                .filter(|a| **a != routed)
                .find_map(|a| Some((*a, *network.host_routes.get(a)?)))
                && other_index != ifindex
            {
                self.warn_once(key, &format!("the node's host routes to {routed} and {other} lead to different interfaces ({ifindex}, {other_index}); capturing it on the first"));
            }
            if !self.no_route_since.is_empty() {
                self.no_route_since.remove(key);
            }
            if network.unresolved.contains(&ifindex) {
                self.waiting = true;
                continue;
            }
            let Some(ifname) = network.veths.get(&ifindex) else {
                self.warn_once(key, &format!("the node's host route to {routed} leads to interface {ifindex}, which is not a veth; not capturing it"));
                continue;
            };
            if let Some(other) = owners.get(&ifindex) {
                self.warn_once(
                    key,
                    &format!(
                        "{other} already owns host veth {ifname}; not capturing a second pod on it"
                    ),
                );
                continue;
            }
            owners.insert(ifindex, key);
            let workload_id = match self.workload_ids.get(key) {
                Some(&id) => id,
                None => {
                    self.next_id += 1;
                    self.workload_ids.insert(key.to_string(), self.next_id - 1);
                    self.next_id - 1
                }
            };
            wanted.push(CapturedPod {
                workload: workload.key.clone(),
                workload_id,
                ipv4,
                ipv6,
                ifname: ifname.clone(),
                ifindex,
                draining: false,
                dns_capture: workload.dns_capture,
            });
        }
        self.drain_leaving(network, &mut wanted);
        wanted
    }

    /// Adds to `wanted` the pods that left the mesh (planned before, not now)
    /// whose host veth is still there, marked draining: the flows the proxy
    /// carries for them go on through it, new ones are not captured. A pod
    /// drains for at least [`LeaveDrain::settle`], then until the proxy carries none
    /// of its connections or [`LeaveDrain::bound`] has passed; then it is
    /// detached (its remaining connections closed). Planned again, it is no
    /// longer draining. While the source settles ([`Removal::Nothing`]) a pod
    /// missing from it is kept as it was.
    fn drain_leaving(&mut self, network: &NodeNetwork, wanted: &mut Vec<CapturedPod>) {
        let bound = self.leave_drain.bound;
        if bound.is_zero() {
            return;
        }
        let settling = removal(self.state.completeness()) == Removal::Nothing;
        let planned: HashSet<u32> = wanted.iter().map(|p| p.ifindex).collect();
        let now = Instant::now();
        let mut leaving = HashMap::new();
        for pod in &self.wanted {
            if planned.contains(&pod.ifindex)
                || network.veths.get(&pod.ifindex) != Some(&pod.ifname)
            {
                continue;
            }
            let since = match self.leaving.get(&pod.ifindex) {
                Some(since) => *since,
                None if settling => {
                    wanted.push(pod.clone());
                    continue;
                }
                None => {
                    tracing::info!(workload = %pod.workload, ifname = %pod.ifname, "left the mesh: its connections through the proxy drain (up to {}), new ones go direct", humantime::format_duration(bound));
                    now
                }
            };
            let drained = now.saturating_duration_since(since);
            if drained >= bound {
                tracing::info!(workload = %pod.workload, ifname = %pod.ifname, "left the mesh {} ago: closing its remaining connections through the proxy", humantime::format_duration(bound));
                continue;
            }
            if drained >= self.leave_drain.settle
                && !pod.addrs().any(|a| (self.leave_drain.carries)(a))
            {
                tracing::info!(workload = %pod.workload, ifname = %pod.ifname, "drained: the proxy carries none of its connections");
                continue;
            }
            leaving.insert(pod.ifindex, since);
            wanted.push(CapturedPod {
                draining: true,
                ..pod.clone()
            });
        }
        self.leaving = leaving;
    }
}
