//! Pooled HBONE connections, multiplexing CONNECT streams.
//!
//! HTTP/2 connections are pooled per (source identity, source address, destination
//! identity, destination address): the outer connection is bound to the source pod's
//! address, and the server checks that address against the client certificate, so
//! the source address belongs to the key as it does in ztunnel's pool.
//!
//! Each proxy thread ([`set_thread`]) has connections of its own: a connection's
//! task runs on the thread that made it, so the streams of the connections a
//! thread carries never hand a chunk to another thread. A key has one
//! connection per thread, and a further one when each is at the peer's limit
//! of concurrent streams (a new CONNECT never waits for an open one to end); a
//! new stream goes to the connection with the fewest streams that has room.
//! Each connection is made once at a time; concurrent requests for it wait and
//! then share it. Connections unused for [`IDLE_TIMEOUT`] are released (open
//! streams keep them alive until they end).

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::client::SendRequest;
use http::{HeaderValue, StatusCode};
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use super::{
    hbone::{self, ActiveStream, H2Stream},
    socket,
};
use crate::identity::{self, CertManager, SpiffeId};

/// How long an unused connection stays pooled.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The identity of a pooled connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// The source workload's identity (the client certificate).
    pub src_id: SpiffeId,
    /// The source pod's address (the outer connection's source).
    pub src_ip: IpAddr,
    /// The destination workload's identity (required of the server).
    pub dst_id: SpiffeId,
    /// The destination's HBONE address (`pod ip:15008`, `[pod ip]:15008` for
    /// IPv6), of the source's family: connections of the two families never
    /// share a key.
    pub dst: SocketAddr,
}

/// Why an HBONE stream could not be opened; each names the peer.
#[derive(Debug, thiserror::Error)]
pub enum HboneError {
    #[error("connecting to {dst}: {source}")]
    /// The TCP connection to the peer's HBONE port failed.
    Connect {
        /// The peer's HBONE address.
        dst: SocketAddr,
        /// The socket error.
        source: std::io::Error,
    },
    #[error("TLS handshake with {dst} (expecting {id}): {source}")]
    /// The TLS handshake failed (including identity checks).
    Tls {
        /// The peer's HBONE address.
        dst: SocketAddr,
        /// The identity required of the peer.
        id: SpiffeId,
        /// The handshake error.
        source: std::io::Error,
    },
    #[error(transparent)]
    /// No certificate for the source identity.
    Identity(#[from] identity::Error),
    #[error("HTTP/2 with {dst}: {source}")]
    /// An HTTP/2 error.
    H2 {
        /// The peer's HBONE address.
        dst: SocketAddr,
        /// h2's error.
        source: h2::Error,
    },
    #[error("{dst} answered CONNECT {target} with {status}")]
    /// The peer answered the CONNECT with an error status.
    Status {
        /// The peer's HBONE address.
        dst: SocketAddr,
        /// The CONNECT target.
        target: SocketAddr,
        /// The status the peer answered.
        status: StatusCode,
    },
}

impl HboneError {
    /// Whether the peer reset the connection before the tunnel opened (its agent
    /// stopping with connections still in its listener's queue, or going away
    /// during the handshakes): nothing was processed, so a new dial may be made.
    pub fn peer_restarting(&self) -> bool {
        use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, UnexpectedEof};
        match self {
            HboneError::Connect { source, .. } | HboneError::Tls { source, .. } => {
                matches!(
                    source.kind(),
                    ConnectionReset | ConnectionAborted | UnexpectedEof
                )
            }
            HboneError::H2 { source, .. } => source.is_io() || source.is_go_away(),
            HboneError::Identity(_) | HboneError::Status { .. } => false,
        }
    }
}

struct Connection {
    sender: SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
    last_used: Instant,
}

