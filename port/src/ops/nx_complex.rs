//! c64 functions as Nx.BinaryBackend computes them: the `Complex` library's
//! formulas, evaluated step by step in f64 (as Elixir floats are), with its
//! clauses for infinite and NaN parts, and rounded once to c64. MLX's own
//! complex kernels follow C99 instead (`tanh(inf + 3i)` is `1`, Nx's NaN;
//! `asinh(-2i)` takes the other branch) and compute in f32.
//!
//! `Complex` handles ±inf and NaN as atoms with IEEE-like rules; IEEE f64
//! arithmetic gives the same results except where a clause says otherwise,
//! and those clauses are the `where_`s below.

use super::compose::complex;
use super::convert::float_scalar;
use super::precise;
use crate::mlx::{ops, Array, Dtype, Error, Result};

/// A complex value as its f64 parts.
struct Z {
    re: Array,
    im: Array,
}

fn k(v: f64) -> Result<Array> {
    float_scalar(v, Dtype::F64)
}

fn nan() -> Result<Array> {
    k(f64::NAN)
}

/// `x` where `cond`, else `y`, part by part.
fn pick(cond: &Array, x: &Z, y: &Z) -> Result<Z> {
    Ok(Z {
        re: ops::where_(cond, &x.re, &y.re)?,
        im: ops::where_(cond, &x.im, &y.im)?,
    })
}

fn constant(re: f64, im: f64) -> Result<Z> {
    Ok(Z { re: k(re)?, im: k(im)? })
}

fn not_finite(x: &Array) -> Result<Array> {
    ops::logical_not(&ops::isfinite(x)?)
}

/// Whether either part is infinite or NaN.
fn any_not_finite(z: &Z) -> Result<Array> {
    ops::logical_or(&not_finite(&z.re)?, &not_finite(&z.im)?)
}

fn is_zero(x: &Array) -> Result<Array> {
    ops::equal(x, &k(0.0)?)
}

fn from_c64(t: &Array) -> Result<Z> {
    Ok(Z {
        re: ops::astype(&ops::real(t)?, Dtype::F64)?,
        im: ops::astype(&ops::imag(t)?, Dtype::F64)?,
    })
}

/// Rounded to c64; NaN parts are Nx's NaN (positive, quiet), whatever
/// sign the arithmetic left on them.
fn to_c64(z: &Z) -> Result<Array> {
    let shape = ops::add(&z.re, &z.im)?.shape();
    let part = |x: &Array| -> Result<Array> { ops::broadcast_to(&ops::where_(&ops::isnan(x)?, &nan()?, x)?, &shape) };
    complex(&part(&z.re)?, &part(&z.im)?)
}

fn add(a: &Z, b: &Z) -> Result<Z> {
    Ok(Z {
        re: ops::add(&a.re, &b.re)?,
        im: ops::add(&a.im, &b.im)?,
    })
}

fn sub(a: &Z, b: &Z) -> Result<Z> {
    Ok(Z {
        re: ops::subtract(&a.re, &b.re)?,
        im: ops::subtract(&a.im, &b.im)?,
    })
}

/// `-x` as `Complex.cos/1` writes it (`-:math.sin(re)`), which OTP 25
/// compiles to `0 - x`: `-0.0` is `0.0` there.
fn minus(x: &Array) -> Result<Array> {
    ops::subtract(&k(0.0)?, x)
}

fn neg(a: &Z) -> Result<Z> {
    Ok(Z {
        re: ops::negative(&a.re)?,
        im: ops::negative(&a.im)?,
    })
}

/// The textbook product (no C99 recovery of infinities).
fn mul(a: &Z, b: &Z) -> Result<Z> {
    let re = ops::subtract(&ops::multiply(&a.re, &b.re)?, &ops::multiply(&a.im, &b.im)?)?;
    let im = ops::add(&ops::multiply(&a.im, &b.re)?, &ops::multiply(&a.re, &b.im)?)?;
    Ok(Z { re, im })
}

/// `Complex.divide/2` of real parts: a finite number over an infinity is
/// 0 (IEEE keeps a sign).
fn div_real(x: &Array, y: &Array) -> Result<Array> {
    let q = ops::divide(x, y)?;
    let zero = ops::logical_and(&ops::isfinite(x)?, &ops::isinf(y)?)?;
    ops::where_(&zero, &k(0.0)?, &q)
}

