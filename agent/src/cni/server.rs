//! The agent's side of podlink-cni: the Unix socket ([`listen`]) and the state
//! of the pods the plugin told about ([`Enroller`]).
//!
//! At CNI ADD time the pod's object may not have reached the agent's workload
//! source yet, and it has no `status.podIP` yet. The agent therefore records the
//! addresses the plugin reports (an overlay, `namespace/name` → addresses, used
//! for pods whose object has none), waits up to [`ENROLL_WAIT`] for the object
//! (re-checking on each source change), reconciles at once, and answers when the
//! pod's links exist, or with the reason they do not. Pods that are not to be
//! enrolled are answered at once. DEL drops the overlay entry.

use std::{
    borrow::Cow,
    collections::{BTreeSet, HashMap, HashSet},
    fs,
    net::IpAddr,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};

use super::{
    protocol::{Command, ENROLL_WAIT, MAX_MESSAGE, REQUEST_TIMEOUT, Reply, Request},
    snapshot::Snapshot,
};
use crate::{
    dataplane::CapturedPod,
    k8s::{Namespace, Pod, PodIP, PodStatus},
    state::WorkloadIndex,
};

/// A request of the plugin, with the way to answer it.
#[derive(Debug)]
pub struct Incoming {
    /// The request.
    pub request: Request,
    /// Where the answer goes (the connection's task writes it).
    pub reply: oneshot::Sender<Reply>,
}