/// A place for one pooled connection of a key.
struct Slot {
    /// The connection: made at first use, made again once it closed.
    conn: tokio::sync::Mutex<Option<Connection>>,
    /// Streams open on it or being opened.
    streams: Arc<AtomicUsize>,
    /// The streams the peer lets it open at once (its
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`, RFC 9113 §6.5.2), as last seen; a
    /// podlink peer's until the connection is made.
    max_streams: AtomicUsize,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            conn: tokio::sync::Mutex::default(),
            streams: Arc::default(),
            max_streams: AtomicUsize::new(hbone::MAX_CONCURRENT_STREAMS as usize),
        }
    }
}

impl Slot {
    /// Whether its streams reach what the peer allows: a new stream would
    /// wait for one of them to end.
    fn is_full(&self) -> bool {
        self.streams.load(Ordering::Relaxed) >= self.max_streams.load(Ordering::Relaxed)
    }
}

/// A proxy thread ([`set_thread`]) and a key: its connections for the key.
type ThreadKey = (usize, PoolKey);

/// The pool.
#[derive(Default)]
pub struct Pool {
    slots: Mutex<HashMap<ThreadKey, Vec<Arc<Slot>>>>,
}

thread_local! {
    /// The proxy thread this one is ([`set_thread`]); 0 elsewhere.
    static THREAD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Names the calling thread as proxy thread `index`: the streams it opens use
/// its own connections, whose frames and TLS records are then handled on it
/// (a connection's task runs on the runtime that made it).
pub fn set_thread(index: usize) {
    THREAD.with(|t| t.set(index));
}

impl Pool {
    /// The slot a new stream for `key` goes to, counted in it from now on: the
    /// one with the fewest streams, never a full one ([`Slot::is_full`]): when
    /// every slot is full (or there is none) a new one is added.
    fn pick(&self, key: &PoolKey) -> (Arc<Slot>, ActiveStream) {
        let mut slots = self.slots.lock().expect("pool lock");
        let list = slots
            .entry((THREAD.with(std::cell::Cell::get), key.clone()))
            .or_default();
        let least = list
            .iter()
            .filter(|slot| !slot.is_full())
            .min_by_key(|slot| slot.streams.load(Ordering::Relaxed));
        let slot = match least {
            Some(slot) => slot.clone(),
            None => {
                let slot = Arc::new(Slot::default());
                list.push(slot.clone());
                slot
            }
        };
        let counted = ActiveStream::new(slot.streams.clone());
        (slot, counted)
    }

    /// Opens a CONNECT stream to `target` over the pooled connection for `key`,
    /// making the connection if there is none (or it closed); the request
    /// carries the client workload's `baggage` if given.
    ///
    /// # Errors
    /// [`HboneError`] for connection, TLS, HTTP/2 failures and non-200 answers.
    pub async fn connect(
        &self,
        key: &PoolKey,
        target: SocketAddr,
        baggage: Option<&HeaderValue>,
        certs: &CertManager,
        mark: u32,
    ) -> Result<H2Stream, HboneError> {
        let (slot, counted) = self.pick(key);
        let h2_err = |source| HboneError::H2 {
            dst: key.dst,
            source,
        };
        // A pooled connection may be dying (closed, or going away after a GOAWAY):
        // the request was then not processed, so it is retried on a new one. Twice:
        // a peer that is draining may accept the first new connection from its
        // backlog and send it away too; the next one waits (SYN retry) for the
        // peer's next agent.
        let mut attempts = 3;
        loop {
            attempts -= 1;
            let (sender, closed) = {
                let mut guard = slot.conn.lock().await;
                match guard.as_mut() {
                    Some(conn) if !conn.closed.load(Ordering::Acquire) => {
                        conn.last_used = Instant::now();
                        (conn.sender.clone(), conn.closed.clone())
                    }
                    _ => {
                        let conn = match Self::dial(key, certs, mark).await {
                            Ok(conn) => conn,
                            // A peer whose agent is stopping resets the
                            // connections left in its listener's queue: the next
                            // dial waits (SYN retry) for its next agent.
                            Err(e) if attempts > 0 && e.peer_restarting() => {
                                tracing::debug!(dst = %key.dst, "HBONE dial reset ({e}); dialling again");
                                continue;
                            }
                            Err(e) => return Err(e),
                        };
                        let pair = (conn.sender.clone(), conn.closed.clone());
                        *guard = Some(conn);
                        pair
                    }
                }
            };
            let retryable = |e: &h2::Error| {
                e.is_go_away() || e.reason() == Some(h2::Reason::REFUSED_STREAM) || e.is_io()
            };
            let mut sender = match sender.ready().await {
                Ok(sender) => {
                    slot.max_streams
                        .store(sender.current_max_send_streams(), Ordering::Relaxed);
                    sender
                }
                Err(e) if attempts > 0 => {
                    tracing::debug!(dst = %key.dst, "pooled HBONE connection is gone: {e}");
                    closed.store(true, Ordering::Release);
                    continue;
                }
                Err(e) => return Err(h2_err(e)),
            };
            let sent =
                sender.send_request(hbone::connect_request(target, key.src_ip, baggage), false);
            let (response, send) = match sent {
                Ok(sent) => sent,
                Err(e) if attempts > 0 && retryable(&e) => {
                    closed.store(true, Ordering::Release);
                    continue;
                }
                Err(e) => return Err(h2_err(e)),
            };
            let response = match response.await {
                Ok(response) => response,
                Err(e) if attempts > 0 && retryable(&e) => {
                    closed.store(true, Ordering::Release);
                    continue;
                }
                Err(e) => return Err(h2_err(e)),
            };
            if response.status() != StatusCode::OK {
                return Err(HboneError::Status {
                    dst: key.dst,
                    target,
                    status: response.status(),
                });
            }
            return Ok(H2Stream::counted(send, response.into_body(), counted));
        }
    }

    async fn dial(key: &PoolKey, certs: &CertManager, mark: u32) -> Result<Connection, HboneError> {
        let config = certs.client_config(&key.src_id, &key.dst_id).await?;
        let tcp = socket::connect(Some(key.src_ip), key.dst, mark)
            .await
            .map_err(|source| HboneError::Connect {
                dst: key.dst,
                source,
            })?;
        socket::set_liveness(&tcp);
        let mut tls = TlsConnector::from(config)
            .connect(ServerName::IpAddress(key.dst.ip().into()), tcp)
            .await
            .map_err(|source| HboneError::Tls {
                dst: key.dst,
                id: key.dst_id.clone(),
                source,
            })?;
        hbone::take_whole_frames(tls.get_mut().1);
        let (sender, connection) =
            hbone::client_builder()
                .handshake(tls)
                .await
                .map_err(|source| HboneError::H2 {
                    dst: key.dst,
                    source,
                })?;
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        let dst = key.dst;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%dst, "HBONE connection ended: {e}");
            }
            flag.store(true, Ordering::Release);
        });
        tracing::debug!(%dst, src = %key.src_ip, id = %key.dst_id, "new HBONE connection");
        Ok(Connection {
            sender,
            closed,
            last_used: Instant::now(),
        })
    }

    /// Releases the connections whose key fails `keep` (open streams finish).
    pub fn retain(&self, keep: impl Fn(&PoolKey) -> bool) {
        self.slots
            .lock()
            .expect("pool lock")
            .retain(|(_, key), _| keep(key));
    }

    /// Releases connections that are closed or idle for longer than `idle`.
    pub fn sweep(&self, idle: Duration) {
        let now = Instant::now();
        self.slots.lock().expect("pool lock").retain(|_, list| {
            list.retain(|slot| {
                // A slot being dialled is busy: keep it.
                let Ok(guard) = slot.conn.try_lock() else {
                    return true;
                };
                match guard.as_ref() {
                    Some(c) => {
                        !c.closed.load(Ordering::Acquire) && now.duration_since(c.last_used) < idle
                    }
                    // Empty, unless a stream is about to dial it.
                    None => slot.streams.load(Ordering::Relaxed) > 0,
                }
            });
            !list.is_empty()
        });
    }

    /// The number of slots (connections, made or to be made) per key, for tests.
    #[cfg(test)]
    fn slots(&self, key: &PoolKey) -> usize {
        self.slots
            .lock()
            .expect("pool lock")
            .get(&(THREAD.with(std::cell::Cell::get), key.clone()))
            .map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> PoolKey {
        let id = SpiffeId::new("cluster.local", "ns", "sa");
        PoolKey {
            src_id: id.clone(),
            src_ip: "10.0.0.1".parse().unwrap(),
            dst_id: id,
            dst: "10.0.1.1:15008".parse().unwrap(),
        }
    }

    /// Each proxy thread has its own connections for a key: a stream opened
    /// on another thread never rides this one's.
    #[test]
    fn each_proxy_thread_has_its_own_connections() {
        let pool = Arc::new(Pool::default());
        let (mine, a) = pool.pick(&key());
        let (again, b) = pool.pick(&key());
        assert!(Arc::ptr_eq(&mine, &again), "one per key on a thread");
        let other = std::thread::spawn({
            let pool = pool.clone();
            move || {
                set_thread(1);
                pool.pick(&key())
            }
        })
        .join()
        .unwrap();
        assert!(!Arc::ptr_eq(&mine, &other.0), "thread 1 has its own");
        assert_eq!(other.0.streams.load(Ordering::Relaxed), 1);
        assert_eq!(mine.streams.load(Ordering::Relaxed), 2);
        drop((a, b));
        pool.retain(|_| false);
        assert_eq!(pool.slots(&key()), 0, "released on every thread");
    }

    /// Streams share a key's one connection until the peer's limit of
    /// concurrent streams fills it; then a second takes the next, and a new
    /// stream goes to the one with room and the fewest streams.
    #[test]
    fn streams_share_a_connection_until_it_is_full() {
        let pool = Pool::default();
        let key = key();
        let (x, _x) = pool.pick(&key);
        let (y, y_stream) = pool.pick(&key);
        assert!(Arc::ptr_eq(&x, &y), "parallel streams: one connection");
        assert_eq!(pool.slots(&key), 1);
        // Full (the peer allows two streams at once): a second connection.
        x.max_streams.store(2, Ordering::Relaxed);
        let (z, _z) = pool.pick(&key);
        assert!(!Arc::ptr_eq(&x, &z), "a full connection takes no stream");
        assert_eq!(pool.slots(&key), 2);
        let (w, _w) = pool.pick(&key);
        assert!(Arc::ptr_eq(&z, &w), "the one with room");
        // A stream of the first ends: it has room again, and the fewest.
        drop(y_stream);
        z.max_streams.store(2, Ordering::Relaxed);
        let (v, _v) = pool.pick(&key);
        assert!(Arc::ptr_eq(&x, &v), "room again on the first");
        assert_eq!(x.streams.load(Ordering::Relaxed), 2);
    }

    /// The key names the source address and the peer's HBONE address: an IPv6
    /// and an IPv4 destination (even of one workload) never share a connection,
    /// and an IPv4-mapped address, made canonical on entry, is its IPv4 peer's.
    #[test]
    fn connections_are_pooled_per_family() {
        let pool = Pool::default();
        let v4 = key();
        let v6 = PoolKey {
            src_ip: "fd00:10:244:1::1".parse().unwrap(),
            dst: "[fd00:10:244:2::1]:15008".parse().unwrap(),
            ..key()
        };
        assert_ne!(v4, v6);
        let (a, _a) = pool.pick(&v4);
        let (b, _b) = pool.pick(&v6);
        assert!(!Arc::ptr_eq(&a, &b), "one connection per family");
        assert_eq!((pool.slots(&v4), pool.slots(&v6)), (1, 1));

        let mapped: SocketAddr = "[::ffff:10.0.1.1]:15008".parse().unwrap();
        let same = PoolKey {
            dst: crate::proxy::canonical(mapped),
            ..key()
        };
        assert_eq!(same, v4);
        let (c, _c) = pool.pick(&same);
        assert!(
            Arc::ptr_eq(&a, &c),
            "the same peer address: the same connection"
        );
    }

    /// The sweep drops empty slots nobody is about to use and keeps those a
    /// stream is dialling.
    #[test]
    fn the_sweep_keeps_slots_in_use() {
        let pool = Pool::default();
        let key = key();
        let (first, a) = pool.pick(&key);
        first.max_streams.store(1, Ordering::Relaxed);
        let (_, b) = pool.pick(&key);
        assert_eq!(pool.slots(&key), 2);
        drop(b);
        pool.sweep(IDLE_TIMEOUT);
        assert_eq!(pool.slots(&key), 1);
        drop(a);
        pool.sweep(IDLE_TIMEOUT);
        assert_eq!(pool.slots(&key), 0);
    }
}
