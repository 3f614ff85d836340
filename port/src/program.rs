//! Programs: a whole graph of ops over numbered slots, defined once by
//! `:define_program` and run by `:run_program` (protocol.md §6, "Programs").
//!
//! A step is an op of the op table, run through the same builder and the
//! same checks as an eager request (indices, divisors, element counts, the
//! memory limit), or a control-flow step (`while`, `cond`) whose condition
//! is evaluated here, in the worker. The first failing step fails the run
//! and names its op, as an eager op would.
//!
//! A while loop of small arrays and simple ops runs on the host instead
//! (`host`): an MLX op costs ~4 µs however small, which is all such a
//! loop's iteration is.

mod host;

use crate::budget::{self, budget, EvalError};
use crate::checks::Checks;
use crate::mlx::{ops, Array, Compiled, Dtype, Evaluated};
use crate::ops::{builder, Builder};
use crate::registry::Failure;
use crate::term::Term;
use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Programs one worker holds at most; the client evicts below this.
pub const MAX_PROGRAMS: usize = 4096;
/// Slots one program may number.
pub const MAX_SLOTS: usize = 1 << 20;

type Fail = Rc<Failure>;

pub struct Program {
    slots: usize,
    inputs: Vec<usize>,
    /// The input positions a top-level write (`ops::MOVES_FIRST_INPUT`)
    /// takes over, among the first `args` (see `donated`).
    donated: Vec<usize>,
    outputs: Vec<usize>,
    steps: Rc<Vec<Step>>,
    fused: Option<Fused>,
}

/// A program run through `mlx::core::compile` (`fuse: true`), which fuses
/// its element-wise chains into single kernels.
struct Fused {
    compiled: Compiled,
    /// Off once compiling failed for a reason other than the program's own
    /// steps (no C++ compiler, say): it then runs unfused.
    on: Cell<bool>,
    /// Whether the last trace failed in a step: that call runs unfused, and
    /// reports the step's failure as an unfused run would.
    trace_failed: Rc<Cell<bool>>,
}

enum Step {
    Op {
        name: String,
        builder: Builder,
        ins: Vec<usize>,
        outs: Vec<usize>,
        attrs: Term,
        /// For a small creation op (`constant`, `iota`, `eye`), its arrays,
        /// evaluated once when the program is defined: each run shares them
        /// (a trace builds its own, as MLX compiles only what it traces).
        literal: Option<Vec<Array>>,
    },
    While {
        init: Vec<usize>,
        outs: Vec<usize>,
        state: Vec<usize>,
        cond: Rc<Vec<Step>>,
        pred: usize,
        body: Rc<Branch>,
        /// With `fuse: true`, `UNROLL` iterations (each the body, then the
        /// next condition) compiled: state and `free` slots in, the new
        /// state and the condition's flag out.
        fused: Option<(Fused, Vec<usize>)>,
        /// The iteration cut into the part the condition depends on and the
        /// rest, when it can be (`Split::new`).
        split: Option<Split>,
        /// The loop as the host runs it, when its steps are all host ops
        /// (`host::Loop`); it runs there when its arrays are small too.
        host: Option<Box<host::Loop>>,
    },
    Cond {
        outs: Vec<usize>,
        clauses: Vec<(Vec<Step>, usize, Branch)>,
        last: Branch,
    },
    /// A hook (`Nx.Defn.Kernel.hook/3`, `print_value/2`, tokens): `ins`
    /// are evaluated and sent to the caller as they are reached, while the
    /// program goes on (`HookSink`).
    Hook { id: u64, ins: Vec<usize> },
}

/// Where a run's hook steps send their values: the caller of `run_program`
/// (see `session::program_calls`). `Err` stops the program with that
/// message (the caller cancelled, or is gone).
pub trait HookSink {
    fn fire(&mut self, id: u64, values: Vec<Evaluated>) -> Result<(), String>;
}

/// Steps and the slots holding their results.
struct Branch {
    steps: Vec<Step>,
    results: Vec<usize>,
}

/// A while loop's iteration (its condition, then its body) cut in two: the
/// control part, the state the condition depends on (a counter, say) with
/// the steps computing it and the flag, and the data part, the rest of the
/// state with the steps computing it (the control steps it reads run again).
/// A small control part runs ahead (`Run::split_loop`): many iterations of it
/// built lazily and evaluated at once, so that the worker learns how many
/// iterations run from one evaluation per chunk, not one per iteration. The
/// data part then runs exactly those iterations, as the loop would (nothing
/// past the end, nothing masked), and is evaluated with the next chunk.
struct Split {
    /// Positions in the state of the control part, and of the data part.
    control: Vec<usize>,
    data: Vec<usize>,
    /// Indices of each part's steps in the condition, and in the body.
    control_steps: (Vec<usize>, Vec<usize>),
    data_steps: (Vec<usize>, Vec<usize>),
}

