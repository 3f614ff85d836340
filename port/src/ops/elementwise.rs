//! Element-wise ops with MLX broadcasting. Arithmetic converts its inputs to
//! the output type first, as Nx does.

use super::{finish, to_out_type, Outputs};
use crate::mlx::{ops, Array};
use crate::term::Term;

/// `fn name(inputs, attrs)`: both inputs to the output type, then the MLX op.
macro_rules! arithmetic {
    ($($name:ident),* $(,)?) => {$(
        pub fn $name(x: &[&Array], a: &Term) -> Outputs {
            let (l, r) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
            finish(ops::$name(&l, &r), a)
        }
    )*};
}

arithmetic!(add, subtract, multiply, divide);
