//! The KV cache's write (Moat.KVCache): new rows into a cache buffer, in
//! place when nothing else holds the buffer.
//!
//! `kv_write` is `slice_update` at a start read from a tensor, checked: rows
//! past the cache's end fail the op instead of being clamped as Nx's
//! `put_slice` would clamp them. Eagerly, the session then moves the cache
//! out of its id (`MOVES_FIRST_INPUT`), so that the graph node holds the
//! only handle and MLX writes into the same buffer when it evaluates it
//! (MLX donates an input that a single handle holds; any other holder, a
//! view or a pending op that reads the old contents, makes it copy).

use super::{attrs, finish, Outputs};
use crate::budget;
use crate::mlx::Array;
use crate::mlx::{ops, Dtype};
use crate::term::Term;

/// Ops whose first input the session moves out of its id when they build:
/// the id then reads as a failure that says where its contents went.
pub const MOVES_FIRST_INPUT: &[&str] = &["kv_write"];

/// `[cache, rows, offset]`: attrs `axis`. `rows` matches `cache` on every
/// axis but `axis` and is converted to the cache's type; `offset` is an
/// integer scalar, with `offset + rows` at most the cache's length there.
pub fn kv_write(x: &[&Array], a: &Term) -> Outputs {
    let (cache, rows, offset) = (x[0], x[1], x[2]);
    let shape = cache.shape();
    let axis = attrs::axis(attrs::field(a, "axis")?, shape.len())? as usize;
    let new = rows.shape();
    let agrees = new.len() == shape.len()
        && new
            .iter()
            .zip(&shape)
            .enumerate()
            .all(|(i, (n, c))| i == axis || n == c);
    if !agrees {
        return Err(format!(
            "rows of shape {new:?} do not fit a cache of shape {shape:?} (they must agree on every axis but {axis})"
        ));
    }
    if !offset.dtype().is_integer() || !offset.shape().is_empty() {
        return Err(format!(
            "the offset must be an integer scalar, got {} of shape {:?}",
            crate::protocol::dtype_term(offset.dtype()),
            offset.shape()
        ));
    }
    let at = budget::read::<i64>(&ops::astype(offset, Dtype::S64)?)?[0];
    let (len, count) = (shape[axis] as i64, new[axis] as i64);
    if at < 0 || at + count > len {
        return Err(format!(
            "offset {at} with {count} new rows is outside the cache's {len} rows along axis {axis}"
        ));
    }
    let rows = if rows.dtype() == cache.dtype() {
        rows.share()?
    } else {
        ops::astype(rows, cache.dtype())?
    };
    let mut start = vec![0; shape.len()];
    let mut stop = shape.clone();
    start[axis] = at as i32;
    stop[axis] = (at + count) as i32;
    finish(ops::slice_update(cache, &rows, &start, &stop, &vec![1; shape.len()]), a)
}
