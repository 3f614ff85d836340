//! Compiles the C++ shim against MLX and links the worker to libmlx.
//!
//! MLX is found, in order, at: $MOAT_MLX_DIR; the cache that `mix
//! moat.setup` (and bin/setup) fills, $MOAT_CACHE (default ~/.cache/moat)
//! then `<package>-<version>/mlx` of the flavour $MOAT_MLX (default `cpu`) in
//! mlx.pins; a pip-installed `mlx` package. The folder must hold include/ and
//! lib/libmlx.so.
//!
//! The worker finds its shared libraries (MLX's, and OpenBLAS where it is
//! linked) only in `lib/` next to itself, through an `$ORIGIN` rpath: this
//! script links them into `lib/` beside what cargo builds, and the Mix
//! compiler links the same set into the application's priv/lib, which a
//! `mix release` copies. Nothing names the cache, so a release runs wherever
//! it is copied.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One line of mlx.pins: a flavour and the wheel that provides it.
struct Pin {
    flavour: String,
    package: String,
    version: String,
}

fn main() {
    for var in ["MOAT_MLX_DIR", "MOAT_MLX", "MOAT_CACHE", "HOME", "MOAT_BLAS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rerun-if-changed=mlx.pins");
    println!("cargo:rerun-if-changed=src/mlx/ffi.rs");
    println!("cargo:rustc-check-cfg=cfg(moat_openblas)");
    elementwise_wrappers();

    let pin = pin();
    let Some(mlx) = find_mlx(&pin) else {
        // The Mix compiler shows this paragraph, from "moat: MLX", on its own.
        eprintln!(
            "moat: MLX {version} ({package}) not found. Install it with\n\n    mix moat.setup --mlx {flavour}\n\n\
             (from this checkout or any Mix project that depends on Moat), or point MOAT_MLX_DIR at \
             a folder holding include/mlx and lib/libmlx.so.\n",
            version = pin.version,
            package = pin.package,
            flavour = pin.flavour
        );
        std::process::exit(1);
    };
    let include = mlx.join("include");
    let lib = mlx.join("lib");

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .flag("-isystem")
        .flag(include.to_str().expect("utf-8 path"))
        .flag("-fPIC")
        .warnings(true)
        .extra_warnings(true);
    for entry in std::fs::read_dir("shim").expect("port/shim") {
        let path = entry.expect("shim entry").path();
        if path.extension().is_some_and(|e| e == "cpp") {
            build.file(path);
        }
    }
    // The fault-injection build's shim has a device fault (shim/fault.cpp).
    if env::var_os("CARGO_FEATURE_FAULT_INJECTION").is_some() {
        build.define("MOAT_FAULT_INJECTION", None);
    }
    build.compile("moat_shim");
    // The shim's CPU kernels call SLEEF (Debian: libsleef-dev).
    println!("cargo:rustc-link-lib=dylib=sleef");

    let mut libs = mlx_libs(&mlx);
    libs.extend(link_blas());
    libs.extend(sleef());
    link_libs(&libs);
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    // DT_RPATH, not DT_RUNPATH: it also applies to the libraries' own
    // dependencies (libmlx's vendored LAPACK, OpenBLAS's libgfortran), so one
    // lib/ serves them all. `$ORIGIN/../lib` is for the test executables in
    // deps/.
    println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags");
    // shim/scheduler.cpp defines MLX's scheduler entry points that libmlx
    // calls through its PLT: exported from the executable, they are the ones
    // libmlx binds to (and forward to libmlx's own). `--undefined` keeps
    // their object in the link.
    for symbol in SCHEDULER_SYMBOLS {
        println!("cargo:rustc-link-arg=-Wl,--undefined={symbol}");
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol={symbol}");
    }
    // shim/alloc.cpp's `mlx::core::allocator::allocator()`, which libmlx
    // calls through its PLT: exported, it is the one libmlx binds to.
    println!("cargo:rustc-link-arg=-Wl,--undefined={ALLOCATOR_SYMBOL}");
    println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol={ALLOCATOR_SYMBOL}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/lib:$ORIGIN/../lib");
}

