use crate::mlx::{ffi, Array, Dtype, Error, Result};

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

/// Reinterprets the bytes as another type of the same width.
pub fn view(a: &Array, dtype: Dtype) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_view(a.raw(), dtype.code(), out) })
}

pub fn transpose(a: &Array, axes: &[i32]) -> Result<Array> {
    // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_transpose(a.raw(), axes.as_ptr(), axes.len(), out) })
}

pub fn flip(a: &Array, axes: &[i32]) -> Result<Array> {
    // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_flip(a.raw(), axes.as_ptr(), axes.len(), out) })
}

/// `start`, `stop` and `strides` have one entry per axis.
pub fn slice(a: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
    let n = start.len();
    if stop.len() != n || strides.len() != n {
        return Err(Error::new("slice: start, stop and strides differ in length"));
    }
    // SAFETY: `a` is live; the three slices are valid for `n` elements.
    Array::from_call(|out| unsafe { ffi::moat_slice(a.raw(), start.as_ptr(), stop.as_ptr(), strides.as_ptr(), n, out) })
}

/// `src` with the strided box `start..stop` replaced by `update`.
pub fn slice_update(src: &Array, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
    let n = start.len();
    if stop.len() != n || strides.len() != n {
        return Err(Error::new("slice_update: start, stop and strides differ in length"));
    }
    // SAFETY: both arrays are live; the three slices are valid for `n` elements.
    Array::from_call(|out| unsafe {
        ffi::moat_slice_update(
            src.raw(),
            update.raw(),
            start.as_ptr(),
            stop.as_ptr(),
            strides.as_ptr(),
            n,
            out,
        )
    })
}

pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let raw: Vec<*const ffi::moat_array> = arrays.iter().map(|a| a.raw() as *const _).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    Array::from_call(|out| unsafe { ffi::moat_concatenate(raw.as_ptr(), raw.len(), axis, out) })
}

pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let raw: Vec<*const ffi::moat_array> = arrays.iter().map(|a| a.raw() as *const _).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    Array::from_call(|out| unsafe { ffi::moat_stack(raw.as_ptr(), raw.len(), axis, out) })
}

/// `a` where `cond` holds, else `b` (broadcasting).
pub fn where_(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    // SAFETY: the three arrays are live for the call.
    Array::from_call(|out| unsafe { ffi::moat_where(cond.raw(), a.raw(), b.raw(), out) })
}

pub fn pad(a: &Array, low: &[i32], high: &[i32], value: &Array) -> Result<Array> {
    if low.len() != high.len() {
        return Err(Error::new("pad: low and high differ in length"));
    }
    // SAFETY: `a` and `value` are live; `low` and `high` hold `low.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_pad(a.raw(), low.as_ptr(), high.as_ptr(), low.len(), value.raw(), out) })
}

/// A view of `a`'s buffer with the given shape and element strides.
///
/// # Safety
/// `a` must be row-contiguous and every element the view addresses must lie
/// inside its buffer: MLX reads the view without checking it.
pub unsafe fn as_strided(a: &Array, shape: &[i32], strides: &[i64], offset: usize) -> Result<Array> {
    if shape.len() != strides.len() {
        return Err(Error::new("as_strided: shape and strides differ in length"));
    }
    // SAFETY: `a` is live; `shape` and `strides` hold `shape.len()` elements;
    // the view fits (the caller's part).
    Array::from_call(|out| unsafe {
        ffi::moat_as_strided(a.raw(), shape.as_ptr(), strides.as_ptr(), shape.len(), offset, out)
    })
}

pub fn tril(a: &Array, k: i32) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_tril(a.raw(), k, out) })
}

/// The `offset` diagonal of the matrices spanned by `axis1` and `axis2`,
/// as a new last axis.
pub fn diagonal(a: &Array, offset: i32, axis1: i32, axis2: i32) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_diagonal(a.raw(), offset, axis1, axis2, out) })
}
