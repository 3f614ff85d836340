//! Ops that change an array's shape or element type.

use super::convert::{cast, nonzero};
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::{ops, Array, Result};
use crate::term::Term;

pub fn astype(x: &[&Array], a: &Term) -> Outputs {
    finish(cast(x[0], attrs::dtype(attrs::field(a, "type")?)?), a)
}

/// The same bytes read as another type of the same width.
pub fn bitcast(x: &[&Array], a: &Term) -> Outputs {
    let (from, to) = (x[0].dtype(), attrs::dtype(attrs::field(a, "type")?)?);
    if from.size() != to.size() {
        return Err(format!(
            "cannot bitcast {:?} to {:?}: they differ in width",
            from.nx(),
            to.nx()
        ));
    }
    finish(ops::view(x[0], to), a)
}

pub fn reshape(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::reshape(x[0], &attrs::ints(attrs::field(a, "shape")?)?), a)
}

pub fn broadcast_to(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::broadcast_to(x[0], &attrs::ints(attrs::field(a, "shape")?)?), a)
}

/// Nx's broadcast: input axis `i` becomes output axis `axes[i]`; the other
/// output axes are new.
pub fn broadcast(x: &[&Array], a: &Term) -> Outputs {
    let shape = attrs::ints(attrs::field(a, "shape")?)?;
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let dims = x[0].shape();
    if axes.len() != dims.len() {
        return Err(format!("axes {axes:?} do not name every axis of shape {dims:?}"));
    }
    let mut aligned = vec![1; shape.len()];
    for (axis, dim) in axes.iter().zip(dims) {
        let slot = usize::try_from(*axis).ok().and_then(|i| aligned.get_mut(i));
        *slot.ok_or_else(|| format!("axis {axis} is out of range for shape {shape:?}"))? = dim;
    }
    finish(
        ops::reshape(x[0], &aligned).and_then(|r| ops::broadcast_to(&r, &shape)),
        a,
    )
}

pub fn transpose(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::transpose(x[0], &attrs::ints(attrs::field(a, "axes")?)?), a)
}

pub fn reverse(x: &[&Array], a: &Term) -> Outputs {
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    if axes.is_empty() {
        return finish(x[0].share(), a);
    }
    finish(ops::flip(x[0], &axes), a)
}

/// Nx's pad: per axis `[low, high, interior]`; negative low/high cut.
pub fn pad(x: &[&Array], a: &Term) -> Outputs {
    let config = attrs::field(a, "config")?.as_list().ok_or("config must be a list")?;
    let config = config
        .iter()
        .map(attrs::ints)
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let shape = x[0].shape();
    if config.len() != shape.len() || config.iter().any(|c| c.len() != 3 || c[2] < 0) {
        return Err(format!(
            "config needs one [low, high, interior >= 0] per axis of {shape:?}"
        ));
    }
    let (t, value) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    finish(pad_array(&t, &value, &config), a)
}

/// Grows every axis by its positive padding and interior gaps (a filled
/// array with `x` written in at a stride), then cuts negative padding off.
fn pad_array(x: &Array, value: &Array, config: &[Vec<i32>]) -> Result<Array> {
    let shape = x.shape();
    let mut grown = Vec::new();
    let (mut start, mut stop, mut strides) = (Vec::new(), Vec::new(), Vec::new());
    for (n, c) in shape.iter().zip(config) {
        let (low, high, interior) = (c[0].max(0), c[1].max(0), c[2]);
        let spread = if *n == 0 { 0 } else { n + (n - 1) * interior };
        grown.push(low + spread + high);
        start.push(low);
        stop.push(low + spread);
        strides.push(interior + 1);
    }
    let filled = ops::full(&grown, value, x.dtype())?;
    let placed = if x.size() == 0 {
        filled
    } else {
        ops::slice_update(&filled, x, &start, &stop, &strides)?
    };
    if config.iter().all(|c| c[0] >= 0 && c[1] >= 0) {
        return Ok(placed);
    }
    let cut_start: Vec<i32> = config.iter().map(|c| (-c[0]).max(0)).collect();
    let cut_stop: Vec<i32> = grown.iter().zip(config).map(|(g, c)| g - (-c[1]).max(0)).collect();
    ops::slice(&placed, &cut_start, &cut_stop, &vec![1; grown.len()])
}

pub fn concatenate(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::int(attrs::field(a, "axis")?)?;
    let inputs = x
        .iter()
        .map(|t| to_out_type(t, a))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    finish(ops::concatenate(&inputs.iter().collect::<Vec<_>>(), axis), a)
}

pub fn stack(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::int(attrs::field(a, "axis")?)?;
    let inputs = x
        .iter()
        .map(|t| to_out_type(t, a))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    finish(ops::stack(&inputs.iter().collect::<Vec<_>>(), axis), a)
}

/// `on_true` where `pred` is non-zero, else `on_false`, broadcasting.
pub fn select(x: &[&Array], a: &Term) -> Outputs {
    let (on_true, on_false) = (to_out_type(x[1], a)?, to_out_type(x[2], a)?);
    finish(nonzero(x[0]).and_then(|p| ops::where_(&p, &on_true, &on_false)), a)
}

/// Nx's clip: `x > min ? x : min`, then `< max ? _ : max` (NaN becomes
/// min, then max if min is not below max).
pub fn clip(x: &[&Array], a: &Term) -> Outputs {
    let (t, min, max) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?, to_out_type(x[2], a)?);
    let clipped = || -> Result<Array> {
        let low = ops::where_(&ops::greater(&t, &min)?, &t, &min)?;
        ops::where_(&ops::less(&low, &max)?, &low, &max)
    };
    finish(clipped(), a)
}

/// Another handle to the same (immutable) array.
pub fn copy(x: &[&Array], a: &Term) -> Outputs {
    finish(x[0].share(), a)
}