/// `mlx::core::allocator::allocator()`, mangled.
const ALLOCATOR_SYMBOL: &str = "_ZN3mlx4core9allocator9allocatorEv";

/// `mlx::core::scheduler::Scheduler::enqueue(Stream, std::function<void()>)`,
/// `signal_event` and `wait_event(Stream, Event, std::function<void(Event&)>)`
/// (MLX 0.32's scheduler.h), mangled.
const SCHEDULER_SYMBOLS: [&str; 3] = [
    "_ZN3mlx4core9scheduler9Scheduler7enqueueENS0_6StreamESt8functionIFvvEE",
    "_ZN3mlx4core9scheduler9Scheduler12signal_eventENS0_6StreamENS0_5EventESt8functionIFvRS4_EE",
    "_ZN3mlx4core9scheduler9Scheduler10wait_eventENS0_6StreamENS0_5EventESt8functionIFvRS4_EE",
];

/// libmlx and what the wheel vendors beside it (`<package>.libs/`), as
/// (file name, path).
fn mlx_libs(mlx: &Path) -> Vec<(String, PathBuf)> {
    let parent = mlx.parent().expect("MLX folder has a parent");
    let mut dirs = vec![mlx.join("lib")];
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("mlx") && name.ends_with(".libs") {
            dirs.push(entry.path());
        }
    }
    let mut libs = Vec::new();
    for dir in dirs {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.contains(".so") {
                libs.push((name, entry.path()));
            }
        }
    }
    libs
}

/// Replaces `lib/` of the profile folder (the worker's folder) with links to
/// `libs`.
fn link_libs(libs: &[(String, PathBuf)]) {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    // OUT_DIR is <profile>/build/moat_port-<hash>/out.
    let dir = out.ancestors().nth(3).expect("profile folder").join("lib");
    // Removes the old links, never what they point to.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create lib/");
    for (name, path) in libs {
        let target = path
            .canonicalize()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        std::os::unix::fs::symlink(&target, dir.join(name)).expect("link into lib/");
    }
}

/// The wheel's bundled reference BLAS runs f32 matmul ~30x slower than
/// OpenBLAS. Linking libopenblas as a direct dependency of the executable puts
/// it ahead of libmlx's own dependencies in the symbol lookup order, so
/// libmlx's cblas_*/LAPACK calls bind to OpenBLAS. MOAT_BLAS=bundled opts out.
/// Returns OpenBLAS and the libraries it needs beyond glibc and GCC's runtime.
fn link_blas() -> Vec<(String, PathBuf)> {
    if env::var("MOAT_BLAS").as_deref() == Ok("bundled") {
        return Vec::new();
    }
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    ];
    match candidates.iter().find(|p| Path::new(p).exists()) {
        Some(path) => {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg={path}");
            println!("cargo:rustc-cfg=moat_openblas");
            let mut libs = vec![("libopenblas.so.0".to_string(), PathBuf::from(path))];
            libs.extend(needed(Path::new(path)));
            libs
        }
        None => {
            println!(
                "cargo:warning=libopenblas.so.0 not found (apt-get install libopenblas0-pthread): \
                 the worker uses MLX's bundled reference BLAS, which is ~30x slower at matmul"
            );
            Vec::new()
        }
    }
}

/// SLEEF, which Debian ships only as a shared library: carried in `lib/`
/// like OpenBLAS, so a release runs where libsleef3 is not installed.
fn sleef() -> Vec<(String, PathBuf)> {
    [
        "/usr/lib/x86_64-linux-gnu/libsleef.so.3",
        "/usr/lib/aarch64-linux-gnu/libsleef.so.3",
    ]
    .iter()
    .map(Path::new)
    .find(|p| p.exists())
    .map(|p| vec![("libsleef.so.3".to_string(), p.to_path_buf())])
    .unwrap_or_default()
}

