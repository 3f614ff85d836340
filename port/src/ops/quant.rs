//! Quantized weights (Moat.quantize): a weight quantized along its last
//! axis is one packed uint8 array in the registry (protocol.md, "Quantized
//! weights"); the ops that read it take its dense shape and type and MLX's
//! parameters as attrs.

use super::indexing::bounds;
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::ops::{self, Quant};
use crate::mlx::{Array, Dtype};
use crate::term::Term;

type Checked<T> = Result<T, String>;

const MODES: &[&str] = &["affine", "mxfp4", "mxfp8", "nvfp4"];

fn mode(a: &Term) -> Checked<&str> {
    let m = attrs::atom(attrs::field(a, "mode")?)?;
    if MODES.contains(&m) {
        Ok(m)
    } else {
        Err(format!("unknown quantization mode {m}, expected one of {MODES:?}"))
    }
}

/// A weight type MLX quantizes.
fn weight_type(t: Dtype) -> Checked<Dtype> {
    match t {
        Dtype::F32 | Dtype::F16 | Dtype::Bf16 => Ok(t),
        t => Err(format!(
            "quantized weights are f32, f16 or bf16, got {}",
            crate::protocol::dtype_term(t)
        )),
    }
}

/// The type of a weight's affine scales and biases: the optional attr
/// `scale_type`, by default the weight's type `dense`. f32 or bf16 for any
/// weight, f16 for an f16 one (f16 cannot hold every f32 or bf16 scale).
fn scale_type(a: &Term, dense: Dtype) -> Checked<Dtype> {
    let t = match a.get("scale_type") {
        Some(t) => attrs::dtype(t)?,
        None => return Ok(dense),
    };
    if t == Dtype::F32 || t == Dtype::Bf16 || t == dense {
        Ok(t)
    } else {
        let name = |t: Dtype| {
            let (kind, bits) = t.nx();
            format!("{kind}{bits}")
        };
        Err(format!(
            "scales of a {} weight are f32, bf16 or its own type, got {}",
            name(dense),
            name(t)
        ))
    }
}

/// The packed weight's description from the attrs `shape`, `dense`,
/// `scale_type`, `group_size`, `bits` and `mode`.
struct Described {
    shape: Vec<i32>,
    dtype: Dtype,
    scales: Dtype,
    group_size: i32,
    bits: i32,
    mode: String,
}

impl Described {
    fn from(a: &Term) -> Checked<Described> {
        let shape = attrs::ints(attrs::field(a, "shape")?)?;
        if shape.len() < 2 || shape.iter().any(|&d| d < 0) {
            return Err(format!("a quantized weight has rank at least 2, got shape {shape:?}"));
        }
        let dtype = weight_type(attrs::dtype(attrs::field(a, "dense")?)?)?;
        Ok(Described {
            shape,
            dtype,
            scales: scale_type(a, dtype)?,
            group_size: attrs::positive(attrs::field(a, "group_size")?)?,
            bits: attrs::positive(attrs::field(a, "bits")?)?,
            mode: mode(a)?.to_string(),
        })
    }

    fn quant(&self) -> Quant<'_> {
        Quant {
            shape: &self.shape,
            scales: self.scales,
            group_size: self.group_size,
            bits: self.bits,
            mode: &self.mode,
        }
    }
}

/// `[w]`: attrs `bits`, `group_size`, `mode`, optional `scale_type`. The
/// packed uint8 vector.
pub fn quantize(x: &[&Array], a: &Term) -> Outputs {
    let w = x[0];
    let scales = scale_type(a, weight_type(w.dtype())?)?;
    let shape = w.shape();
    let group = attrs::positive(attrs::field(a, "group_size")?)?;
    match shape.last() {
        Some(&k) if shape.len() >= 2 && k > 0 && k % group == 0 => {}
        _ => {
            return Err(format!(
                "expected a weight of rank at least 2 whose last axis is a positive multiple of the group \
                 size {group}, got shape {shape:?}"
            ))
        }
    }
    let bits = attrs::positive(attrs::field(a, "bits")?)?;
    Ok(vec![
        ops::quantize(w, group, bits, mode(a)?, scales).map_err(|e| e.message)?
    ])
}

