//! `podlink agent`: runs in a node's network namespace, keeps the dataplane in
//! step with the workloads, and serves the proxy.
//!
//! Start-up order matters for traffic:
//! 1. the proxy's listeners are bound (connections assigned to them wait in the
//!    backlog);
//! 2. the programs are loaded and the pinned links of a previous agent adopted, so
//!    capture never stops across a restart;
//! 3. the workloads are read and published to the proxy;
//! 4. only then does the proxy accept, so no connection meets an empty workload
//!    view; the dataplane is then reconciled (new pods attached).
//!
//! At run time a workload is known to the proxy before its host veth is attached,
//! and a pod is detached only once the workload source is complete (no manifest
//! waiting to settle, none broken without a good version; the Kubernetes API's
//! first lists done).

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use podlink_common::{
    CONFIG_FAIL_OPEN, Config, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, PROXY_MARK,
    REDIRECT_MARK, REDIRECT_MARK_MASK, ROUTE_TABLE, RULE_PRIORITY,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    admin,
    authz::PolicySet,
    cni::{
        self,
        server::{Attached, Enroller, SourceView},
    },
    dataplane::{
        CapturedPod, Dataplane, DataplaneConfig, Removal, net,
        netlink::{Netlink, NodeNetwork},
    },
    identity::{
        CertManager, CertSource, SpiffeId,
        istio_ca::{IstioCaClient, IstioCaConfig},
    },
    proxy::{self, Listeners, ProxyConfig, ProxyState, View},
    source::{Source, manifests},
    state::{MAX_POD_UPDATES, WorkloadIndex, service::ServiceIndex},
    telemetry::{
        logging::{HeldMessages, LogControl, Severity},
        scrape::DataplaneMaps,
        server::{self, Readiness},
    },
};

pub use crate::source::WorkloadSourceConfig;

/// Settings of `podlink agent`.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// This node's name (`spec.nodeName` of its pods).
    pub node: String,
    /// Where the workloads come from.
    pub source: WorkloadSourceConfig,
    /// The podlink-cni plugin's socket, and whether to install the plugin.
    pub cni: CniConfig,
    /// Directory holding `ca.crt` and `ca.key` (the local CA; watched, reloaded on
    /// change). Not used with `istio_ca`.
    pub ca_dir: Option<PathBuf>,
    /// Get workload certificates from an Istio CA instead of the local one.
    pub istio_ca: Option<IstioCaConfig>,
    /// Where maps and links are pinned (a bpffs is mounted there if needed).
    pub pin_dir: PathBuf,
    /// Where the sysctls' original values are recorded before they are changed
    /// (`sysctls.json`, see [`crate::dataplane::journal`]); one per node.
    pub state_dir: PathBuf,
    /// SPIFFE trust domain of the mesh.
    pub trust_domain: String,
    /// Namespace whose authorization policies apply mesh-wide (`istio-system`).
    pub root_namespace: String,
    /// Address of the admin endpoint (`/config_dump`), loopback.
    pub admin_address: std::net::SocketAddr,
    /// Lifetime of workload certificates; they are reissued at half of it.
    pub cert_lifetime: Duration,
    /// Let enrolled pods' outbound connections pass uncaptured while no proxy listens.
    pub fail_open: bool,
    /// Attach TCX links with expedited RCU grace periods
    /// ([`crate::dataplane::rcu`]).
    pub expedite_attach: bool,
    /// Destination IPv4 prefixes that bypass capture.
    pub excluded_cidrs: Vec<ipnet::Ipv4Net>,
    /// Destination ports that bypass capture (both directions).
    pub excluded_ports: Vec<u16>,
    /// Time allowed to connect upstream.
    pub connect_timeout: Duration,
    /// Connections handled at once; `None`: a third of the open-file limit.
    pub max_connections: Option<usize>,
    /// Address of the metrics endpoint (`GET /metrics`).
    pub metrics_address: std::net::SocketAddr,
    /// Address of the readiness endpoint (`GET /healthz/ready`).
    pub readiness_address: std::net::SocketAddr,
    /// How long open connections may go on after SIGTERM before the agent exits.
    pub drain_grace: Duration,
    /// The cluster ID (the `*_cluster` metric labels).
    pub cluster_id: String,
    /// The log filter, changed at run time by the admin endpoint's `/logging`
    /// (`None`: not changeable).
    pub log_control: Option<LogControl>,
}

