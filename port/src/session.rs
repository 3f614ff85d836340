//! The thread that owns the MLX stream: it runs every request in arrival
//! order, keeps the registry, and acknowledges progress.

use crate::budget::{self, budget, EvalError, Pressure};
use crate::checks::Checks;
use crate::incoming::{Incoming, Upload};
use crate::mlx::{Array, Evaluated};
use crate::ops;
use crate::program::Programs;
use crate::protocol::{self, Id, Malformed, Request};
use crate::registry::{Failure, Registry};
use crate::replies::{Outgoing, Replies};
use crate::shared::{Sealed, SealedCopy};
use crate::term::Term;
use crossbeam_channel::{Receiver, TryRecvError};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;

mod memory_calls;
mod program_calls;

/// The requests served outside the op table (`ops`), by the reader thread
/// (`connection`) or by the `match` in `Session::request`. With the table's
/// ops they are every op the worker knows (`moat_port --list-ops`), which
/// tests check against protocol.md §6 and against what the client sends.
pub const REQUESTS: &[&str] = &[
    "from_binary",
    "upload",
    "upload_file",
    "from_file",
    "to_binary",
    "eval",
    "async_eval",
    "metadata",
    "sync",
    "release",
    "memory_info",
    "reset_peak_memory",
    "clear_cache",
    "set_memory_limit",
    "set_cache_limit",
    "define_program",
    "run_program",
    "release_program",
    #[cfg(feature = "fault-injection")]
    "fault",
];

/// Every op this worker knows: the requests, then the op table.
pub fn op_names() -> Vec<&'static str> {
    REQUESTS.iter().copied().chain(ops::names()).collect()
}

/// What a pinned readback keeps alive until the client releases its pin.
enum Pinned {
    /// The tensor, which the client reads at its address.
    Memory { _data: Evaluated },
    /// Its sealed copy, whose file the client maps.
    File { _file: Arc<Sealed> },
}

