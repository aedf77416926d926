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
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::Semaphore};

use super::{
    logging::RateLimited,
    metrics,
    scrape::{self, DataplaneMaps, ScrapeSource},
};

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

/// Bounds on the connections of one endpoint, so that clients that connect and
/// send nothing, or send a request slowly, cannot hold the agent's descriptors
/// (the endpoints listen on every address of the node).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; more are closed as soon as they are accepted.
    pub connections: usize,
    /// Time a client has to send a request's headers, from the connection's
    /// start or the previous response (hyper's `header_read_timeout`).
    pub header_read: Duration,
    /// Longest life of a connection: a keep-alive connection is closed after it
    /// (a scraper opens another).
    pub lifetime: Duration,
}

impl Limits {
    /// 64 connections, 5 s for a request's headers, 60 s per connection: far more
    /// than scrapers and kubelet probes use.
    pub const DEFAULT: Limits = Limits {
        connections: 64,
        header_read: Duration::from_secs(5),
        lifetime: Duration::from_secs(60),
    };
}

/// Serves HTTP/1 requests on `listener` with `handler` until the task is dropped,
/// within [`Limits::DEFAULT`]. A failed accept (out of descriptors) is retried
/// after a pause.
pub async fn serve<H>(listener: TcpListener, handler: H)
where
    H: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync + 'static,
{
    serve_within(listener, handler, Limits::DEFAULT).await
}

/// [`serve`] within `limits`.
pub async fn serve_within<H>(listener: TcpListener, handler: H, limits: Limits)
where
    H: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync + 'static,
{
    let handler = Arc::new(handler);
    let permits = Arc::new(Semaphore::new(limits.connections));
    let over_limit = RateLimited::default();
    let accept_failed = RateLimited::default();
    let name = listener.local_addr().map_or_else(
        |_| "HTTP endpoint".to_string(),
        |a| format!("HTTP endpoint {a}"),
    );
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                accept_failed.warn(|n| format!("{name}: accept failed: {e} ({n} times)"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Closed at once: a full endpoint holds no more descriptors.
            over_limit.warn(|n| {
                format!(
                    "{name}: at the limit of {} connections; refused {n} (from {peer} and others)",
                    limits.connections
                )
            });
            drop(stream);
            continue;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler(&req)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.lifetime, connection).await;
            drop(permit);
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
pub fn metrics<P: ScrapeSource>(
    proxy: Arc<P>,
    maps: Option<Arc<Mutex<DataplaneMaps>>>,
) -> impl Fn(&Request<Incoming>) -> Response<Full<Bytes>> {
    move |req| match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics" | "/stats/prometheus") => respond(
            StatusCode::OK,
            metrics::CONTENT_TYPE,
            scrape::encode(&*proxy, maps.as_deref()),
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use std::net::SocketAddr;

    use super::*;

    /// Whether the server closes `stream` within `within` (reading what it sent
    /// first).
    async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 1024];
        tokio::time::timeout(within, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }

    /// Serves `ok` within `limits` on a loopback port.
    async fn endpoint(limits: Limits) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve_within(
            listener,
            |_req: &Request<Incoming>| text(StatusCode::OK, "ok"),
            limits,
        ));
        (addr, server)
    }

    /// Sends a whole request; the response (empty when the connection was closed
    /// or reset first).
    async fn get(addr: SocketAddr) -> String {
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = b"GET /healthz/ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        let mut response = String::new();
        if client.write_all(request).await.is_ok() {
            let read = client.read_to_string(&mut response);
            if tokio::time::timeout(Duration::from_secs(5), read)
                .await
                .is_err()
            {
                response.clear();
            }
        }
        response
    }

    /// Connections over the limit are closed at once; the endpoint answers again
    /// once the clients holding it are gone.
    #[tokio::test]
    async fn connections_over_the_limit_are_closed() {
        let (addr, server) = endpoint(Limits {
            connections: 2,
            header_read: Duration::from_secs(60),
            lifetime: Duration::from_secs(60),
        })
        .await;
        let silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
        // Let the server take both before the third.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_within(&mut third, Duration::from_secs(5)).await,
            "a connection over the limit is closed"
        );
        drop((silent, slow));
        let mut response = String::new();
        for _ in 0..50 {
            response = get(addr).await;
            if !response.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
        server.abort();
    }

    /// Clients that connect and send nothing, or half a request, are closed after
    /// the header timeout.
    #[tokio::test]
    async fn idle_and_slow_clients_are_closed() {
        let (addr, server) = endpoint(Limits {
            connections: 64,
            header_read: Duration::from_millis(300),
            lifetime: Duration::from_secs(60),
        })
        .await;
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
        assert!(
            closed_within(&mut slow, Duration::from_secs(5)).await,
            "half a request is closed after the header timeout"
        );
        assert!(
            closed_within(&mut silent, Duration::from_secs(5)).await,
            "a silent connection is closed after the header timeout"
        );
        assert!(get(addr).await.starts_with("HTTP/1.1 200"));
        server.abort();
    }
}
