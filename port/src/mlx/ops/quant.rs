//! Quantized weights, each held as one packed uint8 array (protocol.md,
//! "Quantized weights"): MLX's quantize, dequantize, quantized_matmul and
//! gather_qmm.

use std::ffi::CString;
use std::os::raw::c_int;
use std::ptr;

use crate::mlx::{ffi, Array, Dtype, Error, Result};

/// How a packed weight was made: its dense shape `{..., out, in}`, the type
/// of its affine scales and biases, and MLX's parameters.
pub struct Quant<'a> {
    pub shape: &'a [i32],
    pub scales: Dtype,
    pub group_size: i32,
    pub bits: i32,
    pub mode: &'a str,
}

fn mode(q: &Quant) -> Result<CString> {
    CString::new(q.mode).map_err(|_| Error::new("quantize: mode holds a NUL"))
}

/// `w` quantized along its last axis, packed into one uint8 vector; affine
/// scales and biases of type `scales`.
pub fn quantize(w: &Array, group_size: i32, bits: i32, mode: &str, scales: Dtype) -> Result<Array> {
    let mode = CString::new(mode).map_err(|_| Error::new("quantize: mode holds a NUL"))?;
    // SAFETY: `w` is live; `mode` is NUL-terminated and outlives the call.
    Array::from_call(|out| unsafe { ffi::moat_quantize(w.raw(), group_size, bits, mode.as_ptr(), scales.code(), out) })
}

/// The dense weight of `packed`, computed in and of type `out` (a float).
pub fn dequantize(packed: &Array, q: &Quant, out: Dtype) -> Result<Array> {
    let m = mode(q)?;
    // SAFETY: `packed` is live; `shape` is valid for its length; `m` outlives the call.
    Array::from_call(|out_ptr| unsafe {
        ffi::moat_dequantize(
            packed.raw(),
            q.shape.as_ptr(),
            q.shape.len(),
            q.scales.code(),
            out.code(),
            q.group_size,
            q.bits,
            m.as_ptr(),
            out_ptr,
        )
    })
}

/// `x · wᵀ` (`transpose`) or `x · w` for the packed weight `w`.
pub fn quantized_matmul(x: &Array, packed: &Array, q: &Quant, transpose: bool) -> Result<Array> {
    let m = mode(q)?;
    // SAFETY: the arrays are live; `shape` is valid for its length; `m` outlives the call.
    Array::from_call(|out| unsafe {
        ffi::moat_quantized_matmul(
            x.raw(),
            packed.raw(),
            q.shape.as_ptr(),
            q.shape.len(),
            q.scales.code(),
            q.group_size,
            q.bits,
            m.as_ptr(),
            c_int::from(transpose),
            out,
        )
    })
}

/// MLX's `gather_qmm`: the products of `x`'s matrices picked by
/// `lhs_indices` with `w`'s picked by `rhs_indices`.
///
/// # Safety
///
/// MLX does not check the indices: each must be within its axis (x's
/// batch, w's experts) before the result is evaluated.
pub unsafe fn gather_qmm(
    x: &Array,
    packed: &Array,
    q: &Quant,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    transpose: bool,
    sorted: bool,
) -> Result<Array> {
    let m = mode(q)?;
    let raw = |a: Option<&Array>| a.map_or(ptr::null(), |a| a.raw());
    // SAFETY: the arrays are live (or null, which the shim reads as absent);
    // `shape` is valid for its length; `m` outlives the call; the caller
    // checks the indices.
    Array::from_call(|out| unsafe {
        ffi::moat_gather_qmm(
            x.raw(),
            packed.raw(),
            q.shape.as_ptr(),
            q.shape.len(),
            q.scales.code(),
            q.group_size,
            q.bits,
            m.as_ptr(),
            raw(lhs_indices),
            raw(rhs_indices),
            c_int::from(transpose),
            c_int::from(sorted),
            out,
        )
    })
}
