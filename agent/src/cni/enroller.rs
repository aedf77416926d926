//! The requests of podlink-cni waiting for their answer ([`Enroller`]), and
//! the enrollment snapshot the plugin reads when no agent answers.
//!
//! The agent records the addresses the plugin reports ([`ReportedAddresses`]),
//! waits up to [`ENROLL_WAIT`] for the pod's object (re-checking on each
//! source change), reconciles at once, and answers when the pod's links
//! exist, or with the reason they do not. Pods that are not to be enrolled
//! are answered at once.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use tokio::sync::oneshot;

use super::{
    overlay::ReportedAddresses,
    protocol::{Command, ENROLL_WAIT, Reply, Request},
    snapshot::Snapshot,
    socket::Incoming,
};
use crate::{
    dataplane::CapturedPod,
    k8s::{Namespace, Pod},
    state::WorkloadIndex,
};

/// An ADD or CHECK waiting for its answer.
#[derive(Debug)]
struct Pending {
    request: Request,
    deadline: Instant,
    reply: oneshot::Sender<Reply>,
}

/// The pods the plugin told the agent about, the requests waiting for an
/// answer, and the enrollment snapshot the agent last wrote.
#[derive(Debug)]
pub struct Enroller {
    node: String,
    snapshot_path: PathBuf,
    written: Option<Snapshot>,
    /// The addresses the plugin reported.
    addresses: ReportedAddresses,
    pending: Vec<Pending>,
}

/// How complete the agent's workload source is, for answers that depend on
/// what it does not know.
#[derive(Clone, Copy)]
pub struct SourceView<'a> {
    /// Everything is listed (nothing settling, the API's first lists done).
    pub complete: bool,
    /// Whether the source has a Namespace object of this name (a manifests
    /// directory need not have one: always true there).
    pub knows_namespace: &'a dyn Fn(&str) -> bool,
}

/// The outcome of an attach attempt the reconciler reports for a pod it planned.
#[derive(Clone, Copy, Debug)]
pub struct Attached<'a> {
    /// The pods planned for capture.
    pub wanted: &'a [CapturedPod],
    /// Those attached now (`namespace/name`).
    pub captured: &'a HashSet<Arc<str>>,
    /// Those that failed, with the error.
    pub errors: &'a HashMap<String, String>,
}

impl Enroller {
    /// The state of an agent on node `node` serving `socket` (the snapshot goes
    /// beside it, see [`Snapshot::path_for`]).
    pub fn new(node: &str, socket: &Path) -> Self {
        Enroller {
            node: node.to_string(),
            snapshot_path: Snapshot::path_for(socket),
            written: None,
            addresses: ReportedAddresses::default(),
            pending: Vec::new(),
        }
    }

    /// Takes in a request: ADD records the reported addresses and waits for
    /// [`Enroller::answer`]; CHECK waits for it too; DEL forgets the pod's
    /// addresses (if reported by the same sandbox) and is answered at once.
    pub fn receive(&mut self, incoming: Incoming) {
        let Incoming { request, reply } = incoming;
        let key = request.key();
        tracing::debug!(command = ?request.command, pod = %key, ips = ?request.ips, "CNI request");
        match request.command {
            Command::Add => {
                self.addresses.report(&request);
                self.pending.push(Pending {
                    request,
                    deadline: Instant::now() + ENROLL_WAIT,
                    reply,
                });
            }
            Command::Check => self.pending.push(Pending {
                request,
                deadline: Instant::now(),
                reply,
            }),
            Command::Del => {
                self.addresses.forget(&request);
                for p in self.pending.extract_if(.., |p| {
                    p.request.key() == key && p.request.container_id == request.container_id
                }) {
                    let _ = p.reply.send(Reply::Error {
                        message: "deleted (CNI DEL) while waiting".into(),
                        retry: false,
                    });
                }
                let _ = reply.send(Reply::Removed);
            }
        }
    }

