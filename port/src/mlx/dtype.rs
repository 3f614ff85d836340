//! MLX element types, their codes in the shim and their Nx names (the wire's
//! spelling of them is `protocol::dtype`'s).

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool = 0,
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    F16,
    F32,
    F64,
    Bf16,
    C64,
}

const ALL: [Dtype; 14] = [
    Dtype::Bool,
    Dtype::U8,
    Dtype::U16,
    Dtype::U32,
    Dtype::U64,
    Dtype::S8,
    Dtype::S16,
    Dtype::S32,
    Dtype::S64,
    Dtype::F16,
    Dtype::F32,
    Dtype::F64,
    Dtype::Bf16,
    Dtype::C64,
];

impl Dtype {
    pub fn code(self) -> i32 {
        self as i32
    }

    pub fn from_code(code: i32) -> Option<Dtype> {
        ALL.get(usize::try_from(code).ok()?).copied()
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::S8 => 1,
            Dtype::U16 | Dtype::S16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::S32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::S64 | Dtype::F64 | Dtype::C64 => 8,
        }
    }

    /// The Nx spelling, `{kind, bits}`; MLX's bool travels as `{:pred, 8}`.
    pub fn nx(self) -> (&'static str, u32) {
        match self {
            Dtype::Bool => ("pred", 8),
            Dtype::U8 => ("u", 8),
            Dtype::U16 => ("u", 16),
            Dtype::U32 => ("u", 32),
            Dtype::U64 => ("u", 64),
            Dtype::S8 => ("s", 8),
            Dtype::S16 => ("s", 16),
            Dtype::S32 => ("s", 32),
            Dtype::S64 => ("s", 64),
            Dtype::F16 => ("f", 16),
            Dtype::F32 => ("f", 32),
            Dtype::F64 => ("f", 64),
            Dtype::Bf16 => ("bf", 16),
            Dtype::C64 => ("c", 64),
        }
    }

    pub fn from_nx(kind: &str, bits: i128) -> Option<Dtype> {
        ALL.iter().copied().find(|d| {
            let (k, b) = d.nx();
            k == kind && b as i128 == bits
        })
    }

    // The type predicates, all here (the builders' short forms in
    // `ops::convert` and `ops::compose` call these).

    /// Nx's float kinds, `f` and `bf` (complex is not one of them).
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::F32 | Dtype::F64 | Dtype::Bf16)
    }

    pub fn is_complex(self) -> bool {
        self == Dtype::C64
    }

    /// A float or a complex type: values that are not exact integers.
    pub fn is_inexact(self) -> bool {
        self.is_float() || self.is_complex()
    }

    /// An integer type, or bool.
    pub fn is_integer(self) -> bool {
        !self.is_inexact()
    }

    /// An unsigned integer type, or bool.
    pub fn is_unsigned(self) -> bool {
        matches!(self, Dtype::Bool | Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64)
    }

    pub fn is_signed(self) -> bool {
        matches!(self, Dtype::S8 | Dtype::S16 | Dtype::S32 | Dtype::S64)
    }
}
