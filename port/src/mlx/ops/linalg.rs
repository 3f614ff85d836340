//! Matrix products and decompositions (decompositions run on the CPU stream).

use super::binary;
use crate::mlx::{ffi, Array, Result};
use std::ptr;

binary! {
    matmul => moat_matmul,
    solve => moat_solve,
}

/// `x {M, K} . w^T` for `w {N, K}` (or `x . w` for `w {K, N}` when
/// `transposed`), one float type, accumulated in f32; one pass over `w` on
/// the CPU for M <= 16.
pub fn matvec(x: &Array, w: &Array, transposed: bool) -> Result<Array> {
    // SAFETY: both inputs are live arrays borrowed for the call.
    Array::from_call(|out| unsafe { ffi::moat_matvec(x.raw(), w.raw(), transposed.into(), out) })
}

/// Runs a shim call that fills `N` outputs.
fn factors<const N: usize>(f: impl FnOnce(*mut *mut ffi::moat_array) -> std::os::raw::c_int) -> Result<[Array; N]> {
    let mut raw = [ptr::null_mut(); N];
    crate::mlx::check(f(raw.as_mut_ptr()))?;
    let arrays: Vec<Array> = raw.into_iter().map(Array::adopt).collect::<Result<_>>()?;
    Ok(arrays.try_into().unwrap_or_else(|_| unreachable!("N arrays")))
}

/// `[q, r]`, reduced: q is m x k, r is k x n with k = min(m, n).
pub fn qr(a: &Array) -> Result<[Array; 2]> {
    // SAFETY: `a` is live; the shim writes exactly 2 outputs.
    factors(|outs| unsafe { ffi::moat_qr(a.raw(), outs) })
}

/// `[u, s, vt]` with full u and vt.
pub fn svd(a: &Array) -> Result<[Array; 3]> {
    // SAFETY: `a` is live; the shim writes exactly 3 outputs.
    factors(|outs| unsafe { ffi::moat_svd(a.raw(), outs) })
}

/// `[eigenvalues (ascending), eigenvectors (columns)]` from the lower triangle.
pub fn eigh(a: &Array) -> Result<[Array; 2]> {
    // SAFETY: `a` is live; the shim writes exactly 2 outputs.
    factors(|outs| unsafe { ffi::moat_eigh(a.raw(), outs) })
}

/// `[pivots, l, u]` with `a[pivots] = l @ u`.
pub fn lu(a: &Array) -> Result<[Array; 3]> {
    // SAFETY: `a` is live; the shim writes exactly 3 outputs.
    factors(|outs| unsafe { ffi::moat_lu(a.raw(), outs) })
}

pub fn cholesky(a: &Array, upper: bool) -> Result<Array> {
    // SAFETY: `a` is live for the call.
    Array::from_call(|out| unsafe { ffi::moat_cholesky(a.raw(), upper as i32, out) })
}

pub fn solve_triangular(a: &Array, b: &Array, upper: bool) -> Result<Array> {
    // SAFETY: both inputs are live for the call.
    Array::from_call(|out| unsafe { ffi::moat_solve_triangular(a.raw(), b.raw(), upper as i32, out) })
}
