use super::{binary, unary};
use crate::mlx::{ffi, Array, Result};

binary! {
    add => moat_add,
    subtract => moat_subtract,
    multiply => moat_multiply,
    divide => moat_divide,
    floor_divide => moat_floor_divide,
    remainder => moat_remainder,
    maximum => moat_maximum,
    minimum => moat_minimum,
    equal => moat_equal,
    not_equal => moat_not_equal,
    less => moat_less,
    greater => moat_greater,
    logical_and => moat_logical_and,
    logical_or => moat_logical_or,
    bitwise_and => moat_bitwise_and,
    bitwise_or => moat_bitwise_or,
    right_shift => moat_right_shift,
    left_shift => moat_left_shift,
}

unary! {
    negative => moat_negative,
    logical_not => moat_logical_not,
    isfinite => moat_isfinite,
    real => moat_real,
    imag => moat_imag,
}
