//! The `:fault` op of test builds (feature `fault-injection`): crashes the
//! worker on request, the ways MLX can crash it, so the reliability tests can
//! prove that the VM and every caller survive. The production binary has no
//! such op.
//!
//! attrs: `%{kind: kind}`, plus `delay_ms: n` to fire from another thread
//! after `n` ms, in the middle of whatever the session is doing then.
//!
//! | kind | what happens |
//! |---|---|
//! | `:sigsegv` | a write to an unmapped address |
//! | `:sigfpe` | an integer division trap (`INT_MIN / -1`) |
//! | `:sigabrt` | `abort()`, as an uncaught C++ exception ends in |
//! | `:sigkill` | SIGKILL, as the OOM killer sends it |
//! | `:panic` | a Rust panic (the process exits with status 101) |
//! | `:exit` | exits with status `code` |
//! | `:sleep` | blocks the session thread for `ms` ms (a long MLX call) |
//! | `:hang` | blocks the session thread for good, using no CPU (a hung MLX call) |
//! | `:spin` | keeps the session thread busy for `ms` ms (a long computation) |
//! | `:device_write` | a GPU kernel writes through a wild pointer (a real CUDA fault) |
//! | `:unsealed` | sealed readback files are handed out unsealed from now on (a broken contract the client must refuse) |
//! | `:wild_pin` | pinned readbacks answer an address nothing is mapped at from now on (the client's read must fail, not return bytes) |

use crate::sys::{self, crash};
use crate::term::Term;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static UNSEALED: AtomicBool = AtomicBool::new(false);
static WILD_PIN: AtomicBool = AtomicBool::new(false);

/// Whether `:unsealed` was injected: readback files then skip their seals.
pub fn leave_unsealed() -> bool {
    UNSEALED.load(Ordering::Relaxed)
}

/// Whether `:wild_pin` was injected: pinned readbacks then answer an
/// unmapped address (the first page, below `mmap_min_addr`).
pub fn wild_pin() -> bool {
    WILD_PIN.load(Ordering::Relaxed)
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Segv,
    Fpe,
    Abort,
    Kill,
    Panic,
    Exit(i32),
    Sleep(u64),
    DeviceWrite,
    Hang,
    Spin(u64),
    Unsealed,
    WildPin,
}

/// Runs the fault now, or arms it on a timer thread; `Ok` when the worker is
/// still alive afterwards (a sleep, or an armed fault).
pub fn inject(attrs: &Term) -> Result<(), String> {
    let fault = parse(attrs)?;
    match attrs
        .get("delay_ms")
        .map(|t| t.as_int().and_then(|ms| u64::try_from(ms).ok()))
    {
        None => fire(fault),
        Some(Some(ms)) => std::thread::Builder::new()
            .name("fault".into())
            .spawn(move || {
                std::thread::sleep(Duration::from_millis(ms));
                let _ = fire(fault);
            })
            .map(drop)
            .map_err(|e| format!("cannot arm the fault: {e}")),
        Some(None) => Err("delay_ms must be a non-negative integer".into()),
    }
}

fn parse(attrs: &Term) -> Result<Fault, String> {
    let number = |key: &str| {
        attrs
            .get(key)
            .and_then(Term::as_int)
            .ok_or(format!("this fault needs an integer {key}"))
    };
    match attrs.get("kind").and_then(Term::as_atom) {
        Some("sigsegv") => Ok(Fault::Segv),
        Some("sigfpe") => Ok(Fault::Fpe),
        Some("sigabrt") => Ok(Fault::Abort),
        Some("sigkill") => Ok(Fault::Kill),
        Some("panic") => Ok(Fault::Panic),
        Some("exit") => Ok(Fault::Exit(number("code")? as i32)),
        Some("device_write") => Ok(Fault::DeviceWrite),
        Some("hang") => Ok(Fault::Hang),
        Some("spin") => Ok(Fault::Spin(number("ms")?.clamp(0, 600_000) as u64)),
        Some("sleep") => Ok(Fault::Sleep(number("ms")?.clamp(0, 600_000) as u64)),
        Some("unsealed") => Ok(Fault::Unsealed),
        Some("wild_pin") => Ok(Fault::WildPin),
        _ => Err(format!("unknown fault {attrs}")),
    }
}

fn fire(fault: Fault) -> Result<(), String> {
    log::info!("injecting fault {fault:?}");
    match fault {
        Fault::Segv => crash::segfault(),
        Fault::Fpe => crash::divide_overflow(),
        Fault::Abort => std::process::abort(),
        Fault::Kill => crash::kill(),
        Fault::Panic => panic!("injected panic"),
        Fault::Exit(code) => sys::exit_now(code),
        Fault::Hang => loop {
            std::thread::park();
        },
        Fault::Spin(ms) => {
            let end = std::time::Instant::now() + Duration::from_millis(ms);
            while std::time::Instant::now() < end {
                std::hint::spin_loop();
            }
            Ok(())
        }
        Fault::DeviceWrite => crate::mlx::fault_device_write().map_err(String::from),
        Fault::Sleep(ms) => {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(())
        }
        Fault::Unsealed => {
            UNSEALED.store(true, Ordering::Relaxed);
            Ok(())
        }
        Fault::WildPin => {
            WILD_PIN.store(true, Ordering::Relaxed);
            Ok(())
        }
    }
}
