//! What the DNS server does with one query, from its bytes: answer it from the
//! name table, forward it, refuse it as malformed, or drop it. Pure (no I/O),
//! so that it is unit-tested and fuzzed (`fuzz/fuzz_targets/dns_query.rs`).
//!
//! The wire format is hickory-proto's (RFC 1035 messages, RFC 6891 EDNS(0)).

use std::net::IpAddr;

use hickory_proto::{
    op::{Edns, Header, Message, MessageType, OpCode, Query, ResponseCode},
    rr::{
        DNSClass, RData, Record, RecordType,
        rdata::{A, AAAA},
    },
    serialize::binary::{BinDecodable, BinDecoder},
};

use super::names::NameTable;

/// TTL of the agent's own answers, in seconds: short, so that a Service's new
/// address or a headless Service's new endpoints are asked again soon (ztunnel
/// answers with 30 s too).
pub const LOCAL_TTL: u32 = 30;

/// Largest UDP answer without EDNS(0) (RFC 1035, 4.2.1).
pub const UDP_MIN_PAYLOAD: usize = 512;
/// The UDP payload size the agent's own answers announce and stays within,
/// whatever the client offers: the DNS Flag Day 2020 value, which avoids IP
/// fragmentation on common paths.
pub const UDP_MAX_PAYLOAD: u16 = 1232;
/// Largest DNS message over TCP (RFC 1035, 4.2.2: a two-byte length).
pub const TCP_MAX_MESSAGE: usize = 65535;

/// How the query came.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// UDP: answers are kept within the client's payload size, else truncated
    /// (TC) for it to ask again over TCP.
    Udp,
    /// TCP (RFC 7766): two-byte length-prefixed messages.
    Tcp,
}

impl Transport {
    /// `udp` or `tcp` (the `request_protocol` label).
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// A well-formed query with one question, as read.
#[derive(Clone, Debug)]
pub struct Asked {
    /// The query as decoded.
    pub message: Message,
    /// Its question.
    pub query: Query,
    /// The question's name in lower case, without the final dot.
    pub name: String,
    /// Largest answer the client takes over UDP: its EDNS(0) payload size,
    /// at least 512 bytes.
    pub udp_payload: usize,
}

impl Asked {
    /// The question's type.
    pub fn qtype(&self) -> RecordType {
        self.query.query_type()
    }

    /// The query's ID.
    pub fn id(&self) -> u16 {
        self.message.metadata.id
    }

    /// A response to this query with `rcode` and no records (with an OPT record
    /// when the query had one, RFC 6891 7): SERVFAIL when the upstream failed.
    pub fn error(&self, rcode: ResponseCode) -> Vec<u8> {
        let mut m = self.response();
        m.metadata.response_code = rcode;
        encode(&m)
    }

