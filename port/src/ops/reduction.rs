//! Reductions over axes, cumulative ops, sorting, and the blocks built on
//! them (all_close, top_k).

use super::convert::{cast, float_scalar, int_scalar, nonzero};
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

fn axes_and_keep(a: &Term) -> std::result::Result<(Vec<i32>, bool), String> {
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let keep = attrs::boolean(attrs::field(a, "keep_axes")?)?;
    Ok((axes, keep))
}

/// `fn name(inputs, attrs)`: the input in the output type, reduced.
macro_rules! reduce {
    ($($name:ident => $mlx:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let (axes, keep) = axes_and_keep(a)?;
            finish(ops::$mlx(&to_out_type(x[0], a)?, &axes, keep), a)
        }
    )*};
}

reduce! {
    sum => sum,
    reduce_max => max,
    reduce_min => min,
}

/// A complex product is Nx's fold (`nx_complex::product`), not MLX's C99
/// multiplication.
pub fn product(x: &[&Array], a: &Term) -> Outputs {
    let (axes, keep) = axes_and_keep(a)?;
    let t = to_out_type(x[0], a)?;
    if t.dtype().is_complex() {
        return finish(super::nx_complex::product(&t, &axes, keep), a);
    }
    finish(ops::prod(&t, &axes, keep), a)
}

/// `fn name(inputs, attrs)`: the input tested for non-zero, reduced.
macro_rules! truth {
    ($($name:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let (axes, keep) = axes_and_keep(a)?;
            finish(nonzero(x[0]).and_then(|t| ops::$name(&t, &axes, keep)), a)
        }
    )*};
}

truth!(all, any);

/// The axis to reduce, `None` for the flattened tensor.
fn optional_axis(a: &Term) -> std::result::Result<Option<i32>, String> {
    match attrs::field(a, "axis")? {
        t if t.is_atom("nil") => Ok(None),
        t => attrs::int(t).map(Some),
    }
}

pub fn argmax(x: &[&Array], a: &Term) -> Outputs {
    arg_extreme(x[0], a, ops::argmax)
}

pub fn argmin(x: &[&Array], a: &Term) -> Outputs {
    arg_extreme(x[0], a, ops::argmin)
}

type ArgReduce = fn(&Array, i32, bool) -> Result<Array>;

/// Nx's argmax/argmin: `tie_break: :low` takes the first extreme, `:high`
/// the last; a NaN anywhere along the axis wins, the last NaN if several.
fn arg_extreme(x: &Array, a: &Term, reduce: ArgReduce) -> Outputs {
    let axis = optional_axis(a)?;
    let keep = attrs::boolean(attrs::field(a, "keep_axes")?)?;
    let high = attrs::field(a, "tie_break")?.is_atom("high");
    let shape = x.shape();
    let out_shape = match (axis, keep) {
        (None, true) => vec![1; shape.len()],
        (None, false) => vec![],
        (Some(axis), keep) => {
            let mut out = shape.clone();
            let slot = usize::try_from(axis).ok().filter(|i| *i < out.len());
            let i = slot.ok_or_else(|| format!("axis {axis} is out of range for shape {shape:?}"))?;
            if keep {
                out[i] = 1
            } else {
                out.remove(i);
            }
            out
        }
    };
    let compute = || -> Result<Array> {
        let (x, axis) = match axis {
            Some(axis) => (x.share()?, axis),
            None => (ops::reshape(x, &[-1])?, 0),
        };
        let index = if high {
            last_index(&x, axis, reduce)?
        } else {
            ops::astype(&reduce(&x, axis, true)?, Dtype::S64)?
        };
        let index = if x.dtype().is_float() {
            let nan = ops::isnan(&x)?;
            let last_nan = last_index(&ops::astype(&nan, Dtype::U8)?, axis, ops::argmax)?;
            ops::where_(&ops::any(&nan, &[axis], true)?, &last_nan, &index)?
        } else {
            index
        };
        ops::reshape(&index, &out_shape)
    };
    finish(compute(), a)
}

/// The index (s64, axis kept) of the last extreme along `axis`: the first
/// one of the reversed array, counted from the end.
fn last_index(x: &Array, axis: i32, reduce: ArgReduce) -> Result<Array> {
    let n = x.shape()[axis as usize] as i128;
    let first = ops::astype(&reduce(&ops::flip(x, &[axis])?, axis, true)?, Dtype::S64)?;
    ops::subtract(&int_scalar(n - 1, Dtype::S64)?, &first)
}

/// `fn name(inputs, attrs)`: an inclusive scan along `axis` in the output
/// type, from the end when `reverse`.
macro_rules! scan {
    ($($name:ident => $scan:path),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let axis = attrs::axis(attrs::field(a, "axis")?, x[0].shape().len())?;
            let reverse = attrs::boolean(attrs::field(a, "reverse")?)?;
            finish($scan(&to_out_type(x[0], a)?, axis, reverse), a)
        }
    )*};
}

scan! {
    cumulative_sum => cumsum,
    cumulative_product => cumprod,
    cumulative_min => cummin,
    cumulative_max => cummax,
}

// Half-precision scans run in f32, which holds every f16 and bf16 value:
// MLX accumulates cumsum/cumprod in the half type (a running sum of ones
// stops at 2048 in f16), and its half cummin/cummax turn the NaN they
// propagate into 0.

fn cumsum(x: &Array, axis: i32, reverse: bool) -> Result<Array> {
    in_f32_if_half(x, |x| ops::cumsum(x, axis, reverse))
}

