//! Matrix products and decompositions.

use super::{finish, to_out_type, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

pub fn matmul(x: &[&Array], a: &Term) -> Outputs {
    finish(ops::matmul(&to_out_type(x[0], a)?, &to_out_type(x[1], a)?), a)
}
