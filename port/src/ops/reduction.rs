//! Reductions over axes.

use super::{attrs, one, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

pub fn sum(x: &[&Array], a: &Term) -> Outputs {
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let keepdims = attrs::boolean(attrs::field(a, "keepdims")?)?;
    one(ops::sum(x[0], &axes, keepdims))
}
