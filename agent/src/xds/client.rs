//! The stream to istiod: opening it, answering responses, reopening it.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use prost::Message;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::{
    ConnectionState, Handler, Refused, ResourceType, XdsConfig, XdsError, XdsMetrics, nack_message,
    proto::{
        discovery::{
            DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
            aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
        },
        rpc,
    },
};
use crate::istiod;

/// The largest response accepted (ztunnel's bound: a cluster's whole state comes
/// in the first response of a stream).
const MAX_RESPONSE_BYTES: usize = 200 * 1024 * 1024;
/// HTTP/2 PINGs on an idle stream, to notice an istiod gone without a word.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// Time allowed for a PING's answer.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// `error_detail.code` of a NACK: `INVALID_ARGUMENT` (istiod reads only that the
/// field is set, and logs the message).
const NACK_CODE: i32 = tonic::Code::InvalidArgument as i32;

/// The versions of the resources held (applied and not removed), by type and
/// name: sent as `initial_resource_versions` on a new stream.
#[derive(Clone, Debug, Default)]
pub struct Held {
    versions: [HashMap<String, String>; 2],
}

impl Held {
    /// Names and versions held of type `t`.
    pub fn versions(&self, t: ResourceType) -> &HashMap<String, String> {
        &self.versions[t.index()]
    }
}

/// What became of one response.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// The response's type, if it is one subscribed to.
    pub resource_type: Option<ResourceType>,
    /// The ACK, or the NACK (`error_detail` set).
    pub request: DeltaDiscoveryRequest,
    /// The resources refused, in the response's order: undecodable first, then
    /// those the handler refused.
    pub refused: Vec<Refused>,
}

impl Answer {
    /// Whether it is an ACK.
    pub fn is_ack(&self) -> bool {
        self.request.error_detail.is_none()
    }
}

/// Decodes `response`'s resources, hands them and the removed names to `handler`,
/// updates `held`, and returns the answer to send: an ACK of its nonce, or a NACK
/// naming every resource refused (see [`super::nack_message`]). A response of a
/// type not subscribed to is NACKed whole, the handler not called.
pub fn handle_response<H: Handler + ?Sized>(
    held: &mut Held,
    handler: &mut H,
    response: DeltaDiscoveryResponse,
) -> Answer {
    let DeltaDiscoveryResponse {
        resources,
        type_url,
        removed_resources,
        nonce,
        ..
    } = response;
    let answer = |refused: Vec<Refused>, resource_type| Answer {
        resource_type,
        request: DeltaDiscoveryRequest {
            type_url: type_url.clone(),
            response_nonce: nonce.clone(),
            error_detail: (!refused.is_empty()).then(|| rpc::Status {
                code: NACK_CODE,
                message: nack_message(&refused),
                details: Vec::new(),
            }),
            ..Default::default()
        },
        refused,
    };
    let Some(t) = ResourceType::of_url(&type_url) else {
        return answer(
            vec![Refused::new(
                format!("(type {type_url:?})"),
                "a type not subscribed to",
            )],
            None,
        );
    };
    let (versions, mut refused, handler_refused) = match t {
        ResourceType::Address => {
            let (versions, updated, refused) = decode(t, resources);
            (
                versions,
                refused,
                handler.addresses(updated, removed_resources.clone()),
            )
        }
        ResourceType::Authorization => {
            let (versions, updated, refused) = decode(t, resources);
            (
                versions,
                refused,
                handler.authorizations(updated, removed_resources.clone()),
            )
        }
    };
    let held = &mut held.versions[t.index()];
    let not_applied: HashSet<&str> = handler_refused.iter().map(|r| r.name.as_str()).collect();
    for (name, version) in versions {
        if !not_applied.contains(name.as_str()) {
            held.insert(name, version);
        }
    }
    for name in &removed_resources {
        held.remove(name);
    }
    refused.extend(handler_refused);
    answer(refused, Some(t))
}

