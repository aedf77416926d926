//! The podlink-cni plugin's Unix socket: one request a connection, answered
//! by the reconciler ([`super::enroller::Enroller`]).

use crate::error::IoError;
use std::{
    fs,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::Arc,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};

use super::{
    Error, Result,
    protocol::{MAX_MESSAGE, REQUEST_TIMEOUT, Reply, Request},
};

/// A request of the plugin, with the way to answer it.
#[derive(Debug)]
pub struct Incoming {
    /// The request.
    pub request: Request,
    /// Where the answer goes (the connection's task writes it).
    pub reply: oneshot::Sender<Reply>,
}

/// The bound socket; dropping it stops accepting and removes the socket file
/// (unless another agent has replaced it meanwhile).
#[derive(Debug)]
pub struct CniSocket {
    path: PathBuf,
    /// `(st_dev, st_ino)` of the socket file this agent made.
    inode: (u64, u64),
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for CniSocket {
    fn drop(&mut self) {
        self.accept.abort();
        if fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.inode) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

impl CniSocket {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Binds the socket at `path` (creating its directory, mode 0755; replacing a
/// stale socket file; the socket itself mode 0600) and serves it: each
/// connection's request is handed to the returned channel, malformed ones are
/// answered with an error naming the problem. Call within a tokio runtime.
///
/// # Errors
/// A directory that cannot be made, a stale socket that cannot be removed, a
/// socket that cannot be bound or restricted ([`Error::Io`]); a path holding
/// something else than a socket ([`Error::NotASocket`]).
pub fn listen(path: &Path) -> Result<(CniSocket, mpsc::Receiver<Incoming>)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(IoError::at("creating", dir))?;
    }
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            fs::remove_file(path).map_err(IoError::at("removing the stale socket", path))?;
        }
        Ok(_) => {
            return Err(Error::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(IoError::at("looking at", path)(e).into()),
    }
    let listener = UnixListener::bind(path).map_err(IoError::at("binding", path))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .map_err(IoError::at("restricting", path))?;
    let meta = fs::symlink_metadata(path).map_err(IoError::at("looking at", path))?;
    let (tx, rx) = mpsc::channel(256);
    // Connections served at once; more wait in the listen backlog, so that a
    // flood of plugin connections cannot take the descriptors the proxy's
    // connections need.
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let accept = tokio::spawn(async move {
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            match listener.accept().await {
                Ok((stream, _)) => {
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        connection(stream, tx).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    tracing::warn!("accepting on the CNI socket: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok((
        CniSocket {
            path: path.to_path_buf(),
            inode: (meta.dev(), meta.ino()),
            accept,
        },
        rx,
    ))
}

/// Plugin connections the agent serves at once (a node starts a few pods at a
/// time; each connection lives until its pod is attached, at most a few seconds).
pub const MAX_CONNECTIONS: usize = 256;

/// Reads a request: up to a newline or the end of the plugin's writing, at
/// most [`MAX_MESSAGE`] bytes.
async fn read_request(stream: &mut UnixStream) -> Result<Request, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading the request: {e}"))?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_MESSAGE {
            return Err(format!("the request is over {MAX_MESSAGE} bytes"));
        }
        if chunk[..n].contains(&b'\n') {
            break;
        }
    }
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    if line.iter().all(u8::is_ascii_whitespace) {
        return Err("empty request".into());
    }
    Request::parse(line).map_err(|e| e.to_string())
}

async fn connection(mut stream: UnixStream, requests: mpsc::Sender<Incoming>) {
    let stopping = || Reply::Error {
        message: "the agent is stopping".into(),
        retry: true,
    };
    let reply = match tokio::time::timeout(REQUEST_TIMEOUT, read_request(&mut stream)).await {
        Err(_) => Reply::Error {
            message: format!("no complete request within {} s", REQUEST_TIMEOUT.as_secs()),
            retry: false,
        },
        Ok(Err(message)) => {
            tracing::warn!("CNI socket: refused a request: {message}");
            Reply::Error {
                message,
                retry: false,
            }
        }
        Ok(Ok(request)) => {
            let (tx, rx) = oneshot::channel();
            if requests
                .send(Incoming { request, reply: tx })
                .await
                .is_err()
            {
                stopping()
            } else {
                rx.await.unwrap_or_else(|_| stopping())
            }
        }
    };
    let _ = stream.write_all(reply.to_line().as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_socket_serves_and_refuses_malformed_requests() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/cni.sock");
        // A stale socket file is replaced.
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (socket, mut rx) = listen(&path).unwrap();
        let exchange = |body: &'static [u8]| {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
                s.write_all(body).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let mut out = Vec::new();
                s.read_to_end(&mut out).unwrap();
                Reply::parse(&out).unwrap()
            })
        };
        let bad = exchange(b"{\"version\": 1, \"command\": \"ADD\"}\n")
            .await
            .unwrap();
        assert!(matches!(bad, Reply::Error { message, .. } if message.contains("containerId")));
        let garbage = exchange(b"\x00\x01").await.unwrap();
        assert!(matches!(garbage, Reply::Error { message, .. } if message.contains("not JSON")));
        let good = exchange(
            br#"{"version":1,"command":"DEL","containerId":"c","namespace":"n","name":"p"}"#,
        );
        let incoming = rx.recv().await.unwrap();
        assert_eq!(incoming.request.key(), "n/p");
        incoming.reply.send(Reply::Removed).unwrap();
        assert_eq!(good.await.unwrap(), Reply::Removed);
        drop(socket);
        assert!(!path.exists());
        // Something else than a socket is not replaced.
        fs::write(&path, "x").unwrap();
        assert_eq!(
            format!("{:#}", listen(&path).unwrap_err()),
            format!(
                "{} exists and is not a socket: not replacing it",
                path.display()
            )
        );
    }
}
