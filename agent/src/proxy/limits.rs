//! The proxy's connection limits and drain: connection slots, the budget of
//! inbound HBONE handshakes under way, the listeners still open, and whether
//! the proxy drains.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::telemetry::{
    logging::RateLimited,
    metrics::{Direction, FailureKind, Metrics},
};

/// The budget an accepted connection takes a permit from before it is handled.
#[derive(Clone, Copy)]
pub(crate) enum Budget {
    /// A connection slot ([`ProxyConfig::max_connections`]), held until the
    /// connection ends.
    ///
    /// [`ProxyConfig::max_connections`]: super::ProxyConfig::max_connections
    Connection,
    /// A handshake permit ([`ConnectionLimits::max_handshakes`]), which the
    /// handler trades for a connection slot once the handshakes succeed (inbound
    /// HBONE).
    Handshake,
}

/// A connection refused at a limit, for [`ConnectionLimits::refused_at_limit`].
pub(crate) struct Refusal {
    /// The listener that accepted it ("outbound", "inbound HBONE", …).
    pub listener: &'static str,
    pub direction: Direction,
    pub peer: SocketAddr,
    /// Refused once its TLS and HTTP/2 handshakes succeeded, not at accept.
    pub after_handshakes: bool,
}

/// See [`ConnectionLimits::max_handshakes`].
fn max_handshakes(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}

/// The proxy's connection slots and handshake budget, its open listeners, and
/// its drain.
pub struct ConnectionLimits {
    /// Connection slots in all ([`ProxyConfig::max_connections`]).
    ///
    /// [`ProxyConfig::max_connections`]: super::ProxyConfig::max_connections
    max_connections: usize,
    /// Set once the agent drains: the listeners finish their queue and close,
    /// inbound HBONE connections are sent GOAWAY.
    draining: watch::Sender<bool>,
    /// Listeners not yet closed.
    listeners_open: AtomicUsize,
    /// One permit per accepted connection and per inbound HBONE stream (each
    /// holds a socket or two): bounds the file descriptors clients can make the
    /// proxy hold.
    connections: Arc<Semaphore>,
    /// One permit per inbound HBONE connection whose TLS and HTTP/2 handshakes
    /// are under way ([`ConnectionLimits::max_handshakes`]). Such connections
    /// take no connection permit until their handshakes succeed, so that clients
    /// which never finish one cannot use up the connections of every listener.
    handshakes: Arc<Semaphore>,
}

impl ConnectionLimits {
    /// `max_connections` slots, a quarter as many handshakes, not draining.
    pub fn new(max_connections: usize) -> Self {
        Self {
            max_connections,
            draining: watch::Sender::new(false),
            listeners_open: AtomicUsize::new(0),
            connections: Arc::new(Semaphore::new(max_connections)),
            handshakes: Arc::new(Semaphore::new(max_handshakes(max_connections))),
        }
    }

    /// Starts draining: the listeners accept what is queued on them and close
    /// (the programs already hand them nothing new: [`Dataplane::set_draining`]),
    /// inbound HBONE connections are sent GOAWAY so that they close once their
    /// streams end. Open connections go on.
    ///
    /// [`Dataplane::set_draining`]: crate::dataplane::Dataplane::set_draining
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    /// Resolves once the proxy drains (at once if it does).
    pub async fn draining(&self) {
        let mut rx = self.draining.subscribe();
        // The sender lives as long as `self`.
        let _ = rx.wait_for(|draining| *draining).await;
    }

    /// Listeners still open: 0 once a draining proxy has closed them all.
    pub fn listeners_open(&self) -> usize {
        self.listeners_open.load(Ordering::Relaxed)
    }

    /// Counts a listener as open, until [`ConnectionLimits::listener_closed`].
    pub(crate) fn listener_opened(&self) {
        self.listeners_open.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a listener as closed.
    pub(crate) fn listener_closed(&self) {
        self.listeners_open.fetch_sub(1, Ordering::Relaxed);
    }

    /// Inbound HBONE handshakes under way at once: a quarter of
    /// [`ProxyConfig::max_connections`], at least one. More are refused (reset).
    ///
    /// [`ProxyConfig::max_connections`]: super::ProxyConfig::max_connections
    pub fn max_handshakes(&self) -> usize {
        max_handshakes(self.max_connections)
    }

    /// Counts a connection refused because `budget` had no permit left (in
    /// `metrics`, as a `connection_limit` or `handshake_limit` failure) and warns
    /// of it through `log`, at its bounded rate.
    pub(crate) fn refused_at_limit(
        &self,
        metrics: &Metrics,
        log: &RateLimited,
        budget: Budget,
        refusal: &Refusal,
    ) {
        let kind = match budget {
            Budget::Connection => FailureKind::ConnectionLimit,
            Budget::Handshake => FailureKind::HandshakeLimit,
        };
        metrics.failed(refusal.direction, kind);
        let Refusal {
            listener,
            peer,
            after_handshakes,
            ..
        } = refusal;
        // Worded only when the warning is given, not for each refusal.
        log.warn(|n| {
            let limit = match budget {
                Budget::Connection => format!("{} connections", self.max_connections),
                Budget::Handshake => format!("{} handshakes under way", self.max_handshakes()),
            };
            let when = if *after_handshakes {
                " after its handshakes"
            } else {
                ""
            };
            format!("{listener} listener: at the limit of {limit}; refused {n} (from {peer} and others){when}")
        });
    }

    /// Takes a permit for an inbound HBONE handshake; `None` at the limit.
    pub(crate) fn start_handshake(&self) -> Option<OwnedSemaphorePermit> {
        self.handshakes.clone().try_acquire_owned().ok()
    }

    /// Connections open now: accepted downstream connections (inbound HBONE
    /// connections whose handshakes succeeded included) and inbound HBONE streams.
    pub fn open_connections(&self) -> usize {
        self.max_connections
            .saturating_sub(self.connections.available_permits())
    }

    /// Takes one of the proxy's connection slots for an upstream connection, if
    /// one is free.
    pub fn connection_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.connections.clone().try_acquire_owned().ok()
    }
}
