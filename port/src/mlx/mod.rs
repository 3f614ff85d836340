//! Safe Rust over the C++ shim: arrays that free themselves, errors as values.
//!
//! Every MLX call happens on the thread that owns the worker's stream (see
//! `session`), except reading and dropping arrays that are already evaluated,
//! which MLX allows from any thread.

mod array;
mod dtype;
mod ffi;
pub mod kernels;
pub mod memory;
pub mod ops;

pub use array::{Array, Buffer, Element, Evaluated};
pub use dtype::Dtype;

use std::ffi::CStr;
use std::fmt;
use std::os::raw::c_int;

/// What MLX threw, caught at the shim boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl Error {
    pub fn new(message: impl Into<String>) -> Error {
        Error {
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Builders report failures as strings; `?` converts.
impl From<Error> for String {
    fn from(e: Error) -> String {
        e.message
    }
}

fn check(code: c_int) -> Result<()> {
    if code == ffi::MOAT_OK {
        return Ok(());
    }
    // SAFETY: the shim returns a pointer to a thread-local NUL-terminated
    // string that stays valid until the next failing call on this thread.
    let message = unsafe { CStr::from_ptr(ffi::moat_last_error()) };
    Err(Error::new(message.to_string_lossy().into_owned()))
}

pub fn version() -> String {
    // SAFETY: MLX returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(ffi::moat_mlx_version()) }
        .to_string_lossy()
        .into_owned()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu = 0,
    Gpu = 1,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }

    pub fn available(self) -> bool {
        let mut out: c_int = 0;
        // SAFETY: `out` is a valid pointer for the duration of the call.
        check(unsafe { ffi::moat_device_available(self as c_int, &mut out) }).is_ok() && out == 1
    }

    /// Makes this the device of every op built afterwards on this thread.
    pub fn make_default(self) -> Result<()> {
        // SAFETY: plain value argument.
        check(unsafe { ffi::moat_set_default_device(self as c_int) })
    }
}

/// Evaluates the arrays' graphs; errors thrown inside kernels surface here.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<*mut ffi::moat_array> = arrays.iter().map(|a| a.raw()).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    check(unsafe { ffi::moat_eval(raw.as_ptr(), raw.len()) })
}

/// Schedules evaluation and returns at once.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<*mut ffi::moat_array> = arrays.iter().map(|a| a.raw()).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    check(unsafe { ffi::moat_async_eval(raw.as_ptr(), raw.len()) })
}
