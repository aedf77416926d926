//! A datagram or TCP message as the DNS server reads it (`dns::message::decide`)
//! over both transports, against a name table with a Service, a headless
//! Service and a host: it never panics, answers only what parsed as a query,
//! and keeps a UDP answer within 1232 bytes.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use podlink_agent::dns::{
    message::{Decision, Transport, UDP_MAX_PAYLOAD, decide},
    names::{DnsHost, NameTable},
};

static NAMES: LazyLock<NameTable> = LazyLock::new(|| {
    let hosts: Vec<DnsHost> = vec![
        DnsHost {
            name: "web.shop.svc.cluster.local".into(),
            addrs: vec!["10.96.0.10".parse().unwrap(), "fd00::10".parse().unwrap()],
        },
        DnsHost {
            name: "many.example.com".into(),
            addrs: (0..=255u8).map(|i| [10, 1, 0, i].into()).collect(),
        },
    ];
    NameTable::build("cluster.local", [], [], &hosts)
});

fuzz_target!(|data: &[u8]| {
    for transport in [Transport::Udp, Transport::Tcp] {
        match decide(data, &NAMES, Some("app"), transport) {
            Decision::Answer(bytes) => {
                assert!(data.len() >= 12);
                if transport == Transport::Udp {
                    assert!(
                        bytes.len() <= usize::from(UDP_MAX_PAYLOAD),
                        "{}",
                        bytes.len()
                    );
                }
            }
            Decision::Refuse(bytes, _) => assert!(bytes.len() >= 12 || bytes.is_empty()),
            Decision::Forward(asked) => {
                let _ = asked.error(hickory_proto::op::ResponseCode::ServFail);
            }
            Decision::Drop => {}
        }
    }
});
