//! Ops that change an array's shape or element type.

use super::{attrs, one, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

pub fn astype(x: &[&Array], a: &Term) -> Outputs {
    one(ops::astype(x[0], attrs::dtype(a)?))
}

pub fn reshape(x: &[&Array], a: &Term) -> Outputs {
    one(ops::reshape(x[0], &attrs::ints(a)?))
}

pub fn broadcast_to(x: &[&Array], a: &Term) -> Outputs {
    one(ops::broadcast_to(x[0], &attrs::ints(a)?))
}
