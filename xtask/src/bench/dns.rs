//! The DNS rows: queries answered from the agent's own names, and queries the
//! agent forwards, each against the direct path (the pod asking the resolver,
//! a dnsmasq in a pod outside the mesh on node 2, as CoreDNS would be).
//!
//! * Own names: [`DNS_CLIENTS`] threads in the client pod, each asking the A
//!   record of a Service name over UDP, one query after the other, for the
//!   run's seconds; answers per second. On the podlink path the agent answers
//!   (the Service is in its name table); on the direct path the resolver
//!   answers the same name (it has it as a record of its own).
//! * Forwarded: one query after the other, each for a name never asked before
//!   (`<n>-<nonce>.ext.bench`, which the resolver answers: a cache miss in the
//!   agent every time), [`DNS_FORWARDED`] of them after 100 to warm up; the p50
//!   of the times. The comparison is what forwarding through the agent adds.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use podlink_tests::{
    Cluster, Pod, PodSpec,
    dns::{QueryType as RecordType, Resolver, ask_udp, query_bytes},
    netns,
};

use super::{
    Path2,
    main_table::{Compare, Row, Series},
    stats::percentile,
};

/// The Service whose name the own-names row asks, and its ClusterIP.
pub(super) const SERVICE_NAME: &str = "web.mesh.svc.cluster.local";
const SERVICE_IP: &str = "10.96.0.53";
/// The zone the resolver answers every name of (the forwarded row's names).
const FORWARDED_ZONE: &str = "ext.bench";
/// Threads asking at once in the own-names row.
pub(super) const DNS_CLIENTS: usize = 4;
/// Forwarded queries timed per run.
pub(super) const DNS_FORWARDED: usize = 2_000;
/// A query unanswered this long fails the run.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(3);

/// The Service manifest of [`SERVICE_NAME`].
fn service_manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: mesh}}\nspec:\n  clusterIP: {SERVICE_IP}\n  ports:\n  - {{port: 80}}\n"
    )
}

/// Makes the resolver pod (on node 2, outside the mesh) with its dnsmasq, and
/// the Service the agent answers.
pub(super) fn start_resolver(c: &mut Cluster) -> Result<(Pod, Resolver)> {
    c.write_manifest("service-web-dns.yaml", &service_manifest())?;
    let pod = c.add_pod(PodSpec::new("resolver", Path2::Direct.namespace(), 1))?;
    let resolver = Resolver::start(
        &pod.netns,
        IpAddr::V4(pod.ip),
        &[(SERVICE_NAME, SERVICE_IP), (FORWARDED_ZONE, "192.0.2.7")],
        &[],
        false,
    )?;
    Ok((pod, resolver))
}

/// Answers per second of `DNS_CLIENTS` threads asking [`SERVICE_NAME`] from
/// `client` to `resolver` for `seconds`.
pub(super) fn own_names_rate(client: &Pod, resolver: IpAddr, seconds: f64) -> Result<f64> {
    let server = SocketAddr::new(resolver, 53);
    let answered = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let threads: Vec<_> = (0..DNS_CLIENTS)
        .map(|_| {
            let (answered, failed) = (answered.clone(), failed.clone());
            let query = query_bytes(&format!("{SERVICE_NAME}."), RecordType::A, false);
            netns::spawn_in_netns(&client.netns, move || {
                while Instant::now() < until {
                    if ask_udp(&query, server, ANSWER_TIMEOUT).is_none() {
                        failed.store(true, Ordering::Relaxed);
                        return;
                    }
                    answered.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect::<std::io::Result<_>>()?;
    for t in threads {
        let _ = t.join();
    }
    if failed.load(Ordering::Relaxed) {
        bail!(
            "a query for {SERVICE_NAME} from {} got no answer",
            client.name
        );
    }
    Ok(answered.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

/// The p50 (µs) of `n` queries from `client` to `resolver`, each for a name
/// not asked before.
pub(super) fn forwarded_latency(client: &Pod, resolver: IpAddr, n: usize) -> Result<f64> {
    let server = SocketAddr::new(resolver, 53);
    let nonce = format!("{:x}", std::process::id() ^ fastnonce());
    let times = netns::in_netns(&client.netns, move || {
        let mut times = Vec::with_capacity(n);
        for i in 0..n + 100 {
            let query = query_bytes(
                &format!("q{i}-{nonce}.{FORWARDED_ZONE}."),
                RecordType::A,
                false,
            );
            let t = Instant::now();
            ask_udp(&query, server, ANSWER_TIMEOUT).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer to query {i}"),
                )
            })?;
            if i >= 100 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(times)
    })
    .with_context(|| format!("forwarded queries from {}", client.name))?;
    let mut times = times;
    times.sort_by(f64::total_cmp);
    Ok(percentile(&times, 0.5))
}

/// A number that differs between runs, so that each run's names are new.
fn fastnonce() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

/// The DNS rows of the main table: own names' answers per second over
/// `seconds`-long runs, and the p50 of `n` forwarded queries.
pub(super) fn rows(own: &Series, forwarded: &Series, seconds: f64, n: usize) -> Vec<Row> {
    vec![
        Row::compared(
            &format!("DNS, agent's own names: queries/s, {DNS_CLIENTS} clients, {seconds} s"),
            "queries/s",
            own,
            Compare::RatioAtLeast(1.0),
        ),
        Row::compared(
            &format!("DNS, forwarded query: {n} new names, p50"),
            "µs",
            forwarded,
            Compare::AddedAtMost(150.0),
        ),
    ]
}
