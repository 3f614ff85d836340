//! Small while loops run on the host (`Loop`): a loop whose steps are all
//! ops of `OPS`, over arrays of at most `MAX_ELEMENTS` elements of the
//! `Data` types, runs here on plain buffers, with no MLX call per op. Each
//! MLX op costs ~4 µs of graph bookkeeping and evaluation whatever its size,
//! which is all a small iteration is (the 1000-iteration counter of
//! `bench/compiler.exs`: ~29 µs an iteration on MLX). The loop's state is
//! read from MLX once at entry and becomes MLX arrays once at exit.
//!
//! Each op computes what its builder in `crate::ops` gives, bit for bit:
//! the same conversions (arithmetic takes both inputs to the out type,
//! comparisons to `input_type`, logical ops test `!= 0`; int to int wraps,
//! int to float rounds to nearest, float to float as IEEE), numpy
//! broadcasting, wrapping integer arithmetic, float arithmetic in the
//! type's own precision (Rust does not contract `a * b + c`), and min/max
//! as MLX's CPU kernels (`simd/base_simd.h`: a NaN first operand is the
//! result, else `a < b ? a : b`). Float to integer conversions are not
//! here (MLX's `static_cast` is undefined out of range). The oracle is
//! `tests::ops_give_what_their_builders_give`: every op of `OPS` on every
//! type and type pair, on edge values (±0, ±inf, NaNs, extremes,
//! subnormals, wrap-around) and random ones, through this path and through
//! the op's builder, compared bit for bit.
//!
//! Anything outside that (a type, shape or slot this path lacks, a
//! condition that is not a scalar, two NaNs of different bits added or
//! multiplied, ops on the GPU) makes `Loop::run` give up, having
//! changed nothing: the loop then runs on MLX from its start, and fails
//! there, if it does, as it always would.

use super::{Branch, Fail, Step};
use crate::budget;
use crate::mlx::{Array, Dtype};
use crate::ops::attrs;
use crate::registry::Failure;
use crate::term::Term;
use std::borrow::Cow;
use std::collections::HashMap;
use std::rc::Rc;

/// The most elements an array of a host loop may hold: a host op costs a
/// few ns an element where an MLX op costs ~4 µs, so the bound keeps every
/// host op far below one MLX op, and the loops it catches (counters,
/// tolerances, small states) are those whose iterations are all overhead.
pub const MAX_ELEMENTS: usize = 64;

/// A while loop over registers, one per slot its steps use.
pub struct Loop {
    /// The slot of each register.
    slots: Vec<usize>,
    /// The registers loaded from their slots at entry: the state, then what
    /// the loop reads before it defines it.
    entry: Vec<usize>,
    state: Vec<usize>,
    cond: Vec<HostStep>,
    pred: usize,
    body: Vec<HostStep>,
    results: Vec<usize>,
}

impl Loop {
    /// None unless every step of the condition and the body is an op of
    /// `OPS` with attributes it takes.
    pub(super) fn new(state: &[usize], cond: &[Step], pred: usize, body: &Branch) -> Option<Loop> {
        let mut p = Plan::default();
        let state: Vec<usize> = state.iter().map(|s| p.write(*s)).collect();
        p.entry.clone_from(&state);
        let cond = p.steps(cond)?;
        let pred = p.read(pred);
        let body_steps = p.steps(&body.steps)?;
        let results = body.results.iter().map(|s| p.read(*s)).collect();
        Some(Loop {
            slots: p.slots,
            entry: p.entry,
            state,
            cond,
            pred,
            body: body_steps,
            results,
        })
    }

    /// Runs the loop from the values in `slots` (its state's included):
    /// the final state, or None where this path cannot run it.
    pub(super) fn run(&self, slots: &[Option<Array>]) -> Option<Result<Vec<Array>, Fail>> {
        // The oracle is MLX's CPU kernels (the GPU's may differ, fast math).
        if crate::mlx::on_gpu() {
            return None;
        }
        let arrays: Vec<&Array> = self
            .entry
            .iter()
            .map(|r| slots[self.slots[*r]].as_ref())
            .collect::<Option<_>>()?;
        if arrays.iter().any(|a| a.size() > MAX_ELEMENTS) {
            return None;
        }
        budget::evaluate(&arrays).ok()?;
        let mut regs: Vec<Option<Rc<Value>>> = vec![None; self.slots.len()];
        for (r, array) in self.entry.iter().zip(arrays) {
            regs[*r] = Some(Rc::new(Value::read(array)?));
        }
        let mut ins = Vec::new();
        loop {
            run_steps(&self.cond, &mut regs, &mut ins)?;
            match regs[self.pred].as_deref()?.data.truth()[..] {
                [true] => {}
                [false] => break,
                _ => return None,
            }
            run_steps(&self.body, &mut regs, &mut ins)?;
            let next: Vec<Rc<Value>> = self.results.iter().map(|r| regs[*r].clone()).collect::<Option<_>>()?;
            for (r, value) in self.state.iter().zip(next) {
                regs[*r] = Some(value);
            }
        }
        let arrays = self.state.iter().map(|r| {
            let value = regs[*r].as_ref().expect("the state is loaded at entry");
            value.data.to_array(&value.shape)
        });
        Some(
            arrays
                .collect::<Result<_, _>>()
                .map_err(|e| Failure::new("while", e.message)),
        )
    }
}