/// The textbook quotient; a finite value over a real infinity is 0.
fn div(a: &Z, b: &Z) -> Result<Z> {
    let num_re = ops::add(&ops::multiply(&a.re, &b.re)?, &ops::multiply(&a.im, &b.im)?)?;
    let num_im = ops::subtract(&ops::multiply(&a.im, &b.re)?, &ops::multiply(&a.re, &b.im)?)?;
    let den = ops::add(&ops::multiply(&b.re, &b.re)?, &ops::multiply(&b.im, &b.im)?)?;
    let q = Z {
        re: div_real(&num_re, &den)?,
        im: div_real(&num_im, &den)?,
    };
    let finite_a = ops::logical_not(&any_not_finite(a)?)?;
    let real_inf = ops::logical_and(&ops::isinf(&b.re)?, &is_zero(&b.im)?)?;
    pick(&ops::logical_and(&finite_a, &real_inf)?, &constant(0.0, 0.0)?, &q)
}

fn half(x: &Array) -> Result<Array> {
    ops::divide(x, &k(2.0)?)
}

/// `Complex.exp/1`: e^re (cos im + i sin im), with its clauses: -inf + any
/// is 0; inf + NaN i is inf + NaN i.
fn exp(z: &Z) -> Result<Z> {
    let rho = precise::exp(&z.re)?;
    let e = Z {
        re: ops::multiply(&rho, &precise::cos(&z.im)?)?,
        im: ops::multiply(&rho, &precise::sin(&z.im)?)?,
    };
    let neg_inf = ops::equal(&z.re, &k(f64::NEG_INFINITY)?)?;
    let e = pick(&neg_inf, &constant(0.0, 0.0)?, &e)?;
    let inf_nan = ops::logical_and(&ops::equal(&z.re, &k(f64::INFINITY)?)?, &ops::isnan(&z.im)?)?;
    pick(&inf_nan, &constant(f64::INFINITY, f64::NAN)?, &e)
}

/// `Complex.abs/1`: NaN for NaN + NaN i, inf for any other non-finite part,
/// else the scaled hypotenuse.
fn abs(z: &Z) -> Result<Array> {
    let (x, y) = (ops::abs(&z.re)?, ops::abs(&z.im)?);
    let one = k(1.0)?;
    let scaled = |big: &Array, small: &Array| -> Result<Array> {
        let r = ops::divide(small, big)?;
        ops::multiply(big, &ops::sqrt(&ops::add(&one, &ops::multiply(&r, &r)?)?)?)
    };
    let h = ops::where_(&ops::greater(&x, &y)?, &scaled(&x, &y)?, &scaled(&y, &x)?)?;
    let h = ops::where_(&is_zero(&y)?, &x, &h)?;
    let h = ops::where_(&is_zero(&x)?, &y, &h)?;
    let h = ops::where_(&any_not_finite(z)?, &k(f64::INFINITY)?, &h)?;
    let both_nan = ops::logical_and(&ops::isnan(&z.re)?, &ops::isnan(&z.im)?)?;
    ops::where_(&both_nan, &nan()?, &h)
}

/// `Complex.atan2/2` of real parts: a finite value against +inf is 0,
/// against -inf pi (IEEE keeps the sign of the numerator).
fn atan2(b: &Array, a: &Array) -> Result<Array> {
    let t = ops::arctan2(b, a)?;
    let finite = ops::isfinite(b)?;
    let pos = ops::logical_and(&finite, &ops::equal(a, &k(f64::INFINITY)?)?)?;
    let negv = ops::logical_and(&finite, &ops::equal(a, &k(f64::NEG_INFINITY)?)?)?;
    let t = ops::where_(&pos, &k(0.0)?, &t)?;
    ops::where_(&negv, &k(std::f64::consts::PI)?, &t)
}

/// `Complex.log/1`: log |z| + i atan2(im, re).
fn log(z: &Z) -> Result<Z> {
    Ok(Z {
        re: ops::log(&abs(z)?)?,
        im: atan2(&z.im, &z.re)?,
    })
}

