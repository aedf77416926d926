//! Sockets of the proxy: transparent listeners and source-preserving connections.
//!
//! Every socket carries `SO_MARK` = the proxy mark, so the TC programs let its
//! packets through. Kernel documentation: `Documentation/networking/tproxy.rst`
//! (`IP_TRANSPARENT`), `ip(7)` (`IP_BIND_ADDRESS_NO_PORT`).

use std::{
    io,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use nix::sys::socket::{setsockopt, sockopt};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Listen backlog of the transparent listeners.
const BACKLOG: i32 = 4096;

/// Binds a transparent listener at `addr` (the loopback address, 127.0.0.1 or
/// `::1`: only packets assigned by the TC programs reach it; the accepted socket's
/// local address is the connection's original destination). An IPv6 listener is
/// `IPV6_V6ONLY` and `IPV6_TRANSPARENT`, an IPv4 one `IP_TRANSPARENT`.
///
/// The listener has `TCP_NODELAY`, which Linux copies into every socket it accepts
/// (`sk_clone_lock` copies the listener's `tcp_sock`), as it does `SO_MARK`: an
/// accepted connection needs no option call of its own.
///
/// # Errors
/// Socket, option (needs `CAP_NET_ADMIN`) or bind failures.
pub fn transparent_listener(addr: SocketAddr, mark: u32) -> io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        // IPv6 only: IPv4 connections go to the IPv4 twin, never here as
        // IPv4-mapped addresses.
        socket.set_only_v6(true)?;
    }
    set_transparent(&socket, addr.ip())?;
    socket.set_mark(mark)?;
    socket.set_tcp_nodelay(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

fn set_transparent(socket: &Socket, family_of: IpAddr) -> io::Result<()> {
    match family_of {
        IpAddr::V4(_) => socket.set_ip_transparent_v4(true),
        IpAddr::V6(_) => socket.set_ip_transparent_v6(true),
    }
}

/// Sets `IP_BIND_ADDRESS_NO_PORT`: the source port is chosen at `connect()`,
/// where only the full 4-tuple must be unique, not at `bind()` (`ip(7)`). IPv6
/// TCP sockets honour it too (`__inet6_bind`; the `SOL_IP` option is passed on
/// to `ip_setsockopt`).
fn set_bind_address_no_port(socket: &Socket) -> io::Result<()> {
    setsockopt(socket, sockopt::IpBindAddressNoPort, &true).map_err(io::Error::from)
}

/// Connects to `dst` with the proxy mark, from `src` when given (transparent bind
/// to an address that is not the node's, such as the client pod's), else from the
/// node's own address. `src` and `dst` are of one family; an IPv6 source is
/// bound with `IPV6_TRANSPARENT`.
///
/// # Errors
/// Socket errors, and the connect's own failure (refused, unreachable, timed out);
/// `InvalidInput` when `src` and `dst` are of different families.
pub async fn connect(src: Option<IpAddr>, dst: SocketAddr, mark: u32) -> io::Result<TcpStream> {
    if let Some(src) = src
        && src.is_ipv4() != dst.is_ipv4()
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the source {src} and the destination {dst} are of different address families"),
        ));
    }
    // Made non-blocking at once (`SOCK_NONBLOCK`): no `fcntl` calls per connection.
    let socket = Socket::new(
        Domain::for_address(dst),
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    socket.set_mark(mark)?;
    socket.set_tcp_nodelay(true)?;
    if let Some(src) = src {
        set_transparent(&socket, src)?;
        set_bind_address_no_port(&socket)?;
        socket.bind(&SocketAddr::new(src, 0).into())?;
    }
    let std: std::net::TcpStream = socket.into();
    let stream = TcpSocket::from_std_stream(std).connect(dst).await?;
    Ok(stream)
}

/// Idle time before TCP keepalive probes start, the interval between probes, and
/// the time unacknowledged data may wait: a dead HBONE peer (a node that crashed or
/// vanished) is noticed within about a minute instead of after minutes of
/// retransmissions, and its pooled connection is replaced.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;
const USER_TIMEOUT: Duration = Duration::from_secs(60);

/// Turns on TCP keepalive and `TCP_USER_TIMEOUT` for a long-lived HBONE connection.
pub fn set_liveness(stream: &TcpStream) {
    let sock = socket2::SockRef::from(stream);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    let _ = sock.set_tcp_keepalive(&keepalive);
    let _ = sock.set_tcp_user_timeout(Some(USER_TIMEOUT));
}

