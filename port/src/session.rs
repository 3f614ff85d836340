//! The thread that owns the MLX stream: it runs every request in arrival
//! order, keeps the registry, and acknowledges progress. Requests arrive
//! decoded (`command`); `Session::call` is their one dispatch, and each
//! family of calls has its file (`memory_calls`, `program_calls`; the
//! tensor calls are here).

use crate::budget::{self, budget, EvalError, Pressure};
use crate::checks::Checks;
use crate::mlx::{Array, Evaluated};
use crate::ops;
use crate::program::Programs;
use crate::protocol::{self, Id, Malformed};
use crate::registry::{Failure, Registry};
use crate::replies::{Outgoing, Replies};
use crate::shared::{Sealed, SealedCopy};
use crate::spin::Spinner;
use crate::term::Term;
use crossbeam_channel::{Receiver, TryRecvError};
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

mod command;
mod memory_calls;
mod program_calls;

pub use command::{Call, Command, HookAck, Incoming, Name, Pin, Refusal, Upload, REQUESTS};

/// Every op this worker knows: the requests, then the op table.
pub fn op_names() -> Vec<&'static str> {
    REQUESTS.iter().copied().chain(ops::names()).collect()
}

/// What the session needs of its input besides the channel.
pub trait Inbound: Send + Sync {
    /// The next message: read by the session itself when the reader thread
    /// is not reading (see `input`), else the next one the reader hands
    /// over. `idle` runs before it blocks. A clean end of input or a broken
    /// stream ends the process, as in the reader thread.
    fn read_here(&self, rx: &Receiver<Incoming>, idle: &mut dyn FnMut()) -> Incoming;
    /// The session starts serving a message.
    fn started(&self);
    /// The session has served it.
    fn finished(&self);
    /// The session is about to wait for frames: the reader reads now.
    fn need_reader(&self);
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
    /// The session's input, which a run with hooks reads while it waits for
    /// its caller's `hook_ack`s (see `program_calls`).
    inbox: Option<Receiver<Incoming>>,
    /// What that run read and did not serve: served next, in order.
    deferred: VecDeque<Incoming>,
    /// The port's input, which the session reads itself while idle.
    input: Option<Arc<dyn Inbound>>,
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
            inbox: None,
            deferred: VecDeque::new(),
            input: None,
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

    /// Reads its own input while idle (see `input`); without it, every
    /// message comes through the channel `run` is given.
    pub fn with_input(mut self, input: Arc<dyn Inbound>) -> Session {
        self.input = Some(input);
        self
    }

