//! Moat's MLX worker. `main.rs` wires the threads; the modules follow the
//! layers of protocol.md: `term` and `frame` (bytes), `protocol` (typed
//! headers), `connection` (framing: where frames come from and go),
//! `incoming` (requests from frames, each decoded once into a
//! `session::Command`: upload reassembly and staging),
//! `replies` (the way out, readbacks in chunks), `cnode` (the Erlang
//! distribution transport), `session` (the MLX
//! thread: one dispatch over the decoded commands), `failure` (failures as data), `checks` (what every op's outputs
//! must pass), `registry` (ids to arrays), `program` (graphs defined once and
//! run many times), `budget` (the memory limit), `shared` (same-host transfers
//! through shared memory), `ops` (the op table), `mlx` (the safe layer over
//! the C++ shim), `sys` (OS calls), `spin` (bounded spinning before the
//! session thread parks) and `trace` (the latency trace).

pub mod budget;
pub mod checks;
pub mod cnode;
pub mod connection;
pub mod failure;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod frame;
pub mod incoming;
pub mod input;
pub mod mlx;
pub mod ops;
pub mod program;
pub mod protocol;
pub mod registry;
pub mod replies;
// Its request handlers are named after the protocol's ops (`from_binary`, `to_binary`).
#[allow(clippy::wrong_self_convention)]
pub mod session;
pub mod shared;
pub mod spin;
pub mod sys;
pub mod term;
pub mod trace;
