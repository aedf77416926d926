//! The admin endpoint, on `127.0.0.1:15000` by default (ztunnel's admin port):
//! `GET /config_dump` answers a JSON document of what the proxy works from.
//!
//! ```text
//! {
//!   "node": "node1",
//!   "workloads": [{"namespace", "name", "node", "service_account", "ips",
//!                  "enrollment", "terminating", "identity", "labels",
//!                  "captured": bool}],
//!   "policies": {"root_namespace", "unknown": null | "why",
//!                "items": [{"namespace", "name", "action", "scope", "notes"}]},
//!   "denials": {"<namespace>/<name>" | "allow-policies" | "unknown-policies": count},
//!   "certificates": [{"identity", "state": "issued" | "pending",
//!                     "not_after", "renew_at" (RFC 3339, UTC)}]
//! }
//! ```
//!
//! It is bound to loopback: it exposes the mesh's workloads and must not be
//! reachable from pods.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::proxy::ProxyState;

/// The default admin address.
pub const DEFAULT_ADMIN_ADDRESS: &str = "127.0.0.1:15000";

/// Binds the admin listener.
///
/// # Errors
/// When the address is taken or not local.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves admin requests until the task is dropped.
pub async fn serve(listener: TcpListener, state: Arc<ProxyState>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(&state, &req)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn handle(state: &ProxyState, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/config_dump") => {
            let mut text =
                serde_json::to_string_pretty(&config_dump(state)).expect("JSON values serialize");
            text.push('\n');
            (StatusCode::OK, text)
        }
        (_, "/config_dump") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET is allowed\n".to_string(),
        ),
        (_, path) => (
            StatusCode::NOT_FOUND,
            format!("no admin endpoint {path}; try /config_dump\n"),
        ),
    };
    Response::builder()
        .status(status)
        .header(
            http::header::CONTENT_TYPE,
            if status == StatusCode::OK {
                "application/json"
            } else {
                "text/plain"
            },
        )
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response")
}

/// The config dump (shape in the module documentation).
pub fn config_dump(state: &ProxyState) -> Value {
    let view = state.view();
    let workloads: Vec<Value> = view
        .workloads
        .workloads()
        .map(|w| {
            let mut value = serde_json::to_value(w.as_ref()).expect("workloads serialize");
            value["captured"] = json!(w.ips.iter().any(|ip| view.local_pod(*ip).is_some()));
            value
        })
        .collect();
    let root = view.policies.root_namespace();
    let policies: Vec<Value> = view
        .policies
        .policies()
        .map(|p| {
            json!({
                "namespace": p.namespace,
                "name": p.name,
                "action": p.action,
                "scope": p.scope(root),
                "notes": p.notes,
            })
        })
        .collect();
    let denials: serde_json::Map<String, Value> = state
        .denials()
        .into_iter()
        .map(|(k, v)| (k, json!(v)))
        .collect();
    // This node's enrolled workload identities and their certificates.
    let mut identities: Vec<_> = view
        .workloads
        .workloads()
        .filter(|w| w.ips.iter().any(|ip| view.local_pod(*ip).is_some()))
        .map(|w| w.identity.clone())
        .collect();
    identities.sort();
    identities.dedup();
    let certificates: Vec<Value> = identities
        .iter()
        .map(|id| {
            let cert = state.certs.cached(id);
            json!({
                "identity": id.to_string(),
                "state": if cert.is_some() { "issued" } else { "pending" },
                "not_after": cert.as_ref().map(|c| humantime::format_rfc3339_seconds(c.not_after).to_string()),
                "renew_at": cert.as_ref().map(|c| humantime::format_rfc3339_seconds(c.renew_at).to_string()),
            })
        })
        .collect();
    json!({
        "node": view.workloads.node(),
        "certificates": certificates,
        "workloads": workloads,
        "policies": {
            "root_namespace": root,
            "unknown": view.policies.unknown(),
            "items": policies,
        },
        "denials": denials,
    })
}
