//! The proxy's connection limits and drain: connection slots, the budget of
//! inbound HBONE handshakes under way, each client address's share of them
//! (of the outbound and inbound plaintext listeners' slots; of the HBONE
//! listener's slots and handshakes), the listeners still open, and whether the
//! proxy drains.

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

/// The share no source address of the outbound and inbound plaintext
/// listeners is held below, unless the proxy has fewer slots in all: a
/// client's connection pool of this size is served whole.
const SHARE_FLOOR: usize = 16;

/// See [`ConnectionLimits::share`].
fn share(max_connections: usize) -> usize {
    (max_connections / 4).max(max_connections.min(SHARE_FLOOR))
}

/// What one HBONE client address may hold of a budget: a quarter of it, at
/// least one. One address (a client pod, a node) cannot take the whole budget;
/// it takes four to.
pub(crate) fn peer_share(budget: usize) -> usize {
    (budget / 4).max(1)
}

/// The parts of a budget each client address holds, each at most `share`.
/// Only addresses holding a part have an entry, so the map holds at most as
/// many entries as the budget has permits.
pub(crate) struct PeerShares {
    /// The most one address may hold.
    share: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One part of an address's share ([`PeerShares::take`]), given back when dropped.
pub(crate) struct PeerPart {
    shares: Arc<PeerShares>,
    peer: IpAddr,
}

impl PeerShares {
    /// Shares of at most `share` parts per address.
    pub(crate) fn new(share: usize) -> Arc<Self> {
        Arc::new(Self {
            share,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The most one address may hold.
    pub(crate) fn share(&self) -> usize {
        self.share
    }

    /// Takes one part of `peer`'s share; `None` when it holds its whole share.
    pub(crate) fn take(self: &Arc<Self>, peer: IpAddr) -> Option<PeerPart> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let parts = held.entry(peer).or_default();
        if *parts >= self.share {
            if *parts == 0 {
                held.remove(&peer);
            }
            return None;
        }
        *parts += 1;
        Some(PeerPart {
            shares: self.clone(),
            peer,
        })
    }

    /// Parts `peer` holds now.
    pub(crate) fn held(&self, peer: IpAddr) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(&peer).copied().unwrap_or(0)
    }

    /// Addresses holding a part now.
    #[cfg(test)]
    fn peers(&self) -> usize {
        self.held.lock().unwrap().len()
    }
}

impl Drop for PeerPart {
    fn drop(&mut self) {
        let mut held = self.shares.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(parts) = held.get_mut(&self.peer) {
            *parts -= 1;
            if *parts == 0 {
                held.remove(&self.peer);
            }
        }
    }
}

/// Which of a client address's shares was full, for
/// [`ConnectionLimits::refused_over_share`].
#[derive(Clone, Copy)]
pub(crate) enum Share {
    /// Its share of the handshakes under way ([`ConnectionLimits::peer_handshakes`]).
    Handshakes,
    /// Its share of the connection slots ([`ConnectionLimits::peer_connections`]).
    Connections,
    /// A source address's share of the outbound and inbound plaintext
    /// listeners' slots ([`ConnectionLimits::share`]).
    Slots,
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
    /// Each HBONE client address's share of `handshakes`
    /// ([`ConnectionLimits::peer_handshakes`]).
    peer_handshakes: Arc<PeerShares>,
    /// Each HBONE client address's share of `connections`: its HBONE
    /// connections and their streams ([`ConnectionLimits::peer_connections`]).
    peer_connections: Arc<PeerShares>,
    /// Each source address's share of `connections` on the outbound and
    /// inbound plaintext listeners ([`ConnectionLimits::share`]).
    shares: Arc<PeerShares>,
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
            peer_handshakes: PeerShares::new(peer_share(max_handshakes(max_connections))),
            peer_connections: PeerShares::new(peer_share(max_connections)),
            shares: PeerShares::new(share(max_connections)),
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
    /// Inbound HBONE takes from its own shares
    /// ([`ConnectionLimits::peer_connections`]).
    ///
    /// [`ProxyConfig::max_connections`]: super::ProxyConfig::max_connections
    pub fn share(&self) -> usize {
        share(self.max_connections)
    }

    /// Takes one of `addr`'s share of the connection slots ([`ConnectionLimits::share`]),
    /// until the permit is dropped; `None` when it holds its share.
    pub(crate) fn take_share(&self, addr: IpAddr) -> Option<PeerPart> {
        self.shares.take(addr)
    }

