//! Bounded, adaptive spinning before the session thread parks
//! (docs/latency.md).
//!
//! On an idle VM a parked thread's wake-up is expensive: its vCPU halts,
//! and the reader's hand-off of a frame to a parked session thread took
//! about 40 µs, several times a whole `:sync` round trip on a busy machine.
//! So the session thread first polls its queue for a while, and only then
//! parks. Only that one thread spins: on a 2-vCPU machine a second spinner
//! (the reader, the writer) leaves no CPU for the VM that sends the next
//! frame, and every call got slower (measured in docs/latency.md).
//!
//! It polls without yielding (a `sched_yield` per poll made a loaded
//! machine switch threads about ten times per call) and adapts: a spin that
//! found its message doubles the budget (up to the bound), one that ran out
//! halves it, down to nothing. It spins only while the machine has a CPU to
//! spare: a gap between two polls (the thread was preempted) drops the
//! budget to nothing at once, and so does a look at the run queues
//! (`/proc/loadavg`'s runnable count, taken every `RECHECK` spins) that
//! finds more runnable threads than CPUs. From nothing, it starts again only
//! when a wake-up was expensive (the reader stamps each hand-over,
//! `handed_over`, and the session measures how long after it it woke), a
//! spin would have caught the message, and the run queues have room: so a
//! caller in a round-trip loop on an idle VM keeps the spin, and a worker
//! on a loaded machine (where a woken thread waits for a CPU, not for a
//! halted vCPU: a wake-up is just as slow there, but spinning takes the
//! CPU the VM needs) or an idle one drops it. `MOAT_SPIN_US` sets the
//! bound in µs (default `DEFAULT_US`; 0 turns spinning off).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The default longest spin. 50 µs covers a VM's round trip between two
/// calls of a caller in a loop; the load test keeps it off where it hurt
/// (docs/latency.md).
const DEFAULT_US: u64 = 50;

