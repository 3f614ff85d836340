//! Element-wise ops with MLX broadcasting. Arithmetic converts its inputs to
//! the output type first, as Nx does; comparisons convert both sides to the
//! merged input type (attr `input_type`) and yield u8. f32, f16 and bf16
//! transcendentals go to the shim's vectorized CPU kernels (`kernels`).

use super::compose::complex;
use super::convert::{bits, float_scalar, int_scalar, nonzero, zero, zeros_like};
use super::{attrs, finish, nx_complex, precise, to_out_type, Outputs};
use crate::mlx::kernels::{self, Op};
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

/// `fn name(inputs, attrs)`: both inputs to the output type, then the MLX op.
macro_rules! arithmetic {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
            finish(ops::$mlx(&l, &r), a)
        }
    )*};
}

arithmetic! {
    add => add,
    subtract => subtract,
    multiply => multiply,
    divide => divide,
    min => minimum,
    max => maximum,
    bitwise_and => bitwise_and,
    bitwise_or => bitwise_or,
    bitwise_xor => bitwise_xor,
}

/// `fn name(inputs, attrs)`: both sides in `input_type`, compared.
macro_rules! comparison {
    ($($name:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let t = attrs::dtype(attrs::field(a, "input_type")?)?;
            let in_type = |x: &Array| if x.dtype() == t { x.share() } else { ops::astype(x, t) };
            finish(in_type(x[0]).and_then(|l| ops::$name(&l, &in_type(x[1])?)), a)
        }
    )*};
}

comparison!(equal, not_equal, greater, less, greater_equal, less_equal);

/// `fn name(inputs, attrs)`: both sides tested for non-zero, then combined.
macro_rules! logical {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            finish(nonzero(x[0]).and_then(|l| ops::$mlx(&l, &nonzero(x[1])?)), a)
        }
    )*};
}

logical! {
    logical_and => logical_and,
    logical_or => logical_or,
    logical_xor => not_equal,
}

/// `fn name(inputs, attrs)`: the input to the output type, then the MLX op.
macro_rules! unary {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            finish(ops::$mlx(&to_out_type(x[0], a)?), a)
        }
    )*};
}

unary! {
    bitwise_not => bitwise_invert,
    conjugate => conjugate,
}

/// `fn name(inputs, attrs)`: like `unary!`, but c64 as Nx computes it
/// (`nx_complex`), where MLX's complex kernels follow C99.
macro_rules! unary_nx_complex {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let t = to_out_type(x[0], a)?;
            if t.dtype().is_complex() {
                return finish(nx_complex::unary(stringify!($name), &t), a);
            }
            finish(ops::$mlx(&t), a)
        }
    )*};
}

unary_nx_complex! {
    tan => tan,
    cosh => cosh,
    sinh => sinh,
    sqrt => sqrt,
    acos => arccos,
    asin => arcsin,
    atan => arctan,
    acosh => arccosh,
    asinh => arcsinh,
    atanh => arctanh,
}

/// Whether the shim's CPU kernels compute this type.
fn kernel_type(t: Dtype) -> bool {
    matches!(t, Dtype::F32 | Dtype::F16 | Dtype::Bf16)
}

/// `fn name(inputs, attrs)`: the input to the output type, then the shim's
/// kernel for f32/f16/bf16, the exact rebuild (`precise`) for f64 where MLX
/// computes f64 in single precision, and MLX's op for the rest (complex).
macro_rules! kernel {
    ($($name:ident => $op:ident, f64: $f64:path, else: $mlx:path);* $(;)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let t = to_out_type(x[0], a)?;
            let out = match t.dtype() {
                d if kernel_type(d) => kernels::unary(Op::$op, &t),
                Dtype::F64 => $f64(&t),
                _ => $mlx(&t),
            };
            finish(out, a)
        }
    )*};
}

