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
/// send nothing, send a request slowly or send a huge one cannot hold the
/// agent's descriptors or memory (the metrics and readiness endpoints listen on
/// every address of the node). A request's body is never read: once answered,
/// a connection whose body has not all arrived is closed (hyper's
/// `poll_drain_or_close_read`), so a body costs at most the connection's read
/// buffer ([`MAX_BUFFER`]).
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
    /// Largest request line and headers (bytes); a larger request is answered
    /// 431 (Request Header Fields Too Large) and its connection closed (hyper's
    /// `max_header_size`).
    pub header_size: usize,
}

/// The largest read buffer of a connection (bytes, hyper's `max_buf_size`):
/// what a request's headers and the part of its body that arrived with them can
/// take.
pub const MAX_BUFFER: usize = 64 * 1024;

impl Limits {
    /// 64 connections, 5 s for a request's headers, 60 s per connection, 16 KiB
    /// of request line and headers: far more than scrapers, kubelet probes and
    /// admin requests use.
    pub const DEFAULT: Limits = Limits {
        connections: 64,
        header_read: Duration::from_secs(5),
        lifetime: Duration::from_secs(60),
        header_size: 16 * 1024,
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
                .max_header_size(limits.header_size)
                .max_buf_size(MAX_BUFFER)
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
            ..Limits::DEFAULT
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
            ..Limits::DEFAULT
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

    /// Sends `head`, then `body_len` bytes of body (as far as the server takes
    /// them); the response (empty when the connection was closed first), whether
    /// the server closed the connection afterwards, and the body's bytes sent.
    async fn send(addr: SocketAddr, head: &[u8], body_len: usize) -> (String, bool, usize) {
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client.write_all(head).await.unwrap();
        let (mut read, mut write) = client.split();
        let mut sent = 0;
        let body = async {
            let piece = vec![b'x'; 64 * 1024];
            let mut left = body_len;
            while left > 0 {
                let n = left.min(piece.len());
                if write.write_all(&piece[..n]).await.is_err() {
                    break;
                }
                left -= n;
                sent += n;
            }
            // The end of the request never comes: the server has to close.
            std::future::pending::<bool>().await
        };
        let mut response = Vec::new();
        let reading = async {
            let mut buf = [0u8; 4096];
            loop {
                match read.read(&mut buf).await {
                    Ok(0) | Err(_) => return true,
                    Ok(n) => response.extend_from_slice(&buf[..n]),
                }
            }
        };
        let closed = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::select! {
                closed = reading => closed,
                closed = body => closed,
            }
        })
        .await
        .unwrap_or(false);
        (
            String::from_utf8_lossy(&response).into_owned(),
            closed,
            sent,
        )
    }

    /// Headers over the limit are answered 431 and the connection closed; a body
    /// is not read: the request is answered and the connection closed before the
    /// body has all arrived. The endpoint answers the next client.
    #[tokio::test]
    async fn oversized_requests_are_cut_off() {
        let (addr, server) = endpoint(Limits::DEFAULT).await;
        let huge_header = format!(
            "GET /metrics HTTP/1.1\r\nhost: x\r\nx-junk: {}\r\n\r\n",
            "a".repeat(Limits::DEFAULT.header_size)
        );
        let (response, closed, _) = send(addr, huge_header.as_bytes(), 0).await;
        assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");
        assert!(closed, "the connection of an oversized header is closed");

        let head = b"POST /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 1073741824\r\n\r\n";
        let (response, closed, sent) = send(addr, head, 1 << 30).await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
        assert!(closed, "a connection whose body is not all there is closed");
        assert!(sent < 1 << 30, "the whole body was taken");
        assert!(get(addr).await.starts_with("HTTP/1.1 200"));
        server.abort();
    }
}
