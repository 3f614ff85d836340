//! Take, scatter and dynamic slices.
//!
//! MLX reads and writes at indices without checking them, so take and
//! scatter are `unsafe`: their callers (the builders in
//! `crate::ops::indexing`) check the indices before the result is evaluated.

use crate::mlx::{ffi, Array, Error, Result};

/// # Safety
/// Every index must lie in `0..a.shape()[axis]` by the time the result (or
/// anything computed from it) is evaluated.
pub unsafe fn take(a: &Array, indices: &Array, axis: i32) -> Result<Array> {
    // SAFETY: both inputs are live for the call; the indices are the caller's.
    Array::from_call(|out| unsafe { ffi::moat_take(a.raw(), indices.raw(), axis, out) })
}

/// # Safety
/// As for `take`.
pub unsafe fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<Array> {
    // SAFETY: both inputs are live for the call; the indices are the caller's.
    Array::from_call(|out| unsafe { ffi::moat_take_along_axis(a.raw(), indices.raw(), axis, out) })
}

/// Writes `updates[i]` (shape `[n, 1, rest...]`) at `indices[i]` of `axis`.
///
/// # Safety
/// Every index must lie in `0..a.shape()[axis]` and each update slice must
/// fit inside `a` at its index by the time the result is evaluated.
pub unsafe fn scatter(a: &Array, indices: &Array, updates: &Array, axis: i32) -> Result<Array> {
    // SAFETY: the three inputs are live for the call; the indices are the caller's.
    Array::from_call(|out| unsafe { ffi::moat_scatter(a.raw(), indices.raw(), updates.raw(), axis, out) })
}

/// Like `scatter`, adding into `a`; duplicates accumulate.
///
/// # Safety
/// As for `scatter`.
pub unsafe fn scatter_add(a: &Array, indices: &Array, updates: &Array, axis: i32) -> Result<Array> {
    // SAFETY: the three inputs are live for the call; the indices are the caller's.
    Array::from_call(|out| unsafe { ffi::moat_scatter_add(a.raw(), indices.raw(), updates.raw(), axis, out) })
}

/// A slice of `sizes` along `axes` starting at the values of `start`.
pub fn slice_dynamic(a: &Array, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
    if axes.len() != sizes.len() {
        return Err(Error::new("slice_dynamic: one size per axis"));
    }
    // SAFETY: inputs are live; `axes` and `sizes` hold `axes.len()` elements.
    Array::from_call(|out| unsafe {
        ffi::moat_slice_dynamic(a.raw(), start.raw(), axes.as_ptr(), sizes.as_ptr(), axes.len(), out)
    })
}

/// `src` with `update` written at the values of `start` along `axes`.
pub fn slice_update_dynamic(src: &Array, update: &Array, start: &Array, axes: &[i32]) -> Result<Array> {
    // SAFETY: inputs are live; `axes` holds `axes.len()` elements.
    Array::from_call(|out| unsafe {
        ffi::moat_slice_update_dynamic(src.raw(), update.raw(), start.raw(), axes.as_ptr(), axes.len(), out)
    })
}
