use crate::mlx::{ffi, Array, Result};

pub fn sum(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
    // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_sum(a.raw(), axes.as_ptr(), axes.len(), keepdims as i32, out) })
}

/// `fn name(a, axes, keepdims)` over an MLX reduction.
macro_rules! reduction {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
            // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), axes.as_ptr(), axes.len(), keepdims as i32, out) })
        }
    )*};
}

reduction! {
    prod => moat_prod,
    max => moat_max,
    min => moat_min,
    any => moat_any,
}

pub fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_argmax(a.raw(), axis, keepdims as i32, out) })
}

pub fn argmin(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_argmin(a.raw(), axis, keepdims as i32, out) })
}

pub fn argsort(a: &Array, axis: i32) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_argsort(a.raw(), axis, out) })
}
