//! `cargo xtask validate-deploy`: checks the Kubernetes manifests of `deploy/`.
//!
//! * `deploy/kustomization.yaml` (not a Kubernetes object, so not schema-checked)
//!   must list, as its `resources`, exactly the manifests beside it: a manifest
//!   added but not listed would never be applied, one listed but missing breaks
//!   `kubectl apply -k`.
//! * Every manifest under `deploy/` (subdirectories included) is validated
//!   against the Kubernetes OpenAPI schemas with `kubernetes-validate --strict`
//!   (unknown fields are errors), for each version in [`KUBERNETES_VERSIONS`]. A
//!   document whose kind and apiVersion have no schema in a version (a typo, or
//!   an API that version does not serve) fails too, where the tool itself only
//!   warns.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::{project_root, setup};

/// The Kubernetes versions the manifests are validated against: the oldest
/// serving `flowcontrol.apiserver.k8s.io/v1` (1.29), the one whose API the agent
/// is built against (k8s-openapi's `v1_33`), and the newest the installed
/// kubernetes-validate knows.
pub const KUBERNETES_VERSIONS: &[&str] = &["1.29.0", "1.33.0", "1.37.0"];

/// The deployment directory.
fn deploy_dir() -> PathBuf {
    project_root().join("deploy")
}

#[derive(Deserialize)]
struct Kustomization {
    #[serde(default)]
    resources: Vec<String>,
}

/// Runs both checks; the error names everything that failed.
pub fn validate() -> Result<()> {
    let dir = deploy_dir();
    let mut failures = Vec::new();
    if let Err(e) = check_kustomization(&dir) {
        failures.push(format!("{e:#}"));
    }
    let manifests = manifests(&dir)?;
    if manifests.is_empty() {
        bail!("no manifests in {}", dir.display());
    }
    for version in KUBERNETES_VERSIONS {
        if let Err(e) = validate_schemas(&dir, &manifests, version) {
            failures.push(format!("{e:#}"));
        }
    }
    if !failures.is_empty() {
        bail!("deploy/ is not valid:\n{}", failures.join("\n"));
    }
    eprintln!(
        "validate-deploy: {} manifests valid against Kubernetes {}; kustomization.yaml lists them",
        manifests.len(),
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

/// Every YAML file under `dir` but kustomizations, relative to `dir`, sorted.
fn manifests(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else if is_yaml(&path) && !is_kustomization(&path) {
                out.push(path.strip_prefix(dir)?.to_path_buf());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `dir/kustomization.yaml`'s resources are exactly the YAML files of `dir`
/// itself (subdirectories are not part of the installation).
fn check_kustomization(dir: &Path) -> Result<()> {
    let path = dir.join("kustomization.yaml");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let kustomization: Kustomization =
        serde_yaml_ng::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut listed = BTreeSet::new();
    let mut problems = Vec::new();
    for resource in &kustomization.resources {
        if !listed.insert(resource.as_str()) {
            problems.push(format!("{resource} is listed twice"));
        }
    }
    let present: BTreeSet<String> = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && is_yaml(p) && !is_kustomization(p))
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    for file in &present {
        if !listed.contains(file.as_str()) {
            problems.push(format!("{file} is not in resources"));
        }
    }
    for resource in &listed {
        if !present.contains(*resource) {
            problems.push(format!(
                "{resource} is in resources but is no manifest file of deploy/"
            ));
        }
    }
    if !problems.is_empty() {
        bail!("{}: {}", path.display(), problems.join("; "));
    }
    Ok(())
}

/// `kubernetes-validate --strict` on `manifests` for one Kubernetes version.
/// Fails on its exit status, on any warning or error line, and when a file has
/// no line saying it passed.
fn validate_schemas(dir: &Path, manifests: &[PathBuf], version: &str) -> Result<()> {
    let out = Command::new(setup::kubernetes_validate_bin())
        .args(["--strict", "--kubernetes-version", version])
        .args(manifests)
        .current_dir(dir)
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
    for file in manifests {
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
