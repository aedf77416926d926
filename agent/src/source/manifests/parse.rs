//! Parsing manifest files: multi-document YAML, `Pod`, `Namespace`, `Service`,
//! `Node`, `EndpointSlice`, `AuthorizationPolicy`, `PeerAuthentication` and
//! `List` documents, and the checks the enrollment and the proxy rely on.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::k8s::{
    EndpointSlice, Namespace, Node, Pod, Service,
    names::{NameRule, is_dns1123_label, is_dns1123_subdomain},
};
use serde_yaml_ng::Value;

use crate::authz::{
    CompileError, MtlsError, MtlsPolicy, Policy,
    spec::{AuthorizationPolicy, PeerAuthentication},
};

/// API versions of `AuthorizationPolicy` and `PeerAuthentication` read (the
/// same schema).
const SECURITY_API_VERSIONS: [&str; 2] = ["security.istio.io/v1", "security.istio.io/v1beta1"];

/// A manifest problem: file, 1-based line, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}:{line}: {problem}", file.display())]
pub struct ManifestError {
    /// The manifest file (or the directory, when it cannot be listed).
    pub file: PathBuf,
    /// 1-based line of the problem (the document's first line when the problem
    /// is in its content; 0 when the file cannot be read).
    pub line: usize,
    /// What is wrong.
    pub problem: Problem,
}

/// What is wrong with a manifest.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The directory or the file cannot be read: not a regular file, more
    /// than [`super::MAX_FILE_SIZE`] bytes, not UTF-8, or an I/O error.
    #[error("{0}")]
    Unreadable(String),
    /// Not YAML, or a field of another type than the Kubernetes API gives it
    /// (as `serde_yaml_ng` words it).
    #[error("{0}")]
    Syntax(String),
    /// Collections nested deeper than `MAX_DEPTH` (64 levels).
    #[error("collections nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// A document without `kind` or `apiVersion`, or one of them not a string.
    #[error("{0}")]
    NoType(String),
    /// A kind podlink reads, in an API version it does not.
    #[error("{kind} has apiVersion {version}; podlink reads {expected}")]
    ApiVersion {
        /// The document's kind.
        kind: String,
        /// The version it has, quoted (or `none`).
        version: String,
        /// The versions podlink reads.
        expected: String,
    },
    /// A `List` whose `items` is not a sequence.
    #[error("List has no items sequence")]
    NoListItems,
    /// An object breaks a rule the API server enforces, or one the
    /// enrollment and the proxy rely on (names, addresses, ports).
    #[error("{0}")]
    Invalid(String),
    /// An AuthorizationPolicy that cannot be compiled.
    #[error(transparent)]
    Policy(#[from] CompileError),
    /// A PeerAuthentication that cannot be compiled.
    #[error(transparent)]
    Mtls(#[from] MtlsError),
    /// The problem of item `index` of a `List`.
    #[error("List item {index}: {problem}")]
    ListItem {
        /// 0-based.
        index: usize,
        /// What is wrong with it.
        problem: Box<Problem>,
    },
}

/// The objects one file holds.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    /// Pods, in file order.
    pub pods: Vec<Pod>,
    /// Namespaces, in file order.
    pub namespaces: Vec<Namespace>,
    /// Authorization policies, compiled, in file order.
    pub policies: Vec<Arc<Policy>>,
    /// Services, in file order.
    pub services: Vec<Service>,
    /// EndpointSlices, in file order.
    pub endpoint_slices: Vec<EndpointSlice>,
    /// PeerAuthentications, compiled, in file order.
    pub mtls_policies: Vec<Arc<MtlsPolicy>>,
    /// Nodes, in file order.
    pub nodes: Vec<Node>,
}

