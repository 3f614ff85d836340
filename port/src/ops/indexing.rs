//! Indexing with Nx's semantics: gather, take, take_along_axis, indexed
//! add/put and slices whose start indices are tensors.
//!
//! MLX reads and writes out-of-range indices without checking (far out of
//! range the process dies, slightly out it returns garbage), so every op
//! checks its indices before MLX evaluates anything with them: it evaluates
//! their lowest and highest values (within the memory limit; only those few
//! numbers are copied out) and fails when one is out of range, as Nx.BinaryBackend
//! raises. Index tuples become row numbers inside MLX.

use super::compose::inverse;
use super::convert::int_scalar;
use super::{attrs, finish, to_out_type, Outputs};
use crate::budget;
use crate::mlx::{ops, Array, Dtype};
use crate::term::Term;
use std::collections::HashMap;

/// `gather(tensor, indices)`: indices `[..., k]` address the `axes` of the
/// tensor; the result is `indices[..-1] ++ the other axes`.
pub fn gather(x: &[&Array], a: &Term) -> Outputs {
    let (tensor, indices) = (x[0], x[1]);
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let ishape = indices.shape();
    let Some(&depth) = ishape.last() else {
        return Err("indices must have rank 1 or more".into());
    };
    let flat = Indexed::new(tensor, &axes)?;
    if depth as usize != axes.len() {
        return Err(format!(
            "indices have depth {depth} but {} axes are indexed",
            axes.len()
        ));
    }
    let rows = flat.rows(indices)?;
    // SAFETY: `rows` are checked row numbers of `flat.array` (`Indexed::rows`).
    let taken = unsafe { ops::take(&as_bits(&flat.array)?, &rows, 0) }?;
    finish(from_bits(taken, tensor.dtype()), a)
}

/// `take(tensor, indices, axis)`: the axis is replaced by the indices' shape.
pub fn take(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::axis(attrs::field(a, "axis")?, x[0].shape().len())?;
    // SAFETY: the result is returned only once `checked` has checked its
    // indices; until then nothing evaluates it.
    let taken = unsafe { ops::take(&as_bits(x[0])?, &gather_indices(x[1])?, axis) }?;
    checked(from_bits(taken, x[0].dtype())?, x[0], x[1], axis, a)
}

/// `take_along_axis(tensor, indices, axis)`: indices have the tensor's shape
/// except along the axis.
pub fn take_along_axis(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::axis(attrs::field(a, "axis")?, x[0].shape().len())?;
    // SAFETY: as in `take`.
    let taken = unsafe { ops::take_along_axis(&as_bits(x[0])?, &gather_indices(x[1])?, axis) }?;
    checked(from_bits(taken, x[0].dtype())?, x[0], x[1], axis, a)
}

/// MLX's CUDA backend compiles (NVRTC) a gather module for each element type
/// and index type on first use, 2 to 8 s each on the H200, so a worker that
/// meets many pairs spends minutes compiling. On the GPU the elements
/// therefore move as unsigned integers of their width, and the indices as
/// s32 (exact once checked: every axis fits in s32), so four modules serve
/// every type. The CPU's kernels are compiled ahead: nothing changes there.
fn as_bits(x: &Array) -> crate::mlx::Result<Array> {
    if !crate::mlx::on_gpu() {
        return x.share();
    }
    let bits = match x.dtype().size() {
        1 => Dtype::U8,
        2 => Dtype::U16,
        4 => Dtype::U32,
        _ => Dtype::U64,
    };
    ops::view(x, bits)
}

/// A gathered array of `as_bits` back in its own type.
fn from_bits(x: Array, dtype: Dtype) -> crate::mlx::Result<Array> {
    if x.dtype() == dtype {
        Ok(x)
    } else {
        ops::view(&x, dtype)
    }
}

/// Indices as the GPU's one gather index type (see `as_bits`).
fn gather_indices(indices: &Array) -> crate::mlx::Result<Array> {
    if crate::mlx::on_gpu() && indices.dtype() != Dtype::S32 {
        ops::astype(indices, Dtype::S32)
    } else {
        indices.share()
    }
}

/// `taken` once its indices are checked.
fn checked(taken: Array, tensor: &Array, indices: &Array, axis: i32, a: &Term) -> Outputs {
    let shape = tensor.shape();
    if let Some(b) = bounds(indices, false)? {
        in_range(b.low[0], b.high[0], shape[axis as usize], axis, &shape)?;
    }
    finish(Ok(taken), a)
}

