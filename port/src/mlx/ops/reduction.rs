use crate::mlx::{ffi, Array, Result};

/// `fn name(a, axes, keepdims)` over a reduction of the shim.
macro_rules! reduce {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
            // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), axes.as_ptr(), axes.len(), keepdims as i32, out) })
        }
    )*};
}

reduce! {
    sum => moat_sum,
    prod => moat_prod,
    max => moat_max,
    min => moat_min,
    all => moat_all,
    any => moat_any,
}

/// `fn name(a, axis, keepdims)`: the index of the first extreme along `axis`.
macro_rules! arg_reduce {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
            // SAFETY: `a` is live for the call.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), axis, keepdims as i32, out) })
        }
    )*};
}

arg_reduce! {
    argmax => moat_argmax,
    argmin => moat_argmin,
}

/// `fn name(a, axis, reverse)`: an inclusive scan along `axis`.
macro_rules! scan {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, axis: i32, reverse: bool) -> Result<Array> {
            // SAFETY: `a` is live for the call.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), axis, reverse as i32, out) })
        }
    )*};
}

scan! {
    cumsum => moat_cumsum,
    cumprod => moat_cumprod,
    cummax => moat_cummax,
    cummin => moat_cummin,
}

/// Stable ascending sort along `axis`, NaN last.
pub fn sort(a: &Array, axis: i32) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_sort(a.raw(), axis, out) })
}

/// The indices (u32) of a stable ascending sort along `axis`, NaN last.
pub fn argsort(a: &Array, axis: i32) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_argsort(a.raw(), axis, out) })
}
