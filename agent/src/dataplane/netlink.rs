//! What the agent reads of the node's network on every reconcile — host routes,
//! veths and addresses — as route netlink dumps (`RTM_GETROUTE`, `RTM_GETLINK`,
//! `RTM_GETADDR`; rtnetlink(7)) over one socket kept open, through the
//! `rtnetlink` crate. Running `ip` for each would cost a process and a JSON
//! document per reconcile, which grows with the number of pods.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
};

use anyhow::{Context, Result};
use futures_util::TryStreamExt;
use rtnetlink::{
    Handle, RouteMessageBuilder,
    packet_route::{
        address::AddressAttribute,
        link::{InfoKind, LinkAttribute, LinkInfo},
        route::{RouteAddress, RouteAttribute, RouteHeader, RouteType},
    },
};

/// How long one [`Netlink::read`] may take.
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The node's network as one reconcile needs it.
#[derive(Debug, Default)]
pub struct NodeNetwork {
    /// Host routes: `/32` IPv4 routes of the main table that go straight out of an
    /// interface (no gateway), by destination, with the interface's index. A
    /// point-to-point CNI plugin (such as `ptp`) adds one per pod to its host veth.
    pub host_routes: HashMap<Ipv4Addr, u32>,
    /// The interfaces host routes lead to that are veths: index → name.
    pub veths: HashMap<u32, String>,
    /// Interfaces host routes lead to whose kind could not be read this time.
    pub unresolved: std::collections::HashSet<u32>,
    /// The node's own IPv4 addresses except loopback, sorted, without duplicates.
    pub addrs: Vec<Ipv4Addr>,
}

/// A route netlink socket in the agent's network namespace.
pub struct Netlink {
    handle: Handle,
    /// What each interface a host route led to is: its name if a veth. An
    /// interface's kind never changes, so each is asked about once (a dump of
    /// every link would cost more than all the rest as pods grow in number);
    /// entries go when no host route leads to their interface any more.
    kinds: std::sync::Mutex<HashMap<u32, Option<String>>>,
}

impl Netlink {
    /// Opens the socket; its connection task runs on the current tokio runtime.
    ///
    /// # Errors
    /// When the socket cannot be opened.
    pub fn open() -> Result<Self> {
        let (connection, handle, _) =
            rtnetlink::new_connection().context("opening a route netlink socket")?;
        tokio::spawn(connection);
        Ok(Self {
            handle,
            kinds: Default::default(),
        })
    }

