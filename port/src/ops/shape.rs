//! Ops that change an array's shape or element type.

use super::{attrs, finish, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

pub fn astype(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::astype(x[0], attrs::dtype(attrs::field(a, "type")?)?), a)
}

pub fn reshape(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::reshape(x[0], &attrs::ints(attrs::field(a, "shape")?)?), a)
}

pub fn broadcast_to(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::broadcast_to(x[0], &attrs::ints(attrs::field(a, "shape")?)?), a)
}