impl Split {
    /// None when the control part holds control flow of its own, or the
    /// loop fires hooks (they must fire once per iteration, in order).
    fn new(state: &[usize], cond: &[Step], pred: usize, body: &Branch) -> Option<Split> {
        if has_hooks(cond) || has_hooks(&body.steps) {
            return None;
        }
        let steps: Vec<&Step> = cond.iter().chain(&body.steps).collect();
        let io: Vec<(Vec<usize>, Vec<usize>)> = steps.iter().map(|s| reads_writes(s)).collect();
        // The state positions each slot depends on.
        let mut deps: HashMap<usize, Vec<usize>> = state.iter().enumerate().map(|(j, s)| (*s, vec![j])).collect();
        for (reads, writes) in &io {
            let mut on: Vec<usize> = reads
                .iter()
                .flat_map(|r| deps.get(r).cloned().unwrap_or_default())
                .collect();
            on.sort_unstable();
            on.dedup();
            for w in writes {
                deps.insert(*w, on.clone());
            }
        }
        let on = |slot: usize| deps.get(&slot).cloned().unwrap_or_default();
        let mut control = on(pred);
        loop {
            let mut wider = control.clone();
            wider.extend(control.iter().flat_map(|j| on(body.results[*j])));
            wider.sort_unstable();
            wider.dedup();
            if wider == control {
                break;
            }
            control = wider;
        }
        let data: Vec<usize> = (0..state.len()).filter(|j| !control.contains(j)).collect();
        // The steps that compute `targets`, by index.
        let slice = |targets: Vec<usize>| {
            let mut wanted: std::collections::HashSet<usize> = targets.into_iter().collect();
            let mut picked = vec![false; steps.len()];
            for (i, (reads, writes)) in io.iter().enumerate().rev() {
                if writes.iter().any(|w| wanted.contains(w)) {
                    picked[i] = true;
                    wanted.extend(reads);
                }
            }
            let at = |range: std::ops::Range<usize>| range.filter(|i| picked[*i]).collect::<Vec<_>>();
            (
                at(0..cond.len()),
                at(cond.len()..steps.len())
                    .iter()
                    .map(|i| i - cond.len())
                    .collect::<Vec<_>>(),
            )
        };
        let control_steps = slice(control.iter().map(|j| body.results[*j]).chain([pred]).collect());
        let op = |s: &Step| matches!(s, Step::Op { .. });
        let all_ops =
            control_steps.0.iter().all(|i| op(&cond[*i])) && control_steps.1.iter().all(|i| op(&body.steps[*i]));
        all_ops.then(|| Split {
            data_steps: slice(data.iter().map(|j| body.results[*j]).collect()),
            control,
            data,
            control_steps,
        })
    }
}

/// The slots a step reads and writes (those of the steps inside a `while`
/// or `cond` included: reading more only makes a split coarser).
fn reads_writes(step: &Step) -> (Vec<usize>, Vec<usize>) {
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    let inner = |steps: &[Step], results: &[usize], reads: &mut Vec<usize>, writes: &mut Vec<usize>| {
        reads.extend(results);
        for s in steps {
            let (r, w) = reads_writes(s);
            reads.extend(r);
            writes.extend(w);
        }
    };
    match step {
        Step::Op { ins, outs, .. } => return (ins.clone(), outs.clone()),
        Step::While {
            init,
            outs,
            state,
            cond,
            pred,
            body,
            ..
        } => {
            reads.extend(init.iter().chain([pred]));
            writes.extend(outs.iter().chain(state));
            inner(cond, &[], &mut reads, &mut writes);
            inner(&body.steps, &body.results, &mut reads, &mut writes);
        }
        Step::Hook { ins, .. } => reads.extend(ins),
        Step::Cond { outs, clauses, last } => {
            writes.extend(outs);
            for (pred_steps, pred, branch) in clauses {
                inner(pred_steps, &[*pred], &mut reads, &mut writes);
                inner(&branch.steps, &branch.results, &mut reads, &mut writes);
            }
            inner(&last.steps, &last.results, &mut reads, &mut writes);
        }
    }
    (reads, writes)
}

/// The programs of one session, by client-assigned id.
#[derive(Default)]
pub struct Programs {
    held: HashMap<u64, Program>,
}

impl Programs {
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn get(&self, id: u64) -> Option<&Program> {
        self.held.get(&id)
    }

    /// Parses and keeps `attrs` (`%{id:, slots:, inputs:, outputs:, steps:}`,
    /// and `fuse: true` to fuse it when it can be).
    pub fn define(&mut self, attrs: &Term, checks: &Checks) -> Result<(), String> {
        let id = attrs
            .get("id")
            .and_then(Term::as_int)
            .and_then(|i| u64::try_from(i).ok())
            .filter(|i| *i > 0)
            .ok_or_else(|| format!("define_program needs a positive integer id, got {attrs}"))?;
        if self.held.contains_key(&id) {
            return Err(format!("program {id} is already defined"));
        }
        if self.held.len() >= MAX_PROGRAMS {
            return Err(format!(
                "the worker holds {MAX_PROGRAMS} programs, its most; release some first"
            ));
        }
        let fuse = attrs.get("fuse").is_some_and(|f| f.is_atom("true")) && !checks.detect_non_finite;
        let mut program = Program::parse(attrs, checks, fuse)?;
        if fuse {
            program.fuse(*checks);
        }
        self.held.insert(id, program);
        Ok(())
    }

    pub fn release(&mut self, id: u64) {
        self.held.remove(&id);
    }
}

