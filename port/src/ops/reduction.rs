//! Reductions over axes.

use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

pub fn sum(x: &[&Array], a: &Term) -> Outputs {
    let axes = attrs::ints(attrs::field(a, "axes")?)?;
    let keep = attrs::boolean(attrs::field(a, "keep_axes")?)?;
    finish(ops::sum(&to_out_type(x[0], a)?, &axes, keep), a)
}