impl Objects {
    /// How many objects of every kind.
    pub fn len(&self) -> usize {
        self.pods.len()
            + self.namespaces.len()
            + self.policies.len()
            + self.services.len()
            + self.endpoint_slices.len()
            + self.mtls_policies.len()
            + self.nodes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Splits a YAML stream into documents at `---` lines; returns each document's
/// first line number (1-based) and text.
fn documents(text: &str) -> Vec<(usize, String)> {
    let mut docs = Vec::new();
    let mut start = 1;
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let is_separator = line == "---" || line.starts_with("--- ") || line.starts_with("---\t");
        if is_separator || line == "..." {
            docs.push((start, std::mem::take(&mut current)));
            start = i + 2;
            continue;
        }
        current.push_str(line);
        current.push('\n');
    }
    docs.push((start, current));
    docs
}

/// Deepest nesting of collections (block or flow: mappings and sequences) a
/// document may have. Kubernetes objects nest about ten deep; the YAML scanner
/// takes time quadratic in the nesting of flow collections (`[`, `{`) before the
/// deserializer's own recursion limit applies.
const MAX_DEPTH: usize = 64;

/// Checks the nesting of the document `text`: the 1-based line of the first
/// collection deeper than [`MAX_DEPTH`], if any ([`crate::sys::yaml_too_deep`]).
fn check_depth(text: &str) -> Result<(), usize> {
    crate::sys::yaml_too_deep(text, MAX_DEPTH).map_or(Ok(()), Err)
}

/// Parses one file's text. `file` is only used in errors.
///
/// # Errors
/// The first problem found; nothing of the file is used then.
pub fn parse(file: &Path, text: &str) -> Result<Objects, ManifestError> {
    let mut objects = Objects::default();
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (start, doc) in documents(text) {
        let err = |line: usize, problem: Problem| ManifestError {
            file: file.to_path_buf(),
            line,
            problem,
        };
        check_depth(&doc).map_err(|line| err(start + line - 1, Problem::TooDeep))?;
        let yaml_err = |e: serde_yaml_ng::Error| {
            let line = e.location().map_or(start, |l| start + l.line() - 1);
            err(line, Problem::Syntax(e.to_string()))
        };
        let value: Value = serde_yaml_ng::from_str(&doc).map_err(yaml_err)?;
        if value.is_null() {
            continue;
        }
        let field = |name: &str| match value.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(err(
                start,
                Problem::NoType(format!("{name} must be a string")),
            )),
        };
        let kind = field("kind")?;
        let api_version = field("apiVersion")?;
        match (api_version, kind) {
            (_, None) => return Err(err(start, Problem::NoType("document has no kind".into()))),
            (None, Some(_)) => {
                return Err(err(
                    start,
                    Problem::NoType("document has no apiVersion".into()),
                ));
            }
            (Some("v1"), Some("List")) => {
                let items = value
                    .get("items")
                    .and_then(Value::as_sequence)
                    .ok_or_else(|| err(start, Problem::NoListItems))?;
                for (i, item) in items.iter().enumerate() {
                    let item_err = |problem: Problem| {
                        err(
                            start,
                            Problem::ListItem {
                                index: i,
                                problem: Box::new(problem),
                            },
                        )
                    };
                    let kind = item.get("kind").and_then(Value::as_str);
                    let version = item.get("apiVersion").and_then(Value::as_str);
                    let decode = |item: &Value| Decoded::Value(item.clone());
                    read_object(kind, version, decode(item), &mut objects).map_err(|f| {
                        item_err(match f {
                            Failure::Yaml(e) => Problem::Syntax(e.to_string()),
                            Failure::Problem(p) => p,
                        })
                    })?;
                }
            }
            (Some(version), Some("List")) => {
                return Err(err(
                    start,
                    Problem::ApiVersion {
                        kind: "List".into(),
                        version: format!("{version:?}"),
                        expected: "v1".into(),
                    },
                ));
            }
            (version, kind) => {
                read_object(kind, version, Decoded::Text(&doc), &mut objects).map_err(
                    |f| match f {
                        Failure::Yaml(e) => yaml_err(e),
                        Failure::Problem(p) => err(start, p),
                    },
                )?;
            }
        }
    }
    Ok(objects)
}

/// A document or `List` item to make an object of: the document's text (so
/// that a syntax error names its line) or the item's parsed value.
enum Decoded<'a> {
    Text(&'a str),
    Value(Value),
}

impl Decoded<'_> {
    fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T, serde_yaml_ng::Error> {
        match self {
            Decoded::Text(text) => serde_yaml_ng::from_str(text),
            Decoded::Value(value) => serde_yaml_ng::from_value(value),
        }
    }
}

/// Why an object was not read: its YAML does not fit its kind, or a
/// [`Problem`] of its content.
enum Failure {
    Yaml(serde_yaml_ng::Error),
    Problem(Problem),
}

impl From<Problem> for Failure {
    fn from(p: Problem) -> Self {
        Failure::Problem(p)
    }
}

/// The API versions podlink reads `kind` in; `None` for a kind it does not
/// read (a `List` is unpacked by [`parse`]).
fn versions_of(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "Pod" | "Namespace" | "Service" | "Node" => Some(&["v1"]),
        "EndpointSlice" => Some(&["discovery.k8s.io/v1"]),
        "AuthorizationPolicy" | "PeerAuthentication" => Some(&SECURITY_API_VERSIONS),
        _ => None,
    }
}