impl Program {
    /// With `fuse`, the while loops whose iterations can be traced are
    /// compiled (see `fuse_loops`).
    fn parse(attrs: &Term, checks: &Checks, fuse: bool) -> Result<Program, String> {
        let slots = field(attrs, "slots")?
            .as_int()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| *n <= MAX_SLOTS)
            .ok_or_else(|| format!("slots must be an integer in 0..={MAX_SLOTS}"))?;
        let p = Parser {
            slots,
            literals: !checks.detect_non_finite,
        };
        let inputs = p.slot_list(field(attrs, "inputs")?)?;
        let args = match attrs.get("args") {
            None => 0,
            Some(n) => n
                .as_int()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n <= inputs.len())
                .ok_or_else(|| format!("args must be an integer in 0..={}, got {n}", inputs.len()))?,
        };
        let steps = p.steps(field(attrs, "steps")?)?;
        let donated = donated(&steps, &inputs[..args]);
        Ok(Program {
            slots,
            inputs,
            donated,
            outputs: p.slot_list(field(attrs, "outputs")?)?,
            steps: Rc::new({
                let mut steps = steps;
                if fuse {
                    fuse_loops(&mut steps, slots, *checks);
                }
                steps
            }),
            fused: None,
        })
    }

    /// Compiles the program with `mlx::core::compile` when every step can
    /// be traced (no control flow, no op that evaluates while it is built)
    /// and a C++ compiler is there for MLX's CPU kernels; else it stays
    /// unfused.
    fn fuse(&mut self, checks: Checks) {
        if !self.steps.iter().all(fusible) || !compiler_available() {
            return;
        }
        let trace_failed = Rc::new(Cell::new(false));
        let (steps, slots, failed) = (self.steps.clone(), self.slots, trace_failed.clone());
        let (inputs, outputs) = (self.inputs.clone(), self.outputs.clone());
        let body = Box::new(move |arrays: &[Array]| {
            let refs: Vec<&Array> = arrays.iter().collect();
            let result = execute(&steps, slots, &inputs, &outputs, &refs, &checks, true, None);
            failed.set(result.is_err());
            result.map_err(|f| format!("{}: {}", f.op, f.message))
        });
        self.fused = Fused::new(self.outputs.len(), body, trace_failed);
    }

    pub fn inputs(&self) -> usize {
        self.inputs.len()
    }

    pub fn outputs(&self) -> usize {
        self.outputs.len()
    }

    /// The input positions whose ids a successful run spends (see `donated`).
    pub fn donated(&self) -> &[usize] {
        &self.donated
    }

    /// Runs the program on `inputs` (one per input slot); its outputs, or
    /// the first failure.
    pub fn run(&self, inputs: &[&Array], checks: &Checks) -> Result<Vec<Array>, Fail> {
        self.run_with_hooks(inputs, checks, None)
    }

    /// Whether the program has hook steps (it must then run as a call, whose
    /// caller receives their values).
    pub fn has_hooks(&self) -> bool {
        has_hooks(&self.steps)
    }

    /// As `run`, hook steps sending their values to `hooks` (with `None`,
    /// a hook step fails the run).
    pub fn run_with_hooks<'a>(
        &self,
        inputs: &[&Array],
        checks: &'a Checks,
        hooks: Option<&'a mut dyn HookSink>,
    ) -> Result<Vec<Array>, Fail> {
        if let Some(arrays) = self.fused.as_ref().and_then(|f| f.call(inputs)) {
            budget::admit_results(&arrays).map_err(|e| Failure::new("run_program", e.to_string()))?;
            return Ok(arrays);
        }
        execute(
            &self.steps,
            self.slots,
            &self.inputs,
            &self.outputs,
            inputs,
            checks,
            false,
            hooks,
        )
    }
}

fn has_hooks(steps: &[Step]) -> bool {
    steps.iter().any(|step| match step {
        Step::Hook { .. } => true,
        Step::Op { .. } => false,
        Step::While { cond, body, .. } => has_hooks(cond) || has_hooks(&body.steps),
        Step::Cond { clauses, last, .. } => {
            has_hooks(&last.steps) || clauses.iter().any(|(p, _, b)| has_hooks(p) || has_hooks(&b.steps))
        }
    })
}

impl Fused {
    fn new(outputs: usize, body: crate::mlx::Trace, trace_failed: Rc<Cell<bool>>) -> Option<Fused> {
        // MLX caches traces by this id, per thread.
        static NEXT_ID: AtomicUsize = AtomicUsize::new(1);
        match Compiled::new(NEXT_ID.fetch_add(1, Ordering::Relaxed), outputs, body) {
            Ok(compiled) => Some(Fused {
                compiled,
                on: Cell::new(true),
                trace_failed,
            }),
            Err(e) => {
                log::warn!("a program runs unfused: {}", e.message);
                None
            }
        }
    }

    /// The compiled function's outputs, or None when this call must run
    /// unfused (its trace failed in a step, or compiling is off).
    fn call(&self, inputs: &[&Array]) -> Option<Vec<Array>> {
        if !self.on.get() {
            return None;
        }
        match self.compiled.call(inputs) {
            Ok(arrays) => Some(arrays),
            Err(_) if self.trace_failed.get() => None,
            Err(e) => {
                log::warn!("a program runs unfused from now on: {}", e.message);
                self.on.set(false);
                None
            }
        }
    }
}