/// A reply map's entries, in the order they are written.
type Pairs = Vec<(&'static str, Term)>;

/// A readback's `pin` request (see `Session::pin_request`).
struct Pin {
    id: Id,
    min: usize,
    sealed: bool,
}

/// Requests between two unprompted acknowledgements.
const ACK_EVERY: u64 = 64;

pub struct Session {
    generation: u64,
    checks: Checks,
    registry: Registry,
    /// Readbacks the client reads from this process's memory (`to_binary`
    /// with `pin`), held until it releases them.
    pins: HashMap<Id, Pinned>,
    /// Tensors whose sealed copy may be in the cache (see `sealed_copy`).
    sealed: HashSet<Id>,
    /// Programs defined by `define_program`, by id.
    programs: Programs,
    shared_memory: bool,
    out: Replies,
    processed: u64,
    acked: u64,
    pressure: Pressure,
}

impl Session {
    pub fn new(generation: u64, out: Replies) -> Session {
        Session {
            generation,
            checks: Checks::default(),
            registry: Registry::default(),
            pins: HashMap::new(),
            sealed: HashSet::new(),
            programs: Programs::default(),
            shared_memory: false,
            out,
            processed: 0,
            acked: 0,
            pressure: Pressure::default(),
        }
    }

    /// The checks applied to every op's outputs (see `checks`).
    pub fn with_checks(mut self, checks: Checks) -> Session {
        self.checks = checks;
        self
    }

    /// Whether readbacks may be pinned for the client to read from this
    /// process's memory (see `shared`).
    pub fn with_shared_memory(mut self, on: bool) -> Session {
        self.shared_memory = on;
        self
    }

    /// Serves until the reader hangs up.
    pub fn run(mut self, rx: Receiver<Incoming>) {
        loop {
            let msg = match rx.try_recv() {
                Ok(msg) => msg,
                Err(TryRecvError::Empty) => {
                    self.ack();
                    match rx.recv() {
                        Ok(msg) => msg,
                        Err(_) => return,
                    }
                }
                Err(TryRecvError::Disconnected) => return,
            };
            self.handle(msg);
            if let Some(active) = self.pressure.observe(budget().live()) {
                self.send(Outgoing::Frame(protocol::memory_pressure(active)));
            }
            self.processed += 1;
            if self.processed - self.acked >= ACK_EVERY {
                self.ack();
            }
        }
    }

    fn ack(&mut self) {
        if self.processed != self.acked {
            self.acked = self.processed;
            self.send(Outgoing::Frame(protocol::ack(self.processed)));
        }
    }

    fn send(&self, msg: Outgoing) {
        self.out.send(msg);
    }

    pub fn handle(&mut self, msg: Incoming) {
        match msg {
            Incoming::Request { req, upload } => self.request(req, upload),
            Incoming::Malformed(Malformed { seq, outs, failure }) => {
                log::warn!("refused frame (seq {seq}, op {}): {}", failure.op, failure.message);
                if seq == 0 && !outs.is_empty() {
                    // No caller waits on it: report it unprompted so it is not
                    // lost (`fail` does so itself when there are no outs).
                    self.send(Outgoing::Frame(protocol::error(0, &failure)));
                }
                self.fail(seq, &outs, Rc::new(failure));
            }
            Incoming::Consumed => {}
        }
    }

    fn request(&mut self, req: Request, upload: Option<Upload>) {
        crate::trace::stamp("S", req.seq);
        if req.generation != self.generation {
            let failure = Failure::stale_generation(req.generation, self.generation, &req.op);
            return self.fail(req.seq, &req.outs, Rc::new(failure));
        }
        let defined = |id: &Id| self.registry.contains(*id) || self.pins.contains_key(id);
        if let Some(id) = req.outs.iter().copied().find(defined) {
            // The defined tensors stay as they are; only the others are
            // poisoned, and the failure is reported unprompted when no
            // caller waits for it.
            let fresh: Vec<Id> = req.outs.iter().copied().filter(|id| !defined(id)).collect();
            let failure = Failure::new(&req.op, format!("tensor id {id} is already defined"));
            if req.seq == 0 && !fresh.is_empty() {
                self.send(Outgoing::Frame(protocol::error(0, &failure)));
            }
            return self.fail(req.seq, &fresh, failure);
        }
        match req.op.as_str() {
            #[cfg(feature = "fault-injection")]
            "fault" => match crate::fault::inject(&req.attrs) {
                Ok(()) => self.reply(req.seq, Term::atom("nil")),
                Err(message) => self.fail(req.seq, &req.outs, Failure::new("fault", message)),
            },
            "from_binary" | "from_file" => self.define_upload(&req, upload),
            "to_binary" => self.to_binary(&req),
            "eval" => self.eval(&req),
            "async_eval" => self.async_eval(&req),
            "metadata" => self.metadata(&req),
            "sync" => self.reply(req.seq, Term::atom("nil")),
            "release" => {
                for id in &req.ins {
                    self.registry.release(*id);
                    self.pins.remove(id);
                    if self.sealed.remove(id) {
                        budget::take_kept_where::<SealedCopy>(|copy| copy.id == *id);
                    }
                }
                self.reply(req.seq, Term::atom("nil"));
            }
            "memory_info" | "reset_peak_memory" | "clear_cache" | "set_memory_limit" | "set_cache_limit" => {
                self.memory_call(&req)
            }
            "define_program" | "run_program" | "release_program" => self.program_call(&req),
            _ => self.build(&req),
        }
    }

    /// Poisons `outs` and, for a call, replies with the failure. A failure
    /// that neither a caller nor an id can carry is reported unprompted
    /// (seq 0), so that it is not lost.
    fn fail(&mut self, seq: u64, outs: &[Id], failure: Rc<Failure>) {
        for id in outs {
            self.registry.poison(*id, failure.clone());
        }
        if seq != 0 || outs.is_empty() {
            self.send(Outgoing::Frame(protocol::error(seq, &failure)));
        }
    }

    fn reply(&self, seq: u64, result: Term) {
        if seq != 0 {
            self.send(Outgoing::Frame(protocol::ok(seq, result)));
            crate::trace::stamp("W", seq);
        }
    }

    fn build(&mut self, req: &Request) {
        let Some((arity, builder)) = ops::builder(&req.op) else {
            let failure = Failure::new(&req.op, format!("unknown op {}", req.op));
            return self.fail(req.seq, &req.outs, failure);
        };
        if !arity.accepts(req.ins.len()) {
            let message = format!("{} takes {arity} inputs, got {}", req.op, req.ins.len());
            return self.fail(req.seq, &req.outs, Failure::new(&req.op, message));
        }
        let outputs = match self.registry.inputs(&req.ins, &req.op) {
            Err(failure) => Err(failure),
            Ok(inputs) => ops::build(builder, &inputs, &req.attrs)
                .and_then(|arrays| self.checks.outputs(&arrays).map(|()| arrays))
                .map_err(|m| Failure::new(&req.op, m)),
        };
        match outputs {
            Ok(arrays) if arrays.len() == req.outs.len() => {
                if let Err(e) = budget::admit_results(&arrays) {
                    return self.fail(req.seq, &req.outs, eval_failure(&req.op, e));
                }
                for (id, array) in req.outs.iter().zip(arrays) {
                    self.registry.insert(*id, array);
                }
                if ops::MOVES_FIRST_INPUT.contains(&req.op.as_str()) {
                    self.move_out(req);
                }
                self.reply(req.seq, Term::atom("nil"));
            }
            Ok(arrays) => {
                let message = format!(
                    "{} defines {} tensors, the request named {}",
                    req.op,
                    arrays.len(),
                    req.outs.len()
                );
                self.fail(req.seq, &req.outs, Failure::new(&req.op, message));
            }
            Err(failure) => self.fail(req.seq, &req.outs, failure),
        }
    }

    /// Lets go of the first input's handle, so that the op's node holds the
    /// only one (see `ops::cache`); the id now reads as this failure.
    fn move_out(&mut self, req: &Request) {
        let (id, out) = (req.ins[0], req.outs[0]);
        let message = format!(
            "tensor id {id} was written in place into tensor {out} by {} (Moat.KVCache.update/3 spends the cache it is given: use the one it returns)",
            req.op
        );
        self.registry.poison(id, Failure::new(&req.op, message));
    }

    fn define_upload(&mut self, req: &Request, upload: Option<Upload>) {
        let Some(upload) = upload else {
            return self.fail(
                req.seq,
                &req.outs,
                Failure::new("from_binary", "no tensor bytes arrived"),
            );
        };
        match upload.into_array() {
            Ok(array) => {
                self.registry.insert(req.outs[0], array);
                self.reply(req.seq, Term::atom("nil"));
            }
            Err(e) => self.fail(req.seq, &req.outs, Rc::new(Failure::mlx("from_binary", e))),
        }
    }

    /// The one input of a single-tensor call, or the failure to report.
    fn single(&self, req: &Request) -> Result<&Array, Rc<Failure>> {
        match req.ins.as_slice() {
            [id] => self.registry.get(*id, &req.op),
            ids => Err(Failure::new(
                &req.op,
                format!("{} takes one tensor id, got {}", req.op, ids.len()),
            )),
        }
    }

    fn to_binary(&mut self, req: &Request) {
        let pin = match self.pin_request(req) {
            Ok(pin) => pin,
            Err(failure) => return self.fail(req.seq, &[], failure),
        };
        let result = self.single(req).and_then(|array| {
            eval_within_budget(&[array], &req.op)?;
            if !array.row_contiguous() {
                // Reading back copies it into one dense block first.
                budget()
                    .admit(array.nbytes())
                    .map_err(|e| Rc::new(Failure::memory_limit(&req.op, &e)))?;
            }
            array.evaluate().map_err(|e| Rc::new(Failure::mlx(&req.op, e)))
        });
        match (result, pin) {
            (Ok(_), _) if req.seq == 0 => {}
            (Ok(data), Some(pin)) if data.bytes().len() >= pin.min.max(1) => {
                let mut info = metadata_pairs(data.array(), Some(data.bytes().len()));
                let sealed = if pin.sealed {
                    self.sealed_copy(req.ins[0], &data)
                } else {
                    None
                };
                match sealed {
                    Some((file, location)) => {
                        info.extend(location);
                        self.pins.insert(pin.id, Pinned::File { _file: file });
                    }
                    None => {
                        info.push(("address", Term::int(data.bytes().as_ptr() as u64)));
                        self.pins.insert(pin.id, Pinned::Memory { _data: data });
                    }
                }
                self.reply(req.seq, protocol::map(info));
            }
            (Ok(data), _) => {
                let info = protocol::map(metadata_pairs(data.array(), Some(data.bytes().len())));
                crate::trace::stamp("E", req.seq);
                self.send(Outgoing::Data {
                    seq: req.seq,
                    result: protocol::ok(req.seq, info),
                    data,
                });
                crate::trace::stamp("W", req.seq);
            }
            (Err(failure), _) => self.fail(req.seq, &[], failure),
        }
    }

    /// Tensor `id`'s bytes in a sealed file, with its `path` and `inode`:
    /// its copy from an earlier readback, or a new one, kept as cache for
    /// the next. `None` when the copy does not fit the memory limit or no
    /// file can be made (the client then reads the pin's address).
    fn sealed_copy(&mut self, id: Id, data: &Evaluated) -> Option<(Arc<Sealed>, Pairs)> {
        let len = data.bytes().len();
        let file = match budget::take_kept_where::<SealedCopy>(|copy| copy.id == id) {
            Some((_, copy)) => copy.file,
            None => {
                budget().admit(len).ok()?;
                match Sealed::of(data.bytes()) {
                    Ok(file) => Arc::new(file),
                    Err(message) => {
                        log::warn!("readback of tensor {id} through the pin's address: {message}");
                        return None;
                    }
                }
            }
        };
        let location = file
            .location()
            .map_err(|message| log::warn!("readback of tensor {id} through the pin's address: {message}"))
            .ok()?;
        if Sealed::may_keep() {
            self.sealed.insert(id);
            budget::keep(len, SealedCopy { id, file: file.clone() });
        }
        Some((file, location))
    }

    /// `to_binary`'s `%{pin: min_bytes}` with `outs: [id]`: a readback of at
    /// least `min_bytes` is pinned as `id` and answered with its address
    /// instead of a payload; with `sealed: true` too, with a sealed file's
    /// `path` and `inode` where one can be made. `None` when not asked, or
    /// not offered.
    fn pin_request(&self, req: &Request) -> Result<Option<Pin>, Rc<Failure>> {
        let min = match &req.attrs {
            Term::Map(_) => req
                .attrs
                .get("pin")
                .and_then(Term::as_int)
                .and_then(|n| usize::try_from(n).ok()),
            attrs if attrs.is_atom("nil") && req.outs.is_empty() => return Ok(None),
            _ => None,
        };
        match (req.outs.as_slice(), min) {
            ([id], Some(min)) => Ok(self.shared_memory.then_some(Pin {
                id: *id,
                min,
                sealed: req.attrs.get("sealed").is_some_and(|t| t.is_atom("true")),
            })),
            _ => Err(Failure::new(
                &req.op,
                format!(
                    "to_binary takes attrs nil, or %{{pin: min_bytes}} with one out id; got {} with {} outs",
                    req.attrs,
                    req.outs.len()
                ),
            )),
        }
    }

    fn eval(&mut self, req: &Request) {
        let result = self
            .registry
            .inputs(&req.ins, &req.op)
            .and_then(|arrays| eval_within_budget(&arrays, &req.op));
        match result {
            Ok(()) => self.reply(req.seq, Term::atom("nil")),
            Err(failure) => self.fail(req.seq, &[], failure),
        }
    }

    /// Starts evaluating in the background (see `budget::evaluate_async`).
    /// Errors resurface at the next blocking call on these ids, so a call
    /// (seq > 0) is answered `nil` regardless.
    fn async_eval(&mut self, req: &Request) {
        if let Ok(arrays) = self.registry.inputs(&req.ins, &req.op) {
            if let Err(e) = budget::evaluate_async(&arrays) {
                log::debug!("async_eval skipped: {e}");
            }
        }
        self.reply(req.seq, Term::atom("nil"));
    }

    fn metadata(&mut self, req: &Request) {
        match self.single(req) {
            Ok(array) => {
                let info = metadata(array, None);
                self.reply(req.seq, info)
            }
            Err(failure) => self.fail(req.seq, &[], failure),
        }
    }
}

/// Evaluates `arrays` within the memory limit (see `budget::evaluate`).
fn eval_within_budget(arrays: &[&Array], op: &str) -> Result<(), Rc<Failure>> {
    budget::evaluate(arrays).map_err(|e| eval_failure(op, e))
}

fn eval_failure(op: &str, e: EvalError) -> Rc<Failure> {
    Rc::new(match e {
        EvalError::Exceeded(e) => Failure::memory_limit(op, &e),
        EvalError::Mlx(e) => Failure::mlx(op, e),
    })
}

fn metadata(array: &Array, bytes: Option<usize>) -> Term {
    protocol::map(metadata_pairs(array, bytes))
}

fn metadata_pairs(array: &Array, bytes: Option<usize>) -> Pairs {
    let mut pairs = vec![
        ("dtype", protocol::dtype_term(array.dtype())),
        ("shape", protocol::shape_term(&array.shape())),
    ];
    if let Some(n) = bytes {
        pairs.push(("bytes", Term::int(n as u64)));
    }
    pairs
}