/// What `lib` loads, by ldd, less what every glibc system has (glibc itself,
/// libstdc++ and libgcc_s, which the worker needs anyway: see README,
/// "Releases").
fn needed(lib: &Path) -> Vec<(String, PathBuf)> {
    const SYSTEM: [&str; 10] = [
        "libc",
        "libm",
        "libdl",
        "libpthread",
        "librt",
        "libresolv",
        "libutil",
        "libmvec",
        "libstdc++",
        "libgcc_s",
    ];
    let Ok(out) = Command::new("ldd").arg(lib).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.trim().split_once(" => ")?;
            let path = rest.split(" (").next()?;
            let base = name.split(".so").next()?;
            (path.starts_with('/') && !SYSTEM.contains(&base) && !base.starts_with("ld-linux"))
                .then(|| (name.to_string(), PathBuf::from(path)))
        })
        .collect()
}

/// The line of mlx.pins for $MOAT_MLX (default `cpu`).
fn pin() -> Pin {
    let flavour = env::var("MOAT_MLX").unwrap_or_else(|_| "cpu".into());
    let pins = std::fs::read_to_string("mlx.pins").expect("port/mlx.pins");
    let mut known = Vec::new();
    for line in pins.lines().filter(|l| !l.trim_start().starts_with('#')) {
        if let [f, package, version, ..] = line.split_whitespace().collect::<Vec<_>>()[..] {
            if f == flavour {
                return Pin {
                    flavour: f.into(),
                    package: package.into(),
                    version: version.into(),
                };
            }
            known.push(f);
        }
    }
    panic!("MOAT_MLX={flavour}: not a flavour of port/mlx.pins (expected one of {known:?})")
}

fn find_mlx(pin: &Pin) -> Option<PathBuf> {
    let cache = env::var_os("MOAT_CACHE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/moat")));
    let candidates = [
        env::var_os("MOAT_MLX_DIR").map(PathBuf::from),
        cache.map(|c| c.join(format!("{}-{}/mlx", pin.package, pin.version))),
        pip_mlx(),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|dir| dir.join("include/mlx/mlx.h").exists() && dir.join("lib/libmlx.so").exists())
}

fn pip_mlx() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('mlx'); print(next(iter(s.submodule_search_locations)))",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The safe element-wise ops, one per declaration in the "-- element-wise"
/// section of src/mlx/ffi.rs: `moat_foo(a, out)` becomes `mlx::ops::foo(a)`
/// through `unary!`, `moat_foo(a, b, out)` `foo(a, b)` through `binary!`
/// (src/mlx/ops/mod.rs, which holds their `// SAFETY:`). So an element-wise
/// shim function needs no wrapper written by hand.
fn elementwise_wrappers() {
    const SECTION: &str = "// -- element-wise";
    const UNARY: &str = "(a: *const moat_array, out: *mut *mut moat_array) -> c_int;";
    const BINARY: &str = "(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;";
    let ffi = std::fs::read_to_string("src/mlx/ffi.rs").expect("src/mlx/ffi.rs");
    let start = ffi.find(SECTION).expect("ffi.rs has an element-wise section") + SECTION.len();
    let section = &ffi[start..];
    let section = &section[..section.find("// --").unwrap_or(section.len())];
    let (mut unary, mut binary) = (String::new(), String::new());
    for line in section.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let decl = line.strip_prefix("pub fn moat_");
        let Some((name, params)) = decl.and_then(|d| d.split_once('(')) else {
            panic!("ffi.rs's element-wise section holds only one-line declarations, found {line:?}");
        };
        let params = format!("({params}");
        let list = match params.as_str() {
            UNARY => &mut unary,
            BINARY => &mut binary,
            _ => panic!("ffi.rs: element-wise moat_{name} must take one or two arrays and an out"),
        };
        list.push_str(&format!("    {name} => moat_{name},\n"));
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("elementwise_ops.rs");
    let code = format!("unary! {{\n{unary}}}\n\nbinary! {{\n{binary}}}\n");
    std::fs::write(out, code).expect("write elementwise_ops.rs");
}
