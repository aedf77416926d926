//! What the agent knows, whatever the source it came from: the workload index
//! and the enrollment decision ([`workload`]), the Services ([`service`]).

pub mod service;
pub mod workload;

pub(crate) use workload::is_finished;
pub use workload::{
    DATAPLANE_MODE_AMBIENT, DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE, Enrollment, MAX_POD_UPDATES,
    Workload, WorkloadIndex, enrollment,
};
