//! istiod's resources (workload xDS, Istio's `pkg/workloadapi/workload.proto`)
//! as podlink's state holds them: a `Workload` becomes a
//! [`Workload`] with [`MeshFacts`], a `Service` a [`MeshService`]. Each
//! conversion refuses a resource it cannot use with a message naming the field
//! (the client NACKs it); fields podlink does not read are ignored.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;

use crate::{
    identity::SpiffeId,
    state::{
        Enrollment, Workload,
        service::{BalancingMode, MeshBalancing, MeshService},
        workload::{MeshFacts, Waypoint, WaypointTarget},
    },
    xds::proto::workload::{self as xds, load_balancing},
};

/// The enrollment of a workload istiod says is reached over HBONE.
const TUNNELLED: Enrollment = Enrollment::Enrolled;
/// The enrollment of one reached directly (`tunnel_protocol: NONE`).
const DIRECT: Enrollment = Enrollment::NotEnrolled("istiod says it is reached without a tunnel");

/// The workload `w` describes; `default_trust_domain` when it names none.
///
/// # Errors
/// No name or namespace; an address that is neither 4 nor 16 bytes; a tunnel
/// protocol other than `NONE` and `HBONE` (`LEGACY_ISTIO_MTLS`, or one podlink
/// does not know); a port above 65535.
pub fn workload(w: &xds::Workload, default_trust_domain: &str) -> Result<Arc<Workload>, String> {
    if w.name.is_empty() || w.namespace.is_empty() {
        return Err("name and namespace must be set".to_string());
    }
    let ips = w
        .addresses
        .iter()
        .enumerate()
        .map(|(i, a)| ip(a).map_err(|why| format!("addresses[{i}]: {why}")))
        .collect::<Result<Vec<_>, _>>()?;
    let enrollment = match xds::TunnelProtocol::try_from(w.tunnel_protocol) {
        Ok(xds::TunnelProtocol::Hbone) => TUNNELLED,
        Ok(xds::TunnelProtocol::None) => DIRECT,
        Ok(other) => {
            return Err(format!(
                "tunnel_protocol {} is not supported by podlink",
                other.as_str_name()
            ));
        }
        Err(_) => {
            return Err(format!(
                "tunnel_protocol {} is not known to podlink",
                w.tunnel_protocol
            ));
        }
    };
    let mut services = BTreeMap::new();
    for (key, list) in &w.services {
        let ports = list
            .ports
            .iter()
            .map(|p| {
                Ok((
                    port(p.service_port).map_err(|e| format!("services[{key}]: {e}"))?,
                    port(p.target_port).map_err(|e| format!("services[{key}]: {e}"))?,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        services.insert(key.clone(), ports);
    }
    let trust_domain = if w.trust_domain.is_empty() {
        default_trust_domain
    } else {
        &w.trust_domain
    };
    let service_account = if w.service_account.is_empty() {
        "default"
    } else {
        &w.service_account
    };
    let kind = match xds::WorkloadType::try_from(w.workload_type) {
        Ok(xds::WorkloadType::Deployment) => "Deployment",
        Ok(xds::WorkloadType::Cronjob) => "CronJob",
        Ok(xds::WorkloadType::Job) => "Job",
        Ok(xds::WorkloadType::Pod) | Err(_) => "Pod",
    };
    let workload_name = if w.workload_name.is_empty() {
        w.name.clone()
    } else {
        w.workload_name.clone()
    };
    let waypoint = w
        .waypoint
        .as_ref()
        .map(|g| waypoint(g).map_err(|e| format!("waypoint: {e}")))
        .transpose()?;
    let zone = w
        .locality
        .as_ref()
        .map(|l| l.zone.clone())
        .filter(|z| !z.is_empty());
    Ok(Arc::new(Workload {
        key: Arc::from(format!("{}/{}", w.namespace, w.name)),
        namespace: w.namespace.clone(),
        name: w.name.clone(),
        node: (!w.node.is_empty()).then(|| w.node.clone()),
        service_account: service_account.to_string(),
        identity: SpiffeId::new(trust_domain, &w.namespace, service_account),
        ips,
        enrollment,
        terminating: false,
        labels: BTreeMap::new(),
        canonical_service: if w.canonical_name.is_empty() {
            workload_name.clone()
        } else {
            w.canonical_name.clone()
        },
        canonical_revision: if w.canonical_revision.is_empty() {
            "latest".to_string()
        } else {
            w.canonical_revision.clone()
        },
        workload_name,
        workload_kind: kind.to_string(),
        host_network: w.network_mode == xds::NetworkMode::HostNetwork as i32,
        dns_capture: true,
        mesh: Some(Arc::new(MeshFacts {
            uid: w.uid.clone(),
            policies: w.authorization_policies.clone(),
            services,
            healthy: w.status == xds::WorkloadStatus::Healthy as i32,
            network: w.network.clone(),
            zone,
            waypoint,
        })),
    }))
}

/// The service `s` describes.
///
/// # Errors
/// No name, namespace or hostname; no address; an address that is neither 4
/// nor 16 bytes, or a prefix longer than it; a port above 65535; a
/// load-balancing mode, scope or health policy podlink does not know.
pub fn service(s: &xds::Service) -> Result<Arc<MeshService>, String> {
    if s.name.is_empty() || s.namespace.is_empty() || s.hostname.is_empty() {
        return Err("name, namespace and hostname must be set".to_string());
    }
    let vips = s
        .addresses
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let ip = ip(&a.address).map_err(|why| format!("addresses[{i}]: {why}"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let len = a.length.unwrap_or(max);
            let len = u8::try_from(len)
                .ok()
                .filter(|l| u32::from(*l) <= max)
                .ok_or_else(|| {
                    format!("addresses[{i}]: prefix length {len} is longer than the address")
                })?;
            Ok(IpNet::new(ip, len).expect("length checked"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let ports = s
        .ports
        .iter()
        .enumerate()
        .map(|(i, p)| {
            Ok((
                port(p.service_port).map_err(|e| format!("ports[{i}]: {e}"))?,
                port(p.target_port).map_err(|e| format!("ports[{i}]: {e}"))?,
            ))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let balancing = match &s.load_balancing {
        None => MeshBalancing::default(),
        Some(lb) => balancing(lb).map_err(|e| format!("load_balancing: {e}"))?,
    };
    let mut waypoints = Vec::new();
    if let Some(g) = &s.waypoint {
        waypoints.push((waypoint(g).map_err(|e| format!("waypoint: {e}"))?, 1));
    }
    for (i, weighted) in s.weighted_waypoints.iter().enumerate() {
        let g = weighted
            .destination
            .as_ref()
            .ok_or_else(|| format!("weighted_waypoints[{i}]: no destination"))?;
        let w = waypoint(g).map_err(|e| format!("weighted_waypoints[{i}]: {e}"))?;
        if weighted.weight > 0 {
            waypoints.push((w, weighted.weight));
        }
    }
    if !s.weighted_waypoints.is_empty() && waypoints.is_empty() {
        return Err("weighted_waypoints: every weight is 0".to_string());
    }
    Ok(Arc::new(MeshService {
        namespace: s.namespace.clone(),
        name: s.name.clone(),
        hostname: s.hostname.clone(),
        vips,
        ports,
        balancing,
        waypoints,
    }))
}

/// istiod's load balancing, as podlink applies it ([`MeshBalancing`]).
fn balancing(lb: &xds::LoadBalancing) -> Result<MeshBalancing, String> {
    use load_balancing::{HealthPolicy, Mode, Scope};
    let mode = match Mode::try_from(lb.mode) {
        Ok(Mode::UnspecifiedMode) => BalancingMode::Any,
        Ok(Mode::Failover) => BalancingMode::Failover,
        Ok(Mode::Strict) => BalancingMode::Strict,
        Ok(Mode::Passthrough) => BalancingMode::Passthrough,
        Err(_) => return Err(format!("mode {} is not known to podlink", lb.mode)),
    };
    let allow_unhealthy = match HealthPolicy::try_from(lb.health_policy) {
        Ok(HealthPolicy::OnlyHealthy) => false,
        Ok(HealthPolicy::AllowAll) => true,
        Err(_) => {
            return Err(format!(
                "health_policy {} is not known to podlink",
                lb.health_policy
            ));
        }
    };
    let mut b = MeshBalancing {
        mode,
        allow_unhealthy,
        ..MeshBalancing::default()
    };
    for (i, &scope) in lb.routing_preference.iter().enumerate() {
        match Scope::try_from(scope) {
            Ok(Scope::Node) => {
                b.node_first |= !b.zone;
                b.node = true;
            }
            Ok(Scope::Region | Scope::Zone | Scope::Subzone) => b.zone = true,
            Ok(Scope::Cluster | Scope::Network | Scope::UnspecifiedScope) => {}
            Err(_) => {
                return Err(format!(
                    "routing_preference[{i}] {scope} is not known to podlink"
                ));
            }
        }
    }
    Ok(b)
}

/// The waypoint a `GatewayAddress` names.
fn waypoint(g: &xds::GatewayAddress) -> Result<Waypoint, String> {
    use xds::gateway_address::Destination;
    let target = match &g.destination {
        Some(Destination::Address(a)) => WaypointTarget::Address(ip(&a.address)?),
        Some(Destination::Hostname(h)) if !h.hostname.is_empty() => {
            WaypointTarget::Service(format!("{}/{}", h.namespace, h.hostname))
        }
        Some(Destination::Hostname(_)) => return Err("an empty hostname".to_string()),
        None => return Err("neither an address nor a hostname".to_string()),
    };
    let port = match port(g.hbone_mtls_port)? {
        0 => 15008,
        p => p,
    };
    Ok(Waypoint { target, port })
}

/// An address of 4 or 16 bytes.
fn ip(bytes: &[u8]) -> Result<IpAddr, String> {
    match bytes.len() {
        4 => Ok(IpAddr::from(<[u8; 4]>::try_from(bytes).expect("4 bytes"))),
        16 => Ok(IpAddr::from(<[u8; 16]>::try_from(bytes).expect("16 bytes")).to_canonical()),
        n => Err(format!("an address of {n} bytes (4 or 16 expected)")),
    }
}

fn port(p: u32) -> Result<u16, String> {
    u16::try_from(p).map_err(|_| format!("port {p} is above 65535"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::proto::workload::{LoadBalancing, Locality, NetworkAddress, Port, PortList};

    fn pod(name: &str, ip: [u8; 4], node: &str) -> xds::Workload {
        xds::Workload {
            uid: format!("Kubernetes//Pod/shop/{name}"),
            name: name.to_string(),
            namespace: "shop".to_string(),
            addresses: vec![ip.to_vec()],
            tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
            service_account: "web".to_string(),
            node: node.to_string(),
            canonical_name: "web".to_string(),
            canonical_revision: "v1".to_string(),
            workload_name: "web".to_string(),
            services: [(
                "shop/web.shop.svc.cluster.local".to_string(),
                PortList {
                    ports: vec![Port {
                        service_port: 80,
                        target_port: 8080,
                        app_protocol: 0,
                    }],
                },
            )]
            .into(),
            authorization_policies: vec!["shop/only-front".to_string()],
            locality: Some(Locality {
                zone: "z1".to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_workload_carries_what_istiod_says() {
        let w = workload(&pod("web-0", [10, 244, 2, 5], "node-2"), "cluster.local").unwrap();
        assert_eq!(w.key(), "shop/web-0");
        assert_eq!(w.ips, ["10.244.2.5".parse::<IpAddr>().unwrap()]);
        assert!(w.enrollment.is_enrolled());
        assert_eq!(
            w.identity.to_string(),
            "spiffe://cluster.local/ns/shop/sa/web"
        );
        assert_eq!(w.node.as_deref(), Some("node-2"));
        assert_eq!(w.workload_kind, "Deployment");
        let facts = w.mesh.as_ref().unwrap();
        assert_eq!(facts.policies, ["shop/only-front"]);
        assert!(facts.healthy);
        assert_eq!(facts.zone.as_deref(), Some("z1"));
        assert_eq!(
            facts.target_port("shop/web.shop.svc.cluster.local", 80, 80),
            Some(8080)
        );
        let mut direct = pod("db", [10, 0, 0, 9], "node-2");
        direct.tunnel_protocol = xds::TunnelProtocol::None as i32;
        direct.trust_domain = "other.example".to_string();
        let direct = workload(&direct, "cluster.local").unwrap();
        assert!(!direct.enrollment.is_enrolled());
        assert_eq!(direct.identity.trust_domain(), "other.example");
    }

    #[test]
    fn a_workload_podlink_cannot_use_is_refused_with_the_field() {
        let mut w = pod("web-0", [10, 0, 0, 1], "n");
        w.addresses.push(vec![1, 2, 3]);
        assert_eq!(
            workload(&w, "cluster.local").unwrap_err(),
            "addresses[1]: an address of 3 bytes (4 or 16 expected)"
        );
        let mut w = pod("web-0", [10, 0, 0, 1], "n");
        w.tunnel_protocol = 42;
        assert_eq!(
            workload(&w, "cluster.local").unwrap_err(),
            "tunnel_protocol 42 is not known to podlink"
        );
        let mut w = pod("web-0", [10, 0, 0, 1], "n");
        w.tunnel_protocol = xds::TunnelProtocol::LegacyIstioMtls as i32;
        assert!(
            workload(&w, "cluster.local")
                .unwrap_err()
                .contains("LEGACY_ISTIO_MTLS")
        );
        let mut w = pod("", [10, 0, 0, 1], "n");
        w.name.clear();
        assert!(workload(&w, "cluster.local").is_err());
    }

    fn svc() -> xds::Service {
        xds::Service {
            name: "web".to_string(),
            namespace: "shop".to_string(),
            hostname: "web.shop.svc.cluster.local".to_string(),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vec![10, 96, 0, 10],
                length: None,
            }],
            ports: vec![Port {
                service_port: 80,
                target_port: 8080,
                app_protocol: 0,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_service_carries_its_addresses_ports_and_balancing() {
        let mut s = svc();
        s.addresses.push(NetworkAddress {
            network: String::new(),
            address: vec![240, 240, 0, 0],
            length: Some(16),
        });
        s.load_balancing = Some(LoadBalancing {
            routing_preference: vec![
                load_balancing::Scope::Node as i32,
                load_balancing::Scope::Zone as i32,
            ],
            mode: load_balancing::Mode::Failover as i32,
            health_policy: 0,
        });
        let s = service(&s).unwrap();
        assert_eq!(s.key(), "shop/web.shop.svc.cluster.local");
        assert_eq!(
            s.vips,
            [
                "10.96.0.10/32".parse::<IpNet>().unwrap(),
                "240.240.0.0/16".parse().unwrap()
            ]
        );
        assert_eq!(s.ports, [(80, 8080)]);
        assert_eq!(s.balancing.mode, BalancingMode::Failover);
        assert!(s.balancing.node_first && s.balancing.zone);
    }

    #[test]
    fn waypoints_are_read_from_workloads_and_services() {
        use xds::{
            GatewayAddress, NamespacedHostname, WeightedWaypoint, gateway_address::Destination,
        };
        let by_name = |hostname: &str| GatewayAddress {
            destination: Some(Destination::Hostname(NamespacedHostname {
                namespace: "shop".to_string(),
                hostname: hostname.to_string(),
            })),
            hbone_mtls_port: 0,
        };
        let mut w = pod("web-0", [10, 0, 0, 1], "n");
        w.waypoint = Some(GatewayAddress {
            destination: Some(Destination::Address(NetworkAddress {
                network: String::new(),
                address: vec![10, 0, 0, 50],
                length: None,
            })),
            hbone_mtls_port: 15009,
        });
        let w = workload(&w, "cluster.local").unwrap();
        assert_eq!(
            w.mesh.as_ref().unwrap().waypoint,
            Some(Waypoint {
                target: WaypointTarget::Address("10.0.0.50".parse().unwrap()),
                port: 15009
            })
        );
        let mut s = svc();
        s.weighted_waypoints = vec![
            WeightedWaypoint {
                destination: Some(by_name("wp-a.shop.svc.cluster.local")),
                weight: 3,
            },
            WeightedWaypoint {
                destination: Some(by_name("wp-b.shop.svc.cluster.local")),
                weight: 0,
            },
        ];
        let s = service(&s).unwrap();
        assert_eq!(
            s.waypoints,
            [(
                Waypoint {
                    target: WaypointTarget::Service("shop/wp-a.shop.svc.cluster.local".to_string()),
                    port: 15008
                },
                3
            )]
        );
        let mut bad = svc();
        bad.waypoint = Some(GatewayAddress {
            destination: None,
            hbone_mtls_port: 0,
        });
        assert_eq!(
            service(&bad).unwrap_err(),
            "waypoint: neither an address nor a hostname"
        );
    }

    #[test]
    fn a_service_podlink_cannot_use_is_refused_with_the_field() {
        let mut s = svc();
        s.load_balancing = Some(LoadBalancing {
            mode: 17,
            ..Default::default()
        });
        assert_eq!(
            service(&s).unwrap_err(),
            "load_balancing: mode 17 is not known to podlink"
        );
        let mut s = svc();
        s.addresses[0].length = Some(33);
        assert_eq!(
            service(&s).unwrap_err(),
            "addresses[0]: prefix length 33 is longer than the address"
        );
        let mut s = svc();
        s.ports[0].service_port = 70_000;
        assert_eq!(
            service(&s).unwrap_err(),
            "ports[0]: port 70000 is above 65535"
        );
    }
}
