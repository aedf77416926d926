//! The admin endpoint, on `127.0.0.1:15000` by default (ztunnel's admin port):
//! `GET /config_dump` answers a JSON document of what the proxy works from;
//! `/logging` shows (`GET`) and changes (`POST /logging?level=debug`, or
//! `EnvFilter` directives: `?level=info,podlink_agent::proxy=debug`) the log
//! filter at run time, as ztunnel's and Envoy's `/logging` do; a filter that does
//! not parse is answered 400 with the reason, and the filter in force stays.
//!
//! ```text
//! {
//!   "node": "node1",
//!   "workloads": [{"namespace", "name", "node", "service_account", "ips",
//!                  "enrollment", "terminating", "identity", "labels",
//!                  "workload_name", "workload_kind", "canonical_service",
//!                  "canonical_revision", "captured": bool}],
//!   "policies": {"root_namespace", "unknown": null | "why",
//!                "unknown_namespaces": {"<namespace>": "why"},
//!                "items": [{"namespace", "name", "action", "scope", "notes"}],
//!                "peer_authentications": [{"namespace", "name",
//!                    "scope": "mesh" | {"namespace": ns} | {"workload": {"namespace", "labels"}} | "ignored",
//!                    "mode": "UNSET" | "DISABLE" | "PERMISSIVE" | "STRICT",
//!                    "port_modes": {"<port>": mode}, "in_effect": bool}]},
//!   "services": [{"namespace", "name", "vip", "port_name", "target_port",
//!                 "endpoints": [{"addr", "ready", "serving", "terminating",
//!                                "node_name", "zone"}], "has_slices",
//!                 "local_only", "traffic_distribution", "affinity_seconds",
//!                 "choice": "ready" | "same-node" | "same-zone"
//!                   | "serving-terminating" | "local"
//!                   | "local-serving-terminating" | "none",
//!                 "usable": ["addr:port"]}],
//!   "denials": {"<namespace>/<name>" (AuthorizationPolicy or PeerAuthentication)
//!               | "allow-policies" | "unknown-policies": count},
//!   "certificates": [{"identity", "state": "issued" | "pending",
//!                     "not_after", "renew_at" (RFC 3339, UTC)}]
//! }
//! ```
//!
//! It is bound to loopback: it exposes the mesh's workloads and must not be
//! reachable from pods.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::{
    authz::{Action, MtlsMode, MtlsScope, Note, Scope},
    proxy::ProxyState,
    state::{Workload, service::ServicePort},
    telemetry::{logging::LogControl, server},
};

/// The default admin address.
pub const DEFAULT_ADMIN_ADDRESS: &str = "127.0.0.1:15000";

/// Binds the admin listener.
///
/// # Errors
/// When the address is taken or not local.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves admin requests until the task is dropped. Without `logging` (no
/// reloadable log filter installed), `/logging` answers 503.
pub async fn serve(listener: TcpListener, state: Arc<ProxyState>, logging: Option<LogControl>) {
    server::serve(listener, move |req| handle(&state, logging.as_ref(), req)).await;
}

/// The value of query parameter `name` in `query`, percent-decoded.
fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (key == name).then(|| {
            percent_encoding::percent_decode_str(&value.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

/// `/logging`: `GET` shows the filter in force; `POST ?level=FILTER` puts a new
/// one in force (a level such as `debug`, or `EnvFilter` directives such as
/// `info,podlink_agent::proxy=debug`), or answers 400 with the reason and
/// keeps the one in force.
fn logging(logging: Option<&LogControl>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let Some(control) = logging else {
        return server::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the log filter cannot be changed in this process\n",
        );
    };
    match *req.method() {
        Method::GET => server::text(StatusCode::OK, format!("{}\n", control.current())),
        Method::POST | Method::PUT => {
            let Some(level) = query_param(req.uri().query().unwrap_or(""), "level") else {
                return server::text(
                    StatusCode::BAD_REQUEST,
                    "give the new filter as ?level=LEVEL or ?level=target=level,...\n",
                );
            };
            match control.set(&level) {
                Ok(now) => {
                    tracing::info!(filter = %now, "log filter changed");
                    server::text(StatusCode::OK, format!("{now}\n"))
                }
                Err(e) => server::text(
                    StatusCode::BAD_REQUEST,
                    format!("{e}; the filter in force stays {}\n", control.current()),
                ),
            }
        }
        _ => server::text(
            StatusCode::METHOD_NOT_ALLOWED,
            "GET shows the log filter, POST ?level=... changes it\n",
        ),
    }
}

fn handle(
    state: &ProxyState,
    log_control: Option<&LogControl>,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/config_dump") => {
            server::respond(StatusCode::OK, "application/json", config_dump(state))
        }
        (_, "/config_dump") => {
            server::text(StatusCode::METHOD_NOT_ALLOWED, "only GET is allowed\n")
        }
        (_, "/logging") => logging(log_control, req),
        (_, path) => server::text(
            StatusCode::NOT_FOUND,
            format!("no admin endpoint {path}; try /config_dump or /logging\n"),
        ),
    }
}

