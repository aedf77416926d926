//! Endpoint choice: which endpoint of a Service a new connection goes to.
//!
//! The Service index ([`super::service`]) has already narrowed each Service
//! port to the endpoints new connections from this node may go to (ready, or
//! serving-terminating when none is; this node's for `internalTrafficPolicy:
//! Local`; the near ones for `trafficDistribution`). Among those:
//!
//! * `sessionAffinity: ClientIP` (Kubernetes "Services", "Session stickiness"):
//!   a client address keeps the endpoint it got while that endpoint stays
//!   among them and its last connection is less than
//!   `sessionAffinityConfig.clientIP.timeoutSeconds` old, as kube-proxy's
//!   iptables mode keeps it (its `recent` match counts from the last
//!   connection). The client is the connecting pod's address; affinity is kept
//!   per virtual address and port, by this proxy alone (a pod's connections
//!   all leave through its own node's proxy).
//! * Otherwise the "power of two choices" (Mitzenmacher, 2001): of two of them
//!   chosen at random, the one with fewer open connections from this proxy.
//!
//! Affinity entries are bounded: those whose timeout has passed are dropped
//! once a minute and whenever the table is full; at [`AFFINITY_CAP`] entries
//! still in force, the least recently used eighth is dropped, so a full table
//! costs one linear pass per `AFFINITY_CAP / 8` new clients. A client whose
//! entry was dropped early gets an endpoint afresh, as after a timeout.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use super::service::ServicePort;

/// The most affinity entries (client and virtual address) kept at once: well
/// above a node's pods times the Services they use with `sessionAffinity`;
/// about 100 bytes each.
pub const AFFINITY_CAP: usize = 16_384;

/// How often expired affinity entries are swept out.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Open connections from this proxy to each Service endpoint, for balancing,
/// and the clients' affinities. Cloning gives another handle on the same
/// state.
#[derive(Clone, Default)]
pub struct EndpointLoad {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    open: HashMap<SocketAddr, usize>,
    affinity: Affinity,
}

/// The endpoint each client got, by (virtual address and port, client
/// address).
#[derive(Default)]
struct Affinity {
    entries: HashMap<(SocketAddr, IpAddr), Sticky>,
    /// When expired entries are next swept out (none yet: at the first use).
    next_sweep: Option<Instant>,
}

#[derive(Clone, Copy)]
struct Sticky {
    endpoint: SocketAddr,
    /// The client's last connection to it.
    last: Instant,
    /// The Service's timeout when it was last used.
    timeout: Duration,
}

impl Sticky {
    fn expired(&self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.last) >= timeout
    }
}

impl Affinity {
    /// The endpoint `client` keeps for `vip`, if its entry is in force and the
    /// endpoint is among `usable`; its last use becomes `now`.
    fn keep(
        &mut self,
        key: (SocketAddr, IpAddr),
        usable: &[SocketAddr],
        timeout: Duration,
        now: Instant,
    ) -> Option<SocketAddr> {
        let sticky = self.entries.get_mut(&key)?;
        if sticky.expired(now, timeout) || usable.binary_search(&sticky.endpoint).is_err() {
            return None;
        }
        sticky.last = now;
        sticky.timeout = timeout;
        Some(sticky.endpoint)
    }

    /// Records that `client` got `endpoint` for `vip` at `now`, making room
    /// as the module says.
    fn record(&mut self, key: (SocketAddr, IpAddr), sticky: Sticky) {
        let now = sticky.last;
        if self.next_sweep.is_none_or(|at| now >= at) {
            self.sweep(now);
        }
        if self.entries.len() >= AFFINITY_CAP && !self.entries.contains_key(&key) {
            self.sweep(now);
            if self.entries.len() >= AFFINITY_CAP {
                self.evict_oldest(AFFINITY_CAP / 8);
            }
        }
        self.entries.insert(key, sticky);
    }

    fn sweep(&mut self, now: Instant) {
        self.entries.retain(|_, s| !s.expired(now, s.timeout));
        self.next_sweep = Some(now + SWEEP_EVERY);
    }

    /// Drops the `n` least recently used entries.
    fn evict_oldest(&mut self, n: usize) {
        let mut by_age: Vec<(Instant, (SocketAddr, IpAddr))> =
            self.entries.iter().map(|(k, s)| (s.last, *k)).collect();
        let n = n.min(by_age.len());
        if n == 0 {
            return;
        }
        by_age.select_nth_unstable_by_key(n - 1, |(last, _)| *last);
        for (_, key) in &by_age[..n] {
            self.entries.remove(key);
        }
    }
}

impl EndpointLoad {
    /// Picks an endpoint of `service` for a new connection from `client` (the
    /// source pod's address), among the endpoints the index chose for this
    /// node: the one `client` keeps by `sessionAffinity: ClientIP`, else by
    /// the power of two choices. The guard counts the connection as open on it
    /// until dropped. `None` when the index chose none
    /// ([`ServicePort::why_no_endpoint`] says why).
    pub fn pick(&self, service: &ServicePort, client: IpAddr) -> Option<EndpointGuard> {
        self.pick_at(service, client, Instant::now())
    }