    /// The response skeleton: ID, opcode, RD and CD copied, RA set, the question.
    fn response(&self) -> Message {
        let mut m = Message::response(self.id(), OpCode::Query);
        let q = &self.message.metadata;
        m.metadata.recursion_desired = q.recursion_desired;
        m.metadata.checking_disabled = q.checking_disabled;
        m.metadata.recursion_available = true;
        m.add_query(self.query.clone());
        if self.message.edns.is_some() {
            let mut edns = Edns::new();
            edns.set_max_payload(UDP_MAX_PAYLOAD);
            m.set_edns(edns);
        }
        m
    }
}

/// What to do with a query.
#[derive(Debug)]
pub enum Decision {
    /// Answer with these bytes: an address of the name table (or a truncated
    /// answer pointing the client to TCP).
    Answer(Vec<u8>),
    /// Not a name of the table, or not an address question: ask the resolver
    /// the pod asked (boxed: the other decisions are a few words).
    Forward(Box<Asked>),
    /// Refuse with these bytes: FORMERR (malformed, or not one question) or
    /// NOTIMP (not a standard query).
    Refuse(Vec<u8>, ResponseCode),
    /// Not answered: shorter than a header, or a response, not a query.
    Drop,
}

/// Decides what to do with `bytes`, a query from a pod of `namespace` (`None`:
/// not known) over `transport`, the agent's names being `names`. Never panics
/// and allocates in proportion to `bytes` only.
pub fn decide(
    bytes: &[u8],
    names: &NameTable,
    namespace: Option<&str>,
    transport: Transport,
) -> Decision {
    let Ok(header) = Header::read(&mut BinDecoder::new(bytes)) else {
        return Decision::Drop;
    };
    if header.message_type != MessageType::Query {
        return Decision::Drop;
    }
    let refuse = |rcode: ResponseCode| {
        let mut m = Message::error_msg(header.id, header.op_code, rcode);
        m.metadata.recursion_desired = header.recursion_desired;
        Decision::Refuse(encode(&m), rcode)
    };
    let Ok(message) = Message::from_vec(bytes) else {
        return refuse(ResponseCode::FormErr);
    };
    if message.metadata.op_code != OpCode::Query {
        return refuse(ResponseCode::NotImp);
    }
    let [query] = message.queries.as_slice() else {
        return refuse(ResponseCode::FormErr);
    };
    let query = query.clone();
    let name = query.name().to_lowercase().to_ascii();
    let name = name.trim_end_matches('.').to_string();
    let udp_payload = message
        .edns
        .as_ref()
        .map_or(UDP_MIN_PAYLOAD, |e| usize::from(e.max_payload()))
        .max(UDP_MIN_PAYLOAD);
    let asked = Box::new(Asked {
        message,
        query,
        name,
        udp_payload,
    });
    let qtype = asked.qtype();
    if asked.query.query_class() != DNSClass::IN
        || !matches!(qtype, RecordType::A | RecordType::AAAA)
    {
        return Decision::Forward(asked);
    }
    let Some(addrs) = names.lookup(&asked.name, namespace) else {
        return Decision::Forward(asked);
    };
    Decision::Answer(answer(&asked, addrs, transport))
}

/// The answer to `asked` (an A or AAAA question) with those of `addrs` of its
/// family (none: NOERROR without records, RFC 2308's NODATA), authoritative,
/// with [`LOCAL_TTL`]; truncated (TC, no records) when it does not fit the
/// client's UDP payload.
fn answer(asked: &Asked, addrs: &[IpAddr], transport: Transport) -> Vec<u8> {
    let mut m = asked.response();
    m.metadata.authoritative = true;
    let owner = asked.query.name().clone();
    for addr in addrs {
        let rdata = match (asked.qtype(), addr) {
            (RecordType::A, IpAddr::V4(v4)) => RData::A(A(*v4)),
            (RecordType::AAAA, IpAddr::V6(v6)) => RData::AAAA(AAAA(*v6)),
            _ => continue,
        };
        m.add_answer(Record::from_rdata(owner.clone(), LOCAL_TTL, rdata));
    }
    fit(&m, asked, transport)
}

/// `m` encoded, or its truncated form (header, question, OPT; TC set) when it
/// is larger than `transport` allows `asked`'s client (RFC 1035 4.2.1, RFC 6891
/// 7, RFC 7766 8).
pub fn fit(m: &Message, asked: &Asked, transport: Transport) -> Vec<u8> {
    let bytes = encode(m);
    let limit = match transport {
        Transport::Udp => asked
            .udp_payload
            .min(usize::from(UDP_MAX_PAYLOAD).max(UDP_MIN_PAYLOAD)),
        Transport::Tcp => TCP_MAX_MESSAGE,
    };
    if bytes.len() <= limit {
        return bytes;
    }
    let mut truncated = m.truncate();
    truncated.metadata.id = m.metadata.id;
    encode(&truncated)
}

/// `m` encoded. A message made of a decoded question and addresses always
/// encodes; should it not, the bytes are empty (and nothing is sent).
fn encode(m: &Message) -> Vec<u8> {
    m.to_vec().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dns::names::DnsHost, k8s::Service};
    use hickory_proto::rr::Name;

    fn names() -> NameTable {
        let web: Service = serde_yaml_ng::from_str(
            "metadata: {name: web, namespace: shop}\nspec: {clusterIPs: [10.96.0.10, 'fd00::10']}",
        )
        .unwrap();
        let many: Vec<IpAddr> = (0..200u8).map(|i| IpAddr::from([10, 1, 0, i])).collect();
        NameTable::build(
            "cluster.local",
            [&web],
            [],
            &[DnsHost {
                name: "many.example.com".into(),
                addrs: many,
            }],
        )
    }

