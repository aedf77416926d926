//! The test bed: a Kubernetes-like cluster made of network namespaces on one
//! machine, used by the end-to-end tests, `cargo xtask demo` and `cargo xtask
//! bench`.
//!
//! * An underlay: a bridge in its own namespace, `10.100.0.0/24`.
//! * Nodes: one namespace each, `eth0` on the underlay (`10.100.0.<n>`), pod CIDR
//!   `10.244.<n>.0/24`, routes to the other nodes' pod CIDRs, and a bpffs of its own
//!   mounted in the root mount namespace (so pins outlive the agent).
//! * Pods: one namespace each, wired by the real `ptp` + `host-local` CNI plugins
//!   from Debian's containernetworking-plugins, run inside the node namespace
//!   exactly as a container runtime runs them; a Pod manifest in the shared
//!   manifests directory describes each.
//! * Dual stack ([`Cluster::dual_stack`]; IPv4 only is the default): each node also
//!   has `fd00::<n>/64` on the underlay, IPv6 forwarding on, pod range
//!   `fd00:10:244:<n>::/64` and routes to the other nodes' IPv6 pod ranges; pods
//!   get one address of each family from `host-local` (`status.podIPs` lists
//!   both, IPv4 first). Duplicate address detection is off in the namespaces the
//!   test bed makes, so IPv6 addresses are usable at once.
//! * One `podlink agent` per node, started with `ip netns exec`, attaching its
//!   programs as the cluster's [`AttachMode`] says (by default as the agent's own
//!   `auto` does: TCX links from Linux 6.6 on, `cls_bpf` filters below).
//! * The agents' source ([`Source`]): the shared manifests directory, or the
//!   Kubernetes API server double ([`api_double`]), listening in every node's
//!   namespace. The same calls ([`Cluster::write_manifest`], [`Cluster::add_pod`],
//!   …) feed either, so a scenario runs against both sources unchanged.
//!
//! Every name carries the process id and a counter, so test beds run side by side;
//! everything is removed on drop, and by [`netns::cleanup`] on a signal.

pub mod api_double;
pub mod app;
pub mod ca_double;
mod capture;
pub mod cni_runtime;
pub mod dns;
pub mod netns;
pub mod waypoint_double;
pub mod xds_double;

pub use capture::{Capture, any_from, contains_bytes, syns_to};

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use netns::{Resource, ip, register, run};
use serde_json::Value;

/// The agent's admin port (on 127.0.0.1 of the node's namespace).
pub const ADMIN_PORT: u16 = 15000;
/// The agent's metrics port.
pub const METRICS_PORT: u16 = 15020;
/// The agent's readiness port.
pub const READINESS_PORT: u16 = 15021;

/// A parsed metrics page (OpenMetrics text): samples by name and labels.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// The page as served.
    pub text: String,
    /// `(name, labels, value)` of each sample.
    pub samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

impl Metrics {
    /// Parses the sample lines of `text` (label values without escapes, as the
    /// agent writes them).
    pub fn parse(text: &str) -> Self {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let value: f64 = value.parse().ok()?;
                let (name, labels) = match series.split_once('{') {
                    Some((name, rest)) => {
                        let rest = rest.strip_suffix('}')?;
                        let labels = rest
                            .split("\",")
                            .filter(|kv| !kv.is_empty())
                            .filter_map(|kv| {
                                let (k, v) = kv.split_once("=\"")?;
                                Some((k.to_string(), v.trim_end_matches('"').to_string()))
                            })
                            .collect();
                        (name.to_string(), labels)
                    }
                    None => (series.to_string(), BTreeMap::new()),
                };
                Some((name, labels, value))
            })
            .collect();
        Self {
            text: text.to_string(),
            samples,
        }
    }

    /// The samples of `name` whose labels include all of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a (String, BTreeMap<String, String>, f64)> + 'a {
        self.samples.iter().filter(move |(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The sum of the samples of `name` whose labels include all of `labels`
    /// (0 when there are none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|(_, _, v)| v).sum()
    }

    /// Whether some sample of `name` has all of `labels`.
    pub fn has(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.matching(name, labels).next().is_some()
    }
}

/// How the agents attach their programs to the host veths (`podlink agent
/// --attach-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttachMode {
    /// The agent's default: TCX links where the kernel has them, else `cls_bpf`
    /// filters.
    #[default]
    Auto,
    /// Pinned TCX links (Linux 6.6 and later).
    Tcx,
    /// `cls_bpf` filters on a `clsact` qdisc.
    ClsBpf,
}

impl AttachMode {
    /// The kind of attachment the agent makes in this mode on this machine's
    /// kernel: [`AttachMode::Tcx`] or [`AttachMode::ClsBpf`].
    pub fn on_this_kernel(self) -> AttachMode {
        match self {
            AttachMode::Auto if kernel_has_tcx() => AttachMode::Tcx,
            AttachMode::Auto => AttachMode::ClsBpf,
            other => other,
        }
    }

    /// The value of `--attach-mode`.
    pub fn arg(self) -> &'static str {
        match self {
            AttachMode::Auto => "auto",
            AttachMode::Tcx => "tcx",
            AttachMode::ClsBpf => "cls-bpf",
        }
    }

    /// What the agent logs for each attachment of a previous agent it adopts, in
    /// this mode on this kernel.
    pub fn adoption_log(self) -> &'static str {
        match self.on_this_kernel() {
            AttachMode::ClsBpf => "adopted cls_bpf filter",
            _ => "adopted pinned link",
        }
    }
}

/// Whether this machine's kernel has TCX links (Linux 6.6 and later), read from
/// its release (`/proc/sys/kernel/osrelease`, e.g. `6.1.0-28-amd64`). Panics if
/// it cannot be read.
pub fn kernel_has_tcx() -> bool {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease")
        .expect("reading /proc/sys/kernel/osrelease");
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    version >= (6, 6)
}

/// The priority of podlink's `cls_bpf` filters as `tc -j filter show` prints it
/// (`podlink_agent::dataplane::tc::FILTER_PRIORITY`).
pub const FILTER_PREF: u64 = 1;
/// The handle of podlink's `cls_bpf` filters as `tc -j filter show` prints it
/// (`podlink_agent::dataplane::tc::FILTER_HANDLE`).
pub const FILTER_HANDLE: &str = "0x53b";

/// The entries of `tc -j filter show` output that are podlink's filter for
/// `program` (`from_pod` at ingress, `to_pod` at egress): kind `bpf` at
/// [`FILTER_PREF`] with [`FILTER_HANDLE`], named after the program.
pub fn podlink_filters<'a>(shown: &'a Value, program: &'a str) -> impl Iterator<Item = &'a Value> {
    shown.as_array().into_iter().flatten().filter(move |f| {
        f["kind"] == "bpf"
            && f["pref"] == FILTER_PREF
            && f["options"]["handle"] == FILTER_HANDLE
            && f["options"]["bpf_name"] == program
    })
}

/// A pod's attachments in its node: the programs with a pinned TCX link, and those
/// with podlink's `cls_bpf` filter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attachments {
    /// `from_pod`, `to_pod`: the programs whose link is pinned.
    pub links: Vec<&'static str>,
    /// The programs attached as podlink's `cls_bpf` filter.
    pub filters: Vec<&'static str>,
}

/// Where Debian's containernetworking-plugins are installed.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

static NEXT_CLUSTER: AtomicU32 = AtomicU32::new(0);

/// The `podlink` binary under test: `$PODLINK_BIN`, else the one `cargo xtask build`
/// makes (the `dist` profile).
pub fn podlink_bin() -> PathBuf {
    std::env::var_os("PODLINK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/dist/podlink"))
}

