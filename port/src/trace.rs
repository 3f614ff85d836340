//! The latency trace behind docs/latency.md: with `MOAT_TRACE` set, the
//! reader, the session and the reply path stamp each call (seq > 0) on
//! stderr as `T <stage> <seq> <unix ns>`, a clock the VM reads too
//! (`:os.system_time/1`), so that bench/latency_profile.exs can put every
//! hop of a call on one time line. Off, a stamp is one load and a branch.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

static ON: OnceLock<bool> = OnceLock::new();

/// Stamps `stage` of call `seq`: `R` read and decoded, `S` taken by the
/// session, `E` evaluated (readbacks), `W` reply handed off.
pub fn stamp(stage: &str, seq: u64) {
    if seq != 0 && *ON.get_or_init(|| std::env::var_os("MOAT_TRACE").is_some()) {
        let ns = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        eprintln!("T {stage} {seq} {ns}");
    }
}