    /// Connection slots `addr` holds now, of its share.
    pub fn held_by(&self, addr: IpAddr) -> usize {
        self.shares.held(addr)
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

    /// Inbound HBONE handshakes under way at once from one client address: a
    /// quarter of [`ConnectionLimits::max_handshakes`], at least one. More are
    /// refused (reset) while the budget still has room for other addresses.
    pub fn peer_handshakes(&self) -> usize {
        self.peer_handshakes.share()
    }

    /// Connection slots one inbound HBONE client address holds at once (its
    /// HBONE connections once their handshakes succeeded, and their streams): a
    /// quarter of [`ProxyConfig::max_connections`], at least one. Over it, a
    /// connection is refused after its handshakes, a stream answered 503.
    ///
    /// [`ProxyConfig::max_connections`]: super::ProxyConfig::max_connections
    pub fn peer_connections(&self) -> usize {
        self.peer_connections.share()
    }

    /// Takes one of `peer`'s share of the handshakes under way; `None` when it
    /// has its share under way.
    pub(crate) fn peer_handshake(&self, peer: IpAddr) -> Option<PeerPart> {
        self.peer_handshakes.take(peer)
    }

    /// Takes one of `peer`'s share of the connection slots (held beside the
    /// slot itself); `None` when it holds its share.
    pub(crate) fn peer_connection(&self, peer: IpAddr) -> Option<PeerPart> {
        self.peer_connections.take(peer)
    }

    /// Connection slots `peer` holds on the HBONE listener now.
    pub fn peer_connections_held(&self, peer: IpAddr) -> usize {
        self.peer_connections.held(peer)
    }

    /// Counts a connection refused because its client address had its `share`
    /// (in `metrics`, as a `handshake_limit`, `connection_limit` or
    /// `share_limit` failure) and warns of it through `log`, at its bounded
    /// rate.
    pub(crate) fn refused_over_share(
        &self,
        metrics: &Metrics,
        log: &RateLimited,
        share: Share,
        refusal: &Refusal,
    ) {
        let kind = match share {
            Share::Handshakes => FailureKind::HandshakeLimit,
            Share::Connections => FailureKind::ConnectionLimit,
            Share::Slots => FailureKind::ShareLimit,
        };
        metrics.failed(refusal.direction, kind);
        let Refusal {
            listener,
            peer,
            after_handshakes,
            ..
        } = refusal;
        log.warn(|n| {
            let limit = match share {
                Share::Slots => {
                    return format!(
                        "{listener} listener: {} holds its share of {} connections (of {}); refused {n} from it and others over their share",
                        peer.ip(),
                        self.share(),
                        self.max_connections
                    );
                }
                Share::Handshakes => {
                    format!("{} handshakes under way", self.peer_handshakes())
                }
                Share::Connections => format!("{} connections", self.peer_connections()),
            };
            let when = if *after_handshakes {
                " after its handshakes"
            } else {
                ""
            };
            format!(
                "{listener} listener: {} is at its share of {limit}; refused {n} (from it and others){when}",
                peer.ip()
            )
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

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// An address takes up to its share; others take theirs meanwhile; a part
    /// given back can be taken again; an address holding nothing leaves no entry.
    #[test]
    fn each_address_takes_at_most_its_share() {
        let shares = PeerShares::new(2);
        let (a, b) = (ip("10.0.0.1"), ip("fd00::1"));
        let first = shares.take(a).unwrap();
        let second = shares.take(a).unwrap();
        assert!(shares.take(a).is_none(), "a third part over a share of 2");
        assert_eq!(shares.held(a), 2);
        let other = shares.take(b).expect("another address has its own share");
        assert_eq!(shares.held(b), 1);
        drop(first);
        assert_eq!(shares.held(a), 1);
        let again = shares.take(a).expect("a part given back is taken again");
        drop((second, again, other));
        assert_eq!((shares.held(a), shares.held(b)), (0, 0));
        assert_eq!(shares.peers(), 0, "addresses holding nothing are forgotten");
    }

    /// Shares are a quarter of their budget, at least one; one address cannot
    /// take the whole handshake budget or all connection slots, and its parts
    /// are over and above the budget's own permits (both are taken).
    #[test]
    fn shares_are_a_quarter_of_the_budgets() {
        assert_eq!(peer_share(0), 1);
        assert_eq!(peer_share(3), 1);
        assert_eq!(peer_share(8), 2);
        assert_eq!(peer_share(1000), 250);
        let limits = ConnectionLimits::new(1000);
        assert_eq!(limits.max_handshakes(), 250);
        assert_eq!(limits.peer_handshakes(), 62);
        assert_eq!(limits.peer_connections(), 250);

        let peer = ip("10.0.0.9");
        let handshakes: Vec<_> = (0..62).map_while(|_| limits.peer_handshake(peer)).collect();
        assert_eq!(handshakes.len(), 62);
        assert!(limits.peer_handshake(peer).is_none());
        assert!(limits.peer_handshake(ip("10.0.0.10")).is_some());
        let slots: Vec<_> = (0..300)
            .map_while(|_| limits.peer_connection(peer))
            .collect();
        assert_eq!(slots.len(), 250);
        assert_eq!(limits.peer_connections_held(peer), 250);
        drop(slots);
        assert_eq!(limits.peer_connections_held(peer), 0);
        // The shares take nothing of the budgets themselves.
        assert_eq!(limits.open_connections(), 0);
    }

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
        assert_eq!(limits.shares.peers(), 0);
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
        limits.refused_over_share(&metrics, &RateLimited::default(), Share::Slots, &refusal);
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
