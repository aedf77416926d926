//! Waypoints: when istiod says a destination service or workload has one
//! (Istio's `istio.io/use-waypoint`, workload xDS `waypoint` and
//! `weighted_waypoints`), an outbound connection goes to the waypoint over
//! HBONE with the original destination in the CONNECT, as ztunnel's outbound
//! does; the waypoint (an L7 proxy) forwards it. A waypoint that is named but
//! cannot be reached (not known, no ready endpoint) refuses the connection:
//! never sent around it.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use crate::state::{
    View, Workload,
    endpoint::{EndpointGuard, EndpointLoad},
    service::ServicePort,
    workload::{Waypoint, WaypointTarget},
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
/// else the destination workload at `dst` names, if any; for client `src`
/// (its address family, its endpoint choice). `random` in `[0, 1)` picks
/// among weighted waypoints.
///
/// # Errors
/// A waypoint is named but cannot be reached: why, for the log.
pub fn choose(
    view: &View,
    endpoints: &EndpointLoad,
    service: Option<&ServicePort>,
    dst: SocketAddr,
    src: IpAddr,
    random: f64,
) -> Result<Option<Via>, String> {
    let named = match service {
        Some(s) => weighted(&s.waypoints, random).cloned(),
        None => view
            .workloads
            .by_ip(dst.ip())
            .and_then(|w| w.mesh.as_ref()?.waypoint.clone()),
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

fn describe(w: &Waypoint) -> String {
    match &w.target {
        WaypointTarget::Address(ip) => SocketAddr::new(*ip, w.port).to_string(),
        WaypointTarget::Service(host) => format!("{host}:{}", w.port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