/// The bound socket; dropping it stops accepting and removes the socket file
/// (unless another agent has replaced it meanwhile).
#[derive(Debug)]
pub struct CniSocket {
    path: PathBuf,
    /// `(st_dev, st_ino)` of the socket file this agent made.
    inode: (u64, u64),
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for CniSocket {
    fn drop(&mut self) {
        self.accept.abort();
        if fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.inode) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

impl CniSocket {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Binds the socket at `path` (creating its directory, mode 0755; replacing a
/// stale socket file; the socket itself mode 0600) and serves it: each
/// connection's request is handed to the returned channel, malformed ones are
/// answered with an error naming the problem. Call within a tokio runtime.
///
/// # Errors
/// A directory that cannot be made, a path holding something else than a
/// socket, a socket that cannot be bound.
pub fn listen(path: &Path) -> Result<(CniSocket, mpsc::Receiver<Incoming>)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        Ok(_) => bail!(
            "{} exists and is not a socket: not replacing it",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("looking at {}", path.display())),
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    let meta = fs::symlink_metadata(path)?;
    let (tx, rx) = mpsc::channel(256);
    // Connections served at once; more wait in the listen backlog, so that a
    // flood of plugin connections cannot take the descriptors the proxy's
    // connections need.
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let accept = tokio::spawn(async move {
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            match listener.accept().await {
                Ok((stream, _)) => {
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        connection(stream, tx).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    tracing::warn!("accepting on the CNI socket: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok((
        CniSocket {
            path: path.to_path_buf(),
            inode: (meta.dev(), meta.ino()),
            accept,
        },
        rx,
    ))
}

/// Plugin connections the agent serves at once (a node starts a few pods at a
/// time; each connection lives until its pod is attached, at most a few seconds).
pub const MAX_CONNECTIONS: usize = 256;

/// Reads a request: up to a newline or the end of the plugin's writing, at
/// most [`MAX_MESSAGE`] bytes.
async fn read_request(stream: &mut UnixStream) -> Result<Request, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading the request: {e}"))?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_MESSAGE {
            return Err(format!("the request is over {MAX_MESSAGE} bytes"));
        }
        if chunk[..n].contains(&b'\n') {
            break;
        }
    }
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    if line.iter().all(u8::is_ascii_whitespace) {
        return Err("empty request".into());
    }
    Request::parse(line).map_err(|e| e.to_string())
}

async fn connection(mut stream: UnixStream, requests: mpsc::Sender<Incoming>) {
    let stopping = || Reply::Error {
        message: "the agent is stopping".into(),
        retry: true,
    };
    let reply = match tokio::time::timeout(REQUEST_TIMEOUT, read_request(&mut stream)).await {
        Err(_) => Reply::Error {
            message: format!("no complete request within {} s", REQUEST_TIMEOUT.as_secs()),
            retry: false,
        },
        Ok(Err(message)) => {
            tracing::warn!("CNI socket: refused a request: {message}");
            Reply::Error {
                message,
                retry: false,
            }
        }
        Ok(Ok(request)) => {
            let (tx, rx) = oneshot::channel();
            if requests
                .send(Incoming { request, reply: tx })
                .await
                .is_err()
            {
                stopping()
            } else {
                rx.await.unwrap_or_else(|_| stopping())
            }
        }
    };
    let _ = stream.write_all(reply.to_line().as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// What the plugin reported for a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reported {
    container_id: String,
    ips: Vec<IpAddr>,
    host_interface: Option<String>,
}

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
    overlay: HashMap<String, Reported>,
    /// The pods (`namespace/name`) whose reported addresses changed since
    /// [`Enroller::take_changed`].
    changed: BTreeSet<String>,
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
            overlay: HashMap::new(),
            changed: BTreeSet::new(),
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
                let reported = Reported {
                    container_id: request.container_id.clone(),
                    ips: request.ips.clone(),
                    host_interface: request.host_interface.clone(),
                };
                if self.overlay.get(&key) != Some(&reported) {
                    self.changed.insert(key.clone());
                    self.overlay.insert(key, reported);
                }
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
                if self
                    .overlay
                    .get(&key)
                    .is_some_and(|r| r.container_id == request.container_id)
                {
                    self.overlay.remove(&key);
                    self.changed.insert(key.clone());
                }
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

    /// The pods (`namespace/name`) whose reported addresses changed since the
    /// last call: their workloads are to be made again with
    /// [`Enroller::overlaid`].
    pub fn take_changed(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.changed)
    }

    /// Whether requests wait for an answer (the agent reconciles for them).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// When the first waiting request times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.iter().map(|p| p.deadline).min()
    }

    /// `pods`, those the plugin reported given the addresses it reported: the
    /// live sandbox's addresses win over the object's, which may still be those
    /// of an earlier sandbox (until the kubelet updates the status) or none yet.
    pub fn pods<'a>(&self, pods: impl Iterator<Item = &'a Pod>) -> Vec<Cow<'a, Pod>> {
        pods.map(|pod| self.overlaid(pod)).collect()
    }

    /// `pod` as [`Enroller::pods`] gives it.
    pub fn overlaid<'a>(&self, pod: &'a Pod) -> Cow<'a, Pod> {
        if self.overlay.is_empty() {
            return Cow::Borrowed(pod);
        }
        let Some(key) = pod.key() else {
            return Cow::Borrowed(pod);
        };
        match self.overlay.get(&key) {
            Some(reported) if !reported.ips.is_empty() && !has_addresses(pod, &reported.ips) => {
                let mut pod = pod.clone();
                let status = pod.status.get_or_insert_with(PodStatus::default);
                status.pod_ip = Some(reported.ips[0].to_string());
                status.pod_ips = Some(
                    reported
                        .ips
                        .iter()
                        .map(|ip| PodIP { ip: ip.to_string() })
                        .collect(),
                );
                Cow::Owned(pod)
            }
            _ => Cow::Borrowed(pod),
        }
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
                        let planned = attached.wanted.iter().find(|c| *c.workload == *key);
                        // Attached where the plugin says the pod is: its host
                        // interface and one of its addresses.
                        let here = |pod: &CapturedPod| {
                            p.request
                                .host_interface
                                .as_ref()
                                .is_none_or(|i| **i == *pod.ifname)
                                && (p.request.ips.is_empty()
                                    || p.request.ips.contains(&IpAddr::V4(pod.ipv4)))
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
                                        pod.ipv4,
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

/// Whether the pod's object lists exactly `ips` (`status.podIPs`, else
/// `status.podIP`).
fn has_addresses(pod: &Pod, ips: &[IpAddr]) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    let listed: Vec<IpAddr> = match status.pod_ips.as_deref() {
        Some(list) if !list.is_empty() => list.iter().filter_map(|p| p.ip.parse().ok()).collect(),
        _ => status
            .pod_ip
            .as_deref()
            .and_then(|ip| ip.parse().ok())
            .into_iter()
            .collect(),
    };
    listed == ips
}