/// Decodes resources of type `t`: their names and versions, the decoded ones
/// (name, message), and those refused.
#[allow(clippy::type_complexity)]
fn decode<M: Message + Default>(
    t: ResourceType,
    resources: Vec<Resource>,
) -> (Vec<(String, String)>, Vec<(String, M)>, Vec<Refused>) {
    let mut versions = Vec::new();
    let mut decoded = Vec::new();
    let mut refused = Vec::new();
    for resource in resources {
        let Some(any) = resource.resource else {
            refused.push(Refused::new(resource.name, "no resource in it"));
            continue;
        };
        if !any.type_url.is_empty() && any.type_url != t.type_url() {
            refused.push(Refused::new(
                resource.name,
                format!("a {} in a response of {}", any.type_url, t.type_url()),
            ));
            continue;
        }
        match M::decode(any.value.as_slice()) {
            Ok(message) => {
                versions.push((resource.name.clone(), resource.version));
                decoded.push((resource.name, message));
            }
            Err(e) => refused.push(Refused::new(resource.name, format!("does not decode: {e}"))),
        }
    }
    (versions, decoded, refused)
}

/// A client of istiod's workload xDS; [`XdsClient::run`] keeps a stream open.
pub struct XdsClient {
    config: XdsConfig,
    host: String,
    metrics: XdsMetrics,
    held: Held,
    acked: [bool; 2],
    ready: watch::Sender<bool>,
}

impl std::fmt::Debug for XdsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdsClient")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// How a stream ended.
struct Ended {
    /// Whether istiod answered the call.
    up: bool,
    /// Whether a response was received.
    received: bool,
    /// Why it ended.
    why: String,
}

impl XdsClient {
    /// A client for `config`, counting in `metrics`; nothing is connected yet.
    ///
    /// # Errors
    /// [`XdsError::Address`] unless the address is `https://host:port`.
    pub fn new(config: XdsConfig, metrics: XdsMetrics) -> Result<Self, XdsError> {
        let host = istiod::host_of(&config.address).map_err(|what| XdsError::Address {
            address: config.address.clone(),
            what,
        })?;
        Ok(Self {
            config,
            host,
            metrics,
            held: Held::default(),
            acked: [false; 2],
            ready: watch::Sender::new(false),
        })
    }

    /// Becomes `true` once a response of each type was answered (ACKed or NACKed), and stays so (what
    /// was received stays applied while istiod is unreachable).
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Keeps a stream to istiod open, handing what it pushes to `handler`, until
    /// the task is dropped; never returns.
    pub async fn run<H: Handler>(mut self, mut handler: H) {
        let mut failures = 0u32;
        let mut streams = 0u64;
        // Whether the loss (or the failure to connect) was reported since the
        // last stream was up.
        let mut reported = false;
        loop {
            let ended = self.stream(&mut handler, &mut streams, &mut reported).await;
            if ended.up {
                self.metrics.set_connected(false);
            }
            if !reported {
                if ended.up {
                    warn!(address = %self.config.address, "workload xDS stream to istiod lost: {}; reconnecting", ended.why);
                } else {
                    warn!(address = %self.config.address, "cannot open a workload xDS stream to istiod: {}; retrying", ended.why);
                }
                handler.connection(&ConnectionState::Lost { why: ended.why });
                reported = true;
            } else {
                debug!(address = %self.config.address, "workload xDS: {}; retrying", ended.why);
            }
            if ended.up && ended.received {
                failures = 0;
            }
            let delay = self.config.backoff.delay(failures, fastrand::f64());
            failures = failures.saturating_add(1);
            tokio::time::sleep(delay).await;
        }
    }