    /// [`EndpointLoad::pick`] at time `now`.
    fn pick_at(
        &self,
        service: &ServicePort,
        client: IpAddr,
        now: Instant,
    ) -> Option<EndpointGuard> {
        let usable = service.usable();
        if usable.is_empty() {
            return None;
        }
        let mut inner = self.inner.lock().expect("endpoint load lock");
        let key = (service.vip, client);
        let timeout = service.affinity_timeout();
        let kept = timeout.and_then(|t| inner.affinity.keep(key, usable, t, now));
        let chosen = match kept {
            Some(endpoint) => endpoint,
            None => {
                let chosen = two_choices(usable, &inner.open);
                if let Some(timeout) = timeout {
                    inner.affinity.record(
                        key,
                        Sticky {
                            endpoint: chosen,
                            last: now,
                            timeout,
                        },
                    );
                }
                chosen
            }
        };
        *inner.open.entry(chosen).or_default() += 1;
        Some(EndpointGuard {
            addr: chosen,
            load: self.inner.clone(),
        })
    }

    /// How many affinity entries are kept.
    #[cfg(test)]
    fn affinities(&self) -> usize {
        self.inner.lock().unwrap().affinity.entries.len()
    }
}

/// Of two of `usable` (not empty) chosen at random, the one with fewer `open`
/// connections.
fn two_choices(usable: &[SocketAddr], open: &HashMap<SocketAddr, usize>) -> SocketAddr {
    match usable.len() {
        1 => usable[0],
        n => {
            let i = fastrand::usize(..n);
            let mut j = fastrand::usize(..n - 1);
            if j >= i {
                j += 1;
            }
            let load = |a: &SocketAddr| open.get(a).copied().unwrap_or(0);
            if load(&usable[j]) < load(&usable[i]) {
                usable[j]
            } else {
                usable[i]
            }
        }
    }
}

/// A connection to a Service endpoint, counted as open on it while it lives.
pub struct EndpointGuard {
    /// The endpoint (address and resolved target port).
    pub addr: SocketAddr,
    load: Arc<Mutex<Inner>>,
}

impl Drop for EndpointGuard {
    fn drop(&mut self) {
        let mut inner = self.load.lock().expect("endpoint load lock");
        if let Some(n) = inner.open.get_mut(&self.addr) {
            *n -= 1;
            if *n == 0 {
                inner.open.remove(&self.addr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        k8s::{EndpointSlice, Service},
        state::service::{Locality, ServiceIndex},
    };

    const HERE: Locality<'static> = Locality {
        node: "n1",
        zone: Some("z1"),
    };

    /// Service `shop/api` at 10.96.0.20:80 with `spec` lines added, and
    /// ready endpoints at `addrs` (port 8080) on node n2.
    fn port(spec: &str, addrs: &[&str]) -> Arc<ServicePort> {
        let placed: Vec<(&str, &str)> = addrs.iter().map(|a| (*a, "n2")).collect();
        port_on(spec, &placed)
    }

    /// The same with endpoints as (address, nodeName).
    fn port_on(spec: &str, endpoints: &[(&str, &str)]) -> Arc<ServicePort> {
        let service: Service = serde_yaml_ng::from_str(&format!(
            "metadata: {{name: api, namespace: shop}}
spec:
  clusterIP: 10.96.0.20
  ports: [{{port: 80, targetPort: 8080}}]
{spec}"
        ))
        .unwrap();
        let endpoints: String = endpoints
            .iter()
            .map(|(a, node)| format!("- {{addresses: [{a}], nodeName: {node}}}\n"))
            .collect();
        let slice: EndpointSlice = serde_yaml_ng::from_str(&format!(
            "metadata: {{name: api-1, namespace: shop, labels: {{kubernetes.io/service-name: api}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints:
{endpoints}"
        ))
        .unwrap();
        let (index, _) = ServiceIndex::build("cluster.local", [&service], [&slice], HERE);
        index
            .lookup("10.96.0.20:80".parse().unwrap())
            .unwrap()
            .clone()
    }

    const ABC: [&str; 3] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    const STICKY: &str = "  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}
";

    fn client(n: u32) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::from(0x0af4_0000 + n))
    }