/// Reads one object of `kind` in `version` (a document or a `List` item)
/// into `objects`: its version checked, then made from `decoded`, checked and
/// compiled. Kinds podlink does not read are skipped.
fn read_object(
    kind: Option<&str>,
    version: Option<&str>,
    decoded: Decoded<'_>,
    objects: &mut Objects,
) -> Result<(), Failure> {
    let Some((kind, expected)) = kind.and_then(|k| Some((k, versions_of(k)?))) else {
        return Ok(());
    };
    if !version.is_some_and(|v| expected.contains(&v)) {
        return Err(Problem::ApiVersion {
            kind: kind.into(),
            version: version.map_or_else(|| "none".into(), |v| format!("{v:?}")),
            expected: expected.join(" and "),
        }
        .into());
    }
    let invalid = |m: String| Failure::Problem(Problem::Invalid(m));
    match kind {
        "Pod" => {
            let pod: Pod = decoded.decode().map_err(Failure::Yaml)?;
            check_pod(&pod).map_err(invalid)?;
            objects.pods.push(pod);
        }
        "Namespace" => {
            let ns: Namespace = decoded.decode().map_err(Failure::Yaml)?;
            check_namespace(&ns).map_err(invalid)?;
            objects.namespaces.push(ns);
        }
        "Service" => {
            let service: Service = decoded.decode().map_err(Failure::Yaml)?;
            check_service(&service).map_err(invalid)?;
            objects.services.push(service);
        }
        "Node" => {
            let node: Node = decoded.decode().map_err(Failure::Yaml)?;
            check_node(&node).map_err(invalid)?;
            objects.nodes.push(node);
        }
        "EndpointSlice" => {
            let slice: EndpointSlice = decoded.decode().map_err(Failure::Yaml)?;
            check_endpoint_slice(&slice).map_err(invalid)?;
            objects.endpoint_slices.push(slice);
        }
        "AuthorizationPolicy" => {
            let policy: AuthorizationPolicy = decoded.decode().map_err(Failure::Yaml)?;
            let policy = Policy::compile(&policy).map_err(Problem::Policy)?;
            check_policy(&policy).map_err(invalid)?;
            objects.policies.push(Arc::new(policy));
        }
        "PeerAuthentication" => {
            let policy: PeerAuthentication = decoded.decode().map_err(Failure::Yaml)?;
            let policy = MtlsPolicy::compile(&policy).map_err(Problem::Mtls)?;
            check_mtls_policy(&policy).map_err(invalid)?;
            objects.mtls_policies.push(Arc::new(policy));
        }
        _ => unreachable!("versions_of names only the kinds read here"),
    }
    Ok(())
}

fn check_namespace(ns: &Namespace) -> Result<(), String> {
    let name = ns.metadata.name.as_deref().unwrap_or("");
    if name.is_empty() {
        return Err("Namespace has no metadata.name".into());
    }
    let rule = NameRule::Dns1123Label;
    if !rule.accepts(name) {
        return Err(format!(
            "Namespace name {name:?} is not a {}",
            rule.describe()
        ));
    }
    Ok(())
}

/// The object's `namespace/name`, its name checked by `rule` and its namespace
/// as a DNS-1123 label.
fn object_name(
    kind: &str,
    meta: &crate::k8s::ObjectMeta,
    rule: NameRule,
) -> Result<String, String> {
    let name = meta.name.as_deref().unwrap_or("");
    let namespace = meta.namespace_or_default();
    let who = format!("{kind} {namespace}/{name}");
    if name.is_empty() {
        return Err(format!("{kind} has no metadata.name"));
    }
    if !rule.accepts(name) {
        return Err(format!("{who}: metadata.name is not a {}", rule.describe()));
    }
    if !is_dns1123_label(namespace) {
        return Err(format!(
            "{who}: metadata.namespace {namespace:?} is not a DNS-1123 label"
        ));
    }
    Ok(who)
}

fn check_port(who: &str, field: &str, port: i32) -> Result<(), String> {
    if (1..=65535).contains(&port) {
        Ok(())
    } else {
        Err(format!(
            "{who}: {field} {port} is not a port number (1-65535)"
        ))
    }
}

