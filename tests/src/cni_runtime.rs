//! A container runtime's CNI side, as libcni does it (CNI spec 1.0, "Section 3:
//! Execution of Network Configurations"): a network configuration list is
//! loaded from the first `*.conflist` of a directory, and each operation runs
//! its plugins in turn, each given the list's `name` and `cniVersion` merged
//! into its own configuration; ADD and CHECK run them in order, each ADD with
//! the previous plugin's result as `prevResult`; DEL runs them in reverse order
//! with the cached ADD result as `prevResult`. Plugins are found in `CNI_PATH`
//! and run in the node's network namespace, where the runtime runs.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Output, Stdio},
};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use crate::netns;

/// The first `*.conflist` of `dir` in lexical order, parsed.
pub fn load_conflist(dir: &Path) -> Result<(PathBuf, Value)> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "conflist"))
        .collect();
    files.sort();
    let path = files
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("no *.conflist in {}", dir.display()))?;
    let text = fs::read_to_string(&path)?;
    let value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON: {text}", path.display()))?;
    Ok((path, value))
}

/// One pod's CNI parameters ("Section 2: Parameters").
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// The node namespace the runtime (and so the plugins) run in.
    pub node_netns: String,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`: the pod's namespace path.
    pub netns_path: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS`.
    pub args: String,
    /// `CNI_PATH`: directories searched for plugins.
    pub cni_path: Vec<PathBuf>,
}

impl Sandbox {
    /// A Kubernetes pod's parameters, as kubelet's runtimes give them.
    pub fn pod(
        node_netns: &str,
        container_id: &str,
        pod_netns: &str,
        namespace: &str,
        name: &str,
        cni_path: Vec<PathBuf>,
    ) -> Self {
        Sandbox {
            node_netns: node_netns.into(),
            container_id: container_id.into(),
            netns_path: format!("/run/netns/{pod_netns}"),
            ifname: "eth0".into(),
            args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={container_id}"
            ),
            cni_path,
        }
    }
}

/// A plugin that failed: which, its exit and its stdout (the CNI error object
/// when it followed the spec).
#[derive(Debug)]
pub struct PluginFailure {
    /// The plugin's `type`.
    pub plugin: String,
    /// Its stdout, parsed when JSON.
    pub error: Value,
    /// Its stdout as printed.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

/// The results of an ADD: each plugin's result, in order (the last is the
/// list's result).
pub type Results = Vec<Value>;

/// Runs `plugin` (found in `CNI_PATH`) with `config` on stdin.
pub fn exec_plugin(
    sandbox: &Sandbox,
    command: &str,
    plugin: &str,
    config: &Value,
) -> Result<Output> {
    let binary = sandbox
        .cni_path
        .iter()
        .map(|d| d.join(plugin))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!("plugin {plugin} is not in CNI_PATH {:?}", sandbox.cni_path))?;
    let cni_path = std::env::join_paths(&sandbox.cni_path)?;
    let mut child = netns::command_in(&sandbox.node_netns, &binary.to_string_lossy())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", &sandbox.container_id)
        .env("CNI_NETNS", &sandbox.netns_path)
        .env("CNI_IFNAME", &sandbox.ifname)
        .env("CNI_ARGS", &sandbox.args)
        .env("CNI_PATH", cni_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", binary.display()))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(config.to_string().as_bytes())?;
    Ok(child.wait_with_output()?)
}

/// The configuration a plugin of `list` gets: its entry, with the list's `name`
/// and `cniVersion`, and `prevResult` when given.
pub fn plugin_config(list: &Value, index: usize, prev_result: Option<&Value>) -> Result<Value> {
    let mut config = list["plugins"]
        .get(index)
        .cloned()
        .ok_or_else(|| anyhow!("no plugin {index} in {list}"))?;
    let object = config
        .as_object_mut()
        .ok_or_else(|| anyhow!("plugin {index} is not an object"))?;
    object.insert("name".into(), list["name"].clone());
    object.insert("cniVersion".into(), list["cniVersion"].clone());
    if let Some(prev) = prev_result {
        object.insert("prevResult".into(), prev.clone());
    }
    Ok(config)
}

fn plugins(list: &Value) -> Result<Vec<String>> {
    list["plugins"]
        .as_array()
        .ok_or_else(|| anyhow!("no plugins in {list}"))?
        .iter()
        .map(|p| {
            p["type"]
                .as_str()
                .map(String::from)
                .ok_or_else(|| anyhow!("a plugin without type in {list}"))
        })
        .collect()
}

fn failure(plugin: &str, out: &Output) -> PluginFailure {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    PluginFailure {
        plugin: plugin.to_string(),
        error: serde_json::from_str(&stdout).unwrap_or(Value::Null),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// ADD: each plugin in order, each given the previous one's result. `Ok(Err)`
/// when a plugin failed (the results before it are given with it, so that the
/// caller can DEL, as runtimes do).
pub fn add(
    list: &Value,
    sandbox: &Sandbox,
) -> Result<std::result::Result<Results, (Results, PluginFailure)>> {
    let mut results: Results = Vec::new();
    for (i, plugin) in plugins(list)?.iter().enumerate() {
        let config = plugin_config(list, i, results.last())?;
        let out = exec_plugin(sandbox, "ADD", plugin, &config)?;
        if !out.status.success() {
            return Ok(Err((results, failure(plugin, &out))));
        }
        let result: Value = serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "{plugin} ADD printed no JSON result: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })?;
        results.push(result);
    }
    Ok(Ok(results))
}

/// DEL: each plugin in reverse order, given the cached result of the ADD
/// (`None`: none cached). Fails with the first plugin that fails.
pub fn del(list: &Value, sandbox: &Sandbox, cached: Option<&Value>) -> Result<()> {
    for (i, plugin) in plugins(list)?.iter().enumerate().rev() {
        let config = plugin_config(list, i, cached)?;
        let out = exec_plugin(sandbox, "DEL", plugin, &config)?;
        if !out.status.success() {
            let f = failure(plugin, &out);
            bail!("{plugin} DEL failed: {} {}", f.stdout, f.stderr);
        }
    }
    Ok(())
}

/// CHECK: each plugin in order, given the cached result of the ADD.
pub fn check(
    list: &Value,
    sandbox: &Sandbox,
    cached: &Value,
) -> Result<std::result::Result<(), PluginFailure>> {
    for (i, plugin) in plugins(list)?.iter().enumerate() {
        let config = plugin_config(list, i, Some(cached))?;
        let out = exec_plugin(sandbox, "CHECK", plugin, &config)?;
        if !out.status.success() {
            return Ok(Err(failure(plugin, &out)));
        }
    }
    Ok(Ok(()))
}
