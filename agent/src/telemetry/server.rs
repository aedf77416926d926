//! The small HTTP/1 servers of the agent (hyper): the metrics endpoint
//! (`GET /metrics`, default `0.0.0.0:15020`), the readiness endpoint
//! (`GET /healthz/ready`, default `0.0.0.0:15021`, the ports and path of
//! ztunnel and Istio's sidecars), and the admin endpoint's transport.

use std::{
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::{
    metrics,
    scrape::{self, DataplaneMaps},
};
use crate::proxy::ProxyState;

/// The default address of the readiness endpoint (port 15021 as ztunnel).
pub const DEFAULT_READINESS_ADDRESS: &str = "0.0.0.0:15021";

/// A response with a body of `content_type`.
pub fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response")
}

/// A `text/plain` response.
pub fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    respond(status, "text/plain; charset=utf-8", body.into())
}

/// Serves HTTP/1 requests on `listener` with `handler` until the task is dropped.
/// A failed accept (out of descriptors) is retried after a pause.
pub async fn serve<H>(listener: TcpListener, handler: H)
where
    H: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync + 'static,
{
    let handler = Arc::new(handler);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler(&req)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Whether the agent is ready: its listeners are up and its programs loaded and
/// attached to the pods it could attach at start; not while it drains.
#[derive(Debug, Default)]
pub struct Readiness(AtomicBool);

impl Readiness {
    /// Sets readiness.
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    /// Whether ready.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The readiness endpoint: `GET /healthz/ready` answers 200 `ready` or 503 `not
/// ready` (starting or draining); other paths 404.
pub fn readiness(ready: Arc<Readiness>) -> impl Fn(&Request<Incoming>) -> Response<Full<Bytes>> {
    move |req| match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz/ready") if ready.get() => text(StatusCode::OK, "ready\n"),
        (&Method::GET, "/healthz/ready") => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: starting or draining\n",
        ),
        (_, "/healthz/ready") => text(StatusCode::METHOD_NOT_ALLOWED, "only GET is allowed\n"),
        (_, path) => text(
            StatusCode::NOT_FOUND,
            format!("no endpoint {path}; try /healthz/ready\n"),
        ),
    }
}

/// The metrics endpoint: `GET /metrics` answers the page of
/// [`scrape::encode`]; other paths 404.
pub fn metrics(
    state: Arc<ProxyState>,
    maps: Option<Arc<Mutex<DataplaneMaps>>>,
) -> impl Fn(&Request<Incoming>) -> Response<Full<Bytes>> {
    move |req| match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics" | "/stats/prometheus") => respond(
            StatusCode::OK,
            metrics::CONTENT_TYPE,
            scrape::encode(&state, maps.as_deref()),
        ),
        (_, "/metrics" | "/stats/prometheus") => {
            text(StatusCode::METHOD_NOT_ALLOWED, "only GET is allowed\n")
        }
        (_, path) => text(
            StatusCode::NOT_FOUND,
            format!("no endpoint {path}; try /metrics\n"),
        ),
    }
}
