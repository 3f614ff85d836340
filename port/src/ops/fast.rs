//! MLX's `fast` kernels (Moat.Fast): RMS and layer norm, rotary embedding and
//! scaled dot-product attention, each one MLX call. Moat.Fast converts the
//! inputs to the output type first; the shapes MLX would refuse are checked
//! here, so that the error names what is wrong.

use super::convert::nonzero;
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::ops::{self, Offset, Rope};
use crate::mlx::{Array, Dtype};
use crate::term::Term;

type Checked<T> = Result<T, String>;

/// A real float output type (MLX's kernels take no integers or complex).
fn float_type(a: &Term) -> Checked<Dtype> {
    match attrs::out_type(a)? {
        Some(t) if t.is_float() && !t.is_complex() => Ok(t),
        Some(t) => Err(format!(
            "expected a real float type, got {}",
            crate::protocol::dtype_term(t)
        )),
        None => Err("missing attribute type".into()),
    }
}

fn eps(a: &Term) -> Checked<f32> {
    Ok(attrs::float(attrs::field(a, "eps")?)? as f32)
}

/// The last axis of `x` and the vector `v` (a weight or bias) agree.
fn check_vector(x: &Array, v: &Array, what: &str) -> Checked<()> {
    let (xs, vs) = (x.shape(), v.shape());
    match xs.last() {
        None => Err("expected a tensor of rank at least 1, got a scalar".into()),
        Some(&d) if vs == [d] => Ok(()),
        Some(&d) => Err(format!(
            "{what} must have shape [{d}] (the last axis of {xs:?}), got {vs:?}"
        )),
    }
}

/// `[x, weight]`: attrs `eps`, `type`.
pub fn rms_norm(x: &[&Array], a: &Term) -> Outputs {
    float_type(a)?;
    let (v, w) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    check_vector(&v, &w, "weight")?;
    finish(ops::fast_rms_norm(&v, Some(&w), eps(a)?), a)
}

/// `[x, weight]` or `[x, weight, bias]`: attrs `eps`, `type`.
pub fn layer_norm(x: &[&Array], a: &Term) -> Outputs {
    if x.len() > 3 {
        return Err(format!("expected 2 or 3 inputs (x, weight, bias), got {}", x.len()));
    }
    float_type(a)?;
    let v = to_out_type(x[0], a)?;
    let w = to_out_type(x[1], a)?;
    check_vector(&v, &w, "weight")?;
    let b = x.get(2).map(|b| to_out_type(b, a)).transpose()?;
    if let Some(b) = &b {
        check_vector(&v, b, "bias")?;
    }
    finish(ops::fast_layer_norm(&v, Some(&w), b.as_ref(), eps(a)?), a)
}

