//! The program calls: `define_program`, `run_program`, `release_program`
//! (protocol.md §6, "Programs").

use super::{Call, Session};
use crate::registry::Failure;
use crate::term::Term;

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
                self.reply(req.seq, Term::atom("nil"));
            }
            Err(failure) => self.fail(req.seq, &req.outs, failure),
        }
    }
}
