//! What the agent knows, whatever the source it came from: the workload index
//! and the enrollment decision ([`workload`]), the Services ([`service`]), the
//! proxy's view of them ([`view`]) and its choice among a Service's endpoints
//! ([`endpoint`]).

pub mod endpoint;
pub mod service;
pub mod view;
pub mod workload;

pub use view::View;
pub(crate) use workload::is_finished;
pub use workload::{
    DATAPLANE_MODE_AMBIENT, DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE, Enrollment, MAX_POD_UPDATES,
    Workload, WorkloadIndex, enrollment,
};