/// `Complex.sqrt/1`, its clauses for non-finite parts first.
fn sqrt(z: &Z) -> Result<Z> {
    let (r, i) = (&z.re, &z.im);
    let (x, y) = (ops::abs(r)?, ops::abs(i)?);
    let (one, halfk) = (k(1.0)?, k(0.5)?);
    let root = |v: &Array| ops::sqrt(v);
    let ratio_root = |p: &Array, q: &Array| -> Result<Array> {
        let t = ops::divide(p, q)?;
        root(&ops::add(&one, &ops::multiply(&t, &t)?)?)
    };
    // x >= y: sqrt(x) sqrt(0.5 (1 + sqrt(1 + (y/x)^2)))
    let wx = ops::multiply(
        &root(&x)?,
        &root(&ops::multiply(&halfk, &ops::add(&one, &ratio_root(&y, &x)?)?)?)?,
    )?;
    // else: sqrt(y) sqrt(0.5 (x/y + sqrt(1 + (x/y)^2)))
    let wy = ops::multiply(
        &root(&y)?,
        &root(&ops::multiply(
            &halfk,
            &ops::add(&ops::divide(&x, &y)?, &ratio_root(&x, &y)?)?,
        )?)?,
    )?;
    let w = ops::where_(&ops::greater_equal(&x, &y)?, &wx, &wy)?;
    let two = k(2.0)?;
    let right = Z {
        re: w.share()?,
        im: ops::divide(i, &ops::multiply(&two, &w)?)?,
    };
    let i2 = ops::where_(&ops::greater_equal(i, &k(0.0)?)?, &w, &ops::negative(&w)?)?;
    let left = Z {
        re: ops::divide(i, &ops::multiply(&two, &i2)?)?,
        im: i2,
    };
    let s = pick(&ops::greater_equal(r, &k(0.0)?)?, &right, &left)?;
    let zero = Z {
        re: r.share()?,
        im: i.share()?,
    };
    let s = pick(&ops::logical_and(&is_zero(r)?, &is_zero(i)?)?, &zero, &s)?;
    // The clauses, last to first so that the first that matches wins.
    let (inf, ninf) = (k(f64::INFINITY)?, k(f64::NEG_INFINITY)?);
    let s = pick(&ops::equal(r, &ninf)?, &constant(0.0, f64::INFINITY)?, &s)?;
    let s = pick(&ops::equal(r, &inf)?, &constant(f64::INFINITY, 0.0)?, &s)?;
    let s = pick(&ops::equal(i, &ninf)?, &constant(f64::INFINITY, f64::NEG_INFINITY)?, &s)?;
    let s = pick(&ops::equal(i, &inf)?, &constant(f64::INFINITY, f64::INFINITY)?, &s)?;
    let any_nan = ops::logical_or(&ops::isnan(r)?, &ops::isnan(i)?)?;
    pick(&any_nan, &constant(f64::NAN, f64::NAN)?, &s)
}

/// sinh and cosh: (e^z -+ e^-z) / 2.
fn sinh_cosh(z: &Z) -> Result<(Z, Z)> {
    let (p, m) = (exp(z)?, exp(&neg(z)?)?);
    let (d, s) = (sub(&p, &m)?, add(&p, &m)?);
    Ok((
        Z {
            re: half(&d.re)?,
            im: half(&d.im)?,
        },
        Z {
            re: half(&s.re)?,
            im: half(&s.im)?,
        },
    ))
}

/// Real sinh and cosh in f64 (expm1 keeps sinh's small values).
fn real_sinh_cosh(x: &Array) -> Result<(Array, Array)> {
    let mx = ops::negative(x)?;
    let sinh = half(&ops::subtract(&ops::expm1(x)?, &ops::expm1(&mx)?)?)?;
    let cosh = half(&ops::add(&precise::exp(x)?, &precise::exp(&mx)?)?)?;
    Ok((sinh, cosh))
}

/// `Complex.sin/1` and `Complex.cos/1`: sin re cosh im + i cos re sinh im
/// and cos re cosh im - i sin re sinh im; NaN + NaN i where the real part
/// or a part is NaN is not finite, except a finite real part with an
/// infinite imaginary one: sin is (re im) + im i, cos inf + (-im re) i.
fn sin_cos(z: &Z) -> Result<(Z, Z)> {
    let (sr, cr) = (precise::sin(&z.re)?, precise::cos(&z.re)?);
    let (shi, chi) = real_sinh_cosh(&z.im)?;
    let sin = Z {
        re: ops::multiply(&sr, &chi)?,
        im: ops::multiply(&cr, &shi)?,
    };
    let cos = Z {
        re: ops::multiply(&cr, &chi)?,
        im: ops::multiply(&minus(&sr)?, &shi)?,
    };
    let finite_re = ops::isfinite(&z.re)?;
    let inf_im = ops::logical_and(&finite_re, &ops::isinf(&z.im)?)?;
    let sin_inf = Z {
        re: ops::multiply(&z.re, &z.im)?,
        im: z.im.share()?,
    };
    let cos_inf = Z {
        re: ops::broadcast_to(&k(f64::INFINITY)?, &z.re.shape())?,
        im: ops::multiply(&ops::multiply(&k(-1.0)?, &z.im)?, &z.re)?,
    };
    let nan_nan = constant(f64::NAN, f64::NAN)?;
    let bad = any_not_finite(z)?;
    let sin = pick(&inf_im, &sin_inf, &pick(&bad, &nan_nan, &sin)?)?;
    let cos = pick(&inf_im, &cos_inf, &pick(&bad, &nan_nan, &cos)?)?;
    Ok((sin, cos))
}

