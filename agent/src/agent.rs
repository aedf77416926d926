//! `podlink agent`: runs in a node's network namespace, keeps the dataplane in
//! step with the workloads, and serves the proxy.
//!
//! Start-up order matters for traffic: the proxy's listeners are bound before any
//! program is attached (a captured pod never meets a missing listener because of
//! us), and each workload is known to the proxy before its host veth is attached.

use std::{collections::HashMap, net::IpAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use podlink_common::{
    CONFIG_FAIL_OPEN, Config, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, PROXY_MARK,
    PROXY_MARK_MASK, REDIRECT_MARK, REDIRECT_MARK_MASK, ROUTE_TABLE, RULE_PRIORITY,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    dataplane::{CapturedPod, Dataplane, DataplaneConfig, net},
    identity::{CertManager, ca::CertificateAuthority},
    proxy::{self, Listeners, ProxyConfig, ProxyState},
    workload::{
        WorkloadIndex,
        manifests::{self, ManifestDir},
    },
};

/// Settings of `podlink agent`.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// This node's name (`spec.nodeName` of its pods).
    pub node: String,
    /// Directory of Pod and Namespace manifests, watched for changes.
    pub manifests: PathBuf,
    /// Directory holding `ca.crt` and `ca.key`.
    pub ca_dir: PathBuf,
    /// Where maps and links are pinned (a bpffs is mounted there if needed).
    pub pin_dir: PathBuf,
    /// SPIFFE trust domain of the mesh.
    pub trust_domain: String,
    /// Lifetime of workload certificates; they are reissued at half of it.
    pub cert_lifetime: Duration,
    /// Let enrolled pods' outbound connections pass uncaptured while no proxy listens.
    pub fail_open: bool,
    /// Destination IPv4 prefixes that bypass capture.
    pub excluded_cidrs: Vec<ipnet::Ipv4Net>,
    /// Destination ports that bypass capture.
    pub excluded_ports: Vec<u16>,
    /// Time allowed to connect upstream.
    pub connect_timeout: Duration,
}

/// How soon pods waiting for their host veth are looked at again.
const PENDING_RETRY: Duration = Duration::from_millis(200);

