//! Istio's control plane (istiod) as a source: the workloads, services and
//! authorization policies it pushes over workload xDS ([`crate::xds`]),
//! converted ([`convert`]) into what [`crate::state::State`] holds.

pub mod convert;
