//! The enrollment snapshot: what the agent last knew of the enrollment labels,
//! kept in a file beside its socket ([`Snapshot::path_for`]) so that podlink-cni
//! can decide, while the agent cannot be reached, whether a new pod must wait
//! for it (fail closed) or needs nothing.
//!
//! It holds the namespaces labelled `istio.io/dataplane-mode=ambient` and this
//! node's pods labelled `ambient` or `none` themselves. Its limit: a pod opted
//! in only by its own label, created while the agent is down, is not in it; the
//! plugin lets it start uncaptured, and the agent, once back, enrolls it by its
//! host route as any pod it finds running.

use crate::error::IoError;
use std::{
    collections::BTreeSet,
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{Error, Result};
use crate::{
    k8s::{Namespace, Pod},
    state::{DATAPLANE_MODE_AMBIENT, DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE},
};

/// The snapshot's file name, in the socket's directory.
pub const FILE_NAME: &str = "enrollment.json";
/// The format version written in `version`.
pub const SNAPSHOT_VERSION: u32 = 1;

/// What the agent knows of enrollment labels.
///
/// ```json
/// {"version": 1, "node": "node1", "ambientNamespaces": ["apps"],
///  "optedIn": ["tools/debug"], "optedOut": ["apps/legacy"]}
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// [`SNAPSHOT_VERSION`].
    pub version: u32,
    /// The node the agent runs on.
    pub node: String,
    /// Namespaces labelled `istio.io/dataplane-mode=ambient`.
    pub ambient_namespaces: BTreeSet<String>,
    /// This node's pods (`namespace/name`) labelled `ambient` themselves.
    pub opted_in: BTreeSet<String>,
    /// This node's pods labelled `none` (opted out).
    pub opted_out: BTreeSet<String>,
}

impl Snapshot {
    /// The snapshot of `pods` (those of node `node`) and `namespaces`.
    pub fn build<'a>(
        node: &str,
        pods: impl IntoIterator<Item = &'a Pod>,
        namespaces: impl IntoIterator<Item = &'a Namespace>,
    ) -> Snapshot {
        fn mode(labels: &Option<std::collections::BTreeMap<String, String>>) -> Option<&str> {
            labels
                .as_ref()
                .and_then(|l| l.get(DATAPLANE_MODE_LABEL))
                .map(String::as_str)
        }
        let mut snapshot = Snapshot {
            version: SNAPSHOT_VERSION,
            node: node.to_string(),
            ..Snapshot::default()
        };
        for ns in namespaces {
            if let Some(name) = &ns.metadata.name
                && mode(&ns.metadata.labels) == Some(DATAPLANE_MODE_AMBIENT)
            {
                snapshot.ambient_namespaces.insert(name.clone());
            }
        }
        for pod in pods {
            if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(node) {
                continue;
            }
            let set = match mode(&pod.metadata.labels) {
                Some(DATAPLANE_MODE_AMBIENT) => &mut snapshot.opted_in,
                Some(DATAPLANE_MODE_NONE) => &mut snapshot.opted_out,
                _ => continue,
            };
            set.extend(pod.key());
        }
        snapshot
    }

    /// Whether pod `namespace/name` is to be enrolled, by the snapshot: `Some`
    /// with the reason when it is, `None` when it needs nothing (as far as the
    /// snapshot knows, see the module's limit).
    pub fn enrolls(&self, namespace: &str, name: &str) -> Option<String> {
        let key = format!("{namespace}/{name}");
        if self.opted_out.contains(&key) {
            None
        } else if self.opted_in.contains(&key) {
            Some(format!(
                "pod {key} is labelled {DATAPLANE_MODE_LABEL}={DATAPLANE_MODE_AMBIENT}"
            ))
        } else if self.ambient_namespaces.contains(namespace) {
            Some(format!(
                "namespace {namespace} is labelled {DATAPLANE_MODE_LABEL}={DATAPLANE_MODE_AMBIENT}"
            ))
        } else {
            None
        }
    }

    /// The snapshot file beside the agent's socket `socket`.
    pub fn path_for(socket: &Path) -> PathBuf {
        socket.with_file_name(FILE_NAME)
    }

    /// Reads the snapshot at `path`; `Ok(None)` when there is none.
    ///
    /// # Errors
    /// An unreadable ([`Error::Io`]) or unparsable ([`Error::NotASnapshot`]) file,
    /// or one of another version ([`Error::SnapshotVersion`]), named.
    pub fn read(path: &Path) -> Result<Option<Snapshot>> {
        let text = match fs::read(path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(IoError::at("reading", path)(e).into()),
        };
        let snapshot: Snapshot =
            serde_json::from_slice(&text).map_err(|error| Error::NotASnapshot {
                path: path.to_path_buf(),
                error,
            })?;
        if snapshot.version != SNAPSHOT_VERSION {
            return Err(Error::SnapshotVersion {
                path: path.to_path_buf(),
                version: snapshot.version,
            });
        }
        Ok(Some(snapshot))
    }

    /// Writes the snapshot to `path` (by rename: a reader never sees half of it).
    ///
    /// # Errors
    /// When the file cannot be written ([`Error::Io`], named).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut text =
            serde_json::to_string_pretty(self).map_err(|error| Error::EncodeSnapshot { error })?;
        text.push('\n');
        super::write_atomically(path, &text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_from_labels_and_decides() {
        let nss: Vec<Namespace> = [
            "metadata: {name: amb, labels: {istio.io/dataplane-mode: ambient}}",
            "metadata: {name: plain}",
        ]
        .iter()
        .map(|y| serde_yaml_ng::from_str(y).unwrap())
        .collect();
        let pod = |name: &str, ns: &str, mode: &str, node: &str| -> Pod {
            serde_yaml_ng::from_str(&format!(
                "metadata: {{name: {name}, namespace: {ns}, labels: {{istio.io/dataplane-mode: {mode}}}}}\nspec: {{nodeName: {node}}}"
            ))
            .unwrap()
        };
        let pods = [
            pod("out", "amb", "none", "n1"),
            pod("in", "plain", "ambient", "n1"),
            pod("elsewhere", "plain", "ambient", "n2"),
        ];
        let s = Snapshot::build("n1", &pods, &nss);
        assert_eq!(s.ambient_namespaces, BTreeSet::from(["amb".to_string()]));
        assert_eq!(s.opted_in, BTreeSet::from(["plain/in".to_string()]));
        assert_eq!(s.opted_out, BTreeSet::from(["amb/out".to_string()]));
        assert!(s.enrolls("amb", "new").unwrap().contains("namespace amb"));
        assert_eq!(s.enrolls("amb", "out"), None);
        assert!(s.enrolls("plain", "in").unwrap().contains("pod plain/in"));
        assert_eq!(s.enrolls("plain", "elsewhere"), None);
        assert_eq!(s.enrolls("plain", "other"), None);

        let dir = tempfile::tempdir().unwrap();
        let path = Snapshot::path_for(&dir.path().join("cni.sock"));
        assert_eq!(Snapshot::read(&path).unwrap(), None);
        s.write(&path).unwrap();
        assert_eq!(Snapshot::read(&path).unwrap(), Some(s));
        fs::write(&path, "{").unwrap();
        assert!(format!("{:#}", Snapshot::read(&path).unwrap_err()).contains("enrollment.json"));
    }
}
