//! The program calls: `define_program`, `run_program`, `release_program`
//! (protocol.md §6, "Programs").

use super::{metadata_pairs, Call, Command, Incoming, Session};
use crate::mlx::Evaluated;
use crate::program::HookSink;
use crate::protocol;
use crate::registry::Failure;
use crate::replies::{Outgoing, Replies};
use crate::term::Term;
use crossbeam_channel::Receiver;
use std::collections::VecDeque;

/// Hook firings a run sends beyond its caller's last `hook_ack`, and the
/// bytes past which it waits for one (a firing is sent whole, whatever its
/// size): what the client holds of hook values at a time is bounded by
/// these, however many times a loop fires (protocol.md §6, "Hooks").
pub const HOOK_WINDOW: u64 = 32;
pub const HOOK_BYTES: usize = 64 << 20;

/// A program call, decoded (a definition is parsed by `Programs::define`).
pub enum ProgramCall {
    Define(Term),
    Run(u64),
    Release(Vec<u64>),
}

impl ProgramCall {
    pub(super) fn run(attrs: &Term) -> Result<ProgramCall, String> {
        let id = attrs.as_int().and_then(|i| u64::try_from(i).ok());
        id.map(ProgramCall::Run)
            .ok_or_else(|| format!("run_program takes a program id (an integer >= 0), got {attrs}"))
    }

    pub(super) fn release(attrs: &Term) -> ProgramCall {
        let ids = attrs.as_list().unwrap_or_default();
        ProgramCall::Release(
            ids.iter()
                .filter_map(|id| id.as_int().and_then(|i| u64::try_from(i).ok()))
                .collect(),
        )
    }
}

impl Session {
    pub(super) fn program_call(&mut self, req: &Call, call: ProgramCall) {
        match call {
            ProgramCall::Define(attrs) => match self.programs.define(&attrs, &self.checks) {
                Ok(()) => self.reply(req.seq, Term::atom("nil")),
                Err(message) => self.fail(req.seq, &req.outs, Failure::new("define_program", message)),
            },
            ProgramCall::Release(ids) => {
                for id in ids {
                    self.programs.release(id);
                }
                self.reply(req.seq, Term::atom("nil"));
            }
            ProgramCall::Run(id) => self.run_program(req, id),
        }
    }

    /// Runs a program: its outputs become `outs`, or every out is poisoned
    /// with the first failure (an unknown program, a poisoned input, or the
    /// step that failed, named by its op).
    fn run_program(&mut self, req: &Call, id: u64) {
        // A run with hooks sends all its frames, its reply too, through the
        // writer's queue, so that they arrive in order (`send_queued`).
        let hooked = req.seq != 0 && self.programs.get(id).is_some_and(|p| p.has_hooks());
        let result = match self.programs.get(id) {
            None => Err(Failure::new(
                "run_program",
                format!("program {id} is not defined (released, or never defined)"),
            )),
            Some(program) if program.inputs() != req.ins.len() || program.outputs() != req.outs.len() => {
                Err(Failure::new(
                    "run_program",
                    format!(
                        "program {id} takes {} inputs and gives {} outputs, the request named {} and {}",
                        program.inputs(),
                        program.outputs(),
                        req.ins.len(),
                        req.outs.len()
                    ),
                ))
            }
            Some(program) if program.has_hooks() && req.seq != 0 => {
                // The run waits for its caller's acknowledgements: someone
                // must read them.
                if let Some(input) = &self.input {
                    input.need_reader();
                }
                let mut link = HookLink {
                    seq: req.seq,
                    out: &self.out,
                    inbox: self.inbox.as_ref(),
                    deferred: &mut self.deferred,
                    served: 0,
                    sent: 0,
                    acked: 0,
                    in_flight: VecDeque::new(),
                };
                let result = self
                    .registry
                    .inputs(&req.ins, "run_program")
                    .and_then(|inputs| program.run_with_hooks(&inputs, &self.checks, Some(&mut link)));
                self.processed += link.served;
                result
            }
            Some(program) => self
                .registry
                .inputs(&req.ins, "run_program")
                .and_then(|inputs| program.run(&inputs, &self.checks)),
        };
        let donated = self.programs.get(id).map(|p| p.donated().to_vec()).unwrap_or_default();
        match result {
            Ok(arrays) => {
                for (id, array) in req.outs.iter().zip(arrays) {
                    self.registry.insert(*id, array);
                }
                for &i in &donated {
                    let input = req.ins[i];
                    let message = format!(
                        "tensor id {input} was written in place by program {id} (run into tensors {:?}): \
                         Moat.KVCache.update/3 spends the cache it is given, inside a compiled function too: \
                         use the one it returns",
                        req.outs
                    );
                    self.registry.poison(input, Failure::new("run_program", message));
                }
                if hooked {
                    let ok = protocol::ok(req.seq, Term::atom("nil"));
                    self.out.send_queued(Outgoing::Frame(ok));
                } else {
                    self.reply(req.seq, Term::atom("nil"));
                }
            }
            Err(failure) if hooked => {
                for id in &req.outs {
                    self.registry.poison(*id, failure.clone());
                }
                self.out
                    .send_queued(Outgoing::Frame(protocol::error(req.seq, &failure)));
            }
            Err(failure) => self.fail(req.seq, &req.outs, failure),
        }
    }
}

