use crate::mlx::{ffi, Array, Buffer, Dtype, Result};

/// `value` (a scalar array) broadcast to `shape`, as `dtype`.
pub fn full(shape: &[i32], value: &Array, dtype: Dtype) -> Result<Array> {
    // SAFETY: `value` is live; `shape` is valid for `shape.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_full(shape.as_ptr(), shape.len(), value.raw(), dtype.code(), out) })
}

/// `start, start + step, ...` below `stop`.
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    // SAFETY: plain value arguments.
    Array::from_call(|out| unsafe { ffi::moat_arange(start, stop, step, dtype.code(), out) })
}

/// An `n` x `m` matrix with ones on diagonal `k`.
pub fn eye(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<Array> {
    // SAFETY: plain value arguments.
    Array::from_call(|out| unsafe { ffi::moat_eye(n, m, k, dtype.code(), out) })
}

/// A 0-d array holding `bytes` (one element of `dtype`, little-endian).
pub fn scalar_from_bytes(bytes: &[u8], dtype: Dtype) -> Result<Array> {
    let mut buffer = Buffer::alloc(bytes.len())?;
    buffer.as_mut_slice().copy_from_slice(bytes);
    buffer.into_array(&[], dtype)
}

pub fn scalar_i64(v: i64) -> Result<Array> {
    scalar_from_bytes(&v.to_le_bytes(), Dtype::S64)
}

pub fn scalar_u64(v: u64) -> Result<Array> {
    scalar_from_bytes(&v.to_le_bytes(), Dtype::U64)
}

pub fn scalar_f64(v: f64) -> Result<Array> {
    scalar_from_bytes(&v.to_le_bytes(), Dtype::F64)
}