kernel! {
    exp => Exp, f64: precise::exp, else: exp_other;
    sigmoid => Sigmoid, f64: precise::sigmoid, else: sigmoid_other;
    cos => Cos, f64: precise::cos, else: cos_other;
    sin => Sin, f64: precise::sin, else: sin_other;
    erf => Erf, f64: precise::erf, else: ops::erf;
    erfc => Erfc, f64: precise::erfc, else: erfc_in_f64;
    expm1 => Expm1, f64: ops::expm1, else: expm1_other;
    log => Log, f64: ops::log, else: log_other;
    log1p => Log1p, f64: ops::log1p, else: ops::log1p;
    tanh => Tanh, f64: ops::tanh, else: tanh_other;
    rsqrt => Rsqrt, f64: ops::rsqrt, else: rsqrt_other;
}

/// `fn name(t)`: the kernel macro's fallback for the other types: complex
/// as Nx computes it (`nx_complex`), the rest with MLX's op.
macro_rules! complex_as_nx {
    ($($name:ident => $nx:literal, $mlx:path);* $(;)?) => {$(
        fn $name(t: &Array) -> Result<Array> {
            if t.dtype().is_complex() {
                return nx_complex::unary($nx, t);
            }
            $mlx(t)
        }
    )*};
}

complex_as_nx! {
    exp_other => "exp", ops::exp;
    log_other => "log", ops::log;
    tanh_other => "tanh", ops::tanh;
    sigmoid_other => "sigmoid", ops::sigmoid;
    sin_other => "sin", ops::sin;
    cos_other => "cos", ops::cos;
    rsqrt_other => "rsqrt", ops::rsqrt;
}

/// f64 has an exact erfc (`1 - erf` would lose the small values).
fn erfc_in_f64(t: &Array) -> Result<Array> {
    ops::astype(t, Dtype::F64).and_then(|wide| precise::erfc(&wide))
}

/// `fn name(inputs, attrs)`: like `unary!`, but f64 goes through `precise`
/// (MLX computes these in single precision).
macro_rules! unary_f64_precise {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let t = to_out_type(x[0], a)?;
            if t.dtype() == Dtype::F64 {
                return finish(precise::$name(&t), a);
            }
            finish(ops::$mlx(&t), a)
        }
    )*};
}

unary_f64_precise! {
    erf_inv => erfinv,
}

/// `fn name(inputs, attrs)`: the MLX op on the input as it is (the output
/// type differs: complex abs is real, predicates are u8).
macro_rules! own_type {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            finish(ops::$mlx(x[0]), a)
        }
    )*};
}

own_type! {
    abs => abs,
    is_nan => isnan,
    is_infinity => isinf,
}

/// `fn name(inputs, attrs)`: an op that leaves integers as they are.
macro_rules! float_only {
    ($($name:ident => $f:expr),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let t = to_out_type(x[0], a)?;
            if t.dtype().is_integer() {
                return finish(Ok(t), a);
            }
            finish($f(&t), a)
        }
    )*};
}

float_only! {
    ceil => ops::ceil,
    floor => ops::floor,
    round => round_half_away,
}

/// Nx rounds half away from zero (MLX rounds half to even):
/// `trunc(x)`, moved one away from zero when the dropped part is >= 0.5.
fn round_half_away(x: &Array) -> Result<Array> {
    let t = ops::trunc(x)?;
    let dropped = ops::abs(&ops::subtract(x, &t)?)?;
    let half = ops::greater_equal(&dropped, &float_scalar(0.5, x.dtype())?)?;
    ops::where_(&half, &ops::add(&t, &ops::sign(x)?)?, &t)
}

/// The sign, NaN for NaN (MLX gives 0).
pub fn sign(x: &[&Array], a: &Term) -> Outputs {
    let t = to_out_type(x[0], a)?;
    if !t.dtype().is_float() {
        return finish(ops::sign(&t), a);
    }
    finish(ops::isnan(&t).and_then(|nan| ops::where_(&nan, &t, &ops::sign(&t)?)), a)
}

pub fn negate(x: &[&Array], a: &Term) -> Outputs {
    let t = to_out_type(x[0], a)?;
    if t.dtype().is_unsigned() {
        // Wraps like Nx: -x mod 2^bits.
        return finish(zero(t.dtype()).and_then(|z| ops::subtract(&z, &t)), a);
    }
    finish(ops::negative(&t), a)
}

