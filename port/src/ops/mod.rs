//! The op table: every graph-building op the protocol accepts, by name.
//!
//! A builder takes its input arrays and the request's attrs and returns the
//! arrays it defines (lazy MLX graph nodes). It fails with a message; the
//! session turns that into poisoned outputs that name the op.

mod attrs;
mod elementwise;
mod linalg;
mod reduction;
mod shape;

use crate::mlx::Array;
use crate::term::Term;

pub use attrs::AttrError;

pub type Outputs = Result<Vec<Array>, String>;
pub type Builder = fn(&[&Array], &Term) -> Outputs;

/// One entry per op: name, number of inputs, builder.
const TABLE: &[(&str, usize, Builder)] = &[
    ("add", 2, elementwise::add),
    ("subtract", 2, elementwise::subtract),
    ("multiply", 2, elementwise::multiply),
    ("divide", 2, elementwise::divide),
    ("astype", 1, shape::astype),
    ("reshape", 1, shape::reshape),
    ("broadcast_to", 1, shape::broadcast_to),
    ("sum", 1, reduction::sum),
    ("matmul", 2, linalg::matmul),
];

pub fn builder(op: &str) -> Option<(usize, Builder)> {
    TABLE.iter().find(|(name, _, _)| *name == op).map(|(_, arity, b)| (*arity, *b))
}

/// Turns an MLX or attribute error into the message an op fails with.
fn one(result: crate::mlx::Result<Array>) -> Outputs {
    result.map(|a| vec![a]).map_err(|e| e.message)
}