/// The `podlink-cni` plugin under test: `$PODLINK_CNI_BIN`, else `podlink-cni`
/// beside [`podlink_bin`] (both are built by `cargo xtask build`).
pub fn podlink_cni_bin() -> PathBuf {
    std::env::var_os("PODLINK_CNI_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| podlink_bin().with_file_name("podlink-cni"))
}

/// Fails (never skips) when the test bed cannot run here.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!(
            "this end-to-end test creates network namespaces, veths, bpffs mounts and BPF links: it needs root (run `cargo xtask test` as root)"
        );
    }
    for tool in [
        "/usr/sbin/ip",
        "/usr/sbin/bpftool",
        "/usr/lib/cni/ptp",
        "/usr/lib/cni/host-local",
    ] {
        if !Path::new(tool).exists() {
            panic!(
                "{tool} is missing: run `cargo xtask setup` (it installs iproute2, bpftool, containernetworking-plugins)"
            );
        }
    }
    if !podlink_bin().exists() {
        panic!(
            "{} is missing: run `cargo xtask build` (or `cargo xtask test`, which builds it)",
            podlink_bin().display()
        );
    }
}

/// A node of the test bed.
#[derive(Clone, Debug)]
pub struct Node {
    /// The Kubernetes node name (`node1`, …).
    pub name: String,
    /// Its network namespace.
    pub netns: String,
    /// Its underlay address.
    pub ip: Ipv4Addr,
    /// Its pod CIDR (a /24).
    pub pod_cidr: Ipv4Addr,
    /// Its IPv6 underlay address (`fd00::<n>`, on a /64), in a dual-stack cluster.
    pub ipv6: Option<Ipv6Addr>,
    /// Its IPv6 pod CIDR (`fd00:10:244:<n>::`, a /64), in a dual-stack cluster.
    pub pod_cidr6: Option<Ipv6Addr>,
    /// The agent's pin directory (on this node's own bpffs).
    pub pin_dir: PathBuf,
    /// The agent's state directory (its sysctl journal).
    pub state_dir: PathBuf,
    /// The agent's podlink-cni socket (`--cni-socket`): one per node, since the
    /// test bed's agents share one file system.
    pub cni_socket: PathBuf,
}

impl Node {
    /// Its IPv6 pod range as CIDR text (`fd00:10:244:<n>::/64`), in a dual-stack
    /// cluster.
    pub fn pod_range6(&self) -> Option<String> {
        self.pod_cidr6.map(|net| format!("{net}/64"))
    }

    /// The directory of the agent's pin layout: `<pin_dir>/v<LAYOUT_VERSION>`, which
    /// holds the maps and `links/`.
    pub fn pins(&self) -> PathBuf {
        self.pin_dir
            .join(format!("v{}", podlink_common::LAYOUT_VERSION))
    }
}

/// A pod of the test bed.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub namespace: String,
    /// Index into [`Cluster::nodes`].
    pub node: usize,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address from the CNI result, in a dual-stack cluster.
    pub ipv6: Option<Ipv6Addr>,
    /// The host side of its veth pair, in the node namespace.
    pub host_veth: String,
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    pub service_account: String,
    /// Its controller (`ownerReferences` with `controller: true`): kind and
    /// name, e.g. `ReplicaSet` `web-5d8f9c7b6`.
    pub owner: Option<(String, String)>,
    /// The sandbox id the CNI plugins were given (`CNI_CONTAINERID`).
    pub container_id: String,
}

impl Pod {
    /// `ip:port` of this pod.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.ip, port))
    }

    /// Its address of `family`. Panics for [`Family::V6`] on a pod without one
    /// (not in a dual-stack cluster).
    pub fn ip_of(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => IpAddr::V4(self.ip),
            Family::V6 => IpAddr::V6(self.ipv6.unwrap_or_else(|| {
                panic!(
                    "pod {} has no IPv6 address: use Cluster::dual_stack",
                    self.name
                )
            })),
        }
    }

    /// `[ipv6]:port` of this pod (see [`Pod::ip_of`]).
    pub fn addr6(&self, port: u16) -> SocketAddr {
        self.addr_of(Family::V6, port)
    }

    /// Its address of `family` with `port`.
    pub fn addr_of(&self, family: Family, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip_of(family), port)
    }

    /// All its addresses, IPv4 first (as `status.podIPs` lists them).
    pub fn ips(&self) -> Vec<IpAddr> {
        std::iter::once(IpAddr::V4(self.ip))
            .chain(self.ipv6.map(IpAddr::V6))
            .collect()
    }
}

/// An address family of the test bed, for scenarios written once for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// What a new pod looks like.
#[derive(Clone, Debug, Default)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    pub node: usize,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub service_account: Option<String>,
    pub owner: Option<(String, String)>,
}

impl PodSpec {
    pub fn new(name: &str, namespace: &str, node: usize) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            node,
            ..Default::default()
        }
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn service_account(mut self, sa: &str) -> Self {
        self.service_account = Some(sa.into());
        self
    }

    /// Its controller: `kind` (`ReplicaSet`, `StatefulSet`, `Job`, ...) and
    /// `name`.
    pub fn owner(mut self, kind: &str, name: &str) -> Self {
        self.owner = Some((kind.into(), name.into()));
        self
    }
}

/// Packet counters of one pod's host veth, summed over CPUs, by field name (as
/// `bpftool` prints them from BTF).
pub type Counters = BTreeMap<String, u64>;

/// Where the agents read the cluster's objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The manifests directory (`--manifests`).
    Manifests,
    /// The Kubernetes API server double (`--kubeconfig`): every manifest the
    /// test writes is applied to it as `kubectl apply` would, every manifest it
    /// removes deleted.
    Kubernetes,
}

/// An object of the API server double: kind, namespace (empty for a
/// cluster-scoped kind), name.
type ObjectKey = (String, String, String);

/// The API server double the agents watch, and what each manifest "file"
/// created in it.
struct KubeApi {
    server: api_double::ApiServer,
    /// Each node's kubeconfig (a listener in its namespace).
    kubeconfigs: Vec<PathBuf>,
    /// The objects (kind, namespace, name) each manifest file holds.
    files: std::sync::Mutex<HashMap<String, Vec<ObjectKey>>>,
}

/// The cluster.
pub struct Cluster {
    pub id: String,
    /// Working directory: manifests, CA, CNI state, agent logs.
    pub dir: PathBuf,
    pub manifests: PathBuf,
    pub ca_dir: PathBuf,
    pub underlay: String,
    pub nodes: Vec<Node>,
    pods: HashMap<String, Pod>,
    agents: HashMap<usize, Child>,
    resources: Vec<Resource>,
    /// Address ranges a node's pods get once its pod CIDR is used up (see
    /// [`Cluster::add_pod_range`]), by node index.
    extra_pod_ranges: HashMap<usize, Vec<String>>,
    /// The API server double, when the agents watch one.
    api: Option<KubeApi>,
    /// Whether nodes and pods have IPv6 addresses too.
    dual_stack: bool,
    /// How the agents started from now on attach their programs.
    attach_mode: AttachMode,
}

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("partial");
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// The API server double's resource of `kind`.
fn resource_of(kind: &str) -> Result<&'static str> {
    Ok(match kind {
        "Pod" => "pods",
        "Namespace" => "namespaces",
        "Service" => "services",
        "EndpointSlice" => "endpointslices",
        "Node" => "nodes",
        "AuthorizationPolicy" => "authorizationpolicies",
        "PeerAuthentication" => "peerauthentications",
        other => bail!("the API server double does not serve {other:?}"),
    })
}

