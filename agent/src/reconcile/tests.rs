//! The reconciler's decisions against a fake dataplane: which pods are
//! attached, kept across a restart and detached, what podlink-cni is told,
//! what happens on an attach error. No root needed.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, Mutex},
};

use tokio::sync::oneshot;

use super::*;
use crate::{
    cni::{
        protocol::{Command, Reply, Request},
        socket::Incoming,
    },
    k8s::{Namespace, Pod},
};

/// A fake dataplane with the contract of [`Dataplane::reconcile`]: wanted
/// pods are attached (those on `failing` interfaces fail), and unwanted ones
/// detached as far as the removal allows; pods a previous agent attached
/// (`adopted`) are not this agent's own.
#[derive(Default)]
struct FakeCapture {
    /// Attached pods by host veth ifindex, with whether this agent attached
    /// them.
    attached: BTreeMap<u32, (CapturedPod, bool)>,
    /// Host veths whose attach fails.
    failing: HashSet<String>,
    node_addrs: Vec<IpAddr>,
    /// What the audit finds until it is repaired.
    broken: Vec<Finding>,
    /// Whether repairs fail.
    repairs_fail: bool,
    /// The calls made, in order: `audit`, `repair`, `reconcile`.
    calls: Vec<&'static str>,
}

impl FakeCapture {
    /// As an agent restarting finds it: `pods` captured by the previous agent.
    fn adopting(pods: &[CapturedPod]) -> Self {
        FakeCapture {
            attached: pods
                .iter()
                .map(|p| (p.ifindex, (p.clone(), false)))
                .collect(),
            ..FakeCapture::default()
        }
    }

    fn names(&self) -> Vec<&str> {
        self.attached.values().map(|(p, _)| &*p.workload).collect()
    }
}

impl Capture for FakeCapture {
    type Error = String;

    fn set_node_addrs(&mut self, addrs: &[IpAddr]) -> Result<(), String> {
        self.node_addrs = addrs.to_vec();
        Ok(())
    }

    fn reconcile(
        &mut self,
        wanted: &[CapturedPod],
        removal: Removal,
    ) -> Vec<(CapturedPod, String)> {
        self.calls.push("reconcile");
        let wanted_ifindexes: HashSet<u32> = wanted.iter().map(|p| p.ifindex).collect();
        self.attached.retain(|ifindex, (_, own)| {
            wanted_ifindexes.contains(ifindex)
                || match removal {
                    Removal::All => false,
                    Removal::OwnOnly => !*own,
                    Removal::Nothing => true,
                }
        });
        let mut failures = Vec::new();
        for pod in wanted {
            if self.failing.contains(&*pod.ifname) {
                failures.push((pod.clone(), format!("attaching to {}: refused", pod.ifname)));
                continue;
            }
            let own = self.attached.get(&pod.ifindex).is_none_or(|(_, own)| *own);
            self.attached.insert(pod.ifindex, (pod.clone(), own));
        }
        failures
    }

    fn audit(&mut self, _wanted: &[CapturedPod]) -> Vec<Finding> {
        self.calls.push("audit");
        self.broken.clone()
    }

    fn repair(&mut self, finding: &Finding) -> Result<(), String> {
        self.calls.push("repair");
        if self.repairs_fail {
            return Err("refused".into());
        }
        self.broken.retain(|f| f != finding);
        Ok(())
    }
}

/// Records what the reporter was told.
#[derive(Clone, Default)]
struct Reported(Arc<Mutex<Vec<Vec<String>>>>);

impl CaptureReporter for Reported {
    fn captured(&mut self, captured: &HashSet<Arc<str>>) {
        let mut names: Vec<String> = captured.iter().map(|c| c.to_string()).collect();
        names.sort();
        self.0.lock().unwrap().push(names);
    }
}

fn pod(name: &str, ip: &str) -> Pod {
    serde_yaml_ng::from_str(&format!(
        "metadata: {{name: {name}, namespace: amb}}\nspec: {{nodeName: n1}}\nstatus: {{podIP: {ip}}}"
    ))
    .unwrap()
}

fn ambient() -> Namespace {
    serde_yaml_ng::from_str("metadata: {name: amb, labels: {istio.io/dataplane-mode: ambient}}")
        .unwrap()
}