/// Compiles each while loop of `steps` (nested ones too) whose condition
/// and body can be traced: `UNROLL` iterations become one fused call.
fn fuse_loops(steps: &mut [Step], slots: usize, checks: Checks) {
    for step in steps.iter_mut() {
        let Step::While {
            state,
            cond,
            pred,
            body,
            fused,
            ..
        } = step
        else {
            continue;
        };
        if !cond.iter().chain(&body.steps).all(fusible) || !compiler_available() {
            continue;
        }
        // What an iteration reads and does not define itself.
        let mut defined: Vec<usize> = state.clone();
        let mut free = Vec::new();
        for s in cond.iter().chain(&body.steps) {
            if let Step::Op { ins, outs, .. } = s {
                free.extend(ins.iter().filter(|i| !defined.contains(i)));
                defined.extend(outs);
            }
        }
        free.extend(body.results.iter().chain([&*pred]).filter(|i| !defined.contains(i)));
        free.sort_unstable();
        free.dedup();
        let trace_failed = Rc::new(Cell::new(false));
        let n_state = state.len();
        let (cond, body, state, pred, failed) =
            (cond.clone(), body.clone(), state.clone(), *pred, trace_failed.clone());
        let free_slots = free.clone();
        let iteration = Box::new(move |arrays: &[Array]| {
            let result = (|| {
                let mut run = Run {
                    slots: (0..slots).map(|_| None).collect(),
                    checks: &checks,
                    tracing: true,
                    hooks: None,
                };
                let values = arrays.iter().map(share).collect::<Result<Vec<_>, Fail>>()?;
                let (state_values, free_values) = values.split_at(state.len());
                run.set(&state, state_values.iter().map(share).collect::<Result<_, _>>()?);
                run.set(&free_slots, free_values.iter().map(share).collect::<Result<_, _>>()?);
                let flag = run.unrolled(&cond, pred, &body, &state)?;
                let mut out = run.values(&state, "while")?;
                out.push(flag);
                Ok(out)
            })();
            failed.set(result.is_err());
            result.map_err(|f: Fail| format!("{}: {}", f.op, f.message))
        });
        *fused = Fused::new(n_state + 1, iteration, trace_failed).map(|f| (f, free));
    }
}

/// The positions in `args` of the inputs that a top-level step of `steps`
/// writes in place (an op of `ops::MOVES_FIRST_INPUT`, `kv_write`, whose
/// first input is that slot). As an eager write spends its cache, a run
/// spends those inputs' ids once it is built, so that the program's graph
/// holds the only handle and MLX writes into the buffer instead of copying
/// it; anything else still reading the old contents makes MLX copy. Only
/// `args` (the function's arguments, not its captured tensors, which the
/// next call reads again) are candidates, and a slot also read by a later
/// top-level step still is one: that step's node holds the old array.
fn donated(steps: &[Step], args: &[usize]) -> Vec<usize> {
    let written: Vec<usize> = steps
        .iter()
        .filter_map(|step| match step {
            Step::Op { name, ins, .. } if crate::ops::MOVES_FIRST_INPUT.contains(&name.as_str()) => {
                ins.first().copied()
            }
            _ => None,
        })
        .collect();
    (0..args.len()).filter(|&i| written.contains(&args[i])).collect()
}

/// Runs `steps` over fresh slots: `inputs` fill `input_slots`, the result
/// is the `output_slots`.
#[allow(clippy::too_many_arguments)]
fn execute<'a>(
    steps: &[Step],
    slots: usize,
    input_slots: &[usize],
    output_slots: &[usize],
    inputs: &[&Array],
    checks: &'a Checks,
    tracing: bool,
    hooks: Option<&'a mut dyn HookSink>,
) -> Result<Vec<Array>, Fail> {
    let mut values: Vec<Option<Array>> = (0..slots).map(|_| None).collect();
    for (slot, array) in input_slots.iter().zip(inputs) {
        values[*slot] = Some(share(array)?);
    }
    let mut run = Run {
        slots: values,
        checks,
        tracing,
        hooks,
    };
    run.steps(steps)?;
    run.values(output_slots, "run_program")
}

/// Ops a trace can hold: they build lazily (no evaluation while built).
const FUSIBLE: &[&str] = &[
    "constant",
    "iota",
    "eye",
    "astype",
    "reshape",
    "broadcast_to",
    "bitcast",
    "broadcast",
    "transpose",
    "reverse",
    "pad",
    "concatenate",
    "stack",
    "select",
    "clip",
    "copy",
    "add",
    "subtract",
    "multiply",
    "divide",
    "pow",
    "atan2",
    "min",
    "max",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "left_shift",
    "right_shift",
    "equal",
    "not_equal",
    "greater",
    "less",
    "greater_equal",
    "less_equal",
    "logical_and",
    "logical_or",
    "logical_xor",
    "exp",
    "expm1",
    "log",
    "log1p",
    "sigmoid",
    "cos",
    "sin",
    "tan",
    "cosh",
    "sinh",
    "tanh",
    "acos",
    "asin",
    "atan",
    "acosh",
    "asinh",
    "atanh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "erf",
    "erfc",
    "erf_inv",
    "abs",
    "bitwise_not",
    "ceil",
    "conjugate",
    "floor",
    "negate",
    "round",
    "sign",
    "real",
    "imag",
    "is_nan",
    "is_infinity",
    "logical_not",
    "phase",
    "sum",
    "product",
    "reduce_max",
    "reduce_min",
    "all",
    "any",
    "argmax",
    "argmin",
    "matmul",
    "dot",
];

fn fusible(step: &Step) -> bool {
    matches!(step, Step::Op { name, .. } if FUSIBLE.contains(&name.as_str()))
}

/// Whether MLX can build fused CPU kernels here: it compiles them with g++
/// at run time (checked once).
fn compiler_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let found = std::process::Command::new("g++")
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            log::warn!("no C++ compiler (g++) for MLX's fused kernels: programs run unfused");
        }
        found
    })
}

