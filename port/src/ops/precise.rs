//! f64 versions of the functions whose MLX CPU kernels compute in single
//! precision even for float64 (exp, sigmoid, sin, cos, erf, erfinv; measured
//! up to 3e-4 relative error), built from MLX primitives that are exact to
//! an ulp in f64 (expm1, arithmetic, floor). Each stays within a few ulp of
//! a correctly rounded result.
//!
//! The constants come from mpmath at 60 digits: Taylor coefficients, pi/2
//! in three 33-bit parts (Cody-Waite), and Chebyshev series of
//! erfcx(x) = exp(x^2) * erfc(x) on [0.5, 2] and [2, 4].

use super::convert::float_scalar;
use crate::mlx::{ops, Array, Dtype, Result};
use std::f64::consts::{FRAC_2_PI, FRAC_2_SQRT_PI};

const PIO2_1: f64 = 1.5707963267341256;
const PIO2_2: f64 = 6.077100506303966e-11;
const PIO2_3: f64 = 2.0222662487959506e-21;
/// (-1)^n / (2n + 1)!, n = 1..9.
const SIN: [f64; 9] = [
    -0.16666666666666666,
    0.008333333333333333,
    -0.0001984126984126984,
    2.7557319223985893e-06,
    -2.505210838544172e-08,
    1.6059043836821613e-10,
    -7.647163731819816e-13,
    2.8114572543455206e-15,
    -8.22063524662433e-18,
];
/// (-1)^n / (2n)!, n = 2..10.
const COS: [f64; 9] = [
    0.041666666666666664,
    -0.001388888888888889,
    2.48015873015873e-05,
    -2.755731922398589e-07,
    2.08767569878681e-09,
    -1.1470745597729725e-11,
    4.779477332387385e-14,
    -1.5619206968586225e-16,
    4.110317623312165e-19,
];
/// erf(x) = x * sum(ERF_SMALL[n] * x^2n) for |x| < 0.5.
const ERF_SMALL: [f64; 13] = [
    FRAC_2_SQRT_PI,
    -0.37612638903183754,
    0.11283791670955126,
    -0.026866170645131252,
    0.005223977625442188,
    -0.0008548327023450853,
    0.00012055332981789664,
    -1.492565035840625e-05,
    1.6462114365889248e-06,
    -1.6365844691234924e-07,
    1.4807192815879218e-08,
    -1.2290555301717928e-09,
    9.422759064650411e-11,
];
/// Chebyshev series of erfcx on [0.5, 2].
const ERFCX_A: [f64; 20] = [
    0.4006822530639845,
    -0.17395587897748596,
    0.03383702540740585,
    -0.006032263577025819,
    0.001000274118215681,
    -0.0001558965252433288,
    2.3014442396758424e-05,
    -3.2375421924541957e-06,
    4.360702485858127e-07,
    -5.645684833789816e-08,
    7.048623263203286e-09,
    -8.509612327566787e-10,
    9.957554366871612e-11,
    -1.1316613855047192e-11,
    1.251336999292314e-12,
    -1.348367808531293e-13,
    1.4178345409698665e-14,
    -1.456695351723711e-15,
    1.463834413999447e-16,
    -1.4274639366304835e-17,
];
/// Chebyshev series of erfcx on [2, 4].
const ERFCX_B: [f64; 20] = [
    0.1874295690262241,
    -0.05794652883669097,
    0.008595247387396534,
    -0.0012284613640242594,
    0.00016974366686180488,
    -2.2738329337044562e-05,
    2.959844378804878e-06,
    -3.7513575581379714e-07,
    4.6372828761738244e-08,
    -5.599455392564088e-09,
    6.613160896679916e-10,
    -7.648271522199816e-11,
    8.670904325876594e-12,
    -9.645456274382024e-13,
    1.0536827959351312e-13,
    -1.1312630905748733e-14,
    1.1945180560527113e-15,
    -1.241309600232272e-16,
    1.270125629361294e-17,
    -1.2682476193385773e-18,
];
const FRAC_1_SQRT_PI: f64 = 0.5641895835477563;
/// Terms of erfc's continued fraction for x >= 4 (relative error < 1e-20).
const ERFC_CF_TERMS: u32 = 30;

fn k(v: f64) -> Result<Array> {
    float_scalar(v, Dtype::F64)
}

fn add_k(a: &Array, v: f64) -> Result<Array> {
    ops::add(a, &k(v)?)
}