/// A node with host routes from each address to a veth (`vethN` with
/// ifindex N).
fn network(routes: &[(&str, u32)]) -> NodeNetwork {
    NodeNetwork {
        host_routes: routes
            .iter()
            .map(|(ip, i)| (ip.parse().unwrap(), *i))
            .collect(),
        veths: routes
            .iter()
            .map(|(_, i)| (*i, Arc::from(format!("veth{i}"))))
            .collect(),
        addrs: vec!["192.0.2.1".parse().unwrap()],
        ..NodeNetwork::default()
    }
}

struct Bed {
    reconciler: Reconciler<FakeCapture>,
    reported: Reported,
    _dir: tempfile::TempDir,
}

fn bed(capture: FakeCapture) -> Bed {
    let dir = tempfile::tempdir().unwrap();
    let reported = Reported::default();
    let reconciler = Reconciler::new(
        State::new("n1", "cluster.local", "istio-system"),
        capture,
        Enroller::new("n1", &dir.path().join("cni.sock")),
        Some(Box::new(reported.clone())),
        true,
    );
    Bed {
        reconciler,
        reported,
        _dir: dir,
    }
}

impl Bed {
    /// One round as the loop runs it.
    fn round(&mut self, delta: Option<Delta>, network: &NodeNetwork) {
        if let Some(delta) = delta {
            self.reconciler.apply_delta(delta);
        }
        self.reconciler.refresh();
        self.reconciler.plan(network);
        self.reconciler.apply(network);
        self.reconciler.answer_cni();
    }

    fn attached(&self) -> Vec<&str> {
        self.reconciler.capture.names()
    }
}

fn all(pods: Vec<Pod>, completeness: Completeness) -> Delta {
    Delta {
        all_pods: Some(pods),
        namespaces: Some(vec![ambient()]),
        completeness,
        ..Delta::default()
    }
}

fn captured(name: &str, ip: &str, ifindex: u32) -> CapturedPod {
    CapturedPod {
        workload: Arc::from(format!("amb/{name}")),
        workload_id: 1,
        ipv4: Some(ip.parse().unwrap()),
        ipv6: None,
        ifname: Arc::from(format!("veth{ifindex}")),
        ifindex,
        draining: false,
        dns_capture: true,
    }
}

/// This node's enrolled pods with a host route to a veth of their own are
/// attached, with stable workload ids; a pod without a route waits and is
/// retried; an opted-out pod is left alone.
#[test]
fn enrolled_pods_with_a_host_veth_are_attached() {
    let mut b = bed(FakeCapture::default());
    let mut out = pod("out", "10.0.0.3");
    out.metadata.labels =
        Some([("istio.io/dataplane-mode".to_string(), "none".to_string())].into());
    let net = network(&[("10.0.0.1", 1), ("10.0.0.3", 3)]);
    b.round(
        Some(all(
            vec![pod("web", "10.0.0.1"), pod("late", "10.0.0.2"), out],
            Completeness::Complete,
        )),
        &net,
    );
    assert_eq!(b.attached(), ["amb/web"]);
    assert_eq!(b.reconciler.capture.node_addrs, net.addrs);
    assert!(b.reconciler.pending_retry().is_some(), "amb/late waits");
    let id_of = |b: &Bed, name: &str| {
        b.reconciler
            .wanted()
            .iter()
            .find(|p| &*p.workload == name)
            .map(|p| p.workload_id)
    };
    let id = id_of(&b, "amb/web");
    // Its route appears: attached too, the first keeping its id.
    let net = network(&[("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.3", 3)]);
    b.round(None, &net);
    assert_eq!(b.attached(), ["amb/web", "amb/late"]);
    assert_eq!(id_of(&b, "amb/web"), id);
    assert_ne!(id_of(&b, "amb/late"), id);
    assert_eq!(b.reconciler.pending_retry(), None);
    assert_eq!(
        b.reported.0.lock().unwrap().last().unwrap(),
        &["amb/late", "amb/web"]
    );
}