fn field<'a>(attrs: &'a Term, key: &str) -> Result<&'a Term, String> {
    attrs
        .get(key)
        .ok_or_else(|| format!("define_program: missing attribute {key}"))
}

struct Parser {
    slots: usize,
    /// Whether small creation ops may be evaluated once (not under
    /// `detect_non_finite`, which checks each op's results as it runs).
    literals: bool,
}

impl Parser {
    fn slot(&self, t: &Term) -> Result<usize, String> {
        t.as_int()
            .and_then(|i| usize::try_from(i).ok())
            .filter(|i| *i < self.slots)
            .ok_or_else(|| format!("bad slot {t} (the program has {} slots)", self.slots))
    }

    fn slot_list(&self, t: &Term) -> Result<Vec<usize>, String> {
        t.as_list()
            .ok_or_else(|| format!("expected a list of slots, got {t}"))?
            .iter()
            .map(|s| self.slot(s))
            .collect()
    }

    fn steps(&self, t: &Term) -> Result<Vec<Step>, String> {
        t.as_list()
            .ok_or_else(|| format!("steps must be a list, got {t}"))?
            .iter()
            .map(|s| self.step(s))
            .collect()
    }

    fn branch(&self, steps: &Term, results: &Term) -> Result<Branch, String> {
        Ok(Branch {
            steps: self.steps(steps)?,
            results: self.slot_list(results)?,
        })
    }

    /// `{name, ins, outs, attrs}`; `while` and `cond` are control flow.
    fn step(&self, t: &Term) -> Result<Step, String> {
        let [name, ins, outs, attrs] = t
            .as_tuple()
            .ok_or_else(|| format!("a step is {{op, ins, outs, attrs}}, got {t}"))?
        else {
            return Err(format!("a step is {{op, ins, outs, attrs}}, got {t}"));
        };
        let name = name
            .as_atom()
            .ok_or_else(|| format!("a step's op must be an atom, got {name}"))?;
        let (ins, outs) = (self.slot_list(ins)?, self.slot_list(outs)?);
        let get = |key: &str| attrs.get(key).ok_or_else(|| format!("{name}: missing attribute {key}"));
        match name {
            "while" => {
                let state = self.slot_list(get("state")?)?;
                let body = self.branch(get("body")?, get("results")?)?;
                if state.len() != ins.len() || body.results.len() != ins.len() || outs.len() != ins.len() {
                    return Err("while: its initial values, state, results and outs must have one length".into());
                }
                let (cond, pred) = (self.steps(get("cond")?)?, self.slot(get("pred")?)?);
                Ok(Step::While {
                    init: ins,
                    outs,
                    split: Split::new(&state, &cond, pred, &body),
                    host: host::Loop::new(&state, &cond, pred, &body).map(Box::new),
                    state,
                    cond: Rc::new(cond),
                    pred,
                    body: Rc::new(body),
                    fused: None,
                })
            }
            "cond" => {
                let clauses = get("clauses")?
                    .as_list()
                    .ok_or("cond: clauses must be a list")?
                    .iter()
                    .map(|c| match c.as_tuple() {
                        Some([pred_steps, pred, steps, results]) => {
                            Ok((self.steps(pred_steps)?, self.slot(pred)?, self.branch(steps, results)?))
                        }
                        _ => Err(format!(
                            "cond: a clause is {{pred_steps, pred, steps, results}}, got {c}"
                        )),
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                let last = match get("last")?.as_tuple() {
                    Some([steps, results]) => self.branch(steps, results)?,
                    _ => return Err("cond: last is {steps, results}".into()),
                };
                let same = |b: &Branch| b.results.len() == outs.len();
                if !same(&last) || !clauses.iter().all(|(_, _, b)| same(b)) {
                    return Err("cond: every branch must give one result per out".into());
                }
                Ok(Step::Cond { outs, clauses, last })
            }
            "hook" => {
                let id = get("id")?
                    .as_int()
                    .and_then(|i| u64::try_from(i).ok())
                    .ok_or_else(|| format!("hook: id must be an integer >= 0, got {attrs}"))?;
                if ins.is_empty() || !outs.is_empty() {
                    return Err("hook: it reads one or more slots and defines none".into());
                }
                Ok(Step::Hook { id, ins })
            }
            _ => {
                let (arity, builder) = builder(name).ok_or_else(|| format!("unknown op {name}"))?;
                if !arity.accepts(ins.len()) {
                    return Err(format!("{name} takes {arity} inputs, got {}", ins.len()));
                }
                Ok(Step::Op {
                    name: name.to_string(),
                    builder,
                    literal: self
                        .literals
                        .then(|| literal(name, builder, attrs, outs.len()))
                        .flatten(),
                    ins,
                    outs,
                    attrs: attrs.clone(),
                })
            }
        }
    }
}

/// Iterations of a while loop one fused call runs (`Run::unrolled`).
const UNROLL: usize = 16;

/// Iterations of a split loop's control part built ahead at most, and the
/// most elements an array of it may hold (`Run::split_loop`).
const FIRST_AHEAD: usize = 4;
const AHEAD: usize = 256;
const AHEAD_ELEMENTS: usize = 64;
/// The bytes a split loop's data part may define lazily (else it runs an
/// iteration at a time).
const DATA_AHEAD_BYTES: usize = 64 << 10;

/// Creation ops up to this size are evaluated once, when defined.
const LITERAL_BYTES: usize = 64 << 10;

/// The arrays of a creation op, evaluated, when it is small and builds;
/// otherwise it stays a step (and fails, if it does, when it runs, as an
/// eager op would).
fn literal(name: &str, builder: Builder, attrs: &Term, outs: usize) -> Option<Vec<Array>> {
    if !matches!(name, "constant" | "iota" | "eye") {
        return None;
    }
    let arrays = crate::ops::build(builder, &[], attrs).ok()?;
    let small = arrays.len() == outs && arrays.iter().all(|a| a.nbytes() <= LITERAL_BYTES);
    if !small || Checks::default().outputs(&arrays).is_err() {
        return None;
    }
    let refs: Vec<&Array> = arrays.iter().collect();
    budget::evaluate(&refs).ok()?;
    Some(arrays)
}

struct Run<'a> {
    slots: Vec<Option<Array>>,
    checks: &'a Checks,
    /// Inside `mlx::core::compile`'s trace.
    tracing: bool,
    /// Where hook steps send their values.
    hooks: Option<&'a mut dyn HookSink>,
}

fn share(array: &Array) -> Result<Array, Fail> {
    array.share().map_err(|e| Failure::new("run_program", e.message))
}

impl Run<'_> {
    fn get(&self, slot: usize, op: &str) -> Result<&Array, Fail> {
        self.slots[slot]
            .as_ref()
            .ok_or_else(|| Failure::new(op, format!("the program reads slot {slot} before defining it")))
    }

