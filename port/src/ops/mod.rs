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

pub(crate) mod attrs;
mod cache;
mod compose;
mod convert;
mod creation;
mod elementwise;
mod fast;
mod fft;
mod indexing;
mod integer;
mod linalg;
mod nx_complex;
mod precise;
mod quant;
mod reduction;
mod shape;
mod window;

use crate::mlx::{ops, Array};
use crate::term::Term;

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

use Arity::{AtLeast, Exactly as N};

/// An op table entry: name, inputs, builder.
pub type Entry = (&'static str, Arity, Builder);

/// One entry per op. Grouped by family.
const TABLE: &[Entry] = &[
    // creation
    ("constant", N(0), creation::constant),
    ("iota", N(0), creation::iota),
    ("eye", N(0), creation::eye),
    // shape and type
    ("astype", N(1), shape::astype),
    ("reshape", N(1), shape::reshape),
    ("broadcast_to", N(1), shape::broadcast_to),
    ("bitcast", N(1), shape::bitcast),
    ("broadcast", N(1), shape::broadcast),
    ("transpose", N(1), shape::transpose),
    ("reverse", N(1), shape::reverse),
    ("pad", N(2), shape::pad),
    ("concatenate", AtLeast(1), shape::concatenate),
    ("stack", AtLeast(1), shape::stack),
    ("select", N(3), shape::select),
    ("clip", N(3), shape::clip),
    ("copy", N(1), shape::copy),
    // element-wise
    ("add", N(2), elementwise::add),
    ("subtract", N(2), elementwise::subtract),
    ("multiply", N(2), elementwise::multiply),
    ("divide", N(2), elementwise::divide),
    ("pow", N(2), elementwise::pow),
    ("atan2", N(2), elementwise::atan2),
    ("min", N(2), elementwise::min),
    ("max", N(2), elementwise::max),
    ("bitwise_and", N(2), elementwise::bitwise_and),
    ("bitwise_or", N(2), elementwise::bitwise_or),
    ("bitwise_xor", N(2), elementwise::bitwise_xor),
    ("left_shift", N(2), elementwise::left_shift),
    ("right_shift", N(2), elementwise::right_shift),
    ("equal", N(2), elementwise::equal),
    ("not_equal", N(2), elementwise::not_equal),
    ("greater", N(2), elementwise::greater),
    ("less", N(2), elementwise::less),
    ("greater_equal", N(2), elementwise::greater_equal),
    ("less_equal", N(2), elementwise::less_equal),
    ("logical_and", N(2), elementwise::logical_and),
    ("logical_or", N(2), elementwise::logical_or),
    ("logical_xor", N(2), elementwise::logical_xor),
    ("exp", N(1), elementwise::exp),
    ("expm1", N(1), elementwise::expm1),
    ("log", N(1), elementwise::log),
    ("log1p", N(1), elementwise::log1p),
    ("sigmoid", N(1), elementwise::sigmoid),
    ("cos", N(1), elementwise::cos),
    ("sin", N(1), elementwise::sin),
    ("tan", N(1), elementwise::tan),
    ("cosh", N(1), elementwise::cosh),
    ("sinh", N(1), elementwise::sinh),
    ("tanh", N(1), elementwise::tanh),
    ("acos", N(1), elementwise::acos),
    ("asin", N(1), elementwise::asin),
    ("atan", N(1), elementwise::atan),
    ("acosh", N(1), elementwise::acosh),
    ("asinh", N(1), elementwise::asinh),
    ("atanh", N(1), elementwise::atanh),
    ("sqrt", N(1), elementwise::sqrt),
    ("rsqrt", N(1), elementwise::rsqrt),
    ("cbrt", N(1), elementwise::cbrt),
    ("erf", N(1), elementwise::erf),
    ("erfc", N(1), elementwise::erfc),
    ("erf_inv", N(1), elementwise::erf_inv),
    ("abs", N(1), elementwise::abs),
    ("bitwise_not", N(1), elementwise::bitwise_not),
    ("ceil", N(1), elementwise::ceil),
    ("conjugate", N(1), elementwise::conjugate),
    ("floor", N(1), elementwise::floor),
    ("negate", N(1), elementwise::negate),
    ("round", N(1), elementwise::round),
    ("sign", N(1), elementwise::sign),
    ("real", N(1), elementwise::real),
    ("imag", N(1), elementwise::imag),
    ("is_nan", N(1), elementwise::is_nan),
    ("is_infinity", N(1), elementwise::is_infinity),
    ("logical_not", N(1), elementwise::logical_not),
    ("phase", N(1), elementwise::phase),
    // integer arithmetic
    ("quotient", N(2), integer::quotient),
    ("remainder", N(2), integer::remainder),
    ("population_count", N(1), integer::population_count),
    ("count_leading_zeros", N(1), integer::count_leading_zeros),
    // reductions, cumulative ops and sorting
    ("sum", N(1), reduction::sum),
    ("product", N(1), reduction::product),
    ("reduce_max", N(1), reduction::reduce_max),
    ("reduce_min", N(1), reduction::reduce_min),
    ("all", N(1), reduction::all),
    ("any", N(1), reduction::any),
    ("argmax", N(1), reduction::argmax),
    ("argmin", N(1), reduction::argmin),
    ("cumulative_sum", N(1), reduction::cumulative_sum),
    ("cumulative_product", N(1), reduction::cumulative_product),
    ("cumulative_min", N(1), reduction::cumulative_min),
    ("cumulative_max", N(1), reduction::cumulative_max),
    ("sort", N(1), reduction::sort),
    ("argsort", N(1), reduction::argsort),
    ("top_k", N(1), reduction::top_k),
    ("all_close", N(2), reduction::all_close),
    // indexing
    ("gather", N(2), indexing::gather),
    ("take", N(2), indexing::take),
    ("take_along_axis", N(2), indexing::take_along_axis),
    ("indexed_add", N(3), indexing::indexed_add),
    ("indexed_put", N(3), indexing::indexed_put),
    ("slice", AtLeast(1), indexing::slice),
    ("put_slice", AtLeast(2), indexing::put_slice),
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
    // fast kernels (Moat.Fast)
    ("fast_rms_norm", N(2), fast::rms_norm),
    ("fast_layer_norm", AtLeast(2), fast::layer_norm),
    ("fast_rope", AtLeast(1), fast::rope),
    ("fast_sdpa", AtLeast(3), fast::sdpa),
    // the KV cache (Moat.KVCache)
    ("kv_write", N(3), cache::kv_write),
    // quantized weights (Moat.quantize)
    ("quantize", N(1), quant::quantize),
    ("dequantize", N(1), quant::dequantize),
    ("quantized_matmul", N(2), quant::quantized_matmul),
    ("gather_qmm", AtLeast(3), quant::gather_qmm),
];

pub use cache::MOVES_FIRST_INPUT;

/// The graph ops, in table order.
pub fn names() -> impl Iterator<Item = &'static str> {
    TABLE.iter().map(|(name, _, _)| *name)
}

/// The op's entry, found once as its request is decoded (`session::Call`).
pub fn entry(op: &str) -> Option<&'static Entry> {
    TABLE.iter().find(|(name, _, _)| *name == op)
}

pub fn builder(op: &str) -> Option<(Arity, Builder)> {
    entry(op).map(|(_, arity, b)| (*arity, *b))
}

/// Runs a builder. On the GPU, an op that MLX's CUDA backend refuses to
/// build (float64 inside, or a kernel it lacks, such as int64 scatter) is
/// built on the CPU instead, from the same inputs and to the same types:
/// MLX moves the data between the devices.
pub fn build(builder: Builder, inputs: &[&Array], a: &Term) -> Outputs {
    match builder(inputs, a) {
        Err(e) if crate::mlx::on_gpu() && gpu_unsupported(&e) => crate::mlx::on_cpu(|| builder(inputs, a)),
        other => other,
    }
}

fn gpu_unsupported(message: &str) -> bool {
    message.contains("not supported on the GPU") || message.contains("GPU scatter does not yet support")
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
