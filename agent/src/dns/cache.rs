//! The bounded cache of forwarded answers.
//!
//! Keyed by the resolver asked and the question (name in lower case, type,
//! class) and what changes the answer's shape (EDNS(0) present, DO and CD
//! bits); kept for the answer's smallest TTL (of its answer records, or of the
//! SOA of a negative answer, RFC 2308 5), at most [`MAX_TTL`]. Truncated
//! answers and answers other than NOERROR and NXDOMAIN are not kept. At most
//! [`CAPACITY`] answers: a full cache first drops the expired ones, then the
//! oldest.

use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Message, ResponseCode},
    rr::{DNSClass, RData, RecordType},
};

use super::message::Asked;

/// Most answers kept.
pub const CAPACITY: usize = 4096;
/// Longest an answer is kept, whatever its TTL, in seconds.
pub const MAX_TTL: u32 = 300;

/// What an answer is kept under.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    upstream: SocketAddr,
    name: String,
    qtype: RecordType,
    class: DNSClass,
    edns: bool,
    dnssec_ok: bool,
    checking_disabled: bool,
}

impl Key {
    /// The key of `asked`, sent to `upstream`.
    pub fn of(asked: &Asked, upstream: SocketAddr) -> Self {
        Key {
            upstream,
            name: asked.name.clone(),
            qtype: asked.qtype(),
            class: asked.query.query_class(),
            edns: asked.message.edns.is_some(),
            dnssec_ok: asked
                .message
                .edns
                .as_ref()
                .is_some_and(|e| e.flags().dnssec_ok),
            checking_disabled: asked.message.metadata.checking_disabled,
        }
    }
}

struct Entry {
    message: Message,
    stored: Instant,
    ttl: u32,
}

/// The cache.
#[derive(Default)]
pub struct Cache {
    entries: HashMap<Key, Entry>,
    /// Keys in the order they were stored (a key stored again appears twice;
    /// the stale mention is skipped when evicting).
    order: VecDeque<(Key, Instant)>,
}

impl Cache {
    /// The answer kept under `key`, with `id` and its TTLs less the time it was
    /// kept, if it has not expired at `now`.
    pub fn get(&mut self, key: &Key, id: u16, now: Instant) -> Option<Message> {
        let entry = self.entries.get(key)?;
        let age = now.saturating_duration_since(entry.stored).as_secs();
        let age = u32::try_from(age).unwrap_or(u32::MAX);
        if age >= entry.ttl {
            self.entries.remove(key);
            return None;
        }
        let mut m = entry.message.clone();
        m.metadata.id = id;
        for record in m
            .answers
            .iter_mut()
            .chain(m.authorities.iter_mut())
            .chain(m.additionals.iter_mut())
        {
            record.ttl = record.ttl.saturating_sub(age);
        }
        Some(m)
    }

    /// Keeps `message` under `key` at `now`, if it may be kept.
    pub fn put(&mut self, key: Key, message: Message, now: Instant) {
        let Some(ttl) = ttl_of(&message) else { return };
        if self.entries.len() >= CAPACITY && !self.entries.contains_key(&key) {
            self.evict(now);
        }
        self.order.push_back((key.clone(), now));
        // The order list stays bounded too: stale mentions go with the oldest.
        while self.order.len() > 2 * CAPACITY {
            self.evict_oldest();
        }
        self.entries.insert(
            key,
            Entry {
                message,
                stored: now,
                ttl,
            },
        );
    }

    /// How many answers are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn evict(&mut self, now: Instant) {
        self.entries.retain(|_, e| {
            now.saturating_duration_since(e.stored) < Duration::from_secs(u64::from(e.ttl))
        });
        while self.entries.len() >= CAPACITY && !self.order.is_empty() {
            self.evict_oldest();
        }
    }

    fn evict_oldest(&mut self) {
        if let Some((key, stored)) = self.order.pop_front()
            && self.entries.get(&key).is_some_and(|e| e.stored == stored)
        {
            self.entries.remove(&key);
        }
    }
}