/// `indexed_add(target, indices, updates)`: duplicates accumulate.
pub fn indexed_add(x: &[&Array], a: &Term) -> Outputs {
    indexed(x, a, Combine::Add)
}

/// `indexed_put(target, indices, updates)`: the last update at an index wins,
/// as in Nx.BinaryBackend (see `last_of_each_row`).
pub fn indexed_put(x: &[&Array], a: &Term) -> Outputs {
    indexed(x, a, Combine::Put)
}

#[derive(Clone, Copy, PartialEq)]
enum Combine {
    Add,
    Put,
}

fn indexed(x: &[&Array], a: &Term, combine: Combine) -> Outputs {
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let (target, updates) = (to_out_type(x[0], a)?, to_out_type(x[2], a)?);
    let shape = target.shape();
    let flat = Indexed::new(&target, &axes)?;
    let ishape = x[1].shape();
    if ishape.len() != 2 || ishape[1] as usize != axes.len() {
        return Err(format!("indices must have shape [n, {}], got {ishape:?}", axes.len()));
    }
    // MLX's scatter writes each update slice without checking that it fits.
    let (ushape, rest) = (updates.shape(), &flat.permuted[axes.len()..]);
    if ushape.len() != rest.len() + 1 || ushape[0] != ishape[0] || ushape[1..].iter().zip(rest).any(|(u, t)| u > t) {
        return Err(format!(
            "updates of shape {ushape:?} do not fit indices {ishape:?} into {shape:?}"
        ));
    }
    if ishape[0] == 0 {
        return finish(target.share(), a);
    }
    let rows = flat.rows(x[1])?;
    // Updates [n, rest...] become slices [n, 1, rest...] of the flattened target.
    let mut slices = ushape.clone();
    slices.insert(1, 1);
    let updates = ops::reshape(&updates, &slices)?;
    let scattered = match combine {
        // SAFETY: `rows` are checked row numbers of `flat.array`.
        Combine::Add => unsafe { ops::scatter_add(&flat.array, &rows, &updates, 0) }?,
        Combine::Put => {
            let (rows, updates) = last_of_each_row(rows, updates, flat.rows_count())?;
            // SAFETY: as above: the kept rows are some of them.
            unsafe { ops::scatter(&flat.array, &rows, &updates, 0) }?
        }
    };
    finish(flat.restore(&scattered), a)
}

/// The rows and updates that remain when only the last update of each row
/// is kept (MLX's scatter writes duplicates in no set order; Nx's last
/// update wins). The row numbers are read back to find them.
fn last_of_each_row(rows: Array, updates: Array, total: i64) -> Result<(Array, Array), String> {
    let n = rows.size();
    let _scratch = budget::budget()
        .hold(scratch_bytes(n, total))
        .map_err(|e| e.to_string())?;
    let values = budget::read::<i32>(&rows)?;
    let keep = last_occurrences(&values, total);
    if keep.len() == n {
        return Ok((rows, updates));
    }
    let kept_rows: Vec<i32> = keep.iter().map(|&i| values[i]).collect();
    let positions: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
    let len = [keep.len() as i32];
    // SAFETY: `positions` are positions of `rows`, and so of `updates`.
    let updates = unsafe { ops::take(&updates, &Array::from_values(&positions, &len)?, 0) }?;
    Ok((Array::from_values(&kept_rows, &len)?, updates))
}

/// Few rows (against the number of values) are counted in a table, others
/// in a hash map.
fn few_rows(n: usize, rows: i64) -> bool {
    rows <= 4 * n as i64 + 4096
}

/// The most host memory `last_of_each_row` takes for `n` row numbers below
/// `rows`: the values, the positions kept, and the table or the hash map.
fn scratch_bytes(n: usize, rows: i64) -> usize {
    let lookup = if few_rows(n, rows) { rows as usize * 8 } else { n * 32 };
    n * 12 + lookup
}

/// For each distinct value (a row number below `rows`), the position of its
/// last occurrence, in order.
fn last_occurrences(values: &[i32], rows: i64) -> Vec<usize> {
    let mut keep: Vec<usize> = if few_rows(values.len(), rows) {
        // Few rows: a table indexed by row.
        let mut last = vec![usize::MAX; rows as usize];
        for (i, &v) in values.iter().enumerate() {
            last[v as usize] = i;
        }
        last.into_iter().filter(|&i| i != usize::MAX).collect()
    } else {
        let mut last = HashMap::with_capacity(values.len());
        for (i, &v) in values.iter().enumerate() {
            last.insert(v, i);
        }
        last.into_values().collect()
    };
    keep.sort_unstable();
    keep
}

