//! The worker's memory limit.
//!
//! MLX's CPU allocator ignores MLX's memory limit and returns NULL when
//! malloc fails, and MLX then crashes. So the worker checks every allocation
//! it can see coming against its own limit, before it happens:
//!
//! * an upload, before its buffer is allocated (reader thread), and a
//!   shared-memory upload before its file is made: its bytes live outside
//!   MLX's allocator, so they are held here (`Held`) until MLX lets go of
//!   them, and count as live buffers;
//! * each op's outputs, when the op is built (session thread);
//! * an evaluation (`evaluate`), before it runs: the output bytes of every
//!   not-yet-evaluated node it would compute (`mlx::memory::pending`),
//!   reserved while it runs. An `async_eval` (`evaluate_async`) keeps its
//!   reservation until the session thread sees it finished; a request that
//!   does not fit next to such reservations first waits for them to finish. A lazy chain too long to fit at once is
//!   evaluated in steps that each fit, so that what MLX frees between steps
//!   (intermediates nothing holds) makes room for the next.
//!
//! A request that does not fit fails with a message naming the sizes, and the
//! worker keeps serving.
//!
//! The budget also owns the cache's accounting: MLX's freed buffers, and
//! memory kept outside MLX's allocator for reuse (`keep`: the shared-memory
//! files of `shared`), all within one cache limit and cleared together. The limit covers results (every array MLX would
//! allocate), not scratch space inside a kernel; views (broadcasts,
//! transposes, slices, reshapes of dense tensors) count nothing. The budget
//! is process-wide, like MLX's allocator.

use crate::mlx::{self, memory, Array, Element};
use std::any::Any;
use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub struct Budget {
    limit: AtomicUsize,
    cache_limit: AtomicUsize,
    /// Bytes an evaluation in progress may still allocate.
    reserved: AtomicUsize,
    /// Live bytes outside MLX's allocator (shared-memory uploads).
    held: AtomicUsize,
    /// The most live bytes when memory was held, since start or
    /// `reset_peak` (MLX's own peak counts only its allocator).
    peak: AtomicUsize,
}

/// A request that would take the worker past its memory limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    pub need: usize,
    pub in_use: usize,
    pub limit: usize,
}

impl fmt::Display for Exceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "memory limit exceeded: needs {}, {} in use, limit {}",
            human(self.need),
            human(self.in_use),
            human(self.limit)
        )
    }
}

/// Holds bytes of the budget while an evaluation allocates them.
pub struct Reservation(usize);

