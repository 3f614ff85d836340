//! Checks on every graph op's outputs, applied after its builder returns
//! and before anything evaluates them.
//!
//! MLX computes an array's element count in a machine word and does not
//! check it: a shape whose count overflows wraps (to 0 for powers of two), and
//! kernels then write past what was allocated. No tensor can be larger than
//! an address space, so outputs beyond `MAX_TENSOR_BYTES` fail the op.
//!
//! `detect_non_finite` (a debug option, off by default) evaluates each float
//! output and fails the op that produced a NaN or an infinity.

use crate::mlx::{ops, Array, Dtype};

/// 2^47 bytes: the user address space of x86-64 and arm64 Linux.
pub const MAX_TENSOR_BYTES: u128 = 1 << 47;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checks {
    pub detect_non_finite: bool,
}

impl Checks {
    pub fn outputs(&self, arrays: &[Array]) -> Result<(), String> {
        for array in arrays {
            size(array)?;
        }
        if self.detect_non_finite {
            for array in arrays {
                finite(array)?;
            }
        }
        Ok(())
    }
}

fn size(array: &Array) -> Result<(), String> {
    let shape = array.shape();
    let elements: u128 = shape.iter().map(|&d| d.max(0) as u128).product();
    let bytes = elements * array.dtype().size() as u128;
    if bytes > MAX_TENSOR_BYTES || elements != array.size() as u128 {
        return Err(format!(
            "the result's shape {shape:?} holds {elements} elements ({bytes} bytes), more than any \
             address space (the limit is {MAX_TENSOR_BYTES} bytes)"
        ));
    }
    Ok(())
}

fn finite(array: &Array) -> Result<(), String> {
    if !array.dtype().is_inexact() || array.size() == 0 {
        return Ok(());
    }
    let all: Vec<i32> = (0..array.shape().len() as i32).collect();
    let bad = ops::any(&ops::logical_not(&ops::isfinite(array)?)?, &all, false)?;
    if crate::budget::read::<u8>(&ops::astype(&bad, Dtype::U8)?)? == [1] {
        return Err("the result holds NaN or infinity (debug option detect_non_finite)".into());
    }
    Ok(())
}
