//! A function compiled (traced, then fused) by `mlx::core::compile`, whose
//! body is a Rust closure over arrays.

use super::{check, ffi, Array, Result};
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

/// The body: the inputs (tracers while MLX traces) to the outputs.
pub type Trace = Box<dyn Fn(&[Array]) -> std::result::Result<Vec<Array>, String>>;

/// MLX traces the body on the first call for each input signature (shapes
/// and types) and replays the fused graph after that.
pub struct Compiled {
    raw: *mut ffi::moat_compiled,
    outputs: usize,
    // Dropped after `raw` is freed (see `Drop`): MLX may call it until then.
    _body: Box<Trace>,
}

impl Drop for Compiled {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `moat_compile` and is freed only here,
        // while the body it calls is still alive (fields drop after this).
        unsafe { ffi::moat_compiled_free(self.raw) }
    }
}

impl Compiled {
    /// Compiles `body`, which gives `outputs` arrays. `id` must be unique
    /// among the live compiled functions of this thread: MLX caches traces
    /// by it.
    pub fn new(id: usize, outputs: usize, body: Trace) -> Result<Compiled> {
        let body = Box::new(body);
        let ctx = &*body as *const Trace as *mut c_void;
        let mut raw = ptr::null_mut();
        // SAFETY: `ctx` points at the boxed body, which outlives `raw` (see
        // `Drop`), and `trace` reads it as a `Trace`.
        check(unsafe { ffi::moat_compile(trace, ctx, id, outputs, &mut raw) })?;
        Ok(Compiled {
            raw,
            outputs,
            _body: body,
        })
    }

    pub fn call(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        let ins: Vec<*mut ffi::moat_array> = inputs.iter().map(|a| a.raw()).collect();
        let mut outs = vec![ptr::null_mut(); self.outputs];
        // SAFETY: the inputs are live for the call; on success the shim
        // writes a fresh handle into every out slot.
        check(unsafe { ffi::moat_compiled_call(self.raw, ins.as_ptr(), ins.len(), outs.as_mut_ptr(), outs.len()) })?;
        outs.into_iter().map(Array::adopt).collect()
    }
}

/// Called by the shim while MLX traces: runs the body on the input handles
/// (now owned here) and hands over those of the outputs. Never unwinds into
/// C++: a panic is a failed trace.
extern "C" fn trace(
    ctx: *mut c_void,
    ins: *const *mut ffi::moat_array,
    n_ins: usize,
    outs: *mut *mut ffi::moat_array,
    n_outs: usize,
) -> c_int {
    let run = AssertUnwindSafe(|| -> std::result::Result<(), String> {
        // SAFETY: `ctx` is the `Trace` boxed by `Compiled::new`, alive as
        // long as its compiled function.
        let body = unsafe { &*(ctx as *const Trace) };
        let inputs = (0..n_ins)
            // SAFETY: the shim passes `n_ins` owned handles.
            .map(|i| Array::adopt(unsafe { *ins.add(i) }).map_err(|e| e.message))
            .collect::<std::result::Result<Vec<Array>, String>>()?;
        let outputs = body(&inputs)?;
        if outputs.len() != n_outs {
            return Err(format!("the body gave {} outputs, not {n_outs}", outputs.len()));
        }
        for (i, array) in outputs.into_iter().enumerate() {
            // SAFETY: `outs` has room for `n_outs` handles, which the shim frees.
            unsafe { *outs.add(i) = array.into_raw() };
        }
        Ok(())
    });
    match catch_unwind(run) {
        Ok(Ok(())) => ffi::MOAT_OK,
        Ok(Err(message)) => {
            log::debug!("a program's trace failed: {message}");
            1
        }
        Err(_) => 1,
    }
}