/// A workload as the config dump shows it: its fields and whether this node
/// captures it.
#[derive(Serialize)]
struct WorkloadEntry<'a> {
    #[serde(flatten)]
    workload: &'a Workload,
    captured: bool,
}

#[derive(Serialize)]
struct PolicyEntry<'a> {
    namespace: &'a str,
    name: &'a str,
    action: &'a Action,
    scope: Scope,
    notes: &'a [Note],
}

/// `in_effect`: false for a second definition, one passed over at its level,
/// or a selector in the root namespace.
#[derive(Serialize)]
struct PeerAuthenticationEntry<'a> {
    namespace: &'a str,
    name: &'a str,
    scope: MtlsScope,
    mode: &'a MtlsMode,
    port_modes: &'a BTreeMap<u16, MtlsMode>,
    in_effect: bool,
}

#[derive(Serialize)]
struct Policies<'a> {
    root_namespace: &'a str,
    unknown: Option<&'a str>,
    unknown_namespaces: &'a BTreeMap<String, String>,
    items: Vec<PolicyEntry<'a>>,
    peer_authentications: Vec<PeerAuthenticationEntry<'a>>,
}

#[derive(Serialize)]
struct CertificateEntry {
    identity: String,
    state: &'static str,
    not_after: Option<String>,
    renew_at: Option<String>,
}

/// The config dump's document (shape in the module documentation), borrowing
/// from the view: it is serialized straight to text, so a cluster's worth of
/// workloads and Services costs the text alone.
#[derive(Serialize)]
struct ConfigDump<'a> {
    node: &'a str,
    certificates: Vec<CertificateEntry>,
    workloads: Vec<WorkloadEntry<'a>>,
    policies: Policies<'a>,
    denials: BTreeMap<String, u64>,
    services: Vec<&'a ServicePort>,
}

/// The config dump as pretty-printed JSON text, ending in a newline (shape in
/// the module documentation).
pub fn config_dump(state: &ProxyState) -> String {
    let view = state.view();
    let root = view.policies.root_namespace();
    let mtls = view.policies.mtls();
    // This node's enrolled workload identities and their certificates.
    let certificates = view
        .local_identities()
        .iter()
        .map(|id| {
            let cert = state.certs.cached(id);
            let time = |t| humantime::format_rfc3339_seconds(t).to_string();
            CertificateEntry {
                identity: id.to_string(),
                state: if cert.is_some() { "issued" } else { "pending" },
                not_after: cert.as_ref().map(|c| time(c.not_after)),
                renew_at: cert.as_ref().map(|c| time(c.renew_at)),
            }
        })
        .collect();
    let dump = ConfigDump {
        node: view.workloads.node(),
        certificates,
        workloads: view
            .workloads
            .workloads()
            .map(|w| WorkloadEntry {
                workload: w,
                captured: w.ips.iter().any(|ip| view.local_pod(*ip).is_some()),
            })
            .collect(),
        policies: Policies {
            root_namespace: root,
            unknown: view.policies.unknown(),
            unknown_namespaces: view.policies.unknown_namespaces(),
            items: view
                .policies
                .policies()
                .map(|p| PolicyEntry {
                    namespace: &p.namespace,
                    name: &p.name,
                    action: &p.action,
                    scope: p.scope(root),
                    notes: &p.notes,
                })
                .collect(),
            peer_authentications: mtls
                .policies()
                .map(|p| PeerAuthenticationEntry {
                    namespace: &p.namespace,
                    name: &p.name,
                    scope: p.scope(root),
                    mode: &p.mode,
                    port_modes: &p.port_modes,
                    in_effect: mtls.in_effect(p),
                })
                .collect(),
        },
        denials: state.denials().into_iter().collect(),
        services: view.services.ports().map(|p| p.as_ref()).collect(),
    };
    let mut text = serde_json::to_string_pretty(&dump).expect("the config dump serializes");
    text.push('\n');
    text
}