/// `ins`: room for a step's inputs, kept across steps.
fn run_steps(steps: &[HostStep], regs: &mut [Option<Rc<Value>>], ins: &mut Vec<Rc<Value>>) -> Option<()> {
    for step in steps {
        ins.clear();
        for r in &step.ins {
            ins.push(regs[*r].clone()?);
        }
        regs[step.out] = Some(step.apply(ins)?);
    }
    Some(())
}

/// Registers for slots, and what the loop reads before defining it.
#[derive(Default)]
struct Plan {
    slots: Vec<usize>,
    index: HashMap<usize, usize>,
    defined: Vec<bool>,
    entry: Vec<usize>,
}

impl Plan {
    fn reg(&mut self, slot: usize) -> usize {
        *self.index.entry(slot).or_insert_with(|| {
            self.slots.push(slot);
            self.defined.push(false);
            self.slots.len() - 1
        })
    }

    fn read(&mut self, slot: usize) -> usize {
        let r = self.reg(slot);
        if !self.defined[r] && !self.entry.contains(&r) {
            self.entry.push(r);
        }
        r
    }

    fn write(&mut self, slot: usize) -> usize {
        let r = self.reg(slot);
        self.defined[r] = true;
        r
    }

    fn steps(&mut self, steps: &[Step]) -> Option<Vec<HostStep>> {
        steps
            .iter()
            .map(|step| {
                let Step::Op {
                    name, ins, outs, attrs, ..
                } = step
                else {
                    return None;
                };
                let (op, ty) = parse(name, attrs)?;
                let [out] = outs[..] else { return None };
                let ins = ins.iter().map(|s| self.read(*s)).collect();
                Some(HostStep {
                    op,
                    ty,
                    ins,
                    out: self.write(out),
                })
            })
            .collect()
    }
}

/// One op over registers; `ty` is the attrs' `type`.
struct HostStep {
    op: Op,
    ty: Option<Dtype>,
    ins: Vec<usize>,
    out: usize,
}

#[derive(Clone, Debug)]
enum Op {
    Arith(Arith),
    Negate,
    Abs,
    Compare(Cmp, Dtype),
    Logical(Logic),
    Not,
    Select,
    Astype,
    Reshape(Vec<i32>),
    BroadcastTo(Vec<i32>),
    /// Nx's broadcast: the shape, and the output axis of each input axis.
    Broadcast(Vec<i32>, Vec<i32>),
    Copy,
    Constant(Rc<Value>),
}

#[derive(Clone, Copy, Debug)]
enum Arith {
    Add,
    Subtract,
    Multiply,
    Divide,
    Min,
    Max,
    BitwiseAnd,
    BitwiseOr,
    BitwiseXor,
}

#[derive(Clone, Copy, Debug)]
enum Cmp {
    Equal,
    NotEqual,
    Greater,
    Less,
    GreaterEqual,
    LessEqual,
}

#[derive(Clone, Copy, Debug)]
enum Logic {
    And,
    Or,
    Xor,
}

type Parse = fn(&Term) -> Option<Op>;

/// The ops a host loop may hold: the name in the op table, and its
/// attributes read (None: this path does not take them).
const OPS: &[(&str, Parse)] = &[
    ("constant", constant),
    ("add", |_| Some(Op::Arith(Arith::Add))),
    ("subtract", |_| Some(Op::Arith(Arith::Subtract))),
    ("multiply", |_| Some(Op::Arith(Arith::Multiply))),
    ("divide", |_| Some(Op::Arith(Arith::Divide))),
    ("min", |_| Some(Op::Arith(Arith::Min))),
    ("max", |_| Some(Op::Arith(Arith::Max))),
    ("bitwise_and", |_| Some(Op::Arith(Arith::BitwiseAnd))),
    ("bitwise_or", |_| Some(Op::Arith(Arith::BitwiseOr))),
    ("bitwise_xor", |_| Some(Op::Arith(Arith::BitwiseXor))),
    ("negate", |_| Some(Op::Negate)),
    ("abs", |_| Some(Op::Abs)),
    ("equal", |a| compare(Cmp::Equal, a)),
    ("not_equal", |a| compare(Cmp::NotEqual, a)),
    ("greater", |a| compare(Cmp::Greater, a)),
    ("less", |a| compare(Cmp::Less, a)),
    ("greater_equal", |a| compare(Cmp::GreaterEqual, a)),
    ("less_equal", |a| compare(Cmp::LessEqual, a)),
    ("logical_and", |_| Some(Op::Logical(Logic::And))),
    ("logical_or", |_| Some(Op::Logical(Logic::Or))),
    ("logical_xor", |_| Some(Op::Logical(Logic::Xor))),
    ("logical_not", |_| Some(Op::Not)),
    ("select", |_| Some(Op::Select)),
    ("astype", |a| attrs::field(a, "type").ok().map(|_| Op::Astype)),
    ("reshape", |a| Some(Op::Reshape(shape(a, "shape")?))),
    ("broadcast_to", |a| Some(Op::BroadcastTo(shape(a, "shape")?))),
    ("broadcast", |a| {
        Some(Op::Broadcast(shape(a, "shape")?, shape(a, "axes")?))
    }),
    ("copy", |_| Some(Op::Copy)),
];

