//! Copying a proxied connection's bytes both ways.
//!
//! Bytes move as [`Bytes`] chunks. A socket is read into memory that is not
//! zeroed first; an HBONE stream hands over the DATA frames h2 received, and
//! sends what was read as it is. Only reads under half their room are copied,
//! so that the room is kept. (tokio's `copy_bidirectional` zeroes two 64 KiB
//! buffers per connection, 6% of the agents' CPU in a connection-rate profile,
//! and copies into and out of each HBONE stream.)
//!
//! Memory is bounded per connection: each direction reads again only once what
//! it read is written, so at most [`LARGEST_READ`] bytes wait here per
//! direction, whatever the peers do. A peer that does not read stops the copy
//! towards it (and TCP's flow control then stops its sender); a peer that does
//! not send costs nothing here: a socket's room is made only once it has bytes
//! to read and let go while it has none. Idle connections are not closed here
//! (TCP connections may be idle for as long as their peers like); what bounds
//! them is the number of connections ([`ConnectionLimits`]).
//!
//! [`ConnectionLimits`]: super::ConnectionLimits

use std::{
    future::poll_fn,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes, BytesMut};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};

use crate::telemetry::connection::Metered;

/// The first read's room (bytes): what most requests and responses fit in.
const FIRST_READ: usize = 16 * 1024;
/// The largest read (bytes), reached by doubling while reads fill their room.
const LARGEST_READ: usize = 64 * 1024;

/// One direction's bytes in flight.
pub struct Chunk {
    /// Read and not yet written.
    data: Bytes,
    /// Memory that sockets are read into, of at most [`LARGEST_READ`] bytes;
    /// reused once nothing holds what was read from it (for an HBONE stream, once
    /// h2 has written it).
    room: BytesMut,
    /// The next read's room (bytes), from [`FIRST_READ`] to [`LARGEST_READ`].
    next: usize,
}

impl Chunk {
    /// Sets the data to copy next (for sources that receive it as [`Bytes`]).
    pub fn set_data(&mut self, data: Bytes) {
        self.data = data;
    }

    /// The data read and not yet written.
    pub fn data(&self) -> &Bytes {
        &self.data
    }
}

impl Default for Chunk {
    fn default() -> Self {
        Chunk {
            data: Bytes::new(),
            room: BytesMut::new(),
            next: FIRST_READ,
        }
    }
}

/// Where a direction's bytes come from.
pub trait Source: AsyncRead + Unpin {
    /// Reads the next bytes into `chunk`, whose data is empty; leaves it empty at
    /// the end of the stream (a half-close). The default reads the
    /// [`AsyncRead`] into the chunk's room.
    ///
    /// # Errors
    /// The reader's.
    fn poll_read_chunk(&mut self, cx: &mut Context<'_>, chunk: &mut Chunk) -> Poll<io::Result<()>> {
        read_into_room(self, cx, chunk)
    }
}

/// Reads `reader` into `chunk`'s room (see [`Source::poll_read_chunk`]), which
/// is made first if it is missing or too small.
fn read_into_room<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    cx: &mut Context<'_>,
    chunk: &mut Chunk,
) -> Poll<io::Result<()>> {
    let room = &mut chunk.room;
    // A room is never grown in place (`reserve` would keep the bytes before
    // its start and reach 112 KiB): it is reclaimed whole once nothing else
    // holds it, else a new one is made.
    if room.capacity() < chunk.next && !room.try_reclaim(chunk.next) {
        *room = BytesMut::with_capacity(chunk.next);
    }
    let offered = room.capacity();
    let n = ready!(tokio_util::io::poll_read_buf(Pin::new(reader), cx, room))?;
    if n == offered {
        chunk.next = (chunk.next * 2).min(LARGEST_READ);
    }
    // A small read is copied out so that the room is kept: a chunk handed on
    // (to h2's send queue) holds its whole allocation until it is written.
    chunk.data = if n * 2 < offered {
        let small = Bytes::copy_from_slice(room);
        room.clear();
        small
    } else {
        room.split().freeze()
    };
    Poll::Ready(Ok(()))
}

/// Where a direction's bytes go.
pub trait Sink: AsyncWrite + Unpin {
    /// Writes from the front of `data` (not empty) and advances it past what was
    /// written. The default writes a copy with [`AsyncWrite::poll_write`].
    ///
    /// # Errors
    /// The writer's, and [`io::ErrorKind::WriteZero`] if it takes nothing.
    fn poll_write_chunk(&mut self, cx: &mut Context<'_>, data: &mut Bytes) -> Poll<io::Result<()>> {
        let n = ready!(Pin::new(self).poll_write(cx, data))?;
        if n == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        data.advance(n);
        Poll::Ready(Ok(()))
    }
}

