//! The reconcile loop: wakes on a source's delta, a podlink-cni request, a
//! route netlink notification, a retry or the periodic resync, and reconciles
//! (auditing what is attached first).

use std::{future::Future, sync::Arc, time::Duration};

use tokio::sync::mpsc;

use super::Reconciler;
use crate::{
    cni::socket::Incoming,
    dataplane::{
        Dataplane,
        netlink::{Netlink, NodeNetwork},
    },
    proxy::ProxyState,
    state::{Completeness, Delta},
    telemetry::server::Readiness,
};

/// How often an idle agent reads the whole node's network again (a full dump
/// of routes, links and addresses), in case a change was missed.
pub const NETWORK_RESYNC: Duration = Duration::from_secs(2);

/// The workload source's task ended: nothing updates the agent's view any
/// more.
#[derive(Debug, thiserror::Error)]
#[error("the workload source stopped: the agent's view of the workloads would no longer change")]
pub struct SourceStopped;

/// The reconciler of the running agent, with what it reads.
pub struct Loop {
    /// The reconciler, over the loaded dataplane.
    pub reconciler: Reconciler<Dataplane>,
    netlink: Netlink,
    /// The node's routes, veths and addresses as last read.
    network: NodeNetwork,
    proxy: Arc<ProxyState>,
    /// The readiness to set once the view is whole ([`Loop::ready_once_whole`]).
    readiness: Option<Arc<Readiness>>,
}

impl Loop {
    /// A loop of `reconciler`, reading the node's network with `netlink`
    /// (`network` as last read) and publishing to `proxy`.
    pub fn new(
        reconciler: Reconciler<Dataplane>,
        netlink: Netlink,
        network: NodeNetwork,
        proxy: Arc<ProxyState>,
    ) -> Self {
        let mut reconciler = reconciler;
        reconciler.count_repairs_in(proxy.metrics.clone());
        Loop {
            reconciler,
            netlink,
            network,
            proxy,
            readiness: None,
        }
    }

    /// Whether the state's view is whole: the source complete, every kind
    /// it reads listed once (the Nodes too), the policies known.
    pub fn view_is_whole(&self) -> bool {
        let state = &self.reconciler.state;
        state.completeness() == Completeness::Complete
            && state.unlisted().is_empty()
            && state.policies_known()
    }

    /// Sets `readiness` now if the view is whole ([`Loop::view_is_whole`]),
    /// else once it is, after the reconcile that made it so.
    pub fn ready_once_whole(&mut self, readiness: Arc<Readiness>) {
        self.readiness = Some(readiness);
        self.update_readiness();
        if self.readiness.is_some() {
            tracing::info!(
                "not ready until the workload source has listed everything it reads once and the authorization policies are known"
            );
        }
    }

    /// Sets the readiness waited for once the view is whole.
    fn update_readiness(&mut self) {
        if self.readiness.is_some()
            && self.view_is_whole()
            && let Some(readiness) = self.readiness.take()
        {
            readiness.set(true);
            tracing::info!("ready: the workload source's view is whole");
        }
    }

    /// Applies `delta` (the source's first) and hands the proxy the view made
    /// from it, before the proxy serves.
    pub fn start(&mut self, delta: Delta) {
        self.reconciler.apply_delta(delta);
        self.reconciler.refresh();
        self.reconciler.plan(&self.network);
        self.reconciler.publish(&self.proxy);
    }

    /// Attaches what [`Loop::start`] planned.
    pub fn attach_planned(&mut self) {
        tokio::task::block_in_place(|| self.reconciler.apply(&self.network));
        self.forget_failed();
    }

    /// Runs until `shutdown` completes: applies the source's `deltas`, takes in
    /// podlink-cni's `requests`, and reconciles when something changed, a pod
    /// waits, or the periodic resync is due.
    ///
    /// # Errors
    /// [`SourceStopped`] when the source's task ends (it only ends by a panic):
    /// the agent must not go on with a view nothing updates.
    pub async fn run(
        &mut self,
        deltas: &mut mpsc::Receiver<Delta>,
        requests: &mut mpsc::Receiver<Incoming>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), SourceStopped> {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let retry = self.reconciler.pending_retry();
            let wait = retry.unwrap_or(NETWORK_RESYNC);
            // CNI requests time out.
            let wait = self.reconciler.cni.next_deadline().map_or(wait, |d| {
                wait.min(d.saturating_duration_since(std::time::Instant::now()))
            });
            let mut resync = false;
            let mut network_changed = false;
            tokio::select! {
                delta = deltas.recv() => {
                    let Some(delta) = delta else {
                        return Err(SourceStopped);
                    };
                    self.reconciler.apply_delta(delta);
                    while let Ok(more) = deltas.try_recv() {
                        self.reconciler.apply_delta(more);
                    }
                }
                Some(incoming) = requests.recv() => {
                    self.reconciler.cni.receive(incoming);
                    while let Ok(more) = requests.try_recv() {
                        self.reconciler.cni.receive(more);
                    }
                }
                () = tokio::time::sleep(wait) => resync = true,
                // A route, address or link changed: a captured pod's veth may
                // have gone or come back, its route moved (the audit sees it).
                () = self.netlink.notified() => network_changed = true,
                () = &mut shutdown => return Ok(()),
            }
            // An idle agent's periodic resync reads the whole network again;
            // reads on a change look only at what changed.
            let idle_resync = resync && retry.is_none() && wait == NETWORK_RESYNC;
            let started = std::time::Instant::now();
            let refreshed = tokio::task::block_in_place(|| self.reconciler.refresh());
            let refreshed_at = started.elapsed();
            // Reconcile on a change, on retries, and on resyncs (routes and the
            // node's addresses may have changed).
            if refreshed.changed
                || self.reconciler.pending_retry().is_some()
                || resync
                || network_changed
                || self.reconciler.cni.has_pending()
            {
                self.read_network(idle_resync).await;
                let network_read = started.elapsed();
                tokio::task::block_in_place(|| {
                    self.reconciler.plan(&self.network);
                    self.reconciler.publish(&self.proxy);
                    let planned = started.elapsed();
                    self.reconciler.apply(&self.network);
                    // Each step's time (µs): the state's indexes, the node's
                    // network, the plan, the attachments.
                    tracing::debug!(
                        read_us = refreshed_at.as_micros() as u64,
                        network_us = (network_read - refreshed_at).as_micros() as u64,
                        plan_us = (planned - network_read).as_micros() as u64,
                        apply_us = (started.elapsed() - planned).as_micros() as u64,
                        "reconciled"
                    );
                });
                self.forget_failed();
                self.reconciler.answer_cni();
            }
            self.update_readiness();
        }
    }

    /// Interfaces whose attach failed may have changed names: asked again.
    fn forget_failed(&mut self) {
        for ifindex in self.reconciler.take_failed_interfaces() {
            self.netlink.forget(ifindex);
        }
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
        self.reconciler.network_unread();
        match Netlink::open() {
            Ok(netlink) => self.netlink = netlink,
            Err(e) => tracing::warn!("{e:#}"),
        }
    }
}
