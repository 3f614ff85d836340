//! `moat_port`: started by the BEAM as a port with `:nouse_stdio`; reads
//! requests on fd 3 and writes replies on fd 4 (see protocol.md).

use crossbeam_channel::bounded;
use moat_port::checks::Checks;
use moat_port::connection::{read_loop, Outgoing, ReaderConfig, Replies};
use moat_port::frame::Limits;
use moat_port::mlx::kernels::Kernels;
use moat_port::mlx::{self, Device, DeviceInfo};
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
                     [--shared-memory true|false] [--device cpu|gpu] [--progress-ms N]
       moat_port --list-ops";

struct Options {
    generation: u64,
    checks: Checks,
    log_level: log::LevelFilter,
    limits: Limits,
    shared_memory: bool,
    /// The device every op runs on; `None`: the best one MLX has.
    device: Option<Device>,
    /// How often to report progress for the client's watchdog (0: never).
    progress_ms: u64,
}

fn parse_args() -> Result<Options, String> {
    let mut opts = Options {
        generation: 1,
        checks: Checks::default(),
        log_level: log::LevelFilter::Warn,
        limits: Limits::default(),
        shared_memory: true,
        device: None,
        progress_ms: 0,
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
            "--progress-ms" => opts.progress_ms = number()?,
            "--device" => {
                opts.device = Some(match value.as_str() {
                    "cpu" => Device::Cpu,
                    "gpu" => Device::Gpu,
                    _ => return Err(format!("{flag}: not cpu or gpu: {value}")),
                })
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(opts)
}

fn main() {
    if std::env::args().skip(1).eq(["--list-ops"]) {
        // The ops this build knows, one a line (tests compare them with
        // protocol.md and with what the client sends).
        for op in moat_port::session::op_names() {
            println!("{op}");
        }
        return;
    }
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

    let (replies, writer) = Replies::new(output, 1024, opts.limits.chunk_bytes);
    thread::Builder::new()
        .name("writer".into())
        .spawn(move || {
            if let Err(e) = writer.run() {
                log::info!("client gone ({e}); exiting");
            }
            sys::exit_now(0);
        })
        .expect("spawn writer");

    let kernels = Kernels::select_from_env().unwrap_or_else(|e| {
        eprintln!("moat_port: {e}");
        std::process::exit(2);
    });
    // A device that is not there is named as nil in the hello: the client
    // refuses the worker with an error naming the devices it has.
    let devices = devices();
    let best = devices[0].kind;
    let device = match opts.device {
        Some(d) if !devices.iter().any(|x| x.kind == d) => None,
        Some(d) => Some(d),
        None => Some(best),
    };

    let offer = shared::offer(opts.shared_memory);
    let shared_memory = !offer.is_atom("nil");
    replies.send(Outgoing::Frame(hello(&opts, kernels, device, &devices, offer)));

    if opts.progress_ms > 0 {
        let replies = replies.clone();
        let every = std::time::Duration::from_millis(opts.progress_ms);
        let gpu = (device == Some(Device::Gpu)).then(sys::GpuLoad::open).flatten();
        thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                // Work done so far: CPU time, plus the GPU's busy time.
                let mut gpu_us = 0;
                loop {
                    thread::sleep(every);
                    if let Some(percent) = gpu.as_ref().and_then(sys::GpuLoad::utilization) {
                        gpu_us += every.as_micros() as u64 * percent / 100;
                    }
                    replies.send(Outgoing::Frame(protocol::progress(sys::cpu_time_us() + gpu_us)));
                }
            })
            .expect("spawn progress");
    }

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

    let device = device.unwrap_or(Device::Cpu);
    if let Err(e) = device.make_default() {
        log::error!("cannot select the {} device: {e}", device.name());
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

/// Every device MLX can run on, GPUs first (a CPU is always there).
fn devices() -> Vec<DeviceInfo> {
    let gpus = (0..Device::Gpu.count()).filter_map(|i| Device::Gpu.info(i).ok());
    let mut cpu = Device::Cpu.info(0).unwrap_or(DeviceInfo {
        kind: Device::Cpu,
        name: String::new(),
        memory: 0,
        compute_capability: (0, 0),
    });
    // MLX's CPU backend reports no memory size.
    if cpu.memory == 0 {
        cpu.memory = sys::physical_memory();
    }
    gpus.chain(std::iter::once(cpu)).collect()
}

fn device_term(d: &DeviceInfo) -> Term {
    let (major, minor) = d.compute_capability;
    let capability = if d.kind == Device::Gpu {
        Term::tuple(vec![Term::int(major), Term::int(minor)])
    } else {
        Term::atom("nil")
    };
    Term::Map(vec![
        (Term::atom("compute_capability"), capability),
        (Term::atom("kind"), Term::atom(d.kind.name())),
        (Term::atom("memory"), Term::int(d.memory)),
        (Term::atom("name"), Term::Binary(d.name.clone().into_bytes())),
    ])
}

fn hello(opts: &Options, kernels: Kernels, device: Option<Device>, all: &[DeviceInfo], shared_memory: Term) -> Term {
    let mut kinds: Vec<Device> = all.iter().map(|d| d.kind).collect();
    kinds.dedup();
    let devices = kinds.into_iter().map(|d| Term::atom(d.name()));
    let blas = if cfg!(moat_openblas) { "openblas" } else { "reference" };
    protocol::hello(vec![
        ("blas", Term::atom(blas)),
        ("chunk_bytes", Term::int(opts.limits.chunk_bytes as u64)),
        ("cpu", Term::atom(kernels.name())),
        ("device", Term::atom(device.map_or("nil", Device::name))),
        ("device_info", Term::List(all.iter().map(device_term).collect())),
        ("devices", Term::List(devices.collect())),
        ("generation", Term::int(opts.generation)),
        ("max_frame_bytes", Term::int(opts.limits.max_frame_bytes as u64)),
        ("mlx", Term::Binary(mlx::version().into_bytes())),
        ("os_pid", Term::int(sys::os_pid())),
        ("shared_memory", shared_memory),
    ])
}