fn bound() -> Duration {
    static BOUND: OnceLock<Duration> = OnceLock::new();
    *BOUND.get_or_init(|| {
        let us = std::env::var("MOAT_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_US);
        Duration::from_micros(us)
    })
}

/// A gap between two polls this long means the thread was preempted.
const PREEMPTED: Duration = Duration::from_micros(10);

/// A budget below this is no budget.
const FLOOR: Duration = Duration::from_micros(1);

/// Spins between two looks at the run queues while spinning pays.
const RECHECK: u32 = 32;

/// Whether the machine has a CPU to spare for a spinning thread.
pub trait Load {
    fn has_room(&mut self) -> bool;
}

/// The run queues as `/proc/loadavg` shows them: room while the runnable
/// threads (this one included) are no more than the CPUs this process may
/// use. Without that file, never room (no spinning).
pub struct RunQueues {
    file: Option<File>,
    cpus: usize,
}

impl Default for RunQueues {
    fn default() -> Self {
        RunQueues {
            file: File::open("/proc/loadavg").ok(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl Load for RunQueues {
    fn has_room(&mut self) -> bool {
        let Some(file) = &self.file else { return false };
        let mut buf = [0u8; 128];
        match file.read_at(&mut buf, 0) {
            Ok(n) => runnable(&buf[..n]).is_some_and(|r| r <= self.cpus),
            Err(_) => false,
        }
    }
}

/// The runnable count of a `/proc/loadavg` line (`0.50 0.40 0.30 2/345 6789`).
fn runnable(line: &[u8]) -> Option<usize> {
    let field = std::str::from_utf8(line).ok()?.split_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

/// One waiting thread's spin budget.
pub struct Spinner<L: Load = RunQueues> {
    bound: Duration,
    budget: Duration,
    /// Spins since the last look at the run queues.
    spins: u32,
    /// The budget an expensive wake-up asks for, granted at the start of the
    /// next wait if the run queues have room: looked at then, after the
    /// request was served, not between the wake-up and the request.
    candidate: Option<Duration>,
    load: L,
}

impl Default for Spinner {
    fn default() -> Self {
        Spinner::new(bound(), RunQueues::default())
    }
}

impl<L: Load> Spinner<L> {
    /// A spinner that spins at most `bound` per wait while `load` has room.
    /// It starts parked: the first expensive wake-up starts it.
    pub fn new(bound: Duration, load: L) -> Spinner<L> {
        Spinner {
            bound,
            budget: Duration::ZERO,
            spins: 0,
            candidate: None,
            load,
        }
    }

    /// At the start of a wait: grants a candidate budget, or looks at the
    /// run queues again after `RECHECK` spins.
    fn resume(&mut self) {
        if let Some(budget) = self.candidate.take() {
            if self.load.has_room() {
                self.budget = budget;
                self.spins = 0;
            }
        } else if !self.budget.is_zero() {
            self.spins += 1;
            if self.spins >= RECHECK {
                self.spins = 0;
                if !self.load.has_room() {
                    self.budget = Duration::ZERO;
                }
            }
        }
    }

    /// Whether the next wait spins (for tests and callers that act on it).
    pub fn spinning(&self) -> bool {
        !self.budget.is_zero()
    }

    /// Waits for `poll` to give something: polls it within the budget, then
    /// calls `park` (which blocks until there is something, or the source is
    /// gone).
    pub fn wait<T>(&mut self, poll: impl FnMut() -> Option<T>, park: impl FnOnce() -> T) -> T {
        self.wait_then(poll, park, |s, start, woke| {
            s.after_park(start, last_handed_over(), woke)
        })
    }

    /// As `wait`, for a source that stamps no hand-over (the pipe the
    /// session reads itself, see `input`): a park that ended within twice
    /// the bound is taken for a caller in a loop, whose next message a spin
    /// of the bound would likely have caught, as on an idle VM, where the
    /// park's own wake-up is the expensive part.
    pub fn wait_unstamped<T>(&mut self, poll: impl FnMut() -> Option<T>, park: impl FnOnce() -> T) -> T {
        self.wait_then(poll, park, |s, start, woke| {
            if !s.bound.is_zero() && woke.saturating_duration_since(start) <= s.bound * 2 {
                s.candidate = Some(s.bound);
            }
        })
    }

    fn wait_then<T>(
        &mut self,
        mut poll: impl FnMut() -> Option<T>,
        park: impl FnOnce() -> T,
        after_park: impl FnOnce(&mut Self, Instant, Instant),
    ) -> T {
        self.resume();
        let start = Instant::now();
        if !self.budget.is_zero() {
            let mut last = start;
            loop {
                if let Some(got) = poll() {
                    self.budget = (self.budget * 2).min(self.bound);
                    return got;
                }
                let now = Instant::now();
                if now - last >= PREEMPTED {
                    // Preempted: the CPU is wanted elsewhere.
                    self.budget = Duration::ZERO;
                    break;
                }
                if now - start >= self.budget {
                    self.budget /= 2;
                    if self.budget < FLOOR {
                        self.budget = Duration::ZERO;
                    }
                    break;
                }
                last = now;
            }
            return park();
        }
        let got = park();
        after_park(self, start, Instant::now());
        got
    }

    /// After a wait that did not spin: whether the next one should. It
    /// should when a spin would have caught the message (it was handed
    /// over within the bound), parking cost a lot (the wake-up took at
    /// least `EXPENSIVE`, as on an idle VM) and the run queues have room
    /// (on a loaded machine the wake-up is slow too, for want of a CPU,
    /// and a spinner would take one from the VM). The last is looked at by
    /// the next wait (`resume`).
    fn after_park(&mut self, start: Instant, handed_over: Instant, woke: Instant) {
        let arrived = handed_over.saturating_duration_since(start);
        if !self.bound.is_zero() && woke.saturating_duration_since(handed_over) >= EXPENSIVE && arrived <= self.bound {
            self.candidate = Some((arrived * 2).clamp(FLOOR, self.bound));
        }
    }
}

/// A wake-up at least this slow is worth spinning to avoid.
const EXPENSIVE: Duration = Duration::from_micros(15);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

static HANDED_OVER: AtomicU64 = AtomicU64::new(0);

/// Stamps the moment the reader hands a message to the session thread, so
/// that the session can tell what its last wake-up cost.
pub fn handed_over() {
    HANDED_OVER.store(epoch().elapsed().as_nanos() as u64, Ordering::Relaxed);
}

fn last_handed_over() -> Instant {
    epoch() + Duration::from_nanos(HANDED_OVER.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A load whose answer the test sets, counting the looks.
    #[derive(Clone, Default)]
    struct Fake {
        busy: Rc<Cell<bool>>,
        looks: Rc<Cell<u32>>,
    }

    impl Load for Fake {
        fn has_room(&mut self) -> bool {
            self.looks.set(self.looks.get() + 1);
            !self.busy.get()
        }
    }

    fn spinner(bound: Duration) -> (Spinner<Fake>, Fake) {
        let load = Fake::default();
        let mut s = Spinner::new(bound, load.clone());
        s.budget = bound;
        (s, load)
    }

    #[test]
    fn a_ready_source_is_taken_without_parking() {
        let (mut s, _) = spinner(Duration::from_millis(5));
        assert_eq!(s.wait(|| Some(1), || unreachable!()), 1);
    }

    #[test]
    fn it_starts_parked() {
        let mut s = Spinner::new(Duration::from_micros(50), Fake::default());
        assert!(!s.spinning());
        assert_eq!(s.wait(|| -> Option<i32> { unreachable!() }, || 7), 7);
    }

    #[test]
    fn a_source_ready_within_the_budget_is_taken_while_spinning() {
        let (mut s, _) = spinner(Duration::from_secs(1));
        let mut n = 0;
        let got = s.wait(
            || {
                n += 1;
                (n == 3).then_some(n)
            },
            || unreachable!(),
        );
        assert_eq!(got, 3);
    }

    #[test]
    fn spins_that_run_out_halve_the_budget_down_to_nothing_and_an_expensive_wake_up_starts_it_again() {
        let bound = Duration::from_micros(64);
        let (mut s, _) = spinner(bound);
        // 64, 32, ... 1 µs, each spun out: 7 halvings (a preemption on the
        // way would drop it at once, which ends the same).
        for _ in 0..7 {
            s.wait(|| None::<i32>, || 0);
        }
        assert_eq!(s.budget, Duration::ZERO);
        // Parked at once (no budget): an expensive wake-up of a message that
        // came 10 µs into the wait starts it again at twice that.
        let t = Instant::now();
        let us = Duration::from_micros;
        s.after_park(t, t + us(10), t + us(50));
        s.resume();
        assert_eq!(s.budget, us(20));
        // A spin that finds its message doubles it.
        s.wait(|| Some(1), || unreachable!());
        assert_eq!(s.budget, us(40));
    }

    #[test]
    fn a_preempted_spin_drops_the_budget_at_once() {
        let (mut s, _) = spinner(Duration::from_secs(1));
        let got = s.wait(
            || {
                std::thread::sleep(Duration::from_millis(1));
                None::<i32>
            },
            || 5,
        );
        assert_eq!(got, 5);
        assert!(!s.spinning());
    }

    #[test]
    fn cheap_wake_ups_or_late_messages_or_full_run_queues_do_not_start_it_again() {
        let us = Duration::from_micros;
        let (mut s, load) = spinner(us(50));
        s.budget = Duration::ZERO;
        let t = Instant::now();
        // Woken 5 µs after the hand-over: cheap, parking is fine.
        s.after_park(t, t + us(10), t + us(15));
        s.resume();
        assert_eq!(s.budget, Duration::ZERO);
        // Handed over after the bound: no spin would have caught it.
        s.after_park(t, t + us(80), t + us(200));
        s.resume();
        assert_eq!(s.budget, Duration::ZERO);
        assert_eq!(load.looks.get(), 0);
        // Expensive and in time, but no CPU to spare: the wake-up waited
        // for a CPU, and a spinner would take one. Looked at by the next
        // wait, not at the wake-up.
        load.busy.set(true);
        s.after_park(t, t + us(10), t + us(50));
        assert_eq!(load.looks.get(), 0);
        s.resume();
        assert_eq!(load.looks.get(), 1);
        assert_eq!(s.budget, Duration::ZERO);
        load.busy.set(false);
        s.after_park(t, t + us(10), t + us(50));
        s.resume();
        assert_eq!(s.budget, us(20));
    }

    #[test]
    fn a_spinner_looks_at_the_run_queues_every_recheck_spins_and_stops_when_they_fill() {
        let (mut s, load) = spinner(Duration::from_secs(1));
        for _ in 0..RECHECK - 1 {
            s.wait(|| Some(()), || unreachable!());
        }
        assert_eq!(load.looks.get(), 0);
        load.busy.set(true);
        // The next wait looks, finds them full and parks at once.
        let mut polled = false;
        s.wait(
            || {
                polled = true;
                Some(())
            },
            || (),
        );
        assert_eq!(load.looks.get(), 1);
        assert!(!polled);
        assert!(!s.spinning());
    }

    #[test]
    fn no_bound_never_polls() {
        let mut s = Spinner::new(Duration::ZERO, Fake::default());
        assert_eq!(s.wait(|| -> Option<i32> { unreachable!() }, || 7), 7);
        let t = Instant::now();
        let us = Duration::from_micros;
        s.after_park(t, t + us(10), t + us(50));
        s.resume();
        assert!(!s.spinning());
    }

    #[test]
    fn the_runnable_count_of_a_loadavg_line() {
        assert_eq!(runnable(b"0.50 0.40 0.30 2/345 6789\n"), Some(2));
        assert_eq!(runnable(b"12.01 9.00 4.10 17/1002 31337"), Some(17));
        assert_eq!(runnable(b"garbage"), None);
    }

    #[test]
    fn the_run_queues_of_this_machine_can_be_read() {
        let mut q = RunQueues::default();
        assert!(q.file.is_some());
        // Whatever the answer, the file parses (else it would always be false
        // and the spin never start): read it once more by hand.
        let text = std::fs::read("/proc/loadavg").unwrap();
        assert!(runnable(&text).is_some());
        let _ = q.has_room();
    }
}
