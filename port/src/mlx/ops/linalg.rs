use super::binary;
use crate::mlx::{ffi, Array, Result};

binary! {
    matmul => moat_matmul,
}
