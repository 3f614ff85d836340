//! The memory calls: statistics, limits and the cache (protocol.md §6).

use super::Session;
use crate::budget::{self, budget};
use crate::protocol::{self, Request};
use crate::registry::Failure;
use crate::term::Term;

impl Session {
    pub(super) fn memory_call(&mut self, req: &Request) {
        match memory_result(req, self.registry.len()) {
            Ok(result) => self.reply(req.seq, result),
            Err(message) => self.fail(req.seq, &[], Failure::new(&req.op, message)),
        }
    }
}

fn memory_result(req: &Request, tensors: usize) -> Result<Term, String> {
    let mlx_error = |e: crate::mlx::Error| e.message;
    match req.op.as_str() {
        "memory_info" => Ok(protocol::map(vec![
            ("active", Term::int(budget().live() as u64)),
            ("peak", Term::int(budget().peak() as u64)),
            ("cache", Term::int(budget::cache() as u64)),
            ("limit", Term::int(budget().limit() as u64)),
            ("cache_limit", Term::int(budget().cache_limit() as u64)),
            ("tensors", Term::int(tensors as u64)),
        ])),
        "reset_peak_memory" => budget().reset_peak().map(|()| Term::atom("nil")).map_err(mlx_error),
        "clear_cache" => budget::clear_cache().map(|()| Term::atom("nil")).map_err(mlx_error),
        "set_memory_limit" => {
            let previous = budget().set_limit(byte_count(req)?).map_err(mlx_error)?;
            Ok(Term::int(previous as u64))
        }
        "set_cache_limit" => {
            let previous = budget().set_cache_limit(byte_count(req)?).map_err(mlx_error)?;
            Ok(Term::int(previous as u64))
        }
        other => Err(format!("{other} is not a memory call")),
    }
}

fn byte_count(req: &Request) -> Result<usize, String> {
    req.attrs
        .as_int()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("{} takes a byte count (an integer >= 0), got {}", req.op, req.attrs))
}
