//! Small MLX compositions shared by builders.

use crate::mlx::{ops, Array, Dtype, Result};

/// A scalar of `dtype` holding the integer `v` (MLX promotes mixed types, so
/// constants must have the exact type of the array they meet).
pub fn int_const(v: i64, dtype: Dtype) -> Result<Array> {
    ops::astype(&Array::scalar(v)?, dtype)
}

/// A scalar of `dtype` holding the bit pattern `v` (for unsigned masks).
pub fn bits_const(v: u64, dtype: Dtype) -> Result<Array> {
    ops::astype(&Array::scalar(v)?, dtype)
}

/// A scalar of `dtype` holding the float `v`.
pub fn float_const(v: f64, dtype: Dtype) -> Result<Array> {
    ops::astype(&Array::scalar(v)?, dtype)
}

/// The permutation that undoes `perm`.
pub fn inverse(perm: &[i32]) -> Vec<i32> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p as usize] = i as i32;
    }
    inv
}

/// The unsigned type of the same width as an integer type.
pub fn unsigned(dtype: Dtype) -> Dtype {
    match dtype {
        Dtype::S8 => Dtype::U8,
        Dtype::S16 => Dtype::U16,
        Dtype::S32 => Dtype::U32,
        Dtype::S64 => Dtype::U64,
        other => other,
    }
}

pub fn is_signed(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::S8 | Dtype::S16 | Dtype::S32 | Dtype::S64)
}

pub fn is_integer(dtype: Dtype) -> bool {
    !dtype.is_float() && dtype != Dtype::Bool
}

/// Product of dimensions, without overflow.
pub fn count(shape: &[i32]) -> i64 {
    shape.iter().map(|&d| d as i64).product()
}

/// `x` with a new axis of size 1 at `axis` (negative: counted from the end
/// of the result, so -1 appends).
pub fn expand(x: &Array, axis: i32) -> Result<Array> {
    let mut shape = x.shape();
    let at = if axis < 0 { shape.len() as i32 + 1 + axis } else { axis };
    shape.insert(at as usize, 1);
    ops::reshape(x, &shape)
}

/// `x` without its size-1 axis `axis` (negative: from the end).
pub fn squeeze(x: &Array, axis: i32) -> Result<Array> {
    let mut shape = x.shape();
    let at = if axis < 0 { shape.len() as i32 + axis } else { axis };
    shape.remove(at as usize);
    ops::reshape(x, &shape)
}

/// Each matrix transposed: the last two axes swapped.
pub fn swap_last(x: &Array) -> Result<Array> {
    let rank = x.shape().len() as i32;
    let mut perm: Vec<i32> = (0..rank).collect();
    perm.swap(rank as usize - 2, rank as usize - 1);
    ops::transpose(x, &perm)
}
