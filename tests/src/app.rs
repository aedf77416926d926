//! The applications of the test bed: an echo server that tells each client the
//! address it sees, and a client for it.
//!
//! Protocol: on accept the server writes `peer=<ip>:<port>\n`, then echoes every
//! byte until the client half-closes, then closes.

use std::{
    io::{self, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::netns;

/// A running echo server; stops when dropped.
pub struct EchoServer {
    pub addr: SocketAddr,
    fd: RawFd,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EchoServer {
    /// Starts a server on `addr` inside network namespace `netns`.
    pub fn start(netns_name: &str, addr: SocketAddr) -> io::Result<Self> {
        let listener = netns::in_netns(netns_name, move || TcpListener::bind(addr))?;
        let fd = listener.as_raw_fd();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let accepted = accepted.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, peer)) => {
                            accepted.fetch_add(1, Ordering::Relaxed);
                            std::thread::spawn(move || {
                                let _ = serve(stream, peer);
                            });
                        }
                        // Woken by the shutdown in `drop`, or out of descriptors.
                        Err(_) => std::thread::sleep(Duration::from_millis(1)),
                    }
                }
            })
        };
        Ok(Self {
            addr,
            fd,
            accepted,
            stop,
            thread: Some(thread),
        })
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the blocked accept (it fails with EINVAL from now on).
        // SAFETY: the listener is still open: the thread owns it until joined.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut stream: TcpStream, peer: SocketAddr) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    stream.write_all(format!("peer={peer}\n").as_bytes())?;
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
    }
    stream.shutdown(Shutdown::Write)
}

/// What a client saw of one exchange with an [`EchoServer`].
#[derive(Debug)]
pub struct Exchange {
    /// The client address the server saw.
    pub peer_seen: SocketAddr,
    /// The bytes echoed back.
    pub echoed: Vec<u8>,
}

/// Connects from network namespace `netns` to `dst` (with a timeout).
pub fn connect(netns_name: &str, dst: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    netns::in_netns(netns_name, move || {
        let s = TcpStream::connect_timeout(&dst, timeout)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.set_write_timeout(Some(Duration::from_secs(20)))?;
        Ok(s)
    })
}

/// Reads the server's `peer=` greeting from a fresh connection.
pub fn read_greeting(stream: &TcpStream) -> io::Result<SocketAddr> {
    let mut line = String::new();
    let mut reader = stream;
    // Byte by byte, so nothing after the newline is consumed.
    let mut byte = [0u8; 1];
    while !line.ends_with('\n') {
        if reader.read(&mut byte)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("connection closed before the greeting (got {line:?})"),
            ));
        }
        line.push(byte[0] as char);
    }
    line.trim()
        .strip_prefix("peer=")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| io::Error::other(format!("unexpected greeting {line:?}")))
}

/// Sends `payload` on an open connection and reads back its echo.
pub fn echo_round(stream: &mut TcpStream, payload: &[u8]) -> io::Result<Vec<u8>> {
    stream.write_all(payload)?;
    let mut back = vec![0u8; payload.len()];
    stream.read_exact(&mut back)?;
    Ok(back)
}

/// Connects, reads the greeting, sends `payload`, half-closes, and reads the echo to
/// the end.
pub fn exchange(netns_name: &str, dst: SocketAddr, payload: &[u8]) -> io::Result<Exchange> {
    let mut stream = connect(netns_name, dst, Duration::from_secs(5))?;
    let peer_seen = read_greeting(&stream)?;
    stream.write_all(payload)?;
    stream.shutdown(Shutdown::Write)?;
    let mut echoed = Vec::new();
    stream.read_to_end(&mut echoed)?;
    Ok(Exchange { peer_seen, echoed })
}
