//! `moat_port`: started by the BEAM as a port with `:nouse_stdio`; reads
//! requests on fd 3 and writes replies on fd 4 (see protocol.md).

use crossbeam_channel::bounded;
use moat_port::checks::Checks;
use moat_port::connection::{read_loop, Outgoing, ReaderConfig, Replies};
use moat_port::frame::Limits;
use moat_port::mlx::kernels::Kernels;
use moat_port::mlx::{self, Device};
use moat_port::protocol;
use moat_port::session::Session;
use moat_port::shared;
use moat_port::sys;
use moat_port::term::Term;
use std::thread;

// Frames are decoded on the reader thread and dropped on the session thread;
// glibc's malloc serialises such cross-thread frees on arena locks.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: moat_port [--generation N] [--log-level error|warn|info|debug|trace] \
                     [--chunk-bytes N] [--max-frame-bytes N] [--detect-non-finite true|false] \
                     [--shared-memory true|false]";

struct Options {
    generation: u64,
    checks: Checks,
    log_level: log::LevelFilter,
    limits: Limits,
    shared_memory: bool,
}

fn parse_args() -> Result<Options, String> {
    let mut opts = Options {
        generation: 1,
        checks: Checks::default(),
        log_level: log::LevelFilter::Warn,
        limits: Limits::default(),
        shared_memory: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {value}"))
        };
        match flag.as_str() {
            "--generation" => opts.generation = number()?,
            "--log-level" => opts.log_level = value.parse().map_err(|_| format!("bad log level {value}"))?,
            "--chunk-bytes" => opts.limits.chunk_bytes = number()?.max(1) as usize,
            "--max-frame-bytes" => opts.limits.max_frame_bytes = number()? as usize,
            "--detect-non-finite" => {
                opts.checks.detect_non_finite = value
                    .parse()
                    .map_err(|_| format!("{flag}: not true or false: {value}"))?
            }
            "--shared-memory" => {
                opts.shared_memory = value
                    .parse()
                    .map_err(|_| format!("{flag}: not true or false: {value}"))?
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(opts)
}

fn main() {
    let opts = parse_args().unwrap_or_else(|e| {
        eprintln!("moat_port: {e}\n{USAGE}");
        std::process::exit(2);
    });
    env_logger::Builder::new()
        .filter_level(opts.log_level)
        .target(env_logger::Target::Stderr)
        .init();
    exit_on_panic();
    sys::hold_input_open(3);
    sys::die_with_parent();
    sys::default_sigchld();

    let (input, output) = match (sys::inherited(3), sys::inherited(4)) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("moat_port: {e}");
            std::process::exit(2);
        }
    };
    sys::grow_pipe(3, 1 << 20);
    sys::grow_pipe(4, 1 << 20);

    let (replies, writer) = Replies::new(output, 1024);
    let chunk = opts.limits.chunk_bytes;
    thread::Builder::new()
        .name("writer".into())
        .spawn(move || {
            if let Err(e) = writer.run(chunk) {
                log::info!("client gone ({e}); exiting");
            }
            sys::exit_now(0);
        })
        .expect("spawn writer");

    let kernels = Kernels::select_from_env().unwrap_or_else(|e| {
        eprintln!("moat_port: {e}");
        std::process::exit(2);
    });
    let offer = shared::offer(opts.shared_memory);
    let shared_memory = !offer.is_atom("nil");
    replies.send(Outgoing::Frame(hello(&opts, kernels, offer)));

    let (in_tx, in_rx) = bounded(256);
    let config = ReaderConfig {
        limits: opts.limits,
        generation: opts.generation,
        shared_memory,
        replies: replies.clone(),
    };
    thread::Builder::new()
        .name("reader".into())
        .spawn(move || {
            match read_loop(input, config, in_tx) {
                Ok(()) => log::info!("input closed; exiting"),
                Err(e) => log::error!("input stream broken ({e}); exiting"),
            }
            sys::exit_now(0);
        })
        .expect("spawn reader");

    if let Err(e) = Device::Cpu.make_default() {
        log::error!("cannot select the CPU device: {e}");
    }
    Session::new(opts.generation, replies)
        .with_checks(opts.checks)
        .with_shared_memory(shared_memory)
        .run(in_rx);
}

/// A panic on any thread ends the worker at once with status 101. Unwinding
/// instead would let another thread exit first with status 0 (hiding the
/// cause), or leave a worker without its reader or writer, on which callers
/// would wait forever. A dead worker is noticed and restarted.
fn exit_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        sys::exit_now(101);
    }));
}

fn hello(opts: &Options, kernels: Kernels, shared_memory: Term) -> Term {
    let devices = [Device::Cpu, Device::Gpu]
        .into_iter()
        .filter(|d| d.available())
        .map(|d| Term::atom(d.name()));
    let blas = if cfg!(moat_openblas) { "openblas" } else { "reference" };
    protocol::hello(vec![
        ("blas", Term::atom(blas)),
        ("chunk_bytes", Term::int(opts.limits.chunk_bytes as u64)),
        ("cpu", Term::atom(kernels.name())),
        ("devices", Term::List(devices.collect())),
        ("generation", Term::int(opts.generation)),
        ("max_frame_bytes", Term::int(opts.limits.max_frame_bytes as u64)),
        ("mlx", Term::Binary(mlx::version().into_bytes())),
        ("os_pid", Term::int(sys::os_pid())),
        ("shared_memory", shared_memory),
    ])
}
