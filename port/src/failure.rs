//! Failures as data: what went wrong, of which kind, in which op. They
//! poison tensors (`registry`) and travel to the client as a term
//! (`protocol::error`, protocol.md §4), where `Moat.Error` formats them once,
//! so a message never starts with its op name.

use crate::budget::Exceeded;
use crate::mlx;
use std::rc::Rc;

/// The first failure in a chain of ops: every tensor computed from a poisoned
/// input carries the same `Failure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub op: String,
    pub kind: Kind,
    pub message: String,
}

/// What kind of failure it is; protocol.md §4 lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// The request cannot be done as asked: its attributes, shapes, types,
    /// ids or op.
    Invalid,
    /// MLX raised an error (while building or evaluating).
    Mlx,
    /// It would take the worker past its memory limit.
    MemoryLimit { need: usize, in_use: usize, limit: usize },
    /// It was sent to another incarnation of the worker.
    StaleGeneration,
    /// A frame that is not a well-formed request.
    Protocol,
    /// The operating system refused (memory files, mappings).
    System,
}

impl Kind {
    /// The atom that names it on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Invalid => "invalid",
            Kind::Mlx => "mlx",
            Kind::MemoryLimit { .. } => "memory_limit",
            Kind::StaleGeneration => "stale_generation",
            Kind::Protocol => "protocol",
            Kind::System => "system",
        }
    }
}

impl Failure {
    /// An `Invalid` failure, shared as poisoned tensors share it.
    pub fn new(op: &str, message: impl Into<String>) -> Rc<Failure> {
        Rc::new(Failure::invalid(op, message))
    }

    pub fn of_kind(op: &str, kind: Kind, message: impl Into<String>) -> Failure {
        Failure {
            op: op.to_string(),
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(op: &str, message: impl Into<String>) -> Failure {
        Failure::of_kind(op, Kind::Invalid, message)
    }

    pub fn mlx(op: &str, e: mlx::Error) -> Failure {
        Failure::of_kind(op, Kind::Mlx, e.message)
    }

    pub fn memory_limit(op: &str, e: &Exceeded) -> Failure {
        let kind = Kind::MemoryLimit {
            need: e.need,
            in_use: e.in_use,
            limit: e.limit,
        };
        Failure::of_kind(op, kind, e.to_string())
    }

    pub fn stale_generation(sent: u64, current: u64, what: &str) -> Failure {
        let message = format!("{what} was sent to worker generation {sent} but this worker is generation {current}");
        Failure::of_kind("stale_generation", Kind::StaleGeneration, message)
    }

    pub fn protocol(op: &str, message: impl Into<String>) -> Failure {
        Failure::of_kind(op, Kind::Protocol, message)
    }

    pub fn system(op: &str, message: impl Into<String>) -> Failure {
        Failure::of_kind(op, Kind::System, message)
    }
}