/// A tensor with its indexed axes moved to the front and merged into one,
/// so that an index tuple becomes one row number.
struct Indexed {
    array: Array,
    axes: Vec<i32>,
    dims: Vec<i32>,
    shape: Vec<i32>,
    permuted: Vec<i32>,
    perm: Vec<i32>,
}

impl Indexed {
    fn new(tensor: &Array, axes: &[i32]) -> Result<Indexed, String> {
        let shape = tensor.shape();
        let rank = shape.len() as i32;
        if axes.iter().any(|&ax| ax < 0 || ax >= rank) || axes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!("axes {axes:?} must be increasing axes of a rank {rank} tensor"));
        }
        let rest: Vec<i32> = (0..rank).filter(|ax| !axes.contains(ax)).collect();
        let perm: Vec<i32> = axes.iter().chain(&rest).copied().collect();
        let permuted: Vec<i32> = perm.iter().map(|&ax| shape[ax as usize]).collect();
        let dims: Vec<i32> = axes.iter().map(|&ax| shape[ax as usize]).collect();
        let rows: i64 = dims.iter().map(|&d| d as i64).product();
        let rows = i32::try_from(rows).map_err(|_| format!("{rows} index combinations are too many"))?;
        let mut merged = vec![rows];
        merged.extend(rest.iter().map(|&ax| shape[ax as usize]));
        let array = ops::reshape(&ops::transpose(tensor, &perm)?, &merged)?;
        Ok(Indexed {
            array,
            axes: axes.to_vec(),
            dims,
            shape,
            permuted,
            perm,
        })
    }

    fn rows_count(&self) -> i64 {
        self.dims.iter().map(|&d| d as i64).product()
    }

    /// The row number (s32) of each index tuple, the last axis of `indices`,
    /// once every index is checked against its axis.
    fn rows(&self, indices: &Array) -> Result<Array, String> {
        let ishape = indices.shape();
        let tuples = &ishape[..ishape.len() - 1];
        if self.dims.is_empty() {
            return Ok(ops::broadcast_to(&int_scalar(0, Dtype::S32)?, tuples)?);
        }
        if let Some(b) = bounds(indices, true)? {
            for (j, (&dim, &axis)) in self.dims.iter().zip(&self.axes).enumerate() {
                in_range(b.low[j], b.high[j], dim, axis, &self.shape)?;
            }
        }
        // Row-major strides of the indexed axes; rows fit in s32 (`new`).
        let mut strides = vec![1i32; self.dims.len()];
        for j in (0..self.dims.len() - 1).rev() {
            strides[j] = strides[j + 1] * self.dims[j + 1];
        }
        let strides = Array::from_values(&strides, &[strides.len() as i32])?;
        let tuples = ops::astype(indices, Dtype::S32)?;
        Ok(ops::sum(&ops::multiply(&tuples, &strides)?, &[-1], false)?)
    }

    /// The merged array back in the original shape and axis order.
    fn restore(&self, merged: &Array) -> crate::mlx::Result<Array> {
        let unmerged = ops::reshape(merged, &self.permuted)?;
        ops::transpose(&unmerged, &inverse(&self.perm)?)
    }
}

/// Lowest and highest values, overall or per column.
pub(super) struct Bounds {
    pub(super) low: Vec<i64>,
    pub(super) high: Vec<i64>,
}

/// The lowest and highest values of an integer tensor, or of each column
/// (its last axis) when `per_column`; `None` when it has no elements. u64
/// values beyond i64 read as i64::MAX, which no axis can hold.
pub(super) fn bounds(indices: &Array, per_column: bool) -> Result<Option<Bounds>, String> {
    let dtype = indices.dtype();
    if dtype.is_inexact() || dtype == Dtype::Bool {
        return Err(format!("indices must be integers, got {:?}", dtype.nx()));
    }
    if indices.size() == 0 {
        return Ok(None);
    }
    let rank = indices.shape().len() as i32;
    let axes: Vec<i32> = (0..if per_column { rank - 1 } else { rank }).collect();
    let wide = if dtype == Dtype::U64 { Dtype::U64 } else { Dtype::S64 };
    let flat = |r: crate::mlx::Result<Array>| ops::astype(&ops::reshape(&r?, &[-1])?, wide);
    let low = flat(ops::min(indices, &axes, false))?;
    let high = flat(ops::max(indices, &axes, false))?;
    let both = ops::concatenate(&[&low, &high], 0)?;
    let values: Vec<i64> = if wide == Dtype::U64 {
        let values = budget::read::<u64>(&both)?;
        values
            .into_iter()
            .map(|v| i64::try_from(v).unwrap_or(i64::MAX))
            .collect()
    } else {
        budget::read::<i64>(&both)?
    };
    let (low, high) = values.split_at(values.len() / 2);
    Ok(Some(Bounds {
        low: low.to_vec(),
        high: high.to_vec(),
    }))
}

