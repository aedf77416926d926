//! What one proxied connection records: Istio's TCP metrics while it lives, and
//! one access log line when it is done.
//!
//! The access log line (target `access`, level INFO, message `connection
//! complete`), after ztunnel's access log, has these fields:
//!
//! | field | value |
//! |---|---|
//! | `direction` | `outbound` or `inbound` |
//! | `route` | `hbone`, `local` (two pods of this node), `passthrough` (outside the mesh), `waypoint` (through the destination's waypoint), `inbound_hbone`, `inbound_waypoint` (HBONE from the destination's waypoint), `inbound_plaintext` |
//! | `src.addr`, `dst.addr` | `ip:port` of the client and of the original destination |
//! | `src.workload`, `src.namespace`, `dst.workload`, `dst.namespace` | the pods' names and namespaces, as ztunnel's, when their addresses belong to known workloads (absent otherwise); the metrics name the workloads the pods belong to |
//! | `dst.service` | for a connection to a Service's ClusterIP, its host name `<name>.<namespace>.svc.cluster.local` (absent otherwise) |
//! | `src.identity`, `dst.identity` | SPIFFE IDs, when known: the client's proved (HBONE) or its pod's (outbound), the destination's expected or presented (absent for plaintext peers) |
//! | `bytes_recv` | bytes from the client to the server (Istio's `received`, the request direction) |
//! | `bytes_sent` | bytes from the server to the client (Istio's `sent`, the response direction) |
//! | `duration_ms` | from accepting the connection (or stream) to its end, milliseconds |
//! | `result` | `ok`, `denied`, or a [`FailureKind`] (`connect_timeout`, `revoked`, …) |
//! | `policy` | with `denied`: the policy that denied it (an AuthorizationPolicy's `namespace/name`, a PeerAuthentication's when it makes mutual TLS `STRICT` and the connection is plaintext, `allow-policies`, `unknown-policies`) |
//! | `error` | with a failure: what happened |
//!
//! In text form: `… INFO access: connection complete direction=outbound
//! route=hbone src.addr=10.244.1.2:40312 src.workload=client … result=ok`; with
//! `--log-format json`, one JSON object per line with these keys under `fields`.

use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll, ready},
    time::Instant,
};

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::metrics::{
    Direction, FailureKind, Metrics, Peer, Reporter, SecurityPolicy, TcpLabels, WorkloadMeta,
};
use crate::identity::SpiffeId;

/// Why a connection failed: the kind (a metric label) and what happened (logged).
#[derive(Debug, Clone)]
pub struct Failure {
    /// The kind.
    pub kind: FailureKind,
    /// What happened, for the logs.
    pub message: String,
}

impl Failure {
    /// A failure of `kind`.
    pub fn new(kind: FailureKind, message: impl ToString) -> Self {
        Self {
            kind,
            message: message.to_string(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// How a connection ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Both directions ended normally.
    Ok,
    /// Refused by an authorization policy, or as plaintext by a
    /// PeerAuthentication (named).
    Denied(String),
    /// Failed.
    Failed(Failure),
}

/// The parties of a connection as the access log names them.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// `route` of the access log.
    pub route: &'static str,
    /// The client's address.
    pub src: SocketAddr,
    /// The original destination.
    pub dst: SocketAddr,
    /// The client's pod, when known.
    pub src_workload: Option<Arc<dyn WorkloadMeta>>,
    /// The destination's pod, when known.
    pub dst_workload: Option<Arc<dyn WorkloadMeta>>,
    /// The client's identity, when known.
    pub src_identity: Option<SpiffeId>,
    /// The destination's identity, when known.
    pub dst_identity: Option<SpiffeId>,
    /// The Service whose ClusterIP the client connected to (`namespace`,
    /// `name`, host name: [`crate::state::service::ServicePort::host`]).
    pub service: Option<(String, String, String)>,
}

/// The bytes a connection carries, counted as they flow: into the
/// `istio_tcp_*_bytes_total` series of the connection and into totals for its
/// access log line.
#[derive(Debug)]
pub struct Traffic {
    received: Vec<Counter>,
    sent: Vec<Counter>,
    from_client: AtomicU64,
    to_client: AtomicU64,
}

impl Traffic {
    /// Counts `n` bytes read from the client (toward the server).
    pub fn count_from_client(&self, n: usize) {
        let n = n as u64;
        self.from_client.fetch_add(n, Ordering::Relaxed);
        self.received.iter().for_each(|c| {
            c.inc_by(n);
        });
    }

    /// Counts `n` bytes written to the client (from the server).
    pub fn count_to_client(&self, n: usize) {
        let n = n as u64;
        self.to_client.fetch_add(n, Ordering::Relaxed);
        self.sent.iter().for_each(|c| {
            c.inc_by(n);
        });
    }
}

/// The client-facing stream of a connection, counting what is read from it
/// (client to server) and written to it (server to client) in its [`Traffic`].
/// The proxy's zero-copy reads and writes count through [`Metered::parts`].
pub struct Metered<'a, S> {
    inner: S,
    traffic: &'a Traffic,
}

impl<S> Metered<'_, S> {
    /// The stream and the [`Traffic`] its bytes are counted in, for reads and
    /// writes that do not go through [`AsyncRead`] and [`AsyncWrite`].
    pub fn parts(&mut self) -> (&mut S, &Traffic) {
        (&mut self.inner, self.traffic)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<'_, S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        self.traffic.count_from_client(buf.filled().len() - before);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<'_, S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut self.inner).poll_write(cx, buf))?;
        self.traffic.count_to_client(n);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// One connection's record: counted as opened when made, as closed (and logged)