    /// Reads routes, links and addresses, within [`READ_TIMEOUT`].
    ///
    /// # Errors
    /// A failed dump, naming what was read, or no complete answer in time (a
    /// reply the library cannot decode is dropped, and its request never ends:
    /// open a new socket then).
    pub async fn read(&self) -> Result<NodeNetwork> {
        tokio::time::timeout(READ_TIMEOUT, self.read_all())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "no complete answer within {}",
                    humantime::format_duration(READ_TIMEOUT)
                )
            })?
    }

    async fn read_all(&self) -> Result<NodeNetwork> {
        // One dump at a time: a netlink socket refuses a second one while the
        // first is in progress (EBUSY).
        let host_routes = self.host_routes().await?;
        let (veths, unresolved) = self.veths(&host_routes).await?;
        Ok(NodeNetwork {
            host_routes,
            veths,
            unresolved,
            addrs: self.addrs().await?,
        })
    }

    /// Forgets what interface `index` is, so that it is asked again (after an
    /// attach by its name failed: it may have been renamed).
    pub fn forget(&self, index: u32) {
        self.kinds.lock().expect("kinds lock").remove(&index);
    }

    async fn host_routes(&self) -> Result<HashMap<Ipv4Addr, u32>> {
        let mut routes = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute();
        let mut out = HashMap::new();
        while let Some(route) = routes.try_next().await.context("dumping routes")? {
            let header = &route.header;
            let table = route
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(header.table));
            if table != u32::from(RouteHeader::RT_TABLE_MAIN)
                || header.kind != RouteType::Unicast
                || header.destination_prefix_length != 32
            {
                continue;
            }
            let mut dst = None;
            let mut oif = None;
            let mut gateway = false;
            for attribute in &route.attributes {
                match attribute {
                    RouteAttribute::Destination(RouteAddress::Inet(ip)) => dst = Some(*ip),
                    RouteAttribute::Oif(index) => oif = Some(*index),
                    RouteAttribute::Gateway(_) | RouteAttribute::MultiPath(_) => gateway = true,
                    _ => {}
                }
            }
            if let (Some(dst), Some(oif), false) = (dst, oif, gateway) {
                out.insert(dst, oif);
            }
        }
        Ok(out)
    }

    async fn veths(
        &self,
        host_routes: &HashMap<Ipv4Addr, u32>,
    ) -> Result<(HashMap<u32, String>, std::collections::HashSet<u32>)> {
        let wanted: std::collections::HashSet<u32> = host_routes.values().copied().collect();
        let unknown: Vec<u32> = {
            let mut kinds = self.kinds.lock().expect("kinds lock");
            kinds.retain(|index, _| wanted.contains(index));
            wanted
                .iter()
                .filter(|i| !kinds.contains_key(i))
                .copied()
                .collect()
        };
        let mut unresolved = std::collections::HashSet::new();
        for index in unknown {
            let mut links = self.handle.link().get().match_index(index).execute();
            let kind = match links.try_next().await {
                Ok(Some(link)) => veth_name(&link),
                // Gone since the routes were read, or refused: asked again next
                // time if a route still leads to it.
                Ok(None) | Err(rtnetlink::Error::NetlinkError(_)) => {
                    unresolved.insert(index);
                    continue;
                }
                Err(e) => return Err(e).context(format!("reading link {index}")),
            };
            self.kinds.lock().expect("kinds lock").insert(index, kind);
        }
        let kinds = self.kinds.lock().expect("kinds lock");
        let veths = kinds
            .iter()
            .filter_map(|(index, name)| Some((*index, name.clone()?)))
            .collect();
        Ok((veths, unresolved))
    }

    async fn addrs(&self) -> Result<Vec<Ipv4Addr>> {
        let mut messages = self.handle.address().get().execute();
        let mut out = Vec::new();
        while let Some(message) = messages.try_next().await.context("dumping addresses")? {
            // IFA_LOCAL is the interface's own address (IFA_ADDRESS is the peer's
            // on point-to-point links).
            for attribute in &message.attributes {
                if let AddressAttribute::Local(IpAddr::V4(ip)) = attribute
                    && !ip.is_loopback()
                {
                    out.push(*ip);
                }
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }
}

/// The link's name if it is a veth.
fn veth_name(link: &rtnetlink::packet_route::link::LinkMessage) -> Option<String> {
    let mut name = None;
    let mut veth = false;
    for attribute in &link.attributes {
        match attribute {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::LinkInfo(info) => {
                veth |= info
                    .iter()
                    .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
            }
            _ => {}
        }
    }
    name.filter(|_| veth)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads this namespace's network (whatever it is) and checks it against
    /// `ip`'s view: the same IPv4 addresses but loopback's, the same veths.
    #[tokio::test]
    async fn reads_what_ip_shows() {
        let net = Netlink::open().unwrap().read().await.unwrap();
        let ip = |args: &[&str]| -> serde_json::Value {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .unwrap();
            serde_json::from_slice(&out.stdout).unwrap()
        };
        let mut addrs: Vec<Ipv4Addr> = ip(&["-j", "-4", "addr", "show"])
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| a["local"].as_str()?.parse().ok())
            .filter(|a: &Ipv4Addr| !a.is_loopback())
            .collect();
        addrs.sort();
        addrs.dedup();
        assert_eq!(net.addrs, addrs);
        // The veths host routes lead to.
        let targets: std::collections::HashSet<u32> = net.host_routes.values().copied().collect();
        let veths: HashMap<u32, String> = ip(&["-j", "-d", "link", "show", "type", "veth"])
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["ifindex"].as_u64().unwrap() as u32,
                    l["ifname"].as_str().unwrap().to_string(),
                )
            })
            .filter(|(i, _)| targets.contains(i))
            .collect();
        assert_eq!(net.veths, veths);
    }
}