/// A socket's room is made only once it has bytes to read, and let go while it
/// has none: a connection that is idle (or never sent anything) holds no memory
/// here, only its sockets.
impl Source for TcpStream {
    fn poll_read_chunk(&mut self, cx: &mut Context<'_>, chunk: &mut Chunk) -> Poll<io::Result<()>> {
        // Readiness may be stale: a read that finds nothing lets the room go too.
        let read = match self.poll_read_ready(cx)? {
            Poll::Ready(()) => read_into_room(self, cx, chunk),
            Poll::Pending => Poll::Pending,
        };
        if read.is_pending() {
            chunk.room = BytesMut::new();
        }
        read
    }
}
impl Sink for TcpStream {}

#[cfg(test)]
impl Source for tokio::io::DuplexStream {}
#[cfg(test)]
impl Sink for tokio::io::DuplexStream {}

impl<T: Source + ?Sized> Source for &mut T {
    fn poll_read_chunk(&mut self, cx: &mut Context<'_>, chunk: &mut Chunk) -> Poll<io::Result<()>> {
        (**self).poll_read_chunk(cx, chunk)
    }
}

impl<T: Sink + ?Sized> Sink for &mut T {
    fn poll_write_chunk(&mut self, cx: &mut Context<'_>, data: &mut Bytes) -> Poll<io::Result<()>> {
        (**self).poll_write_chunk(cx, data)
    }
}

/// Zero-copy reads from the client, counted as bytes from the client.
impl<S: Source> Source for Metered<'_, S> {
    fn poll_read_chunk(&mut self, cx: &mut Context<'_>, chunk: &mut Chunk) -> Poll<io::Result<()>> {
        let (inner, traffic) = self.parts();
        ready!(inner.poll_read_chunk(cx, chunk))?;
        traffic.count_from_client(chunk.data().len());
        Poll::Ready(Ok(()))
    }
}

/// Writes to the client, counted as bytes to the client.
impl<S: Sink> Sink for Metered<'_, S> {
    fn poll_write_chunk(&mut self, cx: &mut Context<'_>, data: &mut Bytes) -> Poll<io::Result<()>> {
        let (inner, traffic) = self.parts();
        let before = data.len();
        ready!(inner.poll_write_chunk(cx, data))?;
        traffic.count_to_client(before - data.len());
        Poll::Ready(Ok(()))
    }
}

/// One direction of a copy.
#[derive(Default)]
struct Half {
    chunk: Chunk,
    read_done: bool,
    unflushed: bool,
    bytes: u64,
    /// Written, flushed and shut down: the bytes it carried.
    done: Option<u64>,
}

impl Half {
    /// Copies from `from` to `to` until `from` ends, then shuts `to` down
    /// (passing the half-close on); returns the bytes copied.
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut R,
        to: &mut W,
    ) -> Poll<io::Result<u64>>
    where
        R: Source + ?Sized,
        W: Sink + ?Sized,
    {
        if let Some(bytes) = self.done {
            return Poll::Ready(Ok(bytes));
        }
        loop {
            if !self.chunk.data.is_empty() {
                let before = self.chunk.data.len();
                ready!(to.poll_write_chunk(cx, &mut self.chunk.data))?;
                self.bytes += (before - self.chunk.data.len()) as u64;
                self.unflushed = true;
                continue;
            }
            if self.read_done {
                ready!(Pin::new(&mut *to).poll_flush(cx))?;
                ready!(Pin::new(&mut *to).poll_shutdown(cx))?;
                self.done = Some(self.bytes);
                // The chunk's memory is not needed any more.
                self.chunk = Chunk::default();
                return Poll::Ready(Ok(self.bytes));
            }
            // What was written is no longer referenced here: the room can be
            // reused if nothing else holds it.
            self.chunk.data = Bytes::new();
            match from.poll_read_chunk(cx, &mut self.chunk) {
                Poll::Pending => {
                    if self.unflushed {
                        ready!(Pin::new(&mut *to).poll_flush(cx))?;
                        self.unflushed = false;
                    }
                    return Poll::Pending;
                }
                Poll::Ready(result) => {
                    result?;
                    self.read_done = self.chunk.data.is_empty();
                }
            }
        }
    }
}

