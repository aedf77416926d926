//! What the agent reads of the node's network on every reconcile — host routes,
//! veths and addresses — as route netlink dumps (`RTM_GETROUTE`, `RTM_GETLINK`,
//! `RTM_GETADDR`; rtnetlink(7)) over one socket kept open, through the
//! `rtnetlink` crate. Running `ip` for each would cost a process and a JSON
//! document per reconcile, which grows with the number of pods.
//!
//! A dump of every route and address grows with the node too (about 6 ms with
//! 1,000 host veths), so only a full read dumps. Between full reads, the routes and
//! addresses are kept up to date from the kernel's notifications
//! (`RTNLGRP_IPV4_ROUTE`, `RTNLGRP_IPV4_IFADDR`, their IPv6 twins and
//! `RTNLGRP_LINK`; rtnetlink(7)), read without blocking from a second socket at
//! each read. IPv4 does not notify the routes it flushes with a deleted
//! interface, so an interface's `RTM_DELLINK` (or being set down) removes its
//! routes of both families here, and losing its last IPv4 address its IPv4
//! routes. A lost notification (`ENOBUFS`: the socket's buffer overflowed),
//! one that cannot be decoded, or any error reading them makes the read a full
//! one, and so does a last full read older than 2 s at the agent's periodic
//! resync (while nothing changes), or older than 30 s at any read: a pod's
//! enrollment does not wait for a dump.

use std::{
    collections::{HashMap, HashSet},
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use futures_util::TryStreamExt;
use rtnetlink::{
    Handle, RouteMessageBuilder,
    packet_core::{NetlinkMessage, NetlinkPayload},
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        address::{AddressAttribute, AddressMessage, AddressScope},
        link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo},
        route::{
            RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteType,
        },
    },
    sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE},
};

use super::error::{Error, Result};

/// How long one [`Netlink::read`] may take.
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The node's network as one reconcile needs it.
#[derive(Debug, Default)]
pub struct NodeNetwork {
    /// Host routes: `/32` IPv4 and `/128` IPv6 routes of the main table that go
    /// straight out of an interface (no gateway), by destination, with the
    /// interface's index. A point-to-point CNI plugin (such as `ptp`) adds one per
    /// pod address to its host veth.
    pub host_routes: HashMap<IpAddr, u32>,
    /// The interfaces host routes lead to that are veths: index → name.
    pub veths: HashMap<u32, Arc<str>>,
    /// Interfaces host routes lead to whose kind could not be read this time.
    pub unresolved: std::collections::HashSet<u32>,
    /// The node's own addresses: IPv4 except loopback, then IPv6 of global scope
    /// (not link-local, not loopback), each family sorted, without duplicates.
    pub addrs: Vec<IpAddr>,
}

/// A route netlink socket in the agent's network namespace.
pub struct Netlink {
    handle: Handle,
    /// What each interface a host route led to is: its name if a veth. An
    /// interface's kind never changes, so each is asked about once (a dump of
    /// every link would cost more than all the rest as pods grow in number);
    /// entries go when no host route leads to their interface any more.
    kinds: std::sync::Mutex<HashMap<u32, Option<Arc<str>>>>,
    /// Host routes and addresses since the last full read.
    tracked: std::sync::Mutex<Tracked>,
    /// Whether the notification socket's failure was logged.
    warned: std::sync::atomic::AtomicBool,
}

/// The multicast groups of the notifications followed (`linux/rtnetlink.h`).
const GROUPS: u32 = (libc::RTMGRP_LINK
    | libc::RTMGRP_IPV4_IFADDR
    | libc::RTMGRP_IPV4_ROUTE
    | libc::RTMGRP_IPV6_IFADDR
    | libc::RTMGRP_IPV6_ROUTE) as u32;
/// `RTM_NEWLINK` to `RTM_DELROUTE` (`linux/rtnetlink.h`): the message types of
/// those groups.
const FOLLOWED_TYPES: std::ops::RangeInclusive<u16> = libc::RTM_NEWLINK..=libc::RTM_DELROUTE;
/// The length of a netlink message header (`struct nlmsghdr`, netlink(7)).
const HEADER_LEN: usize = size_of::<libc::nlmsghdr>();
/// A read is a full one (dumps) when the last full read is older than this:
/// whatever notifications miss (none that this module knows of) lasts no longer.
/// Reads on a change (a pod to enroll) dump only this rarely: a dump of a node
/// with a thousand host veths takes 6 to 12 ms.
const FULL_READ_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30);
/// A resync's read (the agent's periodic one, while nothing changes) is a full
/// one when the last full read is older than this.
const RESYNC_FULL_READ_AGE: std::time::Duration = std::time::Duration::from_secs(2);
/// Receive buffer asked for the notification socket (bytes): a burst of pods
/// made between two reads (each a few links, an address and routes, about 1 KiB a
/// notification) fits; beyond it, the next read is a full one.
const NOTIFICATION_BUFFER: usize = 4 << 20;