/// when finished — or dropped unfinished, which logs it as `io` ("abandoned": the
/// agent stopped while it was open).
pub struct ConnectionRecord {
    metrics: Arc<Metrics>,
    direction: Direction,
    closed: Vec<Counter>,
    traffic: Traffic,
    endpoints: Endpoints,
    start: Instant,
    done: bool,
}

impl ConnectionRecord {
    /// Counts a new connection between `endpoints`, once per reporter (a
    /// connection between two pods of this node is reported by both sides).
    pub fn open(
        metrics: &Arc<Metrics>,
        direction: Direction,
        reporters: &[Reporter],
        security: SecurityPolicy,
        endpoints: Endpoints,
    ) -> Self {
        let source = Peer {
            workload: endpoints.src_workload.as_deref(),
            identity: endpoints.src_identity.as_ref(),
        };
        let destination = Peer {
            workload: endpoints.dst_workload.as_deref(),
            identity: endpoints.dst_identity.as_ref(),
        };
        let labels: Vec<TcpLabels> = reporters
            .iter()
            .map(|r| TcpLabels::new(*r, source, destination, security, metrics.cluster_id()))
            .map(|l| match &endpoints.service {
                Some((namespace, name, host)) => l.with_service(namespace, name, host),
                None => l,
            })
            .collect();
        let each = |family: &prometheus_client::metrics::family::Family<TcpLabels, Counter>| {
            labels
                .iter()
                .map(|l| family.get_or_create_owned(l))
                .collect::<Vec<_>>()
        };
        for c in each(&metrics.opened) {
            c.inc();
        }
        Self {
            metrics: metrics.clone(),
            direction,
            closed: each(&metrics.closed),
            traffic: Traffic {
                received: each(&metrics.received_bytes),
                sent: each(&metrics.sent_bytes),
                from_client: AtomicU64::new(0),
                to_client: AtomicU64::new(0),
            },
            endpoints,
            start: Instant::now(),
            done: false,
        }
    }

    /// Wraps the connection's client-facing stream so that its bytes are counted.
    pub fn meter<S>(&self, client: S) -> Metered<'_, S> {
        Metered {
            inner: client,
            traffic: &self.traffic,
        }
    }

    /// Bytes from the client so far, and to the client.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.traffic.from_client.load(Ordering::Relaxed),
            self.traffic.to_client.load(Ordering::Relaxed),
        )
    }

    /// Counts the connection as closed (and failed, with its kind) and writes
    /// its access log line.
    pub fn finish(mut self, outcome: Outcome) {
        self.record(&outcome);
    }

    fn record(&mut self, outcome: &Outcome) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let (result, policy, error) = match outcome {
            Outcome::Ok => ("ok", None, None),
            Outcome::Denied(policy) => ("denied", Some(policy.as_str()), None),
            Outcome::Failed(f) => {
                self.metrics.failed(self.direction, f.kind);
                (f.kind.as_str(), None, Some(f.message.as_str()))
            }
        };
        let (bytes_recv, bytes_sent) = self.bytes();
        let e = &self.endpoints;
        fn name(w: &Option<Arc<dyn WorkloadMeta>>) -> Option<&str> {
            w.as_deref().map(WorkloadMeta::name)
        }
        fn namespace(w: &Option<Arc<dyn WorkloadMeta>>) -> Option<&str> {
            w.as_deref().map(WorkloadMeta::namespace)
        }
        let id = |i: &Option<SpiffeId>| i.as_ref().map(ToString::to_string);
        let service = e.service.as_ref().map(|(_, _, host)| host.as_str());
        tracing::info!(
            target: "access",
            direction = %self.direction.as_str(),
            route = %e.route,
            src.addr = %e.src,
            src.workload = name(&e.src_workload),
            src.namespace = namespace(&e.src_workload),
            src.identity = id(&e.src_identity),
            dst.addr = %e.dst,
            dst.service = service,
            dst.workload = name(&e.dst_workload),
            dst.namespace = namespace(&e.dst_workload),
            dst.identity = id(&e.dst_identity),
            bytes_recv,
            bytes_sent,
            duration_ms = self.start.elapsed().as_millis() as u64,
            result = %result,
            policy,
            error,
            "connection complete"
        );
        // Counted once logged: a reader of the metrics finds the line written.
        for c in &self.closed {
            c.inc();
        }
    }
}