fn parse(name: &str, a: &Term) -> Option<(Op, Option<Dtype>)> {
    let (_, parse) = OPS.iter().find(|(n, _)| *n == name)?;
    Some((parse(a)?, attrs::out_type(a).ok()?))
}

fn compare(op: Cmp, a: &Term) -> Option<Op> {
    Some(Op::Compare(op, attrs::dtype(attrs::field(a, "input_type").ok()?).ok()?))
}

/// Non-negative integers (a shape, axes).
fn shape(a: &Term, key: &str) -> Option<Vec<i32>> {
    attrs::ints(attrs::field(a, key).ok()?)
        .ok()
        .filter(|s| s.iter().all(|d| *d >= 0))
}

/// `value` (one element's bytes) over `shape`, as `creation::constant`.
fn constant(a: &Term) -> Option<Op> {
    let shape = shape(a, "shape")?;
    let dtype = attrs::dtype(attrs::field(a, "type").ok()?).ok()?;
    let Term::Binary(bytes) = attrs::field(a, "value").ok()? else {
        return None;
    };
    let data = Data::repeat(dtype, bytes, elements(&shape)?)?;
    Some(Op::Constant(Rc::new(Value { shape, data })))
}

/// The elements of `shape`, when it is small.
fn elements(shape: &[i32]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, d| n.checked_mul(usize::try_from(*d).ok()?))
        .filter(|n| *n <= MAX_ELEMENTS)
}

impl HostStep {
    /// The op on `x`, then converted to `ty` (as `ops::finish`); None where
    /// this path does not compute it.
    fn apply(&self, x: &[Rc<Value>]) -> Option<Rc<Value>> {
        // `ops::to_out_type`.
        fn to_out(v: &Value, ty: Option<Dtype>) -> Option<Cow<'_, Value>> {
            match ty {
                Some(t) => v.cast(t),
                None => Some(Cow::Borrowed(v)),
            }
        }
        let bools = |shape: Vec<i32>, b: Vec<bool>| {
            let wide: Vec<Wide> = b.into_iter().map(|b| Wide::Int(b.into())).collect();
            Some(Value {
                shape,
                data: Data::from_wide(self.ty?, &wide)?,
            })
        };
        let out = match &self.op {
            Op::Arith(op) => {
                let (l, r) = (to_out(&x[0], self.ty)?, to_out(&x[1], self.ty)?);
                let (shape, [i, j]) = broadcast([&l.shape, &r.shape])?;
                let data = Data::arith(*op, &l.data, &r.data, (&i, &j, elements(&shape)?))?;
                Value { shape, data }
            }
            Op::Negate => {
                let t = to_out(&x[0], self.ty)?;
                Value {
                    data: t.data.negate(),
                    shape: t.shape.clone(),
                }
            }
            Op::Abs => Value {
                data: x[0].data.abs(),
                shape: x[0].shape.clone(),
            },
            Op::Compare(op, t) => {
                let (l, r) = (x[0].cast(*t)?, x[1].cast(*t)?);
                let (shape, [i, j]) = broadcast([&l.shape, &r.shape])?;
                let holds = Data::compare(*op, &l.data, &r.data, (&i, &j, elements(&shape)?))?;
                bools(shape, holds)?
            }
            Op::Logical(op) => {
                let (shape, [i, j]) = broadcast([&x[0].shape, &x[1].shape])?;
                let (l, r) = (x[0].data.truth(), x[1].data.truth());
                let each = (0..elements(&shape)?).map(|k| {
                    let (l, r) = (l[i.at(k)], r[j.at(k)]);
                    match op {
                        Logic::And => l && r,
                        Logic::Or => l || r,
                        Logic::Xor => l != r,
                    }
                });
                bools(shape, each.collect())?
            }
            Op::Not => bools(x[0].shape.clone(), x[0].data.truth().iter().map(|t| !t).collect())?,
            Op::Select => {
                let (on_true, on_false) = (to_out(&x[1], self.ty)?, to_out(&x[2], self.ty)?);
                let (shape, [p, i, j]) = broadcast([&x[0].shape, &on_true.shape, &on_false.shape])?;
                let truth = x[0].data.truth();
                let pick: Vec<bool> = (0..elements(&shape)?).map(|k| truth[p.at(k)]).collect();
                let data = Data::select(&pick, &on_true.data, &on_false.data, (&i, &j, pick.len()))?;
                Value { shape, data }
            }
            Op::Astype => x[0].cast(self.ty?)?.into_owned(),
            Op::Reshape(shape) => reshape(&x[0], shape)?,
            Op::BroadcastTo(shape) => broadcast_to(&x[0], shape)?,
            Op::Broadcast(shape, axes) => {
                if axes.len() != x[0].shape.len() {
                    return None;
                }
                let mut aligned = vec![1; shape.len()];
                for (axis, dim) in axes.iter().zip(&x[0].shape) {
                    *aligned.get_mut(*axis as usize)? = *dim;
                }
                broadcast_to(&reshape(&x[0], &aligned)?, shape)?
            }
            Op::Copy if self.ty.is_some_and(|t| t != x[0].data.dtype()) => (*x[0]).clone(),
            Op::Copy => return Some(x[0].clone()),
            // Of its own type, `ty`.
            Op::Constant(value) => return Some(value.clone()),
        };
        // `ops::finish`.
        Some(Rc::new(match self.ty {
            Some(t) if t != out.data.dtype() => out.cast(t)?.into_owned(),
            _ => out,
        }))
    }
}

