//! One safe function per shim op, in one file per family. Ops build lazy
//! graph nodes; shape and type errors are reported here, kernel errors at
//! evaluation.

mod creation;
mod elementwise;
mod fast;
mod fft;
mod indexing;
mod linalg;
mod quant;
mod reduction;
mod shape;
mod window;

pub use creation::*;
pub use elementwise::*;
pub use fast::*;
pub use fft::*;
pub use indexing::*;
pub use linalg::*;
pub use quant::*;
pub use reduction::*;
pub use shape::*;
pub use window::*;

/// `fn name(a, b) -> Result<Array>` over `ffi::moat_name`.
macro_rules! binary {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, b: &Array) -> Result<Array> {
            // SAFETY: both inputs are live arrays borrowed for the call.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), b.raw(), out) })
        }
    )*};
}

/// `fn name(a) -> Result<Array>` over `ffi::moat_name`.
macro_rules! unary {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array) -> Result<Array> {
            // SAFETY: the input is a live array borrowed for the call.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), out) })
        }
    )*};
}

pub(crate) use binary;
pub(crate) use unary;