/// The agent's side of the podlink-cni plugin.
#[derive(Clone, Debug)]
pub struct CniConfig {
    /// The Unix socket the plugin asks (`/var/run/podlink/cni.sock`).
    pub socket: PathBuf,
    /// Install the plugin into the node's CNI configuration; `None`: leave it.
    pub install: Option<crate::cni::Install>,
}

/// Raises the soft open-file limit to the hard one; returns the limit in force.
fn raise_nofile_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => {
            if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                hard
            } else {
                soft
            }
        }
        Err(_) => 1024,
    }
}

/// Retry delays for pods that wait for their host veth (or failed to attach):
/// quick at first, then slower, so a pod that never gets one costs little.
const PENDING_RETRY_MIN: Duration = Duration::from_millis(200);
const PENDING_RETRY_MAX: Duration = Duration::from_secs(5);
/// How long an enrolled pod of this node may have no host route (its sandbox
/// starting) before the agent warns that none leads to it.
const NO_ROUTE_WARNING: Duration = Duration::from_secs(30);

/// Runs the agent until SIGTERM or SIGINT, then drains: the programs stop handing
/// new connections of enrolled pods to the proxy (they drop them: fail closed),
/// the listeners accept what is queued and close, the agent stops being ready, and open connections go on until they end or
/// `drain_grace` has passed (a second signal ends the wait), then it returns.
/// Pinned links and maps stay in place on exit: enrolled pods stay captured (fail
/// closed) until an agent is back.
///
/// # Errors
/// Start-up failures (CA, listeners, programs, manifests directory); once running,
/// problems with single pods or files are logged and the agent keeps going.
pub async fn run(cfg: AgentConfig) -> Result<()> {
    let source = match (&cfg.istio_ca, &cfg.ca_dir) {
        (Some(istio), _) => CertSource::Istio(IstioCaClient::new(istio.clone())?),
        (None, Some(dir)) => CertSource::Local { dir: dir.clone() },
        (None, None) => anyhow::bail!("no CA: give a CA directory or an Istio CA address"),
    };
    let described = source.describe();
    let certs = CertManager::new(source, &cfg.trust_domain, cfg.cert_lifetime)
        .with_context(|| format!("loading the trust of the {described}"))?;
    tracing::info!(
        ca = %described,
        trust_anchors = certs.roots().len(),
        cert_lifetime = %humantime::format_duration(cfg.cert_lifetime),
        "workload certificates"
    );
    // Renewal and CA reloads, in the background.
    let cert_maintenance = tokio::spawn({
        let certs = certs.clone();
        async move { certs.run().await }
    });
    let nofile = raise_nofile_limit();
    // Each proxied connection holds two descriptors; leave room for the agent's own.
    let max_connections = cfg
        .max_connections
        .unwrap_or_else(|| (nofile / 3).clamp(256, 1 << 20) as usize);
    tracing::info!(nofile, max_connections, "connection limit");
    let proxy_config = ProxyConfig {
        max_connections,
        listen_ip: std::net::Ipv4Addr::LOCALHOST,
        outbound_port: OUTBOUND_PORT,
        inbound_plaintext_port: INBOUND_PLAINTEXT_PORT,
        hbone_port: HBONE_PORT,
        proxy_mark: PROXY_MARK,
        connect_timeout: cfg.connect_timeout,
        cluster_id: cfg.cluster_id.clone(),
    };
    let listeners = Listeners::bind(&proxy_config)?;
    let admin_listener = admin::bind(cfg.admin_address)
        .await
        .with_context(|| format!("binding the admin endpoint {}", cfg.admin_address))?;
    let bind = |what: &'static str, addr: std::net::SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the {what} endpoint {addr}"))
    };
    let metrics_listener = bind("metrics", cfg.metrics_address).await?;
    // Not ready until the programs are attached and the proxy accepts.
    let readiness = Arc::new(Readiness::default());
    let readiness_server = tokio::spawn(server::serve(
        bind("readiness", cfg.readiness_address).await?,
        server::readiness(readiness.clone()),
    ));
    let netlink = Netlink::open()?;
    let network = netlink
        .read(true)
        .await
        .context("reading the node's network")?;
    // Takes the pin directory's lock first: the node's routing and sysctls are
    // changed only by the agent holding it, never while `podlink uninstall` (which
    // takes it too) puts them back.
    let dataplane = Dataplane::load(&DataplaneConfig {
        pin_dir: cfg.pin_dir.clone(),
        state_dir: cfg.state_dir.clone(),
        config: Config::with_defaults(if cfg.fail_open { CONFIG_FAIL_OPEN } else { 0 }),
        node_addrs: network.addrs.clone(),
        excluded_cidrs: cfg.excluded_cidrs.clone(),
        excluded_ports: cfg.excluded_ports.clone(),
        expedite_attach: cfg.expedite_attach,
    })?;
    net::install_policy_routing(
        REDIRECT_MARK,
        REDIRECT_MARK_MASK,
        ROUTE_TABLE,
        RULE_PRIORITY,
    )
    .context("installing policy routing")?;
    net::apply_node_sysctls(dataplane.journal())?;
    let state = Arc::new(ProxyState::new(proxy_config, certs));
    let maps = match DataplaneMaps::new(&dataplane) {
        Ok(maps) => Some(Arc::new(std::sync::Mutex::new(maps))),
        Err(e) => {
            tracing::warn!("the metrics will not report the dataplane's maps: {e:#}");
            None
        }
    };
    let metrics_server = tokio::spawn(server::serve(
        metrics_listener,
        server::metrics(state.clone(), maps),
    ));
    // After a CA change, new HBONE connections are made with the reissued
    // certificates and the new trust: pooled ones are released (their open
    // streams finish), so that none outlives the trust it was verified under.
    let pool_release = tokio::spawn({
        let state = state.clone();
        let mut changes = state.certs.ca_changes();
        async move {
            while changes.changed().await.is_ok() {
                state.pool.retain(|_| false);
                tracing::info!("CA changed: pooled HBONE connections released");
            }
        }
    });

    // Bound before the source is opened: the plugin's requests wait for the
    // run loop rather than finding no agent.
    let (cni_socket, mut cni_requests) =
        cni::server::listen(&cfg.cni.socket).context("serving the podlink-cni plugin's socket")?;
    let mut source = Source::open(&cfg.source, &cfg.node).await?;
    let mut reconciler = Reconciler {
        node: cfg.node.clone(),
        trust_domain: cfg.trust_domain.clone(),
        root_namespace: cfg.root_namespace.clone(),
        policies: Arc::new(PolicySet::default()),
        services: Arc::new(ServiceIndex::default()),
        index_messages: HeldMessages::default(),
        service_messages: HeldMessages::default(),
        policy_messages: HeldMessages::default(),
        policies_unknown: false,
        dataplane,
        workload_ids: HashMap::new(),
        next_id: 1,
        pending_retry: None,
        index: Arc::new(WorkloadIndex::default()),
        snapshot_due: false,
        wanted: Vec::new(),
        waiting: false,
        warned: HashSet::new(),
        pruned_at: None,
        no_route_since: HashMap::new(),
        netlink,
        network,
        cni: Enroller::new(&cfg.node, &cfg.cni.socket),
        attached: HashSet::new(),
        attach_errors: HashMap::new(),
    };
    reconciler.publish(&mut source);
    reconciler.plan(&state);
    let proxy = tokio::spawn(proxy::serve(state.clone(), listeners));
    let admin = tokio::spawn(admin::serve(
        admin_listener,
        state.clone(),
        cfg.log_control.clone(),
    ));
    tokio::task::block_in_place(|| reconciler.apply(&mut source));
    let cni_install = match &cfg.cni.install {
        Some(install) => Some(
            cni::install::start(install.clone(), cfg.cni.socket.clone())
                .context("installing the podlink-cni plugin")?,
        ),
        None => None,
    };
    release_startup_memory();
    readiness.set(true);
    tracing::info!(
        node = %cfg.node,
        pin_dir = %cfg.pin_dir.display(),
        metrics = %cfg.metrics_address,
        readiness = %cfg.readiness_address,
        "agent running"
    );

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut unsettled = false;
    loop {
        // Nothing waits: a wake by the timer is the periodic resync.
        let idle = !unsettled && reconciler.pending_retry.is_none();
        let wait = if unsettled {
            manifests::SETTLE
        } else {
            reconciler.pending_retry.unwrap_or(manifests::RESYNC)
        };
        // CNI requests time out.
        let wait = reconciler.cni.next_deadline().map_or(wait, |d| {
            wait.min(d.saturating_duration_since(std::time::Instant::now()))
        });
        let mut resync = false;
        tokio::select! {
            () = source.changed() => {}
            Some(incoming) = cni_requests.recv() => {
                reconciler.cni.receive(incoming);
                while let Ok(more) = cni_requests.try_recv() {
                    reconciler.cni.receive(more);
                }
            }
            () = tokio::time::sleep(wait) => resync = true,
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        // An idle agent's periodic resync looks at everything again (every
        // manifest, a full dump of the network), in case a change was missed;
        // reads on a change look only at what changed.
        let idle_resync = resync && idle && wait == manifests::RESYNC;
        if idle_resync {
            source.resync();
        }
        let started = std::time::Instant::now();
        let rescan = reconciler.publish(&mut source);
        let published = started.elapsed();
        unsettled = rescan.unsettled;
        // Reconcile on a change, on retries, and on resyncs (routes and the node's
        // addresses may have changed).
        if rescan.changed
            || !rescan.errors.is_empty()
            || reconciler.pending_retry.is_some()
            || resync
            || reconciler.cni.has_pending()
        {
            reconciler.read_network(idle_resync).await;
            let network_read = started.elapsed();
            tokio::task::block_in_place(|| {
                reconciler.plan(&state);
                let planned = started.elapsed();
                reconciler.apply(&mut source);
                // Each step's time (µs): the source and the index, the node's
                // network, the plan, the attachments.
                tracing::debug!(
                    read_us = published.as_micros() as u64,
                    network_us = (network_read - published).as_micros() as u64,
                    plan_us = (planned - network_read).as_micros() as u64,
                    apply_us = (started.elapsed() - planned).as_micros() as u64,
                    "reconciled"
                );
            });
            reconciler.answer_cni(&source);
        }
    }
    // The plugin now finds no agent and decides by the enrollment snapshot.
    reconciler.cni.stop();
    drop(cni_socket);
    drop(cni_requests);
    if let Some(task) = cni_install {
        task.abort();
    }
    readiness.set(false);
    // First stop the programs from handing the listeners new connections, so
    // that the listeners can finish the handshakes under way before they close.
    if let Err(e) = reconciler.dataplane.set_draining() {
        tracing::warn!(
            "could not mark the proxy draining in the config map ({e:#}); connections queued on the listeners may be reset"
        );
    }
    drain(&state, cfg.drain_grace, (&mut sigterm, &mut sigint)).await;
    tracing::info!(
        "stopping; links and maps stay pinned, enrolled pods fail closed until an agent is back"
    );
    proxy.abort();
    admin.abort();
    metrics_server.abort();
    readiness_server.abort();
    cert_maintenance.abort();
    pool_release.abort();
    Ok(())
}