fn reshape(x: &Value, shape: &[i32]) -> Option<Value> {
    (elements(shape)? == x.data.len()).then(|| Value {
        shape: shape.to_vec(),
        data: x.data.clone(),
    })
}

fn broadcast_to(x: &Value, shape: &[i32]) -> Option<Value> {
    let (out, [at, _]) = broadcast([&x.shape, shape])?;
    let n = elements(&out)?;
    (out == shape).then(|| Value {
        data: x.data.gather(&(0..n).map(|k| at.at(k)).collect::<Vec<_>>()),
        shape: out,
    })
}

/// Numpy broadcasting: the shape of the result, and where each input is
/// read for each of the result's elements. None when the shapes do not
/// broadcast, or the result is not small.
fn broadcast<const N: usize>(shapes: [&[i32]; N]) -> Option<(Vec<i32>, [At; N])> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1; rank];
    for s in shapes {
        for (o, d) in out[rank - s.len()..].iter_mut().zip(s) {
            if *o == 1 {
                *o = *d;
            } else if *d != 1 && d != o {
                return None;
            }
        }
    }
    let size = elements(&out)?;
    let at = shapes.map(|s| match s {
        s if s == out => At::Each,
        s if s.iter().all(|d| *d == 1) => At::First,
        s => {
            // The input's strides over the result's axes, 0 where broadcast.
            let mut strides = vec![0; rank];
            let mut stride = 1;
            for (k, d) in s.iter().enumerate().rev() {
                if *d != 1 {
                    strides[rank - s.len() + k] = stride;
                }
                stride *= *d as usize;
            }
            let at = (0..size).map(|mut flat| {
                let mut at = 0;
                for (d, stride) in out.iter().zip(&strides).rev() {
                    at += flat % *d as usize * stride;
                    flat /= *d as usize;
                }
                at
            });
            At::Gather(at.collect())
        }
    });
    Some((out, at))
}

/// Which element of an input each element of a broadcast result reads.
enum At {
    Each,
    First,
    Gather(Vec<usize>),
}

impl At {
    fn at(&self, k: usize) -> usize {
        match self {
            At::Each => k,
            At::First => 0,
            At::Gather(at) => at[k],
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Value {
    shape: Vec<i32>,
    data: Data,
}

impl Value {
    fn read(array: &Array) -> Option<Value> {
        let evaluated = array.evaluate().ok()?;
        Some(Value {
            shape: array.shape(),
            data: Data::read(&evaluated)?,
        })
    }

    /// `ops::astype` where it is exact to mirror: not float to integer.
    fn cast(&self, to: Dtype) -> Option<Cow<'_, Value>> {
        if to == self.data.dtype() {
            return Some(Cow::Borrowed(self));
        }
        Some(Cow::Owned(Value {
            shape: self.shape.clone(),
            data: Data::from_wide(to, &self.data.wide())?,
        }))
    }
}

/// An element on its way to another type: integers exactly, floats as
/// f64 (f32 widens exactly).
#[derive(Clone, Copy)]
enum Wide {
    Int(i128),
    Float(f64),
}

/// An element type, with its arithmetic as MLX's CPU kernels compute it.
trait Num: crate::mlx::Element + PartialOrd + Default {
    fn wide(self) -> Wide;
    /// `static_cast` from a wide value; None from a float to an integer.
    fn narrow(w: Wide) -> Option<Self>;
    /// None where the op is not this type's (integer division, float
    /// bitwise ops) or is `Min`/`Max` (`arith`).
    fn op(op: Arith, a: Self, b: Self) -> Option<Self>;
    fn negate(self) -> Self;
    fn abs(self) -> Self;
    fn is_nan(self) -> bool;
}

fn arith<T: Num>(op: Arith, a: T, b: T) -> Option<T> {
    match op {
        // As MLX's `minimum` and `maximum` (simd/base_simd.h).
        Arith::Min => Some(if a.is_nan() || a < b { a } else { b }),
        Arith::Max => Some(if a.is_nan() || a > b { a } else { b }),
        _ => T::op(op, a, b),
    }
}

/// Integers: computed in i128 and truncated, which wraps as C++ does.
macro_rules! int {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn wide(self) -> Wide {
                Wide::Int(self as i128)
            }

            fn narrow(w: Wide) -> Option<Self> {
                match w {
                    Wide::Int(i) => Some(i as $t),
                    Wide::Float(_) => None,
                }
            }

            fn op(op: Arith, a: Self, b: Self) -> Option<Self> {
                let (x, y) = (a as i128, b as i128);
                let z = match op {
                    Arith::Add => x.wrapping_add(y),
                    Arith::Subtract => x.wrapping_sub(y),
                    Arith::Multiply => x.wrapping_mul(y),
                    Arith::BitwiseAnd => x & y,
                    Arith::BitwiseOr => x | y,
                    Arith::BitwiseXor => x ^ y,
                    Arith::Divide | Arith::Min | Arith::Max => return None,
                };
                Some(z as $t)
            }

            fn negate(self) -> Self {
                (self as i128).wrapping_neg() as $t
            }

            fn abs(self) -> Self {
                (self as i128).unsigned_abs() as $t
            }

            fn is_nan(self) -> bool {
                false
            }
        }
    )*};
}

