//! Small MLX compositions shared by builders.

use crate::mlx::{ops, Array, Dtype, Error, Result};

/// The permutation that undoes `perm` (a permutation of `0..perm.len()`).
pub fn inverse(perm: &[i32]) -> Result<Vec<i32>> {
    let mut inv = vec![-1; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        match usize::try_from(p).ok().and_then(|p| inv.get_mut(p)) {
            Some(slot) if *slot < 0 => *slot = i as i32,
            _ => return Err(Error::new(format!("{perm:?} is not a permutation"))),
        }
    }
    Ok(inv)
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

/// Product of dimensions, saturating at `i64::MAX`.
pub fn count(shape: &[i32]) -> i64 {
    shape.iter().fold(1i64, |n, &d| n.saturating_mul(d as i64))
}

/// `axis` (negative: counted from the end) as an index below `len`.
fn position(axis: i32, len: usize) -> Result<usize> {
    let at = if axis < 0 {
        len as i64 + axis as i64
    } else {
        axis as i64
    };
    usize::try_from(at)
        .ok()
        .filter(|&i| i < len)
        .ok_or_else(|| Error::new(format!("axis {axis} is out of range for {len} positions")))
}

/// `x` with a new axis of size 1 at `axis` (negative: counted from the end
/// of the result, so -1 appends).
pub fn expand(x: &Array, axis: i32) -> Result<Array> {
    let mut shape = x.shape();
    shape.insert(position(axis, shape.len() + 1)?, 1);
    ops::reshape(x, &shape)
}

/// `x` without its size-1 axis `axis` (negative: from the end).
pub fn squeeze(x: &Array, axis: i32) -> Result<Array> {
    let mut shape = x.shape();
    let at = position(axis, shape.len())?;
    if shape[at] != 1 {
        return Err(Error::new(format!("axis {axis} of shape {shape:?} is not of size 1")));
    }
    shape.remove(at);
    ops::reshape(x, &shape)
}

/// Each matrix transposed: the last two axes swapped.
pub fn swap_last(x: &Array) -> Result<Array> {
    let rank = x.shape().len();
    if rank < 2 {
        return Err(Error::new(format!("expected a matrix, got a tensor of rank {rank}")));
    }
    let mut perm: Vec<i32> = (0..rank as i32).collect();
    perm.swap(rank - 2, rank - 1);
    ops::transpose(x, &perm)
}

/// `re + im * i` as c64, built from the two f32 halves side by side (not
/// `re + im * i` in complex arithmetic, which turns an infinite part into
/// NaN + inf i). Both parts have the same shape.
pub fn complex(re: &Array, im: &Array) -> Result<Array> {
    let (re, im) = (ops::astype(re, Dtype::F32)?, ops::astype(im, Dtype::F32)?);
    let shape = re.shape();
    let pairs = ops::contiguous(&ops::stack(&[&re, &im], -1)?)?;
    ops::reshape(&ops::view(&pairs, Dtype::C64)?, &shape)
}