/// What the last full read found, with the notifications read since applied.
#[derive(Default)]
struct Tracked {
    /// The notification socket; `None` until the first full read, and after an
    /// error on it (the next read is then a full one, with a new socket).
    socket: Option<Socket>,
    /// The same socket (a second descriptor) registered with the runtime, to
    /// wait for its next notification ([`Netlink::notified`]).
    watch: Option<Arc<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>>,
    /// When the last full read was made.
    full_read_at: Option<std::time::Instant>,
    host_routes: HashMap<IpAddr, u32>,
    /// The node's addresses ([`node_address`]) by interface (one address may be
    /// on several: a point-to-point CNI plugin gives each host veth the same one).
    addrs: HashSet<(u32, IpAddr)>,
}

impl Tracked {
    /// Applies one notification. Messages of other kinds are ignored.
    ///
    /// IPv4 flushes an interface's routes without an `RTM_DELROUTE` when the
    /// interface is deleted or set down, or loses its last IPv4 address
    /// (`fib_disable_ip()` in `net/ipv4/fib_frontend.c`): those notifications take
    /// the interface's routes here (of both families for the first two, IPv4's
    /// for the last).
    fn apply(&mut self, message: &RouteNetlinkMessage) {
        match message {
            RouteNetlinkMessage::NewRoute(route) => {
                if let Some(dst) = main_table_host_prefix(route) {
                    // A /32 replaced by one that is not a host route (a gateway, a
                    // blackhole) is no pod's any more.
                    match host_route(route) {
                        Some((dst, oif)) => self.host_routes.insert(dst, oif),
                        None => self.host_routes.remove(&dst),
                    };
                }
            }
            RouteNetlinkMessage::DelRoute(route) => {
                if let Some((dst, oif)) = host_route(route)
                    && self.host_routes.get(&dst) == Some(&oif)
                {
                    self.host_routes.remove(&dst);
                }
            }
            RouteNetlinkMessage::NewAddress(address) => {
                if let Some(ip) = node_address(address) {
                    self.addrs.insert((address.header.index, ip));
                }
            }
            RouteNetlinkMessage::DelAddress(address) => {
                if let Some(ip) = node_address(address) {
                    let index = address.header.index;
                    self.addrs.remove(&(index, ip));
                    if ip.is_ipv4() && !self.addrs.iter().any(|(i, a)| *i == index && a.is_ipv4()) {
                        self.host_routes
                            .retain(|dst, oif| *oif != index || dst.is_ipv6());
                    }
                }
            }
            // Bridge port notifications (AF_BRIDGE) are not about the interface.
            RouteNetlinkMessage::NewLink(link)
                if link.header.interface_family == AddressFamily::Unspec
                    && !link.header.flags.contains(LinkFlags::Up) =>
            {
                self.forget_routes_of(link.header.index);
            }
            RouteNetlinkMessage::DelLink(link)
                if link.header.interface_family == AddressFamily::Unspec =>
            {
                let index = link.header.index;
                self.forget_routes_of(index);
                self.addrs.retain(|(i, _)| *i != index);
            }
            _ => {}
        }
    }

    fn forget_routes_of(&mut self, index: u32) {
        self.host_routes.retain(|_, oif| *oif != index);
    }

    /// The node's addresses, as [`NodeNetwork::addrs`] has them.
    fn addrs(&self) -> Vec<IpAddr> {
        node_addrs(self.addrs.iter().map(|(_, ip)| *ip))
    }
}

/// Opens a route netlink socket subscribed to [`GROUPS`], not blocking.
fn notification_socket() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind(&SocketAddr::new(0, GROUPS))?;
    socket.set_non_blocking(true)?;
    // As root, past net.core.rmem_max (SO_RCVBUFFORCE); else what it allows.
    let size = NOTIFICATION_BUFFER as libc::c_int;
    let forced = nix::sys::socket::setsockopt(
        &socket,
        nix::sys::socket::sockopt::RcvBufForce,
        &NOTIFICATION_BUFFER,
    );
    if forced.is_err() {
        socket.set_rx_buf_sz(size)?;
    }
    Ok(socket)
}

