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
//! machine switch threads about ten times per call), stops at once when a
//! gap between two polls shows the thread was preempted (the CPU is wanted
//! elsewhere, and then vCPUs do not halt anyway), and adapts: a spin that
//! found its message doubles the budget (up to the bound), one that ran out
//! halves it, down to nothing; from nothing, a wait that ended within the
//! bound starts it again at an eighth. So a caller in a round-trip loop
//! keeps the spin and an idle or loaded worker drops it. `MOAT_SPIN_US`
//! sets the bound (default 50; 0 turns spinning off).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The default longest spin.
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

/// One waiting thread's spin budget.
pub struct Spinner {
    bound: Duration,
    budget: Duration,
}

impl Default for Spinner {
    fn default() -> Self {
        Spinner::with_bound(bound())
    }
}

impl Spinner {
    /// A spinner that spins at most `bound` per wait.
    pub fn with_bound(bound: Duration) -> Spinner {
        Spinner { bound, budget: bound }
    }

    /// Waits for `poll` to give something: polls it within the budget, then
    /// calls `park` (which blocks until there is something, or the source is
    /// gone).
    pub fn wait<T>(&mut self, mut poll: impl FnMut() -> Option<T>, park: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        if !self.budget.is_zero() {
            let mut last = start;
            loop {
                if let Some(got) = poll() {
                    self.budget = (self.budget * 2).min(self.bound);
                    return got;
                }
                let now = Instant::now();
                if now - start >= self.budget || now - last >= PREEMPTED {
                    break;
                }
                last = now;
            }
            self.budget /= 2;
            if self.budget < FLOOR {
                self.budget = Duration::ZERO;
            }
            return park();
        }
        let got = park();
        if start.elapsed() <= self.bound {
            self.budget = self.bound / 8;
        }
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ready_source_is_taken_without_parking() {
        let mut s = Spinner::with_bound(Duration::from_millis(5));
        assert_eq!(s.wait(|| Some(1), || unreachable!()), 1);
    }

    #[test]
    fn a_source_ready_within_the_budget_is_taken_while_spinning() {
        let mut s = Spinner::with_bound(Duration::from_secs(1));
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
    fn spins_that_run_out_halve_the_budget_down_to_nothing_and_a_short_wait_starts_it_again() {
        let bound = Duration::from_micros(64);
        let mut s = Spinner::with_bound(bound);
        // 64, 32, ... 1 µs, each spun out: 7 halvings.
        for _ in 0..7 {
            s.wait(|| None::<i32>, || 0);
        }
        assert_eq!(s.budget, Duration::ZERO);
        // Parked at once (no budget), and the wait was short.
        s.wait(|| -> Option<i32> { unreachable!() }, || 0);
        assert_eq!(s.budget, bound / 8);
        // A spin that finds its message doubles it.
        s.wait(|| Some(1), || unreachable!());
        assert_eq!(s.budget, bound / 4);
    }

    #[test]
    fn a_long_wait_from_nothing_keeps_nothing() {
        let mut s = Spinner::with_bound(Duration::from_micros(10));
        s.budget = Duration::ZERO;
        s.wait(
            || -> Option<i32> { unreachable!() },
            || {
                std::thread::sleep(Duration::from_millis(2));
                0
            },
        );
        assert_eq!(s.budget, Duration::ZERO);
    }

    #[test]
    fn no_bound_never_polls() {
        let mut s = Spinner::with_bound(Duration::ZERO);
        assert_eq!(s.wait(|| -> Option<i32> { unreachable!() }, || 7), 7);
    }
}
