//! Dot products and linear algebra with Nx's semantics.
//!
//! MLX multiplies matrices of floating types only; integer dot products are
//! computed exactly from f64 products of narrow limbs (see
//! `exact_int_matmul`). MLX's decompositions take f32 or f64, so narrower
//! floats are computed in f32 and converted back; complex inputs are left to
//! the client (Nx's default implementations).

use super::compose::{count, expand, squeeze, swap_last, unsigned};
use super::convert::{float_scalar, int_scalar};
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

// -- dot

/// `matmul(a, b)`: MLX's matrix product (batched over leading axes).
pub fn matmul(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::matmul(&to_out_type(x[0], a)?, &to_out_type(x[1], a)?), a)
}

/// `dot(a, contract_a, batch_a, b, contract_b, batch_b)`: the result's axes
/// are the batch axes, then a's free axes, then b's free axes.
pub fn dot(x: &[&Array], a: &Term) -> Outputs {
    let axes = |key| attrs::ints(attrs::field(a, key)?);
    let (ca, ba, cb, bb) = (
        axes("contract_a")?,
        axes("batch_a")?,
        axes("contract_b")?,
        axes("batch_b")?,
    );
    let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let (ls, rs) = (l.shape(), r.shape());
    let dims = |s: &[i32], axes: &[i32]| -> std::result::Result<Vec<i32>, String> {
        axes.iter()
            .map(|&i| {
                s.get(i as usize)
                    .copied()
                    .ok_or_else(|| format!("axis {i} out of range"))
            })
            .collect()
    };
    let free = |rank: usize, c: &[i32], b: &[i32]| -> Vec<i32> {
        (0..rank as i32).filter(|i| !c.contains(i) && !b.contains(i)).collect()
    };
    let (fa, fb) = (free(ls.len(), &ca, &ba), free(rs.len(), &cb, &bb));
    let (batch, k_dims) = (dims(&ls, &ba)?, dims(&ls, &ca)?);
    if dims(&rs, &bb)? != batch || dims(&rs, &cb)? != k_dims {
        return Err(format!("contracted or batch axes differ in size: {ls:?} and {rs:?}"));
    }
    let (m_dims, n_dims) = (dims(&ls, &fa)?, dims(&rs, &fb)?);
    let size = |d: &[i32]| i32::try_from(count(d)).map_err(|_| format!("dot: {d:?} has too many elements"));
    let (b, m, k, n) = (size(&batch)?, size(&m_dims)?, size(&k_dims)?, size(&n_dims)?);
    if let Some(product) = rows_by_matrix(&l, &r, (&fa, &ca, &ba), (&fb, &cb, &bb), (m, k, n))? {
        return finish(ops::reshape(&product, &[m_dims, n_dims].concat()), a);
    }
    let l3 = ops::reshape(&ops::transpose(&l, &[ba, fa, ca].concat())?, &[b, m, k])?;
    let r3 = ops::reshape(&ops::transpose(&r, &[bb, cb, fb].concat())?, &[b, k, n])?;
    let product = match l.dtype() {
        t if t.is_integer() => exact_int_matmul(&l3, &r3, k)?,
        // Half floats accumulate in f32 and round once, as Nx's do. MLX's
        // CUDA GEMMs (cuBLAS) do that themselves, at the tensor cores' rate.
        Dtype::F16 | Dtype::Bf16 if !crate::mlx::on_gpu() => {
            ops::matmul(&ops::astype(&l3, Dtype::F32)?, &ops::astype(&r3, Dtype::F32)?)?
        }
        _ => ops::matmul(&l3, &r3)?,
    };
    finish(ops::reshape(&product, &[batch, m_dims, n_dims].concat()), a)
}

/// The most rows of x an f32 product by a weight `{N, K}` takes through
/// `rows_by_matrix`.
const F32_ROWS: i32 = 6;