/// Undoes [`reset_on_close`]: the next close sends a FIN.
pub fn close_gracefully(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(None);
}

/// Makes the next close of `stream` send a RST instead of a FIN, so that a peer
/// sees a failed connection as failed.
pub fn reset_on_close(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use nix::fcntl::{FcntlArg, OFlag, fcntl};

    use super::*;

    fn is_nonblocking(socket: &impl AsFd) -> bool {
        let flags = fcntl(socket, FcntlArg::F_GETFL).expect("fcntl");
        OFlag::from_bits_retain(flags).contains(OFlag::O_NONBLOCK)
    }

    /// The kernel copies the listener's `TCP_NODELAY` and mark into the sockets it
    /// accepts; the listener and `connect`'s sockets are non-blocking and marked.
    /// Needs root (`IP_TRANSPARENT` wants `CAP_NET_ADMIN`); loopback only.
    #[tokio::test]
    #[ignore = "needs root"]
    async fn accepted_and_connected_sockets_have_nodelay_and_the_mark() {
        const MARK: u32 = 0x539;
        let listener = transparent_listener("127.0.0.1:0".parse().unwrap(), MARK)
            .expect("a transparent listener: this test needs root (CAP_NET_ADMIN)");
        assert!(is_nonblocking(&listener), "listener: O_NONBLOCK");
        let addr = listener.local_addr().unwrap();
        let client = connect(None, addr, MARK).await.unwrap();
        let (accepted, peer) = listener.accept().await.unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        for (which, stream) in [("accepted", &accepted), ("connected", &client)] {
            assert!(stream.nodelay().unwrap(), "{which}: TCP_NODELAY");
            assert_eq!(
                socket2::SockRef::from(stream).mark().unwrap(),
                MARK,
                "{which}"
            );
            assert!(is_nonblocking(stream), "{which}: O_NONBLOCK");
        }
    }

    /// A source and a destination of different families are refused before any
    /// socket is made, naming both.
    #[tokio::test]
    async fn a_source_of_another_family_is_refused() {
        let err = connect(
            Some("10.0.0.1".parse().unwrap()),
            "[::1]:9".parse().unwrap(),
            0,
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            err.to_string(),
            "the source 10.0.0.1 and the destination [::1]:9 are of different address families"
        );
    }

    /// `IP_BIND_ADDRESS_NO_PORT` is taken by IPv6 TCP sockets too.
    #[test]
    fn ipv6_sockets_take_bind_address_no_port() {
        let Ok(socket) = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP)) else {
            eprintln!("skipped: no IPv6 sockets here");
            return;
        };
        set_bind_address_no_port(&socket).unwrap();
    }

    /// An upstream connection from a client pod's IPv6 address (not the node's)
    /// keeps it as its source, with the mark; the listener is IPv6-only. In a
    /// network namespace of its own; needs root.
    #[test]
    #[ignore = "needs root"]
    fn ipv6_upstream_connections_keep_the_client_address() {
        use crate::dataplane::testing::{add_ipv6_address, in_new_network_namespace, ip};
        in_new_network_namespace(|| async {
            ip("link set lo up");
            assert!(
                crate::dataplane::net::ipv6_enabled(),
                "needs IPv6 (net.ipv6.conf.all.disable_ipv6 is 1, or the kernel has none)"
            );
            // The pod's address is not the node's: routed to this host as
            // replies to transparent sockets are (`local` route).
            add_ipv6_address("fd00::1/128", "lo");
            ip("-6 route add local fd00:0:0:1::/64 dev lo");
            let server = tokio::net::TcpListener::bind("[fd00::1]:8080")
                .await
                .unwrap();
            let pod: IpAddr = "fd00:0:0:1::5".parse().unwrap();
            let upstream = connect(Some(pod), "[fd00::1]:8080".parse().unwrap(), 0x539)
                .await
                .unwrap();
            let (_accepted, peer) = server.accept().await.unwrap();
            assert_eq!(peer.ip(), pod);
            assert_eq!(upstream.local_addr().unwrap(), peer);
            assert_eq!(socket2::SockRef::from(&upstream).mark().unwrap(), 0x539);

            let listener = transparent_listener("[::1]:15001".parse().unwrap(), 0x539).unwrap();
            assert!(socket2::SockRef::from(&listener).only_v6().unwrap());
            assert!(
                tokio::net::TcpStream::connect("[::ffff:127.0.0.1]:15001")
                    .await
                    .is_err(),
                "an IPv6-only listener takes no IPv4"
            );
        });
    }
}