    fn values(&self, slots: &[usize], op: &str) -> Result<Vec<Array>, Fail> {
        slots.iter().map(|s| share(self.get(*s, op)?)).collect()
    }

    fn set(&mut self, slots: &[usize], arrays: Vec<Array>) {
        for (slot, array) in slots.iter().zip(arrays) {
            self.slots[*slot] = Some(array);
        }
    }

    fn steps(&mut self, steps: &[Step]) -> Result<(), Fail> {
        steps.iter().try_for_each(|step| self.step(step))
    }

    fn step(&mut self, step: &Step) -> Result<(), Fail> {
        match step {
            Step::Op {
                name,
                builder,
                ins,
                outs,
                attrs,
                literal,
            } => {
                let arrays = match literal {
                    Some(arrays) if !self.tracing => arrays.iter().map(share).collect::<Result<Vec<_>, Fail>>()?,
                    _ => self.op(name, *builder, ins, attrs)?,
                };
                if arrays.len() != outs.len() {
                    let message = format!("{name} defines {} tensors, the step named {}", arrays.len(), outs.len());
                    return Err(Failure::new(name, message));
                }
                self.set(outs, arrays);
                Ok(())
            }
            Step::While {
                init,
                outs,
                state,
                cond,
                pred,
                body,
                fused,
                split,
                host,
            } => {
                let values = self.values(init, "while")?;
                self.set(state, values);
                // Before any MLX path, fused ones too (faster for the
                // arrays it takes, by `bench/compiler.exs`'s while row).
                let plain = !self.tracing && !self.checks.detect_non_finite;
                let hosted = host.as_ref().filter(|_| plain).and_then(|h| h.run(&self.slots));
                match (hosted, split) {
                    (Some(arrays), _) => {
                        let arrays = arrays?;
                        budget::admit_results(&arrays).map_err(|e| Failure::new("while", e.to_string()))?;
                        self.set(state, arrays);
                    }
                    (None, Some(split)) if fused.is_none() && plain => {
                        self.split_loop(split, cond, *pred, body, state)?
                    }
                    _ => self.iterate(cond, *pred, body, state, fused.as_ref())?,
                }
                let values = self.values(state, "while")?;
                self.set(outs, values);
                Ok(())
            }
            Step::Cond { outs, clauses, last } => {
                let mut chosen = last;
                for (pred_steps, pred, branch) in clauses {
                    self.steps(pred_steps)?;
                    if truth(self.get(*pred, "cond")?, "cond")? {
                        chosen = branch;
                        break;
                    }
                }
                self.steps(&chosen.steps)?;
                let values = self.values(&chosen.results, "cond")?;
                self.set(outs, values);
                Ok(())
            }
            Step::Hook { id, ins } => self.hook(*id, ins),
        }
    }

    /// Evaluates a hook's values (within the memory limit, as a readback)
    /// and sends them to the caller.
    fn hook(&mut self, id: u64, ins: &[usize]) -> Result<(), Fail> {
        let mut values = Vec::with_capacity(ins.len());
        for slot in ins {
            let array = self.get(*slot, "hook")?;
            budget::evaluate(&[array]).map_err(|e| eval_failure("hook", e))?;
            if !array.row_contiguous() {
                budget()
                    .admit(array.nbytes())
                    .map_err(|e| Failure::new("hook", e.to_string()))?;
            }
            values.push(array.evaluate().map_err(|e| Failure::new("hook", e.message))?);
        }
        match self.hooks.as_deref_mut() {
            Some(sink) => sink.fire(id, values).map_err(|m| Failure::new("hook", m)),
            None => Err(Failure::new(
                "hook",
                "a program with hooks runs as a call (seq > 0), whose caller receives their values".to_string(),
            )),
        }
    }

