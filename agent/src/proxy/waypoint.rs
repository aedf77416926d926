//! Waypoints: when istiod says a destination service or workload has one
//! (Istio's `istio.io/use-waypoint`, workload xDS `waypoint` and
//! `weighted_waypoints`), an outbound connection goes to the waypoint over
//! HBONE with the original destination in the CONNECT, as ztunnel's outbound
//! does; the waypoint (an L7 proxy) forwards it. A waypoint that is named but
//! cannot be reached (not known, no ready endpoint) refuses the connection:
//! never sent around it.
//!
//! Inbound, a connection from a destination's waypoint ([`serves`]: its peer
//! address and verified identity are a workload of a waypoint named for the
//! destination) is served like any other HBONE connection, as ztunnel's
//! inbound does: the destination's policies apply with the waypoint's identity
//! as the source (the waypoint enforces what concerns the original client),
//! and the pod sees the waypoint's address. It is logged and recorded as
//! `inbound_waypoint`. A waypoint's own outbound connections to what it
//! serves do not go through it again (ztunnel's `check_from_waypoint`).

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use crate::{
    identity::SpiffeId,
    state::{
        View, Workload,
        endpoint::{EndpointGuard, EndpointLoad},
        service::ServicePort,
        workload::{Waypoint, WaypointTarget},
    },
};

/// The waypoint a connection goes through.
pub struct Via {
    /// Its HBONE address (a waypoint workload's address and HBONE port).
    pub addr: SocketAddr,
    /// The waypoint workload (its identity is verified).
    pub workload: Arc<Workload>,
    /// Counts the connection on the endpoint chosen, when the waypoint was
    /// named by a service.
    pub _guard: Option<EndpointGuard>,
}

/// The waypoint `service` (the destination's Service port, if it is one) or
/// else the destination workload at `dst` names, if any; for the connection
/// of `source` from its address `src` (its address family, its endpoint
/// choice). `random` in `[0, 1)` picks among weighted waypoints. `None` too
/// when `source` is itself a workload of the waypoint named (of any of a
/// service's weighted waypoints): a waypoint's own connection to what it
/// serves.
///
/// # Errors
/// A waypoint is named but cannot be reached: why, for the log.
pub fn choose(
    view: &View,
    endpoints: &EndpointLoad,
    service: Option<&ServicePort>,
    dst: SocketAddr,
    (source, src): (&Workload, IpAddr),
    random: f64,
) -> Result<Option<Via>, String> {
    let named = match service {
        Some(s) if s.waypoints.iter().any(|(w, _)| is_member(view, w, source)) => None,
        Some(s) => weighted(&s.waypoints, random).cloned(),
        None => view
            .workloads
            .by_ip(dst.ip())
            .and_then(|w| w.mesh.as_ref()?.waypoint.clone())
            .filter(|w| !is_member(view, w, source)),
    };
    let Some(waypoint) = named else {
        return Ok(None);
    };
    reach(view, endpoints, &waypoint, src)
        .map(Some)
        .ok_or_else(|| format!("its waypoint {} cannot be reached", describe(&waypoint)))
}

/// One of `waypoints` by weight (`random` in `[0, 1)`).
fn weighted(waypoints: &[(Waypoint, u32)], random: f64) -> Option<&Waypoint> {
    let total: u64 = waypoints.iter().map(|(_, w)| u64::from(*w)).sum();
    if total == 0 {
        return waypoints.first().map(|(w, _)| w);
    }
    // Truncation intended: a point in [0, total).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let mut point = (random.clamp(0.0, 1.0) * total as f64) as u64;
    for (w, weight) in waypoints {
        if point < u64::from(*weight) {
            return Some(w);
        }
        point -= u64::from(*weight);
    }
    waypoints.last().map(|(w, _)| w)
}

/// The waypoint workload and address `waypoint` leads to from `src`.
fn reach(view: &View, endpoints: &EndpointLoad, waypoint: &Waypoint, src: IpAddr) -> Option<Via> {
    let vips: Vec<IpAddr> = match &waypoint.target {
        WaypointTarget::Address(ip) => vec![*ip],
        WaypointTarget::Service(host) => view.services.host(host).to_vec(),
    };
    // The client's family first.
    let mut vips = vips;
    vips.sort_by_key(|ip| ip.is_ipv4() != src.is_ipv4());
    for ip in vips {
        let at = SocketAddr::new(ip, waypoint.port);
        if let Some(port) = view.services.lookup(at) {
            let guard = endpoints.pick(port, src)?;
            let workload = view.workloads.by_ip(guard.addr.ip())?.clone();
            return Some(Via {
                addr: guard.addr,
                workload,
                _guard: Some(guard),
            });
        }
        if let Some(workload) = view.workloads.by_ip(ip) {
            return Some(Via {
                addr: at,
                workload: workload.clone(),
                _guard: None,
            });
        }
    }
    None
}