/// `Complex.divide(1, z)`.
fn recip(z: &Z) -> Result<Z> {
    div(&one()?, z)
}

fn i() -> Result<Z> {
    constant(0.0, 1.0)
}

fn one() -> Result<Z> {
    constant(1.0, 0.0)
}

/// NaN + NaN i wherever a part of `z` is not finite (asin, acos).
fn nan_if_not_finite(z: &Z, w: Z) -> Result<Z> {
    pick(&any_not_finite(z)?, &constant(f64::NAN, f64::NAN)?, &w)
}

/// The c64 function `name` of `t`, as Nx.BinaryBackend computes it.
pub fn unary(name: &str, t: &Array) -> Result<Array> {
    let z = from_c64(t)?;
    let w = match name {
        "exp" => exp(&z)?,
        "log" => log(&z)?,
        "sqrt" => sqrt(&z)?,
        "sin" => sin_cos(&z)?.0,
        "cos" => sin_cos(&z)?.1,
        "tan" => {
            let (s, c) = sin_cos(&z)?;
            div(&s, &c)?
        }
        "rsqrt" => recip(&sqrt(&z)?)?,
        // 1 / (1 + e^-z)
        "sigmoid" => recip(&add(&exp(&neg(&z)?)?, &one()?)?)?,
        "sinh" => sinh_cosh(&z)?.0,
        "cosh" => sinh_cosh(&z)?.1,
        "tanh" => {
            let (s, c) = sinh_cosh(&z)?;
            div(&s, &c)?
        }
        // -i log(i z + sqrt(1 - z^2))
        "asin" => {
            let w = mul(
                &neg(&i()?)?,
                &log(&add(&mul(&i()?, &z)?, &sqrt(&sub(&one()?, &mul(&z, &z)?)?)?)?)?,
            )?;
            nan_if_not_finite(&z, w)?
        }
        // -i log(z + sqrt(z^2 - 1))
        "acos" => {
            let w = mul(&neg(&i()?)?, &log(&add(&z, &sqrt(&sub(&mul(&z, &z)?, &one()?)?)?)?)?)?;
            nan_if_not_finite(&z, w)?
        }
        // i/2 (log(1 - i z) - log(1 + i z))
        "atan" => {
            let iz = mul(&i()?, &z)?;
            let t1 = mul(&constant(0.5, 0.0)?, &i()?)?;
            mul(&t1, &sub(&log(&sub(&one()?, &iz)?)?, &log(&add(&one()?, &iz)?)?)?)?
        }
        // log(z + sqrt(z^2 + 1))
        "asinh" => log(&add(&z, &sqrt(&add(&mul(&z, &z)?, &one()?)?)?)?)?,
        // log(z + sqrt(z^2 - 1))
        "acosh" => log(&add(&z, &sqrt(&sub(&mul(&z, &z)?, &one()?)?)?)?)?,
        // log((1 + z) / (1 - z)) / 2
        "atanh" => {
            let q = div(&add(&one()?, &z)?, &sub(&one()?, &z)?)?;
            mul(&constant(0.5, 0.0)?, &log(&q)?)?
        }
        other => return Err(Error::new(format!("no Nx complex formula for {other}"))),
    };
    to_c64(&w)
}

/// `Complex.pow/2` of c64 tensors: rho^c e^(-d theta) (cos r + i sin r),
/// r = c theta + d log rho, with its clauses: NaN + NaN i for any
/// non-finite part, `0^0` is 1, `0^y` 0, `x^1` x, `x^-1` 1/x.
pub fn pow(base: &Array, exponent: &Array) -> Result<Array> {
    let (x, y) = (from_c64(base)?, from_c64(exponent)?);
    let rho = abs(&x)?;
    let theta = atan2(&x.im, &x.re)?;
    let s = ops::multiply(
        &ops::power(&rho, &y.re)?,
        &precise::exp(&ops::multiply(&ops::negative(&y.im)?, &theta)?)?,
    )?;
    let r = ops::add(&ops::multiply(&y.re, &theta)?, &ops::multiply(&y.im, &ops::log(&rho)?)?)?;
    let general = Z {
        re: ops::multiply(&s, &precise::cos(&r)?)?,
        im: ops::multiply(&s, &precise::sin(&r)?)?,
    };
    let y_zero = ops::logical_and(&is_zero(&y.re)?, &is_zero(&y.im)?)?;
    let x_zero = ops::logical_and(&is_zero(&x.re)?, &is_zero(&x.im)?)?;
    let y_is = |v: f64| -> Result<Array> { ops::logical_and(&ops::equal(&y.re, &k(v)?)?, &is_zero(&y.im)?) };
    let w = pick(&y_is(-1.0)?, &div(&one()?, &x)?, &general)?;
    let w = pick(&y_is(1.0)?, &x, &w)?;
    let of_zero = pick(&y_zero, &one()?, &constant(0.0, 0.0)?)?;
    let w = pick(&x_zero, &of_zero, &w)?;
    let not_finite = ops::logical_or(&any_not_finite(&x)?, &any_not_finite(&y)?)?;
    let w = pick(&not_finite, &constant(f64::NAN, f64::NAN)?, &w)?;
    // 0 ^ (inf + 0i) is 0.
    let zero_to_inf = ops::logical_and(
        &x_zero,
        &ops::logical_and(&ops::equal(&y.re, &k(f64::INFINITY)?)?, &is_zero(&y.im)?)?,
    )?;
    to_c64(&pick(&zero_to_inf, &constant(0.0, 0.0)?, &w)?)
}