#[cfg(test)]
mod tests {
    use super::*;

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
            ipv4: "10.244.1.9".parse().unwrap(),
            ifname: "veth9".into(),
            ifindex: 9,
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
    fn the_live_sandbox_addresses_win_over_a_stale_object() {
        let (_dir, mut e) = enroller();
        let stale = pod(
            "metadata: {name: web, namespace: amb}\nspec: {nodeName: n1}\nstatus: {podIP: 10.244.1.8, podIPs: [{ip: 10.244.1.8}]}",
        );
        let _add = send(&mut e, request(Command::Add, "web", "c1"));
        let pods = e.pods([&stale].into_iter());
        let status = pods[0].status.as_ref().unwrap();
        assert_eq!(status.pod_ip.as_deref(), Some("10.244.1.9"));
        // Once the object lists the same addresses, it is used as it is.
        let current = pod(
            "metadata: {name: web, namespace: amb}\nspec: {nodeName: n1}\nstatus: {podIP: 10.244.1.9}",
        );
        assert!(matches!(
            e.pods([&current].into_iter())[0],
            Cow::Borrowed(_)
        ));
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
        let pods = e.pods([&new, &out].into_iter());
        assert!(matches!(pods[0], Cow::Owned(_)));
        let (index, _) = WorkloadIndex::build(
            "n1",
            "cluster.local",
            pods.iter().map(|p| p.as_ref()),
            [&ns],
        );
        let w = index.workloads().find(|w| w.name == "new").unwrap();
        assert_eq!(w.ips, vec!["10.244.1.9".parse::<IpAddr>().unwrap()]);

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
        assert!(matches!(e.pods([&new].into_iter())[0], Cow::Borrowed(_)));
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
        let pods = e.pods([&new, &other].into_iter());
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

    #[tokio::test]
    async fn the_socket_serves_and_refuses_malformed_requests() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/cni.sock");
        // A stale socket file is replaced.
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (socket, mut rx) = listen(&path).unwrap();
        let exchange = |body: &'static [u8]| {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
                s.write_all(body).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let mut out = Vec::new();
                s.read_to_end(&mut out).unwrap();
                Reply::parse(&out).unwrap()
            })
        };
        let bad = exchange(b"{\"version\": 1, \"command\": \"ADD\"}\n")
            .await
            .unwrap();
        assert!(matches!(bad, Reply::Error { message, .. } if message.contains("containerId")));
        let garbage = exchange(b"\x00\x01").await.unwrap();
        assert!(matches!(garbage, Reply::Error { message, .. } if message.contains("not JSON")));
        let good = exchange(
            br#"{"version":1,"command":"DEL","containerId":"c","namespace":"n","name":"p"}"#,
        );
        let incoming = rx.recv().await.unwrap();
        assert_eq!(incoming.request.key(), "n/p");
        incoming.reply.send(Reply::Removed).unwrap();
        assert_eq!(good.await.unwrap(), Reply::Removed);
        drop(socket);
        assert!(!path.exists());
        // Something else than a socket is not replaced.
        fs::write(&path, "x").unwrap();
        assert!(format!("{:#}", listen(&path).unwrap_err()).contains("not a socket"));
    }
}