pub fn real(x: &[&Array], a: &Term) -> Outputs {
    if x[0].dtype().is_complex() {
        return finish(ops::real(x[0]), a);
    }
    finish(x[0].share(), a)
}

pub fn imag(x: &[&Array], a: &Term) -> Outputs {
    if x[0].dtype().is_complex() {
        return finish(ops::imag(x[0]), a);
    }
    finish(zeros_like(x[0]), a)
}

/// The real cube root, computed in f64 with one Newton step so that exact
/// cubes come out exact; complex roots as Nx takes them, the real root of
/// the modulus at a third of the phase.
pub fn cbrt(x: &[&Array], a: &Term) -> Outputs {
    let t = to_out_type(x[0], a)?;
    if t.dtype().is_complex() {
        let polar = || -> Result<Array> {
            let r = ops::astype(&real_cbrt(&ops::abs(&t)?)?, Dtype::F32)?;
            let third = ops::divide(&phase_of(&t)?, &float_scalar(3.0, Dtype::F32)?)?;
            complex(&scale(&r, &ops::cos(&third)?)?, &scale(&r, &ops::sin(&third)?)?)
        };
        return finish(polar(), a);
    }
    finish(real_cbrt(&t), a)
}

/// The cube root of a real tensor, as f64.
fn real_cbrt(t: &Array) -> Result<Array> {
    let x = ops::astype(t, Dtype::F64)?;
    let third = float_scalar(1.0 / 3.0, Dtype::F64)?;
    let y = ops::multiply(&ops::sign(&x)?, &ops::power(&ops::abs(&x)?, &third)?)?;
    let y2 = ops::multiply(&y, &y)?;
    let step = ops::divide(
        &ops::subtract(&ops::multiply(&y2, &y)?, &x)?,
        &ops::multiply(&y2, &float_scalar(3.0, Dtype::F64)?)?,
    )?;
    let keep = ops::logical_or(&ops::equal(&y, &zero(Dtype::F64)?)?, &ops::isinf(&y)?)?;
    ops::where_(&keep, &y, &ops::subtract(&y, &step)?)
}

/// `r * s`, with an exact zero `s` kept (its limit, where `r` is infinite:
/// the imaginary part of `inf * e^0i` is 0, not NaN).
fn scale(r: &Array, s: &Array) -> Result<Array> {
    ops::where_(&ops::equal(s, &zero(s.dtype())?)?, s, &ops::multiply(r, s)?)
}

fn phase_of(z: &Array) -> Result<Array> {
    kernels::atan2(&ops::imag(z)?, &ops::real(z)?)
}

// MLX has no complex kernel for expm1 or atan2: they are composed from real
// ops.

/// `e^z - 1`; for complex z = x + yi, `expm1(x) cos y - 2 sin^2(y/2)` +
/// `e^x sin y` i, which keeps the digits of a result near 0.
fn expm1_other(t: &Array) -> Result<Array> {
    if !t.dtype().is_complex() {
        return ops::expm1(t);
    }
    let (re, im) = (ops::real(t)?, ops::imag(t)?);
    let half_sin = ops::sin(&ops::multiply(&im, &float_scalar(0.5, Dtype::F32)?)?)?;
    let versine = ops::multiply(&ops::multiply(&half_sin, &half_sin)?, &float_scalar(2.0, Dtype::F32)?)?;
    let real = ops::subtract(&scale(&ops::expm1(&re)?, &ops::cos(&im)?)?, &versine)?;
    complex(&real, &scale(&ops::exp(&re)?, &ops::sin(&im)?)?)
}

/// Complex atan2 takes real values only, as Nx's (Complex.atan2 raises on a
/// non-zero imaginary part; the op fails instead, after evaluating the
/// imaginary parts to check).
pub fn atan2(x: &[&Array], a: &Term) -> Outputs {
    let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    if !l.dtype().is_complex() {
        return finish(kernels::atan2(&l, &r), a);
    }
    for side in [&l, &r] {
        let im = ops::imag(side)?;
        let all: Vec<i32> = (0..im.shape().len() as i32).collect();
        let any = ops::any(&nonzero(&im)?, &all, false)?;
        if crate::budget::read::<u8>(&ops::astype(&any, Dtype::U8)?)? != [0] {
            return Err("atan2 accepts complex numbers with a zero imaginary part only".into());
        }
    }
    let angle = kernels::atan2(&ops::real(&l)?, &ops::real(&r)?)?;
    finish(complex(&angle, &zeros_like(&angle)?), a)
}

