//! `cargo xtask validate-deploy`: checks the Kubernetes manifests of `deploy/`.
//!
//! * Every manifest under `deploy/` (subdirectories included; not the
//!   kustomizations, not the Helm values of [`HELM_VALUES`]) is validated
//!   against the Kubernetes OpenAPI schemas with `kubernetes-validate --strict`
//!   (unknown fields are errors), for each version in [`KUBERNETES_VERSIONS`]. A
//!   document whose kind and apiVersion have no schema in a version (a typo, or
//!   an API that version does not serve) fails too, where the tool itself only
//!   warns.
//! * Every kustomization under `deploy/` (the installation `deploy/`, its
//!   objects `deploy/base/`, the variant beside istiod `deploy/istio/`) is
//!   checked and built as kustomize builds it, in the part of kustomize they
//!   use. A manifest beside a kustomization must be in its `resources` (else it
//!   is never applied); a resource must be a manifest in or below the
//!   kustomization's directory or a directory with a kustomization that does
//!   not contain this one (kustomize refuses both otherwise). Each patch must be
//!   a JSON patch (RFC 6902) whose `target` (kind and name) matches exactly one
//!   object of the resources (kustomize applies a patch that matches nothing to
//!   nothing, silently), and must apply; the objects of every kustomization with
//!   patches are then validated like the manifests. Kustomization fields beyond
//!   `resources`, `patches` and `images` are refused, so that a kustomization
//!   using one fails here rather than being checked in part. Not reproduced:
//!   `images` (the schemas do not constrain an image) and strategic-merge
//!   patches (refused).
//! * The Helm values of [`HELM_VALUES`] (the affinity that keeps Istio's
//!   ztunnel and istio-cni off the nodes podlink takes over) are validated as
//!   the affinity of a DaemonSet's pods, and must exclude the node label that
//!   `deploy/istio`'s DaemonSet selects ([`NODE_PROXY_LABEL`]).

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{project_root, setup};

/// The Kubernetes versions the manifests are validated against: the oldest
/// serving `flowcontrol.apiserver.k8s.io/v1` (1.29), the one whose API the agent
/// is built against (k8s-openapi's `v1_33`), and the newest the installed
/// kubernetes-validate knows.
pub const KUBERNETES_VERSIONS: &[&str] = &["1.29.0", "1.33.0", "1.37.0"];

/// YAML files under `deploy/` that are Helm values for Istio's charts, not
/// manifests: the `affinity` of ztunnel's and istio-cni's DaemonSets.
const HELM_VALUES: &[&str] = &["istio/istio-node-affinity.yaml"];

/// The node label (key, value) that `deploy/istio`'s DaemonSet selects and that
/// [`HELM_VALUES`] keep Istio's node agents away from.
const NODE_PROXY_LABEL: (&str, &str) = ("podlink.io/node-proxy", "podlink");

/// Where the objects built from kustomizations are written for validation.
fn built_dir() -> PathBuf {
    project_root().join("target/validate-deploy")
}

/// The deployment directory.
fn deploy_dir() -> PathBuf {
    project_root().join("deploy")
}

/// The fields of a kustomization this check models; any other is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    #[serde(default, rename = "apiVersion")]
    _api_version: Option<String>,
    #[serde(default, rename = "kind")]
    _kind: Option<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    patches: Vec<PatchEntry>,
    /// Not applied: the schemas do not constrain an image.
    #[serde(default, rename = "images")]
    _images: Vec<Value>,
}

/// An entry of `patches`: the patch inline or in a file, and its target.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchEntry {
    path: Option<String>,
    patch: Option<String>,
    target: Option<Target>,
}

/// A patch's target; kustomize's other selectors (labels, annotations, group,
/// version) are refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    kind: String,
    name: String,
    namespace: Option<String>,
}

