//! The CA is rotated while traffic flows, the way an operator rotates a CA mounted
//! from a Kubernetes Secret (whose `..data` symlink is swapped in one step): (a)
//! the new root is added to the trust bundle, (b) the new CA signs, the old root
//! still trusted, (c) the old root is removed. An enrolled pod on node 1 opens new
//! connections to a pod on node 2 all along; none fails. And a CA file replaced
//! with garbage is refused with a log line naming it, and traffic keeps flowing.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use http::StatusCode;
use podlink_agent::identity::{SpiffeId, ca::generate_ca};
use podlink_tests::{Cluster, Pod, PodSpec, app};

mod common;
use common::{attempt, credentials};

/// Connections' outcomes, by the phase they began in.
type Outcomes = Arc<Mutex<Vec<(usize, Result<(), String>)>>>;

/// How long the agents may take to see a change of the CA files (they watch the
/// directory and poll every 5 s).
const RELOAD_LIMIT: Duration = Duration::from_secs(30);
/// The agents' line for a CA change put in force.
const RELOADED: &str = "CA changed: reissued";

/// A directory laid out as a Kubernetes Secret volume: `ca.crt -> ..data/ca.crt`,
/// `..data -> ..v<n>`; a new version is published by renaming a new `..data`
/// symlink over the old one, as the kubelet does.
struct SecretDir {
    dir: PathBuf,
    version: u32,
}

impl SecretDir {
    /// Turns the plain files `names` of `dir` into that layout, same contents.
    fn adopt(dir: &Path, names: &[&str]) -> Self {
        let files: Vec<(String, String)> = names
            .iter()
            .map(|n| (n.to_string(), fs::read_to_string(dir.join(n)).unwrap()))
            .collect();
        let mut secret = Self {
            dir: dir.to_path_buf(),
            version: 0,
        };
        let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (&**n, &**t)).collect();
        secret.publish(&files);
        for name in names {
            fs::remove_file(dir.join(name)).unwrap();
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name)).unwrap();
        }
        secret
    }

    /// Publishes a new version holding `files` (name, content) in one step.
    fn publish(&mut self, files: &[(&str, &str)]) {
        self.version += 1;
        let version = format!("..v{}", self.version);
        fs::create_dir(self.dir.join(&version)).unwrap();
        for (name, text) in files {
            fs::write(self.dir.join(&version).join(name), text).unwrap();
        }
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).unwrap();
        fs::rename(&tmp, self.dir.join("..data")).unwrap();
        if self.version > 1 {
            fs::remove_dir_all(self.dir.join(format!("..v{}", self.version - 1))).unwrap();
        }
    }
}

/// A client pod on node 1, a server pod on node 2, both enrolled, a prober pod
/// outside the mesh on node 1 (to speak HBONE itself), the agents running with the
/// CA directory as a Secret volume, an echo server on the server's port 8080.
fn mesh() -> (Cluster, [Pod; 3], SecretDir, app::EchoServer) {
    let mut c = Cluster::with_namespaces(2, &[("mesh", true), ("legacy", false)]).unwrap();
    let client = c
        .add_pod(PodSpec::new("client", "mesh", 0).service_account("client"))
        .unwrap();
    let server = c
        .add_pod(PodSpec::new("server", "mesh", 1).service_account("server"))
        .unwrap();
    let prober = c.add_pod(PodSpec::new("prober", "legacy", 0)).unwrap();
    let secret = SecretDir::adopt(&c.ca_dir, &["ca.crt", "ca.key"]);
    c.start_agents().unwrap();
    c.wait_all_captured(&[&client, &server]).unwrap();
    let echo = app::EchoServer::start(&server.netns, server.addr(8080)).unwrap();
    (c, [client, server, prober], secret, echo)
}

/// Waits until both agents have put `n` CA changes in force.
fn wait_reloads(c: &Cluster, n: usize) {
    for node in 0..2 {
        c.wait_log_lines(node, &[RELOADED], n, RELOAD_LIMIT)
            .unwrap();
    }
}