/// Integer powers wrap like Nx; a negative exponent (which Nx refuses) gives
/// the truncated result: 1 for base 1, +-1 for base -1, else 0.
pub fn pow(x: &[&Array], a: &Term) -> Outputs {
    let (base, exp) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let t = base.dtype();
    if kernel_type(t) {
        return finish(kernels::power(&base, &exp), a);
    }
    if t.is_complex() {
        return finish(nx_complex::pow(&base, &exp), a);
    }
    if !t.is_integer() || t.is_unsigned() {
        return finish(ops::power(&base, &exp), a);
    }
    let compute = || -> Result<Array> {
        let negative = ops::less(&exp, &zero(t)?)?;
        let safe_exp = ops::where_(&negative, &zero(t)?, &exp)?;
        let power = ops::power(&base, &safe_exp)?;
        let (one, minus_one) = (int_scalar(1, t)?, int_scalar(-1, t)?);
        let odd = ops::not_equal(&ops::bitwise_and(&exp, &one)?, &zero(t)?)?;
        let of_minus_one = ops::where_(&odd, &minus_one, &one)?;
        let inverse = ops::where_(
            &ops::equal(&base, &one)?,
            &one,
            &ops::where_(&ops::equal(&base, &minus_one)?, &of_minus_one, &zero(t)?)?,
        )?;
        ops::where_(&negative, &inverse, &power)
    };
    finish(compute(), a)
}

/// Shifts by `bits` or more (or by a negative amount) shift everything out,
/// as Nx's arbitrary-precision shifts do, instead of C++'s undefined result.
pub fn left_shift(x: &[&Array], a: &Term) -> Outputs {
    let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let compute = || -> Result<Array> {
        let (out_of_range, amount) = shift_amount(&r)?;
        ops::where_(&out_of_range, &zero(l.dtype())?, &ops::left_shift(&l, &amount)?)
    };
    finish(compute(), a)
}

/// Arithmetic shift for signed types (an oversized shift leaves the sign),
/// logical for unsigned ones.
pub fn right_shift(x: &[&Array], a: &Term) -> Outputs {
    let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let t = l.dtype();
    let compute = || -> Result<Array> {
        let (out_of_range, amount) = shift_amount(&r)?;
        let shifted_out = if t.is_unsigned() {
            zero(t)?
        } else {
            ops::right_shift(&l, &int_scalar(bits(t) as i128 - 1, t)?)?
        };
        ops::where_(&out_of_range, &shifted_out, &ops::right_shift(&l, &amount)?)
    };
    finish(compute(), a)
}

/// Whether each shift amount is outside `0..bits`, and the amount with
/// those entries replaced by 0.
fn shift_amount(r: &Array) -> Result<(Array, Array)> {
    let t = r.dtype();
    let too_big = ops::greater_equal(r, &int_scalar(bits(t) as i128, t)?)?;
    let out_of_range = ops::logical_or(&too_big, &ops::less(r, &zero(t)?)?)?;
    let amount = ops::where_(&out_of_range, &zero(t)?, r)?;
    Ok((out_of_range, amount))
}

/// Nx.Block.LogicalNot: `x == 0` as u8.
pub fn logical_not(x: &[&Array], a: &Term) -> Outputs {
    finish(zero(x[0].dtype()).and_then(|z| ops::equal(x[0], &z)), a)
}

/// Nx.Block.Phase: `atan2(imag, real)`; 0 or pi for real inputs.
pub fn phase(x: &[&Array], a: &Term) -> Outputs {
    if x[0].dtype().is_complex() {
        return finish(ops::imag(x[0]).and_then(|im| kernels::atan2(&im, &ops::real(x[0])?)), a);
    }
    let t = to_out_type(x[0], a)?;
    finish(zeros_like(&t).and_then(|z| kernels::atan2(&z, &t)), a)
}
