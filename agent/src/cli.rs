//! The command line of `podlink`: the node agent and its operator commands
//! (clap). It lives in the library so that tests can parse argument lists the
//! deployment manifests give (`deploy/base/daemonset.yaml`, and as
//! `deploy/istio` patches it).

use std::{path::PathBuf, time::Duration};

use crate::{
    admin::DEFAULT_ADMIN_ADDRESS,
    agent::{self, AgentConfig, CniConfig, WorkloadSourceConfig},
    authz::DEFAULT_ROOT_NAMESPACE,
    cni,
    dataplane::{AttachMode, DEFAULT_PIN_DIR, DEFAULT_STATE_DIR, inspect, preflight},
    identity::{
        DEFAULT_TRUST_DOMAIN, ca,
        istio_ca::{DEFAULT_CLUSTER_ID, DEFAULT_TOKEN_FILE, IstioCaConfig},
    },
    telemetry::{
        logging::{self, LogFormat},
        metrics::DEFAULT_METRICS_ADDRESS,
        server::DEFAULT_READINESS_ADDRESS,
    },
    uninstall::{self, UninstallConfig},
    xds::{Backoff, NodeIdentity, XdsConfig},
};
use anyhow::Result;
use clap::{Args, Parser, Subcommand};

/// `podlink`'s command line.
#[derive(Parser)]
#[command(
    name = "podlink",
    version,
    about = "eBPF redirection dataplane and HBONE proxy for Kubernetes"
)]
pub struct Cli {
    /// Log filter (tracing EnvFilter syntax); RUST_LOG overrides it. The agent's
    /// can be changed at run time: POST /logging?level=... on the admin endpoint.
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    /// Log lines as text, or as JSON objects (one per line).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent in this node's network namespace.
    Agent(Box<AgentArgs>),
    /// Certificate authority tools.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
    /// Show what is pinned and attached: enrolled pods (interface, addresses,
    /// flags), their TCX links or cls_bpf filters, their packet counters by outcome
    /// and drop reason, and anything inconsistent. Reads only, with or without an
    /// agent running; run it in the node's network namespace.
    Inspect {
        /// The agent's pin directory.
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Print a JSON document instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Check that this node's kernel has what podlink's programs need — the
    /// program and map types, every helper they call, TCX or else the clsact
    /// qdisc and cls_bpf, a bpffs for the pins, BTF — as the agent does at start,
    /// and say which is missing and what needs it. Probes with trivial programs
    /// and maps, changes nothing; fails when something is missing. Run it as
    /// root, agent running or not.
    Preflight {
        /// The agent's pin directory (its bpffs is checked).
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Print a JSON document instead of a table.
        #[arg(long)]
        json: bool,
        /// How the agent will attach the programs, as `podlink agent
        /// --attach-mode`: `cls-bpf` checks the clsact qdisc and cls_bpf even
        /// where TCX exists.
        #[arg(long, value_enum, default_value_t = AttachMode::Auto)]
        attach_mode: AttachMode,
    },
    /// Remove everything the agent made on this node: links and pins, its cls_bpf
    /// filters and the clsact qdiscs it added (where no other filter is left), the
    /// policy routing rule and route, the sysctls it changed (restored where they
    /// still have its value), and podlink-cni from the CNI configuration lists.
    /// Refuses while an agent runs on the pin directory: stop it first. Run it in
    /// the node's network namespace; running it again is harmless.
    Uninstall {
        /// The agent's pin directory.
        #[arg(long, default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// The agent's state directory (the sysctl journal, the record of the
        /// clsact qdiscs it added).
        #[arg(long, default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// The CNI configuration directory (its *.conflist files are edited).
        #[arg(long, default_value = cni::DEFAULT_CONF_DIR)]
        cni_conf_dir: PathBuf,
        /// The CNI plugin directory the agent installed podlink-cni into
        /// (`--install-cni`): its podlink-cni binary is removed. Without it the
        /// binary is left in place.
        #[arg(long, value_name = "DIR")]
        cni_bin_dir: Option<PathBuf>,
        /// The agent's podlink-cni socket: the enrollment snapshot beside it (and
        /// a socket file a killed agent left) are removed.
        #[arg(long, value_name = "PATH", default_value = cni::DEFAULT_SOCKET)]
        cni_socket: PathBuf,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Write a development CA: DIR/ca.crt and DIR/ca.key (PEM).
    Init {
        /// Directory to write into (created if missing; existing files are kept).
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Args)]
struct AgentArgs {
    /// This node's name, as in the pods' spec.nodeName (in a DaemonSet: from the
    /// downward API's spec.nodeName, as the NODE_NAME variable).
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Read workloads from this directory of Pod, Namespace, AuthorizationPolicy,
    /// Service and EndpointSlice manifests (YAML), watched for changes, instead
    /// of the Kubernetes API.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Watch the Kubernetes API with this kubeconfig. Without it and without
    /// --manifests, the in-cluster configuration (service account token and
    /// KUBERNETES_SERVICE_HOST) is used.
    #[arg(long, value_name = "PATH")]
    kubeconfig: Option<PathBuf>,
    /// Unix socket on which the agent answers the podlink-cni plugin (enrolls a
    /// pod before its containers start).
    #[arg(long, value_name = "PATH", default_value = cni::DEFAULT_SOCKET)]
    cni_socket: PathBuf,
    /// Install the podlink-cni plugin: copy it into --cni-bin-dir and add it,
    /// last, to the node's CNI configuration list in --cni-conf-dir (removed by
    /// `podlink uninstall`).
    #[arg(long)]
    install_cni: bool,
    /// The podlink-cni binary to install; default: podlink-cni beside this
    /// executable.
    #[arg(long, value_name = "PATH", requires = "install_cni")]
    cni_plugin: Option<PathBuf>,
    /// Where the container runtime looks for CNI plugin binaries.
    #[arg(long, default_value = cni::DEFAULT_BIN_DIR)]
    cni_bin_dir: PathBuf,
    /// The CNI configuration directory (its first *.conflist gets podlink-cni).
    #[arg(long, default_value = cni::DEFAULT_CONF_DIR)]
    cni_conf_dir: PathBuf,
    /// Directory holding ca.crt (the signing CA certificate first, then further
    /// trust anchors) and ca.key. Watched: a change is checked and put in force
    /// (every workload certificate reissued) or refused with an error, the CA in
    /// force staying.
    #[arg(
        long,
        required_unless_present = "ca_address",
        conflicts_with = "ca_address"
    )]
    ca_dir: Option<PathBuf>,
    /// Get workload certificates from an Istio CA (istiod) at this https://host:port
    /// instead: a CSR per local workload identity to
    /// IstioCertificateService/CreateCertificate.
    #[arg(long, value_name = "URL", requires = "ca_root_cert")]
    ca_address: Option<String>,
    /// With --ca-address: PEM bundle of the mesh's root certificates; verifies the
    /// CA server and the issued certificates, and is the trust bundle of HBONE.
    /// Watched and reloaded like ca.crt.
    #[arg(long, value_name = "PATH", requires = "ca_address")]
    ca_root_cert: Option<PathBuf>,
    /// With --ca-address: the node agent's token, sent as a bearer token (read on
    /// every request).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_TOKEN_FILE)]
    ca_token_file: PathBuf,
    /// Learn workloads, services and authorization policies from Istio's control
    /// plane (istiod) at this https://host:port over workload xDS (delta ADS), as
    /// ztunnel does; this node's pods still come from the Kubernetes API (their
    /// enrollment, the CNI path). Uses the --ca-root-cert, --ca-token-file and
    /// --cluster-id of --ca-address.
    #[arg(
        long,
        value_name = "URL",
        requires = "ca_address",
        conflicts_with = "manifests"
    )]
    xds_address: Option<String>,
    /// With --xds-address: the agent's own pod name, namespace and address, which
    /// name it to istiod (node ID `ztunnel~<ip>~<pod>.<namespace>~…`).
    #[arg(long, env = "POD_NAME", requires = "xds_address")]
    pod_name: Option<String>,
    /// With --xds-address: see --pod-name.
    #[arg(long, env = "POD_NAMESPACE", requires = "xds_address")]
    pod_namespace: Option<String>,
    /// With --xds-address: see --pod-name.
    #[arg(long, env = "INSTANCE_IP", requires = "xds_address")]
    pod_ip: Option<std::net::IpAddr>,
    /// The network this node's workloads are on (Istio's `topology.istio.io/network`;
    /// empty: the default network), sent to istiod with --xds-address.
    #[arg(long, env = "NETWORK", default_value = "")]
    network: String,
    /// The cluster ID: sent to the Istio CA (ClusterID header) with --ca-address,
    /// and the source_cluster/destination_cluster label of the metrics.
    #[arg(long, default_value = DEFAULT_CLUSTER_ID)]
    cluster_id: String,
    /// Where maps and links are pinned (on a bpffs; one is mounted if needed),
    /// under vN/, N being the layout version. Locked while the agent runs.
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    /// Where the original values of the sysctls the agent changes (sysctls.json)
    /// and the clsact qdiscs it adds (clsact/) are recorded, for `podlink
    /// uninstall`. One per node network namespace.
    #[arg(long, default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// SPIFFE trust domain of the mesh.
    #[arg(long, default_value = DEFAULT_TRUST_DOMAIN)]
    trust_domain: String,
    /// Admin endpoint (GET /config_dump, GET and POST /logging); keep it on
    /// loopback.
    #[arg(long, default_value = DEFAULT_ADMIN_ADDRESS)]
    admin_address: std::net::SocketAddr,
    /// Prometheus metrics endpoint (GET /metrics).
    #[arg(long, default_value = DEFAULT_METRICS_ADDRESS)]
    metrics_address: std::net::SocketAddr,
    /// Readiness endpoint (GET /healthz/ready: 200 once the programs are attached
    /// and the listeners accept, 503 while starting or draining).
    #[arg(long, default_value = DEFAULT_READINESS_ADDRESS)]
    readiness_address: std::net::SocketAddr,
    /// Proxy threads, each a runtime of its own accepting on the listeners and
    /// carrying the connections it accepted; 0: one per CPU. The agent's
    /// control work (workloads, DNS, metrics) runs on a runtime beside them.
    #[arg(long, env = "PODLINK_WORKER_THREADS", default_value_t = 0)]
    worker_threads: usize,
    /// On SIGTERM, how long open connections may go on (the listeners accept the
    /// handshakes under way and close) before the agent exits, e.g. 5s (Istio's
    /// terminationDrainDuration).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    drain_grace: Duration,
    /// When a pod leaves the mesh (its namespace's or its own label, or its
    /// annotation), how long the connections the proxy carries for it may go on
    /// (new ones go direct at once) before they are closed, e.g. 1h; 0s closes
    /// them at once.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    leave_drain: Duration,
    /// Namespace whose AuthorizationPolicies apply to the whole mesh.
    #[arg(long, default_value = DEFAULT_ROOT_NAMESPACE)]
    root_namespace: String,
    /// Lifetime of workload certificates (renewed in the background at half of
    /// it), e.g. 24h, 90m; from 10m to 366d.
    #[arg(long, default_value = "24h", value_parser = parse_cert_lifetime)]
    cert_lifetime: Duration,
    /// Time allowed to connect upstream, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// An inbound HBONE connection with no stream for this long is closed, and
    /// so is a CONNECT stream that carried no byte either way in this long after
    /// it opened, e.g. 5m; at least 1s.
    #[arg(long, default_value = "5m", value_parser = parse_idle_timeout)]
    hbone_idle_timeout: Duration,
    /// When no proxy listens, let enrolled pods' new outbound connections pass
    /// uncaptured instead of dropping them (default: fail closed). Enrolled pods'
    /// DNS queries follow it too while the agent's DNS server is away.
    #[arg(long)]
    fail_open: bool,
    /// Capture enrolled pods' DNS queries (UDP and TCP to port 53, any address)
    /// into the agent's DNS server, which answers the cluster's Service names
    /// and forwards the rest to the resolver the pod asked. A pod annotated
    /// ambient.istio.io/dns-capture: "false" is left alone; false leaves every
    /// pod alone.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    dns_capture: bool,
    /// The cluster's DNS domain: Services are named
    /// <name>.<namespace>.svc.<domain>.
    #[arg(long, default_value = crate::dns::names::DEFAULT_CLUSTER_DOMAIN)]
    cluster_domain: String,
    /// Time a resolver has to answer a query the DNS server forwarded before the
    /// pod gets SERVFAIL, e.g. 2s; from 100ms to 30s.
    #[arg(long, default_value = "2s", value_parser = parse_dns_timeout)]
    dns_upstream_timeout: Duration,
    /// Set /sys/kernel/rcu_expedited to 1 for the moment of a pod's TCX
    /// attachments (about 0.05 ms per link instead of a normal RCU grace period
    /// each). Node-wide: every RCU grace period on the node is expedited meanwhile
    /// (an IPI to each busy CPU). Without it a pod's enrollment takes 16 to 32 ms
    /// (two links of 8 to 16 ms at HZ=250), well within what pod start-up
    /// tolerates.
    #[arg(long)]
    expedite_attach: bool,
    /// How the programs are attached to the pods' host veths: auto (TCX links
    /// on Linux 6.6 and later, else cls-bpf), tcx (pinned TCX links; refused below
    /// 6.6) or cls-bpf (netlink cls_bpf filters on a clsact qdisc, priority 1,
    /// handle 0x53b, for tooling that expects tc filters). Either outlives the
    /// agent; an agent started in the other mode than the previous one takes its
    /// attachments over pod by pod.
    #[arg(long, value_enum, default_value_t = AttachMode::Auto)]
    attach_mode: AttachMode,
    /// Destination prefix, IPv4 or IPv6, that bypasses capture (repeatable),
    /// e.g. 169.254.0.0/16 or fd00:ec2::/64.
    #[arg(long = "exclude-cidr", value_name = "CIDR", value_parser = parse_cluster_cidr)]
    excluded_cidrs: Vec<ipnet::IpNet>,
    /// The cluster's pod and service ranges, IPv4 and IPv6 (repeatable, or
    /// comma-separated), e.g. 10.244.0.0/16,10.96.0.0/12. An enrolled pod's
    /// connection to an address in them that the agent does not know yet (a
    /// pod or Service created a moment ago) waits up to 1s for it to be learned,
    /// then goes over HBONE if it is an enrolled pod. Ranges are also learned
    /// from the Node objects' podCIDRs and the Services' ClusterIPs.
    #[arg(long = "cluster-cidrs", value_name = "CIDR", value_delimiter = ',', value_parser = parse_cluster_cidr)]
    cluster_cidrs: Vec<ipnet::IpNet>,
    /// Destination port that bypasses capture, both directions (repeatable).
    #[arg(long = "exclude-port", value_name = "PORT")]
    excluded_ports: Vec<u16>,
    /// Connections (and inbound HBONE streams) handled at once; more are refused.
    /// Default: a third of the open-file limit. Inbound HBONE handshakes under way
    /// have their own budget, a quarter of it.
    #[arg(long)]
    max_connections: Option<usize>,
}