/// Runs every check; the error names everything that failed.
pub fn validate() -> Result<()> {
    let dir = deploy_dir();
    let root = project_root();
    let mut failures = Vec::new();
    let (manifests, kustomizations) = files(&dir)?;
    if manifests.is_empty() {
        bail!("no manifests in {}", dir.display());
    }
    let built = built_dir();
    if built.exists() {
        fs::remove_dir_all(&built).with_context(|| format!("removing {}", built.display()))?;
    }
    // Paths relative to the project root, as kubernetes-validate names them.
    let mut validated: Vec<PathBuf> = manifests
        .iter()
        .map(|m| Path::new("deploy").join(m))
        .collect();
    for kustomization in &kustomizations {
        match check_kustomization(&dir, kustomization) {
            Ok(written) => validated.extend(written),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    for values in HELM_VALUES {
        match check_helm_values(&dir, Path::new(values)) {
            Ok(written) => validated.push(written),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    let validated: Vec<PathBuf> = validated
        .iter()
        .map(|p| p.strip_prefix(&root).unwrap_or(p).to_path_buf())
        .collect();
    for version in KUBERNETES_VERSIONS {
        if let Err(e) = validate_schemas(&root, &validated, version) {
            failures.push(format!("{e:#}"));
        }
    }
    if !failures.is_empty() {
        bail!("deploy/ is not valid:\n{}", failures.join("\n"));
    }
    eprintln!(
        "validate-deploy: {} manifests and {} kustomizations ({} files with the built \
         objects and Helm values) valid against Kubernetes {}",
        manifests.len(),
        kustomizations.len(),
        validated.len(),
        KUBERNETES_VERSIONS.join(", ")
    );
    Ok(())
}

fn is_yaml(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "yaml" || e == "yml")
}

fn is_kustomization(path: &Path) -> bool {
    path.file_name().is_some_and(|n| {
        n == "kustomization.yaml" || n == "kustomization.yml" || n == "Kustomization"
    })
}

/// Whether `rel` (relative to `deploy/`) is a manifest: YAML, neither a
/// kustomization nor Helm values.
fn is_manifest(rel: &Path) -> bool {
    is_yaml(rel) && !is_kustomization(rel) && !HELM_VALUES.iter().any(|v| rel == Path::new(v))
}

/// The manifests and the directories holding a kustomization under `dir`,
/// relative to `dir`, sorted.
fn files(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut manifests = Vec::new();
    let mut kustomizations = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let path = entry?.path();
            let rel = path.strip_prefix(dir)?.to_path_buf();
            if path.is_dir() {
                pending.push(path);
            } else if is_kustomization(&path) {
                kustomizations.push(rel.parent().unwrap_or(Path::new("")).to_path_buf());
            } else if is_manifest(&rel) {
                manifests.push(rel);
            }
        }
    }
    manifests.sort();
    kustomizations.sort();
    Ok((manifests, kustomizations))
}

/// Checks the kustomization of `deploy/<rel>` and builds it; with patches, its
/// objects are written under [`built_dir`], one file each, and their paths
/// returned for validation.
fn check_kustomization(deploy: &Path, rel: &Path) -> Result<Vec<PathBuf>> {
    let dir = deploy.join(rel);
    let shown = Path::new("deploy").join(rel).join("kustomization.yaml");
    let kustomization = read_kustomization(&dir).with_context(|| format!("{}", shown.display()))?;
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for resource in &kustomization.resources {
        if !listed.insert(resource.trim_end_matches('/')) {
            problems.push(format!("{resource} is listed twice"));
        }
    }
    for entry in fs::read_dir(&dir)? {
        let path = entry?.path();
        if let Some(name) = path.file_name().and_then(|n| n.to_str())
            && path.is_file()
            && is_manifest(&rel.join(name))
            && !listed.contains(name)
        {
            problems.push(format!("{name} is not in resources"));
        }
    }
    if !problems.is_empty() {
        bail!("{}: {}", shown.display(), problems.join("; "));
    }
    let objects = build(&dir).with_context(|| format!("building {}", shown.display()))?;
    if kustomization.patches.is_empty() {
        return Ok(Vec::new());
    }
    let out = built_dir().join(rel);
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    for object in &objects {
        let name = format!(
            "{}-{}.yaml",
            object["kind"].as_str().unwrap_or("unknown"),
            object["metadata"]["name"].as_str().unwrap_or("unnamed")
        );
        let path = out.join(name);
        fs::write(&path, serde_yaml_ng::to_string(object)?)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn read_kustomization(dir: &Path) -> Result<Kustomization> {
    let path = dir.join("kustomization.yaml");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml_ng::from_str(&text)
        .context("parsing (only resources, patches and images are modelled)")
}

/// The objects the kustomization of `dir` produces: its resources' objects
/// (a directory's built in turn), then its patches applied in order.
fn build(dir: &Path) -> Result<Vec<Value>> {
    let kustomization = read_kustomization(dir)?;
    let root = dir
        .canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))?;
    let mut objects = Vec::new();
    for resource in &kustomization.resources {
        let path = dir
            .join(resource)
            .canonicalize()
            .with_context(|| format!("resource {resource}: no such file or directory"))?;
        if path.is_dir() {
            if root.starts_with(&path) {
                bail!(
                    "resource {resource} contains this kustomization (kustomize refuses the cycle)"
                );
            }
            if !path.join("kustomization.yaml").is_file() {
                bail!("resource {resource} is a directory without a kustomization.yaml");
            }
            objects.extend(build(&path).with_context(|| format!("resource {resource}"))?);
        } else {
            if !path.starts_with(&root) {
                bail!(
                    "resource {resource} is outside the kustomization's directory \
                     (kustomize's default load restrictor refuses it)"
                );
            }
            objects.extend(read_documents(&path).with_context(|| format!("resource {resource}"))?);
        }
    }
    for (i, entry) in kustomization.patches.iter().enumerate() {
        apply_patch(dir, &root, entry, &mut objects).with_context(|| format!("patches[{i}]"))?;
    }
    Ok(objects)
}

/// The YAML documents of a manifest file (empty ones skipped).
fn read_documents(path: &Path) -> Result<Vec<Value>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut documents = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(&text) {
        let value =
            Value::deserialize(document).with_context(|| format!("parsing {}", path.display()))?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

/// Applies one `patches` entry: a JSON patch to the one object its target names.
fn apply_patch(dir: &Path, root: &Path, entry: &PatchEntry, objects: &mut [Value]) -> Result<()> {
    let text = match (&entry.patch, &entry.path) {
        (Some(text), None) => text.clone(),
        (None, Some(file)) => {
            let path = dir.join(file).canonicalize()?;
            if !path.starts_with(root) {
                bail!("{file} is outside the kustomization's directory");
            }
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?
        }
        _ => bail!("give either patch or path"),
    };
    let patch: Value = serde_yaml_ng::from_str(&text).context("parsing the patch")?;
    if !patch.is_array() {
        bail!(
            "a strategic-merge patch, which validate-deploy does not apply: \
             write it as a JSON patch (a list of operations)"
        );
    }
    let operations: json_patch::Patch =
        serde_json::from_value(patch).context("not a JSON patch (RFC 6902)")?;
    let Some(target) = &entry.target else {
        bail!("a JSON patch needs a target");
    };
    let mut matching: Vec<&mut Value> = objects
        .iter_mut()
        .filter(|o| {
            o["kind"] == target.kind
                && o["metadata"]["name"] == target.name
                && target
                    .namespace
                    .as_ref()
                    .is_none_or(|ns| o["metadata"]["namespace"] == *ns)
        })
        .collect();
    let [object] = matching.as_mut_slice() else {
        bail!(
            "the target {} {} matches {} objects, not one",
            target.kind,
            target.name,
            matching.len()
        );
    };
    json_patch::patch(object, &operations)
        .with_context(|| format!("applying it to {} {}", target.kind, target.name))
}

/// Checks Helm values for Istio's node agents (`deploy/<rel>`): their
/// `affinity` keeps the pods off the nodes labelled [`NODE_PROXY_LABEL`] (every
/// required term excludes it), and is written, as the affinity of a minimal
/// DaemonSet, under [`built_dir`] for validation (the path is returned).
fn check_helm_values(deploy: &Path, rel: &Path) -> Result<PathBuf> {
    let shown = Path::new("deploy").join(rel);
    let values: Value = serde_yaml_ng::from_str(
        &fs::read_to_string(deploy.join(rel))
            .with_context(|| format!("reading {}", shown.display()))?,
    )
    .with_context(|| format!("parsing {}", shown.display()))?;
    let affinity = &values["affinity"];
    let terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .filter(|t| !t.is_empty())
        .with_context(|| {
            format!(
                "{}: no affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
                shown.display()
            )
        })?;
    let (key, value) = NODE_PROXY_LABEL;
    let excludes = |term: &Value| {
        term["matchExpressions"].as_array().is_some_and(|exprs| {
            exprs.iter().any(|e| {
                e["key"] == key
                    && e["operator"] == "NotIn"
                    && e["values"]
                        .as_array()
                        .is_some_and(|v| v.contains(&json!(value)))
            })
        })
    };
    if !terms.iter().all(excludes) {
        bail!(
            "{}: a node selector term does not exclude {key}={value}, the nodes deploy/istio's DaemonSet runs on",
            shown.display()
        );
    }
    let istio = build(&deploy.join("istio")).context("building deploy/istio")?;
    let selects = istio.iter().any(|o| {
        o["kind"] == "DaemonSet" && o["spec"]["template"]["spec"]["nodeSelector"][key] == value
    });
    if !selects {
        bail!(
            "deploy/istio's DaemonSet does not select {key}={value}, which {} excludes",
            shown.display()
        );
    }
    let daemonset = json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "istio-node-affinity", "namespace": "istio-system"},
        "spec": {
            "selector": {"matchLabels": {"app": "istio-node-affinity"}},
            "template": {
                "metadata": {"labels": {"app": "istio-node-affinity"}},
                "spec": {
                    "affinity": affinity,
                    "containers": [{"name": "node-agent", "image": "node-agent"}],
                },
            },
        },
    });
    let out = built_dir().join(rel.parent().unwrap_or(Path::new("")));
    fs::create_dir_all(&out)?;
    let path = out.join(format!(
        "DaemonSet-{}",
        rel.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("values.yaml")
    ));
    fs::write(&path, serde_yaml_ng::to_string(&daemonset)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// `kubernetes-validate --strict` on `files` (relative to `root`) for one
/// Kubernetes version. Fails on its exit status, on any warning or error line,
/// and when a file has no line saying it passed.
fn validate_schemas(root: &Path, files: &[PathBuf], version: &str) -> Result<()> {
    let out = Command::new(setup::kubernetes_validate_bin())
        .args(["--strict", "--kubernetes-version", version])
        .args(files)
        .current_dir(root)
        .output()
        .context("running kubernetes-validate (cargo xtask setup installs it)")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut problems: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with("INFO ") && !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    for file in files {
        let name = file.to_string_lossy();
        if !text
            .lines()
            .any(|l| l.starts_with(&format!("INFO {name} passed ")))
        {
            problems.push(format!("{name}: no document passed"));
        }
    }
    if !out.status.success() && problems.is_empty() {
        problems.push(format!("kubernetes-validate exited with {}", out.status));
    }
    if !problems.is_empty() {
        bail!(
            "against Kubernetes {version} (kubernetes-validate --strict):\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}
