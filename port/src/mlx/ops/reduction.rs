use crate::mlx::{ffi, Array, Result};

pub fn sum(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
    // SAFETY: `a` is live; `axes` is valid for `axes.len()` elements.
    Array::from_call(|out| unsafe { ffi::moat_sum(a.raw(), axes.as_ptr(), axes.len(), keepdims as i32, out) })
}