/// `[packed]`: attrs `shape`, `dense`, `scale_type` (optional), `bits`,
/// `group_size`, `mode`, `type`.
pub fn dequantize(x: &[&Array], a: &Term) -> Outputs {
    let d = Described::from(a)?;
    // Straight into a float output type: f16 scales dequantized into f32
    // are not rounded to f16 first.
    let out = match attrs::out_type(a)? {
        Some(t) if t.is_float() && !t.is_complex() => t,
        _ => d.dtype,
    };
    finish(ops::dequantize(x[0], &d.quant(), out), a)
}

/// `[x, packed]`: the attrs of dequantize and `transpose`: `x · wᵀ`
/// (contracting the weight's last axis) or `x · w`, for a 2-D weight.
pub fn quantized_matmul(x: &[&Array], a: &Term) -> Outputs {
    let d = Described::from(a)?;
    let transpose = attrs::boolean(attrs::field(a, "transpose")?)?;
    if d.shape.len() != 2 {
        return Err(format!("expected a 2-D weight, got shape {:?}", d.shape));
    }
    let v = to_out_type(x[0], a)?;
    let k = if transpose { d.shape[1] } else { d.shape[0] };
    match v.shape().last() {
        Some(&kx) if kx == k => {}
        _ => {
            return Err(format!(
                "x of shape {:?} does not contract with a weight of shape {:?}{}",
                v.shape(),
                d.shape,
                if transpose { " transposed" } else { "" }
            ))
        }
    }
    finish(ops::quantized_matmul(&v, x[1], &d.quant(), transpose), a)
}

/// `[x, packed, rhs_indices]` or `[x, packed, lhs_indices, rhs_indices]`:
/// the attrs of dequantize, `transpose` and `sorted`.
pub fn gather_qmm(x: &[&Array], a: &Term) -> Outputs {
    let d = Described::from(a)?;
    let (lhs, rhs) = match x.len() {
        3 => (None, Some(x[2])),
        4 => (Some(x[2]), Some(x[3])),
        n => {
            return Err(format!(
                "expected 3 or 4 inputs (x, w, [lhs_indices,] rhs_indices), got {n}"
            ))
        }
    };
    let transpose = attrs::boolean(attrs::field(a, "transpose")?)?;
    let sorted = attrs::boolean(attrs::field(a, "sorted")?)?;
    let v = to_out_type(x[0], a)?;
    let xs = v.shape();
    if d.shape.len() != 3 || xs.len() < 2 {
        return Err(format!(
            "expected x of rank at least 2 and a weight {{experts, out, in}}, got {xs:?} and {:?}",
            d.shape
        ));
    }
    // MLX reads whatever the indices address: check them first.
    let matrices = xs[..xs.len() - 2].iter().map(|&d| d as i64).product::<i64>();
    for (indices, dim, what) in [(lhs, matrices, "lhs_indices"), (rhs, d.shape[0] as i64, "rhs_indices")] {
        if let Some(b) = indices.map(|i| bounds(i, false)).transpose()?.flatten() {
            let (low, high) = (b.low[0], b.high[0]);
            if low < 0 || high >= dim {
                return Err(format!(
                    "{what} hold {} outside 0..{dim}",
                    if low < 0 { low } else { high }
                ));
            }
        }
    }
    let u32 = |i: &Array| ops::astype(i, Dtype::U32).map_err(|e| e.message);
    let (lhs, rhs) = (lhs.map(u32).transpose()?, rhs.map(u32).transpose()?);
    // SAFETY: the indices were checked above; nothing has evaluated the result.
    let y = unsafe { ops::gather_qmm(&v, x[1], &d.quant(), lhs.as_ref(), rhs.as_ref(), transpose, sorted) };
    finish(y, a)
}
