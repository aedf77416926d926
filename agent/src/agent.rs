//! `podlink agent`: runs in a node's network namespace, keeps the dataplane in
//! step with the workloads, and serves the proxy.
//!
//! Start-up order matters for traffic:
//! 1. the proxy's listeners are bound (connections assigned to them wait in the
//!    backlog);
//! 2. the programs are loaded and the pinned links of a previous agent adopted, so
//!    capture never stops across a restart;
//! 3. the source's first view is applied to the state and published to the
//!    proxy;
//! 4. only then does the proxy accept, so no connection meets an empty workload
//!    view; the dataplane is then reconciled (new pods attached), and the
//!    reconcile loop ([`crate::reconcile::run`]) runs until a signal.
//!
//! The agent is ready (`/healthz/ready`) once the proxy accepts; with the
//! Kubernetes API as its source, only once the source's view is whole and the
//! authorization policies are known too.
//!
//! At run time a workload is known to the proxy before its host veth is attached,
//! and a pod is detached only once the workload source is complete (no manifest
//! waiting to settle, none broken without a good version; the Kubernetes API's
//! first lists done).

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use podlink_common::{
    CONFIG_FAIL_OPEN, Config, DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT,
    PROXY_MARK, REDIRECT_MARK, REDIRECT_MARK_MASK, ROUTE_TABLE, RULE_PRIORITY,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    admin,
    cni::{self, enroller::Enroller},
    dataplane::{AttachMode, Dataplane, DataplaneConfig, net, netlink::Netlink},
    dns::{self, DnsConfig, DnsServer, DnsSockets},
    identity::{
        CertManager, CertSource,
        istio_ca::{IstioCaClient, IstioCaConfig},
    },
    proxy::{self, Listeners, ProxyConfig, ProxyState},
    reconcile::{self, Reconciler},
    source,
    state::State,
    telemetry::{
        logging::LogControl,
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
    /// Capture enrolled pods' DNS into the agent's DNS server ([`crate::dns`]).
    pub dns_capture: bool,
    /// The cluster's DNS domain (`cluster.local`).
    pub cluster_domain: String,
    /// Time a resolver has to answer a forwarded query.
    pub dns_upstream_timeout: Duration,
    /// Attach TCX links with expedited RCU grace periods
    /// ([`crate::dataplane::rcu`]).
    pub expedite_attach: bool,
    /// How the programs are attached to host veths: TCX links or `cls_bpf`
    /// filters ([`crate::dataplane::AttachMode`]).
    pub attach_mode: AttachMode,
    /// Destination IPv4 prefixes that bypass capture.
    pub excluded_cidrs: Vec<ipnet::IpNet>,
    /// The cluster's pod and service ranges (IPv4 and IPv6): an outbound
    /// connection to an address in them that the agent does not know yet waits
    /// briefly for it ([`crate::state::ClusterRanges`]).
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// Destination ports that bypass capture (both directions).
    pub excluded_ports: Vec<u16>,
    /// Time allowed to connect upstream.
    pub connect_timeout: Duration,
    /// Idle timeout of inbound HBONE connections and of unused CONNECT streams
    /// ([`ProxyConfig::hbone_idle_timeout`]).
    pub hbone_idle_timeout: Duration,
    /// Proxy threads ([`ProxyConfig::threads`]).
    pub proxy_threads: usize,
    /// Connections handled at once; `None`: a third of the open-file limit.
    pub max_connections: Option<usize>,
    /// Address of the metrics endpoint (`GET /metrics`).
    pub metrics_address: std::net::SocketAddr,
    /// Address of the readiness endpoint (`GET /healthz/ready`).
    pub readiness_address: std::net::SocketAddr,
    /// How long open connections may go on after SIGTERM before the agent exits.
    pub drain_grace: Duration,
    /// How long a pod's connections through the proxy may go on after it left
    /// the mesh (zero: closed at once).
    pub leave_drain: Duration,
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
    let cert_source = match (&cfg.istio_ca, &cfg.ca_dir) {
        (Some(istio), _) => CertSource::Istio(IstioCaClient::new(istio.clone())?),
        (None, Some(dir)) => CertSource::Local { dir: dir.clone() },
        (None, None) => anyhow::bail!("no CA: give a CA directory or an Istio CA address"),
    };
    let described = cert_source.describe();
    let certs = CertManager::new(cert_source, &cfg.trust_domain, cfg.cert_lifetime)
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
    // The one answer to whether this node has IPv6, for the listeners, the policy
    // routing and the sysctls; said once when it has not (ztunnel crashed binding
    // `[::]` on such nodes, istio/ztunnel#1131).
    let ipv6 = net::ipv6_enabled();
    if !ipv6 {
        tracing::info!(
            "IPv6 is off on this node ({} is absent or not 0): capturing, proxying and routing IPv4 only",
            net::IPV6_DISABLED_SYSCTL
        );
    }
    let proxy_config = ProxyConfig {
        max_connections,
        listen_ip: std::net::Ipv4Addr::LOCALHOST,
        // The IPv6 twins, on a node with IPv6.
        listen_ip6: ipv6.then_some(std::net::Ipv6Addr::LOCALHOST),
        outbound_port: OUTBOUND_PORT,
        inbound_plaintext_port: INBOUND_PLAINTEXT_PORT,
        hbone_port: HBONE_PORT,
        proxy_mark: PROXY_MARK,
        connect_timeout: cfg.connect_timeout,
        hbone_idle_timeout: cfg.hbone_idle_timeout,
        cluster_id: cfg.cluster_id.clone(),
        threads: cfg.proxy_threads,
    };
    if !cfg.cluster_cidrs.is_empty() {
        let ranges: Vec<String> = cfg.cluster_cidrs.iter().map(ToString::to_string).collect();
        tracing::info!(ranges = %ranges.join(","), "cluster ranges");
    }
    let listeners = Listeners::bind(&proxy_config)?;
    let dns_config = DnsConfig::new(ipv6, PROXY_MARK, cfg.dns_upstream_timeout);
    let dns_sockets = if cfg.dns_capture {
        Some(DnsSockets::bind(&dns_config)?)
    } else {
        tracing::info!("DNS capture is off (--dns-capture=false)");
        None
    };
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
        config: Config {
            // No DNS port: the programs capture no pod's DNS.
            dns_port: if cfg.dns_capture { DNS_PORT } else { 0 },
            ..Config::with_defaults(if cfg.fail_open { CONFIG_FAIL_OPEN } else { 0 })
        },
        node_addrs: network.addrs.clone(),
        excluded_cidrs: cfg.excluded_cidrs.clone(),
        excluded_ports: cfg.excluded_ports.clone(),
        expedite_attach: cfg.expedite_attach,
        attach_mode: cfg.attach_mode,
    })?;
    net::install_policy_routing(
        &netlink,
        REDIRECT_MARK,
        REDIRECT_MARK_MASK,
        ROUTE_TABLE,
        RULE_PRIORITY,
        ipv6,
    )
    .await
    .context("installing policy routing")?;
    net::apply_node_sysctls(dataplane.journal(), ipv6)?;
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
        cni::socket::listen(&cfg.cni.socket).context("serving the podlink-cni plugin's socket")?;
    let mut source = source::open(&cfg.source, &cfg.node, &state.metrics.xds).await?;
    let first = source
        .deltas
        .recv()
        .await
        .context("the workload source stopped before its first view")?;
    let reconciler = Reconciler::new(
        State::new(&cfg.node, &cfg.trust_domain, &cfg.root_namespace)
            .with_cluster_cidrs(&cfg.cluster_cidrs)
            .with_cluster_domain(&cfg.cluster_domain),
        dataplane,
        Enroller::new(&cfg.node, &cfg.cni.socket),
        source.reporter.take(),
        source.lists_every_namespace,
    )
    .with_leave_drain(reconcile::LeaveDrain {
        bound: cfg.leave_drain,
        settle: reconcile::LEAVE_SETTLE,
        carries: {
            let carried = state.carried.clone();
            Box::new(move |ip| carried.carries(ip))
        },
    });
    let mut reconcile = reconcile::run::Loop::new(reconciler, netlink, network, state.clone());
    reconcile.start(first);
    let proxy = tokio::spawn(proxy::serve(state.clone(), listeners));
    let dns = dns_sockets.map(|sockets| {
        let server = Arc::new(DnsServer::new(&dns_config, state.clone()));
        tokio::spawn(dns::serve(server, sockets))
    });
    let admin = tokio::spawn(admin::serve(
        admin_listener,
        state.clone(),
        cfg.log_control.clone(),
    ));
    reconcile.attach_planned();
    let cni_install = match &cfg.cni.install {
        Some(install) => Some(
            cni::install::start(install.clone(), cfg.cni.socket.clone())
                .context("installing the podlink-cni plugin")?,
        ),
        None => None,
    };
    release_startup_memory();
    if source.readiness_waits_for_whole_view {
        reconcile.ready_once_whole(readiness.clone());
    } else {
        readiness.set(true);
    }
    tracing::info!(
        node = %cfg.node,
        pin_dir = %cfg.pin_dir.display(),
        metrics = %cfg.metrics_address,
        readiness = %cfg.readiness_address,
        "agent running"
    );

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let stopped = reconcile
        .run(&mut source.deltas, &mut cni_requests, async {
            tokio::select! {
                _ = sigterm.recv() => {}
                _ = sigint.recv() => {}
            }
        })
        .await;
    if let Err(e) = &stopped {
        tracing::error!("{e}; draining and exiting");
    }
    let reconciler = &mut reconcile.reconciler;
    // The plugin now finds no agent and decides by the enrollment snapshot.
    reconciler.cni.stop();
    drop(source);
    drop(cni_socket);
    drop(cni_requests);
    if let Some(task) = cni_install {
        task.abort();
    }
    readiness.set(false);
    // First stop the programs from handing the listeners new connections, so
    // that the listeners can finish the handshakes under way before they close.
    if let Err(e) = reconciler.capture.set_draining() {
        tracing::warn!(
            "could not mark the proxy draining in the config map ({e:#}); connections queued on the listeners may be reset"
        );
    }
    drain(&state, cfg.drain_grace, (&mut sigterm, &mut sigint)).await;
    tracing::info!(
        "stopping; links and maps stay pinned, enrolled pods fail closed until an agent is back"
    );
    proxy.abort();
    if let Some(dns) = dns {
        dns.abort();
    }
    admin.abort();
    metrics_server.abort();
    readiness_server.abort();
    cert_maintenance.abort();
    pool_release.abort();
    Ok(stopped?)
}