/// Rows that decode a transformer, `x {M, K}` by a weight `{N, K}` (or
/// `{K, N}`) with M <= 16, on the CPU: one pass over the weight in its own
/// storage (the shim's matvec), where sgemm would pack it first and half
/// floats would be copied to f32. `None` when the product is not of that form.
///
/// f32 takes them only where they beat OpenBLAS's sgemm (measured at K = N =
/// 4096, Zen 3, same run): a weight `{N, K}` up to `F32_ROWS` rows (4 rows:
/// 9.3 against 13.5 ms, 8 rows: 16.3 against 13.5), a weight `{K, N}` for one
/// row only (sgemv; 2 rows through the matvec's axpy: 27 against 9.6 ms).
fn rows_by_matrix(
    l: &Array,
    r: &Array,
    (fa, ca, ba): (&[i32], &[i32], &[i32]),
    (fb, cb, bb): (&[i32], &[i32], &[i32]),
    (m, k, n): (i32, i32, i32),
) -> Result<Option<Array>> {
    let floating = matches!(l.dtype(), Dtype::F32 | Dtype::F16 | Dtype::Bf16);
    let in_order = |axes: &[i32]| axes.iter().enumerate().all(|(i, &a)| a == i as i32);
    if crate::mlx::on_gpu() || !floating || r.dtype() != l.dtype() || m > 16 || !ba.is_empty() || !bb.is_empty() {
        return Ok(None);
    }
    // x's free axes then its contracted ones; the weight's free axes then
    // its contracted ones ({N, K}) or the other way round ({K, N}).
    if !in_order(&[fa, ca].concat()) {
        return Ok(None);
    }
    let transposed = if in_order(&[fb, cb].concat()) {
        false
    } else if in_order(&[cb, fb].concat()) {
        true
    } else {
        return Ok(None);
    };
    if l.dtype() == Dtype::F32 && m > if transposed { 1 } else { F32_ROWS } {
        return Ok(None);
    }
    let w = ops::reshape(r, &if transposed { [k, n] } else { [n, k] })?;
    Ok(Some(ops::matvec(&ops::reshape(l, &[m, k])?, &w, transposed)?))
}

/// `a @ b` for integer arrays, wrapping like Nx's integer arithmetic.
///
/// Each operand is split into limbs of `w` bits, narrow enough that every
/// f64 product-sum over `k` terms stays below 2^53 and is exact. Limb
/// products are recombined with shifts in u64, wrapping mod 2^64, which is
/// mod 2^bits of the output type; products whose shift reaches the type's
/// width vanish and are skipped.
fn exact_int_matmul(l: &Array, r: &Array, k: i32) -> Result<Array> {
    let dtype = l.dtype();
    let u = unsigned(dtype);
    let bits = (dtype.size() * 8) as u32;
    let log2_k = 64 - (k.max(1) as u64 - 1).leading_zeros();
    let w = ((53 - log2_k) / 2).min(16);
    let limbs = bits.div_ceil(w);
    let split = |x: &Array| -> Result<Vec<Array>> {
        let wide = ops::astype(&ops::view(x, u)?, Dtype::U64)?;
        let mask = int_scalar((1i64 << w) - 1, Dtype::U64)?;
        (0..limbs)
            .map(|i| {
                let shifted = ops::right_shift(&wide, &int_scalar((w * i) as i64, Dtype::U64)?)?;
                ops::astype(&ops::bitwise_and(&shifted, &mask)?, Dtype::F64)
            })
            .collect()
    };
    let (la, lb) = (split(l)?, split(r)?);
    let mut acc: Option<Array> = None;
    for i in 0..limbs {
        for j in 0..limbs - i {
            let shift = w * (i + j);
            if shift >= bits {
                break;
            }
            let part = ops::astype(&ops::matmul(&la[i as usize], &lb[j as usize])?, Dtype::U64)?;
            let part = ops::left_shift(&part, &int_scalar(shift as i64, Dtype::U64)?)?;
            acc = Some(match acc {
                Some(sum) => ops::add(&sum, &part)?,
                None => part,
            });
        }
    }
    let acc = acc.expect("at least one limb product");
    ops::view(&ops::astype(&acc, u)?, dtype)
}

