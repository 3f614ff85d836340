//! The memory calls: statistics, limits and the cache (protocol.md §6).

use super::Session;
use crate::budget::{self, budget};
use crate::protocol;
use crate::registry::Failure;
use crate::term::Term;

/// A memory call, decoded.
pub enum MemoryCall {
    Info,
    ResetPeak,
    ClearCache,
    SetMemoryLimit(usize),
    SetCacheLimit(usize),
}

impl MemoryCall {
    pub(super) fn set_memory_limit(attrs: &Term) -> Result<MemoryCall, String> {
        byte_count("set_memory_limit", attrs).map(MemoryCall::SetMemoryLimit)
    }

    pub(super) fn set_cache_limit(attrs: &Term) -> Result<MemoryCall, String> {
        byte_count("set_cache_limit", attrs).map(MemoryCall::SetCacheLimit)
    }
}

impl Session {
    pub(super) fn memory_call(&mut self, seq: u64, op: &str, call: MemoryCall) {
        match memory_result(call, self.registry.len()) {
            Ok(result) => self.reply(seq, result),
            Err(e) => self.fail(seq, &[], Failure::new(op, e.message)),
        }
    }
}

fn memory_result(call: MemoryCall, tensors: usize) -> crate::mlx::Result<Term> {
    let nil = |()| Term::atom("nil");
    match call {
        MemoryCall::Info => Ok(protocol::map(vec![
            ("active", Term::int(budget().live() as u64)),
            ("peak", Term::int(budget().peak() as u64)),
            ("cache", Term::int(budget::cache() as u64)),
            ("limit", Term::int(budget().limit() as u64)),
            ("cache_limit", Term::int(budget().cache_limit() as u64)),
            ("tensors", Term::int(tensors as u64)),
        ])),
        MemoryCall::ResetPeak => budget().reset_peak().map(nil),
        MemoryCall::ClearCache => budget::clear_cache().map(nil),
        MemoryCall::SetMemoryLimit(bytes) => budget().set_limit(bytes).map(|p| Term::int(p as u64)),
        MemoryCall::SetCacheLimit(bytes) => budget().set_cache_limit(bytes).map(|p| Term::int(p as u64)),
    }
}

fn byte_count(op: &str, attrs: &Term) -> Result<usize, String> {
    attrs
        .as_int()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("{op} takes a byte count (an integer >= 0), got {attrs}"))
}