/// Applies `object` to the API server double by its `kind`; returns its kind,
/// namespace and name.
fn apply_object(api: &api_double::ApiServer, object: Value) -> Result<ObjectKey> {
    let kind = object["kind"].as_str().unwrap_or_default().to_string();
    let name = object["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let namespace = object["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default")
        .to_string();
    api.apply(resource_of(&kind)?, object)
        .with_context(|| format!("applying {kind} {namespace}/{name}"))?;
    Ok((kind, namespace, name))
}

/// Deletes an object [`apply_object`] applied.
fn delete_object(
    api: &api_double::ApiServer,
    kind: &str,
    namespace: &str,
    name: &str,
) -> Result<()> {
    api.delete(resource_of(kind)?, namespace, name)
        .with_context(|| format!("deleting {kind} {namespace}/{name}"))
        .map(drop)
}

/// The objects of a multi-document YAML text, as JSON values (`List` items
/// taken out); empty documents skipped.
fn yaml_objects(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        let value = Value::deserialize(document).context("parsing YAML")?;
        match value {
            Value::Null => {}
            Value::Object(ref map) if map.get("kind").and_then(Value::as_str) == Some("List") => {
                out.extend(
                    map.get("items")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .cloned(),
                );
            }
            other => out.push(other),
        }
    }
    Ok(out)
}

fn yaml_labels(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "{}".into();
    }
    let items: Vec<String> = labels.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", items.join(", "))
}

/// Annotations as a flow mapping, values quoted (`"false"` stays a string).
fn yaml_annotations(annotations: &BTreeMap<String, String>) -> String {
    let items: Vec<String> = annotations
        .iter()
        .map(|(k, v)| format!("{k}: {v:?}"))
        .collect();
    format!("{{{}}}", items.join(", "))
}

/// Removes namespaces left by test processes that no longer exist.
fn sweep_stale() {
    let Ok(entries) = fs::read_dir("/run/netns") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("plt") else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(pid) = pid.parse::<u32>()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            netns::remove(&Resource::Netns(name));
        }
    }
}

impl Cluster {
    /// Builds the underlay and `nodes` nodes (no agents yet), and a CA.
    pub fn new(nodes: usize) -> Result<Self> {
        Self::build(nodes, false)
    }

    fn build(nodes: usize, dual_stack: bool) -> Result<Self> {
        require_root();
        sweep_stale();
        let n = NEXT_CLUSTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("plt{}c{n}", std::process::id());
        let dir = std::env::temp_dir().join(format!("podlink-{id}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        let mut cluster = Cluster {
            manifests: dir.join("manifests"),
            ca_dir: dir.join("ca"),
            underlay: format!("{id}-ul"),
            dir: dir.clone(),
            id: id.clone(),
            nodes: Vec::new(),
            pods: HashMap::new(),
            agents: HashMap::new(),
            resources: Vec::new(),
            extra_pod_ranges: HashMap::new(),
            api: None,
            dual_stack,
            attach_mode: AttachMode::Auto,
        };
        cluster.track(Resource::Dir(dir.clone()));
        fs::create_dir_all(&cluster.manifests)?;
        run(Command::new(podlink_bin())
            .args(["ca", "init", "--out"])
            .arg(&cluster.ca_dir))?;

        // The underlay: a bridge in its own namespace.
        cluster.add_netns(&cluster.underlay.clone())?;
        let ul = cluster.underlay.clone();
        ip(&["-n", &ul, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &ul, "link", "set", "br0", "up"])?;

        for i in 0..nodes {
            let k = i + 1;
            let netns = format!("{id}-n{k}");
            cluster.add_netns(&netns)?;
            if dual_stack {
                // Before any interface comes in, so that all get these.
                netns::sysctl(
                    &netns,
                    &[
                        "net.ipv6.conf.all.forwarding=1",
                        "net.ipv6.conf.all.accept_dad=0",
                        "net.ipv6.conf.default.accept_dad=0",
                    ],
                )?;
            }
            let node_ip = Ipv4Addr::new(10, 100, 0, k as u8);
            let (a, b) = (format!("{id}a{k}"), format!("{id}b{k}"));
            // Interface names are at most 15 bytes: create with short unique names,
            // then move and rename.
            let a = truncate_ifname(&a);
            let b = truncate_ifname(&b);
            ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
            ip(&["link", "set", &a, "netns", &netns, "name", "eth0"])?;
            ip(&["link", "set", &b, "netns", &ul, "name", &format!("n{k}")])?;
            ip(&[
                "-n",
                &ul,
                "link",
                "set",
                &format!("n{k}"),
                "master",
                "br0",
                "up",
            ])?;
            ip(&[
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{node_ip}/24"),
                "dev",
                "eth0",
            ])?;
            let node_ip6 = dual_stack.then(|| Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, k as u16));
            if let Some(node_ip6) = node_ip6 {
                ip(&[
                    "-n",
                    &netns,
                    "addr",
                    "add",
                    &format!("{node_ip6}/64"),
                    "dev",
                    "eth0",
                    "nodad",
                ])?;
            }
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            let bpffs = dir.join(format!("node{k}/bpf"));
            fs::create_dir_all(&bpffs)?;
            run(Command::new("mount").args(["-t", "bpf", "bpf"]).arg(&bpffs))?;
            cluster.track(Resource::Mount(bpffs.clone()));
            cluster.nodes.push(Node {
                name: format!("node{k}"),
                netns,
                ip: node_ip,
                pod_cidr: Ipv4Addr::new(10, 244, k as u8, 0),
                ipv6: node_ip6,
                pod_cidr6: dual_stack
                    .then(|| Ipv6Addr::new(0xfd00, 0x10, 0x244, k as u16, 0, 0, 0, 0)),
                pin_dir: bpffs.join("podlink"),
                state_dir: dir.join(format!("node{k}/state")),
                cni_socket: dir.join(format!("node{k}/cni/cni.sock")),
            });
        }
        for node in &cluster.nodes {
            for other in &cluster.nodes {
                if other.name != node.name {
                    ip(&[
                        "-n",
                        &node.netns,
                        "route",
                        "add",
                        &format!("{}/24", other.pod_cidr),
                        "via",
                        &other.ip.to_string(),
                    ])?;
                    if let (Some(range), Some(via)) = (other.pod_range6(), other.ipv6) {
                        ip(&[
                            "-n",
                            &node.netns,
                            "-6",
                            "route",
                            "add",
                            &range,
                            "via",
                            &via.to_string(),
                        ])?;
                    }
                }
            }
        }
        Ok(cluster)
    }

    /// A cluster of `nodes` nodes whose agents read `source`.
    pub fn with_source(nodes: usize, source: Source) -> Result<Self> {
        Self::with_source_stack(nodes, source, false)
    }

    fn with_source_stack(nodes: usize, source: Source, dual_stack: bool) -> Result<Self> {
        let mut cluster = Self::build(nodes, dual_stack)?;
        if source == Source::Kubernetes {
            let server = api_double::ApiServer::start()?;
            let mut kubeconfigs = Vec::new();
            for n in &cluster.nodes {
                let addr = server.listen_in(&n.netns)?;
                let path = cluster.dir.join(format!("kubeconfig-{}", n.name));
                server.write_kubeconfig(addr, &path)?;
                kubeconfigs.push(path);
            }
            cluster.api = Some(KubeApi {
                server,
                kubeconfigs,
                files: Default::default(),
            });
        }
        Ok(cluster)
    }

    /// Where the agents read the cluster's objects.
    pub fn source(&self) -> Source {
        if self.api.is_some() {
            Source::Kubernetes
        } else {
            Source::Manifests
        }
    }

    /// The API server double the agents watch, with [`Source::Kubernetes`].
    pub fn api(&self) -> Option<&api_double::ApiServer> {
        self.api.as_ref().map(|a| &a.server)
    }