/// Checks what resolving a ClusterIP relies on: addresses and ports.
fn check_service(service: &Service) -> Result<(), String> {
    let who = object_name("Service", &service.metadata, NameRule::Dns1035Label)?;
    let Some(spec) = &service.spec else {
        return Ok(());
    };
    let ips = spec
        .cluster_ip
        .iter()
        .chain(spec.cluster_ips.iter().flatten());
    for ip in ips {
        if !ip.is_empty() && ip != "None" && ip.parse::<IpAddr>().is_err() {
            return Err(format!(
                "{who}: cluster IP {ip:?} is not an IP address (or None)"
            ));
        }
    }
    for (i, port) in spec.ports.iter().flatten().enumerate() {
        check_port(&who, &format!("spec.ports[{i}].port"), port.port)?;
        if let Some(crate::k8s::IntOrString::Int(n)) = &port.target_port {
            check_port(&who, &format!("spec.ports[{i}].targetPort"), *n)?;
        }
    }
    Ok(())
}

fn check_endpoint_slice(slice: &EndpointSlice) -> Result<(), String> {
    let who = object_name("EndpointSlice", &slice.metadata, NameRule::Dns1123Subdomain)?;
    for (i, port) in slice.ports.iter().flatten().enumerate() {
        if let Some(n) = port.port {
            check_port(&who, &format!("ports[{i}].port"), n)?;
        }
    }
    for (i, endpoint) in slice.endpoints.iter().flatten().enumerate() {
        for address in &endpoint.addresses {
            if slice.address_type != "FQDN" && address.parse::<IpAddr>().is_err() {
                return Err(format!(
                    "{who}: endpoints[{i}].addresses {address:?} is not an IP address"
                ));
            }
        }
    }
    Ok(())
}

fn check_policy(policy: &Policy) -> Result<(), String> {
    let who = format!("AuthorizationPolicy {policy}");
    if !is_dns1123_subdomain(&policy.name) {
        return Err(format!("{who}: metadata.name is not a DNS-1123 subdomain"));
    }
    if !is_dns1123_label(&policy.namespace) {
        return Err(format!("{who}: metadata.namespace is not a DNS-1123 label"));
    }
    Ok(())
}

fn check_mtls_policy(policy: &MtlsPolicy) -> Result<(), String> {
    let who = format!("PeerAuthentication {policy}");
    if !is_dns1123_subdomain(&policy.name) {
        return Err(format!("{who}: metadata.name is not a DNS-1123 subdomain"));
    }
    if !is_dns1123_label(&policy.namespace) {
        return Err(format!("{who}: metadata.namespace is not a DNS-1123 label"));
    }
    Ok(())
}

/// Checks a Node's name and pod ranges (`spec.podCIDR(s)`: an address and a
/// prefix length of its family).
fn check_node(node: &Node) -> Result<(), String> {
    let name = node.metadata.name.as_deref().unwrap_or("");
    if name.is_empty() {
        return Err("Node has no metadata.name".into());
    }
    let who = format!("Node {name}");
    if !is_dns1123_subdomain(name) {
        return Err(format!("{who}: metadata.name is not a DNS-1123 subdomain"));
    }
    let Some(spec) = &node.spec else {
        return Ok(());
    };
    let fields = spec
        .pod_cidr
        .iter()
        .map(|c| ("spec.podCIDR".to_string(), c))
        .chain(
            spec.pod_cidrs
                .iter()
                .flatten()
                .enumerate()
                .map(|(i, c)| (format!("spec.podCIDRs[{i}]"), c)),
        );
    for (field, cidr) in fields {
        let valid = cidr.split_once('/').is_some_and(|(ip, len)| {
            let max = match ip.parse::<IpAddr>() {
                Ok(IpAddr::V4(_)) => 32,
                Ok(IpAddr::V6(_)) => 128,
                Err(_) => return false,
            };
            len.parse::<u8>().is_ok_and(|l| l <= max) && !len.starts_with('+')
        });
        if !valid {
            return Err(format!("{who}: {field} {cidr:?} is not a CIDR block"));
        }
    }
    Ok(())
}

/// Checks what the enrollment and the proxy rely on.
fn check_pod(pod: &Pod) -> Result<(), String> {
    let who = object_name("Pod", &pod.metadata, NameRule::Dns1123Subdomain)?;
    if let Some(spec) = &pod.spec {
        for (field, value) in [
            ("spec.serviceAccountName", &spec.service_account_name),
            ("spec.nodeName", &spec.node_name),
        ] {
            if let Some(value) = value.as_deref()
                && !value.is_empty()
                && !is_dns1123_subdomain(value)
            {
                return Err(format!(
                    "{who}: {field} {value:?} is not a DNS-1123 subdomain"
                ));
            }
        }
    }
    if let Some(status) = &pod.status {
        let fields = status
            .pod_ip
            .iter()
            .map(|ip| ("status.podIP".to_string(), ip))
            .chain(
                status
                    .pod_ips
                    .iter()
                    .flatten()
                    .enumerate()
                    .map(|(i, entry)| (format!("status.podIPs[{i}].ip"), &entry.ip)),
            );
        for (field, ip) in fields {
            let Ok(addr) = ip.parse::<IpAddr>() else {
                return Err(format!("{who}: {field} {ip:?} is not an IP address"));
            };
            if let Some(problem) = not_a_pod_address(addr) {
                return Err(format!("{who}: {field} {ip:?} {problem}"));
            }
        }
    }
    Ok(())
}