    /// Runs a while loop from the state in its slots, one evaluation (of the
    /// condition's flag and the state) per iteration, or per `UNROLL`
    /// iterations when fused.
    fn iterate(
        &mut self,
        cond: &[Step],
        pred: usize,
        body: &Branch,
        state: &[usize],
        fused: Option<&(Fused, Vec<usize>)>,
    ) -> Result<(), Fail> {
        let mut flag = self.condition(cond, pred, state)?;
        while read_flag(&flag, "while")? {
            if let Some(mut arrays) = fused.and_then(|(f, free)| self.fused_iteration(f, state, free)) {
                budget::admit_results(&arrays).map_err(|e| Failure::new("while", e.to_string()))?;
                flag = arrays.pop().expect("the flag");
                self.set(state, arrays);
                let mut refs = vec![&flag];
                for slot in state.iter() {
                    refs.push(self.get(*slot, "while")?);
                }
                budget::evaluate(&refs).map_err(|e| eval_failure("while", e))?;
                continue;
            }
            self.steps(&body.steps)?;
            let values = self.values(&body.results, "while")?;
            self.set(state, values);
            flag = self.condition(cond, pred, state)?;
        }
        Ok(())
    }

    /// Runs a split while loop (see `Split`) from the state in its slots:
    /// chunks of `FIRST_AHEAD`, twice as many, … up to `AHEAD` iterations of the control part,
    /// each chunk's flags evaluated at once with the data state so far; then
    /// the data part of each iteration whose flag holds. A control part that
    /// is not small, or that fails to build ahead (where the loop may never
    /// go), hands the rest of the loop to `iterate`, which runs (and fails)
    /// exactly as the loop does.
    fn split_loop(
        &mut self,
        split: &Split,
        cond: &[Step],
        pred: usize,
        body: &Branch,
        state: &[usize],
    ) -> Result<(), Fail> {
        let pick = |from: &[usize], at: &[usize]| at.iter().map(|j| from[*j]).collect::<Vec<usize>>();
        let (control_slots, control_results) = (pick(state, &split.control), pick(&body.results, &split.control));
        let (data_slots, data_results) = (pick(state, &split.data), pick(&body.results, &split.data));
        let mut control = self.values(&control_slots, "while")?;
        let mut chunk = FIRST_AHEAD;
        let mut lazy_bytes = 0;
        loop {
            let mut flags = Vec::with_capacity(chunk);
            let mut ahead = Vec::with_capacity(chunk);
            for _ in 0..chunk {
                let from = ahead.last().unwrap_or(&control);
                let from = from.iter().map(share).collect::<Result<Vec<_>, Fail>>()?;
                self.set(&control_slots, from);
                let Some((flag, next)) = self.control_iteration(split, cond, pred, body, &control_results) else {
                    break;
                };
                flags.push(flag);
                ahead.push(next);
            }
            if flags.is_empty() {
                self.set(&control_slots, control);
                return self.iterate(cond, pred, body, state, None);
            }
            let mut refs: Vec<&Array> = flags.iter().chain(ahead.iter().flatten()).collect();
            for slot in &data_slots {
                refs.push(self.get(*slot, "while")?);
            }
            budget::evaluate(&refs).map_err(|e| eval_failure("while", e))?;
            drop(refs);
            let full = flags.len() == chunk;
            for (flag, next) in flags.iter().zip(ahead) {
                if !read_flag(flag, "while")? {
                    self.set(&control_slots, control);
                    return Ok(());
                }
                self.set(&control_slots, control);
                self.steps_at(cond, &split.data_steps.0)?;
                self.steps_at(&body.steps, &split.data_steps.1)?;
                let values = self.values(&data_results, "while")?;
                self.set(&data_slots, values);
                control = next;
                // A data part of large arrays gains nothing from running
                // ahead (measured slower on SMACOF's): the rest of the loop
                // runs an iteration at a time.
                lazy_bytes +=
                    self.made_bytes(cond, &split.data_steps.0) + self.made_bytes(&body.steps, &split.data_steps.1);
                if lazy_bytes > DATA_AHEAD_BYTES {
                    self.set(&control_slots, control);
                    return self.iterate(cond, pred, body, state, None);
                }
            }
            chunk = if full { (chunk * 2).min(AHEAD) } else { chunk };
        }
    }

    /// One iteration of a split loop's control part, built lazily from the
    /// control state in its slots: the condition's flag and the next
    /// control state; None when it fails, or reads or makes more than
    /// `AHEAD_ELEMENTS` elements in one array (too costly to run ahead).
    fn control_iteration(
        &mut self,
        split: &Split,
        cond: &[Step],
        pred: usize,
        body: &Branch,
        results: &[usize],
    ) -> Option<(Array, Vec<Array>)> {
        let steps = (split.control_steps.0.iter().map(|i| &cond[*i]))
            .chain(split.control_steps.1.iter().map(|i| &body.steps[*i]));
        for step in steps {
            let Step::Op { ins, outs, .. } = step else {
                return None;
            };
            let small = |run: &Self, slots: &[usize]| {
                slots
                    .iter()
                    .all(|s| run.slots[*s].as_ref().is_some_and(|a| a.size() <= AHEAD_ELEMENTS))
            };
            if !small(self, ins) || self.step(step).is_err() || !small(self, outs) {
                return None;
            }
        }
        let pred = self.get(pred, "while").ok().filter(|p| p.size() == 1)?;
        let flag = flag(pred, "while").ok()?;
        Some((flag, self.values(results, "while").ok()?))
    }