fn mul_k(a: &Array, v: f64) -> Result<Array> {
    ops::multiply(a, &k(v)?)
}

fn less_k(a: &Array, v: f64) -> Result<Array> {
    ops::less(a, &k(v)?)
}

/// sum(c[i] * z^i) by Horner's rule.
fn horner(z: &Array, c: &[f64]) -> Result<Array> {
    let (last, rest) = c.split_last().expect("coefficients");
    let mut acc = k(*last)?;
    for ci in rest.iter().rev() {
        acc = add_k(&ops::multiply(&acc, z)?, *ci)?;
    }
    Ok(acc)
}

/// sum(c[i] * T_i(u)) by Clenshaw's recurrence.
fn clenshaw(u: &Array, c: &[f64]) -> Result<Array> {
    let two_u = mul_k(u, 2.0)?;
    let (mut b1, mut b2) = (k(0.0)?, k(0.0)?);
    for ci in c[1..].iter().rev() {
        let b = add_k(&ops::subtract(&ops::multiply(&two_u, &b1)?, &b2)?, *ci)?;
        b2 = b1;
        b1 = b;
    }
    add_k(&ops::subtract(&ops::multiply(u, &b1)?, &b2)?, c[0])
}

/// e^x from expm1, which MLX computes exactly in f64: e^|x| = expm1(|x|) + 1,
/// inverted for negative x.
pub fn exp(x: &Array) -> Result<Array> {
    let grown = add_k(&ops::expm1(&ops::abs(x)?)?, 1.0)?;
    let inverse = ops::divide(&k(1.0)?, &grown)?;
    ops::where_(&less_k(x, 0.0)?, &inverse, &grown)
}

/// 1 / (1 + e^-x), as Nx defines it.
pub fn sigmoid(x: &Array) -> Result<Array> {
    ops::divide(&k(1.0)?, &add_k(&exp(&ops::negative(x)?)?, 1.0)?)
}

/// sin and cos: x reduced by multiples of pi/2 (Cody-Waite, exact for
/// |x| < 2^19 pi), then Taylor polynomials on [-pi/4, pi/4] and the
/// quadrant's sign and swap.
fn sin_cos(x: &Array) -> Result<(Array, Array)> {
    let n = ops::floor(&add_k(&mul_k(x, FRAC_2_PI)?, 0.5)?)?;
    let mut r = ops::subtract(x, &mul_k(&n, PIO2_1)?)?;
    r = ops::subtract(&r, &mul_k(&n, PIO2_2)?)?;
    r = ops::subtract(&r, &mul_k(&n, PIO2_3)?)?;
    let z = ops::multiply(&r, &r)?;
    let sin_r = ops::add(&r, &ops::multiply(&ops::multiply(&r, &z)?, &horner(&z, &SIN)?)?)?;
    // cos r = 1 - z/2 + z^2 C(z), with the rounding of 1 - z/2 put back.
    let half_z = mul_k(&z, 0.5)?;
    let w = ops::subtract(&k(1.0)?, &half_z)?;
    let lost = ops::subtract(&ops::subtract(&k(1.0)?, &w)?, &half_z)?;
    let tail = ops::multiply(&ops::multiply(&z, &z)?, &horner(&z, &COS)?)?;
    let cos_r = ops::add(&w, &ops::add(&lost, &tail)?)?;
    let q = ops::bitwise_and(
        &ops::astype(&n, Dtype::S64)?,
        &super::convert::int_scalar(3, Dtype::S64)?,
    )?;
    let pick = |values: [&Array; 4]| -> Result<Array> {
        let mut out = values[3].share()?;
        for i in (0..3).rev() {
            let is_i = ops::equal(&q, &super::convert::int_scalar(i as i128, Dtype::S64)?)?;
            out = ops::where_(&is_i, values[i], &out)?;
        }
        Ok(out)
    };
    let (neg_sin, neg_cos) = (ops::negative(&sin_r)?, ops::negative(&cos_r)?);
    let sin = pick([&sin_r, &cos_r, &neg_sin, &neg_cos])?;
    let cos = pick([&cos_r, &neg_sin, &neg_cos, &sin_r])?;
    Ok((sin, cos))
}

pub fn sin(x: &Array) -> Result<Array> {
    // Keeps the sign of -0.0.
    ops::where_(&ops::equal(x, &k(0.0)?)?, x, &sin_cos(x)?.0)
}

pub fn cos(x: &Array) -> Result<Array> {
    Ok(sin_cos(x)?.1)
}

