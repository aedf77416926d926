//! The trust's watch and reload: the CA files (or the Istio root bundle) watched
//! and polled; a change checked, then refused or put in force with every cached
//! certificate reissued under it.

use std::{sync::Arc, time::Duration};

use tokio::sync::mpsc;

use super::{CertManager, Generation};
use crate::identity::{Error, source};

/// The trust files are checked this often even without a change event (events
/// can be lost, and a watch on a directory that does not exist yet fails).
const CA_POLL: Duration = Duration::from_secs(5);
/// After a change, the files must read the same twice this far apart before they
/// are loaded (a writer that replaces `ca.crt` and `ca.key` one after the other).
const CA_SETTLE: Duration = Duration::from_millis(100);

impl CertManager {
    /// Checks the trust files now; if they changed and are valid, puts them in
    /// force and reissues every cached certificate. Returns how many were
    /// reissued, or `None` when the files are unchanged.
    ///
    /// # Errors
    /// Files that cannot be read or are not valid, naming the file and what is
    /// wrong; the trust in force is then kept.
    pub async fn reload(&self) -> Result<Option<usize>, Error> {
        let source = &self.inner.source;
        let mut contents = source.read()?;
        loop {
            if contents == self.inner.generation().trust.contents() {
                return Ok(None);
            }
            tokio::time::sleep(CA_SETTLE).await;
            let again = source.read()?;
            if again == contents {
                break;
            }
            contents = again;
        }
        let trust = source.parse(contents)?;
        let anchors = trust.roots.len();
        let number = {
            let mut current = self.inner.trust.write().expect("trust lock");
            let number = current.number + 1;
            *current = Arc::new(Generation { trust, number });
            number
        };
        let mut reissues = tokio::task::JoinSet::new();
        for slot in self.inner.snapshot() {
            let this = self.clone();
            reissues.spawn(async move {
                let _issuing = slot.issuing.lock().await;
                let fresh = {
                    let state = slot.state.lock().expect("certificate slot lock");
                    state.current.as_ref().map(|c| c.generation) >= Some(number)
                };
                if fresh {
                    return true;
                }
                match this.inner.issue(&slot).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(
                            "reissuing the workload certificate of {} under the new CA failed; keeping the current one while it is valid: {e}",
                            slot.id
                        );
                        false
                    }
                }
            });
        }
        let (mut reissued, mut failed) = (0, 0);
        while let Some(done) = reissues.join_next().await {
            match done {
                Ok(true) => reissued += 1,
                _ => failed += 1,
            }
        }
        tracing::info!(
            "CA changed: reissued {reissued} workload certificates{} ({}, {anchors} trust anchors)",
            if failed > 0 {
                format!(", {failed} failed")
            } else {
                String::new()
            },
            source.describe(),
        );
        self.inner.changes.send_replace(number);
        Ok(Some(reissued))
    }

    /// Watches the trust files' directories (a Kubernetes Secret mount swaps its
    /// `..data` symlink) and polls them; reloads on a change, logging a refusal
    /// once per distinct error.
    pub(super) async fn watch_trust(&self) {
        let (tx, mut events) = mpsc::channel(1);
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let change = match event {
                Ok(e) => !matches!(e.kind, notify::EventKind::Access(_)),
                Err(_) => true,
            };
            if change {
                let _ = tx.try_send(());
            }
        });
        let _watcher = match watcher {
            Ok(mut watcher) => {
                for dir in source::parent_dirs(&self.inner.source.files()) {
                    if let Err(e) = notify::Watcher::watch(
                        &mut watcher,
                        &dir,
                        notify::RecursiveMode::NonRecursive,
                    ) {
                        tracing::warn!(
                            "watching {}: {e}; checking it every {CA_POLL:?} instead",
                            dir.display()
                        );
                    }
                }
                Some(watcher)
            }
            Err(e) => {
                tracing::warn!(
                    "watching the CA files: {e}; checking them every {CA_POLL:?} instead"
                );
                None
            }
        };
        let mut last_error: Option<String> = None;
        loop {
            tokio::select! {
                Some(()) = events.recv() => {}
                () = tokio::time::sleep(CA_POLL) => {}
            }
            match self.reload().await {
                Ok(_) => last_error = None,
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_ref() != Some(&text) {
                        tracing::error!(
                            "CA files refused, keeping the CA in force ({}): {text}",
                            self.inner.source.describe()
                        );
                        last_error = Some(text);
                    }
                }
            }
        }
    }
}