/// Fails when `low..=high` leaves `0..dim`, naming the offending index.
fn in_range(low: i64, high: i64, dim: i32, axis: i32, shape: &[i32]) -> Result<(), String> {
    let bad = if low < 0 {
        low
    } else if high >= dim as i64 {
        high
    } else {
        return Ok(());
    };
    Err(format!(
        "index {bad} is out of bounds for axis {axis} in shape {shape:?}"
    ))
}

/// `slice(tensor, starts, lengths, strides)` with some starts given as
/// scalar tensors: `starts` holds an integer or `nil` (the next tensor input)
/// per axis. Starts are clamped into the tensor, as Nx does.
pub fn slice(x: &[&Array], a: &Term) -> Outputs {
    let tensor = x[0];
    let lengths = attrs::ints(attrs::field(a, "lengths")?)?;
    let strides = attrs::positives(attrs::field(a, "strides")?)?;
    let shape = tensor.shape();
    let start = clamped_starts(attrs::field(a, "starts")?, &x[1..], &shape, &lengths)?;
    let axes: Vec<i32> = (0..shape.len() as i32).collect();
    let window = ops::slice_dynamic(tensor, &start, &axes, &lengths)?;
    if strides.iter().all(|&s| s == 1) {
        return finish(Ok(window), a);
    }
    let zeros = vec![0; shape.len()];
    finish(ops::slice(&window, &zeros, &lengths, &strides), a)
}

/// `put_slice(tensor, starts, slice)` with some starts given as scalar
/// tensors (see `slice`); both go to the output type first.
pub fn put_slice(x: &[&Array], a: &Term) -> Outputs {
    let (tensor, slice) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let shape = tensor.shape();
    let start = clamped_starts(attrs::field(a, "starts")?, &x[2..], &shape, &slice.shape())?;
    let axes: Vec<i32> = (0..shape.len() as i32).collect();
    finish(ops::slice_update_dynamic(&tensor, &slice, &start, &axes), a)
}

/// The start indices as one s64 vector, each clamped to `0..=dim - length`.
fn clamped_starts(starts: &Term, tensors: &[&Array], shape: &[i32], lengths: &[i32]) -> Result<Array, String> {
    let starts = starts
        .as_list()
        .ok_or_else(|| format!("starts must be a list, got {starts}"))?;
    if starts.len() != shape.len() || lengths.len() != shape.len() {
        return Err(format!("one start and length per axis of shape {shape:?}"));
    }
    let mut tensors = tensors.iter();
    let mut parts = Vec::with_capacity(starts.len());
    for ((start, &dim), &len) in starts.iter().zip(shape).zip(lengths) {
        let high = (dim as i64 - len as i64).max(0);
        let part = match start.as_int() {
            Some(i) => Array::from_values(&[i.clamp(0, high as i128) as i64], &[1])?,
            None if start.is_atom("nil") => {
                let t = tensors.next().ok_or("fewer start tensors than nil starts")?;
                let t = ops::reshape(t, &[1])?;
                // Unsigned starts are capped in their own type so the cast
                // to s64 cannot wrap them negative.
                let t = if matches!(t.dtype(), Dtype::U64) {
                    ops::minimum(&t, &Array::scalar(high as u64)?)?
                } else {
                    t
                };
                let t = ops::astype(&t, Dtype::S64)?;
                ops::minimum(&ops::maximum(&t, &Array::scalar(0i64)?)?, &Array::scalar(high)?)?
            }
            None => return Err(format!("a start must be an integer or nil, got {start}")),
        };
        parts.push(part);
    }
    if tensors.next().is_some() {
        return Err("more start tensors than nil starts".into());
    }
    let refs: Vec<&Array> = parts.iter().collect();
    Ok(ops::concatenate(&refs, 0)?)
}