    fn query(name: &str, qtype: RecordType, edns: Option<u16>) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.id = 0x1234;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            m.set_edns(e);
        }
        m.to_vec().unwrap()
    }

    fn decoded(bytes: &[u8]) -> Message {
        Message::from_vec(bytes).unwrap()
    }

    #[test]
    fn a_service_is_answered_in_its_family() {
        for (qtype, want) in [
            (RecordType::A, "10.96.0.10"),
            (RecordType::AAAA, "fd00::10"),
        ] {
            let q = query("Web.Shop.svc.cluster.local.", qtype, None);
            let Decision::Answer(bytes) = decide(&q, &names(), None, Transport::Udp) else {
                panic!("not answered");
            };
            let m = decoded(&bytes);
            assert_eq!(m.metadata.id, 0x1234);
            assert_eq!(m.metadata.message_type, MessageType::Response);
            assert!(m.metadata.authoritative && m.metadata.recursion_desired);
            assert_eq!(m.answers.len(), 1);
            assert_eq!(m.answers[0].ttl, LOCAL_TTL);
            // The owner name is the question's, as asked.
            assert_eq!(m.answers[0].name.to_ascii(), "Web.Shop.svc.cluster.local.");
            let got = match &m.answers[0].data {
                RData::A(a) => a.0.to_string(),
                RData::AAAA(a) => a.0.to_string(),
                other => panic!("{other:?}"),
            };
            assert_eq!(got, want);
            assert!(m.edns.is_none(), "no OPT without one in the query");
        }
    }

    #[test]
    fn the_search_path_and_edns_are_kept() {
        let q = query("web.shop.app.svc.cluster.local.", RecordType::A, Some(4096));
        let Decision::Answer(bytes) = decide(&q, &names(), Some("app"), Transport::Udp) else {
            panic!("not answered");
        };
        let m = decoded(&bytes);
        assert_eq!(m.answers.len(), 1);
        assert_eq!(m.edns.unwrap().max_payload(), UDP_MAX_PAYLOAD);
    }

    #[test]
    fn other_names_and_types_are_forwarded() {
        for (name, qtype) in [
            ("example.com.", RecordType::A),
            ("web.shop.svc.cluster.local.", RecordType::MX),
            ("nope.shop.svc.cluster.local.", RecordType::AAAA),
        ] {
            let q = query(name, qtype, Some(1232));
            let Decision::Forward(asked) = decide(&q, &names(), None, Transport::Udp) else {
                panic!("{name} {qtype} not forwarded");
            };
            assert_eq!(asked.udp_payload, 1232);
            let servfail = decoded(&asked.error(ResponseCode::ServFail));
            assert_eq!(servfail.metadata.response_code, ResponseCode::ServFail);
            assert_eq!(servfail.metadata.id, 0x1234);
            assert_eq!(servfail.queries, asked.message.queries);
            assert!(servfail.edns.is_some());
        }
    }

    /// An answer larger than the client's UDP payload is truncated; over TCP
    /// it is whole.
    #[test]
    fn large_answers_are_truncated_over_udp_only() {
        let q = query("many.example.com.", RecordType::A, None);
        let Decision::Answer(bytes) = decide(&q, &names(), None, Transport::Udp) else {
            panic!("not answered");
        };
        assert!(bytes.len() <= UDP_MIN_PAYLOAD);
        let m = decoded(&bytes);
        assert!(m.metadata.truncation && m.answers.is_empty());
        assert_eq!(m.metadata.id, 0x1234);
        let Decision::Answer(bytes) = decide(&q, &names(), None, Transport::Tcp) else {
            panic!("not answered");
        };
        let m = decoded(&bytes);
        assert!(!m.metadata.truncation);
        assert_eq!(m.answers.len(), 200);
    }

    #[test]
    fn malformed_queries_are_refused_or_dropped() {
        let names = names();
        // Shorter than a header: dropped.
        assert!(matches!(
            decide(&[1, 2, 3], &names, None, Transport::Udp),
            Decision::Drop
        ));
        // A response: dropped.
        let mut response = query("a.b.", RecordType::A, None);
        response[2] |= 0x80;
        assert!(matches!(
            decide(&response, &names, None, Transport::Udp),
            Decision::Drop
        ));
        // A question cut short: FORMERR, with the ID.
        let q = query("web.shop.svc.cluster.local.", RecordType::A, None);
        let Decision::Refuse(bytes, ResponseCode::FormErr) =
            decide(&q[..q.len() - 3], &names, None, Transport::Udp)
        else {
            panic!("not FORMERR");
        };
        assert_eq!(decoded(&bytes).metadata.id, 0x1234);
        // No question: FORMERR.
        let mut none = Message::query();
        none.metadata.id = 7;
        let none = none.to_vec().unwrap();
        assert!(matches!(
            decide(&none, &names, None, Transport::Udp),
            Decision::Refuse(_, ResponseCode::FormErr)
        ));
        // Not a standard query: NOTIMP.
        let mut status = Message::query();
        status.metadata.op_code = OpCode::Status;
        let status = status.to_vec().unwrap();
        assert!(matches!(
            decide(&status, &names, None, Transport::Udp),
            Decision::Refuse(_, ResponseCode::NotImp)
        ));
    }
}