/// e^(-a^2) without the rounding of a^2: a = hi + lo with hi of 24 bits,
/// so hi^2 is exact and a^2 = hi^2 + lo * (a + hi).
fn exp_minus_square(a: &Array) -> Result<Array> {
    let hi = ops::astype(&ops::astype(a, Dtype::F32)?, Dtype::F64)?;
    let lo = ops::subtract(a, &hi)?;
    let big = ops::negative(&ops::multiply(&hi, &hi)?)?;
    let small = ops::negative(&ops::multiply(&lo, &ops::add(a, &hi)?)?)?;
    ops::multiply(&exp(&big)?, &exp(&small)?)
}

/// erfc(a) for a >= 0 (NaN stays NaN).
fn erfc_nonnegative(a: &Array) -> Result<Array> {
    let series = ops::subtract(
        &k(1.0)?,
        &ops::multiply(a, &horner(&ops::multiply(a, a)?, &ERF_SMALL)?)?,
    )?;
    let erfcx_a = clenshaw(&mul_k(&add_k(&mul_k(a, 4.0)?, -5.0)?, 1.0 / 3.0)?, &ERFCX_A)?;
    let erfcx_b = clenshaw(&add_k(a, -3.0)?, &ERFCX_B)?;
    let mut t = a.share()?;
    for n in (1..=ERFC_CF_TERMS).rev() {
        t = ops::add(a, &ops::divide(&k(n as f64 / 2.0)?, &t)?)?;
    }
    let erfcx_cf = ops::divide(&k(FRAC_1_SQRT_PI)?, &t)?;
    let erfcx = ops::where_(
        &less_k(a, 2.0)?,
        &erfcx_a,
        &ops::where_(&less_k(a, 4.0)?, &erfcx_b, &erfcx_cf)?,
    )?;
    let scaled = ops::multiply(&exp_minus_square(a)?, &erfcx)?;
    // Beyond 27.3 erfc underflows to 0 (and the split of a^2 would not hold).
    let scaled = ops::where_(&ops::greater_equal(a, &k(27.3)?)?, &k(0.0)?, &scaled)?;
    ops::where_(&less_k(a, 0.5)?, &series, &scaled)
}

pub fn erfc(x: &Array) -> Result<Array> {
    let positive = erfc_nonnegative(&ops::abs(x)?)?;
    let mirrored = ops::subtract(&k(2.0)?, &positive)?;
    ops::where_(&less_k(x, 0.0)?, &mirrored, &positive)
}

pub fn erf(x: &Array) -> Result<Array> {
    let a = ops::abs(x)?;
    let series = ops::multiply(x, &horner(&ops::multiply(x, x)?, &ERF_SMALL)?)?;
    let from_erfc = ops::subtract(&k(1.0)?, &erfc_nonnegative(&a)?)?;
    let signed = ops::where_(&less_k(x, 0.0)?, &ops::negative(&from_erfc)?, &from_erfc)?;
    ops::where_(&less_k(&a, 0.5)?, &series, &signed)
}

/// MLX's single-precision erfinv polished by one Halley step on
/// erf(y) = |x| (on erfc(y) = 1 - |x| where |x| >= 0.5, so that values near
/// 1 keep their precision).
pub fn erf_inv(x: &Array) -> Result<Array> {
    let y0 = ops::erfinv(x)?;
    let a = ops::abs(x)?;
    let y = ops::abs(&y0)?;
    let small = ops::subtract(&erf(&y)?, &a)?;
    let large = ops::subtract(&ops::subtract(&k(1.0)?, &a)?, &erfc_nonnegative(&y)?)?;
    let f = ops::where_(&less_k(&a, 0.5)?, &small, &large)?;
    let slope = mul_k(&exp_minus_square(&y)?, FRAC_2_SQRT_PI)?;
    let u = ops::divide(&f, &slope)?;
    let step = ops::divide(&u, &add_k(&ops::multiply(&y, &u)?, 1.0)?)?;
    let polished = ops::subtract(&y, &step)?;
    let signed = ops::where_(&less_k(x, 0.0)?, &ops::negative(&polished)?, &polished)?;
    let exact = ops::logical_or(&ops::isinf(&y0)?, &ops::equal(&y0, &k(0.0)?)?)?;
    let keep = ops::logical_or(&exact, &ops::isnan(&y0)?)?;
    ops::where_(&keep, &y0, &signed)
}