// -- triangular solve

/// `triangular_solve(a, b)`: `a x = b` (left side) or `x a = b`, with `a`
/// lower or upper triangular and optionally transposed first.
///
/// Computed in f64 (MLX solves through a triangular inverse, whose rounding
/// in f32 shows in the last digits), as Nx.BinaryBackend computes it.
pub fn triangular_solve(x: &[&Array], a: &Term) -> Outputs {
    work_type(a)?;
    let work = Dtype::F64;
    let (am, b) = (ops::astype(x[0], work)?, ops::astype(x[1], work)?);
    let left = attrs::boolean(attrs::field(a, "left_side")?)?;
    let lower = attrs::boolean(attrs::field(a, "lower")?)?;
    let (am, lower) = match attrs::atom(attrs::field(a, "transform_a")?)? {
        // Conjugating a real matrix changes nothing.
        "none" | "conjugate" => (am, lower),
        "transpose" => (swap_last(&am)?, !lower),
        other => return Err(format!("unknown transform_a {other}")),
    };
    let vector = b.shape().len() + 1 == am.shape().len();
    let b = if vector {
        ops::reshape(&b, &[b.shape(), vec![1]].concat())?
    } else {
        b
    };
    let solved = if left {
        ops::solve_triangular(&am, &b, !lower)?
    } else {
        // x a = b  <=>  aᵀ xᵀ = bᵀ; a vector b is its own transpose.
        let bt = if vector { b } else { swap_last(&b)? };
        let xt = ops::solve_triangular(&swap_last(&am)?, &bt, lower)?;
        if vector {
            xt
        } else {
            swap_last(&xt)?
        }
    };
    let shape = x[1].shape();
    finish(ops::reshape(&solved, &shape), a)
}

// -- decompositions (Nx.Block.LinAlg.*)

/// `{q, r}` of Nx.Block.LinAlg.QR, `mode` reduced or complete. Signs follow
/// Nx's Householder convention: where a column is reflected, r's diagonal
/// entry is positive. Which columns Nx reflects is known from the input
/// (a column already zero below the diagonal is not), except where a
/// column becomes zero below the diagonal only after earlier reflections:
/// that depends on Nx's own reflectors, which LAPACK's are not, and such a
/// column is treated as reflected (a documented divergence).
pub fn qr(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let complete = attrs::atom(attrs::field(a, "mode")?)? == "complete";
    let eps = attrs::float(attrs::field(a, "eps")?)?;
    let am = ops::astype(x[0], work)?;
    let shape = am.shape();
    let (m, n) = matrix_dims(&shape)?;
    let k = m.min(n);
    let (q, r) = if complete && m > n {
        // The QR of [a | 0] (square) is a's complete QR: its first n columns
        // are reflected exactly as a's and the zero columns need no
        // reflection, so q is the product of a's n reflections, as in Nx.
        let zeros = ops::broadcast_to(
            &float_scalar(0.0, work)?,
            &[&shape[..shape.len() - 2], &[m, m - n]].concat(),
        )?;
        let [q, r] = ops::qr(&ops::concatenate(&[&am, &zeros], -1)?)?;
        (q, take_last(&r, -1, 0, n)?)
    } else {
        let [q, r] = ops::qr(&am)?;
        (q, r)
    };
    let signs = reflection_signs(&am, &r, m, k)?;
    let (qc, rr) = (q.shape()[q.shape().len() - 1], r.shape()[r.shape().len() - 2]);
    let q = ops::multiply(&q, &expand(&pad_ones(&signs, qc - k, work)?, -2)?)?;
    let r = ops::multiply(&r, &expand(&pad_ones(&signs, rr - k, work)?, -1)?)?;
    let (q, r) = (approximate_zeros(&q, eps)?, approximate_zeros(&r, eps)?);
    Ok(vec![finish_one(q, a)?, finish_one(r, a)?])
}

