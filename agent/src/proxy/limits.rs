//! The proxy's connection limits and drain: connection slots, each source
//! address's share of them, the budget of inbound HBONE handshakes under way,
//! the listeners still open, and whether the proxy drains.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
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

/// The share no source address is held below, unless the proxy has fewer
/// slots in all: a client's connection pool of this size is served whole.
const SHARE_FLOOR: usize = 16;

/// See [`ConnectionLimits::share`].
fn share(max_connections: usize) -> usize {
    (max_connections / 4).max(max_connections.min(SHARE_FLOOR))
}

/// Connection slots held by each source address: an entry per address holding
/// at least one, so at most as many entries as slots.
#[derive(Default)]
struct Shares(Mutex<HashMap<IpAddr, usize>>);

/// One of a source address's share of the connection slots
/// ([`ConnectionLimits::take_share`]), given back when dropped.
pub(crate) struct SharePermit {
    shares: Arc<Shares>,
    addr: IpAddr,
}

impl Drop for SharePermit {
    fn drop(&mut self) {
        let mut held = self.shares.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.addr);
            }
        }
    }
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
    /// Connection slots held by each source address of the outbound and inbound
    /// plaintext listeners ([`ConnectionLimits::share`]).
    shares: Arc<Shares>,
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
            shares: Arc::default(),
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

    /// Connection slots one source address may hold at once on the outbound
    /// (15001) and inbound plaintext (15006) listeners together: a quarter of
    /// [`ProxyConfig::max_connections`], but at least 16 (all of them when there
    /// are fewer). More connections from that address are refused (reset) while
    /// other addresses are served: one pod cannot take every slot, though four
    /// together can. An address, not a pod: a dual-stack pod has a share per
    /// address, and clients behind one address (a node's, after SNAT) share one.
    /// Inbound HBONE connections come from other nodes' proxies, on behalf of
    /// many pods, and take no share.
    ///
    /// [`ProxyConfig::max_connections`]: super::ProxyConfig::max_connections
    pub fn share(&self) -> usize {
        share(self.max_connections)
    }

    /// Takes one of `addr`'s share of the connection slots ([`ConnectionLimits::share`]),
    /// until the permit is dropped; `None` when it holds its share.
    pub(crate) fn take_share(&self, addr: IpAddr) -> Option<SharePermit> {
        let mut held = self.shares.0.lock().unwrap_or_else(|e| e.into_inner());
        if held.get(&addr).is_some_and(|&n| n >= self.share()) || self.share() == 0 {
            return None;
        }
        *held.entry(addr).or_default() += 1;
        Some(SharePermit {
            shares: self.shares.clone(),
            addr,
        })
    }

    /// Connection slots `addr` holds now, of its share.
    pub fn held_by(&self, addr: IpAddr) -> usize {
        let held = self.shares.0.lock().unwrap_or_else(|e| e.into_inner());
        held.get(&addr).copied().unwrap_or(0)
    }

    /// Counts a connection refused because its source address held its share
    /// (in `metrics`, as a `share_limit` failure) and warns of it through `log`,
    /// at its bounded rate.
    pub(crate) fn refused_at_share(&self, metrics: &Metrics, log: &RateLimited, refusal: &Refusal) {
        metrics.failed(refusal.direction, FailureKind::ShareLimit);
        let Refusal { listener, peer, .. } = refusal;
        log.warn(|n| {
            format!(
                "{listener} listener: {} holds its share of {} connections (of {}); refused {n} from it and others over their share",
                peer.ip(),
                self.share(),
                self.max_connections
            )
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A quarter of the slots, at least 16, never more than all of them.
    #[test]
    fn the_share_is_a_quarter_with_a_floor() {
        for (max, want) in [
            (0, 0),
            (1, 1),
            (8, 8),
            (16, 16),
            (40, 16),
            (64, 16),
            (100, 25),
            (30_000, 7_500),
        ] {
            assert_eq!(ConnectionLimits::new(max).share(), want, "{max} slots");
        }
    }

    /// An address is refused beyond its share while others take theirs; a
    /// dropped permit is given back, and an address holding none has no entry.
    #[test]
    fn each_address_holds_at_most_its_share() {
        let limits = ConnectionLimits::new(64);
        let a: IpAddr = "10.244.1.5".parse().unwrap();
        let b: IpAddr = "fd00::5".parse().unwrap();
        let mut held: Vec<_> = (0..16)
            .map(|i| limits.take_share(a).unwrap_or_else(|| panic!("permit {i}")))
            .collect();
        assert!(limits.take_share(a).is_none(), "a 17th for one address");
        assert_eq!(limits.held_by(a), 16);
        let other = limits.take_share(b).expect("another address is served");
        assert_eq!(limits.held_by(b), 1);
        held.pop();
        assert_eq!(limits.held_by(a), 15);
        held.push(limits.take_share(a).expect("a permit given back"));
        drop(held);
        drop(other);
        assert_eq!((limits.held_by(a), limits.held_by(b)), (0, 0));
        assert!(limits.shares.0.lock().unwrap().is_empty());
    }

    /// Refusals at the share are counted as `share_limit`.
    #[test]
    fn refusals_at_the_share_are_counted() {
        let limits = ConnectionLimits::new(4);
        let metrics = Metrics::new("Kubernetes");
        let refusal = Refusal {
            listener: "outbound",
            direction: Direction::Outbound,
            peer: "10.244.1.5:40000".parse().unwrap(),
            after_handshakes: false,
        };
        limits.refused_at_share(&metrics, &RateLimited::default(), &refusal);
        assert_eq!(
            metrics.failures(Direction::Outbound, FailureKind::ShareLimit),
            1
        );
        assert_eq!(
            metrics.failures(Direction::Outbound, FailureKind::ConnectionLimit),
            0
        );
    }
}