/// Gives the memory freed after start-up back to the system. Loading the programs
/// parses the kernel's BTF (megabytes, freed once loaded); glibc's allocator keeps
/// such freed heap unless asked (malloc_trim(3)).
fn release_startup_memory() {
    crate::sys::release_freed_heap();
}

/// Sets up glibc's allocator for the agent (mallopt(3)); call before any thread
/// starts.
///
/// Arenas: glibc gives each thread that allocates under contention an arena
/// of its own (up to eight per core), and freed memory stays in the arena it came
/// from; buffers of connections handled on different proxy threads then hold
/// several arenas' worth of resident memory. One arena per proxy thread (at
/// least two) keeps contention low (`M_ARENA_MAX`).
///
/// Thresholds: it fixes glibc's mmap threshold at [`MALLOC_MMAP_THRESHOLD_BYTES`] and
/// its trim threshold at [`MALLOC_TRIM_THRESHOLD_BYTES`]
/// ([`crate::sys::set_malloc_thresholds`]): blocks at least 128 KiB large (a
/// config dump, a list's buffers) are mapped apart and unmapped when freed,
/// whatever the agent freed before, while the heap's free top is given back
/// only past some megabytes, so that the proxy's 64 KiB buffers, freed and
/// taken again on every connection, do not fault their pages in each time.
pub fn configure_allocator(threads: usize) {
    crate::sys::set_malloc_arena_max(
        libc::c_int::try_from(threads.max(2)).unwrap_or(libc::c_int::MAX),
    );
    crate::sys::set_malloc_thresholds(MALLOC_MMAP_THRESHOLD_BYTES, MALLOC_TRIM_THRESHOLD_BYTES);
}

/// glibc's mmap threshold as the agent fixes it (bytes): its default starting
/// value, 128 KiB (mallopt(3)).
const MALLOC_MMAP_THRESHOLD_BYTES: libc::c_int = 128 * 1024;

/// glibc's trim threshold as the agent fixes it (bytes).
const MALLOC_TRIM_THRESHOLD_BYTES: libc::c_int = 4 * 1024 * 1024;

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
    state.limits.drain();
    let open = state.limits.open_connections();
    tracing::info!(
        open_connections = open,
        grace = %humantime::format_duration(grace),
        "draining: enrolled pods' new connections fail closed, the listeners close once the handshakes under way are accepted, open connections go on for the grace period"
    );
    let deadline = tokio::time::Instant::now() + grace;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        let open = state.limits.open_connections();
        if open == 0 && state.limits.listeners_open() == 0 {
            tracing::info!("drained: no connection open");
            return;
        }
        tokio::select! {
            _ = tick.tick() => {}
            () = tokio::time::sleep_until(deadline), if state.limits.listeners_open() == 0 => {
                tracing::info!(open_connections = open, "grace period over; closing the open connections");
                return;
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    tracing::info!(
        open_connections = state.limits.open_connections(),
        "signalled again; closing the open connections"
    );
}