/// ±1 per diagonal entry of r, flipping where LAPACK's reflection left it
/// negative. Nx (like LAPACK) does not reflect a column whose entries below
/// the diagonal are already zero, as in the leading columns of a matrix that
/// starts upper triangular; those keep their sign. Nor does either reflect
/// the last column when m <= n: there q is square and both are products of
/// the same number of reflections (same determinant), so the signs multiply
/// to 1 and the last one follows from the others.
fn reflection_signs(am: &Array, r: &Array, m: i32, k: i32) -> Result<Array> {
    let work = am.dtype();
    let zero = float_scalar(0.0, work)?;
    let below = ops::tril(&take_last(am, -1, 0, k)?, -1)?;
    let column_nonzero = ops::any(&ops::not_equal(&below, &zero)?, &[-2], false)?;
    let reflected = cumulative_any(&column_nonzero)?;
    let negative = ops::less(&diagonal(&take_last(&take_last(r, -2, 0, k)?, -1, 0, k)?)?, &zero)?;
    let flip = ops::logical_and(&reflected, &negative)?;
    let signs = ops::where_(&flip, &float_scalar(-1.0, work)?, &float_scalar(1.0, work)?)?;
    if m > k || k == 1 {
        return Ok(signs);
    }
    let others = take_last(&signs, -1, 0, k - 1)?;
    let last = ops::prod(&others, &[-1], true)?;
    ops::concatenate(&[&others, &last], -1)
}

/// Nx.Block.LinAlg.Cholesky: the lower factor, from LAPACK. Where the
/// matrix is not positive definite MLX returns a partial factorisation; a
/// matrix of up to `CROUT_MAX` rows with a pivot that is not positive
/// (positive semi-definite with a zero pivot, or indefinite) is factored
/// again by Nx's own algorithm (`crout`), and checking its pivots evaluates
/// the factor in the worker. Larger ones stay lazy: their entries from the
/// first non-positive pivot on are NaN.
pub fn cholesky(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let am = ops::astype(x[0], work)?;
    let l = ops::cholesky(&am, false)?;
    let positive = ops::greater(&diagonal(&l)?, &float_scalar(0.0, work)?)?;
    let (n, _) = matrix_dims(&am.shape())?;
    let l = if n > CROUT_MAX {
        let failed = cumulative_any(&ops::logical_not(&positive)?)?;
        let block = ops::logical_and(&expand(&failed, -1)?, &expand(&failed, -2)?)?;
        // MLX's factor is zero above the diagonal, which stays so.
        ops::tril(&ops::where_(&block, &float_scalar(f64::NAN, work)?, &l)?, 0)?
    } else {
        let axes: Vec<i32> = (0..positive.shape().len() as i32).collect();
        let all_positive = ops::all(&positive, &axes, false)?;
        if crate::budget::read::<u8>(&ops::astype(&all_positive, Dtype::U8)?)? == [1] {
            l
        } else {
            crout(&am)?
        }
    };
    finish(approximate_zeros(&l, CHOLESKY_EPS), a)
}

/// The largest matrices whose pivots are checked (and refactored by Nx's
/// algorithm, n steps of O(n^2)) when one is not positive.
const CROUT_MAX: i32 = 256;

/// Nx's `eps` for Cholesky: added to each pivot it divides by, and the
/// threshold below which entries become zero.
const CHOLESKY_EPS: f64 = 1.0e-10;