/// `[x]`, then the offsets when attr `offset` is `nil`, then `freqs` if
/// given: attrs `dims`, `traditional`, `base`, `scale`, `offset`,
/// `seq_axis` (the axis positions run along), `type`. The offsets are an
/// integer scalar or one start per batch (axis 0). MLX takes positions along
/// axis -2: any other `seq_axis` is swapped there and back, because a
/// `{B, T, H, D}` tensor handed over as it is would rotate head `h` at
/// position `t + h`.
pub fn rope(x: &[&Array], a: &Term) -> Outputs {
    float_type(a)?;
    let v = to_out_type(x[0], a)?;
    let shape = v.shape();
    let rank = shape.len();
    if rank < 2 {
        return Err(format!("expected a tensor of rank at least 2, got shape {shape:?}"));
    }
    let dims = attrs::positive(attrs::field(a, "dims")?)?;
    let last = shape[rank - 1];
    if dims % 2 != 0 || dims > last {
        return Err(format!(
            "dims must be even and at most the last axis ({last}), got {dims}"
        ));
    }
    let seq = attrs::axis(attrs::field(a, "seq_axis")?, rank)? as usize;
    if seq == rank - 1 {
        return Err("seq_axis cannot be the feature (last) axis".into());
    }
    let offset_attr = attrs::field(a, "offset")?;
    let mut rest = x[1..].iter();
    let offsets = if offset_attr.is_atom("nil") {
        let o = rest.next().ok_or("offset is nil but no offset tensor was given")?;
        let per_batch = o.shape() == [shape[0]] && rank >= 3 && seq != 0;
        if !o.dtype().is_integer() || !(o.shape().is_empty() || per_batch) {
            return Err(format!(
                "the offset tensor must be an integer scalar or one per batch ([{}], with seq_axis not 0), \
                 got {} of shape {:?}",
                shape[0],
                crate::protocol::dtype_term(o.dtype()),
                o.shape()
            ));
        }
        Some(ops::astype(o, Dtype::S32)?)
    } else {
        None
    };
    let freqs = rest.next().map(|f| ops::astype(f, Dtype::F32)).transpose()?;
    if rest.next().is_some() {
        return Err(format!(
            "expected at most 3 inputs (x, offsets, freqs), got {}",
            x.len()
        ));
    }
    if let Some(f) = &freqs {
        if f.shape() != [dims / 2] {
            return Err(format!("freqs must have shape [{}], got {:?}", dims / 2, f.shape()));
        }
    }
    let spec = Rope {
        dims,
        traditional: attrs::boolean(attrs::field(a, "traditional")?)?,
        base: attrs::float(attrs::field(a, "base")?)? as f32,
        scale: attrs::float(attrs::field(a, "scale")?)? as f32,
        offset: match &offsets {
            Some(o) => Offset::Array(o),
            None => Offset::Int(attrs::int(offset_attr)?),
        },
        freqs: freqs.as_ref(),
    };
    let mut perm: Vec<i32> = (0..rank as i32).collect();
    perm.swap(seq, rank - 2);
    let moved = seq != rank - 2;
    let mlx = || -> crate::mlx::Result<Array> {
        let v = if moved { ops::transpose(&v, &perm)? } else { v.share()? };
        // MLX wants at least 3 axes; a {T, D} matrix gets a batch of one.
        let flat = rank == 2;
        let v = if flat {
            ops::reshape(&v, &[1, shape[0], shape[1]])?
        } else {
            v
        };
        let r = ops::fast_rope(&v, &spec)?;
        let r = if flat { ops::reshape(&r, &shape)? } else { r };
        // A transposition that swaps two axes is its own inverse.
        if moved {
            ops::transpose(&r, &perm)
        } else {
            Ok(r)
        }
    };
    finish(mlx(), a)
}

/// The roles of sdpa's inputs after `q, k, v`, in their order.
const EXTRAS: &[&str] = &["mask", "lengths", "starts", "sinks"];

