//! A delta ADS server double: istiod's workload xDS for the tests.
//!
//! It serves `envoy.service.discovery.v3.AggregatedDiscoveryService/
//! DeltaAggregatedResources` (the generated server of `podlink_agent::xds::proto`)
//! over TLS with a certificate for its IP address, signed by a root of its own
//! ([`XdsDouble::root_pem`], the trust bundle to give the client). It speaks the
//! protocol as Envoy's "Incremental xDS" document describes it and istiod serves it:
//! * holds resources by type URL, each with a version that changes on every set;
//! * on a stream's first request of a type (a wildcard subscription), answers with
//!   every resource whose version differs from the request's
//!   `initial_resource_versions` (and `removed_resources` for names held there that
//!   it no longer has), always, even when that is nothing;
//! * on [`XdsDouble::push`], sends each open stream what changed for it since its
//!   last response (what it sent is taken as what the client holds, as istiod
//!   does);
//! * each response has a new nonce; the requests answering them (ACK, or NACK
//!   with `error_detail`) are recorded with everything else.
//!
//! A call must carry `authorization: Bearer <token>` with the token given (else
//! `UNAUTHENTICATED`), and may be refused whatever its token
//! ([`XdsDouble::reject_tokens`]) until told otherwise. [`XdsDouble::stop`] ends
//! every stream with `UNAVAILABLE` and closes the listener and the connections;
//! [`XdsDouble::restart`] serves again on the same address, with the same
//! certificate and resources.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_agent::xds::proto::{
    self,
    discovery::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
        aggregated_discovery_service_server::{
            AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
        },
    },
};
use prost::Message;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use crate::netns;

/// One request on a stream, as the double saw it.
#[derive(Clone, Debug)]
pub struct XdsRequest {
    /// The stream's number, from 1 in the order streams were accepted.
    pub stream: u64,
    /// The request.
    pub request: DeltaDiscoveryRequest,
    /// When the double read it off the stream.
    pub received: Instant,
}

impl XdsRequest {
    /// Whether it answers a response (`response_nonce` set) rather than subscribes.
    pub fn is_answer(&self) -> bool {
        !self.request.response_nonce.is_empty()
    }

    /// Whether it is an ACK.
    pub fn is_ack(&self) -> bool {
        self.is_answer() && self.request.error_detail.is_none()
    }

    /// The NACK's `error_detail` message, if it is one.
    pub fn nack(&self) -> Option<&str> {
        self.request
            .error_detail
            .as_ref()
            .map(|s| s.message.as_str())
    }
}

/// One response sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdsResponse {
    /// The stream's number.
    pub stream: u64,
    /// Its type URL.
    pub type_url: String,
    /// Its nonce.
    pub nonce: String,
    /// The names of the resources in it.
    pub resources: Vec<String>,
    /// `removed_resources`.
    pub removed: Vec<String>,
}

/// One call (stream) as the double saw it.
#[derive(Clone, Debug)]
pub struct XdsCall {
    /// The stream's number (also of refused calls).
    pub stream: u64,
    /// The `authorization` header, if any.
    pub authorization: Option<String>,
    /// The `clusterid` header, if any.
    pub cluster_id: Option<String>,
    /// `None` when served; else the status answered.
    pub refused: Option<tonic::Code>,
}

/// A resource held: version and encoded message.
#[derive(Clone)]
struct Held {
    version: String,
    value: Vec<u8>,
}

/// An open stream: what it was sent (by type, name → version) and where to send.
struct OpenStream {
    id: u64,
    sent: HashMap<String, HashMap<String, String>>,
    tx: mpsc::UnboundedSender<Result<DeltaDiscoveryResponse, Status>>,
}

#[derive(Default)]
struct Shared {
    token: String,
    reject_all: bool,
    resources: HashMap<String, BTreeMap<String, Held>>,
    streams: Vec<OpenStream>,
    calls: Vec<XdsCall>,
    requests: Vec<XdsRequest>,
    responses: Vec<XdsResponse>,
    next_stream: u64,
    next_nonce: u64,
    next_version: u64,
}

