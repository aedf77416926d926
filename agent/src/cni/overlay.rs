//! The addresses podlink-cni reported, laid over the pods of whichever source
//! runs ([`PodLayer`]).
//!
//! At CNI ADD time the pod's object may not have reached the agent's source
//! yet, and it has no `status.podIP` yet: the addresses the plugin reports
//! (`namespace/name` → addresses) stand in until the object lists the same.
//! DEL drops them.

use std::{
    borrow::Cow,
    collections::{BTreeSet, HashMap},
    net::IpAddr,
};

use super::protocol::Request;
use crate::{
    k8s::{Pod, PodIP, PodStatus},
    state::{PodLayer, workload::pod_ips_are},
};

/// What the plugin reported for a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reported {
    container_id: String,
    ips: Vec<IpAddr>,
    host_interface: Option<String>,
}

/// What the plugin reported, by pod (`namespace/name`).
#[derive(Debug, Default)]
pub struct ReportedAddresses {
    reported: HashMap<String, Reported>,
    /// The pods whose reported addresses changed since
    /// [`ReportedAddresses::take_changed`].
    changed: BTreeSet<String>,
}

impl ReportedAddresses {
    /// Records what an ADD reports.
    pub fn report(&mut self, request: &Request) {
        let key = request.key();
        let reported = Reported {
            container_id: request.container_id.clone(),
            ips: request.ips.clone(),
            host_interface: request.host_interface.clone(),
        };
        if self.reported.get(&key) != Some(&reported) {
            self.changed.insert(key.clone());
            self.reported.insert(key, reported);
        }
    }

    /// Forgets what the same sandbox reported, on its DEL.
    pub fn forget(&mut self, request: &Request) {
        let key = request.key();
        if self
            .reported
            .get(&key)
            .is_some_and(|r| r.container_id == request.container_id)
        {
            self.reported.remove(&key);
            self.changed.insert(key);
        }
    }

    /// The pods (`namespace/name`) whose reported addresses changed since the
    /// last call: their workloads are to be made again.
    pub fn take_changed(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.changed)
    }
}

impl PodLayer for ReportedAddresses {
    /// The live sandbox's addresses win over the object's, which may still be
    /// those of an earlier sandbox (until the kubelet updates the status) or
    /// none yet.
    fn overlaid<'a>(&self, pod: &'a Pod) -> Cow<'a, Pod> {
        if self.reported.is_empty() {
            return Cow::Borrowed(pod);
        }
        let Some(key) = pod.key() else {
            return Cow::Borrowed(pod);
        };
        match self.reported.get(&key) {
            Some(reported) if !reported.ips.is_empty() && !pod_ips_are(pod, &reported.ips) => {
                let mut pod = pod.clone();
                let status = pod.status.get_or_insert_with(PodStatus::default);
                status.pod_ip = Some(reported.ips[0].to_string());
                status.pod_ips = Some(
                    reported
                        .ips
                        .iter()
                        .map(|ip| PodIP { ip: ip.to_string() })
                        .collect(),
                );
                Cow::Owned(pod)
            }
            _ => Cow::Borrowed(pod),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::protocol::Command;

    fn pod(yaml: &str) -> Pod {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn add(name: &str, container: &str) -> Request {
        Request {
            version: 1,
            command: Command::Add,
            container_id: container.into(),
            namespace: "amb".into(),
            name: name.into(),
            ips: vec!["10.244.1.9".parse().unwrap()],
            host_interface: Some("veth9".into()),
        }
    }

    #[test]
    fn the_live_sandbox_addresses_win_over_a_stale_object() {
        let mut reported = ReportedAddresses::default();
        let stale = pod(
            "metadata: {name: web, namespace: amb}\nspec: {nodeName: n1}\nstatus: {podIP: 10.244.1.8, podIPs: [{ip: 10.244.1.8}]}",
        );
        reported.report(&add("web", "c1"));
        let overlaid = reported.overlaid(&stale);
        let status = overlaid.status.as_ref().unwrap();
        assert_eq!(status.pod_ip.as_deref(), Some("10.244.1.9"));
        // Once the object lists the same addresses, it is used as it is.
        let current = pod(
            "metadata: {name: web, namespace: amb}\nspec: {nodeName: n1}\nstatus: {podIP: 10.244.1.9}",
        );
        assert!(matches!(reported.overlaid(&current), Cow::Borrowed(_)));
    }
}