/// Nx's Cholesky-Crout loop, column by column:
/// `l[j][j] = sqrt(a[j][j] - sum(l[j][k]^2))` and, below it,
/// `l[i][j] = (a[i][j] - sum(l[i][k] l[j][k])) / (l[j][j] + eps)`, k < j.
/// A negative pivot gives NaN from there on and a zero one divides by eps,
/// as in Nx.
fn crout(am: &Array) -> Result<Array> {
    let work = am.dtype();
    let shape = am.shape();
    let (n, _) = matrix_dims(&shape).map_err(crate::mlx::Error::new)?;
    let rows: Vec<i32> = (0..n).collect();
    let rows = Array::from_values(&rows, &[n])?;
    let mut l = ops::broadcast_to(&float_scalar(0.0, work)?, &shape)?;
    for j in 0..n {
        // Columns j.. of l are still zero, so full dot products sum over k < j.
        let row = take_last(&l, -2, j, 1)?;
        let sums = squeeze(&ops::matmul(&l, &swap_last(&row)?)?, -1)?;
        let column = squeeze(&take_last(am, -1, j, 1)?, -1)?;
        let pivot = ops::sqrt(&ops::subtract(
            &take_last(&column, -1, j, 1)?,
            &take_last(&sums, -1, j, 1)?,
        )?)?;
        let below = ops::divide(
            &ops::subtract(&column, &sums)?,
            &ops::add(&pivot, &float_scalar(CHOLESKY_EPS, work)?)?,
        )?;
        let j_at = int_scalar(j as i64, Dtype::S32)?;
        let value = ops::where_(&ops::equal(&rows, &j_at)?, &pivot, &below)?;
        let value = ops::where_(&ops::less(&rows, &j_at)?, &float_scalar(0.0, work)?, &value)?;
        let is_column = ops::equal(&rows, &j_at)?;
        l = ops::where_(&is_column, &expand(&value, -1)?, &l)?;
    }
    Ok(l)
}

/// Nx.Block.LinAlg.Eigh: eigenvalues by decreasing magnitude (as Nx sorts
/// them), eigenvectors as columns, each with its largest component positive.
pub fn eigh(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let eps = attrs::float(attrs::field(a, "eps")?)?;
    let [w, v] = ops::eigh(&ops::astype(x[0], work)?)?;
    let order = ops::argsort(&ops::negative(&ops::abs(&w)?)?, -1)?;
    let columns = ops::broadcast_to(&expand(&order, -2)?, &v.shape())?;
    // SAFETY: `order` is an argsort along the last axis, so its indices lie in it.
    let (w, v) = unsafe {
        (
            ops::take_along_axis(&w, &order, -1)?,
            ops::take_along_axis(&v, &columns, -1)?,
        )
    };
    let v = ops::multiply(&v, &largest_sign(&v, -2)?)?;
    Ok(vec![
        finish_one(approximate_zeros(&w, eps)?, a)?,
        finish_one(approximate_zeros(&v, eps)?, a)?,
    ])
}

/// Nx.Block.LinAlg.SVD: `{u, s, vt}`, singular values decreasing, each row
/// of vt with its largest component positive; `full_matrices` false keeps
/// min(m, n) columns of u and rows of vt.
pub fn svd(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let full = attrs::boolean(attrs::field(a, "full_matrices")?)?;
    let am = ops::astype(x[0], work)?;
    let (m, n) = matrix_dims(&am.shape())?;
    let k = m.min(n);
    let [u, s, vt] = ops::svd(&am)?;
    let top = take_last(&vt, -2, 0, k)?;
    let signs = largest_sign(&top, -1)?;
    let signs_row = swap_last(&signs)?;
    let (u, vt) = if full {
        let u_signs = pad_ones(&squeeze(&signs_row, -2)?, m - k, work)?;
        let vt_signs = pad_ones(&squeeze(&signs_row, -2)?, n - k, work)?;
        (
            ops::multiply(&u, &expand(&u_signs, -2)?)?,
            ops::multiply(&vt, &expand(&vt_signs, -1)?)?,
        )
    } else {
        (
            ops::multiply(&take_last(&u, -1, 0, k)?, &signs_row)?,
            ops::multiply(&top, &signs)?,
        )
    };
    // Flipping a zero leaves -0.0; adding +0.0 makes it 0.0 again.
    let zero = float_scalar(0.0, work)?;
    let (u, vt) = (ops::add(&u, &zero)?, ops::add(&vt, &zero)?);
    Ok(vec![finish_one(u, a)?, finish_one(s, a)?, finish_one(vt, a)?])
}

