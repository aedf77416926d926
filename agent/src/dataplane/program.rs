//! podlink's eBPF programs by name.

use std::fmt;

use aya::programs::TcAttachType;
use podlink_common::{PROG_FROM_POD, PROG_TO_POD};
use serde::Serialize;

/// One of podlink's eBPF programs, attached to each enrolled pod's host veth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Program {
    /// `from_pod`: what the pod sends (TC ingress of the host veth).
    FromPod,
    /// `to_pod`: what the pod receives (TC egress of the host veth).
    ToPod,
}

impl Program {
    /// Both programs, in the order they are attached.
    pub const ALL: [Program; 2] = [Program::FromPod, Program::ToPod];

    /// The program's name in the object (ELF section) and in its link pins.
    pub fn name(self) -> &'static str {
        match self {
            Program::FromPod => PROG_FROM_POD,
            Program::ToPod => PROG_TO_POD,
        }
    }

    /// The program named `name`, if it is one of podlink's.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Where on the host veth it runs.
    pub fn attach_type(self) -> TcAttachType {
        match self {
            Program::FromPod => TcAttachType::Ingress,
            Program::ToPod => TcAttachType::Egress,
        }
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
