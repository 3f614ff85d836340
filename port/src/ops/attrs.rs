//! Reading op attributes out of header terms, with errors that say what was
//! expected.

use crate::mlx::Dtype;
use crate::term::Term;

pub type AttrError = String;

pub fn dtype(t: &Term) -> Result<Dtype, AttrError> {
    crate::protocol::dtype(t).ok_or_else(|| format!("unsupported type {t}"))
}

pub fn int(t: &Term) -> Result<i32, AttrError> {
    t.as_int()
        .and_then(|i| i32::try_from(i).ok())
        .ok_or_else(|| format!("expected a 32-bit integer, got {t}"))
}

pub fn ints(t: &Term) -> Result<Vec<i32>, AttrError> {
    t.as_list()
        .ok_or_else(|| format!("expected a list of integers, got {t}"))?
        .iter()
        .map(int)
        .collect()
}

/// An axis of a tensor of rank `rank`.
pub fn axis(t: &Term, rank: usize) -> Result<i32, AttrError> {
    let axis = int(t)?;
    if axis < 0 || axis as usize >= rank {
        return Err(format!("axis {axis} is out of range for a tensor of rank {rank}"));
    }
    Ok(axis)
}

/// A permutation of `0..rank`.
pub fn permutation(t: &Term, rank: usize) -> Result<Vec<i32>, AttrError> {
    let perm = ints(t)?;
    let mut seen = vec![false; rank];
    let valid = perm.len() == rank
        && perm.iter().all(|&p| {
            let fresh = usize::try_from(p).ok().filter(|&i| i < rank).is_some_and(|i| !seen[i]);
            if fresh {
                seen[p as usize] = true;
            }
            fresh
        });
    if !valid {
        return Err(format!("{perm:?} is not a permutation of the {rank} axes"));
    }
    Ok(perm)
}

/// Integers that must each be at least 1 (strides, dilations, group sizes):
/// MLX divides by them.
pub fn positives(t: &Term) -> Result<Vec<i32>, AttrError> {
    let values = ints(t)?;
    if values.iter().any(|&v| v < 1) {
        return Err(format!("expected positive integers, got {values:?}"));
    }
    Ok(values)
}

pub fn positive(t: &Term) -> Result<i32, AttrError> {
    match int(t)? {
        v if v >= 1 => Ok(v),
        v => Err(format!("expected a positive integer, got {v}")),
    }
}

pub fn float(t: &Term) -> Result<f64, AttrError> {
    match t {
        Term::Float(f) => Ok(*f),
        Term::Int(i) => Ok(*i as f64),
        _ => Err(format!("expected a number, got {t}")),
    }
}

pub fn atom(t: &Term) -> Result<&str, AttrError> {
    t.as_atom().ok_or_else(|| format!("expected an atom, got {t}"))
}

/// `true`, or `false` or `nil`: Elixir's falsy values, which Nx passes for
/// options it leaves unset (`equal_nan: nil`).
pub fn boolean(t: &Term) -> Result<bool, AttrError> {
    match t.as_atom() {
        Some("true") => Ok(true),
        Some("false" | "nil") => Ok(false),
        _ => Err(format!("expected a boolean, got {t}")),
    }
}

pub fn field<'a>(attrs: &'a Term, key: &str) -> Result<&'a Term, AttrError> {
    attrs.get(key).ok_or_else(|| format!("missing attribute {key}"))
}

/// The optional `type` key: the op's output type.
pub fn out_type(attrs: &Term) -> Result<Option<Dtype>, AttrError> {
    attrs.get("type").map(dtype).transpose()
}