/// Certificate lifetimes the agent accepts: long enough that renewal at half of
/// it cannot spin, short enough to stay within X.509 dates.
const CERT_LIFETIME_RANGE: (Duration, Duration) = (
    Duration::from_secs(10 * 60),
    Duration::from_secs(366 * 24 * 3600),
);

fn parse_cluster_cidr(s: &str) -> Result<ipnet::IpNet, String> {
    crate::state::ranges::parse_cidr(s).map_err(|e| e.to_string())
}

fn parse_dns_timeout(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if !(Duration::from_millis(100)..=Duration::from_secs(30)).contains(&d) {
        return Err(format!("{s} is not within 100ms to 30s"));
    }
    Ok(d)
}

fn parse_idle_timeout(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_secs(1) {
        return Err(format!("{s} is shorter than 1s"));
    }
    Ok(d)
}

fn parse_cert_lifetime(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    let (min, max) = CERT_LIFETIME_RANGE;
    if d < min || d > max {
        return Err(format!(
            "{s} is outside {} to {}",
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(d)
}

/// Parses the process's arguments and runs the command.
///
/// # Errors
/// The command's errors.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    let log_control = logging::init(&cli.log_level, cli.log_format)?;
    match cli.command {
        Command::Ca {
            command: CaCommand::Init { out },
        } => {
            let (cert, key) = ca::init(&out)?;
            println!("wrote {} and {}", cert.display(), key.display());
            Ok(())
        }
        Command::Inspect { pin_dir, json } => {
            let report = inspect::inspect(&pin_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.to_table());
            }
            Ok(())
        }
        Command::Preflight {
            pin_dir,
            json,
            attach_mode,
        } => {
            let report = preflight::run(&pin_dir, attach_mode)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.to_table());
            }
            match report.error() {
                Some(error) => Err(error.into()),
                None => Ok(()),
            }
        }
        Command::Uninstall {
            pin_dir,
            state_dir,
            cni_conf_dir,
            cni_bin_dir,
            cni_socket,
        } => {
            let done = uninstall::uninstall(&UninstallConfig {
                pin_dir,
                state_dir,
                cni_conf_dir,
                cni_bin_dir,
                cni_socket,
            })?;
            for line in &done {
                println!("{line}");
            }
            if done.is_empty() {
                println!("nothing of podlink's was left on this node");
            }
            Ok(())
        }
        Command::Agent(args) => {
            let args = *args;
            let proxy_threads = if args.worker_threads > 0 {
                args.worker_threads
            } else {
                std::thread::available_parallelism().map_or(2, |n| n.get())
            };
            agent::configure_allocator(proxy_threads);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let source = match (args.manifests, args.xds_address) {
                (Some(dir), _) => WorkloadSourceConfig::Manifests(dir),
                (None, None) => WorkloadSourceConfig::Kubernetes {
                    kubeconfig: args.kubeconfig,
                },
                (None, Some(address)) => {
                    let missing = |what: &str, env: &str| {
                        anyhow::anyhow!(
                            "--xds-address needs --{what} (or {env}): it names the agent to istiod"
                        )
                    };
                    WorkloadSourceConfig::Istiod {
                        kubeconfig: args.kubeconfig,
                        xds: Box::new(XdsConfig {
                            address,
                            root_cert: args
                                .ca_root_cert
                                .clone()
                                .expect("clap requires --ca-root-cert with --ca-address"),
                            token_file: args.ca_token_file.clone(),
                            cluster_id: args.cluster_id.clone(),
                            node: NodeIdentity {
                                ip: args
                                    .pod_ip
                                    .ok_or_else(|| missing("pod-ip", "INSTANCE_IP"))?,
                                pod_name: args
                                    .pod_name
                                    .ok_or_else(|| missing("pod-name", "POD_NAME"))?,
                                namespace: args
                                    .pod_namespace
                                    .ok_or_else(|| missing("pod-namespace", "POD_NAMESPACE"))?,
                                node_name: args.node.clone(),
                                network: args.network,
                            },
                            backoff: Backoff::default(),
                        }),
                        trust_domain: args.trust_domain.clone(),
                    }
                }
            };
            runtime.block_on(agent::run(AgentConfig {
                node: args.node,
                source,
                cni: CniConfig {
                    socket: args.cni_socket,
                    install: args.install_cni.then_some(cni::Install {
                        plugin: args.cni_plugin,
                        bin_dir: args.cni_bin_dir,
                        conf_dir: args.cni_conf_dir,
                    }),
                },
                ca_dir: args.ca_dir,
                istio_ca: args.ca_address.map(|address| IstioCaConfig {
                    address,
                    root_cert: args.ca_root_cert.expect("clap requires --ca-root-cert"),
                    token_file: args.ca_token_file,
                    cluster_id: args.cluster_id.clone(),
                }),
                pin_dir: args.pin_dir,
                state_dir: args.state_dir,
                trust_domain: args.trust_domain,
                root_namespace: args.root_namespace,
                admin_address: args.admin_address,
                cert_lifetime: args.cert_lifetime,
                fail_open: args.fail_open,
                dns_capture: args.dns_capture,
                cluster_domain: args.cluster_domain,
                dns_upstream_timeout: args.dns_upstream_timeout,
                expedite_attach: args.expedite_attach,
                attach_mode: args.attach_mode,
                excluded_cidrs: args.excluded_cidrs,
                cluster_cidrs: args.cluster_cidrs,
                excluded_ports: args.excluded_ports,
                connect_timeout: args.connect_timeout,
                hbone_idle_timeout: args.hbone_idle_timeout,
                proxy_threads,
                max_connections: args.max_connections,
                metrics_address: args.metrics_address,
                readiness_address: args.readiness_address,
                drain_grace: args.drain_grace,
                leave_drain: args.leave_drain,
                cluster_id: args.cluster_id,
                log_control: Some(log_control),
            }))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! The deployment's arguments (`deploy/base/daemonset.yaml`, as is and as
    //! `deploy/istio` patches it, and the uninstall pod) parsed by the agent's
    //! own command line, as the kubelet would pass them.

    use std::{collections::HashMap, path::Path};

    use clap::Parser;
    use serde_yaml_ng::Value;

    use super::{Cli, Command};

    fn deploy_file(name: &str) -> Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy")
            .join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
    }

    /// The object `kind`/`name` of `deploy/base` (file `file`) with the JSON
    /// patches of `deploy/<variant>/kustomization.yaml` that target it applied,
    /// as kustomize does (`cargo xtask validate-deploy` checks that every patch
    /// there is a JSON patch matching one object).
    pub(crate) fn patched(variant: &str, file: &str, kind: &str, name: &str) -> Value {
        let mut object: serde_json::Value =
            serde_yaml_ng::from_value(deploy_file(&format!("base/{file}"))).unwrap();
        assert_eq!(
            (object["kind"].as_str(), object["metadata"]["name"].as_str()),
            (Some(kind), Some(name))
        );
        let kustomization = deploy_file(&format!("{variant}/kustomization.yaml"));
        let mut applied = 0;
        for entry in kustomization["patches"].as_sequence().into_iter().flatten() {
            let target = &entry["target"];
            if target["kind"].as_str() != Some(kind) || target["name"].as_str() != Some(name) {
                continue;
            }
            let text = str_of(&entry["patch"], "an inline patch");
            let operations: json_patch::Patch = serde_yaml_ng::from_str(text).unwrap_or_else(|e| {
                panic!("{variant}: a patch of {kind} {name} is no JSON patch: {e}")
            });
            json_patch::patch(&mut object, &operations)
                .unwrap_or_else(|e| panic!("{variant}: patching {kind} {name}: {e}"));
            applied += 1;
        }
        assert!(applied > 0, "{variant} does not patch {kind} {name}");
        serde_yaml_ng::to_value(object).unwrap()
    }

    fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
        v.as_str()
            .unwrap_or_else(|| panic!("{what} is not a string: {v:?}"))
    }

    /// The pod spec's container `name`.
    fn container<'a>(pod_spec: &'a Value, name: &str) -> &'a Value {
        pod_spec["containers"]
            .as_sequence()
            .expect("containers")
            .iter()
            .find(|c| c["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no container {name}"))
    }

    /// The container's environment as the kubelet would set it: literal values,
    /// the downward API's fields as placeholders, keys of `configmap`.
    fn container_env(container: &Value, configmap: &Value) -> HashMap<String, String> {
        let configmap_name = str_of(&configmap["metadata"]["name"], "ConfigMap name");
        let mut env = HashMap::new();
        for var in container["env"].as_sequence().into_iter().flatten() {
            let name = str_of(&var["name"], "env name").to_string();
            let value = if let Some(value) = var.get("value") {
                str_of(value, &name).to_string()
            } else if let Some(field) = var["valueFrom"].get("fieldRef") {
                match str_of(&field["fieldPath"], &name) {
                    "spec.nodeName" => "node-1".to_string(),
                    "metadata.name" => "podlink-x7k2p".to_string(),
                    "metadata.namespace" => "podlink".to_string(),
                    "status.podIP" | "status.hostIP" => "10.0.0.11".to_string(),
                    other => panic!("{name}: no placeholder for fieldPath {other}"),
                }
            } else if let Some(key_ref) = var["valueFrom"].get("configMapKeyRef") {
                assert_eq!(
                    str_of(&key_ref["name"], &name),
                    configmap_name,
                    "{name} refers to another ConfigMap"
                );
                let key = str_of(&key_ref["key"], &name);
                str_of(
                    configmap["data"]
                        .get(key)
                        .unwrap_or_else(|| panic!("{name}: the ConfigMap has no key {key}")),
                    key,
                )
                .to_string()
            } else {
                panic!("{name}: neither value, fieldRef nor configMapKeyRef");
            };
            env.insert(name, value);
        }
        env
    }

    /// `arg` with `$(VAR)` replaced by the variable's value and `$$` by `$`, as
    /// the kubelet expands command and args. A reference to a variable the
    /// container does not define would reach the agent unexpanded: a failure here.
    fn expand(arg: &str, env: &HashMap<String, String>) -> String {
        let mut out = String::new();
        let mut rest = arg;
        while let Some(i) = rest.find('$') {
            out.push_str(&rest[..i]);
            rest = &rest[i..];
            if let Some(after) = rest.strip_prefix("$$") {
                out.push('$');
                rest = after;
            } else if let Some(after) = rest.strip_prefix("$(") {
                let end = after
                    .find(')')
                    .unwrap_or_else(|| panic!("unclosed $( in {arg}"));
                let name = &after[..end];
                let value = env
                    .get(name)
                    .unwrap_or_else(|| panic!("{arg}: the container defines no {name}"));
                out.push_str(value);
                rest = &after[end + 1..];
            } else {
                out.push('$');
                rest = &rest[1..];
            }
        }
        out.push_str(rest);
        out
    }

    /// The container's command and args, expanded with `configmap`'s keys.
    fn argv(container: &Value, configmap: &Value) -> Vec<String> {
        let env = container_env(container, configmap);
        container["command"]
            .as_sequence()
            .expect("the container names its command")
            .iter()
            .chain(container["args"].as_sequence().into_iter().flatten())
            .map(|a| expand(str_of(a, "argument"), &env))
            .collect()
    }

    /// Whether `path` is inside one of the container's volume mounts.
    fn mounted(container: &Value, path: &Path) -> bool {
        container["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .any(|m| path.starts_with(str_of(&m["mountPath"], "mountPath")))
    }

    #[test]
    fn daemonset_arguments_parse_as_the_agent_on_kubernetes() {
        let daemonset = deploy_file("base/daemonset.yaml");
        let pod_spec = &daemonset["spec"]["template"]["spec"];
        let container = container(pod_spec, "podlink");
        let argv = argv(container, &deploy_file("base/configmap.yaml"));
        assert_eq!(argv[0], "/usr/local/bin/podlink");

        let cli = Cli::try_parse_from(&argv)
            .unwrap_or_else(|e| panic!("the DaemonSet's arguments {argv:?} do not parse:\n{e}"));
        let Command::Agent(args) = cli.command else {
            panic!("the DaemonSet does not run `podlink agent`");
        };
        assert_eq!(args.node, "node-1", "--node from the downward API");
        // No --manifests and no --kubeconfig: the Kubernetes API, in-cluster;
        // no istiod xDS (deploy/istio adds it).
        assert!(args.manifests.is_none());
        assert!(args.kubeconfig.is_none());
        assert!(args.xds_address.is_none());
        assert!(args.install_cni, "--install-cni");
        // The Istio CA, with its root certificate and token from volumes.
        assert!(args.ca_dir.is_none());
        let ca_address = args.ca_address.as_deref().expect("--ca-address");
        assert!(ca_address.starts_with("https://"), "{ca_address}");
        let root_cert = args.ca_root_cert.as_deref().expect("--ca-root-cert");
        for path in [
            root_cert,
            &args.ca_token_file,
            &args.cni_socket,
            &args.cni_bin_dir,
            &args.cni_conf_dir,
            &args.pin_dir,
            &args.state_dir,
        ] {
            assert!(
                mounted(container, path),
                "{} is on no volume mount of the container",
                path.display()
            );
        }
        // The readiness probe asks the agent's readiness endpoint.
        let probe_port = container["readinessProbe"]["httpGet"]["port"]
            .as_u64()
            .expect("readinessProbe.httpGet.port");
        assert_eq!(u64::from(args.readiness_address.port()), probe_port);
        // The kubelet waits longer than the drain (and the listeners' close).
        let grace = pod_spec["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("terminationGracePeriodSeconds");
        assert!(
            args.drain_grace.as_secs() + 3 < grace,
            "--drain-grace {:?} leaves no room in terminationGracePeriodSeconds {grace}",
            args.drain_grace
        );

        // The test parses for real: one misspelt flag, or an unexpanded
        // variable, fails.
        let misspelt: Vec<String> = argv
            .iter()
            .map(|a| a.replace("--install-cni", "--instal-cni"))
            .collect();
        assert_ne!(misspelt, argv);
        assert!(Cli::try_parse_from(&misspelt).is_err());
        let unexpanded: Vec<String> = argv
            .iter()
            .map(|a| {
                if a.starts_with("--drain-grace=") {
                    "--drain-grace=$(DRAIN_GRACE)".to_string()
                } else {
                    a.clone()
                }
            })
            .collect();
        assert!(Cli::try_parse_from(&unexpanded).is_err());
    }

    /// Whether every volume mount of the container names a volume of the pod.
    fn mounts_name_volumes(pod_spec: &Value, container: &Value) -> Result<(), String> {
        let volumes: Vec<&str> = pod_spec["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .map(|v| str_of(&v["name"], "volume name"))
            .collect();
        for mount in container["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
        {
            let name = str_of(&mount["name"], "volumeMount name");
            if !volumes.contains(&name) {
                return Err(format!(
                    "the volume mount {name} names no volume of the pod"
                ));
            }
        }
        Ok(())
    }

    /// deploy/istio's DaemonSet, as its patches make it: the agent beside
    /// istiod, with workload xDS from the CA's istiod and its own pod's name,
    /// namespace and address from the downward API, on the nodes labelled
    /// podlink.io/node-proxy=podlink.
    #[test]
    fn istio_daemonset_arguments_parse_as_the_agent_beside_istiod() {
        let daemonset = patched("istio", "daemonset.yaml", "DaemonSet", "podlink");
        let configmap = patched("istio", "configmap.yaml", "ConfigMap", "podlink");
        let pod_spec = &daemonset["spec"]["template"]["spec"];
        let container = container(pod_spec, "podlink");
        let argv = argv(container, &configmap);
        let cli = Cli::try_parse_from(&argv)
            .unwrap_or_else(|e| panic!("deploy/istio's arguments {argv:?} do not parse:\n{e}"));
        let Command::Agent(args) = cli.command else {
            panic!("deploy/istio does not run `podlink agent`");
        };
        assert_eq!(args.node, "node-1");
        assert!(args.manifests.is_none() && args.kubeconfig.is_none());
        // xDS from the istiod that is the CA (clap requires --ca-address).
        let xds_address = args.xds_address.as_deref().expect("--xds-address");
        assert!(xds_address.starts_with("https://"), "{xds_address}");
        assert_eq!(Some(xds_address), args.ca_address.as_deref());
        // The pod identity, each from its downward API field.
        assert_eq!(
            args.pod_name.as_deref(),
            Some("podlink-x7k2p"),
            "metadata.name"
        );
        assert_eq!(
            args.pod_namespace.as_deref(),
            Some("podlink"),
            "metadata.namespace"
        );
        assert_eq!(
            args.pod_ip,
            Some("10.0.0.11".parse().unwrap()),
            "status.podIP"
        );
        assert_eq!(args.network, "", "the ConfigMap's network: the default one");
        // Every path the agent is given is mounted, from a volume of the pod.
        let root_cert = args.ca_root_cert.as_deref().expect("--ca-root-cert");
        for path in [
            root_cert,
            &args.ca_token_file,
            &args.cni_socket,
            &args.cni_bin_dir,
            &args.cni_conf_dir,
            &args.pin_dir,
            &args.state_dir,
        ] {
            assert!(
                mounted(container, path),
                "{} is on no volume mount of the container",
                path.display()
            );
        }
        mounts_name_volumes(pod_spec, container).unwrap();
        // Only the nodes moved to podlink.
        assert_eq!(
            pod_spec["nodeSelector"]["podlink.io/node-proxy"].as_str(),
            Some("podlink")
        );
        // The rest is the base's: the same arguments but the added ones.
        let base = deploy_file("base/daemonset.yaml");
        let base_argv = self::argv(
            self::container(&base["spec"]["template"]["spec"], "podlink"),
            &deploy_file("base/configmap.yaml"),
        );
        assert_eq!(argv[..base_argv.len()], base_argv[..]);

        // The test sees a broken patch: without the downward API's variable the
        // argument stays unexpanded, which the test refuses.
        let mut container = container.clone();
        let env = container["env"].as_sequence_mut().unwrap();
        env.retain(|v| v["name"].as_str() != Some("POD_NAME"));
        let broken = std::panic::catch_unwind(|| self::argv(&container, &configmap));
        assert!(broken.is_err(), "an argument naming an undefined variable");
    }

    #[test]
    fn uninstall_pod_arguments_parse_and_match_the_daemonset() {
        let pod = deploy_file("uninstall/uninstall-pod.yaml");
        let uninstall = container(&pod["spec"], "uninstall");
        let uninstall_argv = argv(uninstall, &deploy_file("base/configmap.yaml"));
        let cli = Cli::try_parse_from(&uninstall_argv).unwrap_or_else(|e| {
            panic!("the uninstall pod's arguments {uninstall_argv:?} do not parse:\n{e}")
        });
        let Command::Uninstall {
            pin_dir,
            state_dir,
            cni_conf_dir,
            cni_bin_dir,
            cni_socket,
        } = cli.command
        else {
            panic!("the uninstall pod does not run `podlink uninstall`");
        };
        for path in [&pin_dir, &state_dir, &cni_conf_dir, &cni_socket]
            .into_iter()
            .chain(cni_bin_dir.as_ref())
        {
            assert!(
                mounted(uninstall, path),
                "{} is not mounted",
                path.display()
            );
        }

        let daemonset = deploy_file("base/daemonset.yaml");
        let agent_argv = argv(
            container(&daemonset["spec"]["template"]["spec"], "podlink"),
            &deploy_file("base/configmap.yaml"),
        );
        let Command::Agent(agent) = Cli::try_parse_from(&agent_argv).expect("parses").command
        else {
            panic!("not the agent");
        };
        assert_eq!(pin_dir, agent.pin_dir);
        assert_eq!(state_dir, agent.state_dir);
        assert_eq!(cni_conf_dir, agent.cni_conf_dir);
        assert_eq!(cni_socket, agent.cni_socket);
        if let Some(dir) = cni_bin_dir {
            assert_eq!(dir, agent.cni_bin_dir);
        }
    }

    /// `--cluster-cidrs` takes both families, repeated or comma-separated, and
    /// refuses an entry that is not a CIDR, naming it.
    #[test]
    fn cluster_cidrs_parse_and_bad_ones_are_refused() {
        let parse = |cidrs: &[&str]| {
            let mut argv = vec!["podlink", "agent", "--node", "n1", "--ca-dir", "/ca"];
            for c in cidrs {
                argv.extend(["--cluster-cidrs", c]);
            }
            Cli::try_parse_from(argv).map(|cli| match cli.command {
                Command::Agent(args) => args.cluster_cidrs,
                _ => unreachable!("parsed as the agent"),
            })
        };
        let cidrs = parse(&["10.244.0.0/16,fd00:10:244::/56", "10.96.0.0/12"]).unwrap();
        let cidrs: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
        assert_eq!(cidrs, ["10.244.0.0/16", "fd00:10:244::/56", "10.96.0.0/12"]);
        assert!(parse(&[]).unwrap().is_empty());
        let err = parse(&["10.244.0.0/16,10.96.0.0"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("--cluster-cidrs") && err.contains("\"10.96.0.0\" is not a CIDR"),
            "{err}"
        );
        let err = parse(&["10.244.7.0/16"]).err().unwrap().to_string();
        assert!(err.contains("the range is 10.244.0.0/16"), "{err}");
    }
}
