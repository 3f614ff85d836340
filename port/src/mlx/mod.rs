//! Safe Rust over the C++ shim: arrays that free themselves, errors as values.
//!
//! Every MLX call happens on the thread that owns the worker's stream (see
//! `session`), except reading and dropping arrays that are already evaluated,
//! which MLX allows from any thread.

mod array;
mod compiled;
mod dtype;
mod ffi;
pub mod kernels;
pub mod memory;
pub mod ops;

pub use array::{Array, Buffer, Element, Evaluated, Exported};
pub use compiled::{Compiled, Trace};
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
    let message = message.to_string_lossy().into_owned();
    if context_lost(&message) {
        // Every later CUDA call in this process would fail too: end it, so
        // that the supervisor starts a worker with a fresh context.
        log::error!("the GPU context is lost ({message}); exiting");
        crate::sys::exit_now(crate::sys::EXIT_GPU_LOST);
    }
    Err(Error::new(message))
}

/// CUDA's sticky errors: after one, the process's context is unusable.
fn context_lost(message: &str) -> bool {
    const STICKY: &[&str] = &[
        "illegal memory access",
        "illegal address",
        "misaligned address",
        "illegal instruction",
        "unspecified launch failure",
        "device-side assert",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "cudaErrorIllegalAddress",
        "cudaErrorLaunchFailure",
    ];
    STICKY.iter().any(|s| message.contains(s))
}

/// Runs a GPU kernel that writes through a wild pointer: a real device fault.
#[cfg(feature = "fault-injection")]
pub fn fault_device_write() -> Result<()> {
    // SAFETY: no arguments; the fault happens on the device, not here.
    check(unsafe { ffi::moat_fault_device_write() })
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

    /// How many devices of this kind MLX sees (0 where it has none).
    pub fn count(self) -> usize {
        let mut out: c_int = 0;
        // SAFETY: `out` is a valid pointer for the duration of the call.
        match check(unsafe { ffi::moat_device_count(self as c_int, &mut out) }) {
            Ok(()) if self.available() => out.max(0) as usize,
            _ => 0,
        }
    }

    /// What MLX reports of device `index` of this kind.
    pub fn info(self, index: usize) -> Result<DeviceInfo> {
        let mut name = [0 as std::os::raw::c_char; 256];
        let (mut memory, mut major, mut minor) = (0u64, 0 as c_int, 0 as c_int);
        // SAFETY: `name` has `name.len()` writable bytes, which the shim
        // NUL-terminates; the other pointers are valid for the call.
        check(unsafe {
            ffi::moat_device_info(
                self as c_int,
                index as c_int,
                name.as_mut_ptr(),
                name.len(),
                &mut memory,
                &mut major,
                &mut minor,
            )
        })?;
        // SAFETY: the shim wrote a NUL-terminated string into `name`.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        Ok(DeviceInfo {
            kind: self,
            name,
            memory,
            compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        })
    }

    /// Makes this the device of every op built afterwards on this thread.
    pub fn make_default(self) -> Result<()> {
        // SAFETY: plain value argument.
        check(unsafe { ffi::moat_set_default_device(self as c_int) })?;
        ON_GPU.store(self == Device::Gpu, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

static ON_GPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether ops run on the GPU, which has no float64 (MLX's CUDA backend).
pub fn on_gpu() -> bool {
    ON_GPU.load(std::sync::atomic::Ordering::Relaxed)
}

/// Runs `f` with the CPU as the default device, then goes back to the GPU.
pub fn on_cpu<T>(f: impl FnOnce() -> T) -> T {
    let was_gpu = on_gpu();
    if was_gpu {
        let _ = Device::Cpu.make_default();
    }
    let out = f();
    if was_gpu {
        if let Err(e) = Device::Gpu.make_default() {
            log::error!("cannot go back to the GPU device: {e}");
        }
    }
    out
}

/// One device as MLX describes it; `compute_capability` is (0, 0) on the CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub kind: Device,
    pub name: String,
    pub memory: u64,
    pub compute_capability: (u32, u32),
}

/// Evaluates the arrays' graphs; errors thrown inside kernels surface here.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<*mut ffi::moat_array> = arrays.iter().map(|a| a.raw()).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    check(unsafe { ffi::moat_eval(raw.as_ptr(), raw.len()) })
}

/// Schedules evaluation with the CPU stream's thread held until every
/// kernel of it is queued (see `moat_async_eval_gated`), and returns.
pub fn async_eval_gated(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<*mut ffi::moat_array> = arrays.iter().map(|a| a.raw()).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    check(unsafe { ffi::moat_async_eval_gated(raw.as_ptr(), raw.len()) })
}

/// Whether `eval` runs MLX's CPU tasks on the calling thread, with no hand-off
/// to the stream's thread (port/shim/scheduler.cpp; `MOAT_INLINE_EVAL=0`
/// turns it off).
pub fn inline_eval() -> bool {
    // SAFETY: reads a setting; no arguments.
    unsafe { ffi::moat_inline_eval() == 1 }
}

/// How this thread's MLX CPU tasks ran, for tests and profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InlineStats {
    /// Tasks (and event signals) run on this thread, so far.
    pub inlined: u64,
    /// Tasks (and event signals and waits) handed to a stream's thread.
    pub forwarded: u64,
    /// MLX's count of task groups not yet finished (`n_active_tasks`).
    pub active: i64,
}

pub fn inline_eval_stats() -> InlineStats {
    let (mut inlined, mut forwarded, mut active) = (0u64, 0u64, 0i64);
    // SAFETY: the pointers are valid for one write each.
    unsafe { ffi::moat_inline_eval_stats(&mut inlined, &mut forwarded, &mut active) };
    InlineStats {
        inlined,
        forwarded,
        active,
    }
}

/// Schedules evaluation and returns at once.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<*mut ffi::moat_array> = arrays.iter().map(|a| a.raw()).collect();
    // SAFETY: every pointer is a live array borrowed for the call.
    check(unsafe { ffi::moat_async_eval(raw.as_ptr(), raw.len()) })
}