impl Shared {
    /// A response for `stream` of type `type_url`, with what changed since what
    /// it holds (`sent`); `None` when nothing did and `always` is false.
    fn diff(&mut self, index: usize, type_url: &str, always: bool) -> Option<()> {
        let empty = BTreeMap::new();
        let current = self.resources.get(type_url).unwrap_or(&empty);
        let stream = &mut self.streams[index];
        let sent = stream.sent.entry(type_url.to_string()).or_default();
        let mut resources = Vec::new();
        for (name, held) in current {
            if sent.get(name) != Some(&held.version) {
                resources.push(Resource {
                    name: name.clone(),
                    version: held.version.clone(),
                    resource: Some(prost_types::Any {
                        type_url: type_url.to_string(),
                        value: held.value.clone(),
                    }),
                    ..Default::default()
                });
            }
        }
        let removed: Vec<String> = sent
            .keys()
            .filter(|name| !current.contains_key(*name))
            .cloned()
            .collect();
        if resources.is_empty() && removed.is_empty() && !always {
            return None;
        }
        for r in &resources {
            sent.insert(r.name.clone(), r.version.clone());
        }
        for name in &removed {
            sent.remove(name);
        }
        self.next_nonce += 1;
        let nonce = format!("nonce-{}", self.next_nonce);
        self.responses.push(XdsResponse {
            stream: stream.id,
            type_url: type_url.to_string(),
            nonce: nonce.clone(),
            resources: resources.iter().map(|r| r.name.clone()).collect(),
            removed: removed.clone(),
        });
        let _ = stream.tx.send(Ok(DeltaDiscoveryResponse {
            system_version_info: String::new(),
            resources,
            type_url: type_url.to_string(),
            removed_resources: removed,
            nonce,
        }));
        Some(())
    }
}

/// The served service.
struct Service {
    shared: Arc<Mutex<Shared>>,
}

type ResponseStream =
    Pin<Box<dyn futures_util::Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Service {
    type DeltaAggregatedResourcesStream = ResponseStream;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let authorization = header("authorization");
        let cluster_id = header("clusterid");
        let (id, rx) = {
            let mut shared = self.shared.lock().unwrap();
            shared.next_stream += 1;
            let id = shared.next_stream;
            let refused = if shared.reject_all
                || authorization.as_deref() != Some(&format!("Bearer {}", shared.token))
            {
                Some(tonic::Code::Unauthenticated)
            } else {
                None
            };
            shared.calls.push(XdsCall {
                stream: id,
                authorization,
                cluster_id,
                refused,
            });
            if refused.is_some() {
                return Err(Status::unauthenticated("the double refuses this token"));
            }
            let (tx, rx) = mpsc::unbounded_channel();
            shared.streams.push(OpenStream {
                id,
                sent: HashMap::new(),
                tx,
            });
            (id, rx)
        };
        let mut inbound = request.into_inner();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                let received = Instant::now();
                let mut shared = shared.lock().unwrap();
                shared.requests.push(XdsRequest {
                    stream: id,
                    request: request.clone(),
                    received,
                });
                if request.response_nonce.is_empty() {
                    // A subscription: what the client holds is what it says.
                    let Some(index) = shared.streams.iter().position(|s| s.id == id) else {
                        break;
                    };
                    shared.streams[index].sent.insert(
                        request.type_url.clone(),
                        request.initial_resource_versions.clone(),
                    );
                    shared.diff(index, &request.type_url, true);
                }
            }
            shared.lock().unwrap().streams.retain(|s| s.id != id);
        });
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(outbound)))
    }
}

/// A serving thread.
struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: JoinHandle<()>,
}

/// A running delta ADS double; stops when dropped.
pub struct XdsDouble {
    /// `https://<ip>:<port>`, for the client's address.
    pub address: String,
    /// The double's root certificate (PEM), for the client's root certificates.
    pub root_pem: String,
    addr: SocketAddr,
    netns: Option<String>,
    cert_pem: String,
    key_pem: String,
    shared: Arc<Mutex<Shared>>,
    running: Option<Running>,
}