impl Drop for ConnectionRecord {
    fn drop(&mut self) {
        self.record(&Outcome::Failed(Failure::new(
            FailureKind::Io,
            "abandoned: the proxy stopped carrying it",
        )));
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn endpoints() -> Endpoints {
        Endpoints {
            route: "passthrough",
            src: "10.244.1.2:40000".parse().unwrap(),
            dst: "10.0.0.1:80".parse().unwrap(),
            src_workload: None,
            dst_workload: None,
            src_identity: None,
            dst_identity: None,
            service: None,
        }
    }

    /// Bytes are counted as they flow, into the metrics of every reporter, and a
    /// finished (or dropped) record counts one close and a failure by kind.
    #[tokio::test]
    async fn records_count_bytes_as_they_flow_and_close_once() {
        let metrics = Arc::new(Metrics::new("Kubernetes"));
        let record = ConnectionRecord::open(
            &metrics,
            Direction::Outbound,
            &[Reporter::Source, Reporter::Destination],
            SecurityPolicy::None,
            endpoints(),
        );
        let (client, mut far) = tokio::io::duplex(64);
        let mut metered = record.meter(client);
        far.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        metered.read_exact(&mut buf).await.unwrap();
        metered.write_all(b"hi").await.unwrap();
        drop(metered);
        assert_eq!(record.bytes(), (5, 2));
        let labels = |r| {
            TcpLabels::new(
                r,
                Peer::default(),
                Peer::default(),
                SecurityPolicy::None,
                "Kubernetes",
            )
        };
        for r in [Reporter::Source, Reporter::Destination] {
            assert_eq!(metrics.opened.get_or_create(&labels(r)).get(), 1);
            assert_eq!(metrics.received_bytes.get_or_create(&labels(r)).get(), 5);
            assert_eq!(metrics.sent_bytes.get_or_create(&labels(r)).get(), 2);
            assert_eq!(metrics.closed.get_or_create(&labels(r)).get(), 0);
        }
        record.finish(Outcome::Failed(Failure::new(
            FailureKind::ConnectTimeout,
            "timed out",
        )));
        assert_eq!(
            metrics
                .closed
                .get_or_create(&labels(Reporter::Source))
                .get(),
            1
        );
        assert_eq!(
            metrics.failures(Direction::Outbound, FailureKind::ConnectTimeout),
            1
        );

        // Dropped unfinished: closed once, as abandoned.
        drop(ConnectionRecord::open(
            &metrics,
            Direction::Outbound,
            &[Reporter::Source],
            SecurityPolicy::None,
            endpoints(),
        ));
        assert_eq!(
            metrics
                .closed
                .get_or_create(&labels(Reporter::Source))
                .get(),
            2
        );
        assert_eq!(metrics.failures(Direction::Outbound, FailureKind::Io), 1);
    }

    /// A writer into a shared buffer, for a test's subscriber.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A known pod of a Deployment, as telemetry reads it.
    #[derive(Debug)]
    struct Pod;

    impl WorkloadMeta for Pod {
        fn name(&self) -> &str {
            "web-5d8f9c7b6-x2x9q"
        }
        fn namespace(&self) -> &str {
            "shop"
        }
        fn workload_name(&self) -> &str {
            "web"
        }
        fn canonical_service(&self) -> &str {
            "web"
        }
        fn canonical_revision(&self) -> &str {
            "latest"
        }
        fn label(&self, _: &str) -> Option<&str> {
            None
        }
    }

    /// The access line names the pods (as ztunnel's) and the Service; the
    /// metrics name the workload.
    #[test]
    fn the_access_line_names_pods_and_the_service() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let metrics = Arc::new(Metrics::new("Kubernetes"));
        tracing::subscriber::with_default(subscriber, || {
            let record = ConnectionRecord::open(
                &metrics,
                Direction::Outbound,
                &[Reporter::Source],
                SecurityPolicy::MutualTls,
                Endpoints {
                    route: "hbone",
                    dst_workload: Some(Arc::new(Pod)),
                    service: Some((
                        "shop".into(),
                        "web".into(),
                        "web.shop.svc.cluster.local".into(),
                    )),
                    ..endpoints()
                },
            );
            record.finish(Outcome::Ok);
        });
        let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        for field in [
            "dst.service=\"web.shop.svc.cluster.local\"",
            "dst.workload=\"web-5d8f9c7b6-x2x9q\"",
            "dst.namespace=\"shop\"",
            "result=ok",
        ] {
            assert!(log.contains(field), "{field} missing from {log}");
        }
        assert!(!log.contains("src.workload"), "{log}");
        let page = {
            let mut page = String::new();
            metrics.encode_live(&mut page).unwrap();
            page
        };
        assert!(page.contains("destination_workload=\"web\""), "{page}");
        assert!(
            page.contains("destination_service=\"web.shop.svc.cluster.local\""),
            "{page}"
        );
    }
}
