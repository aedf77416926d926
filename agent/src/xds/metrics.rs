//! The workload xDS client's metrics, registered with the agent's others
//! ([`crate::telemetry::metrics::Metrics`]):
//!
//! | metric | type | labels | value |
//! |---|---|---|---|
//! | `podlink_xds_connected` | gauge | | 1 while a stream to istiod is up, else 0 |
//! | `podlink_xds_pushes_total` | counter | `type` (`address`, `authorization`) | responses received |
//! | `podlink_xds_nacks_total` | counter | `type` | responses NACKed (some resource refused) |
//! | `podlink_xds_resources` | gauge | `type` | resources held (applied and not removed) |
//! | `podlink_xds_reconnects_total` | counter | | streams opened after the first |

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::ResourceType;

/// The `type` label.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TypeLabels {
    r#type: TypeLabel,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum TypeLabel {
    address,
    authorization,
}

impl From<ResourceType> for TypeLabels {
    fn from(t: ResourceType) -> Self {
        Self {
            r#type: match t {
                ResourceType::Address => TypeLabel::address,
                ResourceType::Authorization => TypeLabel::authorization,
            },
        }
    }
}

/// The client's metrics; clones share their series.
#[derive(Clone, Debug, Default)]
pub struct XdsMetrics {
    connected: Gauge,
    pushes: Family<TypeLabels, Counter>,
    nacks: Family<TypeLabels, Counter>,
    resources: Family<TypeLabels, Gauge>,
    reconnects: Counter,
}

impl XdsMetrics {
    /// Registers the metrics in `registry`, every `type` present from the start.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "podlink_xds_connected",
            "Whether a workload xDS stream to istiod is up (1) or not (0)",
            self.connected.clone(),
        );
        registry.register(
            "podlink_xds_pushes",
            "Workload xDS responses received from istiod, by type",
            self.pushes.clone(),
        );
        registry.register(
            "podlink_xds_nacks",
            "Workload xDS responses NACKed (a resource refused), by type",
            self.nacks.clone(),
        );
        registry.register(
            "podlink_xds_resources",
            "Workload xDS resources held, by type",
            self.resources.clone(),
        );
        registry.register(
            "podlink_xds_reconnects",
            "Workload xDS streams to istiod opened after the first",
            self.reconnects.clone(),
        );
        for t in ResourceType::ALL {
            drop(self.pushes.get_or_create(&t.into()));
            drop(self.nacks.get_or_create(&t.into()));
            drop(self.resources.get_or_create(&t.into()));
        }
    }

    pub(super) fn set_connected(&self, up: bool) {
        self.connected.set(i64::from(up));
    }

    pub(super) fn pushed(&self, t: ResourceType, nacked: bool, held: usize) {
        self.pushes.get_or_create(&t.into()).inc();
        if nacked {
            self.nacks.get_or_create(&t.into()).inc();
        }
        self.resources
            .get_or_create(&t.into())
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    pub(super) fn reconnected(&self) {
        self.reconnects.inc();
    }

    /// Whether a stream is up (the `podlink_xds_connected` gauge).
    pub fn connected(&self) -> bool {
        self.connected.get() == 1
    }

    /// Responses received of type `t`.
    pub fn pushes(&self, t: ResourceType) -> u64 {
        self.pushes.get_or_create(&t.into()).get()
    }

    /// Responses of type `t` NACKed.
    pub fn nacks(&self, t: ResourceType) -> u64 {
        self.nacks.get_or_create(&t.into()).get()
    }

    /// Resources of type `t` held.
    pub fn resources(&self, t: ResourceType) -> i64 {
        self.resources.get_or_create(&t.into()).get()
    }

    /// Streams opened after the first.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.get()
    }
}
