//! The op table: every graph-building op the protocol accepts, by name, one
//! file per family.
//!
//! Ops are Nx's backend callbacks, one frame each: the worker does the type
//! conversions Nx's semantics need, so the client never sends helper ops.
//! A builder takes its input arrays and the request's attrs and returns the
//! arrays it defines (lazy MLX graph nodes). Attrs are a map; its `type` key,
//! when present, is the output type and the result is converted to it. A
//! builder fails with a message; the session turns that into poisoned outputs
//! that name the op.

mod attrs;
mod compose;
mod elementwise;
mod fft;
mod indexing;
mod integer;
mod linalg;
mod reduction;
mod shape;
mod window;

use crate::mlx::{ops, Array};
use crate::term::Term;

pub use attrs::AttrError;

pub type Outputs = Result<Vec<Array>, String>;
pub type Builder = fn(&[&Array], &Term) -> Outputs;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    Exactly(usize),
    AtLeast(usize),
}

impl Arity {
    pub fn accepts(self, n: usize) -> bool {
        match self {
            Arity::Exactly(k) => n == k,
            Arity::AtLeast(k) => n >= k,
        }
    }
}

impl std::fmt::Display for Arity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arity::Exactly(k) => write!(f, "{k}"),
            Arity::AtLeast(k) => write!(f, "at least {k}"),
        }
    }
}

#[allow(unused_imports)]
use Arity::{AtLeast, Exactly as N};

/// One entry per op: name, inputs, builder. Grouped by family.
const TABLE: &[(&str, Arity, Builder)] = &[
    // shape and type
    ("astype", N(1), shape::astype),
    ("reshape", N(1), shape::reshape),
    ("broadcast_to", N(1), shape::broadcast_to),
    // element-wise
    ("add", N(2), elementwise::add),
    ("subtract", N(2), elementwise::subtract),
    ("multiply", N(2), elementwise::multiply),
    ("divide", N(2), elementwise::divide),
    // integer arithmetic
    ("quotient", N(2), integer::quotient),
    ("remainder", N(2), integer::remainder),
    ("population_count", N(1), integer::population_count),
    ("count_leading_zeros", N(1), integer::count_leading_zeros),
    // reductions
    ("sum", N(1), reduction::sum),
    // indexing
    ("gather", N(2), indexing::gather),
    ("take", N(2), indexing::take),
    ("take_along_axis", N(2), indexing::take_along_axis),
    ("indexed_add", N(3), indexing::indexed_add),
    ("indexed_put", N(3), indexing::indexed_put),
    ("dynamic_slice", AtLeast(1), indexing::dynamic_slice),
    ("dynamic_put_slice", AtLeast(2), indexing::dynamic_put_slice),
    // linear algebra
    ("matmul", N(2), linalg::matmul),
    ("dot", N(2), linalg::dot),
    ("triangular_solve", N(2), linalg::triangular_solve),
    ("qr", N(1), linalg::qr),
    ("cholesky", N(1), linalg::cholesky),
    ("eigh", N(1), linalg::eigh),
    ("svd", N(1), linalg::svd),
    ("lu", N(1), linalg::lu),
    ("solve", N(2), linalg::solve),
    ("determinant", N(1), linalg::determinant),
    // windows and convolution
    ("conv", N(2), window::conv),
    ("window_sum", N(1), window::window_sum),
    ("window_product", N(1), window::window_product),
    ("window_max", N(1), window::window_max),
    ("window_min", N(1), window::window_min),
    ("window_scatter_max", N(3), window::window_scatter_max),
    ("window_scatter_min", N(3), window::window_scatter_min),
    // fft
    ("fft", N(1), fft::fft),
    ("ifft", N(1), fft::ifft),
    ("fft2", N(1), fft::fft2),
    ("ifft2", N(1), fft::ifft2),
    ("rfft", N(1), fft::rfft),
    ("irfft", N(1), fft::irfft),
];

pub fn builder(op: &str) -> Option<(Arity, Builder)> {
    TABLE.iter().find(|(name, _, _)| *name == op).map(|(_, arity, b)| (*arity, *b))
}

/// Every op name in the table (for tests and diagnostics).
pub fn names() -> impl Iterator<Item = &'static str> {
    TABLE.iter().map(|(name, _, _)| *name)
}

/// The single output of an op, converted to the attrs' `type` if it has one.
fn finish(result: crate::mlx::Result<Array>, a: &Term) -> Outputs {
    let array = result.map_err(|e| e.message)?;
    match attrs::out_type(a)? {
        Some(t) if t != array.dtype() => Ok(vec![ops::astype(&array, t).map_err(|e| e.message)?]),
        _ => Ok(vec![array]),
    }
}

/// `x` converted to the attrs' `type` (inputs of arithmetic take the output
/// type first, as Nx does).
fn to_out_type(x: &Array, a: &Term) -> Result<Array, String> {
    match attrs::out_type(a)? {
        Some(t) if t != x.dtype() => ops::astype(x, t).map_err(|e| e.message),
        _ => x.share().map_err(|e| e.message),
    }
}
