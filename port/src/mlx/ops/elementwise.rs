use super::binary;
use crate::mlx::{ffi, Array, Result};

binary! {
    add => moat_add,
    subtract => moat_subtract,
    multiply => moat_multiply,
    divide => moat_divide,
}
