//! `mlx::core::fast` kernels. `None` stands for MLX's `std::nullopt`.

use std::ptr;

use crate::mlx::{ffi, Array, Result};

fn raw_or_null(a: Option<&Array>) -> *const ffi::moat_array {
    a.map_or(ptr::null(), |a| a.raw())
}

/// `x / sqrt(mean(x², -1) + eps) * weight` over the last axis.
pub fn fast_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: inputs are live (or null, which the shim reads as no weight).
    Array::from_call(|out| unsafe { ffi::moat_fast_rms_norm(x.raw(), raw_or_null(weight), eps, out) })
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis.
pub fn fast_layer_norm(x: &Array, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: inputs are live (or null, which the shim reads as absent).
    Array::from_call(|out| unsafe {
        ffi::moat_fast_layer_norm(x.raw(), raw_or_null(weight), raw_or_null(bias), eps, out)
    })
}

/// Where a rotary embedding's positions start: one for all, or an int32
/// array (a scalar or one per batch, axis 0).
pub enum Offset<'a> {
    Int(i32),
    Array(&'a Array),
}

/// The rotary embedding's parameters; `freqs`, when given, replaces `base`.
pub struct Rope<'a> {
    pub dims: i32,
    pub traditional: bool,
    pub base: f32,
    pub scale: f32,
    pub offset: Offset<'a>,
    pub freqs: Option<&'a Array>,
}

/// Rotary embedding; positions run along axis -2 from the offset.
pub fn fast_rope(x: &Array, r: &Rope) -> Result<Array> {
    let (dims, traditional, freqs) = (r.dims, i32::from(r.traditional), raw_or_null(r.freqs));
    match r.offset {
        // SAFETY: inputs are live (or null, which the shim reads as absent).
        Offset::Int(offset) => Array::from_call(|out| unsafe {
            ffi::moat_fast_rope(x.raw(), dims, traditional, r.base, r.scale, offset, freqs, out)
        }),
        // SAFETY: as above; `offset` is a live array.
        Offset::Array(offset) => Array::from_call(|out| unsafe {
            ffi::moat_fast_rope_offsets(x.raw(), dims, traditional, r.base, r.scale, offset.raw(), freqs, out)
        }),
    }
}

/// What attention masks beyond `mask`: causality (the queries are the last
/// keys, of the valid prefix when `lengths` is given), keys at or past
/// `lengths[b]` and before `starts[b]` (integer `{B}`), and per-head sink
/// logits (`{Hq}`) in the softmax's denominator.
pub struct Attend<'a> {
    pub scale: f32,
    pub causal: bool,
    pub mask: Option<&'a Array>,
    pub lengths: Option<&'a Array>,
    pub starts: Option<&'a Array>,
    pub sinks: Option<&'a Array>,
}

/// `softmax(q kᵀ · scale + mask) v`.
pub fn fast_attention(q: &Array, k: &Array, v: &Array, a: &Attend) -> Result<Array> {
    // SAFETY: inputs are live (or null, which the shim reads as absent).
    Array::from_call(|out| unsafe {
        ffi::moat_fast_attention(
            q.raw(),
            k.raw(),
            v.raw(),
            a.scale,
            i32::from(a.causal),
            raw_or_null(a.mask),
            raw_or_null(a.lengths),
            raw_or_null(a.starts),
            raw_or_null(a.sinks),
            out,
        )
    })
}
