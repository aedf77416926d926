//! The workload xDS messages and the delta ADS service, generated from podlink's
//! protos (`agent/proto/`, see their headers for the source files and commit) by
//! `build.rs`. Module paths follow the protobuf packages; the short names below
//! are what the rest of podlink uses.
//!
//! The well-known types (`google.protobuf.Any`, `Struct`, `Duration`, `Empty`,
//! `UInt32Value`) are `prost_types`'.

#![allow(missing_docs, clippy::all)]

/// `istio.*` packages.
pub mod istio {
    /// `istio.workload`: `Address` (a `Workload` or a `Service`) and their parts.
    pub mod workload {
        include!(concat!(env!("OUT_DIR"), "/istio.workload.rs"));
    }
    /// `istio.security`: `Authorization` (a policy) and its rules.
    pub mod security {
        include!(concat!(env!("OUT_DIR"), "/istio.security.rs"));
    }
}

/// `envoy.*` packages.
pub mod envoy {
    /// `envoy.config.*`.
    pub mod config {
        /// `envoy.config.core`.
        pub mod core {
            /// `envoy.config.core.v3`: `Node`.
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
            }
        }
    }
    /// `envoy.service.*`.
    pub mod service {
        /// `envoy.service.discovery`.
        pub mod discovery {
            /// `envoy.service.discovery.v3`: the delta ADS service and messages.
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.discovery.v3.rs"));
            }
        }
    }
}

/// `google.*` packages (the non-well-known ones).
pub mod google {
    /// `google.rpc`: `Status`.
    pub mod rpc {
        include!(concat!(env!("OUT_DIR"), "/google.rpc.rs"));
    }
}

pub use envoy::config::core::v3 as core;
pub use envoy::service::discovery::v3 as discovery;
pub use google::rpc;
pub use istio::{security, workload};

/// The type URL of workload xDS `Address` resources
/// (`type.googleapis.com/` + the message's full name, as `Any` spells it).
pub const ADDRESS_TYPE_URL: &str = "type.googleapis.com/istio.workload.Address";
/// The type URL of `Authorization` resources.
pub const AUTHORIZATION_TYPE_URL: &str = "type.googleapis.com/istio.security.Authorization";