/// Across a restart, what the previous agent captured stays while the source
/// is incomplete, and only this agent's own attachments go while part of it
/// cannot be read; once it is complete, pods it lacks are detached.
#[test]
fn a_restart_keeps_pods_until_the_source_is_complete() {
    let previous = [
        captured("web", "10.0.0.1", 1),
        captured("gone", "10.0.0.9", 9),
    ];
    let mut b = bed(FakeCapture::adopting(&previous));
    let net = network(&[("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.9", 9)]);
    b.round(Some(all(Vec::new(), Completeness::Incomplete)), &net);
    assert_eq!(b.attached(), ["amb/web", "amb/gone"]);
    assert!(
        b.reconciler.pending_retry().is_some(),
        "retried while incomplete"
    );
    // Nothing is reported uncaptured from a view that is not whole.
    assert!(b.reported.0.lock().unwrap().is_empty());
    // A pod of this agent's own, then gone, while a file is broken: its
    // attachment goes, the previous agent's stay.
    b.round(
        Some(all(
            vec![pod("new", "10.0.0.2")],
            Completeness::UnreadableParts,
        )),
        &net,
    );
    assert_eq!(b.attached(), ["amb/web", "amb/new", "amb/gone"]);
    b.round(Some(all(Vec::new(), Completeness::UnreadableParts)), &net);
    assert_eq!(b.attached(), ["amb/web", "amb/gone"]);
    assert!(b.reported.0.lock().unwrap().is_empty());
    b.round(
        Some(all(vec![pod("web", "10.0.0.1")], Completeness::Complete)),
        &net,
    );
    assert_eq!(b.attached(), ["amb/web"]);
    assert_eq!(b.reported.0.lock().unwrap().as_slice(), [["amb/web"]]);
}

fn add(name: &str, ip: &str, veth: &str) -> (Incoming, oneshot::Receiver<Reply>) {
    let (tx, rx) = oneshot::channel();
    let request = Request {
        version: 1,
        command: Command::Add,
        container_id: format!("c-{name}"),
        namespace: "amb".into(),
        name: name.into(),
        ips: vec![ip.parse().unwrap()],
        host_interface: Some(veth.into()),
    };
    (Incoming { request, reply: tx }, rx)
}

/// A CNI ADD for a pod whose object has no address yet: the reported address
/// stands in, the pod is attached and the plugin told so.
#[test]
fn a_cni_add_is_answered_once_attached() {
    let mut b = bed(FakeCapture::default());
    let net = network(&[("10.0.0.4", 4)]);
    let bare: Pod =
        serde_yaml_ng::from_str("metadata: {name: new, namespace: amb}\nspec: {nodeName: n1}")
            .unwrap();
    b.round(Some(all(vec![bare], Completeness::Complete)), &net);
    assert!(b.attached().is_empty());
    let (incoming, mut reply) = add("new", "10.0.0.4", "veth4");
    b.reconciler.cni.receive(incoming);
    b.round(None, &net);
    assert_eq!(b.attached(), ["amb/new"]);
    assert_eq!(
        reply.try_recv().unwrap(),
        Reply::Enrolled {
            interface: "veth4".into()
        }
    );
}

