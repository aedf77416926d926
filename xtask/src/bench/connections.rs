//! Connection rate and churn: client threads opening one connection after the
//! other, counted per second, and the phases of a connection as its client sees
//! them.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Result;
use podlink_tests::{Pod, app, netns};
use serde::Serialize;

use super::{
    Path2,
    stats::{percentile, stats},
};

/// What a run of connecting clients did.
#[derive(Clone, Debug, Serialize)]
pub(super) struct ClientRun {
    /// Connections completed in each second of the run.
    pub(super) per_second: Vec<u64>,
    pub(super) completed: u64,
    pub(super) failed: u64,
    pub(super) seconds: f64,
    /// Where a completed connection's time went, p50 of each phase (when asked
    /// for, and some connection completed).
    pub(super) phases: Option<Phases>,
}

/// The phases of a connection as its client sees them (µs): `connect()` until it
/// returns (once the kernel completed the handshake on the listening socket: on
/// the podlink path the outbound proxy's, before the proxy accepts it), then
/// until the server's greeting is read, then sending 1 KiB, half-closing and
/// reading the echo to the end of the stream; and the whole. On the podlink
/// path the greeting waits for the proxy's accept, the HBONE CONNECT, the
/// upstream connection to the server pod and the greeting's way back through
/// both proxies; the echo and the close cross both proxies there and back.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(super) struct Phases {
    pub(super) connect_us: f64,
    pub(super) greeting_us: f64,
    pub(super) echo_close_us: f64,
    pub(super) total_us: f64,
}

impl Phases {
    /// The p50 of each phase over `samples` (one per connection: the phases'
    /// seconds, then the whole's); `None` without samples.
    pub(super) fn p50(samples: &[[f64; 4]]) -> Option<Phases> {
        if samples.is_empty() {
            return None;
        }
        let at = |i: usize| {
            let mut v: Vec<f64> = samples.iter().map(|s| s[i] * 1e6).collect();
            v.sort_by(f64::total_cmp);
            percentile(&v, 0.5)
        };
        Some(Phases {
            connect_us: at(0),
            greeting_us: at(1),
            echo_close_us: at(2),
            total_us: at(3),
        })
    }

    /// Each field's median over `runs` (as the main table's medians); `None`
    /// without runs.
    pub(super) fn median(runs: &[Phases]) -> Option<Phases> {
        if runs.is_empty() {
            return None;
        }
        let of = |f: fn(&Phases) -> f64| stats(&runs.iter().map(f).collect::<Vec<_>>()).median;
        Some(Phases {
            connect_us: of(|p| p.connect_us),
            greeting_us: of(|p| p.greeting_us),
            echo_close_us: of(|p| p.echo_close_us),
            total_us: of(|p| p.total_us),
        })
    }
}

impl ClientRun {
    pub(super) fn rate(&self) -> f64 {
        self.completed as f64 / self.seconds
    }

    /// Connections per second over the first (`last == false`) or last `window`
    /// seconds.
    pub(super) fn window_rate(&self, window: u64, last: bool) -> f64 {
        let n = self.per_second.len();
        let w = (window as usize).min(n);
        let slice = if last {
            &self.per_second[n - w..]
        } else {
            &self.per_second[..w]
        };
        slice.iter().sum::<u64>() as f64 / w as f64
    }
}

/// `per_target` client threads for each (client pod, echo server) target, each
/// opening one connection after the other (connect, greeting, 1 KiB each way,
/// close) for `seconds`. Completions are counted in the second they end in; with
/// `phases`, each completed connection's phases are timed too ([`Phases`]).
pub(super) fn run_clients(
    targets: &[(&Pod, SocketAddr)],
    per_target: usize,
    seconds: f64,
    phases: bool,
) -> Result<ClientRun> {
    let length = Duration::from_secs_f64(seconds);
    let buckets: Arc<Vec<AtomicU64>> = Arc::new(
        (0..seconds.ceil() as usize)
            .map(|_| AtomicU64::new(0))
            .collect(),
    );
    let failed = Arc::new(AtomicU64::new(0));
    let timed = phases;
    let phases = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let mut threads = Vec::new();
    for (client, server) in targets {
        for _ in 0..per_target {
            let (buckets, failed, phases, server) =
                (buckets.clone(), failed.clone(), phases.clone(), *server);
            threads.push(netns::spawn_in_netns(&client.netns, move || {
                let payload = [0x42u8; 1024];
                let mut mine: Vec<[f64; 4]> = Vec::new();
                while start.elapsed() < length {
                    let one = || -> std::io::Result<[f64; 4]> {
                        let begin = Instant::now();
                        let mut s =
                            std::net::TcpStream::connect_timeout(&server, Duration::from_secs(5))?;
                        let connected = Instant::now();
                        s.set_read_timeout(Some(Duration::from_secs(5)))?;
                        app::read_greeting(&s)?;
                        let greeted = Instant::now();
                        s.write_all(&payload)?;
                        s.shutdown(Shutdown::Write)?;
                        let mut back = Vec::with_capacity(1024);
                        s.read_to_end(&mut back)?;
                        if back.len() != payload.len() {
                            return Err(std::io::Error::other("short echo"));
                        }
                        let end = Instant::now();
                        Ok([
                            (connected - begin).as_secs_f64(),
                            (greeted - connected).as_secs_f64(),
                            (end - greeted).as_secs_f64(),
                            (end - begin).as_secs_f64(),
                        ])
                    };
                    let result = one();
                    let at = start.elapsed();
                    match result {
                        Ok(phases) if at < length => {
                            buckets[at.as_secs() as usize].fetch_add(1, Ordering::Relaxed);
                            if timed {
                                mine.push(phases);
                            }
                        }
                        Ok(_) => {}
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                phases.lock().unwrap().append(&mut mine);
            })?);
        }
    }
    for t in threads {
        let _ = t.join();
    }
    let phases = Phases::p50(&phases.lock().unwrap());
    let per_second: Vec<u64> = buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
    let failed = failed.load(Ordering::Relaxed);
    if failed > 0 {
        eprintln!("bench: {failed} connections failed during a connection run");
    }
    Ok(ClientRun {
        completed: per_second.iter().sum(),
        per_second,
        failed,
        seconds,
        phases,
    })
}

#[derive(Serialize)]
pub(super) struct Churn {
    pub(super) direct: ClientRun,
    pub(super) podlink: ClientRun,
    pub(super) podlink_agent_cpu_seconds: f64,
}

/// The phases of the one-client connection runs: each run's p50s, and their
/// medians over the runs, per path (`None` if no run completed a connection).
#[derive(Serialize)]
pub(super) struct OneClientPhases {
    pub(super) direct: Option<Phases>,
    pub(super) podlink: Option<Phases>,
    pub(super) runs: [Vec<Phases>; 2],
}

impl OneClientPhases {
    pub(super) fn new(runs: [Vec<Phases>; 2]) -> Self {
        OneClientPhases {
            direct: Phases::median(&runs[Path2::Direct as usize]),
            podlink: Phases::median(&runs[Path2::Podlink as usize]),
            runs,
        }
    }
}
