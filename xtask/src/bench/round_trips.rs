//! Request/response: round trips of a fixed size on one open connection, as
//! fast as they go, and on many connections at a fixed rate.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{Pod, app};

use super::stats::percentile;

/// Round-trip times (µs) of `size`-byte messages on one connection: p50 and p99.
pub(super) fn latency(
    client: &Pod,
    server: SocketAddr,
    size: usize,
    round_trips: usize,
) -> Result<[f64; 2]> {
    let mut stream = open(client, server)?;
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

/// A connection from `client` to the echo server at `server`, `TCP_NODELAY`,
/// its greeting read.
fn open(client: &Pod, server: SocketAddr) -> Result<TcpStream> {
    let stream = app::connect(&client.netns, server, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    app::read_greeting(&stream)?;
    Ok(stream)
}

/// The fixed request rate (requests/s) of the efficiency table's run.
pub(super) const FIXED_RATE: f64 = 1_000.0;
/// Its keep-alive connections, each carrying an equal share of the rate.
pub(super) const FIXED_RATE_CONNECTIONS: usize = 16;
/// Its length (s).
pub(super) const FIXED_RATE_SECONDS: f64 = 10.0;
/// The size of a request and of its echo (bytes).
const REQUEST_BYTES: usize = 1024;

/// What a run at a fixed rate carried.
#[derive(Debug)]
pub(super) struct FixedRate {
    /// Requests answered.
    pub(super) requests: u64,
    /// From the first request's time to the last answer (s).
    pub(super) seconds: f64,
    /// Round-trip time of a request, from its send (µs), p50.
    pub(super) p50_us: f64,
}

impl FixedRate {
    /// Requests answered per second.
    pub(super) fn rate(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
}

/// `rate` requests per second of [`REQUEST_BYTES`] to the echo server at
/// `server`, over `connections` connections from `client` opened first, for
/// `seconds`: connection `i` sends its `k`-th request at `(k · connections + i)
/// / rate` s after the start (at once when late) and reads its echo.
///
/// # Errors
/// A connection that cannot be opened, or a request left without its echo.
pub(super) fn fixed_rate(
    client: &Pod,
    server: SocketAddr,
    rate: f64,
    connections: usize,
    seconds: f64,
) -> Result<FixedRate> {
    let streams = (0..connections)
        .map(|_| open(client, server))
        .collect::<Result<Vec<_>>>()
        .context("opening the fixed-rate run's connections")?;
    let start = Instant::now() + Duration::from_millis(50);
    let length = Duration::from_secs_f64(seconds);
    let threads: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(i, mut stream)| {
            std::thread::spawn(move || -> std::io::Result<Vec<f64>> {
                let msg = [0x5a; REQUEST_BYTES];
                let mut back = [0; REQUEST_BYTES];
                let mut mine = Vec::new();
                for k in 0.. {
                    let at = Duration::from_secs_f64((k * connections + i) as f64 / rate);
                    if at >= length {
                        break;
                    }
                    let at = start + at;
                    if let Some(wait) = at.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let sent = Instant::now();
                    stream.write_all(&msg)?;
                    stream.read_exact(&mut back)?;
                    mine.push(sent.elapsed().as_secs_f64() * 1e6);
                }
                Ok(mine)
            })
        })
        .collect();
    let mut rtts = Vec::new();
    for t in threads {
        rtts.extend(
            t.join()
                .map_err(|_| anyhow::anyhow!("a fixed-rate client panicked"))?
                .context("a fixed-rate request")?,
        );
    }
    let elapsed = start.elapsed().as_secs_f64();
    if rtts.is_empty() {
        bail!("the fixed-rate run answered no request");
    }
    rtts.sort_by(f64::total_cmp);
    Ok(FixedRate {
        requests: rtts.len() as u64,
        seconds: elapsed,
        p50_us: percentile(&rtts, 0.5),
    })
}