/// Whether the peer of an inbound connection, at `peer` with the verified
/// identity `client`, is a waypoint of `destination`: a workload at that
/// address with that identity belongs to the waypoint `destination` names, or
/// to one (weighted or not) of a service it backs. Both the address and the
/// identity must match, as ztunnel's `check_from_waypoint` requires: a peer
/// that presents another identity from the waypoint's address, or the
/// waypoint's identity from another address, is not it.
pub fn serves(view: &View, destination: &Workload, client: &SpiffeId, peer: IpAddr) -> bool {
    let Some(from) = view.workloads.by_ip(peer).filter(|w| w.identity == *client) else {
        return false;
    };
    let Some(facts) = destination.mesh.as_ref() else {
        return false;
    };
    if facts
        .waypoint
        .as_ref()
        .is_some_and(|w| is_member(view, w, from))
    {
        return true;
    }
    facts.services.iter().any(|(host, ports)| {
        view.services.host(host).iter().any(|vip| {
            ports.iter().any(|(port, _)| {
                view.services
                    .lookup(SocketAddr::new(*vip, *port))
                    .is_some_and(|s| s.waypoints.iter().any(|(w, _)| is_member(view, w, from)))
            })
        })
    })
}

/// Whether `workload` is one of the workloads of `waypoint`: the one at its
/// address, or an endpoint of its service.
fn is_member(view: &View, waypoint: &Waypoint, workload: &Workload) -> bool {
    let vips = match &waypoint.target {
        WaypointTarget::Address(ip) => std::slice::from_ref(ip),
        WaypointTarget::Service(host) => view.services.host(host),
    };
    vips.iter().any(|ip| {
        workload.ips.contains(ip)
            || view
                .services
                .lookup(SocketAddr::new(*ip, waypoint.port))
                .is_some_and(|s| {
                    s.endpoints
                        .iter()
                        .any(|e| workload.ips.contains(&e.addr.ip()))
                })
    })
}