int!(u8, u16, u32, u64, i8, i16, i32, i64);

/// Floats: IEEE in the type's own precision.
macro_rules! float {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn wide(self) -> Wide {
                Wide::Float(f64::from(self))
            }

            // `f as f64` in f64's.
            #[allow(clippy::unnecessary_cast)]
            fn narrow(w: Wide) -> Option<Self> {
                Some(match w {
                    Wide::Int(i) => i as $t,
                    Wide::Float(f) => f as $t,
                })
            }

            fn op(op: Arith, a: Self, b: Self) -> Option<Self> {
                Some(match op {
                    // Of two NaNs, MLX's kernels keep the second, or the
                    // first where the second is one scalar: its layout, not
                    // its value, decides, so the host path gives up.
                    Arith::Add | Arith::Multiply if a.is_nan() && b.is_nan() && a.to_bits() != b.to_bits() => {
                        return None
                    }
                    Arith::Add => a + b,
                    Arith::Subtract => a - b,
                    Arith::Multiply => a * b,
                    Arith::Divide => a / b,
                    _ => return None,
                })
            }

            fn negate(self) -> Self {
                -self
            }

            fn abs(self) -> Self {
                <$t>::abs(self)
            }

            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    )*};
}

float!(f32, f64);

impl Cmp {
    fn holds<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            Cmp::Equal => a == b,
            Cmp::NotEqual => a != b,
            Cmp::Greater => a > b,
            Cmp::Less => a < b,
            Cmp::GreaterEqual => a >= b,
            Cmp::LessEqual => a <= b,
        }
    }
}