/// Reads every notification waiting on `socket`, without blocking, and hands
/// each route netlink message to `apply`.
///
/// # Errors
/// `ENOBUFS` when notifications were lost, or any other receive error: the
/// caller must then read everything again.
fn drain(socket: &Socket, mut apply: impl FnMut(&RouteNetlinkMessage)) -> io::Result<()> {
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    loop {
        buf.clear();
        // MSG_TRUNC: the datagram's real length, to notice one that did not fit.
        match socket.recv(&mut buf, libc::MSG_TRUNC) {
            Ok(n) if n > buf.len() => {
                return Err(io::Error::other(format!(
                    "a notification of {n} bytes was truncated"
                )));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
        for_each_message(&buf, &mut apply)?;
    }
}

/// Hands each route netlink message of one datagram to `apply`; a message of
/// another kind that the library cannot decode is skipped.
///
/// # Errors
/// A message whose length does not fit the datagram, or a link, address or route
/// message that cannot be decoded.
fn for_each_message(buf: &[u8], apply: &mut impl FnMut(&RouteNetlinkMessage)) -> io::Result<()> {
    let mut offset = 0;
    while buf.len() >= offset + HEADER_LEN {
        let length = u32::from_ne_bytes(buf[offset..offset + 4].try_into().unwrap()) as usize;
        if length < HEADER_LEN || offset + length > buf.len() {
            return Err(io::Error::other("a malformed notification"));
        }
        let kind = u16::from_ne_bytes(buf[offset + 4..offset + 6].try_into().unwrap());
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[offset..offset + length]) {
            Ok(message) => {
                if let NetlinkPayload::InnerMessage(inner) = &message.payload {
                    apply(inner);
                }
            }
            // A link, address or route notification that cannot be read may be one
            // that matters.
            Err(e) if FOLLOWED_TYPES.contains(&kind) => {
                return Err(io::Error::other(format!(
                    "a notification of type {kind} could not be decoded: {e}"
                )));
            }
            Err(_) => {}
        }
        offset += (length + 3) & !3;
    }
    Ok(())
}

/// The node's addresses among `found`: IPv4 but loopback first, then IPv6 of
/// global scope (not loopback, link-local or IPv4-mapped), each family sorted,
/// without duplicates. IPv4 first: the config map holds the first
/// `MAX_NODE_ADDRS` only.
pub(crate) fn node_addrs(found: impl IntoIterator<Item = IpAddr>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = found
        .into_iter()
        .filter(|ip| match ip {
            IpAddr::V4(v4) => !v4.is_loopback(),
            IpAddr::V6(v6) => is_global_ipv6(v6),
        })
        .collect();
    // `IpAddr` orders IPv4 before IPv6.
    out.sort();
    out.dedup();
    out
}

/// Whether `ip` may be a node's own global IPv6 address: not unspecified,
/// loopback, link-local (`fe80::/10`), multicast or IPv4-mapped.
fn is_global_ipv6(ip: &Ipv6Addr) -> bool {
    !ip.is_unspecified()
        && !ip.is_loopback()
        && !ip.is_unicast_link_local()
        && !ip.is_multicast()
        && ip.to_ipv4_mapped().is_none()
}

/// The destination of a host-sized route (`/32` IPv4, `/128` IPv6) of the main
/// table (of any kind).
fn main_table_host_prefix(route: &RouteMessage) -> Option<IpAddr> {
    let header = &route.header;
    let table = route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(header.table));
    let host_length = match header.address_family {
        AddressFamily::Inet => 32,
        AddressFamily::Inet6 => 128,
        _ => return None,
    };
    if table != u32::from(RouteHeader::RT_TABLE_MAIN)
        || header.destination_prefix_length != host_length
    {
        return None;
    }
    route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
        RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
        _ => None,
    })
}

/// A host route: `/32` IPv4 or `/128` IPv6, main table, unicast, straight out of
/// an interface (no gateway), and for IPv6 not `proto kernel` (the kernel adds
/// one for each `/128` address of an interface: the host veth's own gateway
/// address, not a pod's). Its destination and interface index.
fn host_route(route: &RouteMessage) -> Option<(IpAddr, u32)> {
    let dst = main_table_host_prefix(route)?;
    if route.header.kind != RouteType::Unicast
        || (dst.is_ipv6() && route.header.protocol == RouteProtocol::Kernel)
    {
        return None;
    }
    let mut oif = None;
    for attribute in &route.attributes {
        match attribute {
            RouteAttribute::Oif(index) => oif = Some(*index),
            RouteAttribute::Gateway(_) | RouteAttribute::MultiPath(_) => return None,
            _ => {}
        }
    }
    Some((dst, oif?))
}

/// An address message's own address, if it may be one of [`node_addrs`]: IPv4
/// (`IFA_LOCAL`; `IFA_ADDRESS` is the peer's on point-to-point links), or IPv6 of
/// global scope (`IFA_LOCAL` if given, which only a point-to-point address with
/// a peer has, else `IFA_ADDRESS`; not link-local, not loopback).
fn node_address(message: &AddressMessage) -> Option<IpAddr> {
    match message.header.family {
        AddressFamily::Inet => message.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(IpAddr::V4(ip)) => Some(IpAddr::V4(*ip)),
            _ => None,
        }),
        AddressFamily::Inet6 if message.header.scope == AddressScope::Universe => {
            let local = message.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(IpAddr::V6(ip)) => Some(*ip),
                _ => None,
            });
            let address = || {
                message.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(IpAddr::V6(ip)) => Some(*ip),
                    _ => None,
                })
            };
            local
                .or_else(address)
                .filter(is_global_ipv6)
                .map(IpAddr::V6)
        }
        _ => None,
    }
}

