//! What telemetry reads of the proxy and its state: the metrics page the proxy's
//! view of the node, its certificates and its denials ([`ScrapeSource`]); the
//! metric labels and the access log a workload's pod name, namespace, workload
//! name, canonical service and revision, and labels ([`WorkloadMeta`]).

use std::{net::IpAddr, sync::Arc, time::SystemTime};

use super::ProxyState;
use crate::{
    state::Workload,
    telemetry::{
        metrics::{Metrics, WorkloadMeta},
        scrape::ScrapeSource,
    },
};

/// `workload` as telemetry reads it (for [`Endpoints`]).
///
/// [`Endpoints`]: crate::telemetry::connection::Endpoints
pub(super) fn meta(workload: Arc<Workload>) -> Arc<dyn WorkloadMeta> {
    workload
}

impl WorkloadMeta for Workload {
    fn name(&self) -> &str {
        &self.name
    }

    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn workload_name(&self) -> &str {
        &self.workload_name
    }

    fn canonical_service(&self) -> &str {
        &self.canonical_service
    }

    fn canonical_revision(&self) -> &str {
        &self.canonical_revision
    }

    fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key).map(String::as_str)
    }
}

impl ScrapeSource for ProxyState {
    fn live_metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn enrolled_pods(&self) -> usize {
        self.view().captured.len()
    }

    fn workload_at(&self, ip: IpAddr) -> Option<(String, String)> {
        self.view()
            .workloads
            .by_ip(ip)
            .map(|w| (w.name.clone(), w.namespace.clone()))
    }

    fn certificate_expiries(&self) -> Vec<(String, SystemTime)> {
        self.view()
            .local_identities()
            .into_iter()
            .filter_map(|id| {
                let cert = self.certs.cached(&id)?;
                Some((id.to_string(), cert.not_after))
            })
            .collect()
    }

    fn denials(&self) -> Vec<(String, u64)> {
        ProxyState::denials(self)
    }

    fn known_objects(&self) -> Vec<(&'static str, usize)> {
        let view = self.view();
        vec![
            ("workloads", view.workloads.len()),
            ("services", view.services.service_count()),
            ("policies", view.policies.policies().count()),
        ]
    }
}