#[test]
fn rotating_the_ca_keeps_every_new_connection_working() {
    let (c, [client, server, prober], mut secret, _echo) = mesh();
    let old_cert = fs::read_to_string(c.ca_dir.join("ca.crt")).unwrap();
    let old_key = fs::read_to_string(c.ca_dir.join("ca.key")).unwrap();
    let (new_cert, new_key) = generate_ca("podlink rotated CA").unwrap();

    // New connections, one after the other, each tagged with the phase it began in.
    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let outcomes: Outcomes = Arc::default();
    let traffic = {
        let (phase, stop, outcomes) = (phase.clone(), stop.clone(), outcomes.clone());
        let (netns, dst, client_ip) = (client.netns.clone(), server.addr(8080), client.ip);
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let p = phase.load(Ordering::Relaxed);
                let payload = format!("connection {i} in phase {p}").into_bytes();
                let outcome = app::exchange(&netns, dst, &payload)
                    .map_err(|e| e.to_string())
                    .and_then(|ex| {
                        if ex.echoed != payload {
                            Err(format!("echoed {:?}", String::from_utf8_lossy(&ex.echoed)))
                        } else if ex.peer_seen.ip() != client_ip {
                            Err(format!("the server saw {}", ex.peer_seen))
                        } else {
                            Ok(())
                        }
                    });
                outcomes.lock().unwrap().push((p, outcome));
                i += 1;
            }
        })
    };
    let made_in = |p: usize| {
        outcomes
            .lock()
            .unwrap()
            .iter()
            .filter(|(q, _)| *q == p)
            .count()
    };
    // Lets a few connections begin in phase `p`.
    let run_phase = |p: usize| {
        phase.store(p, Ordering::Relaxed);
        while made_in(p) < 5 && !traffic.is_finished() {
            std::thread::sleep(Duration::from_millis(10));
        }
    };

    // A client certificate of the old CA, for after the rotation.
    let prober_id = SpiffeId::new("cluster.local", "legacy", "prober");
    let (old_client_key, _) = credentials(&c.ca_dir, &prober_id);
    run_phase(0);
    // (a) Both roots trusted; the old CA still signs.
    secret.publish(&[
        ("ca.crt", &format!("{old_cert}{new_cert}")),
        ("ca.key", &old_key),
    ]);
    wait_reloads(&c, 1);
    run_phase(1);
    // (b) The new CA signs; the old root is still trusted.
    secret.publish(&[
        ("ca.crt", &format!("{new_cert}{old_cert}")),
        ("ca.key", &new_key),
    ]);
    wait_reloads(&c, 2);
    run_phase(2);
    // (c) Only the new root.
    secret.publish(&[("ca.crt", &new_cert), ("ca.key", &new_key)]);
    wait_reloads(&c, 3);
    run_phase(3);
    stop.store(true, Ordering::Relaxed);
    traffic.join().unwrap();

    let outcomes = outcomes.lock().unwrap();
    let failed: Vec<_> = outcomes.iter().filter(|(_, o)| o.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} connections failed: {failed:?}\nnode1:\n{}\nnode2:\n{}",
        failed.len(),
        outcomes.len(),
        c.agent_log(0),
        c.agent_log(1)
    );
    for p in 0..4 {
        assert!(
            outcomes.iter().any(|(q, _)| *q == p),
            "no connection in phase {p}"
        );
    }
    // Each agent reissued its one local workload's certificate at each change, and
    // released its pooled HBONE connections, so later phases made new ones.
    for node in 0..2 {
        let log = c.agent_log(node);
        let reloads: Vec<&str> = log.lines().filter(|l| l.contains(RELOADED)).collect();
        assert_eq!(reloads.len(), 3, "{log}");
        assert!(
            reloads
                .iter()
                .all(|l| l.contains("reissued 1 workload certificates")),
            "{reloads:#?}"
        );
        assert!(!log.contains("CA files refused"), "{log}");
    }

    // The server now presents a certificate of the new CA: a client that trusts
    // only the new root (and holds a certificate of it) completes a handshake.
    let server_id = SpiffeId::new("cluster.local", "mesh", "server");
    let (key, roots) = credentials(
        &c.ca_dir,
        &SpiffeId::new("cluster.local", "legacy", "prober"),
    );
    assert_eq!(roots.len(), 1);
    let status = tokio::runtime::Runtime::new().unwrap().block_on(attempt(
        &prober.netns,
        server.addr(15008),
        key,
        roots,
        server_id,
        server.addr(8080),
    ));
    assert_eq!(status, Ok(StatusCode::OK), "node2:\n{}", c.agent_log(1));
    // And a certificate of the removed root is refused.
    let refused = tokio::runtime::Runtime::new().unwrap().block_on(attempt(
        &prober.netns,
        server.addr(15008),
        old_client_key,
        credentials(&c.ca_dir, &prober_id).1,
        SpiffeId::new("cluster.local", "mesh", "server"),
        server.addr(8080),
    ));
    assert!(refused.is_err(), "{refused:?}");
}

#[test]
fn a_garbage_ca_file_is_refused_and_traffic_keeps_flowing() {
    let (c, [client, server, prober], mut secret, _echo) = mesh();
    let key_pem = fs::read_to_string(c.ca_dir.join("ca.key")).unwrap();
    let server_id = SpiffeId::new("cluster.local", "mesh", "server");
    // Credentials of the CA in force, taken before it is garbled.
    let (key, roots) = credentials(
        &c.ca_dir,
        &SpiffeId::new("cluster.local", "legacy", "prober"),
    );
    app::exchange(&client.netns, server.addr(8080), b"before").unwrap();

    secret.publish(&[
        ("ca.crt", "-----BEGIN GARBAGE-----\nnot a certificate\n"),
        ("ca.key", &key_pem),
    ]);
    for node in 0..2 {
        c.wait_log_lines(
            node,
            &[
                "CA files refused",
                "ca.crt: malformed PEM",
                "GARBAGE",
                "no END line",
            ],
            1,
            RELOAD_LIMIT,
        )
        .unwrap();
    }
    // New connections: through the proxy, and a new HBONE handshake with the
    // server's agent, which still presents a certificate of the CA in force.
    let ex = app::exchange(&client.netns, server.addr(8080), b"after").unwrap();
    assert_eq!(ex.echoed, b"after");
    let status = tokio::runtime::Runtime::new().unwrap().block_on(attempt(
        &prober.netns,
        server.addr(15008),
        key,
        roots,
        server_id,
        server.addr(8080),
    ));
    assert_eq!(status, Ok(StatusCode::OK), "node2:\n{}", c.agent_log(1));
    for node in 0..2 {
        let log = c.agent_log(node);
        assert!(!log.contains(RELOADED), "{log}");
        // Refused once, not at every poll.
        assert_eq!(log.matches("CA files refused").count(), 1, "{log}");
    }
}
