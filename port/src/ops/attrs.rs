//! Reading op attributes out of header terms, with errors that say what was
//! expected.

use crate::mlx::Dtype;
use crate::term::Term;

pub type AttrError = String;

pub fn dtype(t: &Term) -> Result<Dtype, AttrError> {
    Dtype::from_term(t).ok_or_else(|| format!("unsupported type {t}"))
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

pub fn boolean(t: &Term) -> Result<bool, AttrError> {
    match t.as_atom() {
        Some("true") => Ok(true),
        Some("false") => Ok(false),
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