    /// A cluster of `nodes` nodes with these Kubernetes namespaces (name, and
    /// whether it is labelled `istio.io/dataplane-mode=ambient`).
    pub fn with_namespaces(nodes: usize, namespaces: &[(&str, bool)]) -> Result<Self> {
        Self::with_namespaces_from(nodes, namespaces, Source::Manifests)
    }

    /// As [`Cluster::with_namespaces`], the agents reading `source`.
    pub fn with_namespaces_from(
        nodes: usize,
        namespaces: &[(&str, bool)],
        source: Source,
    ) -> Result<Self> {
        Self::with_namespaces_stack(nodes, namespaces, source, false)
    }

    /// As [`Cluster::with_namespaces`], dual stack: nodes and pods have an IPv6
    /// address besides their IPv4 one ([`Node::ipv6`], [`Pod::ipv6`]).
    pub fn dual_stack(nodes: usize, namespaces: &[(&str, bool)]) -> Result<Self> {
        Self::dual_stack_from(nodes, namespaces, Source::Manifests)
    }

    /// As [`Cluster::dual_stack`], the agents reading `source`.
    pub fn dual_stack_from(
        nodes: usize,
        namespaces: &[(&str, bool)],
        source: Source,
    ) -> Result<Self> {
        Self::with_namespaces_stack(nodes, namespaces, source, true)
    }

    fn with_namespaces_stack(
        nodes: usize,
        namespaces: &[(&str, bool)],
        source: Source,
        dual_stack: bool,
    ) -> Result<Self> {
        let cluster = Self::with_source_stack(nodes, source, dual_stack)?;
        for (name, ambient) in namespaces {
            cluster.add_namespace(name, *ambient)?;
        }
        Ok(cluster)
    }

    /// Makes the agents started from now on attach their programs in `mode`
    /// (`--attach-mode`, left out for [`AttachMode::Auto`]).
    pub fn set_attach_mode(&mut self, mode: AttachMode) {
        self.attach_mode = mode;
    }

    /// As [`Cluster::set_attach_mode`], for a cluster just built.
    pub fn attaching(mut self, mode: AttachMode) -> Self {
        self.attach_mode = mode;
        self
    }

    /// How the agents started from now on attach their programs.
    pub fn attach_mode(&self) -> AttachMode {
        self.attach_mode
    }

    /// Whether nodes and pods have IPv6 addresses too.
    pub fn is_dual_stack(&self) -> bool {
        self.dual_stack
    }