/// How long `m` may be kept, in seconds; `None`: not at all.
fn ttl_of(m: &Message) -> Option<u32> {
    if m.metadata.truncation
        || !matches!(
            m.metadata.response_code,
            ResponseCode::NoError | ResponseCode::NXDomain
        )
    {
        return None;
    }
    let ttl = if m.answers.is_empty() {
        // Negative: the SOA's TTL, bounded by its MINIMUM (RFC 2308 5).
        m.authorities.iter().find_map(|r| match &r.data {
            RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
            _ => None,
        })?
    } else {
        m.answers.iter().map(|r| r.ttl).min()?
    };
    (ttl > 0).then_some(ttl.min(MAX_TTL))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dns::{
        message::{Decision, Transport, decide},
        names::NameTable,
    };
    use hickory_proto::{
        op::Query,
        rr::{Name, Record, rdata::A},
    };

    fn asked(name: &str) -> Asked {
        let mut m = Message::query();
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        let Decision::Forward(asked) = decide(
            &m.to_vec().unwrap(),
            &NameTable::default(),
            None,
            Transport::Udp,
        ) else {
            panic!()
        };
        *asked
    }

    fn answer(name: &str, ttl: u32) -> Message {
        let mut m = Message::response(1, hickory_proto::op::OpCode::Query);
        m.add_answer(Record::from_rdata(
            Name::from_ascii(name).unwrap(),
            ttl,
            RData::A(A::new(192, 0, 2, 1)),
        ));
        m
    }

    const UPSTREAM: &str = "10.96.0.10:53";

    #[test]
    fn answers_are_kept_for_their_ttl_with_the_ttl_counted_down() {
        let mut cache = Cache::default();
        let key = Key::of(&asked("Example.com."), UPSTREAM.parse().unwrap());
        let t0 = Instant::now();
        cache.put(key.clone(), answer("example.com.", 60), t0);
        // The same question in another case is the same key.
        let again = Key::of(&asked("example.COM."), UPSTREAM.parse().unwrap());
        let hit = cache.get(&again, 77, t0 + Duration::from_secs(20)).unwrap();
        assert_eq!(hit.metadata.id, 77);
        assert_eq!(hit.answers[0].ttl, 40);
        assert!(cache.get(&key, 1, t0 + Duration::from_secs(60)).is_none());
        assert!(cache.is_empty());
        // Another resolver is another key.
        cache.put(key.clone(), answer("example.com.", 60), t0);
        let other = Key::of(&asked("example.com."), "10.0.0.1:53".parse().unwrap());
        assert!(cache.get(&other, 1, t0).is_none());
    }

    #[test]
    fn what_is_not_kept() {
        let mut cache = Cache::default();
        let key = Key::of(&asked("example.com."), UPSTREAM.parse().unwrap());
        let now = Instant::now();
        let mut truncated = answer("example.com.", 60);
        truncated.metadata.truncation = true;
        let mut servfail = answer("example.com.", 60);
        servfail.metadata.response_code = ResponseCode::ServFail;
        for m in [truncated, servfail, answer("example.com.", 0)] {
            cache.put(key.clone(), m, now);
        }
        assert!(cache.is_empty());
    }

    #[test]
    fn the_cache_is_bounded() {
        let mut cache = Cache::default();
        let now = Instant::now();
        for i in 0..CAPACITY + 100 {
            let name = format!("n{i}.example.com.");
            let key = Key::of(&asked(&name), UPSTREAM.parse().unwrap());
            cache.put(key, answer(&name, 300), now);
        }
        assert!(cache.len() <= CAPACITY);
        assert!(cache.order.len() <= 2 * CAPACITY);
        // The newest is there.
        let last = format!("n{}.example.com.", CAPACITY + 99);
        let key = Key::of(&asked(&last), UPSTREAM.parse().unwrap());
        assert!(cache.get(&key, 1, now).is_some());
    }
}
