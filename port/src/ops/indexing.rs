//! Indexing with Nx's semantics: gather, take, take_along_axis, indexed
//! add/put and slices whose start indices are tensors.
//!
//! MLX reads and writes out-of-range indices without checking (far out of
//! range the process dies, slightly out it returns garbage), so every index
//! is read back on the worker and checked before MLX sees it. Out-of-range
//! indices fail the op, as they raise in Nx.BinaryBackend.

use super::compose::inverse;
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::{ops, Array, Dtype};
use crate::term::Term;
use std::collections::HashMap;

/// `gather(tensor, indices)`: indices `[..., k]` address the `axes` of the
/// tensor; the result is `indices[..-1] ++ the other axes`.
pub fn gather(x: &[&Array], a: &Term) -> Outputs {
    let (tensor, indices) = (x[0], x[1]);
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let shape = tensor.shape();
    let ishape = indices.shape();
    let Some((&depth, outer)) = ishape.split_last() else {
        return Err("indices must have rank 1 or more".into());
    };
    let flat = Indexed::new(tensor, &axes)?;
    if depth as usize != axes.len() {
        return Err(format!(
            "indices have depth {depth} but {} axes are indexed",
            axes.len()
        ));
    }
    let linear = flat.linear(&read_indices(indices)?, &shape)?;
    let idx = index_array(&linear, outer, flat.rows())?;
    finish(ops::take(&flat.array, &idx, 0), a)
}

/// `take(tensor, indices, axis)`: the axis is replaced by the indices' shape.
pub fn take(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::int(attrs::field(a, "axis")?)?;
    check_axis_indices(x[0], x[1], axis)?;
    finish(ops::take(x[0], x[1], axis), a)
}

/// `take_along_axis(tensor, indices, axis)`: indices have the tensor's shape
/// except along the axis.
pub fn take_along_axis(x: &[&Array], a: &Term) -> Outputs {
    let axis = attrs::int(attrs::field(a, "axis")?)?;
    check_axis_indices(x[0], x[1], axis)?;
    finish(ops::take_along_axis(x[0], x[1], axis), a)
}

/// `indexed_add(target, indices, updates)`: duplicates accumulate.
pub fn indexed_add(x: &[&Array], a: &Term) -> Outputs {
    indexed(x, a, Combine::Add)
}

/// `indexed_put(target, indices, updates)`: the last update at an index wins,
/// as in Nx.BinaryBackend (MLX's scatter is unordered on duplicates, so only
/// the last update of each index is passed to it).
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
    let mut linear = flat.linear(&read_indices(x[1])?, &shape)?;
    if linear.is_empty() {
        return finish(target.share(), a);
    }
    // Updates [n, rest...] become slices [n, 1, rest...] of the flattened target.
    let mut slices = ushape.clone();
    slices.insert(1, 1);
    let mut updates = ops::reshape(&updates, &slices)?;
    if combine == Combine::Put {
        let keep = last_occurrences(&linear, flat.rows());
        if keep.len() < linear.len() {
            let positions: Vec<i64> = keep.iter().map(|&i| i as i64).collect();
            let n = positions.len() as i32;
            updates = ops::take(&updates, &Array::from_values(&positions, &[n])?, 0)?;
            linear = keep.iter().map(|&i| linear[i]).collect();
        }
    }
    let idx = index_array(&linear, &[linear.len() as i32], flat.rows())?;
    let scattered = match combine {
        Combine::Add => ops::scatter_add(&flat.array, &idx, &updates, 0)?,
        Combine::Put => ops::scatter(&flat.array, &idx, &updates, 0)?,
    };
    finish(flat.restore(&scattered), a)
}