/// The element types of this path: `Data`'s variants, named as `Dtype`'s.
macro_rules! types {
    ($($v:ident: $t:ty),*) => {
        #[derive(Clone, Debug, PartialEq)]
        enum Data {
            $($v(Vec<$t>)),*
        }

        /// The types this path takes.
        #[cfg(test)]
        const TYPES: &[Dtype] = &[$(Dtype::$v),*];

        impl Data {
            fn dtype(&self) -> Dtype {
                match self {
                    $(Data::$v(_) => Dtype::$v),*
                }
            }

            fn len(&self) -> usize {
                match self {
                    $(Data::$v(x) => x.len()),*
                }
            }

            fn read(array: &crate::mlx::Evaluated) -> Option<Data> {
                match array.array().dtype() {
                    $(Dtype::$v => Some(Data::$v(array.values::<$t>()?.to_vec())),)*
                    _ => None,
                }
            }

            fn to_array(&self, shape: &[i32]) -> crate::mlx::Result<Array> {
                match self {
                    $(Data::$v(x) => Array::from_values(x, shape)),*
                }
            }

            /// One element's bytes (native order, as Nx's) `n` times.
            fn repeat(dtype: Dtype, bytes: &[u8], n: usize) -> Option<Data> {
                match dtype {
                    $(Dtype::$v => Some(Data::$v(vec![<$t>::from_ne_bytes(bytes.try_into().ok()?); n])),)*
                    _ => None,
                }
            }

            fn wide(&self) -> Vec<Wide> {
                match self {
                    $(Data::$v(x) => x.iter().map(|e| e.wide()).collect()),*
                }
            }

            fn from_wide(to: Dtype, w: &[Wide]) -> Option<Data> {
                match to {
                    $(Dtype::$v => w.iter().map(|e| <$t>::narrow(*e)).collect::<Option<_>>().map(Data::$v),)*
                    _ => None,
                }
            }

            /// Each element `!= 0` (`convert::nonzero`: NaN is true, -0 false).
            fn truth(&self) -> Vec<bool> {
                match self {
                    $(Data::$v(x) => x.iter().map(|e| *e != <$t>::default()).collect()),*
                }
            }

            fn negate(&self) -> Data {
                match self {
                    $(Data::$v(x) => Data::$v(x.iter().map(|e| e.negate()).collect())),*
                }
            }

            fn abs(&self) -> Data {
                match self {
                    $(Data::$v(x) => Data::$v(x.iter().map(|e| e.abs()).collect())),*
                }
            }

            fn gather(&self, at: &[usize]) -> Data {
                match self {
                    $(Data::$v(x) => Data::$v(at.iter().map(|i| x[*i]).collect())),*
                }
            }

            /// `op` on `n` pairs: the elements of `a` and `b` (of one type)
            /// that `i` and `j` give.
            fn arith(op: Arith, a: &Data, b: &Data, (i, j, n): (&At, &At, usize)) -> Option<Data> {
                match (a, b) {
                    $((Data::$v(x), Data::$v(y)) => {
                        (0..n).map(|k| arith(op, x[i.at(k)], y[j.at(k)])).collect::<Option<_>>().map(Data::$v)
                    })*
                    _ => None,
                }
            }

            fn compare(op: Cmp, a: &Data, b: &Data, (i, j, n): (&At, &At, usize)) -> Option<Vec<bool>> {
                match (a, b) {
                    $((Data::$v(x), Data::$v(y)) => Some((0..n).map(|k| op.holds(x[i.at(k)], y[j.at(k)])).collect()),)*
                    _ => None,
                }
            }

            fn select(pick: &[bool], a: &Data, b: &Data, (i, j, n): (&At, &At, usize)) -> Option<Data> {
                match (a, b) {
                    $((Data::$v(x), Data::$v(y)) => Some(Data::$v(
                        (0..n).map(|k| if pick[k] { x[i.at(k)] } else { y[j.at(k)] }).collect(),
                    )),)*
                    _ => None,
                }
            }
        }
    };
}

types!(U8: u8, U16: u16, U32: u32, U64: u64, S8: i8, S16: i16, S32: i32, S64: i64, F32: f32, F64: f64);

#[cfg(test)]
mod tests {
    //! The oracle: each op of `OPS` through this path and through its
    //! builder (`ops::build`, as a program's step runs it), bit for bit.

