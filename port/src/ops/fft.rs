//! Fourier transforms with Nx's semantics: each transformed axis is padded
//! with zeros or truncated to its length, and components within `eps` of
//! zero are rounded to zero, as Nx.BinaryBackend does.

use super::compose::complex;
use super::convert::float_scalar;
use super::{attrs, finish, Outputs};
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

#[derive(Clone, Copy)]
enum Kind {
    Forward,
    Inverse,
    RealForward,
    RealInverse,
}

/// `fft(tensor)` along `axis` with `length`.
pub fn fft(x: &[&Array], a: &Term) -> Outputs {
    transform(x[0], a, Kind::Forward, "axis", "length")
}

pub fn ifft(x: &[&Array], a: &Term) -> Outputs {
    transform(x[0], a, Kind::Inverse, "axis", "length")
}

/// Nx.Block.FFT2: over two `axes` with `lengths`.
pub fn fft2(x: &[&Array], a: &Term) -> Outputs {
    transform(x[0], a, Kind::Forward, "axes", "lengths")
}

pub fn ifft2(x: &[&Array], a: &Term) -> Outputs {
    transform(x[0], a, Kind::Inverse, "axes", "lengths")
}

/// Nx.Block.RFFT: the first `length / 2 + 1` frequencies of a real signal.
pub fn rfft(x: &[&Array], a: &Term) -> Outputs {
    transform(x[0], a, Kind::RealForward, "axis", "length")
}

/// Nx.Block.IRFFT: a real signal of `length` from its half spectrum.
pub fn irfft(x: &[&Array], a: &Term) -> Outputs {
    transform(x[0], a, Kind::RealInverse, "axis", "length")
}

// `axis`/`length` (one transform) or `axes`/`lengths` (two), as one list.
fn int_or_ints(t: &Term) -> std::result::Result<Vec<i32>, attrs::AttrError> {
    if t.as_list().is_some() {
        attrs::ints(t)
    } else {
        Ok(vec![attrs::int(t)?])
    }
}

fn transform(x: &Array, a: &Term, kind: Kind, axes_key: &str, lengths_key: &str) -> Outputs {
    let axes = int_or_ints(attrs::field(a, axes_key)?)?;
    let lengths = int_or_ints(attrs::field(a, lengths_key)?)?;
    let eps = attrs::float(attrs::field(a, "eps")?)?;
    // MLX transforms in c64/f32; wider inputs are narrowed first (Moat has
    // no c128, so Nx's type for them is refused before they get here).
    let x = match (kind, x.dtype()) {
        (Kind::RealForward, Dtype::F32) | (Kind::RealInverse | Kind::Forward | Kind::Inverse, Dtype::C64) => {
            x.share()?
        }
        (Kind::RealForward, _) => ops::astype(x, Dtype::F32)?,
        _ => ops::astype(x, Dtype::C64)?,
    };
    let result = match kind {
        Kind::Forward => ops::fftn(&x, &lengths, &axes)?,
        Kind::Inverse => ops::ifftn(&x, &lengths, &axes)?,
        Kind::RealForward => ops::rfftn(&x, &lengths, &axes)?,
        Kind::RealInverse => ops::irfftn(&x, &lengths, &axes)?,
    };
    finish(round_small(&result, eps), a)
}

/// Real and imaginary parts within `eps` of zero become zero.
fn round_small(x: &Array, eps: f64) -> Result<Array> {
    let round = |part: &Array| -> Result<Array> {
        let zero = float_scalar(0.0, part.dtype())?;
        let eps = float_scalar(eps, part.dtype())?;
        let small = ops::logical_and(
            &ops::logical_not(&ops::greater(part, &eps)?)?,
            &ops::logical_not(&ops::less(part, &ops::negative(&eps)?)?)?,
        )?;
        // NaN compares false both ways but is not small.
        let small = ops::logical_and(&small, &ops::equal(part, part)?)?;
        ops::where_(&small, &zero, part)
    };
    if x.dtype() == Dtype::C64 {
        complex(&round(&ops::real(x)?)?, &round(&ops::imag(x)?)?)
    } else {
        round(x)
    }
}