/// Gives the memory freed after start-up back to the system. Loading the programs
/// parses the kernel's BTF (megabytes, freed once loaded); glibc's allocator keeps
/// such freed heap unless asked (malloc_trim(3)).
fn release_startup_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// glibc's allocator gives each thread that allocates under contention an arena
/// of its own (up to eight per core), and freed memory stays in the arena it came
/// from; buffers of connections handled on different runtime threads then hold
/// several arenas' worth of resident memory. One arena per runtime thread (at
/// least two) keeps contention low (mallopt(3), `M_ARENA_MAX`). Call before any
/// thread starts.
pub fn limit_allocator_arenas(threads: usize) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt has no preconditions.
    unsafe {
        libc::mallopt(
            libc::M_ARENA_MAX,
            libc::c_int::try_from(threads.max(2)).unwrap_or(libc::c_int::MAX),
        );
    }
}

/// Closes the listeners and waits until the open connections end, `grace` passes,
/// or another signal comes.
async fn drain(
    state: &ProxyState,
    grace: Duration,
    (sigterm, sigint): (
        &mut tokio::signal::unix::Signal,
        &mut tokio::signal::unix::Signal,
    ),
) {
    state.drain();
    let open = state.open_connections();
    tracing::info!(
        open_connections = open,
        grace = %humantime::format_duration(grace),
        "draining: enrolled pods' new connections fail closed, the listeners close once the handshakes under way are accepted, open connections go on for the grace period"
    );
    let deadline = tokio::time::Instant::now() + grace;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        let open = state.open_connections();
        if open == 0 && state.listeners_open() == 0 {
            tracing::info!("drained: no connection open");
            return;
        }
        tokio::select! {
            _ = tick.tick() => {}
            () = tokio::time::sleep_until(deadline), if state.listeners_open() == 0 => {
                tracing::info!(open_connections = open, "grace period over; closing the open connections");
                return;
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    tracing::info!(
        open_connections = state.open_connections(),
        "signalled again; closing the open connections"
    );
}

struct Reconciler {
    node: String,
    trust_domain: String,
    root_namespace: String,
    /// The authorization policies as last read.
    policies: Arc<PolicySet>,
    /// The Services as last read.
    services: Arc<ServiceIndex>,
    /// The workload index's warnings (address conflicts, pods defined twice),
    /// the Service index's and the policies' (with their notes), each logged
    /// once while it holds.
    index_messages: HeldMessages,
    service_messages: HeldMessages,
    policy_messages: HeldMessages,
    /// Whether the last policy set was built while a broken file may hold
    /// policies, so that their return is logged once.
    policies_unknown: bool,
    dataplane: Dataplane,
    /// Stable numbers of workloads (`namespace/name`) for the pods map.
    workload_ids: HashMap<String, u32>,
    next_id: u32,
    /// Some enrolled pod is not attached yet (no host veth, or an error): retry
    /// after this long.
    pending_retry: Option<Duration>,
    /// The workloads of the source as last read.
    index: Arc<WorkloadIndex>,
    /// The enrollment snapshot may be out of date (not written while the
    /// source was incomplete, or its write failed): write it at the next change.
    snapshot_due: bool,
    /// The pods to capture, as last planned.
    wanted: Vec<CapturedPod>,
    /// Some pod waits for its host route (or the lookup failed).
    waiting: bool,
    /// Workloads already warned about (warnings are given once).
    warned: HashSet<String>,
    /// The index's [`WorkloadIndex::removals`] when `workload_ids`, `warned`
    /// and `no_route_since` last dropped the workloads it no longer has.
    pruned_at: Option<u64>,
    /// When each enrolled local pod without a host route was first seen so
    /// ([`NO_ROUTE_WARNING`]).
    no_route_since: HashMap<String, std::time::Instant>,
    netlink: Netlink,
    /// The node's routes, veths and addresses as last read.
    network: NodeNetwork,
    /// The pods podlink-cni told about: their reported addresses, the requests
    /// waiting for an answer, the enrollment snapshot.
    cni: Enroller,
    /// The planned pods attached by the last apply (`namespace/name`).
    attached: HashSet<Arc<str>>,
    /// The planned pods whose attach failed in the last apply, with the error.
    attach_errors: HashMap<String, String>,
}

impl Reconciler {
    /// Rescans the workload source and, if it changed, updates the workload
    /// index: pod by pod when the source says which pods changed, no Namespace
    /// did and at most [`MAX_POD_UPDATES`] pods did; else (the first read, a
    /// Kubernetes watch that listed again) by a rebuild. A change that touches
    /// no pod keeps the index as it is.
    fn publish(&mut self, source: &mut Source) -> manifests::Rescan {
        let mut rescan = source.rescan();
        for error in &rescan.errors {
            tracing::warn!("manifest refused: {error}");
        }
        let first = self.index.node().is_empty();
        // Addresses podlink-cni reported stand in for those of pods whose
        // object has none yet.
        let reported = self.cni.take_changed();
        rescan.changed |= !reported.is_empty();
        if rescan.changed || first {
            let changes = rescan.changes.as_ref().filter(|c| {
                !first && !c.namespaces && c.pods.len() + reported.len() <= MAX_POD_UPDATES
            });
            let warnings = match changes {
                Some(changes) if changes.pods.is_empty() && reported.is_empty() => {
                    self.index.warnings()
                }
                Some(changes) => {
                    let mut index = WorkloadIndex::clone(&self.index);
                    for key in changes.pods.union(&reported) {
                        self.update_workload(&mut index, source, key);
                    }
                    let warnings = index.warnings();
                    self.index = Arc::new(index);
                    warnings
                }
                None => {
                    let pods = self.cni.pods(source.pods());
                    let (index, warnings) = self.index.rebuild(
                        &self.node,
                        &self.trust_domain,
                        pods.iter().map(|p| &**p),
                        source.namespaces(),
                    );
                    self.index = Arc::new(index);
                    warnings
                }
            };
            // The snapshot holds the namespaces' and pods' mode labels only.
            if changes.is_none_or(|c| c.mode_labels) || self.snapshot_due {
                let complete = source.removal() == Removal::All;
                self.snapshot_due =
                    !self
                        .cni
                        .update_snapshot(complete, source.pods(), source.namespaces());
            }
            // Which files define a pod twice is looked for only when one does.
            let duplicates = if self.index.has_duplicates() {
                source.duplicate_pods()
            } else {
                Vec::new()
            };
            self.index_messages.log(
                warnings
                    .into_iter()
                    .chain(duplicates)
                    .map(|w| (Severity::Warn, w))
                    .collect(),
            );
            if changes.is_none_or(|c| c.services) {
                let (services, warnings) =
                    ServiceIndex::build(source.services(), source.endpoint_slices());
                self.service_messages
                    .log(warnings.into_iter().map(|w| (Severity::Warn, w)).collect());
                self.services = Arc::new(services);
            }
        }
        // A file that breaks may make the policies unknown without changing any
        // object.
        if rescan.changed || !rescan.errors.is_empty() || first {
            self.policies = Arc::new(self.policy_set(source));
        }
        rescan
    }

    /// Updates pod `key`'s (`namespace/name`) workload in `index` from its
    /// definitions in the source, with the addresses podlink-cni reported.
    fn update_workload(&self, index: &mut WorkloadIndex, source: &Source, key: &str) {
        let Some((namespace, name)) = key.split_once('/') else {
            return;
        };
        let definitions: Vec<_> = source
            .pods()
            .filter(|p| {
                p.metadata.name.as_deref() == Some(name)
                    && p.metadata.namespace_or_default() == namespace
            })
            .map(|p| self.cni.overlaid(p))
            .collect();
        // The last of that name, as a rebuild's lookup keeps.
        let namespace_object = source
            .namespaces()
            .filter(|ns| ns.metadata.name.as_deref() == Some(namespace))
            .last();
        index.update(
            &self.trust_domain,
            key,
            definitions.iter().map(|p| &**p),
            namespace_object,
        );
    }

    /// The policies of the source; all requests are denied while a broken file
    /// may hold some. Warnings and notes on how a policy is enforced at layer 4
    /// are logged once while they hold.
    fn policy_set(&mut self, source: &Source) -> PolicySet {
        let (mut set, warnings) =
            PolicySet::build(&self.root_namespace, source.policies().cloned());
        let mut messages: Vec<(Severity, String)> = warnings
            .into_iter()
            .map(|w| (Severity::Warn, w.to_string()))
            .collect();
        for policy in set.policies() {
            for n in &policy.notes {
                messages.push((Severity::Warn, format!("AuthorizationPolicy {policy}: {n}")));
            }
        }
        let unknown = source.policies_unknown();
        if let Some(error) = unknown {
            messages.push((
                Severity::Error,
                format!(
                    "authorization policies cannot be known while {} is broken ({}): every inbound connection to this node's pods is denied until it is fixed",
                    error.file.display(),
                    error.message
                ),
            ));
            set.deny_all_unknown(format!("{} is broken", error.file.display()));
        } else if self.policies_unknown {
            tracing::info!(
                "authorization policies are known again: inbound connections are authorized by them"
            );
        }
        self.policy_messages.log(messages);
        self.policies_unknown = unknown.is_some();
        set
    }

    /// Decides which pods to capture (their host veths) and hands the proxy the
    /// workloads and those pods' addresses, before anything is attached: a pod's
    /// first connection finds the proxy knowing it.
    fn plan(&mut self, state: &ProxyState) {
        self.wanted = self.wanted();
        let captured: HashSet<IpAddr> = self.wanted.iter().map(|p| IpAddr::V4(p.ipv4)).collect();
        let view = state.view();
        if !Arc::ptr_eq(&view.workloads, &self.index)
            || !Arc::ptr_eq(&view.policies, &self.policies)
            || !Arc::ptr_eq(&view.services, &self.services)
            || *view.captured != captured
        {
            state.update(View {
                workloads: self.index.clone(),
                captured: Arc::new(captured),
                policies: self.policies.clone(),
                services: self.services.clone(),
            });
            // Certificates are only needed for this node's enrolled workloads
            // (often many pods to one identity: each is copied once).
            let local: HashSet<&SpiffeId> = self
                .index
                .workloads()
                .filter(|w| w.enrollment.is_enrolled() && self.index.is_local(w))
                .map(|w| &w.identity)
                .collect();
            state.certs.retain(|id| local.contains(id));
            state.certs.prefetch(local.into_iter().cloned());
        }
    }

    /// Attaches the planned pods and detaches the others as far as the source's
    /// completeness allows; tells the source which pods are captured; schedules
    /// a retry while some pod waits.
    fn apply(&mut self, source: &mut Source) {
        let removal = source.removal();
        let mut retry = std::mem::take(&mut self.waiting);
        if let Err(e) = self.dataplane.set_node_addrs(&self.network.addrs) {
            tracing::warn!("writing node addresses: {e:#}");
        }
        if removal != Removal::All {
            tracing::debug!(
                ?removal,
                "workload source incomplete for now: detaching less"
            );
        }
        let mut captured: HashSet<Arc<str>> =
            self.wanted.iter().map(|p| p.workload.clone()).collect();
        self.attach_errors.clear();
        for (pod, error) in self.dataplane.reconcile(&self.wanted, removal) {
            tracing::warn!(workload = %pod.workload, ifname = %pod.ifname, "capture failed: {error:#}");
            captured.remove(&pod.workload);
            self.attach_errors
                .insert(pod.workload.to_string(), format!("{error:#}"));
            // Its name may have changed: ask again.
            self.netlink.forget(pod.ifindex);
            retry = true;
        }
        source.captured(&captured);
        self.attached = captured;
        // What is kept per workload goes with it.
        let index = &self.index;
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

    /// Answers the podlink-cni requests the last apply settled.
    fn answer_cni(&mut self, source: &Source) {
        self.cni.answer(
            &self.index,
            Attached {
                wanted: &self.wanted,
                captured: &self.attached,
                errors: &self.attach_errors,
            },
            SourceView {
                complete: source.removal() == Removal::All,
                knows_namespace: &|ns| source.knows_namespace(ns),
            },
        );
    }

    /// Warns once per workload.
    fn warn_once(&mut self, key: &str, message: &str) {
        if self.warned.insert(key.to_string()) {
            tracing::warn!(workload = %key, "{message}");
        }
    }

    /// The pods to capture: this node's enrolled workloads with an IPv4 address and
    /// a host route to a veth of their own. Sets `waiting` when some have none yet.
    fn wanted(&mut self) -> Vec<CapturedPod> {
        let index = self.index.clone();
        let network = std::mem::take(&mut self.network);
        let mut wanted: Vec<CapturedPod> = Vec::with_capacity(self.wanted.len() + 1);
        let mut owners: HashMap<u32, &str> = HashMap::with_capacity(self.wanted.len() + 1);
        for workload in index.captured() {
            let key = workload.key();
            let Some(ipv4) = workload.ipv4() else {
                self.warn_once(key, "enrolled pod has no IPv4 address; IPv6 capture is not supported yet (its IPv6 TCP is dropped)");
                continue;
            };
            let Some(&ifindex) = network.host_routes.get(&ipv4) else {
                tracing::debug!(workload = %key, ip = %ipv4, "no host route to this pod yet");
                self.waiting = true;
                let since = *self
                    .no_route_since
                    .entry(key.to_string())
                    .or_insert_with(std::time::Instant::now);
                if since.elapsed() >= NO_ROUTE_WARNING {
                    self.warn_once(key, &format!("enrolled pod at {ipv4} has had no host route for {} s: no veth of this node leads to it (is it running here?); it is captured once one does", NO_ROUTE_WARNING.as_secs()));
                }
                continue;
            };
            if !self.no_route_since.is_empty() {
                self.no_route_since.remove(key);
            }
            if network.unresolved.contains(&ifindex) {
                self.waiting = true;
                continue;
            }
            let Some(ifname) = network.veths.get(&ifindex) else {
                self.warn_once(key, &format!("the node's host route to {ipv4} leads to interface {ifindex}, which is not a veth; not capturing it"));
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
                ifname: ifname.clone(),
                ifindex,
            });
        }
        self.network = network;
        wanted
    }

    /// Reads the node's routes, veths and addresses for the next plan (a
    /// `resync` may dump them all: [`Netlink::read`]); on a failure keeps the
    /// last ones and retries soon.
    async fn read_network(&mut self, resync: bool) {
        let error = match self.netlink.read(resync).await {
            Ok(network) => {
                self.network = network;
                return;
            }
            Err(e) => e,
        };
        tracing::warn!("reading the node's network: {error:#}; reopening the netlink socket");
        self.waiting = true;
        match Netlink::open() {
            Ok(netlink) => self.netlink = netlink,
            Err(e) => tracing::warn!("{e:#}"),
        }
    }
}