/// A run's way to its caller: hook values go out as `{:hook, seq, info}`
/// frames while the program runs; the caller's `hook_ack`s, read from the
/// session's input while the run waits for them, open the window again.
/// Everything else read meanwhile is served after the run, in order.
struct HookLink<'s> {
    seq: u64,
    out: &'s Replies,
    inbox: Option<&'s Receiver<Incoming>>,
    deferred: &'s mut VecDeque<Incoming>,
    /// The `hook_ack` requests it served (counted as processed).
    served: u64,
    /// Firings sent, and acknowledged by the caller.
    sent: u64,
    acked: u64,
    /// `(firing, bytes)` of the firings not yet acknowledged.
    in_flight: VecDeque<(u64, usize)>,
}

impl HookLink<'_> {
    fn full(&self) -> bool {
        let bytes: usize = self.in_flight.iter().map(|(_, b)| b).sum();
        self.sent - self.acked >= HOOK_WINDOW || (!self.in_flight.is_empty() && bytes >= HOOK_BYTES)
    }

    /// Applies a `hook_ack` of this run; defers anything else.
    fn take(&mut self, msg: Incoming) -> Result<(), String> {
        let Incoming::Call {
            call,
            command: Ok(Command::HookAck(ack)),
        } = msg
        else {
            self.deferred.push_back(msg);
            return Ok(());
        };
        self.served += 1;
        if call.seq != 0 {
            self.out
                .send(Outgoing::Frame(protocol::ok(call.seq, Term::atom("nil"))));
        }
        if ack.run != self.seq {
            return Ok(());
        }
        if ack.cancel {
            return Err("the caller stopped the run (its hook function raised, or it exited)".into());
        }
        self.acked = self.acked.max(ack.received.min(self.sent));
        while self.in_flight.front().is_some_and(|(n, _)| *n <= self.acked) {
            self.in_flight.pop_front();
        }
        Ok(())
    }

    /// Takes what has arrived, without waiting (a cancel stops the run at
    /// its next hook).
    fn poll(&mut self) -> Result<(), String> {
        while let Some(msg) = self.inbox.and_then(|rx| rx.try_recv().ok()) {
            self.take(msg)?;
        }
        Ok(())
    }
}

impl HookSink for HookLink<'_> {
    fn fire(&mut self, id: u64, values: Vec<Evaluated>) -> Result<(), String> {
        self.poll()?;
        while self.full() {
            let msg = self.inbox.and_then(|rx| rx.recv().ok()).ok_or("the client is gone")?;
            self.take(msg)?;
        }
        let of = values.len() as u64;
        let bytes = values.iter().map(|v| v.bytes().len()).sum();
        for (i, data) in values.into_iter().enumerate() {
            let mut info = vec![
                ("id", Term::int(id)),
                ("value", Term::int(i as u64)),
                ("of", Term::int(of)),
            ];
            info.extend(metadata_pairs(data.array(), Some(data.bytes().len())));
            let result = protocol::hook(self.seq, protocol::map(info));
            self.out.send_queued(Outgoing::Data {
                seq: self.seq,
                result,
                data,
            });
        }
        self.sent += 1;
        self.in_flight.push_back((self.sent, bytes));
        Ok(())
    }
}
