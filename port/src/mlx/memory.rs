//! MLX's allocator statistics and limits, and the size of what evaluating a
//! lazy graph would allocate.

use super::{check, ffi, Array, Result};
use std::collections::HashSet;
use std::ffi::CStr;

/// Ops whose result shares its input's buffer on the CPU: evaluating them
/// allocates nothing.
const VIEWS: &[&str] = &[
    "Broadcast",
    "BroadcastAxes",
    "Transpose",
    "Slice",
    "AsStrided",
    "ExpandDims",
    "Squeeze",
    "View",
];

/// Ops that share their input's buffer when it is dense, and copy otherwise.
const RESHAPES: &[&str] = &["Reshape", "Flatten", "Unflatten"];

/// Bytes in live buffers (evaluated arrays and uploads), without the cache.
pub fn active() -> usize {
    // SAFETY: reads the allocator's counters; no arguments.
    unsafe { ffi::moat_active_memory() }
}

/// The largest `active()` seen since start or the last `reset_peak()`.
pub fn peak() -> usize {
    // SAFETY: as above.
    unsafe { ffi::moat_peak_memory() }
}

/// Freed buffers MLX keeps for reuse.
pub fn cache() -> usize {
    // SAFETY: as above.
    unsafe { ffi::moat_cache_memory() }
}

/// MLX's own memory limit (advisory on the CPU: its allocator ignores it).
pub fn limit() -> usize {
    // SAFETY: as above.
    unsafe { ffi::moat_memory_limit() }
}

pub fn reset_peak() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { ffi::moat_reset_peak_memory() })
}

/// Sets MLX's memory limit; returns the previous one.
pub fn set_limit(bytes: usize) -> Result<usize> {
    let mut previous = 0;
    // SAFETY: `previous` is a valid out-pointer for the call.
    check(unsafe { ffi::moat_set_memory_limit(bytes, &mut previous) })?;
    Ok(previous)
}

/// Sets how much freed memory MLX may keep cached; returns the previous limit.
pub fn set_cache_limit(bytes: usize) -> Result<usize> {
    let mut previous = 0;
    // SAFETY: `previous` is a valid out-pointer for the call.
    check(unsafe { ffi::moat_set_cache_limit(bytes, &mut previous) })?;
    Ok(previous)
}

/// Memory files open for MLX's large CPU buffers (port/shim/alloc.cpp),
/// live and cached.
pub fn buffer_files() -> usize {
    // SAFETY: reads the allocator's counters; no arguments.
    unsafe { ffi::moat_buffer_files_open() }
}

/// Lets go of the exported buffers (`Evaluated::export`) that nothing else
/// holds any more, which frees them; returns how many stay held.
pub fn sweep_exports() -> usize {
    // SAFETY: no arguments; the shim's list is behind its own lock.
    unsafe { ffi::moat_exports_sweep() }
}

pub fn clear_cache() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { ffi::moat_clear_cache() })
}

impl Array {
    /// True until the array's evaluation has been scheduled: it owns no
    /// memory yet.
    pub fn unscheduled(&self) -> bool {
        // SAFETY: `self.raw()` is live.
        unsafe { ffi::moat_array_unscheduled(self.raw()) == 1 }
    }

    /// True once its evaluation has finished (an `async_eval` may still be
    /// computing it).
    pub fn available(&self) -> bool {
        // SAFETY: `self.raw()` is live.
        unsafe { ffi::moat_array_available(self.raw()) == 1 }
    }

    /// True when the array's elements are one dense row-major block (reading
    /// it back needs no copy). Meaningful once evaluated.
    pub fn row_contiguous(&self) -> bool {
        // SAFETY: `self.raw()` is live.
        unsafe { ffi::moat_array_row_contiguous(self.raw()) == 1 }
    }

    /// The bytes evaluating this node allocates for its result: none for a
    /// view, nor for a reshape of an evaluated dense input; `nbytes`
    /// otherwise (a reshape of a lazy input may have to copy).
    pub fn result_bytes(&self) -> Result<usize> {
        // SAFETY: `self.raw()` is live; the name is a static string or null.
        let name = unsafe { ffi::moat_array_primitive(self.raw()) };
        let name = if name.is_null() {
            ""
        } else {
            unsafe { CStr::from_ptr(name) }.to_str().unwrap_or("")
        };
        if VIEWS.contains(&name) {
            return Ok(0);
        }
        if RESHAPES.contains(&name) {
            if let [input] = self.inputs()?.as_slice() {
                if !input.unscheduled() && input.row_contiguous() {
                    return Ok(0);
                }
            }
        }
        Ok(self.nbytes())
    }

    /// The identity of the graph node (handles to one node share it).
    fn node_id(&self) -> usize {
        // SAFETY: `self.raw()` is live.
        unsafe { ffi::moat_array_id(self.raw()) }
    }

    fn inputs(&self) -> Result<Vec<Array>> {
        // SAFETY: `self.raw()` is live and `i` is below the input count.
        let n = unsafe { ffi::moat_array_num_inputs(self.raw()) };
        (0..n)
            .map(|i| Array::from_call(|out| unsafe { ffi::moat_array_input(self.raw(), i, out) }))
            .collect()
    }

    fn siblings(&self) -> Result<Vec<Array>> {
        // SAFETY: `self.raw()` is live and `i` is below the sibling count.
        let n = unsafe { ffi::moat_array_num_siblings(self.raw()) };
        (0..n)
            .map(|i| Array::from_call(|out| unsafe { ffi::moat_array_sibling(self.raw(), i, out) }))
            .collect()
    }
}

/// A not-yet-evaluated node and the bytes its evaluation allocates for
/// results (its own, and those of the other outputs of a multi-output op).
pub struct Pending {
    pub node: Array,
    pub bytes: usize,
}

/// Every unscheduled node that evaluating `arrays` would compute, each once,
/// in an order where a node comes after everything it reads. Views count
/// nothing (`Array::result_bytes`), a reshape of a lazy input counts as a
/// copy, and MLX may reuse an input's buffer for an output, so the bytes are
/// an upper bound on results; scratch space inside a kernel is not included.
pub fn pending(arrays: &[&Array]) -> Result<Vec<Pending>> {
    let mut seen = HashSet::new();
    let mut order = Vec::new();
    let mut stack: Vec<(Array, bool)> = arrays
        .iter()
        .map(|a| a.share().map(|a| (a, false)))
        .collect::<Result<_>>()?;
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            let mut bytes = node.result_bytes()?;
            for sibling in node.siblings()? {
                if seen.insert(sibling.node_id()) {
                    bytes = bytes.saturating_add(sibling.nbytes());
                }
            }
            order.push(Pending { node, bytes });
            continue;
        }
        if !node.unscheduled() || !seen.insert(node.node_id()) {
            continue;
        }
        let inputs = node.inputs()?;
        stack.push((node, true));
        stack.extend(inputs.into_iter().map(|input| (input, false)));
    }
    Ok(order)
}

/// The sum of `pending(arrays)`'s bytes.
pub fn pending_bytes(arrays: &[&Array]) -> Result<usize> {
    Ok(pending(arrays)?
        .iter()
        .fold(0usize, |sum, p| sum.saturating_add(p.bytes)))
}
