//! podlink's node agent: workload sources, the eBPF dataplane, workload identity
//! and the HBONE proxy. The `podlink` binary (`src/main.rs`) is its command line.

#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod admin;
pub mod agent;
pub mod authz;
pub mod cli;
pub mod cni;
pub mod dataplane;
pub mod dns;
pub mod error;
pub mod identity;
pub mod istiod;
pub mod k8s;
pub mod proxy;
pub mod reconcile;
pub mod source;
pub mod state;
pub mod sys;
pub mod telemetry;
pub mod uninstall;
pub mod xds;