impl Drop for Reservation {
    fn drop(&mut self) {
        budget().reserved.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// Live bytes outside MLX's allocator, counted until dropped.
pub struct Held(usize);

impl Drop for Held {
    fn drop(&mut self) {
        budget().held.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// The worker's budget. Its limit starts at MLX's default memory limit and
/// its cache limit at MLX's default, which is the memory limit.
pub fn budget() -> &'static Budget {
    static BUDGET: OnceLock<Budget> = OnceLock::new();
    BUDGET.get_or_init(|| {
        let limit = memory::limit();
        Budget {
            limit: AtomicUsize::new(limit),
            cache_limit: AtomicUsize::new(limit),
            reserved: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    })
}

impl Budget {
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    pub fn cache_limit(&self) -> usize {
        self.cache_limit.load(Ordering::Acquire)
    }

    /// Sets the limit (MLX's too, which MLX's GPU allocator enforces);
    /// returns the previous one.
    pub fn set_limit(&self, bytes: usize) -> crate::mlx::Result<usize> {
        memory::set_limit(bytes)?;
        Ok(self.limit.swap(bytes, Ordering::AcqRel))
    }

    pub fn set_cache_limit(&self, bytes: usize) -> crate::mlx::Result<usize> {
        memory::set_cache_limit(bytes)?;
        // The new limit first: a `keep` that takes the shelf's lock after
        // this trim then reads it (one before has its item trimmed).
        let previous = self.cache_limit.swap(bytes, Ordering::AcqRel);
        kept().trim(bytes);
        Ok(previous)
    }

    /// Checks that `need` more bytes fit under the limit, next to the live
    /// buffers and any reservation. When they fit only without MLX's cache,
    /// the cache is cleared first; when only without the reservations of
    /// this thread's async evaluations, those are waited for first.
    pub fn admit(&self, need: usize) -> Result<(), Exceeded> {
        match self.admit_now(need) {
            Err(_) if finish_async() => self.admit_now(need),
            result => result,
        }
    }

    fn admit_now(&self, need: usize) -> Result<(), Exceeded> {
        let limit = self.limit();
        let in_use = self.live().saturating_add(self.reserved.load(Ordering::Acquire));
        let total = in_use.saturating_add(need);
        if total > limit {
            return Err(Exceeded { need, in_use, limit });
        }
        if total.saturating_add(cache()) > limit {
            // Freed buffers would otherwise keep the process above the limit.
            let _ = clear_cache();
        }
        Ok(())
    }

    /// Bytes that still fit under the limit.
    pub fn room(&self) -> usize {
        let in_use = self.live().saturating_add(self.reserved.load(Ordering::Acquire));
        self.limit().saturating_sub(in_use)
    }

    /// Bytes in live buffers: MLX's and those held outside it.
    pub fn live(&self) -> usize {
        memory::active().saturating_add(self.held.load(Ordering::Acquire))
    }

    /// `admit`, then counts `need` bytes as live until the `Held` drops.
    pub fn hold(&self, need: usize) -> Result<Held, Exceeded> {
        self.admit(need)?;
        self.held.fetch_add(need, Ordering::AcqRel);
        self.peak.fetch_max(self.live(), Ordering::AcqRel);
        Ok(Held(need))
    }

    /// The most live bytes reached by an allocation since start or
    /// `reset_peak`: MLX's peak, or more with memory held outside it.
    pub fn peak(&self) -> usize {
        memory::peak().max(self.peak.load(Ordering::Acquire))
    }

    pub fn reset_peak(&self) -> crate::mlx::Result<()> {
        memory::reset_peak()?;
        self.peak.store(0, Ordering::Release);
        Ok(())
    }

    /// `admit`, then holds `need` bytes until the reservation drops.
    pub fn reserve(&self, need: usize) -> Result<Reservation, Exceeded> {
        self.admit(need)?;
        self.reserved.fetch_add(need, Ordering::AcqRel);
        Ok(Reservation(need))
    }
}

/// Freed memory kept for reuse: MLX's buffers and what was `keep`-ed.
pub fn cache() -> usize {
    memory::cache().saturating_add(kept().bytes)
}

/// Returns the cached memory to the system: what was `keep`-ed, and MLX's
/// cache (its error, if any, is returned).
pub fn clear_cache() -> mlx::Result<()> {
    let mut kept = kept();
    kept.trim(0);
    kept.cleared += 1;
    drop(kept);
    memory::clear_cache()
}

/// How many times the cache was cleared: what `keep_unless_cleared` checks.
pub fn cleared() -> u64 {
    kept().cleared
}

/// `keep`, unless the cache was cleared since `cleared()` returned `since`:
/// for items made in the background, so that nothing made before a
/// `clear_cache` arrives after it.
pub fn keep_unless_cleared<T: Any + Send>(since: u64, len: usize, item: T) {
    // MLX's cache is read outside the shelf's lock (MLX may free an adopted
    // buffer, and so `keep`, under its own), the limit under it (see
    // `set_cache_limit`).
    let mlx_cache = memory::cache();
    let mut kept = kept();
    let room = budget().cache_limit().saturating_sub(mlx_cache);
    if len > room || kept.cleared != since {
        return;
    }
    kept.items.push((len, Box::new(item)));
    kept.bytes += len;
    kept.trim(room);
}

/// Keeps `item`, which holds `len` bytes of freed memory outside MLX's
/// allocator (a memory file), for reuse by `take_kept`: it counts as cache,
/// and is dropped when it does not fit within the cache limit next to MLX's
/// cache, by `clear_cache`, or to make room for newer ones.
pub fn keep<T: Any + Send>(len: usize, item: T) {
    let mlx_cache = memory::cache();
    let mut kept = kept();
    let room = budget().cache_limit().saturating_sub(mlx_cache);
    if len > room {
        return;
    }
    kept.items.push((len, Box::new(item)));
    kept.bytes += len;
    kept.trim(room);
}

/// The newest kept item of type `T` and exactly `len` bytes, taken out of
/// the cache.
pub fn take_kept<T: Any + Send>(len: usize) -> Option<T> {
    let mut kept = kept();
    let i = kept.items.iter().rposition(|(n, item)| *n == len && item.is::<T>())?;
    kept.bytes -= len;
    let (_, item) = kept.items.remove(i);
    item.downcast().ok().map(|item| *item)
}

/// The newest kept item of type `T` that `which` picks, taken out of the
/// cache, with its length.
pub fn take_kept_where<T: Any + Send>(which: impl Fn(&T) -> bool) -> Option<(usize, T)> {
    let mut kept = kept();
    let i = kept
        .items
        .iter()
        .rposition(|(_, item)| item.downcast_ref::<T>().is_some_and(&which))?;
    let (len, item) = kept.items.remove(i);
    kept.bytes -= len;
    item.downcast().ok().map(|item| (len, *item))
}

/// Kept items, oldest first (see `keep`).
#[derive(Default)]
struct Shelf {
    items: Vec<(usize, Box<dyn Any + Send>)>,
    bytes: usize,
    cleared: u64,
}

impl Shelf {
    fn trim(&mut self, to: usize) {
        while self.bytes > to {
            let (len, _) = self.items.remove(0);
            self.bytes -= len;
        }
    }
}

fn kept() -> MutexGuard<'static, Shelf> {
    static KEPT: OnceLock<Mutex<Shelf>> = OnceLock::new();
    // A panic ends the process (main.rs), so the lock is never poisoned in use.
    KEPT.get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Why a request does not fit, or MLX's error while finding out.
#[derive(Debug)]
pub enum EvalError {
    Exceeded(Exceeded),
    Mlx(mlx::Error),
}

impl fmt::Display for EvalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvalError::Exceeded(e) => e.fmt(f),
            EvalError::Mlx(e) => e.fmt(f),
        }
    }
}

/// Checks that the results of a newly built op fit.
pub fn admit_results(arrays: &[Array]) -> Result<(), EvalError> {
    let need = arrays
        .iter()
        .try_fold(0usize, |sum, a| a.result_bytes().map(|b| sum.saturating_add(b)));
    budget()
        .admit(need.map_err(EvalError::Mlx)?)
        .map_err(EvalError::Exceeded)
}

thread_local! {
    /// Async evaluations started on this thread's stream and not yet seen
    /// finished, with the memory they reserved.
    static ASYNC: RefCell<Vec<(Vec<Array>, Reservation)>> = const { RefCell::new(Vec::new()) };
}

/// Starts evaluating `arrays` in the background, at once (it cannot go in
/// steps), with what it needs reserved until it is seen finished.
pub fn evaluate_async(arrays: &[&Array]) -> Result<(), EvalError> {
    ASYNC.with_borrow_mut(|running| running.retain(|(arrays, _)| !arrays.iter().all(Array::available)));
    let need = memory::pending_bytes(arrays).map_err(EvalError::Mlx)?;
    let reservation = budget().reserve(need).map_err(EvalError::Exceeded)?;
    mlx::async_eval(arrays).map_err(EvalError::Mlx)?;
    let held = arrays.iter().map(|a| a.share()).collect::<mlx::Result<Vec<_>>>();
    let held = held.map_err(EvalError::Mlx)?;
    ASYNC.with_borrow_mut(|running| running.push((held, reservation)));
    Ok(())
}

/// Waits for this thread's async evaluations and drops their reservations;
/// false when there were none.
fn finish_async() -> bool {
    let running = ASYNC.take();
    for (arrays, _) in &running {
        let refs: Vec<&Array> = arrays.iter().collect();
        // Their errors surface when the arrays are next evaluated.
        let _ = mlx::eval(&refs);
    }
    !running.is_empty()
}

/// Evaluates `arrays` within the limit: at once when everything it would
/// compute fits, otherwise in steps along the graph, each evaluating the
/// nodes that fit in the room left. A single node that does not fit fails
/// it, and so does a step that leaves too little room for the next.
pub fn evaluate(arrays: &[&Array]) -> Result<(), EvalError> {
    let pending = memory::pending(arrays).map_err(EvalError::Mlx)?;
    let need = pending.iter().fold(0usize, |sum, p| sum.saturating_add(p.bytes));
    if let Ok(_held) = budget().reserve(need) {
        return eval_batched(pending, arrays);
    }
    let mut step: Vec<Array> = Vec::new();
    let mut step_bytes = 0usize;
    for p in pending {
        if !step.is_empty() && step_bytes.saturating_add(p.bytes) > budget().room() {
            evaluate_step(std::mem::take(&mut step), step_bytes)?;
            step_bytes = 0;
        }
        if step.is_empty() {
            budget().admit(p.bytes).map_err(EvalError::Exceeded)?;
        }
        step_bytes = step_bytes.saturating_add(p.bytes);
        step.push(p.node);
    }
    evaluate_step(step, step_bytes)?;
    mlx::eval(arrays).map_err(EvalError::Mlx)
}

/// Nodes queued behind one gate (see `mlx::async_eval_gated`): few enough
/// that MLX's scheduler never holds the caller back while the gate is shut
/// (it waits once more than ten tasks, each ten kernels, are queued).
const GATED_NODES: usize = 32;

/// Evaluates `arrays` whose unscheduled nodes are `pending` (in graph
/// order): each run of nodes is queued with MLX's CPU thread held, so its
/// kernels run back to back, then the evaluation is waited for. Each run's
/// handles are dropped once it is queued, so intermediate buffers are freed
/// as in one `eval`. Where a synchronous CPU evaluation runs its tasks on
/// this thread (port/shim/scheduler.cpp), one `eval` does that already, and
/// queueing through MLX's thread would only add its hand-offs.
fn eval_batched(pending: Vec<memory::Pending>, arrays: &[&Array]) -> Result<(), EvalError> {
    if pending.len() > 1 && (mlx::on_gpu() || !mlx::inline_eval()) {
        let nodes: Vec<Array> = pending.into_iter().map(|p| p.node).collect();
        for run in runs(&kinds(&nodes), GATED_NODES) {
            let refs: Vec<&Array> = nodes[run].iter().collect();
            mlx::async_eval_gated(&refs).map_err(EvalError::Mlx)?;
        }
    }
    mlx::eval(arrays).map_err(EvalError::Mlx)
}

/// Per node, whether it is float64, on a GPU worker, where that matters;
/// all `false` elsewhere. MLX evaluates a list of arrays through one node on
/// the stream of the first, which reads all of them, and refuses a float64
/// input to a GPU node: the f64 nodes of an op built on the CPU
/// (`ops::build`) must not share an evaluation with GPU nodes.
fn kinds(nodes: &[Array]) -> Vec<bool> {
    let gpu = mlx::on_gpu();
    nodes.iter().map(|n| gpu && n.dtype() == mlx::Dtype::F64).collect()
}

/// Consecutive runs of at most `max` nodes, each of one kind, in order.
fn runs(kinds: &[bool], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=kinds.len() {
        if i == kinds.len() || kinds[i] != kinds[start] || i - start == max {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// Evaluates `array` within the limit and copies out its elements: for the
/// few values (flags, bounds) a builder must know before it can go on.
pub fn read<T: Element>(array: &Array) -> Result<Vec<T>, String> {
    evaluate(&[array]).map_err(|e| e.to_string())?;
    let evaluated = array.evaluate().map_err(|e| e.message)?;
    let values = evaluated
        .values::<T>()
        .ok_or("read: the array is not of the requested type")?;
    Ok(values.to_vec())
}

/// Evaluates the nodes of one step, then lets go of them: what nothing else
/// holds (no later node, no registered tensor) is freed.
fn evaluate_step(nodes: Vec<Array>, bytes: usize) -> Result<(), EvalError> {
    let _held = budget().reserve(bytes).map_err(EvalError::Exceeded)?;
    for run in runs(&kinds(&nodes), usize::MAX) {
        let refs: Vec<&Array> = nodes[run].iter().collect();
        mlx::eval(&refs).map_err(EvalError::Mlx)?;
    }
    Ok(())
}

/// Watches the live buffers for the client's garbage collector.
///
/// A tensor handle is a few words on the BEAM's heap, so a process can drop
/// gigabytes of tensors without its heap growing enough to collect. The
/// worker therefore reports `{:memory_pressure, active}` whenever its live
/// buffers grow by half since their last low point (by at least
/// `MIN_STEP`), and the client collects the processes that create tensors.
#[derive(Default)]
pub struct Pressure {
    low: usize,
}

impl Pressure {
    pub const MIN_STEP: usize = 16 << 20;

    /// `Some(active)` when it is time to report.
    pub fn observe(&mut self, active: usize) -> Option<usize> {
        self.low = self.low.min(active);
        let threshold = self.low.saturating_add((self.low / 2).max(Self::MIN_STEP));
        if active > threshold {
            // Counts again from here; releases bring the low point down.
            self.low = active;
            Some(active)
        } else {
            None
        }
    }
}

fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluation_runs_keep_the_order_never_mix_kinds_and_stay_short() {
        assert_eq!(runs(&[], 3), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(runs(&[false; 7], 3), vec![0..3, 3..6, 6..7]);
        let kinds = [false, true, true, false, false, false, false, true];
        assert_eq!(runs(&kinds, 3), vec![0..1, 1..3, 3..6, 6..7, 7..8]);
        assert_eq!(runs(&kinds, usize::MAX), vec![0..1, 1..3, 3..7, 7..8]);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(512), "512 bytes");
        assert_eq!(human(4 << 20), "4.0 MiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }

    #[test]
    fn pressure_is_reported_after_growing_by_half_since_the_low_point() {
        const MIB: usize = 1 << 20;
        let mut p = Pressure::default();
        assert_eq!(p.observe(10 * MIB), None, "below the minimum step");
        assert_eq!(p.observe(17 * MIB), Some(17 * MIB));
        assert_eq!(p.observe(30 * MIB), None);
        assert_eq!(p.observe(34 * MIB), Some(34 * MIB));
        // Releases bring it down to 20 MiB: the next report comes past 36.
        assert_eq!(p.observe(20 * MIB), None);
        assert_eq!(p.observe(36 * MIB), None);
        assert_eq!(p.observe(37 * MIB), Some(37 * MIB));
        // Past the minimum step, growth by half counts.
        assert_eq!(p.observe(100 * MIB), Some(100 * MIB));
        assert_eq!(p.observe(150 * MIB), None);
        assert_eq!(p.observe(151 * MIB), Some(151 * MIB));
    }

    #[test]
    fn the_message_names_need_use_and_limit() {
        let e = Exceeded {
            need: 8 << 20,
            in_use: 1 << 20,
            limit: 4 << 20,
        };
        assert_eq!(
            e.to_string(),
            "memory limit exceeded: needs 8.0 MiB, 1.0 MiB in use, limit 4.0 MiB"
        );
    }
}
