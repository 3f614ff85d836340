//! Requests decoded once, at the edge: the reader thread turns each header
//! into a `Call` and its `Command` (tokio mini-redis's `Command::from_frame`), and the session
//! dispatches on its `Command` alone. Each family decodes its own fields in
//! its own file (`memory_calls`, `program_calls`; uploads in `incoming`); a
//! graph op carries its op table entry, found once here.

use super::{memory_calls::MemoryCall, program_calls::ProgramCall};
use crate::failure::Failure;
use crate::mlx::{Array, Buffer, Dtype};
use crate::ops;
use crate::protocol::{Id, Malformed, Request};
use crate::shared::Mapped;
use crate::term::Term;

/// `Name`, `REQUESTS` and `Name::parse` from one list, so that the names the
/// worker reports (`--list-ops`) are the ones it decodes: `Incoming::decode`
/// and the reader match on `Name` exhaustively.
macro_rules! requests {
    ($($(#[$attr:meta])* $variant:ident = $name:literal,)*) => {
        /// A request kind served outside the op table.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Name {
            $($(#[$attr])* $variant,)*
        }

        /// The requests served outside the op table (`ops`), by the reader
        /// thread (`incoming`) or by the session. With the table's ops they
        /// are every op the worker knows (`moat_port --list-ops`), which
        /// tests check against protocol.md §6 and against what the client
        /// sends.
        pub const REQUESTS: &[&str] = &[$($(#[$attr])* $name,)*];

        impl Name {
            pub fn parse(op: &str) -> Option<Name> {
                match op {
                    $($(#[$attr])* $name => Some(Name::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

requests! {
    FromBinary = "from_binary",
    Upload = "upload",
    UploadFile = "upload_file",
    FromFile = "from_file",
    ToBinary = "to_binary",
    Eval = "eval",
    AsyncEval = "async_eval",
    Metadata = "metadata",
    Sync = "sync",
    Release = "release",
    MemoryInfo = "memory_info",
    ResetPeakMemory = "reset_peak_memory",
    ClearCache = "clear_cache",
    SetMemoryLimit = "set_memory_limit",
    SetCacheLimit = "set_cache_limit",
    DefineProgram = "define_program",
    RunProgram = "run_program",
    ReleaseProgram = "release_program",
    HookAck = "hook_ack",
    #[cfg(feature = "fault-injection")]
    Fault = "fault",
}

/// What the reader passes to the session, one per frame it reads.
pub enum Incoming {
    Call {
        call: Call,
        command: Result<Command, Refusal>,
    },
    /// A frame refused as a whole before it reaches the session (see
    /// `Malformed`).
    Malformed(Malformed),
    /// A frame the reader consumed itself (a middle chunk of an upload, or
    /// a shared file it made and answered).
    Consumed,
}

/// One request for the session: its header (what it asks is its `Command`).
pub struct Call {
    pub seq: u64,
    pub generation: u64,
    /// The op as the header names it, for failures (dispatch is on `command`).
    pub op: String,
    pub outs: Vec<Id>,
    pub ins: Vec<Id>,
}

/// What a request asks of the session, its fields decoded.
pub enum Command {
    /// A tensor's complete bytes (`from_binary`, its `upload` chunks, or
    /// `from_file`), to become `outs[0]`.
    FromBinary(Upload),
    ToBinary(Option<Pin>),
    Eval,
    AsyncEval,
    Metadata,
    Sync,
    Release,
    Memory(MemoryCall),
    Program(ProgramCall),
    /// The caller of a run with hooks has received its hook frames, or
    /// cancels it (see `program_calls`).
    HookAck(HookAck),
    /// A graph op: its table entry and its attrs.
    Op(&'static ops::Entry, Term),
    #[cfg(feature = "fault-injection")]
    Fault(Term),
}

/// A request that cannot be done as asked. The session still checks its
/// generation and ids as any other's, then fails it.
pub struct Refusal {
    pub failure: Failure,
    /// Whether the failure poisons `outs` (a call that defines no tensor,
    /// such as a readback whose out is a pin, poisons nothing).
    pub poisons_outs: bool,
}

/// `to_binary`'s `%{pin: min_bytes}` with `outs: [id]`: a readback of at
/// least `min` bytes is pinned as `id` and answered with its address instead
/// of a payload; with `sealed: true` too, with a sealed file's `path` and
/// `inode` where one can be made; with `export: true`, with the file that
/// holds the tensor's own buffer (`path`, `inode`, `file_bytes`, `offset`)
/// where it is in one.
pub struct Pin {
    pub id: Id,
    pub min: usize,
    pub sealed: bool,
    pub export: bool,
}

/// The complete bytes of an uploaded tensor.
pub enum Upload {
    /// Read from the pipe into MLX's memory.
    Piped {
        buffer: Buffer,
        shape: Vec<i32>,
        dtype: Dtype,
    },
    /// Written by the client into a shared file, mapped.
    Shared(Mapped),
}

impl Upload {
    pub fn into_array(self) -> crate::mlx::Result<Array> {
        match self {
            Upload::Piped { buffer, shape, dtype } => buffer.into_array(&shape, dtype),
            Upload::Shared(mapped) => mapped.into_array(),
        }
    }
}

impl Incoming {
    /// A request the session serves, decoded: `name` is its kind when it is
    /// not a graph op. The reader's own requests (uploads) come whole
    /// through `Incoming::upload`.
    pub fn decode(mut req: Request, name: Option<Name>) -> Incoming {
        let attrs = std::mem::replace(&mut req.attrs, Term::nil());
        let command = command(&req, attrs, name);
        Incoming::call(req, command)
    }

    /// A complete upload, for the ids of the request that began it.
    pub fn upload(req: Request, upload: Upload) -> Incoming {
        Incoming::call(req, Ok(Command::FromBinary(upload)))
    }

    fn call(req: Request, command: Result<Command, Refusal>) -> Incoming {
        let call = Call {
            seq: req.seq,
            generation: req.generation,
            op: req.op,
            outs: req.outs,
            ins: req.ins,
        };
        Incoming::Call { call, command }
    }
}

/// `req`'s command; its attrs, moved out of it, are `attrs`.
fn command(req: &Request, attrs: Term, name: Option<Name>) -> Result<Command, Refusal> {
    let poisons = |message: String| Refusal {
        failure: Failure::invalid(&req.op, message),
        poisons_outs: true,
    };
    let defines_none = |message: String| Refusal {
        failure: Failure::invalid(&req.op, message),
        poisons_outs: false,
    };
    let memory = |call: Result<MemoryCall, String>| call.map(Command::Memory).map_err(defines_none);
    Ok(match name {
        None => {
            let entry = ops::entry(&req.op).ok_or_else(|| poisons(format!("unknown op {}", req.op)))?;
            let arity = entry.1;
            if !arity.accepts(req.ins.len()) {
                return Err(poisons(format!(
                    "{} takes {arity} inputs, got {}",
                    req.op,
                    req.ins.len()
                )));
            }
            Command::Op(entry, attrs)
        }
        // The reader serves these itself, and passes an upload on whole.
        Some(Name::FromBinary | Name::Upload | Name::UploadFile | Name::FromFile) => {
            return Err(Refusal {
                failure: Failure::protocol(&req.op, format!("{} is served by the reader", req.op)),
                poisons_outs: true,
            })
        }
        Some(Name::ToBinary) => Command::ToBinary(pin(req, &attrs).map_err(defines_none)?),
        Some(Name::Eval) => Command::Eval,
        Some(Name::AsyncEval) => Command::AsyncEval,
        Some(Name::Metadata) => Command::Metadata,
        Some(Name::Sync) => Command::Sync,
        Some(Name::Release) => Command::Release,
        Some(Name::MemoryInfo) => Command::Memory(MemoryCall::Info),
        Some(Name::ResetPeakMemory) => Command::Memory(MemoryCall::ResetPeak),
        Some(Name::ClearCache) => Command::Memory(MemoryCall::ClearCache),
        Some(Name::SetMemoryLimit) => memory(MemoryCall::set_memory_limit(&attrs))?,
        Some(Name::SetCacheLimit) => memory(MemoryCall::set_cache_limit(&attrs))?,
        Some(Name::DefineProgram) => Command::Program(ProgramCall::Define(attrs)),
        Some(Name::RunProgram) => Command::Program(ProgramCall::run(&attrs).map_err(poisons)?),
        Some(Name::ReleaseProgram) => Command::Program(ProgramCall::release(&attrs)),
        Some(Name::HookAck) => Command::HookAck(HookAck::parse(&attrs).map_err(defines_none)?),
        #[cfg(feature = "fault-injection")]
        Some(Name::Fault) => Command::Fault(attrs),
    })
}

/// `hook_ack`'s attrs: `%{run: seq, received: n}` (the caller of run `seq`
/// has received `n` of its hook firings) or `%{run: seq, cancel: true}`.
pub struct HookAck {
    pub run: u64,
    pub received: u64,
    pub cancel: bool,
}

impl HookAck {
    fn parse(attrs: &Term) -> Result<HookAck, String> {
        let int = |key| {
            attrs
                .get(key)
                .and_then(Term::as_int)
                .and_then(|i| u64::try_from(i).ok())
        };
        let cancel = attrs.get("cancel").is_some_and(|t| t.is_atom("true"));
        match (int("run"), int("received")) {
            (Some(run), Some(received)) => Ok(HookAck { run, received, cancel }),
            (Some(run), None) if cancel => Ok(HookAck {
                run,
                received: 0,
                cancel,
            }),
            _ => Err(format!(
                "hook_ack takes %{{run: seq, received: n}} or %{{run: seq, cancel: true}}, got {attrs}"
            )),
        }
    }
}

/// `to_binary`'s attrs: `nil` with no outs, or a pin (see `Pin`).
fn pin(req: &Request, attrs: &Term) -> Result<Option<Pin>, String> {
    let min = match attrs {
        Term::Map(_) => attrs
            .get("pin")
            .and_then(Term::as_int)
            .and_then(|n| usize::try_from(n).ok()),
        attrs if attrs.is_atom("nil") && req.outs.is_empty() => return Ok(None),
        _ => None,
    };
    match (req.outs.as_slice(), min) {
        ([id], Some(min)) => Ok(Some(Pin {
            id: *id,
            min,
            sealed: attrs.get("sealed").is_some_and(|t| t.is_atom("true")),
            export: attrs.get("export").is_some_and(|t| t.is_atom("true")),
        })),
        _ => Err(format!(
            "to_binary takes attrs nil, or %{{pin: min_bytes}} with one out id; got {} with {} outs",
            attrs,
            req.outs.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_name_parses_to_its_kind_and_no_op_shadows_one() {
        for name in REQUESTS {
            assert!(Name::parse(name).is_some(), "{name}");
            assert!(ops::entry(name).is_none(), "{name} is a request and an op");
        }
        assert_eq!(Name::parse("add"), None);
    }
}
