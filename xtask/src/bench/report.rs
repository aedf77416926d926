//! Everything one full run measured, as printed and as written to `--json`.

use serde::Serialize;

use super::{
    Settings,
    api_watch::ApiWatch,
    connections::{Churn, OneClientPhases},
    ebpf::{EbpfByWorkload, ProgCounters},
    efficiency::EfficiencyRow,
    enrollment::Enrollment,
    machine::Machine,
    main_table::Row,
    memory::Memory,
    scaling::Scaling,
    xds_watch::XdsWatch,
};

#[derive(Serialize, Default)]
pub(super) struct Timings {
    pub(super) bed_seconds: f64,
    pub(super) main_table_seconds: f64,
    pub(super) scaling_seconds: f64,
    pub(super) enrollment_seconds: f64,
    pub(super) api_watch_seconds: f64,
    pub(super) xds_watch_seconds: f64,
    pub(super) cleanup_seconds: f64,
    pub(super) total_seconds: f64,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) machine: Machine,
    pub(super) settings: Settings,
    pub(super) rows: Vec<Row>,
    /// Both agents' CPU per unit of work, beside ztunnel's.
    pub(super) efficiency: Vec<EfficiencyRow>,
    pub(super) churn: Churn,
    pub(super) memory: Memory,
    /// Each program instance's counters over the measured span.
    pub(super) ebpf: Vec<ProgCounters>,
    /// The same counters by kind of run.
    pub(super) ebpf_by_workload: EbpfByWorkload,
    /// Where the time of a new connection goes, one client.
    pub(super) one_client_phases: OneClientPhases,
    pub(super) enrollment: Enrollment,
    pub(super) scaling: Scaling,
    /// The agent watching the Kubernetes API at cluster scale.
    pub(super) api_watch: ApiWatch,
    /// The agent fed by istiod at cluster scale.
    pub(super) xds_watch: XdsWatch,
    pub(super) timings: Timings,
}