/// `[q, k, v]` and the inputs attr `extras` names (any of `mask`, `lengths`,
/// `starts`, `sinks`, in that order; without the attr, a fourth input is the
/// mask), each of q, k, v `{B, H, T, D}` with `k`/`v` holding a divisor of
/// q's heads (grouped-query attention, not tiled): attrs `scale`, `causal`,
/// `type`. An integer mask is boolean (non-zero attends); a float mask is
/// added to the scores. `lengths` and `starts` are integer `{B}` (or
/// scalars): keys before `starts[b]` and from `lengths[b]` on are masked,
/// and a causal mask aligns the queries with the last valid keys. `sinks`
/// is `{Hq}`: one logit per query head in the softmax's denominator.
pub fn sdpa(x: &[&Array], a: &Term) -> Outputs {
    let roles: Vec<&str> = match a.get("extras") {
        None => EXTRAS[..x.len().saturating_sub(3).min(1)].to_vec(),
        Some(t) => {
            let list = t.as_list().ok_or_else(|| format!("extras must be a list, got {t}"))?;
            let roles = list
                .iter()
                .map(|r| attrs::atom(r).map_err(|e| e.to_string()))
                .collect::<Result<Vec<_>, _>>()?;
            let order: Vec<Option<usize>> = roles.iter().map(|r| EXTRAS.iter().position(|e| e == r)).collect();
            if order.iter().any(Option::is_none) || !order.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!(
                    "extras must be some of {EXTRAS:?}, in that order, got {roles:?}"
                ));
            }
            roles
        }
    };
    if x.len() != 3 + roles.len() {
        return Err(format!(
            "expected {} inputs (q, k, v and {roles:?}), got {}",
            3 + roles.len(),
            x.len()
        ));
    }
    let extra = |role: &str| roles.iter().position(|r| *r == role).map(|i| x[3 + i]);
    let t = float_type(a)?;
    let (q, k, v) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?, to_out_type(x[2], a)?);
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(format!(
            "q, k and v must be {{B, H, T, D}}, got shapes {qs:?}, {ks:?}, {vs:?}"
        ));
    }
    if qs[0] != ks[0] || ks[0] != vs[0] || ks[1] != vs[1] || ks[2] != vs[2] || qs[3] != ks[3] {
        return Err(format!(
            "q {qs:?}, k {ks:?} and v {vs:?} disagree: they need one batch, k and v one head count and \
             length, q and k one head size"
        ));
    }
    if ks[1] == 0 || qs[1] % ks[1] != 0 {
        return Err(format!("q's {} heads are not a multiple of k's {}", qs[1], ks[1]));
    }
    let scale = attrs::float(attrs::field(a, "scale")?)? as f32;
    let causal = attrs::boolean(attrs::field(a, "causal")?)?;
    let mask = match extra("mask") {
        None => None,
        Some(m) if m.dtype() == Dtype::Bool => Some(m.share()?),
        Some(m) if m.dtype().is_float() && !m.dtype().is_complex() => Some(ops::astype(m, t)?),
        Some(m) if !m.dtype().is_complex() => Some(nonzero(m)?),
        Some(_) => return Err("a complex mask is neither boolean nor additive".into()),
    };
    let per_batch = |role: &str| -> Checked<Option<Array>> {
        let Some(p) = extra(role) else { return Ok(None) };
        if !p.dtype().is_integer() || !(p.shape().is_empty() || p.shape() == [qs[0]]) {
            return Err(format!(
                "{role} must be an integer scalar or one per batch ([{}]), got {} of shape {:?}",
                qs[0],
                crate::protocol::dtype_term(p.dtype()),
                p.shape()
            ));
        }
        // Clamped in s64 first, so that no value wraps in the cast to s32.
        let wide = ops::astype(p, Dtype::S64)?;
        let high = Array::scalar(ks[2] as i64)?;
        let clamped = ops::minimum(&ops::maximum(&wide, &Array::scalar(0i64)?)?, &high)?;
        Ok(Some(ops::broadcast_to(&ops::astype(&clamped, Dtype::S32)?, &[qs[0]])?))
    };
    let (lengths, starts) = (per_batch("lengths")?, per_batch("starts")?);
    let sinks = match extra("sinks") {
        None => None,
        Some(s) if s.shape() == [qs[1]] && s.dtype().is_float() && !s.dtype().is_complex() => {
            Some(ops::astype(s, Dtype::F32)?)
        }
        Some(s) => {
            return Err(format!(
                "sinks must be a real float vector of one logit per query head ([{}]), got {} of shape {:?}",
                qs[1],
                crate::protocol::dtype_term(s.dtype()),
                s.shape()
            ))
        }
    };
    let spec = ops::Attend {
        scale,
        causal,
        mask: mask.as_ref(),
        lengths: lengths.as_ref(),
        starts: starts.as_ref(),
        sinks: sinks.as_ref(),
    };
    finish(ops::fast_attention(&q, &k, &v, &spec), a)
}
