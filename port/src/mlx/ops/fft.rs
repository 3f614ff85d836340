//! Fourier transforms over several axes, each padded or truncated to a length.

use crate::mlx::{ffi, Array, Error, Result};

macro_rules! fft {
    ($($name:ident => $ffi:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, lengths: &[i32], axes: &[i32]) -> Result<Array> {
            if lengths.len() != axes.len() {
                return Err(Error::new("fft: one length per axis"));
            }
            // SAFETY: `a` is live; `lengths` and `axes` hold `axes.len()` elements.
            Array::from_call(|out| unsafe { ffi::$ffi(a.raw(), lengths.as_ptr(), axes.as_ptr(), axes.len(), out) })
        }
    )*};
}

fft! {
    fftn => moat_fftn,
    ifftn => moat_ifftn,
    rfftn => moat_rfftn,
    irfftn => moat_irfftn,
}
