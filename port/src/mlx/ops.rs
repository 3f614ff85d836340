//! One safe function per shim op. Ops build lazy graph nodes; shape and type
//! errors are reported here, kernel errors at evaluation.

use super::{ffi, Array, Dtype, Result};

macro_rules! binary {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, b: &Array) -> Result<Array> {
            // SAFETY: both inputs are live arrays borrowed for the call.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), b.raw(), out) })
        }
    )*};
}

binary! {
    add => moat_add,
    subtract => moat_subtract,
    multiply => moat_multiply,
    divide => moat_divide,
    matmul => moat_matmul,
}

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

pub fn sum(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
    // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_sum(a.raw(), axes.as_ptr(), axes.len(), keepdims as i32, out) })
}