impl Netlink {
    /// Opens the socket; its connection task runs on the current tokio runtime.
    ///
    /// # Errors
    /// When the socket cannot be opened.
    pub fn open() -> Result<Self> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|error| Error::NetlinkSocket { error })?;
        tokio::spawn(connection);
        Ok(Self {
            handle,
            kinds: Default::default(),
            tracked: Default::default(),
            warned: Default::default(),
        })
    }

    /// Opens a socket on a current-thread runtime made for the purpose and runs
    /// `f` with it: for the operator commands (`podlink inspect`, `podlink
    /// uninstall`), which run without a runtime. Not to be called on a tokio
    /// runtime's thread (tokio panics there).
    ///
    /// # Errors
    /// When the runtime cannot be made or the socket opened; `f`'s errors.
    pub fn blocking<T>(f: impl AsyncFnOnce(&Netlink) -> Result<T>) -> Result<T> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| Error::Runtime { error })?;
        runtime.block_on(async {
            let netlink = Netlink::open()?;
            f(&netlink).await
        })
    }

    /// The `rtnetlink` handle, for requests of the other modules ([`super::net`]).
    pub(super) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Reads routes, links and addresses, within [`READ_TIMEOUT`]: by dumps at the
    /// first read, when the last full read is older than `FULL_READ_MAX_AGE`
    /// (for a `resync`, the agent's periodic read while nothing changes:
    /// `RESYNC_FULL_READ_AGE`), or when the notifications since it are not all
    /// known; else from those notifications.
    ///
    /// # Errors
    /// A failed dump, naming what was read, or no complete answer in time (a
    /// reply the library cannot decode is dropped, and its request never ends:
    /// open a new socket then).
    pub async fn read(&self, resync: bool) -> Result<NodeNetwork> {
        let max_age = if resync {
            RESYNC_FULL_READ_AGE
        } else {
            FULL_READ_MAX_AGE
        };
        tokio::time::timeout(READ_TIMEOUT, self.read_all(false, max_age))
            .await
            .map_err(|_| Error::NetlinkTimeout {
                timeout: READ_TIMEOUT,
            })?
    }

    async fn read_all(&self, full: bool, max_age: std::time::Duration) -> Result<NodeNetwork> {
        if full || !self.catch_up(max_age) {
            // Subscribed before the dumps: a change made meanwhile is in the dump,
            // or is applied at the next read, or both (applying it again is
            // harmless).
            let socket = match notification_socket() {
                Ok(socket) => Some(socket),
                Err(e) => {
                    if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::warn!(
                            "route netlink notifications unavailable, every read dumps: {e}"
                        );
                    }
                    None
                }
            };
            let started = std::time::Instant::now();
            // One dump at a time: a netlink socket refuses a second one while the
            // first is in progress (EBUSY).
            let host_routes = self.host_routes().await?;
            let addrs = self.addrs().await?;
            let watch = socket.as_ref().and_then(|s| {
                let fd = std::os::fd::AsFd::as_fd(s).try_clone_to_owned().ok()?;
                crate::sys::watch_fd(fd).ok().map(Arc::new)
            });
            *self.tracked.lock().expect("tracked lock") = Tracked {
                socket,
                watch,
                full_read_at: Some(started),
                host_routes,
                addrs,
            };
        }
        let (host_routes, addrs) = {
            let tracked = self.tracked.lock().expect("tracked lock");
            (tracked.host_routes.clone(), tracked.addrs())
        };
        let (veths, unresolved) = self.veths(&host_routes).await?;
        Ok(NodeNetwork {
            host_routes,
            veths,
            unresolved,
            addrs,
        })
    }

    /// Applies the notifications waiting since the last read. Returns false when
    /// that cannot bring the last read up to date (no socket, lost notifications,
    /// an error) or the last full read is older than `max_age`: the read must
    /// dump.
    fn catch_up(&self, max_age: std::time::Duration) -> bool {
        let mut tracked = self.tracked.lock().expect("tracked lock");
        if tracked.full_read_at.is_none_or(|at| at.elapsed() > max_age) {
            return false;
        }
        let Some(socket) = tracked.socket.take() else {
            return false;
        };
        match drain(&socket, |message| tracked.apply(message)) {
            Ok(()) => {
                tracked.socket = Some(socket);
                true
            }
            Err(e) => {
                tracing::debug!("route netlink notifications: {e}; reading everything");
                false
            }
        }
    }

    /// Resolves when a notification (a route, address or link change) arrived
    /// since the last call, at once if one is waiting: the agent then reads the
    /// node's network again and audits its captures. Never resolves while no
    /// notification socket is open (the periodic resync reads then).
    pub async fn notified(&self) {
        let watch = self.tracked.lock().expect("tracked lock").watch.clone();
        let Some(watch) = watch else {
            return std::future::pending().await;
        };
        match watch.readable().await {
            // Read (drained) by the next `read`; a notification after this
            // wakes the next call.
            Ok(mut ready) => ready.clear_ready(),
            Err(_) => std::future::pending().await,
        }
    }

    /// Forgets what interface `index` is, so that it is asked again (after an
    /// attach by its name failed: it may have been renamed).
    pub fn forget(&self, index: u32) {
        self.kinds.lock().expect("kinds lock").remove(&index);
    }

    /// The host routes of both families: a dump of each (one at a time). A
    /// kernel without IPv6 refuses its dump (`EAFNOSUPPORT`): IPv4's only then.
    async fn host_routes(&self) -> Result<HashMap<IpAddr, u32>> {
        let mut out = HashMap::new();
        for (family, dump) in [
            ("IPv4", RouteMessageBuilder::<Ipv4Addr>::new().build()),
            ("IPv6", RouteMessageBuilder::<Ipv6Addr>::new().build()),
        ] {
            let mut routes = self.handle.route().get(dump).execute();
            loop {
                match routes.try_next().await {
                    Ok(Some(route)) => {
                        if let Some((dst, oif)) = host_route(&route) {
                            out.insert(dst, oif);
                        }
                    }
                    Ok(None) => break,
                    Err(rtnetlink::Error::NetlinkError(e))
                        if e.raw_code() == -libc::EAFNOSUPPORT =>
                    {
                        break;
                    }
                    Err(e) => {
                        return Err(Error::netlink(format!("dumping {family} routes"))(e));
                    }
                }
            }
        }
        Ok(out)
    }

    async fn veths(
        &self,
        host_routes: &HashMap<IpAddr, u32>,
    ) -> Result<(HashMap<u32, Arc<str>>, std::collections::HashSet<u32>)> {
        let wanted: std::collections::HashSet<u32> = host_routes.values().copied().collect();
        let unknown: Vec<u32> = {
            let mut kinds = self.kinds.lock().expect("kinds lock");
            kinds.retain(|index, _| wanted.contains(index));
            wanted
                .iter()
                .filter(|i| !kinds.contains_key(i))
                .copied()
                .collect()
        };
        let mut unresolved = std::collections::HashSet::new();
        for index in unknown {
            let mut links = self.handle.link().get().match_index(index).execute();
            let kind = match links.try_next().await {
                Ok(Some(link)) => veth_name(&link),
                // Gone since the routes were read, or refused: asked again next
                // time if a route still leads to it.
                Ok(None) | Err(rtnetlink::Error::NetlinkError(_)) => {
                    unresolved.insert(index);
                    continue;
                }
                Err(e) => return Err(Error::netlink(format!("reading link {index}"))(e)),
            };
            self.kinds.lock().expect("kinds lock").insert(index, kind);
        }
        let kinds = self.kinds.lock().expect("kinds lock");
        let veths = kinds
            .iter()
            .filter_map(|(index, name)| Some((*index, name.clone()?)))
            .collect();
        Ok((veths, unresolved))
    }

    async fn addrs(&self) -> Result<HashSet<(u32, IpAddr)>> {
        let mut messages = self.handle.address().get().execute();
        let mut out = HashSet::new();
        while let Some(message) = messages
            .try_next()
            .await
            .map_err(Error::netlink("dumping addresses"))?
        {
            if let Some(ip) = node_address(&message) {
                out.insert((message.header.index, ip));
            }
        }
        Ok(out)
    }
}