    #[test]
    fn two_choices_balance_within_the_chosen_set() {
        let load = EndpointLoad::default();
        let svc = port("", &ABC);
        let mut held = Vec::new();
        for i in 0..30 {
            held.push(load.pick(&svc, client(i)).unwrap());
        }
        let mut counts: HashMap<SocketAddr, usize> = HashMap::new();
        for g in &held {
            *counts.entry(g.addr).or_default() += 1;
        }
        // The less loaded of two: each gets some, none most.
        assert_eq!(counts.len(), 3, "{counts:?}");
        assert!(
            counts.values().all(|&n| (5..=15).contains(&n)),
            "{counts:?}"
        );
        // Only within the set the index chose (here this node's two, by
        // PreferSameNode), though the third has no connection open.
        let near = port_on(
            "  trafficDistribution: PreferSameNode\n",
            &[("10.0.0.1", "n1"), ("10.0.0.2", "n1"), ("10.0.0.9", "n2")],
        );
        let mut near_held = Vec::new();
        for i in 0..20 {
            near_held.push(load.pick(&near, client(i)).unwrap());
        }
        let on = |ip: &str| {
            near_held
                .iter()
                .filter(|g| g.addr.ip() == client_ip(ip))
                .count()
        };
        assert_eq!(on("10.0.0.9"), 0);
        assert!(on("10.0.0.1") >= 5 && on("10.0.0.2") >= 5);
        drop((held, near_held));
        assert!(load.inner.lock().unwrap().open.is_empty());
        // No usable endpoint: none.
        let none = port("", &[]);
        assert!(load.pick(&none, client(1)).is_none());
        // Without affinity, nothing is remembered.
        assert_eq!(load.affinities(), 0);
    }

    fn client_ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_client_sticks_to_its_endpoint_until_the_timeout() {
        let load = EndpointLoad::default();
        let svc = port(STICKY, &ABC);
        let t0 = Instant::now();
        let first = load.pick_at(&svc, client(1), t0).unwrap().addr;
        // Every later connection within the timeout of the last one, though
        // the load would send it elsewhere (the guard is held).
        let mut held = Vec::new();
        for s in 1..20 {
            let at = t0 + Duration::from_secs(s * 50);
            let guard = load.pick_at(&svc, client(1), at).unwrap();
            assert_eq!(guard.addr, first, "at {s}");
            held.push(guard);
        }
        // Another client gets its own.
        let others: std::collections::HashSet<_> = (2..40)
            .map(|c| load.pick_at(&svc, client(c), t0).unwrap().addr)
            .collect();
        assert!(others.len() > 1);
        // Past the timeout since its last connection: chosen afresh (by load,
        // so not the endpoint the held connections are on).
        let last = t0 + Duration::from_secs(19 * 50);
        let again = load
            .pick_at(&svc, client(1), last + Duration::from_secs(60))
            .unwrap();
        assert_ne!(again.addr, first);
        // ... and kept from then on.
        let later = last + Duration::from_secs(90);
        assert_eq!(
            load.pick_at(&svc, client(1), later).unwrap().addr,
            again.addr
        );
    }

    #[test]
    fn a_gone_endpoint_is_replaced_and_kept() {
        let load = EndpointLoad::default();
        let t0 = Instant::now();
        let svc = port(STICKY, &ABC);
        let first = load.pick_at(&svc, client(1), t0).unwrap().addr;
        let rest: Vec<&str> = ABC
            .iter()
            .copied()
            .filter(|a| a.parse::<IpAddr>().unwrap() != first.ip())
            .collect();
        let fewer = port(STICKY, &rest);
        let second = load.pick_at(&fewer, client(1), t0).unwrap().addr;
        assert_ne!(second, first);
        for s in 1..10 {
            let at = t0 + Duration::from_secs(s);
            assert_eq!(load.pick_at(&fewer, client(1), at).unwrap().addr, second);
        }
        // The first endpoint back: the client stays on its new one.
        let at = t0 + Duration::from_secs(20);
        assert_eq!(load.pick_at(&svc, client(1), at).unwrap().addr, second);
        // No usable endpoint: none, and the entry stays for when one is back.
        assert!(load.pick_at(&port(STICKY, &[]), client(1), at).is_none());
        assert_eq!(load.affinities(), 1);
    }

    #[test]
    fn affinity_entries_are_bounded() {
        let load = EndpointLoad::default();
        let svc = port(STICKY, &ABC);
        let t0 = Instant::now();
        // Expired entries are swept out as time passes.
        for c in 0..100 {
            drop(load.pick_at(&svc, client(c), t0));
        }
        assert_eq!(load.affinities(), 100);
        drop(load.pick_at(&svc, client(1000), t0 + Duration::from_secs(61)));
        assert_eq!(load.affinities(), 1);
        // A full table of entries in force drops its least recently used
        // eighth.
        let t1 = t0 + Duration::from_secs(62);
        let cap = u32::try_from(AFFINITY_CAP).unwrap();
        for c in 0..cap {
            let at = t1 + Duration::from_millis(u64::from(c) / 1000);
            drop(load.pick_at(&svc, client(c), at));
        }
        assert_eq!(load.affinities(), AFFINITY_CAP);
        // The first clients used again: the most recent now.
        let t2 = t1 + Duration::from_secs(30);
        let kept = load.pick_at(&svc, client(0), t2).unwrap().addr;
        drop(load.pick_at(&svc, client(cap), t2));
        assert_eq!(load.affinities(), AFFINITY_CAP - AFFINITY_CAP / 8 + 1);
        let inner = load.inner.lock().unwrap();
        let entries = &inner.affinity.entries;
        assert_eq!(entries[&(svc.vip, client(0))].endpoint, kept);
        assert!(!entries.contains_key(&(svc.vip, client(1))));
        assert!(entries.contains_key(&(svc.vip, client(cap - 1))));
    }
}
