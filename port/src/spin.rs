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
//! halves it, down to nothing. From nothing, it starts again only when a
//! wake-up was expensive (the reader stamps each hand-over, `handed_over`,
//! and the session measures how long after it it woke) and a spin would
//! have caught the message: so a caller in a round-trip loop on an idle VM
//! keeps the spin, and a worker on a busy machine (cheap wake-ups) or an
//! idle one drops it. `MOAT_SPIN_US`
//! sets the bound in µs (default 0, off: see `DEFAULT_US`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The default longest spin: none. Under a heavy load (other processes
/// runnable), a wake-up is slow for want of a CPU, not because a vCPU
/// halted, and spinning then cost more than it saved (docs/latency.md); on
/// an idle VM `MOAT_SPIN_US=50` is the setting to try.
const DEFAULT_US: u64 = 0;

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
        self.after_park(start, last_handed_over(), Instant::now());
        got
    }

    /// After a wait that did not spin: whether the next one should. It
    /// should when a spin would have caught the message (it was handed
    /// over within the bound) and parking cost a lot (the wake-up took at
    /// least `EXPENSIVE`, as on an idle VM); on a busy machine wake-ups are
    /// cheap, and the thread keeps parking.
    fn after_park(&mut self, start: Instant, handed_over: Instant, woke: Instant) {
        let arrived = handed_over.saturating_duration_since(start);
        if !self.bound.is_zero() && woke.saturating_duration_since(handed_over) >= EXPENSIVE && arrived <= self.bound {
            self.budget = (arrived * 2).clamp(FLOOR, self.bound);
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
    fn spins_that_run_out_halve_the_budget_down_to_nothing_and_an_expensive_wake_up_starts_it_again() {
        let bound = Duration::from_micros(64);
        let mut s = Spinner::with_bound(bound);
        // 64, 32, ... 1 µs, each spun out: 7 halvings.
        for _ in 0..7 {
            s.wait(|| None::<i32>, || 0);
        }
        assert_eq!(s.budget, Duration::ZERO);
        // Parked at once (no budget): an expensive wake-up of a message that
        // came 10 µs into the wait starts it again at twice that.
        let t = Instant::now();
        let us = Duration::from_micros;
        s.after_park(t, t + us(10), t + us(50));
        assert_eq!(s.budget, us(20));
        // A spin that finds its message doubles it.
        s.wait(|| Some(1), || unreachable!());
        assert_eq!(s.budget, us(40));
    }

    #[test]
    fn cheap_wake_ups_or_late_messages_do_not_start_it_again() {
        let us = Duration::from_micros;
        let mut s = Spinner::with_bound(us(50));
        s.budget = Duration::ZERO;
        let t = Instant::now();
        // Woken 5 µs after the hand-over: cheap, parking is fine.
        s.after_park(t, t + us(10), t + us(15));
        assert_eq!(s.budget, Duration::ZERO);
        // Handed over after the bound: no spin would have caught it.
        s.after_park(t, t + us(80), t + us(200));
        assert_eq!(s.budget, Duration::ZERO);
    }

    #[test]
    fn no_bound_never_polls() {
        let mut s = Spinner::with_bound(Duration::ZERO);
        assert_eq!(s.wait(|| -> Option<i32> { unreachable!() }, || 7), 7);
    }
}
