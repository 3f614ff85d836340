//! Element-wise ops with MLX broadcasting.

use super::{one, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

pub fn add(x: &[&Array], _: &Term) -> Outputs {
    one(ops::add(x[0], x[1]))
}

pub fn subtract(x: &[&Array], _: &Term) -> Outputs {
    one(ops::subtract(x[0], x[1]))
}

pub fn multiply(x: &[&Array], _: &Term) -> Outputs {
    one(ops::multiply(x[0], x[1]))
}

pub fn divide(x: &[&Array], _: &Term) -> Outputs {
    one(ops::divide(x[0], x[1]))
}
