//! What the metrics page reads of the proxy ([`ScrapeSource`]): the proxy's view
//! of the node, its certificates and its denials.

use std::{net::IpAddr, time::SystemTime};

use super::ProxyState;
use crate::telemetry::{metrics::Metrics, scrape::ScrapeSource};

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
}