/// The complex product over `axes`, as Nx.BinaryBackend folds it (from
/// `1 + 0i`, with the textbook multiplication, so an infinite factor makes
/// NaN where C99 would recover an infinity), in f64, pairwise: the reduced
/// axes are moved last and flattened, then halved until one is left.
pub fn product(t: &Array, axes: &[i32], keep: bool) -> Result<Array> {
    let shape = t.shape();
    let rank = shape.len() as i32;
    let reduced: Vec<i32> = axes.iter().map(|&a| if a < 0 { a + rank } else { a }).collect();
    for (n, &a) in reduced.iter().enumerate() {
        if !(0..rank).contains(&a) || reduced[..n].contains(&a) {
            return Err(Error::new(format!(
                "axes {axes:?} are not distinct axes of shape {shape:?}"
            )));
        }
    }
    let kept: Vec<i32> = (0..rank).filter(|a| !reduced.contains(a)).collect();
    let perm: Vec<i32> = kept.iter().chain(reduced.iter()).copied().collect();
    let kept_dims: Vec<i32> = kept.iter().map(|&a| shape[a as usize]).collect();
    let n: i32 = reduced.iter().map(|&a| shape[a as usize]).product();
    let mut flat_shape = kept_dims.clone();
    flat_shape.push(n);
    let flat = ops::reshape(&ops::transpose(t, &perm)?, &flat_shape)?;
    let mut z = from_c64(&flat)?;
    // The fold's first factor, 1 + 0i.
    let mut first_shape = kept_dims.clone();
    first_shape.push(1);
    let unit = Z {
        re: ops::broadcast_to(&k(1.0)?, &first_shape)?,
        im: ops::broadcast_to(&k(0.0)?, &first_shape)?,
    };
    z = Z {
        re: ops::concatenate(&[&unit.re, &z.re], -1)?,
        im: ops::concatenate(&[&unit.im, &z.im], -1)?,
    };
    let mut len = n + 1;
    let last = kept_dims.len();
    while len > 1 {
        let pairs = len / 2;
        let take = |x: &Array, start: i32, stop: i32, step: i32| -> Result<Array> {
            let mut lo = vec![0; last + 1];
            let mut hi = kept_dims.clone();
            let mut st = vec![1; last + 1];
            lo[last] = start;
            hi.push(stop);
            st[last] = step;
            ops::slice(x, &lo, &hi, &st)
        };
        let a = Z {
            re: take(&z.re, 0, 2 * pairs, 2)?,
            im: take(&z.im, 0, 2 * pairs, 2)?,
        };
        let b = Z {
            re: take(&z.re, 1, 2 * pairs, 2)?,
            im: take(&z.im, 1, 2 * pairs, 2)?,
        };
        // Element times accumulator, as Nx writes it.
        let mut p = mul(&b, &a)?;
        if len % 2 == 1 {
            let (re, im) = (take(&z.re, len - 1, len, 1)?, take(&z.im, len - 1, len, 1)?);
            p = Z {
                re: ops::concatenate(&[&p.re, &re], -1)?,
                im: ops::concatenate(&[&p.im, &im], -1)?,
            };
        }
        z = p;
        len = pairs + len % 2;
    }
    let out = to_c64(&z)?;
    let out_shape: Vec<i32> = if keep {
        (0..rank)
            .map(|a| if reduced.contains(&a) { 1 } else { shape[a as usize] })
            .collect()
    } else {
        kept_dims
    };
    ops::reshape(&out, &out_shape)
}
