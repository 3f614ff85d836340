//! The shim's vectorized CPU kernels (port/shim/kernels*.cpp): f32, f16 and
//! bf16 element-wise functions computed in f32 through SLEEF, in place of
//! MLX's CPU kernels, which run at scalar speed. The kernel set is chosen
//! once at start from what the CPU reports, never from how the worker was
//! compiled.

use super::{check, ffi, Array, Result};
use std::os::raw::c_int;

/// A kernel set, in the order of the shim's `moat_kernels`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    Scalar = 0,
    Avx2 = 1,
    Avx512 = 2,
    /// MLX's own CPU kernels, for comparison (erfc, which MLX lacks, scalar).
    Mlx = 3,
}

/// The environment variable that forces a kernel set: `scalar`, `avx2`,
/// `avx512`, `mlx` (MLX's own kernels), or `auto` (the default: the widest
/// that cpuid reports).
pub const FORCE_VAR: &str = "MOAT_CPU_FEATURES";

impl Kernels {
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Scalar => "scalar",
            Kernels::Avx2 => "avx2",
            Kernels::Avx512 => "avx512",
            Kernels::Mlx => "mlx",
        }
    }

    /// Selects the kernel set named by `MOAT_CPU_FEATURES`, or the best the
    /// CPU supports; fails on an unknown name or on a set the CPU lacks.
    pub fn select_from_env() -> std::result::Result<Kernels, String> {
        let want = match std::env::var(FORCE_VAR).as_deref() {
            Err(_) | Ok("") | Ok("auto") => -1,
            Ok("scalar") => Kernels::Scalar as c_int,
            Ok("avx2") => Kernels::Avx2 as c_int,
            Ok("avx512") => Kernels::Avx512 as c_int,
            Ok("mlx") => Kernels::Mlx as c_int,
            Ok(other) => {
                return Err(format!(
                    "{FORCE_VAR}={other}: expected auto, scalar, avx2, avx512 or mlx"
                ))
            }
        };
        let mut got: c_int = 0;
        // SAFETY: `got` is a valid pointer for the duration of the call.
        check(unsafe { ffi::moat_kernels_select(want, &mut got) }).map_err(|e| format!("{FORCE_VAR}: {e}"))?;
        Ok(match got {
            1 => Kernels::Avx2,
            2 => Kernels::Avx512,
            3 => Kernels::Mlx,
            _ => Kernels::Scalar,
        })
    }
}

/// The unary functions, in the order of the shim's `moat_kernel_op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Exp,
    Expm1,
    Log,
    Log1p,
    Tanh,
    Sigmoid,
    Erf,
    Erfc,
    Sin,
    Cos,
    Rsqrt,
}

/// `op(a)` for an f32, f16 or bf16 array, lazily. On a GPU default device
/// it is computed in double on the GPU and rounded to f32 (then to the half
/// type): CUDA's f32 functions are an ulp or two off, MLX's half ones more.
pub fn unary(op: Op, a: &Array) -> Result<Array> {
    // SAFETY: the input is a live array borrowed for the call.
    Array::from_call(|out| unsafe { ffi::moat_kernel_unary(op as c_int, a.raw(), out) })
}

/// `a ** b` with broadcasting, for two f32, f16 or bf16 arrays of one type.
pub fn power(a: &Array, b: &Array) -> Result<Array> {
    // SAFETY: both inputs are live arrays borrowed for the call.
    Array::from_call(|out| unsafe { ffi::moat_kernel_power(a.raw(), b.raw(), out) })
}

/// `atan2(a, b)` with broadcasting: MLX's op, except f32 on a GPU default
/// device, computed in double on the GPU and rounded once (CUDA's f32
/// atan2 is off by an ulp where Nx's is not).
pub fn atan2(a: &Array, b: &Array) -> Result<Array> {
    // SAFETY: both inputs are live arrays borrowed for the call.
    Array::from_call(|out| unsafe { ffi::moat_kernel_atan2(a.raw(), b.raw(), out) })
}