    /// The bytes of what the steps of `steps` at `at` defined.
    fn made_bytes(&self, steps: &[Step], at: &[usize]) -> usize {
        let outs = |step: &Step| match step {
            Step::Op { outs, .. } | Step::While { outs, .. } | Step::Cond { outs, .. } => outs.clone(),
            Step::Hook { .. } => Vec::new(),
        };
        at.iter()
            .flat_map(|i| outs(&steps[*i]))
            .filter_map(|s| self.slots[s].as_ref().map(Array::nbytes))
            .sum()
    }

    /// The steps of `steps` at `at`, in order.
    fn steps_at(&mut self, steps: &[Step], at: &[usize]) -> Result<(), Fail> {
        at.iter().try_for_each(|i| self.step(&steps[*i]))
    }

    /// Runs a while's condition on the current state, and evaluates the
    /// condition's flag with the state in one evaluation: the state is
    /// evaluated each iteration, so the graph does not grow with the
    /// iterations, and the flag is then read without another.
    fn condition(&mut self, cond: &[Step], pred: usize, state: &[usize]) -> Result<Array, Fail> {
        self.steps(cond)?;
        let flag = flag(self.get(pred, "while")?, "while")?;
        let mut arrays = vec![&flag];
        for slot in state {
            arrays.push(self.get(*slot, "while")?);
        }
        budget::evaluate(&arrays).map_err(|e| eval_failure("while", e))?;
        Ok(flag)
    }

    /// `UNROLL` iterations of a while loop whose condition holds now, built
    /// lazily (in a fused iteration's trace, so one compiled call runs them
    /// all): after the first, each iteration's state is `where(live,
    /// body(state), state)`, `live` being the condition so far, so once the
    /// condition fails the state stays the one the loop ends with, bit for
    /// bit. Only for steps that build lazily: an iteration built past the
    /// loop's end computes nothing that could fail or be seen. Returns
    /// `live` as the u8 flag.
    fn unrolled(&mut self, cond: &[Step], pred: usize, body: &Branch, state: &[usize]) -> Result<Array, Fail> {
        let fail = |e: crate::mlx::Error| Failure::new("while", e.message);
        let mut live: Option<Array> = None;
        for _ in 0..UNROLL {
            self.steps(&body.steps)?;
            let mut values = self.values(&body.results, "while")?;
            if let Some(live) = &live {
                for (value, slot) in values.iter_mut().zip(state) {
                    *value = ops::where_(live, value, self.get(*slot, "while")?).map_err(fail)?;
                }
            }
            self.set(state, values);
            self.steps(cond)?;
            let pred = self.get(pred, "while")?;
            if pred.size() != 1 {
                let message = format!("a condition must be a scalar, got {} values", pred.size());
                return Err(Failure::new("while", message));
            }
            let holds = ops::astype(pred, Dtype::Bool).map_err(fail)?;
            live = Some(match live {
                Some(live) => ops::logical_and(&live, &holds).map_err(fail)?,
                None => holds,
            });
        }
        ops::astype(&live.expect("UNROLL > 0"), Dtype::U8).map_err(fail)
    }

    /// One fused iteration of a while loop: its new state and flag, or None
    /// to run this iteration unfused.
    fn fused_iteration(&self, fused: &Fused, state: &[usize], free: &[usize]) -> Option<Vec<Array>> {
        let inputs: Vec<&Array> = state
            .iter()
            .chain(free)
            .map(|s| self.slots[*s].as_ref())
            .collect::<Option<_>>()?;
        fused.call(&inputs)
    }

    /// One op, through its builder and the checks an eager request passes.
    fn op(&self, name: &str, builder: Builder, ins: &[usize], attrs: &Term) -> Result<Vec<Array>, Fail> {
        let inputs = ins
            .iter()
            .map(|s| self.get(*s, name))
            .collect::<Result<Vec<&Array>, Fail>>()?;
        // As an eager request: what MLX's CUDA backend refuses to build is
        // built on the CPU (ops::build).
        let arrays = crate::ops::build(builder, &inputs, attrs)
            .and_then(|arrays| self.checks.outputs(&arrays).map(|()| arrays))
            .map_err(|m| Failure::new(name, m))?;
        budget::admit_results(&arrays).map_err(|e| Failure::new(name, e.to_string()))?;
        Ok(arrays)
    }
}

fn eval_failure(op: &str, e: EvalError) -> Fail {
    match e {
        EvalError::Exceeded(e) => Failure::new(op, e.to_string()),
        EvalError::Mlx(e) => Failure::new(op, e.message),
    }
}

/// A predicate as u8 (`x != 0`), lazily.
fn flag(pred: &Array, op: &str) -> Result<Array, Fail> {
    let converted = match pred.dtype() {
        Dtype::U8 => pred.share(),
        _ => ops::astype(pred, Dtype::Bool).and_then(|b| ops::astype(&b, Dtype::U8)),
    };
    converted.map_err(|e| Failure::new(op, e.message))
}

/// Whether a scalar flag is non-zero (as `Nx.to_number(pred) != 0`).
fn read_flag(flag: &Array, op: &str) -> Result<bool, Fail> {
    let fail = |m: String| Failure::new(op, m);
    match budget::read::<u8>(flag).map_err(fail)?.as_slice() {
        [v] => Ok(*v != 0),
        values => Err(fail(format!(
            "a condition must be a scalar, got {} values",
            values.len()
        ))),
    }
}

/// Whether a scalar predicate is non-zero.
fn truth(pred: &Array, op: &str) -> Result<bool, Fail> {
    read_flag(&flag(pred, op)?, op)
}