/// Runs the agent until SIGTERM or SIGINT. Pinned links and maps stay in place on
/// exit: enrolled pods stay captured (fail closed) until an agent is back.
///
/// # Errors
/// Start-up failures (CA, listeners, programs, manifests directory); once running,
/// problems with single pods or files are logged and the agent keeps going.
pub async fn run(cfg: AgentConfig) -> Result<()> {
    let ca = CertificateAuthority::load(&cfg.ca_dir).context("loading the CA")?;
    let certs = CertManager::new(ca, &cfg.trust_domain, cfg.cert_lifetime)?;
    let proxy_config = ProxyConfig {
        listen_ip: std::net::Ipv4Addr::LOCALHOST,
        outbound_port: OUTBOUND_PORT,
        inbound_plaintext_port: INBOUND_PLAINTEXT_PORT,
        hbone_port: HBONE_PORT,
        proxy_mark: PROXY_MARK,
        connect_timeout: cfg.connect_timeout,
    };
    let listeners = Listeners::bind(&proxy_config)?;
    net::install_policy_routing(
        REDIRECT_MARK,
        REDIRECT_MARK_MASK,
        ROUTE_TABLE,
        RULE_PRIORITY,
    )
    .context("installing policy routing")?;
    net::apply_node_sysctls()?;
    let dataplane = Dataplane::load(&DataplaneConfig {
        pin_dir: cfg.pin_dir.clone(),
        config: Config {
            proxy_mark: PROXY_MARK,
            proxy_mark_mask: PROXY_MARK_MASK,
            redirect_mark: REDIRECT_MARK,
            redirect_mark_mask: REDIRECT_MARK_MASK,
            outbound_port: OUTBOUND_PORT,
            inbound_plaintext_port: INBOUND_PLAINTEXT_PORT,
            hbone_port: HBONE_PORT,
            flags: if cfg.fail_open { CONFIG_FAIL_OPEN } else { 0 },
            ..Config::default()
        },
        excluded_cidrs: cfg.excluded_cidrs.clone(),
        excluded_ports: cfg.excluded_ports.clone(),
    })?;
    let state = Arc::new(ProxyState::new(proxy_config, certs));
    let proxy = tokio::spawn(proxy::serve(state.clone(), listeners));

    let mut source = ManifestDir::new(&cfg.manifests).with_context(|| {
        format!(
            "reading the manifests directory {}",
            cfg.manifests.display()
        )
    })?;
    let (_watcher, mut events) = manifests::watch(&cfg.manifests)
        .with_context(|| format!("watching {}", cfg.manifests.display()))?;
    let mut reconciler = Reconciler {
        node: cfg.node.clone(),
        trust_domain: cfg.trust_domain.clone(),
        dataplane,
        workload_ids: HashMap::new(),
        next_id: 1,
        pending: false,
    };
    reconciler.apply(&mut source, &state, true);
    tracing::info!(node = %cfg.node, pin_dir = %cfg.pin_dir.display(), "agent running");

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    loop {
        let wait = if reconciler.pending {
            PENDING_RETRY
        } else {
            manifests::RESYNC
        };
        tokio::select! {
            Some(()) = events.recv() => {
                tokio::time::sleep(manifests::DEBOUNCE).await;
                while events.try_recv().is_ok() {}
            }
            () = tokio::time::sleep(wait) => {}
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        reconciler.apply(&mut source, &state, false);
    }
    tracing::info!(
        "stopping; links and maps stay pinned, enrolled pods fail closed until an agent is back"
    );
    proxy.abort();
    Ok(())
}

struct Reconciler {
    node: String,
    trust_domain: String,
    dataplane: Dataplane,
    /// Stable numbers of workloads (`namespace/name`) for the pods map.
    workload_ids: HashMap<String, u32>,
    next_id: u32,
    /// Some enrolled pod is not attached yet (no host veth, or an error).
    pending: bool,
}

impl Reconciler {
    fn apply(&mut self, source: &mut ManifestDir, state: &ProxyState, force: bool) {
        let rescan = source.rescan();
        for error in &rescan.errors {
            tracing::warn!("manifest refused: {error}");
        }
        if !(rescan.changed || self.pending || force) {
            return;
        }
        let (index, warnings) = WorkloadIndex::build(
            &self.node,
            &self.trust_domain,
            source.pods(),
            source.namespaces(),
        );
        for warning in warnings {
            tracing::warn!("{warning}");
        }
        let index = Arc::new(index);
        state.set_workloads(index.clone());
        tokio::task::block_in_place(|| self.sync_dataplane(&index));
    }

    fn sync_dataplane(&mut self, index: &WorkloadIndex) {
        let captured: Vec<_> = index.captured().collect();
        let addrs: Vec<IpAddr> = captured
            .iter()
            .filter_map(|w| w.ipv4().map(IpAddr::V4))
            .collect();
        let interfaces = match net::host_interfaces(&addrs) {
            Ok(interfaces) => interfaces,
            Err(e) => {
                tracing::warn!("looking up host veths: {e:#}");
                self.pending = true;
                return;
            }
        };
        let mut pending = false;
        let mut wanted = Vec::new();
        let mut with_v4 = captured.iter().filter(|w| w.ipv4().is_some());
        for ifname in interfaces {
            let workload = with_v4.next().expect("one interface per address");
            let ipv4 = workload.ipv4().expect("filtered on IPv4");
            let Some(ifindex) = ifname.as_deref().and_then(net::ifindex) else {
                tracing::debug!(workload = %workload.key(), ip = %ipv4, "no host veth routes to this pod yet");
                pending = true;
                continue;
            };
            let key = workload.key();
            let workload_id = *self.workload_ids.entry(key.clone()).or_insert_with(|| {
                self.next_id += 1;
                self.next_id - 1
            });
            wanted.push(CapturedPod {
                workload: key,
                workload_id,
                ipv4,
                ifname: ifname.expect("ifindex came from it"),
                ifindex,
            });
        }
        for w in captured.iter().filter(|w| w.ipv4().is_none()) {
            tracing::warn!(workload = %w.key(), "enrolled pod has no IPv4 address; IPv6 capture is not supported yet");
        }
        match net::node_ipv4_addrs() {
            Ok(addrs) => {
                if let Err(e) = self.dataplane.set_node_addrs(&addrs) {
                    tracing::warn!("writing node addresses: {e:#}");
                }
            }
            Err(e) => tracing::warn!("reading node addresses: {e:#}"),
        }
        for (pod, error) in self.dataplane.reconcile(&wanted) {
            tracing::warn!(workload = %pod.workload, ifname = %pod.ifname, "capture failed: {error:#}");
            pending = true;
        }
        let live: std::collections::HashSet<String> = index.workloads().map(|w| w.key()).collect();
        self.workload_ids.retain(|k, _| live.contains(k));
        self.pending = pending;
    }
}