    use super::*;
    use crate::protocol::{dtype_term, map, shape_term};

    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Values that break arithmetic (zeros, signs, extremes, wrap-around;
    /// for floats also infinities, NaNs of both signs and with a payload,
    /// subnormals, integers past the mantissa), then random ones: any bits,
    /// and for floats small fractions too. `MAX_ELEMENTS` in all.
    fn samples(t: Dtype, random: &mut Random) -> Value {
        let ints = [
            0,
            1,
            -1,
            2,
            -2,
            7,
            -100,
            127,
            128,
            255,
            256,
            65_535,
            i32::MIN as i128,
            i32::MAX as i128,
            u32::MAX as i128,
            i64::MIN as i128,
            i64::MAX as i128,
            u64::MAX as i128,
        ];
        let fraction = |b: u64| (b % 20_001) as f64 / 64.0 - 150.0;
        macro_rules! floats {
            ($v:ident, $t:ident, $payload:expr, $from_bits:expr, $from_f64:expr) => {{
                let mut x: Vec<$t> = vec![
                    0.0,
                    -0.0,
                    1.0,
                    -1.0,
                    0.5,
                    -2.5,
                    3.0,
                    1e10,
                    $t::INFINITY,
                    $t::NEG_INFINITY,
                    $t::NAN,
                    -$t::NAN,
                    $t::from_bits($payload),
                    $t::MAX,
                    $t::MIN,
                    $t::MIN_POSITIVE,
                    $t::from_bits(1),
                    -$t::from_bits(3),
                    16_777_217.0,
                    9_007_199_254_740_993.0,
                ];
                while x.len() < MAX_ELEMENTS {
                    let b = random.next();
                    x.push(if x.len() % 2 == 0 {
                        $from_bits(b)
                    } else {
                        $from_f64(fraction(b))
                    });
                }
                Data::$v(x)
            }};
        }
        let data = match t {
            Dtype::F32 => floats!(F32, f32, 0x7fc0_0001, |b| f32::from_bits(b as u32), |f| f as f32),
            Dtype::F64 => floats!(F64, f64, 0x7ff8_0000_0000_0001, f64::from_bits, |f| f),
            _ => {
                let mut wide: Vec<Wide> = ints.iter().map(|i| Wide::Int(*i)).collect();
                wide.extend((wide.len()..MAX_ELEMENTS).map(|_| Wide::Int(random.next() as i64 as i128)));
                Data::from_wide(t, &wide).unwrap()
            }
        };
        vector(data)
    }

    fn vector(data: Data) -> Value {
        Value {
            shape: vec![data.len() as i32],
            data,
        }
    }

    /// Every pair of elements of `a` and `b`, as vectors of `MAX_ELEMENTS`.
    fn pairs(a: &Value, b: &Value) -> Vec<(Value, Value)> {
        let all: Vec<(usize, usize)> = (0..a.data.len())
            .flat_map(|i| (0..b.data.len()).map(move |j| (i, j)))
            .collect();
        all.chunks(MAX_ELEMENTS)
            .map(|c| {
                let (i, j): (Vec<usize>, Vec<usize>) = c.iter().copied().unzip();
                (vector(a.data.gather(&i)), vector(b.data.gather(&j)))
            })
            .collect()
    }

    fn bytes(v: &Value) -> Vec<u8> {
        v.data.to_array(&v.shape).unwrap().evaluate().unwrap().bytes().to_vec()
    }

    fn typed(t: Dtype) -> Term {
        map(vec![("type", dtype_term(t))])
    }

    fn host(name: &str, ins: &[&Value], a: &Term) -> Option<Value> {
        let (op, ty) = parse(name, a)?;
        let step = HostStep {
            op,
            ty,
            ins: Vec::new(),
            out: 0,
        };
        let ins: Vec<Rc<Value>> = ins.iter().map(|v| Rc::new((*v).clone())).collect();
        step.apply(&ins).map(Rc::unwrap_or_clone)
    }

    /// The builder's result on MLX's CPU, whatever the default device: the
    /// host path stands in for CPU kernels (a GPU refuses f64 and writes NaNs
    /// with other payload bits).
    fn mlx(name: &str, ins: &[&Value], a: &Term) -> Result<Value, String> {
        crate::mlx::Device::Cpu.make_default().map_err(|e| e.to_string())?;
        let arrays: Vec<Array> = ins.iter().map(|v| v.data.to_array(&v.shape).unwrap()).collect();
        let refs: Vec<&Array> = arrays.iter().collect();
        let (_, builder) = crate::ops::builder(name).unwrap();
        let out = crate::ops::build(builder, &refs, a)?;
        Value::read(&out[0]).ok_or_else(|| format!("{:?} is not a host type", out[0].dtype()))
    }

    /// The host's result is the builder's, bit for bit (shape and type too).
    fn same(name: &str, ins: &[&Value], a: &Term) {
        let h = host(name, ins, a).unwrap_or_else(|| panic!("{name} {a}: no host result for {ins:?}"));
        let m = mlx(name, ins, a).unwrap_or_else(|e| panic!("{name} {a}: {e}"));
        let agree = h.shape == m.shape && h.data.dtype() == m.data.dtype() && bytes(&h) == bytes(&m);
        if !agree {
            // Bytes, as Debug writes every NaN alike.
            let ins: Vec<Vec<u8>> = ins.iter().map(|v| bytes(v)).collect();
            let show = |v: &Value| format!("{:?} {:?} {:02x?}", v.data.dtype(), v.shape, bytes(v));
            panic!("{name} {a} on {ins:02x?}:\n host {}\n  mlx {}", show(&h), show(&m));
        }
    }

    /// The host path refuses it (a loop holding it runs on MLX).
    fn refused(name: &str, ins: &[&Value], a: &Term) {
        assert!(host(name, ins, a).is_none(), "{name} {a} on {ins:?} has a host result");
    }

    const ARITH: [&str; 9] = [
        "add",
        "subtract",
        "multiply",
        "divide",
        "min",
        "max",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
    ];
    const COMPARE: [&str; 6] = ["equal", "not_equal", "greater", "less", "greater_equal", "less_equal"];
    const LOGICAL: [&str; 3] = ["logical_and", "logical_or", "logical_xor"];

    /// Not this path's: integer division, float bitwise ops.
    fn excluded(name: &str, t: Dtype) -> bool {
        match t.is_float() {
            true => name.starts_with("bitwise"),
            false => name == "divide",
        }
    }

    /// Whether `name` adds or multiplies two NaNs of different bits at some
    /// element (which one MLX keeps depends on the arrays' layout).
    fn two_nans(name: &str, a: &Value, b: &Value) -> bool {
        let nan = |w: Wide| matches!(w, Wide::Float(f) if f.is_nan());
        let (x, y) = (bytes(a), bytes(b));
        let size = a.data.dtype().size();
        matches!(name, "add" | "multiply")
            && a.data
                .wide()
                .into_iter()
                .zip(b.data.wide())
                .enumerate()
                .any(|(k, (l, r))| nan(l) && nan(r) && x[k * size..][..size] != y[k * size..][..size])
    }

    #[test]
    fn ops_give_what_their_builders_give() {
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let to_u8 = typed(Dtype::U8);
        for &t in TYPES {
            let x = samples(t, &mut random);
            for (a, b) in pairs(&x, &x) {
                for name in ARITH {
                    match excluded(name, t) || two_nans(name, &a, &b) {
                        true => refused(name, &[&a, &b], &typed(t)),
                        false => same(name, &[&a, &b], &typed(t)),
                    }
                }
                let compared = map(vec![("input_type", dtype_term(t)), ("type", dtype_term(Dtype::U8))]);
                for name in COMPARE {
                    same(name, &[&a, &b], &compared);
                }
                for name in LOGICAL {
                    same(name, &[&a, &b], &to_u8);
                }
            }
            for name in ["negate", "abs", "copy"] {
                same(name, &[&x], &typed(t));
            }
            same("logical_not", &[&x], &to_u8);
            // Each value's truth picks one of two others (one broadcast).
            let on_true = samples(Dtype::F32, &mut random);
            let on_false = Value {
                shape: vec![],
                data: Data::F32(vec![f32::NAN]),
            };
            same("select", &[&x, &on_true, &on_false], &typed(Dtype::F32));
            // Conversions, and ops across types (both sides converted first).
            for &to in TYPES {
                for name in ["astype", "copy", "negate", "abs"] {
                    match t.is_float() && !to.is_float() {
                        true => refused(name, &[&x], &typed(to)),
                        false => same(name, &[&x], &typed(to)),
                    }
                }
                if to.is_float() || !t.is_float() {
                    let y = samples(to, &mut random);
                    let first = |v: &Value| vector(v.data.gather(&(0..8).collect::<Vec<_>>()));
                    for (a, b) in pairs(&first(&x), &first(&y)) {
                        same("add", &[&a, &b], &typed(to));
                        same("max", &[&b, &a], &typed(to));
                        let compared = map(vec![("input_type", dtype_term(to)), ("type", dtype_term(Dtype::F32))]);
                        same("less", &[&a, &b], &compared);
                    }
                }
            }
        }
    }

    #[test]
    fn shapes_broadcast_as_numpy_and_mlx() {
        let mut random = Random(7);
        let values = |shape: &[i32], random: &mut Random| {
            let n = shape.iter().product::<i32>() as usize;
            Value {
                shape: shape.to_vec(),
                data: samples(Dtype::F32, random).data.gather(&(0..n).collect::<Vec<_>>()),
            }
        };
        let broadcasting: [(&[i32], &[i32]); 7] = [
            (&[], &[4]),
            (&[2, 1], &[1, 3]),
            (&[3], &[2, 3]),
            (&[0], &[1]),
            (&[1], &[0]),
            (&[2, 1, 2], &[3, 1]),
            (&[4, 4], &[4, 4]),
        ];
        for (l, r) in broadcasting {
            let (a, b) = (values(l, &mut random), values(r, &mut random));
            same("add", &[&a, &b], &typed(Dtype::F32));
            same(
                "less",
                &[&b, &a],
                &map(vec![
                    ("input_type", dtype_term(Dtype::F32)),
                    ("type", dtype_term(Dtype::U8)),
                ]),
            );
            same("select", &[&a, &b, &a], &typed(Dtype::F32));
        }
        let shaped = |key: &str, shape: &[i32]| map(vec![(key, shape_term(shape)), ("type", dtype_term(Dtype::F32))]);
        let six = values(&[6], &mut random);
        same("reshape", &[&six], &shaped("shape", &[2, 3]));
        same("reshape", &[&six], &shaped("shape", &[6, 1, 1]));
        let three = values(&[3], &mut random);
        same("broadcast_to", &[&three], &shaped("shape", &[2, 3]));
        same("broadcast_to", &[&values(&[1], &mut random)], &shaped("shape", &[0]));
        let broadcast = |shape: &[i32], axes: &[i32]| {
            map(vec![
                ("shape", shape_term(shape)),
                ("axes", shape_term(axes)),
                ("type", dtype_term(Dtype::F32)),
            ])
        };
        same("broadcast", &[&three], &broadcast(&[2, 3], &[1]));
        same("broadcast", &[&three], &broadcast(&[3, 2], &[0]));
        let constant = map(vec![
            ("shape", shape_term(&[2, 2])),
            ("type", dtype_term(Dtype::S64)),
            ("value", Term::Binary((-3i64).to_ne_bytes().to_vec())),
        ]);
        same("constant", &[], &constant);
        // What MLX refuses, the host path refuses too (MLX then fails the
        // op), and results past the bound.
        let two = values(&[2], &mut random);
        for (name, ins, a) in [
            ("add", vec![&two, &three], typed(Dtype::F32)),
            ("reshape", vec![&six], shaped("shape", &[4])),
            ("broadcast_to", vec![&three], shaped("shape", &[3, 2])),
            (
                "add",
                vec![&values(&[8, 1], &mut random), &values(&[1, 9], &mut random)],
                typed(Dtype::F32),
            ),
        ] {
            refused(name, &ins, &a);
        }
    }
}
