//! The program calls: `define_program`, `run_program`, `release_program`
//! (protocol.md §6, "Programs").

use super::Session;
use crate::protocol::Request;
use crate::registry::Failure;
use crate::term::Term;

impl Session {
    pub(super) fn program_call(&mut self, req: &Request) {
        match req.op.as_str() {
            "define_program" => match self.programs.define(&req.attrs, &self.checks) {
                Ok(()) => self.reply(req.seq, Term::atom("nil")),
                Err(message) => self.fail(req.seq, &req.outs, Failure::new("define_program", message)),
            },
            "release_program" => {
                for id in req.attrs.as_list().unwrap_or_default() {
                    if let Some(id) = id.as_int().and_then(|i| u64::try_from(i).ok()) {
                        self.programs.release(id);
                    }
                }
                self.reply(req.seq, Term::atom("nil"));
            }
            _ => self.run_program(req),
        }
    }

    /// Runs a program: its outputs become `outs`, or every out is poisoned
    /// with the first failure (an unknown program, a poisoned input, or the
    /// step that failed, named by its op).
    fn run_program(&mut self, req: &Request) {
        let id = req.attrs.as_int().and_then(|i| u64::try_from(i).ok()).unwrap_or(0);
        let result = match self.programs.get(id) {
            None => Err(Failure::new(
                "run_program",
                format!("program {} is not defined (released, or never defined)", req.attrs),
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
        match result {
            Ok(arrays) => {
                for (id, array) in req.outs.iter().zip(arrays) {
                    self.registry.insert(*id, array);
                }
                self.reply(req.seq, Term::atom("nil"));
            }
            Err(failure) => self.fail(req.seq, &req.outs, failure),
        }
    }
}
