//! `moat_port`: started by the BEAM as a port with `:nouse_stdio`, it reads
//! requests on fd 3 and writes replies on fd 4; with `--node`, it is an
//! Erlang C-node instead (see `cnode`). Both speak protocol.md.

use crossbeam_channel::bounded;
use moat_port::checks::Checks;
use moat_port::cnode::{self, NodeConfig};
use moat_port::connection::{pipe_source, PipeSink};
use moat_port::frame::Limits;
use moat_port::incoming::{Reader, ReaderConfig};
use moat_port::input::{self, Input};
use moat_port::mlx::kernels::Kernels;
use moat_port::mlx::{self, Device, DeviceInfo};
use moat_port::protocol;
use moat_port::replies::{Outgoing, Replies};
use moat_port::session::Session;
use moat_port::shared;
use moat_port::sys;
use moat_port::term::Term;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

// Frames are decoded on the reader thread and dropped on the session thread;
// glibc's malloc serialises such cross-thread frees on arena locks.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: moat_port [--generation N] [--log-level error|warn|info|debug|trace] \
                     [--chunk-bytes N] [--max-frame-bytes N] [--detect-non-finite true|false] \
                     [--shared-memory true|false] [--device cpu|gpu] [--progress-ms N]
       moat_port --node NAME@HOST --cookie-file PATH [--listen IP[:PORT]] [--supervise] [options above]
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
    /// C-node mode: the node's name, where its cookie is, where it listens.
    node: Option<String>,
    cookie_file: Option<PathBuf>,
    listen: SocketAddr,
    /// Run the worker as a child and start it again when it dies.
    supervise: bool,
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
        node: None,
        cookie_file: None,
        listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        supervise: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--supervise" {
            opts.supervise = true;
            continue;
        }
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
            "--node" => opts.node = Some(value),
            "--cookie-file" => opts.cookie_file = Some(PathBuf::from(value)),
            "--listen" => {
                opts.listen = value
                    .parse()
                    .or_else(|_| value.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)))
                    .map_err(|_| format!("{flag}: not an IP address or IP:PORT: {value}"))?
            }
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
    if opts.node.is_some() != opts.cookie_file.is_some() {
        return Err("--node and --cookie-file go together".into());
    }
    if opts.supervise && opts.node.is_none() {
        return Err("--supervise is for a C-node (--node): a port's worker is supervised by its BEAM".into());
    }
    Ok(opts)
}

/// MLX's CUDA backend runs f32 matrix products on TF32 tensor cores unless
/// told otherwise; Moat's default is full f32, as on the CPU, for every way
/// the worker is started (Moat.Worker's `:tf32` sets the variable itself).
fn full_f32_by_default() {
    if std::env::var_os("MLX_ENABLE_TF32").is_none() {
        // Before any thread starts and before MLX reads the variable.
        std::env::set_var("MLX_ENABLE_TF32", "0");
    }
}

fn main() {
    full_f32_by_default();
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
    if opts.supervise {
        supervise();
    }
    if opts.node.is_some() {
        if std::env::var_os(SUPERVISED).is_some() {
            sys::die_with_parent();
        }
        node(opts);
    } else {
        port(opts);
    }
}

/// The devices and kernels of this worker, and its hello's fields but the
/// generation and the shared-memory offer.
struct Machine {
    kernels: Kernels,
    device: Option<Device>,
    devices: Vec<DeviceInfo>,
}

impl Machine {
    fn select(wanted: Option<Device>) -> Machine {
        let kernels = Kernels::select_from_env().unwrap_or_else(|e| {
            eprintln!("moat_port: {e}");
            std::process::exit(2);
        });
        // A device that is not there is named as nil in the hello: the client
        // refuses the worker with an error naming the devices it has.
        let devices = devices();
        let best = devices[0].kind;
        let device = match wanted {
            Some(d) if !devices.iter().any(|x| x.kind == d) => None,
            Some(d) => Some(d),
            None => Some(best),
        };
        Machine {
            kernels,
            device,
            devices,
        }
    }

    /// Makes the device ops run on the default of every thread.
    fn make_default(&self) {
        let device = self.device.unwrap_or(Device::Cpu);
        if let Err(e) = device.make_default() {
            log::error!("cannot select the {} device: {e}", device.name());
        }
    }
}

