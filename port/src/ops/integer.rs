//! Integer division and bit counting with Nx's semantics.
//!
//! Nx's `quotient` truncates toward zero and `remainder` takes the sign of
//! the dividend; MLX floors and takes the sign of the divisor, so both are
//! corrected here. MLX's integer division traps (SIGFPE) on `MIN / -1`, so a
//! divisor of -1 never reaches it: `x / -1` is `-x` (wrapping, as Nx writes
//! the out-of-range result) and `x rem -1` is 0. An integer divisor of zero
//! fails the op, as it raises in Nx.BinaryBackend (the divisor is evaluated,
//! within the memory limit, to check); float remainders by zero are NaN, as in IEEE 754.

use super::compose::unsigned;
use super::convert::int_scalar;
use super::{finish, to_out_type, Outputs};
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

pub fn quotient(x: &[&Array], a: &Term) -> Outputs {
    let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let dtype = l.dtype();
    if !dtype.is_integer() {
        return Err(format!("quotient needs integer types, got {:?}", dtype.nx()));
    }
    check_divisor(&r)?;
    if !dtype.is_signed() {
        return finish(ops::floor_divide(&l, &r), a);
    }
    let zero = int_scalar(0, dtype)?;
    let (divisor, minus_one) = without_minus_one(&r)?;
    let floor = ops::floor_divide(&l, &divisor)?;
    // Floor and truncation differ by one when the division is inexact and
    // the operands' signs differ.
    let inexact = ops::not_equal(&ops::remainder(&l, &divisor)?, &zero)?;
    let signs_differ = ops::not_equal(&ops::less(&l, &zero)?, &ops::less(&divisor, &zero)?)?;
    let correction = ops::astype(&ops::logical_and(&inexact, &signs_differ)?, dtype)?;
    let truncated = ops::add(&floor, &correction)?;
    finish(ops::where_(&minus_one, &ops::negative(&l)?, &truncated), a)
}

pub fn remainder(x: &[&Array], a: &Term) -> Outputs {
    let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let dtype = l.dtype();
    if dtype == Dtype::C64 {
        return Err("remainder is not defined for complex numbers".into());
    }
    if dtype.is_float() {
        return finish(float_remainder(&l, &r), a);
    }
    check_divisor(&r)?;
    if !dtype.is_signed() {
        return finish(ops::remainder(&l, &r), a);
    }
    let zero = int_scalar(0, dtype)?;
    let (divisor, minus_one) = without_minus_one(&r)?;
    let floored = ops::remainder(&l, &divisor)?;
    // MLX's result has the divisor's sign; Nx's has the dividend's.
    let nonzero = ops::not_equal(&floored, &zero)?;
    let wrong_sign = ops::not_equal(&ops::less(&floored, &zero)?, &ops::less(&l, &zero)?)?;
    let fix = ops::logical_and(&nonzero, &wrong_sign)?;
    let truncated = ops::where_(&fix, &ops::subtract(&floored, &divisor)?, &floored)?;
    finish(ops::where_(&minus_one, &zero, &truncated), a)
}

/// The divisor with its -1s replaced by 1 (MLX traps on `MIN / -1`), and
/// where they were, for the caller to put its own result there.
fn without_minus_one(r: &Array) -> Result<(Array, Array)> {
    let minus_one = ops::equal(r, &int_scalar(-1, r.dtype())?)?;
    let divisor = ops::where_(&minus_one, &int_scalar(1, r.dtype())?, r)?;
    Ok((divisor, minus_one))
}

/// Fails when an integer divisor holds a zero (MLX would return 0 or the
/// dividend).
fn check_divisor(divisor: &Array) -> std::result::Result<(), String> {
    let all: Vec<i32> = (0..divisor.shape().len() as i32).collect();
    let zero = ops::any(&ops::equal(divisor, &int_scalar(0, divisor.dtype())?)?, &all, false)?;
    match crate::budget::read::<u8>(&ops::astype(&zero, Dtype::U8)?)?[..] {
        [0] => Ok(()),
        _ => Err("division by zero".into()),
    }
}

/// C's fmod, exactly: `fmod(a, b) = sign(a) * fmod(|a|, |b|)`, and on
/// non-negative operands MLX's floored remainder is fmod.
fn float_remainder(l: &Array, r: &Array) -> Result<Array> {
    let magnitude = ops::remainder(&abs(l)?, &abs(r)?)?;
    let negative = ops::less(l, &ops::astype(&Array::scalar(0.0f64)?, l.dtype())?)?;
    ops::where_(&negative, &ops::negative(&magnitude)?, &magnitude)
}

/// `|x|` that keeps the sign of a zero (fmod's result takes the dividend's).
fn abs(x: &Array) -> Result<Array> {
    let zero = ops::astype(&Array::scalar(0.0f64)?, x.dtype())?;
    ops::where_(&ops::less(x, &zero)?, &ops::negative(x)?, x)
}

pub fn population_count(x: &[&Array], a: &Term) -> Outputs {
    let dtype = x[0].dtype();
    if !dtype.is_integer() {
        return Err(format!("population_count needs an integer type, got {:?}", dtype.nx()));
    }
    let bits = ops::view(x[0], unsigned(dtype))?;
    finish(ops::astype(&popcount(&bits)?, dtype), a)
}

pub fn count_leading_zeros(x: &[&Array], a: &Term) -> Outputs {
    let dtype = x[0].dtype();
    if !dtype.is_integer() {
        return Err(format!(
            "count_leading_zeros needs an integer type, got {:?}",
            dtype.nx()
        ));
    }
    let u = unsigned(dtype);
    let width = (u.size() * 8) as u64;
    // Smear the highest set bit downwards; the leading zeros are then the
    // bits still clear.
    let mut v = ops::view(x[0], u)?;
    let mut shift = 1;
    while shift < width {
        v = ops::bitwise_or(&v, &ops::right_shift(&v, &int_scalar(shift, u)?)?)?;
        shift *= 2;
    }
    let zeros = ops::subtract(&int_scalar(width, u)?, &popcount(&v)?)?;
    finish(ops::astype(&zeros, dtype), a)
}

/// Bits set in each element of an unsigned array (SWAR, in the array's type).
fn popcount(v: &Array) -> Result<Array> {
    let u = v.dtype();
    let width = u.size() * 8;
    let c = |bits: u64| int_scalar(bits, u);
    let mask = |byte: u64| c(u64::from_le_bytes([byte as u8; 8]));
    let shr = |x: &Array, n: u64| ops::right_shift(x, &c(n)?);
    let v = ops::subtract(v, &ops::bitwise_and(&shr(v, 1)?, &mask(0x55)?)?)?;
    let v = ops::add(
        &ops::bitwise_and(&v, &mask(0x33)?)?,
        &ops::bitwise_and(&shr(&v, 2)?, &mask(0x33)?)?,
    )?;
    let v = ops::bitwise_and(&ops::add(&v, &shr(&v, 4)?)?, &mask(0x0f)?)?;
    if width == 8 {
        return Ok(v);
    }
    // Sum the bytes into the top byte, then bring it down.
    let summed = ops::multiply(&v, &mask(0x01)?)?;
    shr(&summed, width as u64 - 8)
}
