//! Rows for docs/reliability.md: when `MOAT_RELIABILITY_LOG` names a file,
//! each reliability test appends what it injected and what survived
//! (bin/reliability-report collects them).

use std::io::Write;

/// One row of a group (`crashes`, `malformed`, `load`, `security`): the
/// fault, how many were injected, how many the system survived, how many
/// results were lost or wrong, and a note.
pub fn row(group: &str, fault: &str, injected: u64, survived: u64, lost: u64, note: &str) {
    let Ok(path) = std::env::var("MOAT_RELIABILITY_LOG") else {
        return;
    };
    let line = format!("{group}\t{fault}\t{injected}\t{survived}\t{lost}\t{note}\n");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("reliability log");
    file.write_all(line.as_bytes()).expect("write reliability log");
}

/// The fuzzers' time budget: `MOAT_FUZZ_SECS` (default `default_secs`).
pub fn fuzz_budget(default_secs: f64) -> std::time::Duration {
    let secs = std::env::var("MOAT_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_secs);
    std::time::Duration::from_secs_f64(secs)
}
