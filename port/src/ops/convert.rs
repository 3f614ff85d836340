//! Nx's type rules in MLX terms: which kind a dtype is, its bounds, scalar
//! constants, and `cast`, which converts the way `Nx.as_type/2` does.

use crate::mlx::{ops, Array, Dtype, Result};

pub fn bits(d: Dtype) -> i64 {
    8 * d.size() as i64
}

/// The smallest and largest value of an integer dtype.
pub fn int_bounds(d: Dtype) -> (i128, i128) {
    let bits = bits(d) as u32;
    if d.is_unsigned() {
        (0, (1i128 << bits) - 1)
    } else {
        (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
    }
}

/// A 0-d array of `dtype` holding the integer `v` (wrapped to the type).
pub fn int_scalar(v: impl Into<i128>, dtype: Dtype) -> Result<Array> {
    let v: i128 = v.into();
    let s = if v > i64::MAX as i128 {
        ops::scalar_u64(v as u64)?
    } else {
        ops::scalar_i64(v as i64)?
    };
    retype(s, dtype)
}

/// A 0-d array of `dtype` holding `v`.
pub fn float_scalar(v: f64, dtype: Dtype) -> Result<Array> {
    retype(ops::scalar_f64(v)?, dtype)
}

pub fn zero(dtype: Dtype) -> Result<Array> {
    int_scalar(0, dtype)
}

fn retype(a: Array, dtype: Dtype) -> Result<Array> {
    if a.dtype() == dtype {
        Ok(a)
    } else {
        ops::astype(&a, dtype)
    }
}

/// Zeros of `x`'s shape and type.
pub fn zeros_like(x: &Array) -> Result<Array> {
    ops::full(&x.shape(), &zero(x.dtype())?, x.dtype())
}

/// `x != 0`, as MLX booleans (Nx's truth test for every type).
pub fn nonzero(x: &Array) -> Result<Array> {
    ops::not_equal(x, &zero(x.dtype())?)
}

/// `x` as `to` with `Nx.as_type/2`'s semantics: complex to real keeps the
/// real part; float to integer truncates toward zero and wraps like Nx
/// (through s64), except NaN -> 0, +inf -> the type's max, -inf -> its min.
pub fn cast(x: &Array, to: Dtype) -> Result<Array> {
    let from = x.dtype();
    if from == to {
        return x.share();
    }
    if from.is_complex() && !to.is_complex() {
        return cast(&ops::real(x)?, to);
    }
    if !from.is_inexact() || to.is_inexact() {
        return ops::astype(x, to);
    }
    float_to_int(x, to)
}

fn float_to_int(x: &Array, to: Dtype) -> Result<Array> {
    let wrapped = ops::astype(&ops::astype(x, Dtype::S64)?, to)?;
    let converted = if to == Dtype::U64 {
        // Values in [2^63, 2^64) do not fit s64; MLX converts them directly.
        let big = ops::greater_equal(x, &float_scalar(9_223_372_036_854_775_808.0, x.dtype())?)?;
        ops::where_(&big, &ops::astype(x, to)?, &wrapped)?
    } else {
        wrapped
    };
    let (min, max) = int_bounds(to);
    let inf = ops::isinf(x)?;
    let positive = ops::greater(x, &zero(x.dtype())?)?;
    let bound = ops::where_(&positive, &int_scalar(max, to)?, &int_scalar(min, to)?)?;
    let with_inf = ops::where_(&inf, &bound, &converted)?;
    ops::where_(&ops::isnan(x)?, &zero(to)?, &with_inf)
}
