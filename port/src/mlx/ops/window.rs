//! Convolution.

use crate::mlx::{ffi, Array, Error, Result};

/// The spatial parameters of `conv_general`, one entry per spatial axis.
#[derive(Clone, Copy)]
pub struct ConvSpec<'a> {
    pub strides: &'a [i32],
    pub pad_lo: &'a [i32],
    pub pad_hi: &'a [i32],
    pub kernel_dilation: &'a [i32],
    pub input_dilation: &'a [i32],
    pub groups: i32,
}

/// `input` is `[N, spatial..., C]`, `weight` `[O, spatial..., C / groups]`.
pub fn conv_general(input: &Array, weight: &Array, spec: &ConvSpec) -> Result<Array> {
    let n = spec.strides.len();
    let lens = [
        spec.pad_lo.len(),
        spec.pad_hi.len(),
        spec.kernel_dilation.len(),
        spec.input_dilation.len(),
    ];
    if lens.iter().any(|l| *l != n) {
        return Err(Error::new("conv: one stride, padding and dilation per spatial axis"));
    }
    // SAFETY: inputs are live; every slice holds `n` elements.
    Array::from_call(|out| unsafe {
        ffi::moat_conv_general(
            input.raw(),
            weight.raw(),
            spec.strides.as_ptr(),
            spec.pad_lo.as_ptr(),
            spec.pad_hi.as_ptr(),
            spec.kernel_dilation.as_ptr(),
            spec.input_dilation.as_ptr(),
            n,
            spec.groups,
            out,
        )
    })
}
