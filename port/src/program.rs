//! Programs: a whole graph of ops over numbered slots, defined once by
//! `:define_program` and run by `:run_program` (protocol.md §6, "Programs").
//!
//! A step is an op of the op table, run through the same builder and the
//! same checks as an eager request (indices, divisors, element counts, the
//! memory limit), or a control-flow step (`while`, `cond`) whose condition
//! is evaluated here, in the worker. The first failing step fails the run
//! and names its op, as an eager op would.

use crate::budget::{self, EvalError};
use crate::checks::Checks;
use crate::mlx::{ops, Array, Dtype};
use crate::ops::{builder, Builder};
use crate::registry::Failure;
use crate::term::Term;
use std::collections::HashMap;
use std::rc::Rc;

/// Programs one worker holds at most; the client evicts below this.
pub const MAX_PROGRAMS: usize = 4096;
/// Slots one program may number.
pub const MAX_SLOTS: usize = 1 << 20;

type Fail = Rc<Failure>;

pub struct Program {
    slots: usize,
    inputs: Vec<usize>,
    outputs: Vec<usize>,
    steps: Vec<Step>,
}

enum Step {
    /// A small creation op (`constant`, `iota`, `eye`), evaluated once when
    /// the program is defined: each run shares its arrays.
    Literal { arrays: Vec<Array>, outs: Vec<usize> },
    Op {
        name: String,
        builder: Builder,
        ins: Vec<usize>,
        outs: Vec<usize>,
        attrs: Term,
    },
    While {
        init: Vec<usize>,
        outs: Vec<usize>,
        state: Vec<usize>,
        cond: Vec<Step>,
        pred: usize,
        body: Branch,
    },
    Cond {
        outs: Vec<usize>,
        clauses: Vec<(Vec<Step>, usize, Branch)>,
        last: Branch,
    },
}

/// Steps and the slots holding their results.
struct Branch {
    steps: Vec<Step>,
    results: Vec<usize>,
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

    /// Parses and keeps `attrs` (`%{id:, slots:, inputs:, outputs:, steps:}`).
    pub fn define(&mut self, attrs: &Term) -> Result<(), String> {
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
        self.held.insert(id, Program::parse(attrs)?);
        Ok(())
    }

    pub fn release(&mut self, id: u64) {
        self.held.remove(&id);
    }
}

impl Program {
    fn parse(attrs: &Term) -> Result<Program, String> {
        let slots = field(attrs, "slots")?
            .as_int()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| *n <= MAX_SLOTS)
            .ok_or_else(|| format!("slots must be an integer in 0..={MAX_SLOTS}"))?;
        let p = Parser { slots };
        Ok(Program {
            slots,
            inputs: p.slot_list(field(attrs, "inputs")?)?,
            outputs: p.slot_list(field(attrs, "outputs")?)?,
            steps: p.steps(field(attrs, "steps")?)?,
        })
    }

    pub fn inputs(&self) -> usize {
        self.inputs.len()
    }

    pub fn outputs(&self) -> usize {
        self.outputs.len()
    }

    /// Runs the program on `inputs` (one per input slot); its outputs, or
    /// the first failure.
    pub fn run(&self, inputs: &[&Array], checks: &Checks) -> Result<Vec<Array>, Fail> {
        let mut slots: Vec<Option<Array>> = (0..self.slots).map(|_| None).collect();
        for (slot, array) in self.inputs.iter().zip(inputs) {
            slots[*slot] = Some(share(array)?);
        }
        let mut run = Run { slots, checks };
        run.steps(&self.steps)?;
        run.values(&self.outputs, "run_program")
    }
}

fn field<'a>(attrs: &'a Term, key: &str) -> Result<&'a Term, String> {
    attrs
        .get(key)
        .ok_or_else(|| format!("define_program: missing attribute {key}"))
}

struct Parser {
    slots: usize,
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
                Ok(Step::While {
                    init: ins,
                    outs,
                    state,
                    cond: self.steps(get("cond")?)?,
                    pred: self.slot(get("pred")?)?,
                    body,
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
            _ => {
                let (arity, builder) = builder(name).ok_or_else(|| format!("unknown op {name}"))?;
                if !arity.accepts(ins.len()) {
                    return Err(format!("{name} takes {arity} inputs, got {}", ins.len()));
                }
                if let Some(arrays) = literal(name, builder, attrs, outs.len()) {
                    return Ok(Step::Literal { arrays, outs });
                }
                Ok(Step::Op {
                    name: name.to_string(),
                    builder,
                    ins,
                    outs,
                    attrs: attrs.clone(),
                })
            }
        }
    }
}

/// Creation ops up to this size are evaluated once, when defined.
const LITERAL_BYTES: usize = 64 << 10;

/// The arrays of a creation op, evaluated, when it is small and builds;
/// otherwise it stays a step (and fails, if it does, when it runs, as an
/// eager op would).
fn literal(name: &str, builder: Builder, attrs: &Term, outs: usize) -> Option<Vec<Array>> {
    if !matches!(name, "constant" | "iota" | "eye") {
        return None;
    }
    let arrays = builder(&[], attrs).ok()?;
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
            Step::Literal { arrays, outs } => {
                let arrays = arrays.iter().map(share).collect::<Result<Vec<_>, Fail>>()?;
                self.set(outs, arrays);
                Ok(())
            }
            Step::Op {
                name,
                builder,
                ins,
                outs,
                attrs,
            } => {
                let arrays = self.op(name, *builder, ins, attrs)?;
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
            } => {
                let values = self.values(init, "while")?;
                self.set(state, values);
                let mut flag = self.condition(cond, *pred, state)?;
                while read_flag(&flag, "while")? {
                    self.steps(&body.steps)?;
                    let values = self.values(&body.results, "while")?;
                    self.set(state, values);
                    flag = self.condition(cond, *pred, state)?;
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
        }
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

    /// One op, through its builder and the checks an eager request passes.
    fn op(&self, name: &str, builder: Builder, ins: &[usize], attrs: &Term) -> Result<Vec<Array>, Fail> {
        let inputs = ins
            .iter()
            .map(|s| self.get(*s, name))
            .collect::<Result<Vec<&Array>, Fail>>()?;
        let arrays = builder(&inputs, attrs)
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