/// An attach that fails leaves the pod uncaptured (not reported captured),
/// asks for a retry with growing delays, names the interface for the loop to
/// look up again, and the plugin is told why once its wait is over.
#[test]
fn an_attach_error_is_retried_and_told() {
    let mut capture = FakeCapture::default();
    capture.failing.insert("veth5".into());
    let mut b = bed(capture);
    let net = network(&[("10.0.0.5", 5)]);
    let (incoming, mut reply) = add("web", "10.0.0.5", "veth5");
    b.reconciler.cni.receive(incoming);
    b.round(
        Some(all(vec![pod("web", "10.0.0.5")], Completeness::Complete)),
        &net,
    );
    assert!(b.attached().is_empty());
    assert_eq!(
        b.reported.0.lock().unwrap().last().unwrap(),
        &[] as &[String]
    );
    assert_eq!(b.reconciler.take_failed_interfaces(), [5]);
    let first = b.reconciler.pending_retry().unwrap();
    assert!(
        reply.try_recv().is_err(),
        "answered only once its wait is over"
    );
    b.round(None, &net);
    assert!(b.reconciler.pending_retry().unwrap() > first);
    // Its wait over (a CHECK is answered at once): told why.
    let (tx, mut check) = oneshot::channel();
    let mut request = add("web", "10.0.0.5", "veth5").0.request;
    request.command = Command::Check;
    b.reconciler.cni.receive(Incoming { request, reply: tx });
    b.round(None, &net);
    match check.try_recv() {
        Ok(Reply::Error { message, retry }) => {
            assert!(!retry, "podlink's own error");
            assert!(message.contains("attaching to veth5: refused"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Once the attach works, the pod is captured and no retry is due.
    b.reconciler.capture.failing.clear();
    b.round(None, &net);
    assert_eq!(b.attached(), ["amb/web"]);
    assert_eq!(b.reconciler.pending_retry(), None);
    assert_eq!(
        reply.try_recv().unwrap(),
        Reply::Enrolled {
            interface: "veth5".into()
        }
    );
}

/// Two pods routed to one host veth: only the first is captured.
#[test]
fn a_host_veth_is_captured_for_one_pod() {
    let mut b = bed(FakeCapture::default());
    let mut net = network(&[("10.0.0.1", 1)]);
    net.host_routes.insert("10.0.0.2".parse().unwrap(), 1);
    b.round(
        Some(all(
            vec![pod("a", "10.0.0.1"), pod("b", "10.0.0.2")],
            Completeness::Complete,
        )),
        &net,
    );
    assert_eq!(b.attached(), ["amb/a"]);
    let counts: HashMap<u32, usize> =
        b.reconciler
            .wanted()
            .iter()
            .fold(HashMap::new(), |mut m, p| {
                *m.entry(p.ifindex).or_default() += 1;
                m
            });
    assert_eq!(counts, HashMap::from([(1, 1)]));
}

/// A pod with the addresses `ips` (`status.podIPs`, in order).
fn pod_with_ips(name: &str, ips: &[&str]) -> Pod {
    let listed: Vec<String> = ips.iter().map(|ip| format!("{{ip: '{ip}'}}")).collect();
    serde_yaml_ng::from_str(&format!(
        "metadata: {{name: {name}, namespace: amb}}\nspec: {{nodeName: n1}}\nstatus: {{podIP: '{}', podIPs: [{}]}}",
        ips[0],
        listed.join(", ")
    ))
    .unwrap()
}

/// A dual-stack pod is enrolled with both addresses on the host veth its IPv4
/// host route leads to, and the proxy is told of both; an IPv6-only pod through
/// its IPv6 host route; the node's IPv6 addresses are written with IPv4's.
#[test]
fn dual_stack_and_ipv6_only_pods_are_enrolled() {
    let mut b = bed(FakeCapture::default());
    let mut net = network(&[
        ("10.0.0.1", 1),
        ("fd00::1", 1),
        ("fd00::2", 2),
        ("fd00::3", 3),
    ]);
    net.addrs.push("2001:db8::1".parse().unwrap());
    b.round(
        Some(all(
            vec![
                pod_with_ips("dual", &["10.0.0.1", "fd00::1"]),
                pod_with_ips("six", &["fd00::2"]),
                // Its IPv4 route is missing: the IPv6 one leads to its veth.
                pod_with_ips("late4", &["10.0.0.3", "fd00::3"]),
            ],
            Completeness::Complete,
        )),
        &net,
    );
    assert_eq!(b.attached(), ["amb/dual", "amb/six", "amb/late4"]);
    let by_name = |b: &Bed, name: &str| {
        b.reconciler
            .wanted()
            .iter()
            .find(|p| &*p.workload == name)
            .cloned()
            .unwrap()
    };
    let dual = by_name(&b, "amb/dual");
    assert_eq!(
        (dual.ipv4, dual.ipv6, dual.ifindex),
        (
            Some("10.0.0.1".parse().unwrap()),
            Some("fd00::1".parse().unwrap()),
            1
        )
    );
    let six = by_name(&b, "amb/six");
    assert_eq!(
        (six.ipv4, six.ipv6, six.ifindex),
        (None, Some("fd00::2".parse().unwrap()), 2)
    );
    assert_eq!(six.addrs_text(), "fd00::2");
    assert_eq!(by_name(&b, "amb/late4").ifindex, 3);
    assert_eq!(b.reconciler.capture.node_addrs, net.addrs);
    assert_eq!(b.reconciler.pending_retry(), None);
}

/// A dual-stack pod whose two host routes lead to different interfaces is
/// captured on its IPv4 route's veth (and warned about, once).
#[test]
fn a_dual_stack_pod_follows_its_ipv4_route() {
    let mut b = bed(FakeCapture::default());
    let net = network(&[("10.0.0.1", 1), ("fd00::1", 2)]);
    b.round(
        Some(all(
            vec![pod_with_ips("dual", &["fd00::1", "10.0.0.1"])],
            Completeness::Complete,
        )),
        &net,
    );
    assert_eq!(b.attached(), ["amb/dual"]);
    assert_eq!(b.reconciler.wanted()[0].ifindex, 1);
    assert!(b.reconciler.warned.contains("amb/dual"));
}

/// A pod that leaves the mesh drains while the proxy carries its connections:
/// still attached, marked draining, not reported captured; enrolled again it is captured as before; once the
/// proxy carries none of its connections (or its veth goes) it is detached.
#[test]
fn a_pod_leaving_the_mesh_drains_while_the_proxy_carries_its_connections() {
    let carried = Arc::new(Mutex::new(HashSet::<IpAddr>::new()));
    let dir = tempfile::tempdir().unwrap();
    let reported = Reported::default();
    let reconciler = Reconciler::new(
        State::new("n1", "cluster.local", "istio-system"),
        FakeCapture::default(),
        Enroller::new("n1", &dir.path().join("cni.sock")),
        Some(Box::new(reported.clone())),
        true,
    )
    .with_leave_drain(LeaveDrain {
        bound: Duration::from_secs(3600),
        settle: Duration::ZERO,
        carries: {
            let carried = carried.clone();
            Box::new(move |ip| carried.lock().unwrap().contains(&ip))
        },
    });
    let mut b = Bed {
        reconciler,
        reported,
        _dir: dir,
    };
    let net = network(&[("10.0.0.1", 1), ("10.0.0.2", 2)]);
    let mut out = pod("web", "10.0.0.1");
    out.metadata.labels =
        Some([("istio.io/dataplane-mode".to_string(), "none".to_string())].into());
    let enrolled = || {
        all(
            vec![pod("web", "10.0.0.1"), pod("db", "10.0.0.2")],
            Completeness::Complete,
        )
    };
    let left = || {
        all(
            vec![out.clone(), pod("db", "10.0.0.2")],
            Completeness::Complete,
        )
    };
    let draining = |b: &Bed| -> Vec<String> {
        b.reconciler
            .capture
            .attached
            .values()
            .filter(|(p, _)| p.draining)
            .map(|(p, _)| p.workload.to_string())
            .collect()
    };
    b.round(Some(enrolled()), &net);
    assert_eq!(b.attached(), ["amb/web", "amb/db"]);
    assert!(draining(&b).is_empty());

    // web leaves with a connection through the proxy: it drains.
    carried.lock().unwrap().insert("10.0.0.1".parse().unwrap());
    b.round(Some(left()), &net);
    assert_eq!(b.attached(), ["amb/web", "amb/db"]);
    assert_eq!(draining(&b), ["amb/web"]);
    assert_eq!(b.reported.0.lock().unwrap().last().unwrap(), &["amb/db"]);
    b.round(None, &net);
    assert_eq!(draining(&b), ["amb/web"], "still carried: still draining");

    // Enrolled again: captured as before, no longer draining.
    b.round(Some(enrolled()), &net);
    assert_eq!(b.attached(), ["amb/web", "amb/db"]);
    assert!(draining(&b).is_empty());

    // Leaves again; its last connection ends: detached.
    b.round(Some(left()), &net);
    assert_eq!(draining(&b), ["amb/web"]);
    carried.lock().unwrap().clear();
    b.round(None, &net);
    assert_eq!(b.attached(), ["amb/db"]);

    // A pod whose host veth is gone is not drained.
    carried.lock().unwrap().insert("10.0.0.2".parse().unwrap());
    b.round(Some(enrolled()), &net);
    let mut db_out = pod("db", "10.0.0.2");
    db_out.metadata.labels = out.metadata.labels.clone();
    b.round(
        Some(all(
            vec![pod("web", "10.0.0.1"), db_out],
            Completeness::Complete,
        )),
        &network(&[("10.0.0.1", 1)]),
    );
    assert_eq!(b.attached(), ["amb/web"]);
}

/// The audit runs before the reconcile; each finding is repaired and counted
/// by reason; a failed repair is not counted, schedules a retry, and is found
/// again by the next audit.
#[test]
fn audit_findings_are_repaired_before_attaching_and_counted() {
    use crate::dataplane::audit::{AttachmentFact, PodFacts, Reason, check_pod};

    let web = captured("web", "10.0.0.1", 1);
    let facts = PodFacts {
        veth_exists: true,
        entry: None,
        attachments: vec![(crate::dataplane::Program::FromPod, AttachmentFact::Detached)],
    };
    let broken = check_pod(&web, &facts);
    let mut b = bed(FakeCapture {
        broken: broken.clone(),
        repairs_fail: true,
        ..FakeCapture::default()
    });
    let metrics = Arc::new(Metrics::default());
    b.reconciler.count_repairs_in(metrics.clone());
    let net = network(&[("10.0.0.1", 1)]);
    b.round(
        Some(all(vec![pod("web", "10.0.0.1")], Completeness::Complete)),
        &net,
    );
    assert_eq!(
        b.reconciler.capture.calls,
        ["audit", "repair", "repair", "reconcile"]
    );
    assert_eq!(metrics.repairs(Reason::MapEntryMissing), 0);
    assert!(b.reconciler.pending_retry().is_some());

    b.reconciler.capture.repairs_fail = false;
    b.reconciler.capture.calls.clear();
    b.round(None, &net);
    assert_eq!(
        b.reconciler.capture.calls,
        ["audit", "repair", "repair", "reconcile"]
    );
    assert_eq!(metrics.repairs(Reason::MapEntryMissing), 1);
    assert_eq!(metrics.repairs(Reason::LinkDetached), 1);
    assert!(b.reconciler.capture.broken.is_empty());
    assert!(b.reconciler.pending_retry().is_none());
    assert_eq!(b.attached(), ["amb/web"]);

    // Nothing more found: nothing more counted.
    b.round(None, &net);
    assert_eq!(metrics.repairs(Reason::MapEntryMissing), 1);
}

/// While the planned pods stay as they were (or only gain pods) and the last
/// repairs succeeded, the audit runs once per `AUDIT_INTERVAL`; a pod of the
/// plan removed or changed runs it at once.
#[test]
fn the_audit_is_skipped_while_nothing_of_this_node_changed() {
    let mut b = bed(FakeCapture::default());
    let net = network(&[("10.0.0.1", 1), ("10.0.0.2", 2)]);
    b.round(
        Some(all(vec![pod("web", "10.0.0.1")], Completeness::Complete)),
        &net,
    );
    assert_eq!(b.reconciler.capture.calls, ["audit", "reconcile"]);
    b.reconciler.capture.calls.clear();
    b.round(None, &net);
    assert_eq!(b.reconciler.capture.calls, ["reconcile"]);
    b.reconciler.capture.calls.clear();
    // One more pod: nothing audited would have changed.
    b.round(
        Some(all(
            vec![pod("web", "10.0.0.1"), pod("db", "10.0.0.2")],
            Completeness::Complete,
        )),
        &net,
    );
    assert_eq!(b.reconciler.capture.calls, ["reconcile"]);
    b.reconciler.capture.calls.clear();
    // One pod fewer: audited at once.
    b.round(
        Some(all(vec![pod("db", "10.0.0.2")], Completeness::Complete)),
        &net,
    );
    assert_eq!(b.reconciler.capture.calls, ["audit", "reconcile"]);
    b.reconciler.capture.calls.clear();
    if let Some(last) = &mut b.reconciler.last_audit {
        last.at -= AUDIT_INTERVAL;
    }
    b.round(None, &net);
    assert_eq!(b.reconciler.capture.calls, ["audit", "reconcile"]);
}