/// The link's name if it is a veth.
fn veth_name(link: &rtnetlink::packet_route::link::LinkMessage) -> Option<Arc<str>> {
    let mut name = None;
    let mut veth = false;
    for attribute in &link.attributes {
        match attribute {
            LinkAttribute::IfName(n) => name = Some(Arc::from(n.as_str())),
            LinkAttribute::LinkInfo(info) => {
                veth |= info
                    .iter()
                    .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
            }
            _ => {}
        }
    }
    name.filter(|_| veth)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::testing::{add_ipv6_address, in_new_network_namespace, ip};
    use rtnetlink::packet_route::link::LinkMessage;

    /// A host route to `dst` (`/32`, `/128`) out of `oif`, as a dump has it.
    fn route(dst: impl Into<IpAddr>, oif: u32) -> RouteMessage {
        let dst = dst.into();
        let length = if dst.is_ipv4() { 32 } else { 128 };
        let mut route = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(dst, length)
            .unwrap()
            .output_interface(oif)
            .build();
        route.header.kind = RouteType::Unicast;
        route.header.table = RouteHeader::RT_TABLE_MAIN;
        route
    }

    /// An address of interface `index` as the kernel notifies it: IPv4 in
    /// `IFA_LOCAL`, IPv6 in `IFA_ADDRESS` with its scope (link for `fe80::/10`,
    /// host for `::1`).
    fn address(index: u32, ip: impl Into<IpAddr>) -> AddressMessage {
        let ip = ip.into();
        let mut message = AddressMessage::default();
        message.header.index = index;
        match ip {
            IpAddr::V4(_) => {
                message.header.family = AddressFamily::Inet;
                message.attributes.push(AddressAttribute::Local(ip));
            }
            IpAddr::V6(v6) => {
                message.header.family = AddressFamily::Inet6;
                message.header.scope = if v6.is_loopback() {
                    AddressScope::Host
                } else if v6.is_unicast_link_local() {
                    AddressScope::Link
                } else {
                    AddressScope::Universe
                };
                message.attributes.push(AddressAttribute::Address(ip));
            }
        }
        message
    }

    fn datagram(messages: Vec<RouteNetlinkMessage>) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            let mut message = NetlinkMessage::from(m);
            message.finalize();
            let start = out.len();
            out.resize(start + message.buffer_len(), 0);
            message.serialize(&mut out[start..]);
            out.resize(out.len().next_multiple_of(4), 0);
        }
        out
    }

    #[test]
    fn notifications_keep_routes_and_addresses() {
        let a = IpAddr::from([10, 244, 1, 5]);
        let b = IpAddr::from([10, 244, 1, 6]);
        let gw = IpAddr::from([10, 244, 1, 1]);
        let mut tracked = Tracked::default();
        let mut apply = |m: &RouteNetlinkMessage| tracked.apply(m);
        let mut gateway = route(Ipv4Addr::new(10, 0, 0, 0), 2);
        gateway.header.destination_prefix_length = 8;
        let buf = datagram(vec![
            RouteNetlinkMessage::NewRoute(route(a, 7)),
            RouteNetlinkMessage::NewRoute(route(b, 8)),
            RouteNetlinkMessage::NewRoute(gateway),
            RouteNetlinkMessage::NewAddress(address(7, gw)),
            RouteNetlinkMessage::NewAddress(address(8, gw)),
            RouteNetlinkMessage::NewAddress(address(1, Ipv4Addr::LOCALHOST)),
        ]);
        for_each_message(&buf, &mut apply).unwrap();
        assert_eq!(tracked.host_routes, HashMap::from([(a, 7), (b, 8)]));
        assert_eq!(tracked.addrs(), vec![gw]);
        // A route of another interface for the same address is not deleted; the
        // interface's deletion takes its routes and addresses (IPv4 does not
        // notify the routes it flushes).
        let mut gone = LinkMessage::default();
        gone.header.index = 7;
        let buf = datagram(vec![
            RouteNetlinkMessage::DelRoute(route(b, 9)),
            RouteNetlinkMessage::DelLink(gone),
        ]);
        let mut apply = |m: &RouteNetlinkMessage| tracked.apply(m);
        for_each_message(&buf, &mut apply).unwrap();
        assert_eq!(tracked.host_routes, HashMap::from([(b, 8)]));
        assert_eq!(
            tracked.addrs,
            HashSet::from([(8, gw), (1, IpAddr::from(Ipv4Addr::LOCALHOST))])
        );
        let buf = datagram(vec![
            RouteNetlinkMessage::DelRoute(route(b, 8)),
            RouteNetlinkMessage::DelAddress(address(8, gw)),
        ]);
        let mut apply = |m: &RouteNetlinkMessage| tracked.apply(m);
        for_each_message(&buf, &mut apply).unwrap();
        assert!(tracked.host_routes.is_empty());
        assert!(tracked.addrs().is_empty());
        // The flushes IPv4 does not notify: an interface set down, one that lost
        // its last address. A bridge port's RTM_DELLINK (AF_BRIDGE) is not the
        // interface's deletion; a /32 replaced by a gateway route is no host route.
        let c = IpAddr::from([10, 244, 1, 7]);
        let d = IpAddr::from([10, 244, 1, 8]);
        let e = IpAddr::from([10, 244, 1, 9]);
        let mut down = LinkMessage::default();
        down.header.index = 10;
        let mut port = LinkMessage::default();
        port.header.index = 11;
        port.header.interface_family = AddressFamily::Bridge;
        let mut replaced = route(e, 12);
        replaced.attributes.push(RouteAttribute::Gateway(gw.into()));
        let buf = datagram(vec![
            RouteNetlinkMessage::NewRoute(route(c, 10)),
            RouteNetlinkMessage::NewRoute(route(d, 11)),
            RouteNetlinkMessage::NewRoute(route(e, 12)),
            RouteNetlinkMessage::NewAddress(address(11, gw)),
            RouteNetlinkMessage::NewLink(down),
            RouteNetlinkMessage::DelLink(port),
            RouteNetlinkMessage::NewRoute(replaced),
        ]);
        let mut apply = |m: &RouteNetlinkMessage| tracked.apply(m);
        for_each_message(&buf, &mut apply).unwrap();
        assert_eq!(tracked.host_routes, HashMap::from([(d, 11)]));
        assert_eq!(tracked.addrs(), vec![gw]);
        let buf = datagram(vec![RouteNetlinkMessage::DelAddress(address(11, gw))]);
        let mut apply = |m: &RouteNetlinkMessage| tracked.apply(m);
        for_each_message(&buf, &mut apply).unwrap();
        assert!(tracked.host_routes.is_empty());
        // A length past the datagram's end is refused.
        let mut bad = datagram(vec![RouteNetlinkMessage::NewRoute(route(a, 7))]);
        bad[0] = 0xff;
        assert!(for_each_message(&bad, &mut |_| {}).is_err());
    }

    /// IPv6 host routes (`/128`) map a pod's IPv6 address to its host veth as
    /// IPv4's `/32` do; other prefixes, gateways and other tables do not. The
    /// node's global IPv6 addresses count as its own, link-local and loopback
    /// ones do not; losing the last IPv4 address takes IPv4's routes only.
    #[test]
    fn ipv6_host_routes_and_addresses_are_kept() {
        let pod4 = IpAddr::from([10, 244, 1, 5]);
        let pod6: IpAddr = "fd00:10:244:1::5".parse().unwrap();
        let other6: IpAddr = "fd00:10:244:1::6".parse().unwrap();
        let gw4 = IpAddr::from([10, 244, 1, 1]);
        let node6: IpAddr = "2001:db8::10".parse().unwrap();
        let link_local: IpAddr = "fe80::1".parse().unwrap();
        let mut prefix = route(other6, 7);
        prefix.header.destination_prefix_length = 64;
        let mut via = route(other6, 7);
        via.attributes
            .push(RouteAttribute::Gateway(link_local.into()));
        let mut local_table = route(other6, 7);
        local_table.header.table = 255; // RT_TABLE_LOCAL
        // What the kernel adds for a /128 address of the host veth.
        let mut own = route(other6, 7);
        own.header.protocol = RouteProtocol::Kernel;
        assert_eq!(host_route(&route(pod6, 7)), Some((pod6, 7)));
        for not_host in [&prefix, &via, &local_table, &own] {
            assert_eq!(host_route(not_host), None, "{not_host:?}");
        }
        let mut tracked = Tracked::default();
        let buf = datagram(vec![
            RouteNetlinkMessage::NewRoute(route(pod4, 7)),
            RouteNetlinkMessage::NewRoute(route(pod6, 7)),
            RouteNetlinkMessage::NewRoute(prefix),
            RouteNetlinkMessage::NewAddress(address(7, gw4)),
            RouteNetlinkMessage::NewAddress(address(7, link_local)),
            RouteNetlinkMessage::NewAddress(address(2, node6)),
            RouteNetlinkMessage::NewAddress(address(1, Ipv6Addr::LOCALHOST)),
        ]);
        for_each_message(&buf, &mut |m| tracked.apply(m)).unwrap();
        assert_eq!(tracked.host_routes, HashMap::from([(pod4, 7), (pod6, 7)]));
        assert_eq!(tracked.addrs(), vec![gw4, node6]);
        // The veth loses its IPv4 address: IPv4 flushes its IPv4 routes only.
        let buf = datagram(vec![RouteNetlinkMessage::DelAddress(address(7, gw4))]);
        for_each_message(&buf, &mut |m| tracked.apply(m)).unwrap();
        assert_eq!(tracked.host_routes, HashMap::from([(pod6, 7)]));
        assert_eq!(tracked.addrs(), vec![node6]);
        // IPv6 notifies its deletions.
        let buf = datagram(vec![RouteNetlinkMessage::DelRoute(route(pod6, 7))]);
        for_each_message(&buf, &mut |m| tracked.apply(m)).unwrap();
        assert!(tracked.host_routes.is_empty());
    }

    /// The node's addresses: IPv4 first, then global IPv6, each sorted, without
    /// loopback, link-local, multicast or IPv4-mapped ones and duplicates.
    #[test]
    fn node_addresses_put_ipv4_first() {
        let parse = |a: &[&str]| -> Vec<IpAddr> { a.iter().map(|a| a.parse().unwrap()).collect() };
        let found = parse(&[
            "fd00::1",
            "10.0.0.2",
            "127.0.0.1",
            "::1",
            "fe80::1",
            "ff02::1",
            "::ffff:10.0.0.9",
            "2001:db8::1",
            "10.0.0.1",
            "10.0.0.2",
            "fd00::1",
        ]);
        assert_eq!(
            node_addrs(found),
            parse(&["10.0.0.1", "10.0.0.2", "2001:db8::1", "fd00::1"])
        );
    }

    /// A change of the node's network wakes [`Netlink::notified`], which
    /// otherwise waits; the next read takes the notification in. Needs root.
    #[test]
    #[ignore = "needs root"]
    fn a_change_wakes_the_wait_for_notifications() {
        in_new_network_namespace(|| async move {
            let netlink = Netlink::open().unwrap();
            netlink.read_all(true, FULL_READ_MAX_AGE).await.unwrap();
            let quiet =
                tokio::time::timeout(std::time::Duration::from_millis(200), netlink.notified())
                    .await;
            assert!(quiet.is_err(), "woken with nothing changed");
            ip("link add nlwake0 type veth peer name nlwake1");
            ip("link set nlwake0 up");
            ip("route add 10.98.0.5/32 dev nlwake0");
            tokio::time::timeout(std::time::Duration::from_secs(10), netlink.notified())
                .await
                .expect("no wake-up for a new route");
            let index = nix::net::if_::if_nametoindex("nlwake0").unwrap();
            let read = netlink.read(false).await.unwrap();
            assert_eq!(
                read.host_routes.get(&IpAddr::from([10, 98, 0, 5])),
                Some(&index)
            );
        });
    }

    /// In a network namespace of its own (this thread's), the kernel's
    /// notifications bring a read without dumps up to date: a veth and its host
    /// routes and addresses of both families appear, and go with the veth. Needs root
    /// (`unshare(CLONE_NEWNET)`) and `ip`.
    #[test]
    #[ignore = "needs root"]
    fn reads_without_dumps_follow_the_kernel() {
        in_new_network_namespace(|| async move {
            let netlink = Netlink::open().unwrap();
            let first = netlink.read_all(true, FULL_READ_MAX_AGE).await.unwrap();
            assert!(first.host_routes.is_empty() && first.addrs.is_empty());
            let full_read_at = || netlink.tracked.lock().unwrap().full_read_at;
            let dumped_at = full_read_at();
            ip("link add nlhost0 type veth peer name nlpod0");
            ip("link set nlhost0 up");
            ip("addr add 10.99.0.1/32 dev nlhost0");
            add_ipv6_address("fd99::1/128", "nlhost0");
            ip("route add 10.99.0.5/32 dev nlhost0");
            ip("-6 route add fd99::5/128 dev nlhost0");
            let index = nix::net::if_::if_nametoindex("nlhost0").unwrap();
            let after = netlink.read(false).await.unwrap();
            // From the notifications alone: no full read since the first.
            assert!(netlink.tracked.lock().unwrap().socket.is_some());
            assert_eq!(full_read_at(), dumped_at);
            let pod = IpAddr::from([10, 99, 0, 5]);
            let pod6: IpAddr = "fd99::5".parse().unwrap();
            assert_eq!(
                after.host_routes,
                HashMap::from([(pod, index), (pod6, index)])
            );
            assert_eq!(after.veths, HashMap::from([(index, Arc::from("nlhost0"))]));
            assert_eq!(
                after.addrs,
                [IpAddr::from([10, 99, 0, 1]), "fd99::1".parse().unwrap()]
            );
            // Set down, the kernel flushes the route without notifying it.
            ip("link set nlhost0 down");
            let down = netlink.read(false).await.unwrap();
            assert_eq!(full_read_at(), dumped_at);
            assert!(down.host_routes.is_empty(), "{:?}", down.host_routes);
            assert_eq!(
                netlink
                    .read_all(true, FULL_READ_MAX_AGE)
                    .await
                    .unwrap()
                    .host_routes,
                down.host_routes
            );
            let dumped_at = full_read_at();
            ip("link set nlhost0 up");
            ip("route add 10.99.0.5/32 dev nlhost0");
            ip("-6 route add fd99::5/128 dev nlhost0");
            let again = netlink.read(false).await.unwrap();
            assert_eq!(
                again.host_routes,
                HashMap::from([(pod, index), (pod6, index)])
            );
            ip("link del nlhost0");
            let gone = netlink.read(false).await.unwrap();
            assert_eq!(full_read_at(), dumped_at);
            assert!(gone.host_routes.is_empty(), "{:?}", gone.host_routes);
            assert!(gone.veths.is_empty() && gone.addrs.is_empty());
            // A full read agrees.
            let full = netlink.read_all(true, FULL_READ_MAX_AGE).await.unwrap();
            assert!(full.host_routes.is_empty() && full.addrs.is_empty());
        });
    }

    /// Reads this namespace's network (whatever it is) and checks it against
    /// `ip`'s view: the same IPv4 addresses but loopback's and IPv6 addresses
    /// of global scope, the same veths.
    #[tokio::test]
    async fn reads_what_ip_shows() {
        let net = Netlink::open().unwrap().read(false).await.unwrap();
        let ip_json =
            |args: &str| -> serde_json::Value { serde_json::from_str(&ip(args)).unwrap() };
        let addrs: Vec<IpAddr> = ip_json("-j addr show")
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .filter(|a| a["family"] == "inet" || a["scope"] == "global")
            .filter_map(|a| a["local"].as_str()?.parse().ok())
            .collect();
        assert_eq!(net.addrs, node_addrs(addrs));
        // The veths host routes lead to.
        let targets: std::collections::HashSet<u32> = net.host_routes.values().copied().collect();
        let veths: HashMap<u32, Arc<str>> = ip_json("-j -d link show type veth")
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["ifindex"].as_u64().unwrap() as u32,
                    Arc::from(l["ifname"].as_str().unwrap()),
                )
            })
            .filter(|(i, _)| targets.contains(i))
            .collect();
        assert_eq!(net.veths, veths);
    }
}
