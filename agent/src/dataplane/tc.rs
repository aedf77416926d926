//! podlink's `cls_bpf` filters: the programs attached to host veths as classic
//! traffic-control filters on a `clsact` qdisc (the attach mode `cls-bpf`, and
//! `auto` on kernels without TCX, below 6.6), over route netlink
//! (`RTM_{NEW,DEL,GET}TFILTER`, `RTM_{NEW,DEL,GET}QDISC`; rtnetlink(7), tc(8)).
//!
//! Each program is one filter, found by where it is and what it is named, so that
//! a new agent finds those of the previous one without any pin:
//! * on the host veth's `clsact` qdisc, at `ingress` (parent `ffff:fff2`) for
//!   `from_pod`, at `egress` (parent `ffff:fff3`) for `to_pod`;
//! * at priority [`FILTER_PRIORITY`] with handle [`FILTER_HANDLE`], chain 0,
//!   protocol `all`;
//! * of kind `bpf`, in direct-action mode, named after its program (`tc filter
//!   show` prints the name: `… pref 1 bpf chain 0 handle 0x53b from_pod
//!   direct-action …`).
//!
//! A filter is not tied to a process: it stays attached when the agent exits,
//! running its program on the pinned maps, until it is deleted (or its interface
//! is). A new agent replaces the program of each filter in place
//! ([`Tc::attach`] with [`How::Replace`]: `RTM_NEWTFILTER` with neither
//! `NLM_F_CREATE` nor `NLM_F_EXCL`), which `cls_bpf_change()`
//! (`net/sched/cls_bpf.c`) does with `list_replace_rcu()`: every packet sees the
//! old program or the new one, never none.
//!
//! Other filters on the same qdisc run after podlink's (a higher priority number)
//! on the packets its programs pass: they return `TC_ACT_UNSPEC` (-1) for that,
//! which `cls_bpf_classify()` takes as "no verdict" (`cls_bpf_exec_opcode()`),
//! and `__tcf_classify()` (`net/sched/cls_api.c`) then goes on to the next
//! filter; with none left the packet goes on its way. A filter before podlink's
//! (priority 0 is not allowed; none can be lower than 1) cannot exist.

use std::{
    collections::BTreeSet,
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

use rtnetlink::{
    packet_core::{
        NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_EXCL, NLM_F_REQUEST,
        NetlinkMessage, NetlinkPayload,
    },
    packet_route::{
        RouteNetlinkMessage,
        tc::{
            TcAttribute, TcBpfFlags, TcFilterBpf, TcFilterBpfOption, TcHandle, TcMessage,
            TcMessageBuffer, TcOption,
        },
    },
    sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE},
};
use serde::Serialize;

use super::Program;

/// The priority (`tc … pref`) of podlink's filters: 1, the first, so that capture
/// decides before any other filter on the host veth (packets it passes go on to
/// the others).
pub const FILTER_PRIORITY: u16 = 1;
/// The handle of podlink's filters: `0x53b` (1339, the number of podlink's
/// routing table and rule, [`podlink_common::ROUTE_TABLE`]). With
/// [`FILTER_PRIORITY`] and the program's name it tells podlink's filters from
/// others.
pub const FILTER_HANDLE: u32 = 0x53b;
/// `ETH_P_ALL` (`linux/if_ether.h`): the filters see every protocol.
const ETH_P_ALL: u16 = 0x0003;
/// The kind of the `clsact` qdisc (`net/sched/sch_ingress.c`).
const CLSACT: &str = "clsact";
/// The `clsact` qdisc's handle, `ffff:0`.
const CLSACT_HANDLE: TcHandle = TcHandle {
    major: 0xffff,
    minor: 0,
};
/// Dumps interrupted by a concurrent change (`NLM_F_DUMP_INTR`) are read again
/// this many times before the inconsistency is an error.
const DUMP_TRIES: usize = 3;

/// The `clsact` parent a program's filter hangs from: `ingress` for `from_pod`,
/// `egress` for `to_pod` (as the TCX attach types, [`Program::attach_type`]).
pub fn parent(program: Program) -> TcHandle {
    TcHandle {
        major: 0xffff,
        minor: match program {
            Program::FromPod => TcHandle::MIN_INGRESS,
            Program::ToPod => TcHandle::MIN_EGRESS,
        },
    }
}