/// Why `ip` cannot be a pod's address, if it cannot: addresses that name no
/// single remote interface, and IPv4 written as IPv6 (which would not match the
/// IPv4 packets the pod sends).
fn not_a_pod_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        _ if ip.is_unspecified() => Some("is the unspecified address"),
        _ if ip.is_loopback() => Some("is a loopback address"),
        _ if ip.is_multicast() => Some("is a multicast address"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("is the broadcast address"),
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            Some("is an IPv4-mapped IPv6 address (write the IPv4 address)")
        }
        _ => None,
    }
}

/// A valid Pod manifest, for tests.
#[cfg(test)]
pub(super) const TEST_POD: &str = "apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: shop
  labels: {istio.io/dataplane-mode: ambient}
spec:
  nodeName: node1
  serviceAccountName: web
  containers: []
status:
  podIP: 10.1.1.5
";

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = TEST_POD;

    #[test]
    fn multi_document_files() {
        let text = format!(
            "# comment\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: shop\n---\n{POD}---\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: x\n"
        );
        let objects = parse(Path::new("a.yaml"), &text).unwrap();
        assert_eq!(objects.namespaces.len(), 1);
        assert_eq!(objects.pods.len(), 1);
        assert_eq!(objects.pods[0].metadata.name.as_deref(), Some("web"));
    }

    /// The example manifests directory of docs/operating.md is read as it says:
    /// the pod is enrolled on node1 with the identity the comment gives.
    #[test]
    fn the_documented_example_enrolls_its_pod() {
        let doc = include_str!("../../../../docs/operating.md");
        let after = doc
            .split_once("A manifests directory that enrolls one pod of node1")
            .expect("docs/operating.md's example")
            .1;
        let example = after
            .split_once("```yaml\n")
            .and_then(|(_, rest)| rest.split_once("```"))
            .expect("a yaml block")
            .0;
        let objects = parse(Path::new("example.yaml"), example).unwrap();
        let (index, warnings) = crate::state::WorkloadIndex::build(
            "node1",
            "cluster.local",
            &objects.pods,
            &objects.namespaces,
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        let pod = index.workloads().find(|w| w.name == "frontend").unwrap();
        assert!(pod.enrollment.is_enrolled());
        assert!(index.is_local(pod));
        assert_eq!(
            pod.identity.to_string(),
            "spiffe://cluster.local/ns/shop/sa/frontend"
        );
        assert_eq!(pod.ips, vec!["10.244.1.2".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn errors_name_the_line() {
        // The second document starts on line 14; its unclosed sequence is reported
        // where the parser gives up, at the document's end (line 18).
        let text = format!("{POD}---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: [unclosed\n");
        let err = parse(Path::new("bad.yaml"), &text).unwrap_err();
        assert_eq!(err.file, Path::new("bad.yaml"));
        assert_eq!(err.line, 18, "{err}");
        assert!(err.to_string().starts_with("bad.yaml:18:"), "{err}");

        let bad_ip = POD.replace("10.1.1.5", "10.1.1.500");
        let err = parse(Path::new("ip.yaml"), &bad_ip).unwrap_err();
        assert!(
            err.problem
                .to_string()
                .contains("status.podIP \"10.1.1.500\" is not an IP address"),
            "{err}"
        );

        for (ip, problem) in [
            ("0.0.0.0", "unspecified"),
            ("127.0.0.1", "loopback"),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("'::ffff:10.1.1.5'", "IPv4-mapped"),
            ("'::1'", "loopback"),
        ] {
            let text = POD.replace("10.1.1.5", ip);
            let err = parse(Path::new("ip.yaml"), &text).unwrap_err();
            assert!(err.problem.to_string().contains(problem), "{ip}: {err}");
            assert!(
                err.problem.to_string().contains("status.podIP"),
                "{ip}: {err}"
            );
        }

        let err = parse(Path::new("k.yaml"), "apiVersion: v1\nmetadata: {}\n").unwrap_err();
        assert!(err.problem.to_string().contains("no kind"), "{err}");

        let wrong_type = POD.replace("nodeName: node1", "nodeName: [1, 2]");
        let err = parse(Path::new("t.yaml"), &wrong_type).unwrap_err();
        assert_eq!(err.line, 8, "{err}");

        let no_name = POD.replace("  name: web\n", "");
        let err = parse(Path::new("n.yaml"), &no_name).unwrap_err();
        assert!(
            err.problem.to_string().contains("no metadata.name"),
            "{err}"
        );
    }

    #[test]
    fn authorization_policies() {
        let text = "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: allow-front, namespace: shop}\nspec:\n  rules: [{from: [{source: {namespaces: [shop]}}]}]\n---\napiVersion: security.istio.io/v1beta1\nkind: AuthorizationPolicy\nmetadata: {name: nothing, namespace: shop}\nspec: {}\n";
        let objects = parse(Path::new("p.yaml"), text).unwrap();
        let names: Vec<String> = objects.policies.iter().map(|p| p.to_string()).collect();
        assert_eq!(names, ["shop/allow-front", "shop/nothing"]);

        // Errors name the file, the document's line, the policy and the field.
        let bad = text.replace("namespaces: [shop]", "ipBlocks: [nonsense]");
        let err = parse(Path::new("p.yaml"), &bad).unwrap_err();
        assert_eq!(err.line, 1);
        assert!(
            err.to_string().contains("AuthorizationPolicy shop/allow-front: spec.rules[0].from[0].source.ipBlocks: \"nonsense\""),
            "{err}"
        );
        let typo = text.replace("rules:", "rule:");
        let err = parse(Path::new("p.yaml"), &typo).unwrap_err();
        assert!(
            err.problem.to_string().contains("unknown field `rule`"),
            "{err}"
        );
        let alpha = text.replace("security.istio.io/v1beta1", "security.istio.io/v1alpha9");
        let err = parse(Path::new("p.yaml"), &alpha).unwrap_err();
        assert_eq!(err.line, 7);
        assert!(
            err.problem
                .to_string()
                .contains("apiVersion \"security.istio.io/v1alpha9\""),
            "{err}"
        );
        let list = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: security.istio.io/v1\n  kind: AuthorizationPolicy\n  metadata: {name: a, namespace: b}\n  spec: {action: DENY}\n";
        assert_eq!(parse(Path::new("l.yaml"), list).unwrap().policies.len(), 1);
        // A policy under any other apiVersion is an error, never silently dropped
        // (that could drop a DENY).
        for (from, to) in [
            ("security.istio.io/v1", "security.istio.io/v1beta2"),
            ("apiVersion: security.istio.io/v1\n  ", ""),
        ] {
            let bad = list.replace(from, to);
            let err = parse(Path::new("l.yaml"), &bad).unwrap_err();
            assert!(
                err.problem
                    .to_string()
                    .contains("List item 0: AuthorizationPolicy has apiVersion"),
                "{bad}: {err}"
            );
        }
        for version in ["istio.io/v1", "security.istio.io.v1"] {
            let bad = text.replace("security.istio.io/v1beta1", version);
            let err = parse(Path::new("p.yaml"), &bad).unwrap_err();
            assert!(
                err.problem
                    .to_string()
                    .contains("AuthorizationPolicy has apiVersion"),
                "{err}"
            );
        }
    }

    #[test]
    fn services_and_endpoint_slices() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80, targetPort: http}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.244.1.2]}]\n";
        let objects = parse(Path::new("s.yaml"), text).unwrap();
        assert_eq!(
            (objects.services.len(), objects.endpoint_slices.len()),
            (1, 1)
        );
        for (from, to, want) in [
            (
                "clusterIP: 10.96.0.10",
                "clusterIP: 10.96.0.300",
                "cluster IP \"10.96.0.300\" is not an IP address",
            ),
            (
                "port: 80,",
                "port: 0,",
                "spec.ports[0].port 0 is not a port number",
            ),
            (
                "port: 8080",
                "port: 70000",
                "ports[0].port 70000 is not a port number",
            ),
            (
                "addresses: [10.244.1.2]",
                "addresses: [pod-a]",
                "endpoints[0].addresses \"pod-a\" is not an IP address",
            ),
            (
                "discovery.k8s.io/v1",
                "discovery.k8s.io/v1beta1",
                "EndpointSlice has apiVersion",
            ),
            (
                "{name: web, namespace: shop}",
                "{name: 1web, namespace: shop}",
                "Service shop/1web: metadata.name is not a DNS-1035 label",
            ),
        ] {
            let err = parse(Path::new("s.yaml"), &text.replace(from, to)).unwrap_err();
            assert!(err.problem.to_string().contains(want), "{to}: {err}");
        }
    }

    #[test]
    fn peer_authentications() {
        let text = "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: strict, namespace: shop}\nspec: {mtls: {mode: STRICT}}\n---\napiVersion: security.istio.io/v1beta1\nkind: PeerAuthentication\nmetadata: {name: open, namespace: bank}\nspec:\n  selector: {matchLabels: {app: teller}}\n  portLevelMtls: {\"8080\": {mode: DISABLE}}\n";
        let objects = parse(Path::new("pa.yaml"), text).unwrap();
        let names: Vec<String> = objects
            .mtls_policies
            .iter()
            .map(|p| p.to_string())
            .collect();
        assert_eq!(names, ["shop/strict", "bank/open"]);
        assert_eq!(
            objects.mtls_policies[0].mode,
            crate::authz::MtlsMode::Strict
        );

        // Errors name the file, the document's line, the policy and the field.
        let bad = text.replace("mode: DISABLE", "mode: OFF");
        let err = parse(Path::new("pa.yaml"), &bad).unwrap_err();
        assert_eq!(err.line, 6, "{err}");
        assert!(
            err.to_string().starts_with(
                "pa.yaml:6: PeerAuthentication bank/open: spec.portLevelMtls.8080.mode \"OFF\""
            ),
            "{err}"
        );
        let typo = text.replace("mtls: {mode: STRICT}", "mTLS: {mode: STRICT}");
        let err = parse(Path::new("pa.yaml"), &typo).unwrap_err();
        assert!(
            err.problem.to_string().contains("unknown field `mTLS`"),
            "{err}"
        );
        let alpha = text.replace("security.istio.io/v1beta1", "security.istio.io/v1alpha1");
        let err = parse(Path::new("pa.yaml"), &alpha).unwrap_err();
        assert!(
            err.problem
                .to_string()
                .contains("PeerAuthentication has apiVersion \"security.istio.io/v1alpha1\""),
            "{err}"
        );
        let bad_name = text.replace("name: strict", "name: Strict");
        let err = parse(Path::new("pa.yaml"), &bad_name).unwrap_err();
        assert!(
            err.problem.to_string().contains("not a DNS-1123 subdomain"),
            "{err}"
        );

        // Inside a List too, its version checked.
        let list = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: security.istio.io/v1beta1\n  kind: PeerAuthentication\n  metadata: {name: a, namespace: b}\n  spec: {mtls: {mode: PERMISSIVE}}\n";
        assert_eq!(
            parse(Path::new("l.yaml"), list)
                .unwrap()
                .mtls_policies
                .len(),
            1
        );
        let bad = list.replace("security.istio.io/v1beta1", "security.istio.io/v2");
        let err = parse(Path::new("l.yaml"), &bad).unwrap_err();
        assert!(
            err.problem
                .to_string()
                .contains("List item 0: PeerAuthentication has apiVersion"),
            "{err}"
        );
        let bad = list.replace("PERMISSIVE", "LOOSE");
        let err = parse(Path::new("l.yaml"), &bad).unwrap_err();
        assert!(
            err.problem
                .to_string()
                .contains("List item 0: PeerAuthentication b/a"),
            "{err}"
        );
    }

    #[test]
    fn nodes() {
        let text = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node1\n  labels: {topology.kubernetes.io/zone: zone-a}\nspec:\n  podCIDR: 10.244.1.0/24\n  podCIDRs: [10.244.1.0/24, 'fd00:1::/64']\n";
        let objects = parse(Path::new("n.yaml"), text).unwrap();
        assert_eq!(objects.nodes.len(), 1);
        let node = &objects.nodes[0];
        assert_eq!(
            node.metadata.labels.as_ref().unwrap()[crate::k8s::ZONE_LABEL],
            "zone-a"
        );
        assert_eq!(
            node.spec
                .as_ref()
                .unwrap()
                .pod_cidrs
                .as_ref()
                .unwrap()
                .len(),
            2
        );
        for (from, to, want) in [
            (
                "podCIDR: 10.244.1.0/24",
                "podCIDR: 10.244.1.0",
                "spec.podCIDR \"10.244.1.0\" is not a CIDR block",
            ),
            (
                "'fd00:1::/64'",
                "'fd00:1::/129'",
                "spec.podCIDRs[1] \"fd00:1::/129\" is not a CIDR block",
            ),
            (
                "name: node1",
                "name: Node_1",
                "Node Node_1: metadata.name is not a DNS-1123 subdomain",
            ),
            (
                "apiVersion: v1",
                "apiVersion: v2",
                "Node has apiVersion \"v2\"",
            ),
        ] {
            let err = parse(Path::new("n.yaml"), &text.replace(from, to)).unwrap_err();
            assert!(err.problem.to_string().contains(want), "{to}: {err}");
        }
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n- {}",
            text.replace('\n', "\n  ")
        );
        assert_eq!(parse(Path::new("l.yaml"), &list).unwrap().nodes.len(), 1);
    }

    #[test]
    fn lists_are_unpacked() {
        let text = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata: {name: a}\n- apiVersion: v1\n  kind: Namespace\n  metadata: {name: b}\n";
        let objects = parse(Path::new("l.yaml"), text).unwrap();
        assert_eq!(objects.pods.len(), 1);
        assert_eq!(objects.namespaces.len(), 1);
    }

    #[test]
    fn hostile_documents_are_refused_quickly_with_a_reason() {
        let deep = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n  labels: {}{}\n",
            "[".repeat(200_000),
            "]".repeat(200_000)
        );
        let err = parse(Path::new("deep.yaml"), &deep).unwrap_err();
        assert!(
            err.problem.to_string().contains("nested deeper than 64"),
            "{err}"
        );
        assert_eq!(err.line, 5);
        // The nesting is read as the parser reads it: a quote or `#` inside a plain
        // scalar (also after a space), or a quoted string over two lines, hides
        // none of it.
        for hide in [
            "[a'b, ",
            "[a\"b, ",
            "[a#b, ",
            "[a 'b, ",
            "[a \"b, ",
            "\"a\n    \", y: [",
        ] {
            let hidden = format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n  labels: {{x: {hide}{}{}]}}\n",
                "[".repeat(200_000),
                "]".repeat(200_000)
            );
            let err = parse(Path::new("hidden.yaml"), &hidden).unwrap_err();
            assert!(
                err.problem.to_string().contains("nested deeper than 64"),
                "{hide:?}: {err}"
            );
        }
        // Block nesting counts too.
        let mut block = String::from("apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\nnotes:\n");
        for level in 0..70 {
            block.push_str(&format!("{}k{level}:\n", "  ".repeat(level + 1)));
        }
        let err = parse(Path::new("block.yaml"), &block).unwrap_err();
        assert!(
            err.problem.to_string().contains("nested deeper than 64"),
            "{err}"
        );
        // Brackets inside strings and comments do not count.
        let quoted = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n  labels: {{a: \"{}\"}} # {}\n",
            "[".repeat(100),
            "{".repeat(100)
        );
        assert!(parse(Path::new("q.yaml"), &quoted).is_ok());
        // Nor inside single quotes with a doubled quote, or quotes after `[` and `,`.
        let quoted = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n  annotations: {{a: 'it''s {}'}}\nnotes: [\"{}\",'{}']\n",
            "[".repeat(100),
            "{".repeat(100),
            "[".repeat(100)
        );
        let objects = parse(Path::new("q.yaml"), &quoted).unwrap();
        assert_eq!(objects.pods.len(), 1);

        let cases = [
            ("kind: 5\napiVersion: v1\n", "kind must be a string"),
            (
                "apiVersion: v2\nkind: Pod\nmetadata: {name: x}\n",
                "apiVersion \"v2\"",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {serviceAccountName: wéb, containers: []}\n",
                "spec.serviceAccountName \"wéb\" is not a DNS-1123 subdomain",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata: {name: ../../etc}\n",
                "metadata.name is not a DNS-1123 subdomain",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: mesh/sa/evil}\n",
                "metadata.namespace \"mesh/sa/evil\" is not a DNS-1123 label",
            ),
            (
                "apiVersion: v1\nkind: Namespace\nmetadata: {name: Bad_Name}\n",
                "not a DNS-1123 label",
            ),
        ];
        for (text, want) in cases {
            let err = parse(Path::new("c.yaml"), text).unwrap_err();
            assert!(err.problem.to_string().contains(want), "{text:?}: {err}");
        }
        // A byte-order mark is not an error.
        let bom = format!("\u{feff}{POD}");
        assert_eq!(parse(Path::new("bom.yaml"), &bom).unwrap().pods.len(), 1);
    }
}
