use crate::mlx::{ffi, Array, Dtype, Result};

pub fn astype(a: &Array, dtype: Dtype) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_astype(a.raw(), dtype.code(), out) })
}

pub fn contiguous(a: &Array) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_contiguous(a.raw(), out) })
}

pub fn reshape(a: &Array, shape: &[i32]) -> Result<Array> {
    // SAFETY: `a` is live; `shape` is valid for `shape.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_reshape(a.raw(), shape.as_ptr(), shape.len(), out) })
}

pub fn broadcast_to(a: &Array, shape: &[i32]) -> Result<Array> {
    // SAFETY: `a` is live; `shape` is valid for `shape.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_broadcast_to(a.raw(), shape.as_ptr(), shape.len(), out) })
}
