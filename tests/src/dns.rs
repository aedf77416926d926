//! DNS on the test bed: a real resolver (Debian's dnsmasq) in a network
//! namespace of the test, and a stub client that asks from a pod's namespace
//! over UDP or TCP, as a pod's resolver library does.

use std::{
    fs,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use hickory_proto::{
    op::{Edns, Message, Query},
    rr::{Name, RecordType},
};

use crate::netns::{self, Resource};

pub use hickory_proto::rr::RecordType as QueryType;

/// The dnsmasq binary (package `dnsmasq-base`, which starts no system service).
pub const DNSMASQ: &str = "/usr/sbin/dnsmasq";

/// A dnsmasq answering on `addr:53` in a network namespace, logging every
/// query it receives; killed on drop.
pub struct Resolver {
    child: Child,
    /// Where it listens (port 53).
    pub addr: IpAddr,
    log: PathBuf,
    _dir: PathBuf,
}

impl Resolver {
    /// Starts dnsmasq in `netns` on `addr` (an address of that namespace),
    /// with no upstream, answering `records`: `(name, A address)` pairs (the
    /// name's subdomains too), and `txt` TXT records (`(name, strings)`, e.g.
    /// large ones for truncation); logging each query when `log_queries`
    /// ([`Resolver::queries`] reads them). Fails loudly when dnsmasq is not
    /// installed.
    pub fn start(
        netns_name: &str,
        addr: IpAddr,
        records: &[(&str, &str)],
        txt: &[(&str, Vec<String>)],
        log_queries: bool,
    ) -> Result<Self> {
        if !std::path::Path::new(DNSMASQ).exists() {
            bail!(
                "{DNSMASQ} is missing: install Debian's dnsmasq-base (cargo xtask test installs it)"
            );
        }
        let dir = std::env::temp_dir().join(format!(
            "podlink-dnsmasq-{}-{}",
            std::process::id(),
            netns_name
        ));
        fs::create_dir_all(&dir)?;
        netns::register(Resource::Dir(dir.clone()));
        let log = dir.join("queries.log");
        let mut cmd = netns::command_in(netns_name, DNSMASQ);
        cmd.args([
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--user=root",
            "--cache-size=0",
            "--port=53",
        ])
        .arg(format!("--listen-address={addr}"))
        .arg(format!("--log-facility={}", log.display()))
        .arg(format!("--pid-file={}", dir.join("pid").display()));
        if log_queries {
            cmd.arg("--log-queries");
        }
        for (name, a) in records {
            cmd.arg(format!("--address=/{name}/{a}"));
        }
        for (name, strings) in txt {
            cmd.arg(format!("--txt-record={name},{}", strings.join(",")));
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting dnsmasq")?;
        netns::register(Resource::Process(child.id()));
        let resolver = Resolver {
            child,
            addr,
            log,
            _dir: dir,
        };
        // Ready once it answers.
        let deadline = Instant::now() + Duration::from_secs(10);
        let probe = query_bytes("ready.invalid.", RecordType::A, false);
        let server = SocketAddr::new(addr, 53);
        loop {
            let probe = probe.clone();
            let answered = netns::in_netns(netns_name, move || {
                Ok(ask_udp(&probe, server, Duration::from_millis(200)))
            })?;
            if answered.is_some() {
                return Ok(resolver);
            }
            if Instant::now() > deadline {
                bail!("dnsmasq did not answer on {server}");
            }
        }
    }

    /// The query log lines so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many queries for `name` (as dnsmasq logs it: `query[A] name from
    /// ip`) came from `from`, if given, else from anywhere.
    pub fn queries(&self, name: &str, from: Option<IpAddr>) -> usize {
        self.log()
            .lines()
            .filter(|l| l.contains("query[") && l.contains(&format!(" {name} from ")))
            .filter(|l| from.is_none_or(|ip| l.ends_with(&format!(" from {ip}"))))
            .count()
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        netns::unregister(&Resource::Process(self.child.id()));
    }
}

/// A recursive query for `name` (with the final dot) of type `qtype`, with an
/// EDNS(0) OPT record (payload 1232) when `edns`.
pub fn query_bytes(name: &str, qtype: RecordType, edns: bool) -> Vec<u8> {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).expect("a name"), qtype));
    if edns {
        let mut e = Edns::new();
        e.set_max_payload(1232);
        m.set_edns(e);
    }
    m.to_vec().expect("a query encodes")
}

/// Sends `query` over UDP to `server` from the calling thread's namespace;
/// the answer with the query's ID, if one comes within `wait`.
pub fn ask_udp(query: &[u8], server: SocketAddr, wait: Duration) -> Option<Vec<u8>> {
    let bind: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let socket = UdpSocket::bind(bind).ok()?;
    socket.connect(server).ok()?;
    socket.send(query).ok()?;
    let deadline = Instant::now() + wait;
    let mut buf = vec![0u8; 65535];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        socket
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        let n = socket.recv(&mut buf).ok()?;
        if n >= 2 && query.len() >= 2 && buf[..2] == query[..2] {
            return Some(buf[..n].to_vec());
        }
    }
}

/// Sends `query` over TCP to `server` (two-byte length framing, RFC 7766) and
/// reads one answer within `wait`.
pub fn ask_tcp(query: &[u8], server: SocketAddr, wait: Duration) -> std::io::Result<Vec<u8>> {
    let mut stream = TcpStream::connect_timeout(&server, wait)?;
    stream.set_read_timeout(Some(wait))?;
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(query);
    stream.write_all(&framed)?;
    let mut len = [0u8; 2];
    stream.read_exact(&mut len)?;
    let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut answer)?;
    Ok(answer)
}

/// The addresses (A and AAAA) in `answer`.
pub fn addresses(answer: &Message) -> Vec<IpAddr> {
    answer
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            hickory_proto::rr::RData::A(a) => Some(IpAddr::V4(a.0)),
            hickory_proto::rr::RData::AAAA(a) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect()
}
