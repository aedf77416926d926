//! Request/response: round trips of a fixed size on one open connection.

use std::{
    io::{Read, Write},
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::Result;
use podlink_tests::{Pod, app};

use super::stats::percentile;

/// Round-trip times (µs) of `size`-byte messages on one connection: p50 and p99.
pub(super) fn latency(
    client: &Pod,
    server: SocketAddr,
    size: usize,
    round_trips: usize,
) -> Result<[f64; 2]> {
    let mut stream = app::connect(&client.netns, server, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    app::read_greeting(&stream)?;
    let msg = vec![0x5a; size];
    let mut back = vec![0; size];
    for _ in 0..100 {
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
    }
    let mut rtts = Vec::with_capacity(round_trips);
    for _ in 0..round_trips {
        let t = Instant::now();
        stream.write_all(&msg)?;
        stream.read_exact(&mut back)?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    rtts.sort_by(f64::total_cmp);
    Ok([percentile(&rtts, 0.5), percentile(&rtts, 0.99)])
}