/// Nx.Block.LinAlg.LU: `{p, l, u}` with `a = p l u`, p a permutation matrix
/// of `p_type`.
pub fn lu(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let p_type = attrs::dtype(attrs::field(a, "p_type")?)?;
    let [pivots, l, u] = ops::lu(&ops::astype(x[0], work)?)?;
    let (n, _) = matrix_dims(&l.shape())?;
    // MLX: row i of a is row pivots[i] of l u, so p[i][pivots[i]] = 1.
    let columns: Vec<u32> = (0..n as u32).collect();
    let columns = Array::from_values(&columns, &[n])?;
    let p = ops::equal(&expand(&pivots, -1)?, &columns)?;
    Ok(vec![ops::astype(&p, p_type)?, finish_one(l, a)?, finish_one(u, a)?])
}

/// Nx.Block.LinAlg.Solve: `a x = b` for a square `a`; `b` a vector or a
/// matrix of right-hand sides.
pub fn solve(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let (am, b) = (ops::astype(x[0], work)?, ops::astype(x[1], work)?);
    let shape = b.shape();
    let vector = shape.len() + 1 == am.shape().len();
    let b = if vector {
        ops::reshape(&b, &[shape.clone(), vec![1]].concat())?
    } else {
        b
    };
    finish(ops::reshape(&ops::solve(&am, &b)?, &shape), a)
}

/// Nx.Block.LinAlg.Determinant: by the closed forms Nx uses for 2x2 and
/// 3x3 matrices (exact on small integers), else from an LU factorisation.
pub fn determinant(x: &[&Array], a: &Term) -> Outputs {
    let work = work_type(a)?;
    let am = ops::astype(x[0], work)?;
    let (n, _) = matrix_dims(&am.shape())?;
    let e = |i: i32, j: i32| -> Result<Array> {
        let entry = take_last(&take_last(&am, -2, i, 1)?, -1, j, 1)?;
        squeeze(&squeeze(&entry, -1)?, -1)
    };
    let det = match n {
        0 => ops::broadcast_to(&float_scalar(1.0, work)?, &am.shape()[..am.shape().len() - 2])?,
        1 => e(0, 0)?,
        2 => ops::subtract(
            &ops::multiply(&e(0, 0)?, &e(1, 1)?)?,
            &ops::multiply(&e(0, 1)?, &e(1, 0)?)?,
        )?,
        3 => {
            let term = |(i, j, k): (i32, i32, i32)| -> Result<Array> {
                ops::multiply(&ops::multiply(&e(0, i)?, &e(1, j)?)?, &e(2, k)?)
            };
            let plus = ops::add(&ops::add(&term((0, 1, 2))?, &term((1, 2, 0))?)?, &term((2, 0, 1))?)?;
            let minus = ops::add(&ops::add(&term((2, 1, 0))?, &term((0, 2, 1))?)?, &term((1, 0, 2))?)?;
            ops::subtract(&plus, &minus)?
        }
        _ => lu_determinant(&am)?,
    };
    finish(Ok(det), a)
}

/// sign(pivots) * prod(diag(u)).
fn lu_determinant(am: &Array) -> Result<Array> {
    let [pivots, _, u] = ops::lu(am)?;
    let product = ops::prod(&diagonal(&u)?, &[-1], false)?;
    // The permutation's parity: the number of inversions in `pivots`.
    let p = ops::astype(&pivots, Dtype::S32)?;
    // Pairs i < j with p[i] > p[j]: below the diagonal of `earlier`, which
    // is `later` transposed.
    let earlier = ops::less(&expand(&p, -1)?, &expand(&p, -2)?)?;
    let pairs = ops::tril(&ops::astype(&earlier, Dtype::S32)?, -1)?;
    let inversions = ops::sum(&pairs, &[-2, -1], false)?;
    let odd = ops::equal(
        &ops::remainder(&inversions, &int_scalar(2, Dtype::S32)?)?,
        &int_scalar(1, Dtype::S32)?,
    )?;
    ops::where_(&odd, &ops::negative(&product)?, &product)
}

