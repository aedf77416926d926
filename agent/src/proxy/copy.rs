//! Copying a proxied connection's bytes both ways.

use std::io;

use tokio::io::{AsyncRead, AsyncWrite};

/// Buffer size of each direction (bytes).
const BUFFER: usize = 64 * 1024;

/// Copies between `a` and `b` until both directions end; a half-close is passed
/// on as one. Returns the bytes copied a→b and b→a. On an error the caller
/// decides how the sockets close (a RST, so that the peers see the failure).
pub async fn bidirectional<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    tokio::io::copy_bidirectional_with_sizes(a, b, BUFFER, BUFFER).await
}