fn cumprod(x: &Array, axis: i32, reverse: bool) -> Result<Array> {
    in_f32_if_half(x, |x| ops::cumprod(x, axis, reverse))
}

fn cummin(x: &Array, axis: i32, reverse: bool) -> Result<Array> {
    in_f32_if_half(x, |x| ops::cummin(x, axis, reverse))
}

fn cummax(x: &Array, axis: i32, reverse: bool) -> Result<Array> {
    in_f32_if_half(x, |x| ops::cummax(x, axis, reverse))
}

fn in_f32_if_half(x: &Array, f: impl Fn(&Array) -> Result<Array>) -> Result<Array> {
    match x.dtype() {
        Dtype::F16 | Dtype::Bf16 => ops::astype(&f(&ops::astype(x, Dtype::F32)?)?, x.dtype()),
        _ => f(x),
    }
}

fn descending(a: &Term) -> std::result::Result<bool, String> {
    match attrs::field(a, "direction")?.as_atom() {
        Some("asc") => Ok(false),
        Some("desc") => Ok(true),
        _ => Err("direction must be :asc or :desc".into()),
    }
}

/// Stable sort along `axis`; NaN sorts above +inf (last ascending, first
/// descending), as in Nx.BinaryBackend.
pub fn sort(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::axis(attrs::field(a, "axis")?, x[0].shape().len())?;
    let desc = descending(a)?;
    finish(sort_values(x[0], axis, desc), a)
}

/// Descending values are the ascending ones reversed: equal elements are
/// indistinguishable (except -0.0 and 0.0, which may trade places).
fn sort_values(x: &Array, axis: i32, desc: bool) -> Result<Array> {
    let sorted = ops::sort(x, axis)?;
    if desc {
        ops::flip(&sorted, &[axis])
    } else {
        Ok(sorted)
    }
}

pub fn argsort(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::axis(attrs::field(a, "axis")?, x[0].shape().len())?;
    let desc = descending(a)?;
    finish(sort_indices(x[0], axis, desc), a)
}

/// MLX's argsort is stable and ascending. A stable descending order is the
/// ascending order of the reversed array, reversed, with indices counted
/// from the end: ties keep their original order in both directions.
fn sort_indices(x: &Array, axis: i32, desc: bool) -> Result<Array> {
    if !desc {
        return ops::astype(&ops::argsort(x, axis)?, Dtype::S64);
    }
    let n = x.shape()[axis as usize] as i128;
    let reversed = ops::argsort(&ops::flip(x, &[axis])?, axis)?;
    let from_end = ops::astype(&ops::flip(&reversed, &[axis])?, Dtype::S64)?;
    ops::subtract(&int_scalar(n - 1, Dtype::S64)?, &from_end)
}

/// Nx.Block.TopK: the `k` largest along the last axis, in descending order
/// (ties by position), and their indices.
pub fn top_k(x: &[&Array], a: &Term) -> Outputs {
    let k = attrs::int(attrs::field(a, "k")?)?;
    let shape = x[0].shape();
    let axis = shape.len() as i32 - 1;
    if axis < 0 || k < 0 || k > shape[axis as usize] {
        return Err(format!("k = {k} does not fit the last axis of shape {shape:?}"));
    }
    let first_k = |t: Array| -> Result<Array> {
        let mut stop = t.shape();
        stop[axis as usize] = k;
        ops::slice(&t, &vec![0; stop.len()], &stop, &vec![1; stop.len()])
    };
    let values = sort_values(x[0], axis, true).and_then(first_k).map_err(|e| e.message)?;
    let indices = sort_indices(x[0], axis, true)
        .and_then(first_k)
        .map_err(|e| e.message)?;
    let t = attrs::dtype(attrs::field(a, "index_type")?)?;
    let indices = cast(&indices, t).map_err(|e| e.message)?;
    Ok(vec![values, indices])
}

/// Nx.Block.AllClose: `|a - b| <= atol + rtol * |b|` everywhere, computed in
/// `input_type`; infinities must match exactly; NaNs match each other only
/// with `equal_nan`. A u8 scalar.
pub fn all_close(x: &[&Array], a: &Term) -> Outputs {
    let t = attrs::dtype(attrs::field(a, "input_type")?)?;
    let rtol = attrs::float(attrs::field(a, "rtol")?)?;
    let atol = attrs::float(attrs::field(a, "atol")?)?;
    let equal_nan = attrs::boolean(attrs::field(a, "equal_nan")?)?;
    let compute = || -> Result<Array> {
        let (l, r) = (cast(x[0], t)?, cast(x[1], t)?);
        let real = if t.is_complex() { Dtype::F32 } else { t };
        let diff = ops::abs(&ops::subtract(&l, &r)?)?;
        let tol = ops::add(
            &float_scalar(atol, real)?,
            &ops::multiply(&float_scalar(rtol, real)?, &ops::abs(&r)?)?,
        )?;
        let mut close = ops::less_equal(&diff, &tol)?;
        if !t.is_integer() {
            let inf = ops::logical_or(&ops::isinf(&l)?, &ops::isinf(&r)?)?;
            close = ops::where_(&inf, &ops::equal(&l, &r)?, &close)?;
            if equal_nan {
                let both_nan = ops::logical_and(&ops::isnan(&l)?, &ops::isnan(&r)?)?;
                close = ops::logical_or(&both_nan, &close)?;
            }
        }
        ops::all(&close, &(0..close.shape().len() as i32).collect::<Vec<_>>(), false)
    };
    finish(compute(), a)
}