fn describe(w: &Waypoint) -> String {
    match &w.target {
        WaypointTarget::Address(ip) => SocketAddr::new(*ip, w.port).to_string(),
        WaypointTarget::Service(host) => format!("{host}:{}", w.port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        source::xds::convert,
        state::{WorkloadIndex, service::ServiceIndex},
        xds::proto::workload::{
            self as xds, GatewayAddress, NamespacedHostname, NetworkAddress, Port, PortList,
            gateway_address::Destination,
        },
    };

    /// An istiod workload `name` of namespace `mesh` (service account `name`)
    /// at `ip`, backing `services` (`namespace/hostname`, service port,
    /// target port), its waypoint `waypoint`.
    fn workload(
        name: &str,
        ip: [u8; 4],
        services: &[(&str, u32, u32)],
        waypoint: Option<GatewayAddress>,
    ) -> Arc<Workload> {
        let w = xds::Workload {
            uid: format!("test//Pod/mesh/{name}"),
            name: name.to_string(),
            namespace: "mesh".to_string(),
            addresses: vec![ip.to_vec()],
            tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
            service_account: name.to_string(),
            node: "n2".to_string(),
            services: services
                .iter()
                .map(|(host, port, target)| {
                    let ports = vec![Port {
                        service_port: *port,
                        target_port: *target,
                        app_protocol: 0,
                    }];
                    ((*host).to_string(), PortList { ports })
                })
                .collect(),
            waypoint,
            ..Default::default()
        };
        convert::workload(&w, "cluster.local").unwrap()
    }

    /// An istiod service `mesh/<name>` at `vip`, port `port` to `port`.
    fn service(
        name: &str,
        vip: [u8; 4],
        port: u32,
        waypoint: Option<GatewayAddress>,
    ) -> Arc<crate::state::service::MeshService> {
        let s = xds::Service {
            name: name.to_string(),
            namespace: "mesh".to_string(),
            hostname: format!("{name}.mesh.svc.cluster.local"),
            addresses: vec![NetworkAddress {
                network: String::new(),
                address: vip.to_vec(),
                length: None,
            }],
            ports: vec![Port {
                service_port: port,
                target_port: port,
                app_protocol: 0,
            }],
            waypoint,
            ..Default::default()
        };
        convert::service(&s).unwrap()
    }

    fn at(ip: [u8; 4]) -> Option<GatewayAddress> {
        Some(GatewayAddress {
            destination: Some(Destination::Address(NetworkAddress {
                network: String::new(),
                address: ip.to_vec(),
                length: None,
            })),
            hbone_mtls_port: 15008,
        })
    }

    /// The service `mesh/api` (10.96.0.77:80, backed by `server` at
    /// 10.244.2.5) names the waypoint workload at 10.100.0.252; the workload
    /// `db` (10.244.2.6) names the waypoint service `mesh/wp` (10.96.0.50:15008,
    /// backed by the waypoint workload `wp-1` at 10.244.3.7); `client`
    /// (10.244.1.2) and `other` (10.244.3.3) are plain workloads.
    fn mesh() -> View {
        let api = "mesh/api.mesh.svc.cluster.local";
        let wp = "mesh/wp.mesh.svc.cluster.local";
        let by_name = GatewayAddress {
            destination: Some(Destination::Hostname(NamespacedHostname {
                namespace: "mesh".to_string(),
                hostname: "wp.mesh.svc.cluster.local".to_string(),
            })),
            hbone_mtls_port: 15008,
        };
        let workloads = [
            workload("server", [10, 244, 2, 5], &[(api, 80, 8080)], None),
            workload("db", [10, 244, 2, 6], &[], Some(by_name)),
            workload("waypoint", [10, 100, 0, 252], &[], None),
            workload("wp-1", [10, 244, 3, 7], &[(wp, 15008, 15008)], None),
            workload("client", [10, 244, 1, 2], &[], None),
            workload("other", [10, 244, 3, 3], &[], None),
        ];
        let services = [
            service("api", [10, 96, 0, 77], 80, at([10, 100, 0, 252])),
            service("wp", [10, 96, 0, 50], 15008, None),
        ];
        let mut index = WorkloadIndex::build("n1", "cluster.local", [], []).0;
        index.lay_mesh(workloads.iter());
        let mut service_index = ServiceIndex::default();
        let here = crate::state::service::Locality {
            node: "n1",
            zone: None,
        };
        let warnings = service_index.lay_mesh(services.iter(), &index, here);
        assert!(warnings.is_empty(), "{warnings:?}");
        View {
            workloads: Arc::new(index),
            services: Arc::new(service_index),
            ..View::default()
        }
    }

    fn id(sa: &str) -> SpiffeId {
        SpiffeId::new("cluster.local", "mesh", sa)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A peer is the destination's waypoint when both its address and its
    /// verified identity are a waypoint workload's, for a waypoint named by a
    /// service the destination backs or by the destination itself (by its
    /// service's name, any of its endpoints); a peer with only one of the two
    /// is not, nor is a waypoint for a workload that names none.
    #[test]
    fn the_waypoint_is_known_by_its_address_and_identity() {
        let view = mesh();
        let w = |name: &str| view.workloads.get(&format!("mesh/{name}")).unwrap().clone();
        let (server, db, client) = (w("server"), w("db"), w("client"));
        assert!(serves(&view, &server, &id("waypoint"), ip("10.100.0.252")));
        assert!(serves(&view, &db, &id("wp-1"), ip("10.244.3.7")));
        // Another identity from the waypoint's address.
        assert!(!serves(&view, &server, &id("other"), ip("10.100.0.252")));
        assert!(!serves(&view, &server, &id("client"), ip("10.100.0.252")));
        // The waypoint's identity from another workload's address, or from an
        // address no workload has.
        assert!(!serves(&view, &server, &id("waypoint"), ip("10.244.3.3")));
        assert!(!serves(&view, &server, &id("waypoint"), ip("10.100.0.99")));
        // Not the waypoint these destinations name.
        assert!(!serves(&view, &db, &id("waypoint"), ip("10.100.0.252")));
        assert!(!serves(&view, &server, &id("wp-1"), ip("10.244.3.7")));
        assert!(!serves(&view, &client, &id("waypoint"), ip("10.100.0.252")));
    }

    /// A client's connection to a service with a waypoint goes to the
    /// waypoint; the waypoint's own connection to it does not go through
    /// itself again; a workload's named waypoint service is reached at an
    /// endpoint of it.
    #[test]
    fn a_waypoint_is_not_its_own_waypoint() {
        let view = mesh();
        let endpoints = EndpointLoad::default();
        let w = |name: &str| view.workloads.get(&format!("mesh/{name}")).unwrap().clone();
        let vip: SocketAddr = "10.96.0.77:80".parse().unwrap();
        let api = view.services.lookup(vip).cloned();
        let choose = |source: &Workload, dst: SocketAddr| {
            let service = view.services.lookup(dst).cloned();
            choose(
                &view,
                &endpoints,
                service.as_deref(),
                dst,
                (source, source.ips[0]),
                0.5,
            )
            .unwrap()
            .map(|via| via.addr)
        };
        assert!(api.is_some());
        let via = choose(&w("client"), vip);
        assert_eq!(via, Some("10.100.0.252:15008".parse().unwrap()));
        assert_eq!(choose(&w("waypoint"), vip), None);
        let db: SocketAddr = "10.244.2.6:5432".parse().unwrap();
        assert_eq!(
            choose(&w("client"), db),
            Some("10.244.3.7:15008".parse().unwrap())
        );
        assert_eq!(choose(&w("wp-1"), db), None);
    }

    fn wp(ip: &str) -> Waypoint {
        Waypoint {
            target: WaypointTarget::Address(ip.parse().unwrap()),
            port: 15008,
        }
    }

    /// Weighted waypoints are picked in proportion to their weights.
    #[test]
    fn weights_divide_the_connections() {
        let all = [(wp("10.0.0.1"), 1), (wp("10.0.0.2"), 3)];
        let picks: Vec<_> = [0.0, 0.2, 0.25, 0.5, 0.99]
            .iter()
            .map(|&r| weighted(&all, r).unwrap().clone())
            .collect();
        assert_eq!(picks[0], all[0].0);
        assert_eq!(picks[1], all[0].0);
        assert_eq!(picks[2], all[1].0);
        assert_eq!(picks[4], all[1].0);
        assert!(weighted(&[], 0.5).is_none());
    }
}