/// `tcm_info` of a filter: its priority in the upper 16 bits, its protocol (in
/// network byte order) in the lower ones (`TC_H_MAKE(prio << 16, protocol)` in
/// tc(8)'s source).
fn filter_info(priority: u16, protocol: u16) -> u32 {
    (u32::from(priority) << 16) | u32::from(protocol.to_be())
}

/// One of podlink's filters as a dump shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Filter {
    /// The interface's index.
    pub ifindex: u32,
    /// The program it is named after (and hangs where that program goes).
    pub program: Program,
    /// The id of the program it runs (`TCA_BPF_ID`, as `bpftool prog` lists it);
    /// `null` if the kernel did not say.
    pub program_id: Option<u32>,
    /// Whether it is in direct-action mode (podlink's always are).
    pub direct_action: bool,
}

/// The filter `message` describes if it is one of podlink's: kind `bpf` at
/// [`FILTER_PRIORITY`] with [`FILTER_HANDLE`], protocol `all`, in chain 0, at a
/// `clsact` parent, named after the program that goes there. Anything else —
/// another tool's filter, even one at the same priority and handle, or one named
/// `to_pod` at ingress — is not podlink's and is left alone.
pub fn podlinks(message: &TcMessage) -> Option<Filter> {
    let header = &message.header;
    let program = Program::ALL
        .into_iter()
        .find(|p| parent(*p) == header.parent)?;
    if header.info != filter_info(FILTER_PRIORITY, ETH_P_ALL)
        || u32::from(header.handle) != FILTER_HANDLE
    {
        return None;
    }
    let mut kind = None;
    let mut chain = 0;
    let mut name = None;
    let mut program_id = None;
    let mut direct_action = false;
    for attribute in &message.attributes {
        match attribute {
            TcAttribute::Kind(k) => kind = Some(k.as_str()),
            TcAttribute::Chain(c) => chain = *c,
            TcAttribute::Options(options) => {
                for option in options {
                    match option {
                        TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = Some(n.as_str()),
                        TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => program_id = Some(*id),
                        TcOption::Bpf(TcFilterBpfOption::Flags(flags)) => {
                            direct_action = flags.contains(TcBpfFlags::DirectAction);
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (kind == Some(TcFilterBpf::KIND) && chain == 0 && name == Some(program.name())).then_some(
        Filter {
            ifindex: u32::try_from(header.index).ok()?,
            program,
            program_id,
            direct_action,
        },
    )
}

/// Whether a qdisc dump's `message` is a `clsact` qdisc.
fn is_clsact(message: &TcMessage) -> bool {
    message.header.parent == TcHandle::CLSACT
        && message.header.handle == CLSACT_HANDLE
        && message
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(k) if k == CLSACT))
}

/// How [`Tc::attach`] attaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// A new filter: fails with `EEXIST` if one is at podlink's priority and
    /// handle already (`NLM_F_CREATE | NLM_F_EXCL`).
    Create,
    /// The program of the filter that is there, replaced in place: fails with
    /// `ENOENT` if there is none (no `NLM_F_CREATE`), with `EINVAL` if the filter
    /// at podlink's priority is not a `bpf` one.
    Replace,
}

/// A route netlink socket for podlink's filters and `clsact` qdiscs, used one
/// request at a time, blocking (the dataplane's calls are synchronous). Every
/// request names the interface by index, so a renamed interface is still the
/// same one.
pub struct Tc {
    socket: Socket,
    sequence: u32,
}

impl Tc {
    /// Opens a socket in the current network namespace.
    ///
    /// # Errors
    /// When the socket cannot be opened or bound.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
        })
    }

    /// Sends `message` with `flags` (besides `NLM_F_REQUEST`) and reads the
    /// answer: the tc messages of a dump (`NLM_F_DUMP`), else none once the
    /// kernel acknowledged (`NLM_F_ACK` is added).
    ///
    /// # Errors
    /// The kernel's error (`EEXIST`, `ENOENT`, …); an interrupted dump (after
    /// [`DUMP_TRIES`]); an answer that cannot be read. A message of a dump that
    /// the library cannot decode is skipped, unless its header says it is at
    /// podlink's priority and handle (then it is an error).
    fn request(&mut self, message: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<TcMessage>> {
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut tries = 0;
        loop {
            tries += 1;
            let (answer, interrupted) = self.exchange(message.clone(), flags, dump)?;
            if !interrupted {
                return Ok(answer);
            }
            if tries >= DUMP_TRIES {
                return Err(io::Error::other(format!(
                    "the dump was interrupted by concurrent changes {DUMP_TRIES} times"
                )));
            }
        }
    }

    /// One request and its answer; also whether a dump was interrupted.
    fn exchange(
        &mut self,
        message: RouteNetlinkMessage,
        flags: u16,
        dump: bool,
    ) -> io::Result<(Vec<TcMessage>, bool)> {
        self.sequence = self.sequence.wrapping_add(1);
        let sequence = self.sequence;
        let mut request = NetlinkMessage::from(message);
        request.header.flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
        request.header.sequence_number = sequence;
        request.finalize();
        let mut buf = vec![0; request.buffer_len()];
        request.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let mut out = Vec::new();
        let mut interrupted = false;
        loop {
            let (datagram, _) = self.socket.recv_from_full()?;
            let mut offset = 0;
            while offset + 16 <= datagram.len() {
                let length =
                    u32::from_ne_bytes(datagram[offset..offset + 4].try_into().unwrap()) as usize;
                if length < 16 || offset + length > datagram.len() {
                    return Err(io::Error::other("a malformed netlink message"));
                }
                let bytes = &datagram[offset..offset + length];
                offset += length.next_multiple_of(4);
                let message = match NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes) {
                    Ok(message) => message,
                    Err(e) => {
                        if dump && !at_podlinks_place(&bytes[16..]) {
                            continue;
                        }
                        return Err(io::Error::other(format!(
                            "an answer that cannot be read: {e}"
                        )));
                    }
                };
                if message.header.sequence_number != sequence {
                    continue;
                }
                interrupted |= message.header.flags & NLM_F_DUMP_INTR != 0;
                match message.payload {
                    NetlinkPayload::Done(_) => return Ok((out, interrupted)),
                    NetlinkPayload::Error(e) => match e.code {
                        None => return Ok((out, interrupted)),
                        Some(code) => return Err(io::Error::from_raw_os_error(-code.get())),
                    },
                    NetlinkPayload::InnerMessage(
                        RouteNetlinkMessage::NewTrafficFilter(m)
                        | RouteNetlinkMessage::NewQueueDiscipline(m),
                    ) => out.push(m),
                    _ => {}
                }
            }
        }
    }

    /// The interfaces that have a `clsact` qdisc (a dump of every qdisc).
    ///
    /// # Errors
    /// A failed dump.
    pub fn clsact_interfaces(&mut self) -> io::Result<BTreeSet<u32>> {
        let qdiscs = self.request(
            RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(qdiscs
            .iter()
            .filter(|q| is_clsact(q))
            .filter_map(|q| u32::try_from(q.header.index).ok())
            .collect())
    }

    /// Every filter at `program`'s parent of interface `ifindex` (none without a
    /// `clsact` qdisc), podlink's or not.
    ///
    /// # Errors
    /// A failed dump.
    pub fn filters(&mut self, ifindex: u32, program: Program) -> io::Result<Vec<TcMessage>> {
        let mut message = TcMessage::with_index(index(ifindex)?);
        message.header.parent = parent(program);
        self.request(RouteNetlinkMessage::GetTrafficFilter(message), NLM_F_DUMP)
    }

    /// podlink's filters on interface `ifindex` ([`podlinks`]).
    ///
    /// # Errors
    /// A failed dump.
    pub fn podlink_filters_on(&mut self, ifindex: u32) -> io::Result<Vec<Filter>> {
        let mut found = Vec::new();
        for program in Program::ALL {
            found.extend(self.filters(ifindex, program)?.iter().filter_map(podlinks));
        }
        Ok(found)
    }

    /// podlink's filters on every interface of the network namespace: those of
    /// each interface with a `clsact` qdisc. An interface deleted meanwhile has
    /// none.
    ///
    /// # Errors
    /// A failed dump.
    pub fn podlink_filters(&mut self) -> io::Result<Vec<Filter>> {
        let mut found = Vec::new();
        for ifindex in self.clsact_interfaces()? {
            match self.podlink_filters_on(ifindex) {
                Ok(filters) => found.extend(filters),
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(found)
    }

    /// Adds a `clsact` qdisc to interface `ifindex`. Returns false when it has one
    /// already (or another qdisc in its place, such as `ingress`: attaching then
    /// fails).
    ///
    /// # Errors
    /// The kernel's refusal (`ENODEV` when the interface is gone).
    pub fn add_clsact(&mut self, ifindex: u32) -> io::Result<bool> {
        match self.request(
            RouteNetlinkMessage::NewQueueDiscipline(clsact(ifindex)?),
            NLM_F_CREATE | NLM_F_EXCL,
        ) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Deletes the `clsact` qdisc of interface `ifindex`, with every filter on it.
    /// Returns false when there was none.
    ///
    /// # Errors
    /// The kernel's refusal.
    pub fn remove_clsact(&mut self, ifindex: u32) -> io::Result<bool> {
        match self.request(RouteNetlinkMessage::DelQueueDiscipline(clsact(ifindex)?), 0) {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Attaches `program` (its descriptor `fd`) to interface `ifindex` as
    /// podlink's filter, `how` says whether as a new one or in place of the one
    /// there.
    ///
    /// # Errors
    /// The kernel's refusal: see [`How`]; `ENOENT` too without a `clsact` qdisc,
    /// `EINVAL` when another kind of filter has podlink's priority.
    pub fn attach(
        &mut self,
        ifindex: u32,
        program: Program,
        fd: BorrowedFd<'_>,
        how: How,
    ) -> io::Result<()> {
        let mut message = filter(ifindex, program)?;
        let fd = u32::try_from(fd.as_raw_fd()).map_err(io::Error::other)?;
        message.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ProgFd(fd)),
            TcOption::Bpf(TcFilterBpfOption::ProgName(program.name().to_string())),
            TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
        ]));
        let flags = match how {
            How::Create => NLM_F_CREATE | NLM_F_EXCL,
            How::Replace => 0,
        };
        self.request(RouteNetlinkMessage::NewTrafficFilter(message), flags)
            .map(drop)
    }

    /// Deletes podlink's filter for `program` from interface `ifindex`. Returns
    /// false when there was none (nor a `clsact` qdisc, nor the interface).
    ///
    /// # Errors
    /// The kernel's refusal (`EINVAL` when another kind of filter has podlink's
    /// priority).
    pub fn detach(&mut self, ifindex: u32, program: Program) -> io::Result<bool> {
        match self.request(
            RouteNetlinkMessage::DelTrafficFilter(filter(ifindex, program)?),
            0,
        ) {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENODEV)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// An interface index as tc messages hold it.
fn index(ifindex: u32) -> io::Result<i32> {
    i32::try_from(ifindex).map_err(io::Error::other)
}

/// The `clsact` qdisc of interface `ifindex`, to add or delete.
fn clsact(ifindex: u32) -> io::Result<TcMessage> {
    let mut message = TcMessage::with_index(index(ifindex)?);
    message.header.parent = TcHandle::CLSACT;
    message.header.handle = CLSACT_HANDLE;
    message
        .attributes
        .push(TcAttribute::Kind(CLSACT.to_string()));
    Ok(message)
}

/// podlink's filter for `program` on interface `ifindex`, without options: the
/// kind `bpf` is given so that the kernel refuses to touch a filter of another
/// kind (and deleting it never takes more than the one filter: priority,
/// protocol and handle are all set).
fn filter(ifindex: u32, program: Program) -> io::Result<TcMessage> {
    let mut message = TcMessage::with_index(index(ifindex)?);
    message.header.parent = parent(program);
    message.header.handle = FILTER_HANDLE.into();
    message.header.info = filter_info(FILTER_PRIORITY, ETH_P_ALL);
    message
        .attributes
        .push(TcAttribute::Kind(TcFilterBpf::KIND.to_string()));
    Ok(message)
}

/// Whether the tc message `payload` (a `struct tcmsg` and attributes) is at
/// podlink's priority and handle, read from its header alone.
fn at_podlinks_place(payload: &[u8]) -> bool {
    let Ok(buffer) = TcMessageBuffer::new_checked(payload) else {
        return true;
    };
    buffer.info() >> 16 == u32::from(FILTER_PRIORITY) && buffer.handle() == FILTER_HANDLE
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    use crate::dataplane::testing::{in_new_network_namespace, ip};

    /// Runs `tc ARGS` (split at spaces), asserts it succeeded, returns its
    /// standard output.
    fn tc(args: &str) -> String {
        tc_argv(&args.split_whitespace().collect::<Vec<_>>())
    }

    /// Runs `tc` with `args` as they are (for arguments holding spaces, as a
    /// classic BPF `bytecode`), asserts it succeeded, returns its standard
    /// output.
    fn tc_argv(args: &[&str]) -> String {
        let out = std::process::Command::new("tc")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "tc {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// The embedded object's programs, loaded (maps of their own).
    fn load() -> aya::Ebpf {
        let object = crate::dataplane::ebpf_object();
        assert!(
            !object.is_empty(),
            "built without the eBPF object: run `cargo xtask test`"
        );
        let mut ebpf = aya::Ebpf::load(object).unwrap();
        for program in Program::ALL {
            let p: &mut aya::programs::SchedClassifier = ebpf
                .program_mut(program.name())
                .unwrap()
                .try_into()
                .unwrap();
            p.load().unwrap();
        }
        ebpf
    }

    fn classifier(ebpf: &aya::Ebpf, program: Program) -> &aya::programs::SchedClassifier {
        ebpf.program(program.name()).unwrap().try_into().unwrap()
    }

    /// Filters made, found, replaced in place and deleted through route netlink
    /// are what `tc` shows, and others' filters and qdiscs are left alone. Needs
    /// root (`unshare(CLONE_NEWNET)`), `ip`, `tc` and the embedded object.
    #[test]
    #[ignore = "needs root"]
    fn filters_are_made_found_replaced_and_deleted_as_tc_shows() {
        in_new_network_namespace(|| async move {
            ip("link add pl0 type veth peer name pl1");
            let ifindex = nix::net::if_::if_nametoindex("pl0").unwrap();
            let peer = nix::net::if_::if_nametoindex("pl1").unwrap();
            let mut t = Tc::open().unwrap();
            assert!(t.clsact_interfaces().unwrap().is_empty());
            assert!(t.add_clsact(ifindex).unwrap());
            assert!(!t.add_clsact(ifindex).unwrap(), "there already");
            // An `ingress` qdisc is not a clsact one.
            tc("qdisc add dev pl1 ingress");
            assert_eq!(t.clsact_interfaces().unwrap(), BTreeSet::from([ifindex]));
            assert!(!t.add_clsact(peer).unwrap());

            let first = load();
            let second = load();
            let id = |ebpf: &aya::Ebpf, p| classifier(ebpf, p).info().unwrap().id();
            for program in Program::ALL {
                let fd = classifier(&first, program).fd().unwrap();
                t.attach(ifindex, program, fd.as_fd(), How::Create).unwrap();
                let again = t
                    .attach(ifindex, program, fd.as_fd(), How::Create)
                    .unwrap_err();
                assert_eq!(again.raw_os_error(), Some(libc::EEXIST), "{again}");
            }
            let ingress = tc("filter show dev pl0 ingress");
            assert!(
                ingress.contains("pref 1 bpf chain 0 handle 0x53b from_pod direct-action"),
                "{ingress}"
            );
            let egress = tc("filter show dev pl0 egress");
            assert!(
                egress.contains("pref 1 bpf chain 0 handle 0x53b to_pod direct-action"),
                "{egress}"
            );
            let found = t.podlink_filters().unwrap();
            assert_eq!(
                found
                    .iter()
                    .map(|f| (f.ifindex, f.program, f.program_id, f.direct_action))
                    .collect::<Vec<_>>(),
                [
                    (
                        ifindex,
                        Program::FromPod,
                        Some(id(&first, Program::FromPod)),
                        true
                    ),
                    (
                        ifindex,
                        Program::ToPod,
                        Some(id(&first, Program::ToPod)),
                        true
                    ),
                ]
            );

            // Someone else's filters: a later priority, and podlink's handle at
            // another priority.
            // Classic BPF `ret 0` (tc-bpf(8): instruction count, then each
            // instruction's code, jt, jf and k separated by spaces).
            let drop_all = "1,6 0 0 0";
            tc_argv(&[
                "filter", "add", "dev", "pl0", "ingress", "pref", "2", "bpf", "bytecode", drop_all,
            ]);
            tc_argv(&[
                "filter", "add", "dev", "pl0", "egress", "pref", "3", "handle", "0x53b", "bpf",
                "bytecode", drop_all,
            ]);
            // Replaced in place: the same filters run the second object's programs.
            for program in Program::ALL {
                let fd = classifier(&second, program).fd().unwrap();
                t.attach(ifindex, program, fd.as_fd(), How::Replace)
                    .unwrap();
            }
            let found = t.podlink_filters_on(ifindex).unwrap();
            assert_eq!(
                found.iter().map(|f| f.program_id).collect::<Vec<_>>(),
                [
                    Some(id(&second, Program::FromPod)),
                    Some(id(&second, Program::ToPod))
                ]
            );
            assert_eq!(t.filters(ifindex, Program::FromPod).unwrap().len(), 4);
            // The programs stay attached without the objects that loaded them.
            drop((first, second));
            assert_eq!(t.podlink_filters().unwrap().len(), 2);

            // Deleted: podlink's only.
            assert!(t.detach(ifindex, Program::FromPod).unwrap());
            assert!(!t.detach(ifindex, Program::FromPod).unwrap());
            assert!(t.detach(ifindex, Program::ToPod).unwrap());
            assert!(t.podlink_filters().unwrap().is_empty());
            let ingress = tc("filter show dev pl0 ingress");
            assert!(
                !ingress.contains("pref 1") && ingress.contains("pref 2"),
                "{ingress}"
            );
            assert!(tc("filter show dev pl0 egress").contains("pref 3"));
            // Nothing to replace: not made.
            let third = load();
            let fd = classifier(&third, Program::FromPod).fd().unwrap();
            let missing = t
                .attach(ifindex, Program::FromPod, fd.as_fd(), How::Replace)
                .unwrap_err();
            assert_eq!(missing.raw_os_error(), Some(libc::ENOENT), "{missing}");

            // The qdisc goes with what is on it; the `ingress` one stays.
            assert!(t.remove_clsact(ifindex).unwrap());
            assert!(!t.remove_clsact(ifindex).unwrap());
            assert!(!tc("qdisc show dev pl0").contains("clsact"));
            assert!(tc("qdisc show dev pl1").contains("ingress"));
            assert!(t.clsact_interfaces().unwrap().is_empty());
            assert!(t.podlink_filters_on(99).unwrap().is_empty());
        });
    }

    /// A filter message as a dump gives it.
    fn dumped(
        ifindex: u32,
        program: Program,
        priority: u16,
        handle: u32,
        kind: &str,
        name: &str,
    ) -> TcMessage {
        let mut message = TcMessage::with_index(ifindex as i32);
        message.header.parent = parent(program);
        message.header.handle = handle.into();
        message.header.info = filter_info(priority, ETH_P_ALL);
        message.attributes.push(TcAttribute::Kind(kind.into()));
        message.attributes.push(TcAttribute::Chain(0));
        message.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ProgName(name.into())),
            TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
            TcOption::Bpf(TcFilterBpfOption::ProgId(42)),
        ]));
        message
    }

    #[test]
    fn podlinks_filters_are_told_by_place_kind_and_name() {
        let ours = dumped(7, Program::FromPod, 1, FILTER_HANDLE, "bpf", "from_pod");
        assert_eq!(
            podlinks(&ours),
            Some(Filter {
                ifindex: 7,
                program: Program::FromPod,
                program_id: Some(42),
                direct_action: true,
            })
        );
        let egress = dumped(7, Program::ToPod, 1, FILTER_HANDLE, "bpf", "to_pod");
        assert_eq!(podlinks(&egress).map(|f| f.program), Some(Program::ToPod));
        // Another priority or handle, another kind, another name, the other
        // program's name at this parent: not podlink's.
        for other in [
            dumped(7, Program::FromPod, 2, FILTER_HANDLE, "bpf", "from_pod"),
            dumped(7, Program::FromPod, 1, 1, "bpf", "from_pod"),
            dumped(7, Program::FromPod, 1, FILTER_HANDLE, "u32", "from_pod"),
            dumped(7, Program::FromPod, 1, FILTER_HANDLE, "bpf", "cilium"),
            dumped(7, Program::FromPod, 1, FILTER_HANDLE, "bpf", "to_pod"),
            dumped(7, Program::ToPod, 1, FILTER_HANDLE, "bpf", "from_pod"),
        ] {
            assert_eq!(podlinks(&other), None, "{other:?}");
        }
        // The priority's head a dump gives first (no handle, no options).
        let mut head = TcMessage::with_index(7);
        head.header.parent = parent(Program::FromPod);
        head.header.info = filter_info(1, ETH_P_ALL);
        head.attributes.push(TcAttribute::Kind("bpf".into()));
        assert_eq!(podlinks(&head), None);
        // Another chain, another protocol, another parent (a root qdisc's).
        let mut chained = ours.clone();
        chained.attributes[1] = TcAttribute::Chain(3);
        assert_eq!(podlinks(&chained), None);
        let mut ipv4_only = ours.clone();
        ipv4_only.header.info = filter_info(1, 0x0800);
        assert_eq!(podlinks(&ipv4_only), None);
        let mut rooted = ours;
        rooted.header.parent = TcHandle::ROOT;
        assert_eq!(podlinks(&rooted), None);
    }

    #[test]
    fn filters_are_at_clsact_parents_with_protocol_all() {
        assert_eq!(u32::from(parent(Program::FromPod)), 0xffff_fff2);
        assert_eq!(u32::from(parent(Program::ToPod)), 0xffff_fff3);
        // `tc filter add … pref 1 protocol all`: 0x0001_0300 on a little-endian
        // machine, as tc(8) sends it.
        assert_eq!(
            filter_info(1, ETH_P_ALL),
            (1 << 16) | u32::from(ETH_P_ALL.to_be())
        );
        let message = filter(7, Program::ToPod).unwrap();
        assert_eq!(u32::from(message.header.handle), FILTER_HANDLE);
        assert_eq!(message.attributes, [TcAttribute::Kind("bpf".into())]);
    }

    #[test]
    fn only_clsact_qdiscs_count() {
        let mut q = clsact(3).unwrap();
        assert!(is_clsact(&q));
        q.attributes = vec![TcAttribute::Kind("ingress".into())];
        assert!(!is_clsact(&q));
        let mut root = clsact(3).unwrap();
        root.header.parent = TcHandle::ROOT;
        assert!(!is_clsact(&root));
    }

    #[test]
    fn an_unreadable_message_at_podlinks_place_is_noticed() {
        let mut payload = vec![0u8; 20];
        payload[8..12].copy_from_slice(&FILTER_HANDLE.to_ne_bytes());
        payload[16..20].copy_from_slice(&filter_info(1, ETH_P_ALL).to_ne_bytes());
        assert!(at_podlinks_place(&payload));
        payload[16..20].copy_from_slice(&filter_info(2, ETH_P_ALL).to_ne_bytes());
        assert!(!at_podlinks_place(&payload));
        assert!(at_podlinks_place(&[0; 3]), "too short to tell");
    }
}