/// The C-node: serves client nodes until it is killed.
fn node(opts: Options) {
    let fail = |e: String| -> ! {
        eprintln!("moat_port: {e}");
        std::process::exit(2);
    };
    let path = opts.cookie_file.clone().unwrap_or_default();
    let cookie = cnode::read_cookie(&path).unwrap_or_else(|e| fail(e));
    let machine = Machine::select(opts.device);
    machine.make_default();
    let limits = opts.limits;
    let config = NodeConfig {
        name: opts.node.clone().unwrap_or_default(),
        cookie,
        listen: opts.listen,
        limits,
        checks: opts.checks,
    };
    // Across hosts there is no shared memory: the hello offers none.
    let hello = Arc::new(move |generation| hello(generation, &limits, &machine, Term::atom("nil")));
    cnode::run(config, hello).unwrap_or_else(|e| fail(e));
}

/// Set in the environment of a worker `--supervise` runs.
const SUPERVISED: &str = "MOAT_SUPERVISED";

/// `--supervise`: runs the worker as a child with the same options and
/// starts it again whenever it dies, after a pause that doubles from 100 ms
/// up to 5 s while it keeps dying young. A worker that exits with status 0
/// (killed on purpose) or 2 (it cannot start: a bad option, no epmd, a bad
/// cookie file) is not restarted, and the supervisor exits with its status.
fn supervise() -> ! {
    let exe = std::env::current_exe().unwrap_or_else(|e| {
        eprintln!("moat_port: cannot find this executable: {e}");
        std::process::exit(2);
    });
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--supervise").collect();
    let mut pause = Duration::from_millis(100);
    loop {
        let started = Instant::now();
        let status = std::process::Command::new(&exe)
            .args(&args)
            .env(SUPERVISED, "1")
            .status()
            .unwrap_or_else(|e| {
                eprintln!("moat_port: cannot start the worker: {e}");
                std::process::exit(2);
            });
        if let Some(code @ (0 | 2)) = status.code() {
            std::process::exit(code);
        }
        if started.elapsed() > Duration::from_secs(30) {
            pause = Duration::from_millis(100);
        }
        eprintln!("moat_port: the worker ended ({status}); starting it again in {pause:?}");
        thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// The port: one client, the BEAM that started this process, on fds 3 and 4.
fn port(opts: Options) {
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

    let (replies, writer) = Replies::new(PipeSink::new(output), 1024, opts.limits.chunk_bytes);
    thread::Builder::new()
        .name("writer".into())
        .spawn(move || {
            if let Err(e) = writer.run() {
                log::info!("client gone ({e}); exiting");
            }
            sys::exit_now(0);
        })
        .expect("spawn writer");

    let machine = Machine::select(opts.device);
    let device = machine.device;
    let offer = shared::offer(opts.shared_memory);
    let shared_memory = !offer.is_atom("nil");
    replies.send(Outgoing::Frame(hello(opts.generation, &opts.limits, &machine, offer)));

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
    let input = Reader::new(pipe_source(input, config.limits), config);
    let input = Arc::new(Input::new(input).unwrap_or_else(|e| {
        eprintln!("moat_port: cannot make the reader's timer: {e}");
        std::process::exit(2);
    }));
    let shared = input.clone();
    thread::Builder::new()
        .name("reader".into())
        .spawn(move || input::end(shared.serve(in_tx)))
        .expect("spawn reader");

    machine.make_default();
    Session::new(opts.generation, replies)
        .with_checks(opts.checks)
        .with_shared_memory(shared_memory)
        .with_input(input)
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

fn hello(generation: u64, limits: &Limits, machine: &Machine, shared_memory: Term) -> Term {
    let Machine {
        kernels,
        device,
        devices: all,
    } = machine;
    let mut kinds: Vec<Device> = all.iter().map(|d| d.kind).collect();
    kinds.dedup();
    let devices = kinds.into_iter().map(|d| Term::atom(d.name()));
    let blas = if cfg!(moat_openblas) { "openblas" } else { "reference" };
    protocol::hello(vec![
        ("blas", Term::atom(blas)),
        ("chunk_bytes", Term::int(limits.chunk_bytes as u64)),
        ("cpu", Term::atom(kernels.name())),
        ("device", Term::atom(device.map_or("nil", Device::name))),
        ("device_info", Term::List(all.iter().map(device_term).collect())),
        ("devices", Term::List(devices.collect())),
        ("generation", Term::int(generation)),
        ("max_frame_bytes", Term::int(limits.max_frame_bytes as u64)),
        ("mlx", Term::Binary(mlx::version().into_bytes())),
        ("os_pid", Term::int(sys::os_pid())),
        ("shared_memory", shared_memory),
    ])
}