// -- helpers

/// The type decompositions compute in: f64 for f64 results, else f32.
fn work_type(a: &Term) -> std::result::Result<Dtype, String> {
    match attrs::out_type(a)? {
        Some(Dtype::F64) => Ok(Dtype::F64),
        Some(Dtype::C64) => Err("complex matrices are not supported by MLX's linear algebra".into()),
        _ => Ok(Dtype::F32),
    }
}

fn finish_one(x: Array, a: &Term) -> std::result::Result<Array, String> {
    Ok(finish(Ok(x), a)?.pop().expect("one output"))
}

fn matrix_dims(shape: &[i32]) -> std::result::Result<(i32, i32), String> {
    match shape {
        [.., m, n] => Ok((*m, *n)),
        _ => Err(format!("expected a matrix or a batch of matrices, got shape {shape:?}")),
    }
}

/// `x[..., start:start+len]` along `axis` (negative: from the end).
fn take_last(x: &Array, axis: i32, start: i32, len: i32) -> Result<Array> {
    let shape = x.shape();
    let axis = (shape.len() as i32 + axis) as usize;
    let mut lo = vec![0; shape.len()];
    let mut hi = shape.clone();
    lo[axis] = start;
    hi[axis] = start + len;
    ops::slice(x, &lo, &hi, &vec![1; shape.len()])
}

/// The diagonal of each matrix: `[..., n, n] -> [..., n]`.
fn diagonal(x: &Array) -> Result<Array> {
    ops::diagonal(x, 0, -2, -1)
}

/// `flags[..., i]` is true where any of `flags[..., 0..=i]` is.
fn cumulative_any(flags: &Array) -> Result<Array> {
    let running = ops::cummax(&ops::astype(flags, Dtype::U8)?, -1, false)?;
    ops::astype(&running, Dtype::Bool)
}

/// `signs[..., k]` followed by `extra` ones.
fn pad_ones(signs: &Array, extra: i32, work: Dtype) -> Result<Array> {
    if extra <= 0 {
        return signs.share();
    }
    let mut shape = signs.shape();
    *shape.last_mut().expect("rank >= 1") = extra;
    let ones = ops::broadcast_to(&float_scalar(1.0, work)?, &shape)?;
    ops::concatenate(&[signs, &ones], -1)
}

/// ±1 per vector along `axis` (the other matrix axis kept as size 1): the
/// sign of each vector's component of largest magnitude (the first on ties).
fn largest_sign(v: &Array, axis: i32) -> Result<Array> {
    let at = ops::argmax(&ops::abs(v)?, axis, true)?;
    // SAFETY: `at` is an argmax along `axis`, so its indices lie in it.
    let value = unsafe { ops::take_along_axis(v, &at, axis) }?;
    let negative = ops::less(&value, &float_scalar(0.0, v.dtype())?)?;
    ops::where_(
        &negative,
        &float_scalar(-1.0, v.dtype())?,
        &float_scalar(1.0, v.dtype())?,
    )
}

/// Entries within `eps` of zero become zero, as Nx's algorithms round them.
fn approximate_zeros(x: &Array, eps: f64) -> Result<Array> {
    let small = ops::logical_not(&ops::greater(&ops::abs(x)?, &float_scalar(eps, x.dtype())?)?)?;
    // NaN is not small: `!(|NaN| > eps)` is true, so keep NaN explicitly.
    let small = ops::logical_and(&small, &ops::equal(x, x)?)?;
    ops::where_(&small, &float_scalar(0.0, x.dtype())?, x)
}