/// A tensor with its indexed axes moved to the front and merged into one,
/// so that an index tuple becomes one row number.
struct Indexed {
    array: Array,
    axes: Vec<i32>,
    dims: Vec<i64>,
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
        let dims: Vec<i64> = axes.iter().map(|&ax| shape[ax as usize] as i64).collect();
        let rows: i64 = dims.iter().product();
        let rows = i32::try_from(rows).map_err(|_| format!("{rows} index combinations are too many"))?;
        let mut merged = vec![rows];
        merged.extend(rest.iter().map(|&ax| shape[ax as usize]));
        let array = ops::reshape(&ops::transpose(tensor, &perm)?, &merged)?;
        Ok(Indexed {
            array,
            axes: axes.to_vec(),
            dims,
            permuted,
            perm,
        })
    }

    fn rows(&self) -> i64 {
        self.dims.iter().product()
    }

    /// Row numbers of index tuples (rows of `values`), each checked.
    fn linear(&self, values: &[i64], shape: &[i32]) -> Result<Vec<i64>, String> {
        let k = self.dims.len();
        if k == 0 {
            return Ok(vec![0; values.len()]);
        }
        values
            .chunks(k)
            .map(|tuple| {
                tuple
                    .iter()
                    .zip(&self.dims)
                    .zip(&self.axes)
                    .try_fold(0i64, |acc, ((&i, &dim), &axis)| {
                        if i < 0 || i >= dim {
                            Err(format!("index {i} is out of bounds for axis {axis} in shape {shape:?}"))
                        } else {
                            Ok(acc * dim + i)
                        }
                    })
            })
            .collect()
    }

    /// The merged array back in the original shape and axis order.
    fn restore(&self, merged: &Array) -> crate::mlx::Result<Array> {
        let unmerged = ops::reshape(merged, &self.permuted)?;
        ops::transpose(&unmerged, &inverse(&self.perm))
    }
}

/// For each distinct value (a row number below `rows`), the position of its
/// last occurrence, in order.
fn last_occurrences(linear: &[i64], rows: i64) -> Vec<usize> {
    let mut keep: Vec<usize> = if rows <= 4 * linear.len() as i64 + 4096 {
        // Few rows: a table indexed by row.
        let mut last = vec![usize::MAX; rows as usize];
        for (i, &v) in linear.iter().enumerate() {
            last[v as usize] = i;
        }
        last.into_iter().filter(|&i| i != usize::MAX).collect()
    } else {
        let mut last = HashMap::with_capacity(linear.len());
        for (i, &v) in linear.iter().enumerate() {
            last.insert(v, i);
        }
        last.into_values().collect()
    };
    keep.sort_unstable();
    keep
}

/// Row numbers as an index array of `shape`, in the narrowest type MLX
/// indexes with that holds them.
fn index_array(linear: &[i64], shape: &[i32], rows: i64) -> Result<Array, String> {
    if rows <= i32::MAX as i64 {
        let narrow: Vec<i32> = linear.iter().map(|&i| i as i32).collect();
        Ok(Array::from_values(&narrow, shape)?)
    } else {
        Ok(Array::from_values(linear, shape)?)
    }
}

/// Checks that every element of `indices` addresses `tensor` along `axis`.
fn check_axis_indices(tensor: &Array, indices: &Array, axis: i32) -> Result<(), String> {
    let shape = tensor.shape();
    let dim = *shape
        .get(axis as usize)
        .ok_or_else(|| format!("axis {axis} is out of range for shape {shape:?}"))?;
    match read_indices(indices)?.into_iter().find(|&i| i < 0 || i >= dim as i64) {
        Some(i) => Err(format!("index {i} is out of bounds for axis {axis} in shape {shape:?}")),
        None => Ok(()),
    }
}

/// Evaluates an integer tensor and returns its elements (u64 values beyond
/// i64 are reported as i64::MAX, which no axis can hold).
pub(super) fn read_indices(indices: &Array) -> Result<Vec<i64>, String> {
    let dtype = indices.dtype();
    if dtype.is_float() || dtype == Dtype::Bool {
        return Err(format!("indices must be integers, got {:?}", dtype.nx()));
    }
    if dtype == Dtype::U64 {
        let evaluated = indices.evaluate()?;
        let values = evaluated.values::<u64>().ok_or("indices were not u64")?;
        return Ok(values.iter().map(|&v| i64::try_from(v).unwrap_or(i64::MAX)).collect());
    }
    let evaluated = ops::astype(indices, Dtype::S64)?.evaluate()?;
    Ok(evaluated.values::<i64>().ok_or("indices were not s64")?.to_vec())
}

/// `slice(tensor, starts, lengths, strides)` with some starts given as
/// scalar tensors: `starts` holds an integer or `nil` (the next tensor input)
/// per axis. Starts are clamped into the tensor, as Nx does.
pub fn slice(x: &[&Array], a: &Term) -> Outputs {
    let tensor = x[0];
    let lengths = attrs::ints(attrs::field(a, "lengths")?)?;
    let strides = attrs::ints(attrs::field(a, "strides")?)?;
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