    /// The first request of a stream for type `t`.
    fn subscription(&self, t: ResourceType) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            node: Some(self.config.node.node(&self.config.cluster_id)),
            type_url: t.type_url().to_string(),
            initial_resource_versions: self.held.versions(t).clone(),
            ..Default::default()
        }
    }

    /// Opens a stream and answers its responses until it ends.
    async fn stream<H: Handler>(
        &mut self,
        handler: &mut H,
        streams: &mut u64,
        reported: &mut bool,
    ) -> Ended {
        let failed = |why: String| Ended {
            up: false,
            received: false,
            why,
        };
        let config = &self.config;
        let roots = match std::fs::read(&config.root_cert) {
            Ok(roots) => roots,
            Err(e) => {
                return failed(format!(
                    "reading the mesh root certificates {}: {e}",
                    config.root_cert.display()
                ));
            }
        };
        let token = match istiod::read_token(&config.token_file) {
            Ok(token) => token,
            Err(e) => {
                return failed(format!(
                    "reading the token file {}: {e}",
                    config.token_file.display()
                ));
            }
        };
        let endpoint = match istiod::endpoint(&config.address, &self.host, &roots) {
            Ok(endpoint) => endpoint
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true),
            Err(e) => return failed(e),
        };
        let channel = match endpoint.connect().await {
            Ok(channel) => channel,
            Err(e) => return failed(format!("connecting: {}", istiod::error_chain(&e))),
        };
        let (requests, outbound) = mpsc::unbounded_channel();
        for t in ResourceType::ALL {
            let subscription = self.subscription(t);
            debug!(
                type_url = subscription.type_url,
                held = subscription.initial_resource_versions.len(),
                "subscribing"
            );
            let _ = requests.send(subscription);
        }
        let outbound = futures_util::stream::unfold(outbound, |mut outbound| async move {
            outbound.recv().await.map(|request| (request, outbound))
        });
        let mut request = tonic::Request::new(outbound);
        if let Err(e) =
            istiod::insert_credentials(request.metadata_mut(), &token, &self.config.cluster_id)
        {
            return failed(match e {
                istiod::MetadataError::Token => format!(
                    "the token in {} is not a valid header value",
                    self.config.token_file.display()
                ),
                istiod::MetadataError::ClusterId => {
                    "the cluster ID is not a valid header value".into()
                }
            });
        }
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_RESPONSE_BYTES);
        let mut inbound = match client.delta_aggregated_resources(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return failed(status_why(&status)),
        };
        *streams += 1;
        if *streams > 1 {
            self.metrics.reconnected();
        }
        self.metrics.set_connected(true);
        if *reported {
            info!(address = %self.config.address, "workload xDS stream to istiod open again");
        } else {
            info!(address = %self.config.address, "workload xDS stream to istiod open");
        }
        *reported = false;
        handler.connection(&ConnectionState::Connected {
            address: self.config.address.clone(),
        });
        let mut received = false;
        let why = loop {
            let response = match inbound.message().await {
                Ok(Some(response)) => response,
                Ok(None) => break "istiod ended the stream".to_string(),
                Err(status) => break status_why(&status),
            };
            received = true;
            let nonce = response.nonce.clone();
            let answer = handle_response(&mut self.held, handler, response);
            if let Some(t) = answer.resource_type {
                self.metrics
                    .pushed(t, !answer.is_ack(), self.held.versions(t).len());
                // A response answered (ACK, or NACK of some of its resources,
                // the others applied) counts: one bad resource must not keep
                // the agent unready.
                if !self.acked[t.index()] {
                    self.acked[t.index()] = true;
                    if self.acked.iter().all(|a| *a) {
                        info!("workload xDS: both types received and answered: ready");
                        self.ready.send_replace(true);
                    }
                }
            }
            match &answer.request.error_detail {
                Some(detail) => warn!(
                    type_url = answer.request.type_url,
                    nonce, "workload xDS: NACK: {}", detail.message
                ),
                None => debug!(
                    type_url = answer.request.type_url,
                    nonce, "workload xDS: ACK"
                ),
            }
            if requests.send(answer.request).is_err() {
                break "the request stream closed".to_string();
            }
        };
        Ended {
            up: true,
            received,
            why,
        }
    }
}

/// A gRPC status as a reason: `Unauthenticated: <message>`.
fn status_why(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), istiod::status_text(status))
}
