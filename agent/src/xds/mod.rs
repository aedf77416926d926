//! A client of istiod's workload xDS: the workloads, services and policies istiod
//! serves to ztunnel, over Envoy's incremental (delta) aggregated discovery service.

pub mod proto;
