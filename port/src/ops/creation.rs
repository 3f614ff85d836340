//! Tensors made from attributes alone: constants, iota, eye.

use super::{attrs, finish, Outputs};
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

fn shape_and_type(a: &Term) -> std::result::Result<(Vec<i32>, Dtype), String> {
    Ok((
        attrs::ints(attrs::field(a, "shape")?)?,
        attrs::dtype(attrs::field(a, "type")?)?,
    ))
}

/// `value` (one element's bytes, Nx's layout) repeated over `shape`.
pub fn constant(_: &[&Array], a: &Term) -> Outputs {
    let (shape, t) = shape_and_type(a)?;
    let Term::Binary(bytes) = attrs::field(a, "value")? else {
        return Err("value must be a binary holding one element".into());
    };
    if bytes.len() != t.size() {
        return Err(format!(
            "value has {} bytes, one {t:?} element has {}",
            bytes.len(),
            t.size()
        ));
    }
    finish(
        ops::scalar_from_bytes(bytes, t).and_then(|v| ops::full(&shape, &v, t)),
        a,
    )
}

/// Counts along `axis` (or through the flattened shape when `axis` is nil).
pub fn iota(_: &[&Array], a: &Term) -> Outputs {
    let (shape, t) = shape_and_type(a)?;
    let axis = match attrs::field(a, "axis")? {
        n if n.is_atom("nil") => None,
        n => Some(attrs::int(n)?),
    };
    let count = |n: i64| -> Result<Array> {
        // Counted in 64 bits, then converted (wrapping like Nx for narrow
        // types). The GPU has no f64; s64 converts to float the same way.
        let wide = if t.is_inexact() && !crate::mlx::on_gpu() {
            Dtype::F64
        } else {
            Dtype::S64
        };
        ops::astype(&ops::arange(0.0, n as f64, 1.0, wide)?, t)
    };
    let result = match axis {
        None => count(shape.iter().map(|d| *d as i64).product()).and_then(|r| ops::reshape(&r, &shape)),
        Some(axis) => {
            let i = usize::try_from(axis).ok().filter(|i| *i < shape.len());
            let i = i.ok_or_else(|| format!("axis {axis} is out of range for shape {shape:?}"))?;
            let mut aligned = vec![1; shape.len()];
            aligned[i] = shape[i];
            count(shape[i] as i64)
                .and_then(|r| ops::reshape(&r, &aligned))
                .and_then(|r| ops::broadcast_to(&r, &shape))
        }
    };
    finish(result, a)
}

/// Identity matrices in the last two axes, repeated over the leading ones.
pub fn eye(_: &[&Array], a: &Term) -> Outputs {
    let (shape, t) = shape_and_type(a)?;
    let [.., m, n] = shape[..] else {
        return Err(format!("eye needs at least two axes, got shape {shape:?}"));
    };
    finish(ops::eye(m, n, 0, t).and_then(|e| ops::broadcast_to(&e, &shape)), a)
}