    /// Serves until the reader hangs up.
    pub fn run(mut self, rx: Receiver<Incoming>) {
        self.inbox = Some(rx.clone());
        // Without an input of its own the session spins on its channel.
        let mut spinner = self.input.is_none().then(Spinner::default);
        let input = self.input.clone();
        loop {
            let next = match self.deferred.pop_front() {
                Some(msg) => Ok(msg),
                None => rx.try_recv(),
            };
            let msg = match next {
                Ok(msg) => msg,
                Err(TryRecvError::Empty) => {
                    if let Some(input) = &input {
                        input.read_here(&rx, &mut || self.ack())
                    } else {
                        // The idle ack goes out when the thread parks: a frame
                        // that comes during the spin saves it (the next one is
                        // at most `ACK_EVERY` requests away), and the reply is
                        // then the only frame a small call costs.
                        let spinner = spinner.get_or_insert_with(Spinner::default);
                        let next = spinner.wait(
                            || match rx.try_recv() {
                                Err(TryRecvError::Empty) => None,
                                got => Some(got.ok()),
                            },
                            || {
                                self.ack();
                                rx.recv().ok()
                            },
                        );
                        match next {
                            Some(msg) => msg,
                            None => return,
                        }
                    }
                }
                Err(TryRecvError::Disconnected) => return,
            };
            input.as_ref().inspect(|i| i.started());
            self.handle(msg);
            input.as_ref().inspect(|i| i.finished());
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
            Incoming::Call { call, command } => self.call(call, command),
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

    /// The one dispatch: a request, checked, then served by its command.
    fn call(&mut self, req: Call, command: Result<Command, Refusal>) {
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
        match command {
            Err(Refusal { failure, poisons_outs }) => {
                let outs = if poisons_outs { &req.outs[..] } else { &[] };
                self.fail(req.seq, outs, Rc::new(failure))
            }
            #[cfg(feature = "fault-injection")]
            Ok(Command::Fault(attrs)) => match crate::fault::inject(&attrs) {
                Ok(()) => self.reply(req.seq, Term::atom("nil")),
                Err(message) => self.fail(req.seq, &req.outs, Failure::new("fault", message)),
            },
            Ok(Command::FromBinary(upload)) => self.define_upload(&req, upload),
            Ok(Command::ToBinary(pin)) => self.to_binary(&req, pin),
            Ok(Command::Eval) => self.eval(&req),
            Ok(Command::AsyncEval) => self.async_eval(&req),
            Ok(Command::Metadata) => self.metadata(&req),
            Ok(Command::Sync) => self.reply(req.seq, Term::atom("nil")),
            Ok(Command::Release) => {
                for id in &req.ins {
                    self.registry.release(*id);
                    self.pins.remove(id);
                    if self.sealed.remove(id) {
                        budget::take_kept_where::<SealedCopy>(|copy| copy.id == *id);
                    }
                }
                // Frees the exported buffers these ids were the last to share.
                crate::mlx::memory::sweep_exports();
                self.reply(req.seq, Term::atom("nil"));
            }
            Ok(Command::Memory(call)) => self.memory_call(req.seq, &req.op, call),
            Ok(Command::Program(call)) => self.program_call(&req, call),
            // An acknowledgement that arrives after its run ended (a
            // cancel, say) has nothing left to do.
            Ok(Command::HookAck(_)) => self.reply(req.seq, Term::atom("nil")),
            Ok(Command::Op(entry, attrs)) => self.build(&req, entry, &attrs),
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

    /// A graph op (its arity checked as it was decoded).
    fn build(&mut self, req: &Call, &(name, _, builder): &ops::Entry, attrs: &Term) {
        let outputs = match self.registry.inputs(&req.ins, name) {
            Err(failure) => Err(failure),
            Ok(inputs) => ops::build(builder, &inputs, attrs)
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
                if ops::MOVES_FIRST_INPUT.contains(&name) {
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
    fn move_out(&mut self, req: &Call) {
        let (id, out) = (req.ins[0], req.outs[0]);
        let message = format!(
            "tensor id {id} was written in place into tensor {out} by {} (Moat.KVCache.update/3 spends the cache it is given: use the one it returns)",
            req.op
        );
        self.registry.poison(id, Failure::new(&req.op, message));
    }

    fn define_upload(&mut self, req: &Call, upload: Upload) {
        match upload.into_array() {
            Ok(array) => {
                self.registry.insert(req.outs[0], array);
                self.reply(req.seq, Term::atom("nil"));
            }
            Err(e) => self.fail(req.seq, &req.outs, Rc::new(Failure::mlx("from_binary", e))),
        }
    }

    /// The one input of a single-tensor call, or the failure to report.
    fn single(&self, req: &Call) -> Result<&Array, Rc<Failure>> {
        match req.ins.as_slice() {
            [id] => self.registry.get(*id, &req.op),
            ids => Err(Failure::new(
                &req.op,
                format!("{} takes one tensor id, got {}", req.op, ids.len()),
            )),
        }
    }

    /// A readback; a pin is honoured where shared memory is on.
    fn to_binary(&mut self, req: &Call, pin: Option<Pin>) {
        let pin = pin.filter(|_| self.shared_memory);
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
                let exported = if pin.export { exported(req.ins[0], &data) } else { None };
                let sealed = if exported.is_none() && pin.sealed {
                    self.sealed_copy(req.ins[0], &data)
                } else {
                    None
                };
                match (exported, sealed) {
                    (Some(location), _) => {
                        // The tensor's own buffer: the pin keeps it (and its
                        // file's descriptor) until the client has opened it.
                        info.extend(location);
                        self.pins.insert(pin.id, Pinned::Memory { _data: data });
                    }
                    (None, Some((file, location))) => {
                        info.extend(location);
                        self.pins.insert(pin.id, Pinned::File { _file: file });
                    }
                    (None, None) => {
                        #[cfg(feature = "fault-injection")]
                        let address = if crate::fault::wild_pin() {
                            4096
                        } else {
                            data.bytes().as_ptr() as u64
                        };
                        #[cfg(not(feature = "fault-injection"))]
                        let address = data.bytes().as_ptr() as u64;
                        info.push(("address", Term::int(address)));
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

    fn eval(&mut self, req: &Call) {
        // An evaluation lets go of the inputs of the nodes it computes:
        // exported buffers only those held may be free now.
        crate::mlx::memory::sweep_exports();
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
    fn async_eval(&mut self, req: &Call) {
        if let Ok(arrays) = self.registry.inputs(&req.ins, &req.op) {
            if let Err(e) = budget::evaluate_async(&arrays) {
                log::debug!("async_eval skipped: {e}");
            }
        }
        self.reply(req.seq, Term::atom("nil"));
    }

    fn metadata(&mut self, req: &Call) {
        match self.single(req) {
            Ok(array) => {
                let info = metadata(array, None);
                self.reply(req.seq, info)
            }
            Err(failure) => self.fail(req.seq, &[], failure),
        }
    }
}

/// Tensor `id`'s bytes in the memory file of its own buffer, made immutable
/// (`Evaluated::export`), as the reply's `path`, `inode`, `file_bytes` and
/// `offset`; `None` where they are in no such file or a step fails (the
/// client then gets a sealed copy or the pin's address).
fn exported(id: Id, data: &Evaluated) -> Option<Pairs> {
    crate::mlx::memory::sweep_exports();
    #[cfg(feature = "fault-injection")]
    let seal = !crate::fault::leave_unsealed();
    #[cfg(not(feature = "fault-injection"))]
    let seal = true;
    // A GPU worker's buffers are its allocator's (CUDA managed memory).
    if crate::mlx::on_gpu() {
        return None;
    }
    // `:wild_pin` is a fault of the address a pin answers with.
    #[cfg(feature = "fault-injection")]
    if crate::fault::wild_pin() {
        return None;
    }
    let warn = |message: String| log::warn!("readback of tensor {id} without its own buffer: {message}");
    let found = match data.export(seal) {
        Ok(Some(found)) => (found.fd, found.file_bytes, found.offset),
        Ok(None) => {
            // An upload's file, which MLX's allocator does not know: held
            // first, so that MLX never writes into it (a sweep lets go of
            // it if it is in no file).
            data.hold().map_err(|e| warn(e.message)).ok()?;
            crate::shared::export_upload(data.bytes(), seal).map_err(warn).ok()??
        }
        Err(e) => {
            warn(e.message);
            return None;
        }
    };
    let (fd, file_bytes, offset) = found;
    let inode = crate::sys::inode(fd).map_err(|e| warn(e.to_string())).ok()?;
    let path = format!("/proc/{}/fd/{}", crate::sys::os_pid(), fd);
    Some(vec![
        ("file_bytes", Term::int(file_bytes as u64)),
        ("inode", Term::int(inode)),
        ("offset", Term::int(offset as u64)),
        ("path", Term::Binary(path.into_bytes())),
    ])
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