impl XdsDouble {
    /// Starts a double on `addr` (port 0: any free port) in the current network
    /// namespace, or in `netns`, accepting the bearer token `token`.
    ///
    /// # Errors
    /// Making the certificates or binding the address.
    pub fn start(netns: Option<&str>, addr: SocketAddr, token: &str) -> Result<Self> {
        let ca_key = KeyPair::generate().context("CA key")?;
        let mut ca_params = CertificateParams::default();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "xDS double root");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).context("CA certificate")?;
        let issuer = Issuer::new(ca_params, ca_key);
        let server_key = KeyPair::generate().context("server key")?;
        let mut server_params = CertificateParams::default();
        server_params.subject_alt_names = vec![SanType::IpAddress(addr.ip())];
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server_params
            .signed_by(&server_key, &issuer)
            .context("server certificate")?;
        let mut double = Self {
            address: String::new(),
            root_pem: ca_cert.pem(),
            addr,
            netns: netns.map(str::to_string),
            cert_pem: format!("{}{}", server_cert.pem(), ca_cert.pem()),
            key_pem: server_key.serialize_pem(),
            shared: Arc::new(Mutex::new(Shared {
                token: token.to_string(),
                ..Default::default()
            })),
            running: None,
        };
        double.serve()?;
        double.address = format!("https://{}", double.addr);
        Ok(double)
    }

    fn serve(&mut self) -> Result<()> {
        let addr = self.addr;
        let bind = move || {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok(l)
        };
        let listener = match &self.netns {
            Some(ns) => netns::in_netns(ns, bind),
            None => bind(),
        }
        .with_context(|| format!("binding the xDS double to {addr}"))?;
        self.addr = listener.local_addr()?;
        let identity = tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem);
        let service = AggregatedDiscoveryServiceServer::new(Service {
            shared: self.shared.clone(),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = self.shared.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a runtime for the xDS double");
            rt.block_on(async move {
                let listener =
                    tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                let server = tonic::transport::Server::builder()
                    .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                    .expect("the double's TLS settings")
                    .add_service(service)
                    .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
                tokio::select! {
                    _ = server => {}
                    _ = stopped => {}
                }
                // Every stream ends with UNAVAILABLE, as when istiod goes away.
                let streams = std::mem::take(&mut shared.lock().unwrap().streams);
                for s in streams {
                    let _ =
                        s.tx.send(Err(Status::unavailable("the xDS double stopped")));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            });
            // Dropping the runtime drops the connections' tasks: sockets closed.
            drop(rt);
        });
        self.running = Some(Running { stop, thread });
        Ok(())
    }

    /// Stops serving: streams end with `UNAVAILABLE`, connections and the listener
    /// close. Resources and records are kept.
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            let _ = running.stop.send(());
            let _ = running.thread.join();
        }
    }

    /// Serves again on the same address.
    ///
    /// # Errors
    /// Binding the address.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.serve()
    }

    /// Refuses every call with `UNAUTHENTICATED` while `reject` (then only the
    /// right token is accepted).
    pub fn reject_tokens(&self, reject: bool) {
        self.shared.lock().unwrap().reject_all = reject;
    }

    /// Sets resource `name` of `type_url` to the encoded `value`, with a new
    /// version; sent on the next [`XdsDouble::push`].
    pub fn set_raw(&self, type_url: &str, name: &str, value: Vec<u8>) {
        let mut shared = self.shared.lock().unwrap();
        shared.next_version += 1;
        let version = format!("v{}", shared.next_version);
        shared
            .resources
            .entry(type_url.to_string())
            .or_default()
            .insert(name.to_string(), Held { version, value });
    }

    /// Sets the `Address` resource `name`.
    pub fn set_address(&self, name: &str, address: &proto::workload::Address) {
        self.set_raw(proto::ADDRESS_TYPE_URL, name, address.encode_to_vec());
    }

    /// Sets the `Authorization` resource `name`.
    pub fn set_authorization(&self, name: &str, policy: &proto::security::Authorization) {
        self.set_raw(proto::AUTHORIZATION_TYPE_URL, name, policy.encode_to_vec());
    }

    /// Removes resource `name` of `type_url`; sent on the next push.
    pub fn remove(&self, type_url: &str, name: &str) {
        if let Some(held) = self.shared.lock().unwrap().resources.get_mut(type_url) {
            held.remove(name);
        }
    }

    /// Sends every open stream what changed for it (one response per type that
    /// has changes).
    pub fn push(&self) {
        let mut shared = self.shared.lock().unwrap();
        let types: Vec<String> = shared.resources.keys().cloned().collect();
        for index in 0..shared.streams.len() {
            let subscribed: Vec<String> = shared.streams[index].sent.keys().cloned().collect();
            for t in types.iter().filter(|t| subscribed.contains(t)) {
                shared.diff(index, t, false);
            }
        }
    }

    /// The versions held now of `type_url`, by name.
    pub fn versions(&self, type_url: &str) -> HashMap<String, String> {
        self.shared
            .lock()
            .unwrap()
            .resources
            .get(type_url)
            .map(|held| {
                held.iter()
                    .map(|(name, h)| (name.clone(), h.version.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The calls so far, oldest first.
    pub fn calls(&self) -> Vec<XdsCall> {
        self.shared.lock().unwrap().calls.clone()
    }

    /// The requests so far, oldest first.
    pub fn requests(&self) -> Vec<XdsRequest> {
        self.shared.lock().unwrap().requests.clone()
    }

    /// The responses so far, oldest first.
    pub fn responses(&self) -> Vec<XdsResponse> {
        self.shared.lock().unwrap().responses.clone()
    }

    /// The number of streams open.
    pub fn open_streams(&self) -> usize {
        self.shared.lock().unwrap().streams.len()
    }

    /// Waits until `done` holds of the requests so far (checked every 10 ms), at
    /// most `limit`; returns them.
    ///
    /// # Errors
    /// `done` did not hold within `limit`: the requests and responses seen.
    pub fn wait_requests(
        &self,
        limit: Duration,
        done: impl Fn(&[XdsRequest]) -> bool,
    ) -> Result<Vec<XdsRequest>> {
        let deadline = Instant::now() + limit;
        loop {
            let requests = self.requests();
            if done(&requests) {
                return Ok(requests);
            }
            if Instant::now() > deadline {
                bail!(
                    "not within {limit:?}; requests: {:#?}\nresponses: {:#?}\ncalls: {:#?}",
                    requests,
                    self.responses(),
                    self.calls()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for XdsDouble {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The arguments that make node `node`'s agent of `c` beside istiod: its
/// certificates from `ca`, its workloads, services and policies from `xds`,
/// authenticated with `token` and `cluster_id`, trusting both doubles' roots
/// and `extra_roots` (PEM), named to istiod as pod `podlink-<node>` of
/// namespace `podlink` at the node's address. Writes the roots and the token
/// into the bed's directory.
///
/// # Errors
/// When a file cannot be written.
pub fn istiod_agent_args(
    c: &crate::Cluster,
    node: usize,
    ca: &crate::ca_double::CaDouble,
    xds: &XdsDouble,
    token: &str,
    cluster_id: &str,
    extra_roots: &str,
) -> Result<Vec<String>> {
    let roots = c.dir.join("mesh-roots.pem");
    std::fs::write(
        &roots,
        format!("{}{}{extra_roots}", ca.root_pem, xds.root_pem),
    )?;
    let token_file = c.dir.join("istio-token");
    std::fs::write(&token_file, token)?;
    Ok([
        "--ca-address",
        &ca.address,
        "--ca-root-cert",
        &roots.to_string_lossy(),
        "--ca-token-file",
        &token_file.to_string_lossy(),
        "--cluster-id",
        cluster_id,
        "--xds-address",
        &xds.address,
        "--pod-name",
        &format!("podlink-{node}"),
        "--pod-namespace",
        "podlink",
        "--pod-ip",
        &c.nodes[node].ip.to_string(),
    ]
    .map(String::from)
    .to_vec())
}