    /// The addresses the plugin reported (a layer over the source's pods).
    pub fn addresses(&self) -> &ReportedAddresses {
        &self.addresses
    }

    /// The pods (`namespace/name`) whose reported addresses changed since the
    /// last call: their workloads are to be made again.
    pub fn take_changed(&mut self) -> BTreeSet<String> {
        self.addresses.take_changed()
    }

    /// Whether requests wait for an answer (the agent reconciles for them).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// When the first waiting request times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.iter().map(|p| p.deadline).min()
    }

    /// Answers the waiting requests that can be answered after a reconcile:
    /// pods not to be enrolled, pods attached, and those whose time is up (with
    /// the reason).
    pub fn answer(&mut self, index: &WorkloadIndex, attached: Attached<'_>, view: SourceView<'_>) {
        if self.pending.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut waiting = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            let key = p.request.key();
            let expired = now >= p.deadline;
            let workload = index.get(&key);
            let reply = match workload {
                None if !expired => None,
                None => Some(Reply::Error {
                    message: if p.request.command == Command::Check {
                        "not known to the agent's workload source".to_string()
                    } else {
                        format!(
                            "not known to the agent's workload source after {} s",
                            ENROLL_WAIT.as_secs()
                        )
                    },
                    retry: true,
                }),
                Some(w) => match w.enrollment {
                    // Not enrolled as far as the agent knows: with a view still
                    // incomplete (the namespace's labels unknown), wait rather
                    // than let a pod that should be captured start uncaptured.
                    crate::state::Enrollment::NotEnrolled(_)
                        if !view.complete || !(view.knows_namespace)(&p.request.namespace) =>
                    {
                        expired.then(|| Reply::Error {
                            message: format!(
                                "the agent does not know namespace {} or has not listed every workload yet, so it cannot tell whether the pod is to be enrolled",
                                p.request.namespace
                            ),
                            retry: true,
                        })
                    }
                    crate::state::Enrollment::NotEnrolled(reason) => Some(Reply::NotEnrolled {
                        reason: reason.to_string(),
                    }),
                    crate::state::Enrollment::Enrolled if !index.is_local(w) => {
                        Some(Reply::Error {
                            message: format!(
                                "to be enrolled but its spec.nodeName is {:?}, not this agent's node {}",
                                w.node.as_deref().unwrap_or(""),
                                self.node
                            ),
                            retry: true,
                        })
                    }
                    // Another live pod claims one of its addresses (the plugin may
                    // have reported an address that is not this sandbox's): no
                    // pod is served on it, and this one is not enrolled.
                    crate::state::Enrollment::Enrolled
                        if w.ips.iter().any(|ip| index.conflict(*ip).is_some()) =>
                    {
                        expired.then(|| {
                            let claims: Vec<String> = w
                                .ips
                                .iter()
                                .filter_map(|ip| {
                                    let others: Vec<&str> = index
                                        .conflict(*ip)?
                                        .iter()
                                        .map(String::as_str)
                                        .filter(|other| *other != key)
                                        .collect();
                                    Some(format!("{ip} by {}", others.join(", ")))
                                })
                                .collect();
                            Reply::Error {
                                message: format!(
                                    "to be enrolled but its address is also claimed by another pod ({}): no pod is served on it until only one claims it",
                                    claims.join("; ")
                                ),
                                retry: true,
                            }
                        })
                    }
                    crate::state::Enrollment::Enrolled => {
                        let planned = attached
                            .wanted
                            .iter()
                            .find(|c| *c.workload == *key && !c.draining);
                        // Attached where the plugin says the pod is: its host
                        // interface and one of its addresses.
                        let here = |pod: &CapturedPod| {
                            p.request
                                .host_interface
                                .as_ref()
                                .is_none_or(|i| **i == *pod.ifname)
                                && (p.request.ips.is_empty()
                                    || pod.addrs().any(|a| p.request.ips.contains(&a)))
                        };
                        match planned {
                            Some(pod) if attached.captured.contains(key.as_str()) && here(pod) => {
                                Some(Reply::Enrolled {
                                    interface: pod.ifname.to_string(),
                                })
                            }
                            _ if !expired => None,
                            _ => {
                                // An attach that failed is podlink's error (999);
                                // a pod still waiting for its route may pass (11).
                                let retry = !attached.errors.contains_key(&key);
                                let why = match (attached.errors.get(&key), planned) {
                                    (Some(error), _) => format!("attaching failed: {error}"),
                                    (None, Some(pod)) if !here(pod) => format!(
                                        "its address {} leads to {}, not to what the plugin reported ({} {})",
                                        pod.addrs_text(),
                                        pod.ifname,
                                        p.request.host_interface.as_deref().unwrap_or("-"),
                                        p.request
                                            .ips
                                            .iter()
                                            .map(ToString::to_string)
                                            .collect::<Vec<_>>()
                                            .join(", ")
                                    ),
                                    (None, Some(pod)) => {
                                        format!("not attached to {}", pod.ifname)
                                    }
                                    (None, None) if w.ips.is_empty() => {
                                        "it has no address (neither in its object nor reported by the plugin)".into()
                                    }
                                    (None, None) => format!(
                                        "no host route to {} leads to a veth of its own on this node{}",
                                        w.ips
                                            .iter()
                                            .map(ToString::to_string)
                                            .collect::<Vec<_>>()
                                            .join(", "),
                                        p.request
                                            .host_interface
                                            .as_deref()
                                            .map(|i| format!(" (the plugin reported {i})"))
                                            .unwrap_or_default()
                                    ),
                                };
                                Some(Reply::Error {
                                    message: if p.request.command == Command::Check {
                                        format!(
                                            "to be enrolled but is not attached: {why}"
                                        )
                                    } else {
                                        format!(
                                            "to be enrolled but was not attached within {} s: {why}",
                                            ENROLL_WAIT.as_secs()
                                        )
                                    },
                                    retry,
                                })
                            }
                        }
                    }
                },
            };
            match reply {
                Some(reply) => {
                    match &reply {
                        Reply::Error { message, .. } => {
                            tracing::warn!(command = ?p.request.command, pod = %key, "CNI: {message}");
                        }
                        other => {
                            tracing::info!(command = ?p.request.command, pod = %key, reply = ?other, "CNI answered");
                        }
                    }
                    let _ = p.reply.send(reply);
                }
                None => waiting.push(p),
            }
        }
        self.pending = waiting;
    }

    /// Writes the enrollment snapshot of `pods` and `namespaces` if it changed
    /// since the last write. `complete`: the source has listed everything (an
    /// incomplete view is not written: it could make the plugin let an enrolled
    /// pod start uncaptured). Returns whether the file now holds this snapshot:
    /// false while the source is incomplete or after a failed write (logged),
    /// so that the caller asks again.
    pub fn update_snapshot<'a>(
        &mut self,
        complete: bool,
        pods: impl IntoIterator<Item = &'a Pod>,
        namespaces: impl IntoIterator<Item = &'a Namespace>,
    ) -> bool {
        if !complete {
            return false;
        }
        let snapshot = Snapshot::build(&self.node, pods, namespaces);
        if self.written.as_ref() == Some(&snapshot) {
            return true;
        }
        match snapshot.write(&self.snapshot_path) {
            Ok(()) => {
                tracing::debug!(path = %self.snapshot_path.display(), "enrollment snapshot written");
                self.written = Some(snapshot);
                true
            }
            Err(e) => {
                tracing::warn!("writing the enrollment snapshot: {e:#}");
                false
            }
        }
    }

    /// Answers every waiting request with an error (the agent stops).
    pub fn stop(&mut self) {
        for p in self.pending.drain(..) {
            let _ = p.reply.send(Reply::Error {
                message: "the agent is stopping".into(),
                retry: true,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::state::PodLayer;

    fn pod(yaml: &str) -> Pod {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn request(command: Command, name: &str, container: &str) -> Request {
        Request {
            version: 1,
            command,
            container_id: container.into(),
            namespace: "amb".into(),
            name: name.into(),
            ips: vec!["10.244.1.9".parse().unwrap()],
            host_interface: Some("veth9".into()),
        }
    }

    /// An enroller of node n1, with the directory its socket path is in.
    fn enroller() -> (tempfile::TempDir, Enroller) {
        let dir = tempfile::tempdir().unwrap();
        let e = Enroller::new("n1", &dir.path().join("cni.sock"));
        (dir, e)
    }

    /// Namespace amb, enrolled as a whole.
    fn ambient_namespace() -> Namespace {
        serde_yaml_ng::from_str("metadata: {name: amb, labels: {istio.io/dataplane-mode: ambient}}")
            .unwrap()
    }

    /// Pod amb/new captured on veth9 (ifindex 9) with the address [`request`]
    /// reports.
    fn new_on_veth9() -> CapturedPod {
        CapturedPod {
            workload: "amb/new".into(),
            workload_id: 1,
            ipv4: Some("10.244.1.9".parse().unwrap()),
            ipv6: None,
            ifname: "veth9".into(),
            ifindex: 9,
            draining: false,
            dns_capture: true,
        }
    }

    fn send(e: &mut Enroller, r: Request) -> oneshot::Receiver<Reply> {
        let (tx, rx) = oneshot::channel();
        e.receive(Incoming {
            request: r,
            reply: tx,
        });
        rx
    }

    #[test]
    fn the_overlay_gives_addresses_and_answers_follow_the_reconcile() {
        let (_dir, mut e) = enroller();
        let ns = ambient_namespace();
        let new = pod("metadata: {name: new, namespace: amb}\nspec: {nodeName: n1}");
        let out = pod(
            "metadata: {name: out, namespace: amb, labels: {istio.io/dataplane-mode: none}}\nspec: {nodeName: n1}",
        );
        let mut add = send(&mut e, request(Command::Add, "new", "c1"));
        let mut out_request = request(Command::Add, "out", "c2");
        out_request.ips = vec!["10.244.1.10".parse().unwrap()];
        let mut add_out = send(&mut e, out_request);
        let mut add_unknown = send(&mut e, request(Command::Add, "ghost", "c3"));
        // The pods whose reported addresses changed, each once.
        assert_eq!(
            e.take_changed(),
            BTreeSet::from(["amb/ghost", "amb/new", "amb/out"].map(String::from))
        );
        assert!(e.take_changed().is_empty());
        let pods: Vec<_> = [&new, &out]
            .into_iter()
            .map(|p| e.addresses().overlaid(p))
            .collect();
        assert!(matches!(pods[0], Cow::Owned(_)));
        let (index, _) = WorkloadIndex::build(
            "n1",
            "cluster.local",
            pods.iter().map(|p| p.as_ref()),
            [&ns],
        );
        let w = index.workloads().find(|w| w.name == "new").unwrap();
        assert_eq!(
            w.ips,
            vec!["10.244.1.9".parse::<std::net::IpAddr>().unwrap()]
        );

        // Not yet attached: only the opted-out pod is answered.
        let none = HashSet::new();
        let errors = HashMap::new();
        let nothing = Attached {
            wanted: &[],
            captured: &none,
            errors: &errors,
        };
        // While the view is incomplete, not even the opted-out pod is answered.
        let known = |_: &str| true;
        let full = SourceView {
            complete: true,
            knows_namespace: &known,
        };
        e.answer(
            &index,
            nothing,
            SourceView {
                complete: false,
                ..full
            },
        );
        assert!(add_out.try_recv().is_err());
        let unknown = |_: &str| false;
        e.answer(
            &index,
            nothing,
            SourceView {
                knows_namespace: &unknown,
                ..full
            },
        );
        assert!(add_out.try_recv().is_err());
        e.answer(&index, nothing, full);
        assert!(matches!(add_out.try_recv(), Ok(Reply::NotEnrolled { .. })));
        assert!(add.try_recv().is_err());
        let wanted = [new_on_veth9()];
        let captured = HashSet::from([Arc::from("amb/new")]);
        // Attached, but on another interface than the plugin reported: not
        // answered as enrolled.
        let elsewhere = [CapturedPod {
            ifname: "veth8".into(),
            ..wanted[0].clone()
        }];
        e.answer(
            &index,
            Attached {
                wanted: &elsewhere,
                captured: &captured,
                errors: &errors,
            },
            full,
        );
        assert!(add.try_recv().is_err());
        e.answer(
            &index,
            Attached {
                wanted: &wanted,
                captured: &captured,
                errors: &errors,
            },
            full,
        );
        assert_eq!(
            add.try_recv().unwrap(),
            Reply::Enrolled {
                interface: "veth9".into()
            }
        );
        assert!(add_unknown.try_recv().is_err());
        assert_eq!(e.next_deadline().is_some(), e.has_pending());
        // A CHECK of an unattached enrolled pod is answered at once.
        let mut check = send(&mut e, request(Command::Check, "new", "c1"));
        e.answer(&index, nothing, full);
        assert!(
            matches!(check.try_recv(), Ok(Reply::Error { message, .. }) if message.contains("not attached"))
        );
        // DEL of another sandbox keeps the overlay; of this one drops it; twice is fine.
        assert_eq!(
            send(&mut e, request(Command::Del, "new", "old"))
                .try_recv()
                .unwrap(),
            Reply::Removed
        );
        assert!(e.take_changed().is_empty());
        for _ in 0..2 {
            assert_eq!(
                send(&mut e, request(Command::Del, "new", "c1"))
                    .try_recv()
                    .unwrap(),
                Reply::Removed
            );
        }
        assert_eq!(e.take_changed(), BTreeSet::from(["amb/new".to_string()]));
        assert!(matches!(e.addresses().overlaid(&new), Cow::Borrowed(_)));
        e.stop();
        assert!(matches!(
            add_unknown.try_recv(),
            Ok(Reply::Error { retry: true, .. })
        ));
    }

    /// An ADD reporting an address another live pod has is not answered as
    /// enrolled, even where the pod is attached; once its time is up it is
    /// refused, naming the other pod.
    #[test]
    fn an_address_another_pod_claims_is_refused() {
        let (_dir, mut e) = enroller();
        let ns = ambient_namespace();
        let new = pod(
            "metadata: {name: new, namespace: amb}\nspec: {nodeName: n1}\nstatus: {podIP: 10.244.1.5}",
        );
        // The plugin reports 10.244.1.9, which is pod other's.
        let other = pod(
            "metadata: {name: other, namespace: amb}\nspec: {nodeName: n1}\nstatus: {podIP: 10.244.1.9}",
        );
        let mut add = send(&mut e, request(Command::Add, "new", "c1"));
        let pods: Vec<_> = [&new, &other]
            .into_iter()
            .map(|p| e.addresses().overlaid(p))
            .collect();
        let (index, warnings) = WorkloadIndex::build(
            "n1",
            "cluster.local",
            pods.iter().map(|p| p.as_ref()),
            [&ns],
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        let wanted = [new_on_veth9()];
        let captured = HashSet::from([Arc::from("amb/new")]);
        let errors = HashMap::new();
        let attached = Attached {
            wanted: &wanted,
            captured: &captured,
            errors: &errors,
        };
        let known = |_: &str| true;
        let full = SourceView {
            complete: true,
            knows_namespace: &known,
        };
        e.answer(&index, attached, full);
        assert!(add.try_recv().is_err(), "not answered while it may resolve");
        e.pending[0].deadline = Instant::now();
        e.answer(&index, attached, full);
        match add.try_recv() {
            Ok(Reply::Error { message, retry }) => {
                assert!(retry);
                assert!(message.contains("10.244.1.9 by amb/other"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}
