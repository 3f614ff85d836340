//! Compiles the C++ shim against MLX and links the worker to libmlx.
//!
//! MLX is found, in order, at: $MOAT_MLX_DIR; the cache that bin/setup
//! fills ($MOAT_CACHE or ~/.cache/moat, then mlx-cpu-0.32.4/mlx); a
//! pip-installed `mlx` package. The folder must hold include/ and lib/libmlx.so.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";

fn main() {
    for var in ["MOAT_MLX_DIR", "MOAT_CACHE", "HOME", "MOAT_BLAS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rustc-check-cfg=cfg(moat_openblas)");

    let mlx = find_mlx().unwrap_or_else(|| {
        panic!(
            "\n\nMLX {MLX_VERSION} not found. Install it with `bin/setup` (it unpacks the PyPI \
             wheel mlx-cpu=={MLX_VERSION} into ~/.cache/moat), or `pip install mlx-cpu=={MLX_VERSION}`, \
             or point MOAT_MLX_DIR at a folder holding include/mlx and lib/libmlx.so.\n\n"
        )
    });
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
    build.compile("moat_shim");
    // The shim's CPU kernels call SLEEF (Debian: libsleef-dev).
    println!("cargo:rustc-link-lib=dylib=sleef");

    link_blas();
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-env=MOAT_MLX_LIB_DIR={}", lib.display());
}

/// The wheel's bundled reference BLAS runs f32 matmul ~30x slower than
/// OpenBLAS. Linking libopenblas as a direct dependency of the executable puts
/// it ahead of libmlx's own dependencies in the symbol lookup order, so
/// libmlx's cblas_*/LAPACK calls bind to OpenBLAS. MOAT_BLAS=bundled opts out.
fn link_blas() {
    if env::var("MOAT_BLAS").as_deref() == Ok("bundled") {
        return;
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
        }
        None => println!(
            "cargo:warning=libopenblas.so.0 not found (apt-get install libopenblas0-pthread): \
             the worker uses MLX's bundled reference BLAS, which is ~30x slower at matmul"
        ),
    }
}

fn find_mlx() -> Option<PathBuf> {
    let cache = env::var_os("MOAT_CACHE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/moat")));
    let candidates = [
        env::var_os("MOAT_MLX_DIR").map(PathBuf::from),
        cache.map(|c| c.join(format!("mlx-cpu-{MLX_VERSION}/mlx"))),
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