    /// Turns IPv6 off in node `node`'s namespace (`net.ipv6.conf.{all,default}.
    /// disable_ipv6=1`), as on a node booted with IPv6 disabled; call it before
    /// the node's pods are added and its agent started. For a cluster that is
    /// not dual stack (its pods would get no IPv6 address to configure).
    pub fn disable_ipv6(&self, node: usize) -> Result<()> {
        if self.dual_stack {
            bail!("disable_ipv6 is for IPv4-only clusters: a dual-stack node's pods need IPv6");
        }
        netns::sysctl(
            &self.nodes.get(node).context("no such node")?.netns,
            &[
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
        )
    }

    /// Starts the agents of all nodes.
    pub fn start_agents(&mut self) -> Result<()> {
        (0..self.nodes.len()).try_for_each(|node| self.start_agent(node))
    }

    /// Waits until all of `pods` are captured.
    /// Waits until each pod is captured on its node and every running agent
    /// knows it (its `/config_dump` lists it), so that no agent takes a new pod for
    /// a destination outside the mesh.
    pub fn wait_all_captured(&self, pods: &[&Pod]) -> Result<()> {
        pods.iter()
            .try_for_each(|pod| self.wait_captured(pod, true))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        for &node in self.agents.keys() {
            // One dump per try: on a cluster of thousands of workloads a dump
            // is megabytes, and waiting for many pods must not ask for one per
            // pod.
            while let Some(pod) = self.first_unknown(node, pods)? {
                if Instant::now() > deadline {
                    bail!(
                        "the agent of node {} does not know pod {} after 10 s; its log:\n{}",
                        node + 1,
                        pod.name,
                        self.agent_log(node)
                    );
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// The first of `pods` that node `node`'s agent does not list among its
    /// workloads, if any.
    fn first_unknown<'p>(&self, node: usize, pods: &[&'p Pod]) -> Result<Option<&'p Pod>> {
        let dump = self.config_dump(node)?;
        let known: HashSet<(&str, &str)> = dump["workloads"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|w| Some((w["namespace"].as_str()?, w["name"].as_str()?)))
            .collect();
        Ok(pods
            .iter()
            .find(|p| !known.contains(&(p.namespace.as_str(), p.name.as_str())))
            .copied())
    }

    fn track(&mut self, resource: Resource) {
        register(resource.clone());
        self.resources.push(resource);
    }

    /// Creates a network namespace for a pod wired by the test itself (e.g.
    /// through a conflist, see [`cni_runtime`]): `<cluster id>-p-<name>`, removed
    /// with the cluster. Returns its name.
    pub fn add_pod_netns(&mut self, name: &str) -> Result<String> {
        let netns_name = format!("{}-p-{name}", self.id);
        self.add_netns(&netns_name)?;
        Ok(netns_name)
    }

    fn add_netns(&mut self, name: &str) -> Result<()> {
        ip(&["netns", "add", name])?;
        self.track(Resource::Netns(name.to_string()));
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    }

    /// Writes a Namespace manifest; `ambient` sets `istio.io/dataplane-mode=ambient`.
    pub fn add_namespace(&self, name: &str, ambient: bool) -> Result<()> {
        let labels = if ambient {
            "\n  labels:\n    istio.io/dataplane-mode: ambient"
        } else {
            ""
        };
        self.write_manifest(
            &format!("namespace-{name}.yaml"),
            &format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}{labels}\n"),
        )
    }

    fn cni(
        &self,
        command: &str,
        node: &Node,
        container_id: &str,
        netns_name: &str,
    ) -> Result<Value> {
        // One range set: host-local takes the pod CIDR first, then the extra ranges.
        let node_index = self
            .nodes
            .iter()
            .position(|n| n.name == node.name)
            .context("no such node")?;
        let mut ranges = vec![serde_json::json!({"subnet": format!("{}/24", node.pod_cidr)})];
        for range in self.extra_pod_ranges.get(&node_index).into_iter().flatten() {
            ranges.push(serde_json::json!({ "subnet": range }));
        }
        // A second range set gives each pod an IPv6 address too.
        let mut range_sets = vec![serde_json::Value::from(ranges)];
        let mut routes = vec![serde_json::json!({"dst": "0.0.0.0/0"})];
        if let Some(range6) = node.pod_range6() {
            range_sets.push(serde_json::json!([{ "subnet": range6 }]));
            routes.push(serde_json::json!({"dst": "::/0"}));
        }
        let config = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "podlink-testbed",
            "type": "ptp",
            "ipMasq": false,
            "mtu": 1500,
            "ipam": {
                "type": "host-local",
                "ranges": range_sets,
                "routes": routes,
                "dataDir": self.dir.join("cni-ipam").join(&node.name),
            }
        });
        let mut child = netns::command_in(&node.netns, &format!("{CNI_BIN_DIR}/ptp"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", container_id)
            .env("CNI_NETNS", format!("/run/netns/{netns_name}"))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", CNI_BIN_DIR)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running the ptp CNI plugin")?;
        {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("piped")
                .write_all(config.to_string().as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "CNI {command} for {netns_name} failed: {} {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        if out.stdout.is_empty() {
            return Ok(Value::Null);
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Creates a pod: its namespace, its veth by the CNI plugins, its manifest.
    pub fn add_pod(&mut self, spec: PodSpec) -> Result<Pod> {
        let pod = self.add_pod_unlisted(spec)?;
        self.list_pod(&pod)?;
        Ok(pod)
    }

    /// Lets node `node`'s pods take addresses from `cidr` (e.g. `10.245.0.0/21`)
    /// once its /24 pod CIDR is used up, and routes `cidr` to the node from the
    /// other nodes. For test beds with more than 253 pods on a node.
    pub fn add_pod_range(&mut self, node: usize, cidr: &str) -> Result<()> {
        let via = self.nodes.get(node).context("no such node")?.ip;
        for other in self.nodes.iter().filter(|n| n.ip != via) {
            ip(&[
                "-n",
                &other.netns,
                "route",
                "add",
                cidr,
                "via",
                &via.to_string(),
            ])?;
        }
        self.extra_pod_ranges
            .entry(node)
            .or_default()
            .push(cidr.to_string());
        Ok(())
    }

    /// The first half of [`Cluster::add_pod`]: the pod's namespace and its veth
    /// by the CNI plugins, but no manifest yet, so that no agent knows the pod
    /// until [`Cluster::list_pod`] writes it (the bench times enrollment from
    /// there).
    pub fn add_pod_unlisted(&mut self, spec: PodSpec) -> Result<Pod> {
        let node = self.nodes.get(spec.node).context("no such node")?.clone();
        let netns_name = format!("{}-p-{}", self.id, spec.name);
        self.add_netns(&netns_name)?;
        if self.dual_stack {
            // The pod's IPv6 address is usable at once, not after DAD.
            netns::sysctl(
                &netns_name,
                &[
                    "net.ipv6.conf.all.accept_dad=0",
                    "net.ipv6.conf.default.accept_dad=0",
                ],
            )?;
        }
        let container_id = format!("{}-{}", self.id, spec.name);
        let result = self.cni("ADD", &node, &container_id, &netns_name)?;
        let host_veth = result["interfaces"]
            .as_array()
            .and_then(|ifs| ifs.iter().find(|i| i.get("sandbox").is_none()))
            .and_then(|i| i["name"].as_str())
            .ok_or_else(|| anyhow!("CNI result names no host interface: {result}"))?
            .to_string();
        let ips = cni_result_ips(&result);
        let ip_addr = ips
            .iter()
            .find_map(|ip| match ip {
                IpAddr::V4(v4) => Some(*v4),
                IpAddr::V6(_) => None,
            })
            .ok_or_else(|| anyhow!("CNI result has no IPv4 address: {result}"))?;
        let ipv6 = ips.iter().find_map(|ip| match ip {
            IpAddr::V6(v6) => Some(*v6),
            IpAddr::V4(_) => None,
        });
        if self.dual_stack && ipv6.is_none() {
            bail!("CNI result has no IPv6 address in a dual-stack cluster: {result}");
        }
        let pod = Pod {
            name: spec.name.clone(),
            namespace: spec.namespace.clone(),
            node: spec.node,
            netns: netns_name,
            ip: ip_addr,
            ipv6,
            host_veth,
            labels: spec.labels.clone(),
            annotations: spec.annotations.clone(),
            service_account: spec
                .service_account
                .clone()
                .unwrap_or_else(|| "default".into()),
            owner: spec.owner.clone(),
            container_id,
        };
        self.pods.insert(pod.name.clone(), pod.clone());
        Ok(pod)
    }

    /// Writes the manifest of a pod made by [`Cluster::add_pod_unlisted`] (by
    /// rename, in one step).
    pub fn list_pod(&self, pod: &Pod) -> Result<()> {
        self.write_pod_manifest(pod)
    }

    /// Writes the manifest of a pod that has no address yet (`Pending`, no
    /// `status.podIP`), as the API server holds a pod scheduled to a node
    /// before the runtime ran its CNI plugins.
    pub fn list_pending(&self, spec: &PodSpec) -> Result<()> {
        let text = pod_manifest(
            &spec.name,
            &spec.namespace,
            &spec.labels,
            &spec.annotations,
            &self.nodes[spec.node].name,
            spec.service_account.as_deref().unwrap_or("default"),
            spec.owner.as_ref(),
            &[],
        );
        self.write_manifest(&format!("pod-{}-{}.yaml", spec.namespace, spec.name), &text)
    }

    fn pod_manifest_file(pod: &Pod) -> String {
        format!("pod-{}-{}.yaml", pod.namespace, pod.name)
    }

    /// The manifest (YAML) [`Cluster::list_pod`] writes for `pod`, e.g. for
    /// an agent given a manifests directory of its own.
    pub fn pod_manifest(&self, pod: &Pod) -> String {
        pod_manifest(
            &pod.name,
            &pod.namespace,
            &pod.labels,
            &pod.annotations,
            &self.nodes[pod.node].name,
            &pod.service_account,
            pod.owner.as_ref(),
            &pod.ips(),
        )
    }

    fn write_pod_manifest(&self, pod: &Pod) -> Result<()> {
        self.write_manifest(&Self::pod_manifest_file(pod), &self.pod_manifest(pod))
    }

    /// `GET path` on node `node`'s admin endpoint (127.0.0.1:15000 in the node's
    /// namespace): the status code and the body.
    pub fn admin_get(&self, node: usize, path: &str) -> Result<(u16, String)> {
        self.http_request(node, ADMIN_PORT, "GET", path)
    }

    /// `POST path` on node `node`'s admin endpoint: the status code and the body.
    pub fn admin_post(&self, node: usize, path: &str) -> Result<(u16, String)> {
        self.http_request(node, ADMIN_PORT, "POST", path)
    }

    /// Node `node`'s metrics page (`GET 127.0.0.1:15020/metrics` in its
    /// namespace), parsed.
    pub fn metrics(&self, node: usize) -> Result<Metrics> {
        let (status, body) = self.http_request(node, METRICS_PORT, "GET", "/metrics")?;
        if status != 200 {
            bail!("/metrics answered {status}: {body}");
        }
        Ok(Metrics::parse(&body))
    }

    /// Node `node`'s readiness (`GET 127.0.0.1:15021/healthz/ready`): the status.
    pub fn readiness(&self, node: usize) -> Result<u16> {
        Ok(self
            .http_request(node, READINESS_PORT, "GET", "/healthz/ready")?
            .0)
    }

    /// Waits (up to 10 s) until `check` holds for node `node`'s metrics; returns
    /// them, or fails with the page.
    pub fn wait_metrics(
        &self,
        node: usize,
        what: &str,
        check: impl Fn(&Metrics) -> bool,
    ) -> Result<Metrics> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let metrics = self.metrics(node)?;
            if check(&metrics) {
                return Ok(metrics);
            }
            if Instant::now() > deadline {
                bail!(
                    "node {}'s metrics never showed {what}:\n{}",
                    node + 1,
                    metrics.text
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A one-shot HTTP/1.1 request to `127.0.0.1:port` in node `node`'s
    /// namespace: the status code and the body.
    pub fn http_request(
        &self,
        node: usize,
        port: u16,
        method: &str,
        path: &str,
    ) -> Result<(u16, String)> {
        use std::io::{Read, Write};
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let response = netns::in_netns(&self.nodes[node].netns, move || {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(request.as_bytes())?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            Ok(text)
        })?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .ok_or_else(|| anyhow!("no HTTP header in {response:?}"))?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow!("no status in {head:?}"))?;
        Ok((status, body.to_string()))
    }

    /// Node `node`'s `/config_dump`, parsed.
    pub fn config_dump(&self, node: usize) -> Result<Value> {
        let (status, body) = self.admin_get(node, "/config_dump")?;
        if status != 200 {
            bail!("/config_dump answered {status}: {body}");
        }
        serde_json::from_str(&body).with_context(|| format!("/config_dump is not JSON: {body}"))
    }

    /// How many endpoints node `node`'s agent knows for Service
    /// `namespace/name`, as its `/config_dump` lists them (0 when it knows no
    /// such Service, or the dump cannot be read).
    pub fn service_endpoints(&self, node: usize, namespace: &str, name: &str) -> usize {
        let Ok(dump) = self.config_dump(node) else {
            return 0;
        };
        dump["services"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["namespace"] == namespace && s["name"] == name)
            .and_then(|s| s["endpoints"].as_array())
            .map_or(0, Vec::len)
    }

    /// Writes `text` as manifest file `file` (replacing it by rename, as a
    /// ConfigMap update does). With [`Source::Kubernetes`], applies its objects
    /// to the API server double instead, and deletes those an earlier text of
    /// `file` had that this one has not.
    pub fn write_manifest(&self, file: &str, text: &str) -> Result<()> {
        let Some(api) = &self.api else {
            return write_atomically(&self.manifests.join(file), text);
        };
        let objects = yaml_objects(text).with_context(|| format!("manifest {file}"))?;
        let mut keys = Vec::new();
        for object in objects {
            keys.push(apply_object(&api.server, object)?);
        }
        let mut files = api.files.lock().expect("files lock");
        let before = files
            .insert(file.to_string(), keys.clone())
            .unwrap_or_default();
        for gone in before.into_iter().filter(|k| !keys.contains(k)) {
            delete_object(&api.server, &gone.0, &gone.1, &gone.2)?;
        }
        Ok(())
    }

    /// Removes manifest file `file`; with [`Source::Kubernetes`], deletes its
    /// objects from the API server double.
    pub fn remove_manifest(&self, file: &str) -> Result<()> {
        let Some(api) = &self.api else {
            let path = self.manifests.join(file);
            return fs::remove_file(&path).with_context(|| format!("removing {}", path.display()));
        };
        let keys = api
            .files
            .lock()
            .expect("files lock")
            .remove(file)
            .with_context(|| format!("no manifest {file} was written"))?;
        for (kind, namespace, name) in keys {
            delete_object(&api.server, &kind, &namespace, &name)?;
        }
        Ok(())
    }

    /// Replaces a pod's labels (rewrites its manifest by rename).
    pub fn set_pod_labels(&mut self, name: &str, labels: BTreeMap<String, String>) -> Result<Pod> {
        let pod = self.pods.get_mut(name).context("no such pod")?;
        pod.labels = labels;
        let pod = pod.clone();
        self.write_pod_manifest(&pod)?;
        Ok(pod)
    }

    /// Deletes a pod: manifest, CNI DEL, namespace.
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        let pod = self.pods.remove(name).context("no such pod")?;
        // A pod an API server double lists without the test bed has no manifest.
        let file = Self::pod_manifest_file(&pod);
        match &self.api {
            Some(api) if api.files.lock().expect("files lock").contains_key(&file) => {
                self.remove_manifest(&file)?;
            }
            Some(_) => {}
            None => match fs::remove_file(self.manifests.join(&file)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            },
        }
        let node = self.nodes[pod.node].clone();
        self.cni("DEL", &node, &pod.container_id, &pod.netns)?;
        let r = Resource::Netns(pod.netns.clone());
        netns::remove(&r);
        self.resources.retain(|x| *x != r);
        Ok(())
    }

    pub fn pod(&self, name: &str) -> &Pod {
        &self.pods[name]
    }

    /// Path of a node agent's log file.
    pub fn agent_log_path(&self, node: usize) -> PathBuf {
        self.dir
            .join(format!("agent-{}.log", self.nodes[node].name))
    }

    /// A node agent's log so far.
    pub fn agent_log(&self, node: usize) -> String {
        fs::read_to_string(self.agent_log_path(node)).unwrap_or_default()
    }

    /// Every node agent's log, headed by its node, for failure messages.
    pub fn agent_logs(&self) -> String {
        (0..self.nodes.len())
            .map(|n| format!("node{}:\n{}", n + 1, self.agent_log(n)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Starts a packet capture on node `node`'s underlay interface (`eth0`).
    pub fn underlay_capture(&self, node: usize) -> Result<Capture> {
        Capture::start(&self.nodes[node].netns, "eth0", &self.dir, "underlay")
    }

    /// Node `node`'s agent lists `pod` as one workload whose `ips` hold every
    /// address of the pod (a dual-stack pod is one workload); panics with the
    /// config dump otherwise.
    pub fn assert_one_workload(&self, node: usize, pod: &Pod) {
        let dump = self.config_dump(node).unwrap();
        let entries: Vec<&Value> = dump["workloads"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|w| w["namespace"] == pod.namespace.as_str() && w["name"] == pod.name.as_str())
            .collect();
        assert_eq!(entries.len(), 1, "{dump:#}");
        let ips: Vec<&str> = entries[0]["ips"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for ip in pod.ips() {
            assert!(ips.contains(&ip.to_string().as_str()), "{ip} in {dump:#}");
        }
    }

    /// Waits (up to 10 s) until a node agent's log has a line containing one of
    /// `needles`; returns the log, or fails with it.
    pub fn wait_log(&self, node: usize, needles: &[&str]) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.agent_log(node);
            if needles.iter().any(|n| log.contains(n)) {
                return Ok(log);
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent log of node {} never showed {needles:?}:\n{log}",
                    node + 1
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many lines of a node agent's log so far contain all of `needles`.
    pub fn log_lines(&self, node: usize, needles: &[&str]) -> usize {
        count_lines(&self.agent_log(node), needles)
    }

    /// Waits (up to `limit`) until a node agent's log has `count` lines containing
    /// all of `needles`; returns the log, or fails with it. For events that happen
    /// more than once (CA reloads), or later than [`Cluster::wait_log`] waits
    /// (retries with backoff).
    pub fn wait_log_lines(
        &self,
        node: usize,
        needles: &[&str],
        count: usize,
        limit: Duration,
    ) -> Result<String> {
        let deadline = Instant::now() + limit;
        loop {
            let log = self.agent_log(node);
            let found = count_lines(&log, needles);
            if found >= count {
                return Ok(log);
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent log of node {} has {found} lines with all of {needles:?}, not {count}:\n{log}",
                    node + 1
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts `podlink agent` in node `node`'s namespace and waits until it runs.
    pub fn start_agent(&mut self, node: usize) -> Result<()> {
        self.start_agent_with(node, &[])
    }

    /// As [`Cluster::start_agent`], with extra agent arguments.
    pub fn start_agent_with(&mut self, node: usize, extra: &[&str]) -> Result<()> {
        let n = self.nodes[node].clone();
        let log_path = self.agent_log_path(node);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let start_len = log.metadata()?.len() as usize;
        let child = netns::command_in(&n.netns, &podlink_bin().to_string_lossy())
            .args([
                "--log-level",
                "info,podlink_agent=debug",
                "agent",
                "--node",
                &n.name,
            ])
            // The test bed's source, unless the agent is given one.
            .args(
                (!extra.contains(&"--kubeconfig") && !extra.contains(&"--manifests"))
                    .then(|| match &self.api {
                        Some(api) => ["--kubeconfig".as_ref(), api.kubeconfigs[node].as_os_str()],
                        None => ["--manifests".as_ref(), self.manifests.as_os_str()],
                    })
                    .into_iter()
                    .flatten(),
            )
            .arg("--pin-dir")
            .arg(&n.pin_dir)
            .arg("--state-dir")
            .arg(&n.state_dir)
            // The test bed's CA, unless the agent is to use an Istio CA.
            .args(
                (!extra.contains(&"--ca-address"))
                    .then(|| ["--ca-dir".as_ref(), self.ca_dir.as_os_str()])
                    .into_iter()
                    .flatten(),
            )
            // A socket of its own, unless given one.
            .args(
                (!extra.contains(&"--cni-socket"))
                    .then(|| ["--cni-socket".as_ref(), n.cni_socket.as_os_str()])
                    .into_iter()
                    .flatten(),
            )
            // The cluster's attach mode, unless the agent is given one.
            .args(
                (self.attach_mode != AttachMode::Auto && !extra.contains(&"--attach-mode"))
                    .then(|| ["--attach-mode", self.attach_mode.arg()])
                    .into_iter()
                    .flatten(),
            )
            .args(extra)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the agent")?;
        register(Resource::Process(child.id()));
        self.agents.insert(node, child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.agent_log(node);
            if text
                .get(start_len..)
                .is_some_and(|t| t.contains("agent running"))
            {
                return Ok(());
            }
            if let Some(status) = self
                .agents
                .get_mut(&node)
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!("the agent of {} exited ({status}):\n{text}", n.name);
            }
            if Instant::now() > deadline {
                bail!("the agent of {} did not start in time:\n{text}", n.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Gives the underlay namespace's bridge the address `10.100.0.<host>`, where
    /// a service outside the nodes (an Istio CA, as istiod would be) can listen:
    /// every node reaches it over its `eth0`.
    pub fn add_underlay_host(&self, host: u8) -> Result<Ipv4Addr> {
        let addr = Ipv4Addr::new(10, 100, 0, host);
        ip(&[
            "-n",
            &self.underlay,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "br0",
        ])?;
        Ok(addr)
    }

    /// The process id of a node's running agent.
    pub fn agent_pid(&self, node: usize) -> Option<u32> {
        self.agents.get(&node).map(Child::id)
    }

    /// Sends `signal` to a node's agent, without waiting.
    pub fn signal_agent(&self, node: usize, signal: i32) -> Result<()> {
        let pid = self.agent_pid(node).context("no agent runs on that node")?;
        // SAFETY: signalling our own child, which has not been reaped.
        if unsafe { libc::kill(pid as i32, signal) } != 0 {
            bail!("kill: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether a node's agent is still running (started and not exited).
    pub fn agent_running(&mut self, node: usize) -> bool {
        self.agents
            .get_mut(&node)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits up to `limit` for a node's agent to exit; returns its exit status,
    /// or fails with its log.
    pub fn wait_agent_exit(
        &mut self,
        node: usize,
        limit: Duration,
    ) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        let mut child = self.agents.remove(&node).context("no agent on that node")?;
        loop {
            if let Some(status) = child.try_wait()? {
                netns::unregister(&Resource::Process(child.id()));
                return Ok(status);
            }
            if Instant::now() > deadline {
                self.agents.insert(node, child);
                bail!(
                    "the agent of node {} did not exit within {limit:?}:\n{}",
                    node + 1,
                    self.agent_log(node)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops a node's agent with SIGTERM and waits for it to exit.
    pub fn stop_agent(&mut self, node: usize) -> Result<()> {
        if let Some(mut child) = self.agents.remove(&node) {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            netns::unregister(&Resource::Process(child.id()));
        }
        Ok(())
    }

    /// `podlink <args>` run in node `node`'s network namespace (as an operator
    /// would, e.g. `inspect`, `uninstall`); add `--pin-dir` and the like.
    pub fn podlink_command(&self, node: usize, args: &[&str]) -> Command {
        let mut cmd = netns::command_in(&self.nodes[node].netns, &podlink_bin().to_string_lossy());
        cmd.args(args);
        cmd
    }

    /// `podlink inspect --json` of node `node`'s pin directory, parsed.
    pub fn inspect(&self, node: usize) -> Result<Value> {
        let out = run(self
            .podlink_command(node, &["inspect", "--json", "--pin-dir"])
            .arg(&self.nodes[node].pin_dir))?;
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "podlink inspect --json printed no JSON: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// `podlink preflight --json` run in node `node`'s network namespace with its
    /// pin directory, parsed. It fails (exits non-zero) when the kernel lacks
    /// something; the report is printed either way.
    pub fn preflight(&self, node: usize) -> Result<Value> {
        let out = run(self
            .podlink_command(node, &["preflight", "--json", "--pin-dir"])
            .arg(&self.nodes[node].pin_dir))?;
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "podlink preflight --json printed no JSON: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// The ifindex of a pod's host veth in its node namespace.
    pub fn host_ifindex(&self, pod: &Pod) -> Result<u32> {
        let out = ip(&[
            "-n",
            &self.nodes[pod.node].netns,
            "-j",
            "link",
            "show",
            &pod.host_veth,
        ])?;
        let v: Value = serde_json::from_slice(&out.stdout)?;
        v[0]["ifindex"]
            .as_u64()
            .map(|i| i as u32)
            .ok_or_else(|| anyhow!("no ifindex for {}", pod.host_veth))
    }

    /// `tc -j filter show dev <veth> <direction>` of a pod's host veth, parsed.
    pub fn tc_filters(&self, pod: &Pod, direction: &str) -> Result<Value> {
        let out = run(netns::command_in(&self.nodes[pod.node].netns, "tc").args([
            "-j",
            "filter",
            "show",
            "dev",
            &pod.host_veth,
            direction,
        ]))?;
        let text = String::from_utf8_lossy(&out.stdout);
        // Nothing at all (no clsact qdisc) prints nothing.
        if text.trim().is_empty() {
            return Ok(Value::Array(Vec::new()));
        }
        serde_json::from_str(&text).with_context(|| format!("tc printed no JSON: {text}"))
    }

    /// A pod's programs attached in its node: pinned TCX links (`links/` of the
    /// node's pins) and podlink's `cls_bpf` filters (`tc filter show`).
    pub fn attachments(&self, pod: &Pod) -> Result<Attachments> {
        self.attachments_at(pod, self.host_ifindex(pod)?)
    }

    /// [`Cluster::attachments`] of a pod whose host veth has index `ifindex`.
    fn attachments_at(&self, pod: &Pod, ifindex: u32) -> Result<Attachments> {
        let links = self.nodes[pod.node].pins().join("links");
        let mut found = Attachments::default();
        for (program, direction) in [("from_pod", "ingress"), ("to_pod", "egress")] {
            if links.join(format!("{ifindex}_{program}")).exists() {
                found.links.push(program);
            }
            let shown = self.tc_filters(pod, direction)?;
            if podlink_filters(&shown, program).next().is_some() {
                found.filters.push(program);
            }
        }
        Ok(found)
    }

    /// What identifies a pod's attachments to the kernel, to tell whether they
    /// were replaced: the ids of its TCX links (`podlink inspect`), and for its
    /// `cls_bpf` filters, which have no id of their own (and whose program a new
    /// agent replaces in place), their program, direction, priority and handle.
    pub fn attachment_ids(&self, pod: &Pod) -> Result<Vec<String>> {
        let ifindex = self.host_ifindex(pod)?;
        let report = self.inspect(pod.node)?;
        let mut ids: Vec<String> = report["links"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| l["ifindex"] == ifindex)
            .map(|l| format!("link {}", l["link_id"]))
            .chain(
                report["filters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|f| f["ifindex"] == ifindex)
                    .map(|f| {
                        format!(
                            "filter {} {} pref {} handle {}",
                            f["program"], f["direction"], f["priority"], f["handle"]
                        )
                    }),
            )
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Whether the pod is captured: both programs attached to its host veth, each
    /// once (a pinned TCX link or podlink's `cls_bpf` filter, not both), and its
    /// pods-map entry present. `None` while only part of that is in place.
    pub fn capture_state(&self, pod: &Pod) -> Result<Option<bool>> {
        let ifindex = self.host_ifindex(pod)?;
        let attachments = self.attachments_at(pod, ifindex)?;
        let attached = ["from_pod", "to_pod"]
            .iter()
            .filter(|p| attachments.links.contains(p) || attachments.filters.contains(p))
            .count();
        let twice = attachments
            .links
            .iter()
            .any(|p| attachments.filters.contains(p));
        let entry = self
            .dump_map(pod.node, "pods")?
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["formatted"]["key"].as_u64() == Some(u64::from(ifindex)));
        Ok(match (attached, twice, entry) {
            (2, false, true) => Some(true),
            (0, _, false) => Some(false),
            _ => None,
        })
    }

    /// Whether the pod is fully captured (see [`Cluster::capture_state`]).
    pub fn is_captured(&self, pod: &Pod) -> Result<bool> {
        Ok(self.capture_state(pod)? == Some(true))
    }

    /// Waits until the pod is captured (`true`) or not (`false`).
    pub fn wait_captured(&self, pod: &Pod, captured: bool) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.capture_state(pod)? != Some(captured) {
            if Instant::now() > deadline {
                bail!(
                    "pod {} is {}captured after 10 s; agent log:\n{}",
                    pod.name,
                    if captured { "not " } else { "still " },
                    self.agent_log(pod.node)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// `bpftool -j map dump pinned` of one of a node's maps.
    pub fn dump_map(&self, node: usize, map: &str) -> Result<Value> {
        self.dump_map_at(&self.nodes[node].pins().join(map))
    }

    /// `bpftool -j map dump pinned <path>`.
    pub fn dump_map_at(&self, path: &Path) -> Result<Value> {
        let out = run(Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(path))?;
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// The pod's packet counters (summed over CPUs); empty if it has no entry.
    pub fn counters(&self, pod: &Pod) -> Result<Counters> {
        let ifindex = self.host_ifindex(pod)?;
        let dump = self.dump_map(pod.node, "pod_counters")?;
        let mut sums = Counters::new();
        for entry in dump.as_array().into_iter().flatten() {
            let formatted = &entry["formatted"];
            if formatted["key"].as_u64() != Some(u64::from(ifindex)) {
                continue;
            }
            for cpu in formatted["values"].as_array().into_iter().flatten() {
                for (field, value) in cpu["value"].as_object().into_iter().flatten() {
                    *sums.entry(field.clone()).or_default() += value.as_u64().unwrap_or(0);
                }
            }
        }
        Ok(sums)
    }
}

/// The addresses of a CNI result (`ips[].address`, prefix length dropped), in
/// its order.
fn cni_result_ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
        .collect()
}

/// A Pod manifest; `ips` are its `status.podIPs` (the first is `podIP`); without
/// any, `Pending` with no address.
#[allow(
    clippy::too_many_arguments,
    reason = "the fields of a Pod manifest, each named at the call"
)]
fn pod_manifest(
    name: &str,
    ns: &str,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    node: &str,
    sa: &str,
    owner: Option<&(String, String)>,
    ips: &[IpAddr],
) -> String {
    let owner = owner.map_or(String::new(), |(kind, owner)| {
        let api = if kind == "Job" || kind == "CronJob" { "batch/v1" } else { "apps/v1" };
        format!(
            "  ownerReferences:\n  - {{apiVersion: {api}, kind: {kind}, name: {owner}, uid: uid-{owner}, controller: true, blockOwnerDeletion: true}}\n"
        )
    });
    let status = match ips.first() {
        Some(ip) => {
            // Quoted: an IPv6 address is full of colons.
            let all: String = ips.iter().map(|ip| format!("  - ip: \"{ip}\"\n")).collect();
            format!("  phase: Running\n  podIP: \"{ip}\"\n  podIPs:\n{all}")
        }
        None => "  phase: Pending\n".into(),
    };
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  labels: {labels}
  annotations: {annotations}
{owner}spec:
  nodeName: {node}
  serviceAccountName: {sa}
  containers:
  - name: app
    image: registry.example/app:1
status:
{status}",
        labels = yaml_labels(labels),
        annotations = yaml_annotations(annotations),
    )
}

/// How many lines of `log` contain all of `needles`.
fn count_lines(log: &str, needles: &[&str]) -> usize {
    log.lines()
        .filter(|line| needles.iter().all(|n| line.contains(n)))
        .count()
}

fn truncate_ifname(name: &str) -> String {
    // Keep the unique tail: pid and counter are at the end.
    let bytes = name.as_bytes();
    if bytes.len() <= 15 {
        name.to_string()
    } else {
        String::from_utf8_lossy(&bytes[bytes.len() - 15..]).into_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, mut child) in self.agents.drain() {
            let _ = child.kill();
            let _ = child.wait();
            netns::unregister(&Resource::Process(child.id()));
        }
        let pods: Vec<Pod> = self.pods.values().cloned().collect();
        for pod in pods {
            let node = self.nodes[pod.node].clone();
            let _ = self.cni("DEL", &node, &pod.container_id, &pod.netns);
        }
        let mut resources = std::mem::take(&mut self.resources);
        resources.sort_by_key(|r| match r {
            Resource::Process(_) => 0,
            Resource::Netns(_) => 1,
            Resource::Mount(_) => 2,
            Resource::Dir(_) => 3,
        });
        for r in &resources {
            netns::remove(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dual_stack_cni_result_gives_both_addresses_in_order() {
        let result = serde_json::json!({
            "ips": [
                {"interface": 1, "address": "10.244.1.2/24", "gateway": "10.244.1.1"},
                {"interface": 1, "address": "fd00:10:244:1::2/64", "gateway": "fd00:10:244:1::1"},
            ]
        });
        assert_eq!(
            cni_result_ips(&result),
            [
                "10.244.1.2".parse::<IpAddr>().unwrap(),
                "fd00:10:244:1::2".parse().unwrap()
            ]
        );
        assert!(cni_result_ips(&serde_json::json!({})).is_empty());
    }

    #[test]
    fn pod_manifests_list_every_address_in_pod_ips() {
        let ips: [IpAddr; 2] = [
            "10.244.1.2".parse().unwrap(),
            "fd00:10:244:1::2".parse().unwrap(),
        ];
        let text = pod_manifest(
            "p",
            "ns",
            &BTreeMap::new(),
            &BTreeMap::new(),
            "node1",
            "default",
            None,
            &ips,
        );
        let objects = yaml_objects(&text).unwrap();
        let status = &objects[0]["status"];
        assert_eq!(status["phase"], "Running");
        assert_eq!(status["podIP"], "10.244.1.2");
        assert_eq!(
            status["podIPs"],
            serde_json::json!([{"ip": "10.244.1.2"}, {"ip": "fd00:10:244:1::2"}])
        );

        let pending = pod_manifest(
            "p",
            "ns",
            &BTreeMap::new(),
            &BTreeMap::new(),
            "node1",
            "default",
            None,
            &[],
        );
        let status = &yaml_objects(&pending).unwrap()[0]["status"];
        assert_eq!(status["phase"], "Pending");
        assert!(status.get("podIPs").is_none());
    }

    #[test]
    fn pods_give_their_address_of_each_family() {
        let pod = Pod {
            name: "p".into(),
            namespace: "ns".into(),
            node: 0,
            netns: "n".into(),
            ip: "10.244.1.2".parse().unwrap(),
            ipv6: Some("fd00:10:244:1::2".parse().unwrap()),
            host_veth: "veth0".into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            service_account: "default".into(),
            owner: None,
            container_id: "c".into(),
        };
        assert_eq!(pod.addr_of(Family::V4, 80).to_string(), "10.244.1.2:80");
        assert_eq!(pod.addr6(80).to_string(), "[fd00:10:244:1::2]:80");
        assert_eq!(pod.ips().len(), 2);
        let v4_only = Pod { ipv6: None, ..pod };
        assert_eq!(v4_only.ips(), [IpAddr::V4(v4_only.ip)]);
    }
}
