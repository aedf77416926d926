//! Copying a proxied connection's bytes both ways.

use std::io;

use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};

use super::socket::reset_on_close;

/// Buffer size of each direction (bytes).
const BUFFER: usize = 64 * 1024;

/// Copies between the downstream connection `tcp` and `upstream` until both
/// directions end; a half-close is passed on as one. Returns the bytes sent
/// downstream→upstream and upstream→downstream. On an error `tcp` is set to close
/// with a RST, so the client sees the failure.
pub async fn bidirectional<U>(tcp: &mut TcpStream, upstream: &mut U) -> io::Result<(u64, u64)>
where
    U: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let result = tokio::io::copy_bidirectional_with_sizes(tcp, upstream, BUFFER, BUFFER).await;
    if result.is_err() {
        reset_on_close(tcp);
    }
    result
}