/// Copies between `a` and `b` until both directions end; a half-close is passed
/// on as one. Returns the bytes copied a→b and b→a. On an error the caller
/// decides how the sockets close (a RST, so that the peers see the failure).
///
/// # Errors
/// The first read or write error of either direction.
pub async fn bidirectional<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: Source + Sink + ?Sized,
    B: Source + Sink + ?Sized,
{
    let (mut ab, mut ba) = (Half::default(), Half::default());
    poll_fn(|cx| {
        let forward = ab.poll_copy(cx, &mut *a, &mut *b)?;
        let back = ba.poll_copy(cx, &mut *b, &mut *a)?;
        let forward = ready!(forward);
        let back = ready!(back);
        Poll::Ready(Ok((forward, back)))
    })
    .await
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    /// Both directions carry every byte in order, across reads of every size the
    /// room grows through, and each half-close is passed on.
    #[tokio::test]
    async fn copies_both_ways_and_passes_half_closes_on() {
        let (mut client, mut a) = duplex(LARGEST_READ * 2);
        let (mut b, mut server) = duplex(LARGEST_READ * 2);
        let copier = tokio::spawn(async move { bidirectional(&mut a, &mut b).await });
        let up: Vec<u8> = (0..1_000_003u32).map(|i| (i % 253) as u8).collect();
        let down: Vec<u8> = (0..300_007u32).map(|i| (i % 241) as u8).collect();
        let (writer, reader) = {
            let up = up.clone();
            let down = down.clone();
            let writer = tokio::spawn(async move {
                // Small writes first, then large ones.
                for piece in up.chunks(7).take(100) {
                    client.write_all(piece).await.unwrap();
                }
                client.write_all(&up[700..]).await.unwrap();
                client.shutdown().await.unwrap();
                let mut back = Vec::new();
                client.read_to_end(&mut back).await.unwrap();
                back
            });
            let reader = tokio::spawn(async move {
                let mut got = Vec::new();
                server.read_to_end(&mut got).await.unwrap();
                server.write_all(&down).await.unwrap();
                server.shutdown().await.unwrap();
                got
            });
            (writer, reader)
        };
        assert_eq!(reader.await.unwrap(), up);
        assert_eq!(writer.await.unwrap(), down);
        let (forward, back) = copier.await.unwrap().unwrap();
        assert_eq!((forward, back), (up.len() as u64, down.len() as u64));
    }

    /// Reads that fill their room make the next room larger, up to the largest;
    /// small reads leave the room to be reused rather than handed on.
    #[tokio::test]
    async fn the_room_grows_with_full_reads_and_small_reads_are_copied_out() {
        let (mut w, mut r) = duplex(LARGEST_READ * 5);
        w.write_all(&vec![1u8; LARGEST_READ * 5]).await.unwrap();
        let mut chunk = Chunk::default();
        let (mut sizes, mut at) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            // What was read before is dropped, as once written.
            chunk.data = Bytes::new();
            poll_fn(|cx| r.poll_read_chunk(cx, &mut chunk))
                .await
                .unwrap();
            sizes.push(chunk.data.len());
            at.push(chunk.data.as_ptr());
        }
        assert_eq!(
            sizes,
            [
                FIRST_READ,
                FIRST_READ * 2,
                LARGEST_READ,
                LARGEST_READ,
                LARGEST_READ
            ]
        );
        assert_eq!(chunk.next, LARGEST_READ);
        // Once at its largest, the same room is reused whole.
        assert!(at[2] == at[3] && at[3] == at[4], "{at:?}");

        drop(w);
        let (mut w, mut r) = duplex(64);
        w.write_all(b"hello").await.unwrap();
        let mut chunk = Chunk::default();
        poll_fn(|cx| r.poll_read_chunk(cx, &mut chunk))
            .await
            .unwrap();
        assert_eq!(&chunk.data[..], b"hello");
        assert!(chunk.room.is_empty() && chunk.room.capacity() >= FIRST_READ);
        assert_eq!(chunk.next, FIRST_READ);
        // The end of the stream leaves the data empty.
        drop(w);
        chunk.data = Bytes::new();
        poll_fn(|cx| r.poll_read_chunk(cx, &mut chunk))
            .await
            .unwrap();
        assert!(chunk.data.is_empty());
    }

    /// A socket with nothing to read holds no room: none is made before its first
    /// bytes, and the room is let go once it has none left.
    #[tokio::test]
    async fn an_idle_socket_holds_no_room() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut accepted, _) = listener.accept().await.unwrap();
        let mut chunk = Chunk::default();
        let poll = |s: &mut TcpStream, chunk: &mut Chunk| {
            let waker = futures_util::task::noop_waker();
            let mut cx = Context::from_waker(&waker);
            s.poll_read_chunk(&mut cx, chunk)
        };
        assert!(poll(&mut accepted, &mut chunk).is_pending());
        assert_eq!(chunk.room.capacity(), 0);
        client.write_all(b"hello").await.unwrap();
        let read = poll_fn(|cx| accepted.poll_read_chunk(cx, &mut chunk));
        tokio::time::timeout(std::time::Duration::from_secs(10), read)
            .await
            .expect("the bytes arrive")
            .unwrap();
        assert_eq!(&chunk.data[..], b"hello");
        assert!(chunk.room.capacity() >= FIRST_READ);
        chunk.data = Bytes::new();
        assert!(poll(&mut accepted, &mut chunk).is_pending());
        assert_eq!(chunk.room.capacity(), 0, "the room is let go when idle");
    }

    /// A writer that takes nothing is an error, not a busy loop.
    #[tokio::test]
    async fn a_writer_that_takes_nothing_is_an_error() {
        struct Full;
        impl AsyncWrite for Full {
            fn poll_write(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &[u8],
            ) -> Poll<io::Result<usize>> {
                Poll::Ready(Ok(0))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
                Poll::Ready(Ok(()))
            }
        }
        impl Sink for Full {}
        let mut data = Bytes::from_static(b"x");
        let err = poll_fn(|cx| Full.poll_write_chunk(cx, &mut data))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WriteZero);
    }
}
