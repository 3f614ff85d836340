//! The shim's vectorized CPU kernels (f32, f16 and bf16 transcendentals)
//! through a real worker: their ulp bounds against f64 references, the
//! scalar fallback forced by MOAT_CPU_FEATURES, the kernel set announced in
//! the hello, and inputs that are strided, broadcast, empty or half-width.
//! The workers run on the CPU device (`--device cpu`), so that a CUDA build
//! tests its CPU kernels too; on a GPU, f32 has kernels of its own (the last
//! test).

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;
use std::process::Stdio;
use std::time::Duration;

/// Each op with its bound in f32 ulp and an f64 reference (`None`: Rust has
/// no erf; test/moat/kernels_test.exs checks those against Nx.BinaryBackend).
#[allow(clippy::type_complexity)]
const OPS: [(&str, f64, Option<fn(f64) -> f64>); 11] = [
    ("exp", 1.0, Some(f64::exp)),
    ("expm1", 1.0, Some(f64::exp_m1)),
    ("log", 1.0, Some(f64::ln)),
    ("log1p", 1.0, Some(f64::ln_1p)),
    ("tanh", 1.0, Some(f64::tanh)),
    ("sigmoid", 3.0, Some(|x| 1.0 / (1.0 + (-x).exp()))),
    ("erf", 1.0, None),
    ("erfc", 2.0, None),
    ("sin", 1.0, Some(f64::sin)),
    ("cos", 1.0, Some(f64::cos)),
    ("rsqrt", 1.5, Some(|x| 1.0 / x.sqrt())),
];

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return has_avx2() && is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

fn available_sets() -> Vec<&'static str> {
    [("scalar", true), ("avx2", has_avx2()), ("avx512", has_avx512())]
        .into_iter()
        .filter_map(|(set, has)| has.then_some(set))
        .collect()
}

/// Every 65536th f32 bit pattern (both signs, denormals, infinities, NaNs),
/// then the edges: zeros, the smallest denormals, overflow and underflow
/// thresholds, and values that end vector blocks at odd lengths.
fn sweep() -> Vec<f32> {
    let mut v: Vec<f32> = (0..=u32::MAX).step_by(65_536).map(f32::from_bits).collect();
    v.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(1),
        -f32::from_bits(1),
        f32::MIN_POSITIVE,
        88.72283,
        88.7229,
        -87.33654,
        -103.97,
        -104.0,
        1.0,
        -1.0,
        0.927_734_4,
        3.92,
        4.0,
        10.05,
        1e38,
        3e38,
    ]);
    v
}

/// The distance of `got` from `exact`, in f32 ulp at `exact`.
fn ulps(got: f32, exact: f64) -> f64 {
    if exact.is_nan() || got.is_nan() {
        return if exact.is_nan() && got.is_nan() {
            0.0
        } else {
            f64::INFINITY
        };
    }
    if got == exact as f32 {
        return 0.0;
    }
    if got.is_infinite() {
        return f64::INFINITY;
    }
    let exponent = exact.abs().log2().floor() as i32;
    (got as f64 - exact).abs() / 2f64.powi((exponent - 23).max(-149))
}

fn worst(got: &[f32], inputs: &[f32], exact: impl Fn(f64) -> f64) -> (f64, f32) {
    got.iter()
        .zip(inputs)
        .map(|(g, x)| (ulps(*g, exact(*x as f64)), *x))
        .fold((0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a })
}

/// `op` of tensor 1 (the sweep) in `w`, as f32 values.
fn compute(w: &mut Worker, op: &str, seq: u64) -> Vec<f32> {
    w.request(0, op, &[100 + seq], &[1], typed("f", 32));
    let out = w.read_f32(seq, 100 + seq);
    w.request(0, "release", &[], &[100 + seq], nil());
    out
}

/// The worker's options: the CPU device, whatever the build has.
const CPU: [&str; 2] = ["--device", "cpu"];

fn forced(set: &str) -> Worker {
    Worker::start_env(&CPU, &[("MOAT_CPU_FEATURES", set)])
}

#[test]
fn the_hello_names_the_kernel_set_the_cpu_supports_or_the_one_forced() {
    let cpu = |w: &Worker| w.hello.as_tuple().unwrap()[2].get("cpu").cloned();
    let w = Worker::start(&CPU);
    let best = if has_avx512() {
        "avx512"
    } else if has_avx2() {
        "avx2"
    } else {
        "scalar"
    };
    assert_eq!(cpu(&w), Some(Term::atom(best)));
    assert_eq!(cpu(&forced("scalar")), Some(Term::atom("scalar")));
    assert_eq!(cpu(&forced("auto")), Some(Term::atom(best)));
    assert_eq!(cpu(&forced("mlx")), Some(Term::atom("mlx")));
}

#[test]
fn an_unknown_or_unsupported_kernel_set_stops_the_worker_with_status_2() {
    let mut sets = vec!["avx9"];
    if !has_avx2() {
        sets.push("avx2");
    }
    if !has_avx512() {
        sets.push("avx512");
    }
    for set in sets {
        let mut w = Worker::spawn(&[], &[("MOAT_CPU_FEATURES", set)], Stdio::piped());
        let status = w.wait_exit(Duration::from_secs(10));
        assert_eq!(status.code(), Some(2), "MOAT_CPU_FEATURES={set}");
        let mut log = String::new();
        std::io::Read::read_to_string(w.child.stderr.as_mut().unwrap(), &mut log).unwrap();
        assert!(log.contains("MOAT_CPU_FEATURES"), "{log}");
    }
}

#[test]
fn both_kernel_sets_keep_their_ulp_bounds_and_agree() {
    let xs = sweep();
    let mut sets = vec![forced("scalar")];
    if has_avx2() {
        sets.push(forced("avx2"));
    }
    if has_avx512() {
        sets.push(forced("avx512"));
    }
    let mut results: Vec<Vec<Vec<f32>>> = Vec::new();
    for w in &mut sets {
        w.upload_f32(1, &[xs.len() as i32], &xs);
        results.push(
            OPS.iter()
                .enumerate()
                .map(|(i, (op, _, _))| compute(w, op, i as u64 + 1))
                .collect(),
        );
    }
    for (set, per_op) in results.iter().enumerate() {
        for ((op, bound, exact), got) in OPS.iter().zip(per_op) {
            if let Some(exact) = exact {
                let (ulp, at) = worst(got, &xs, exact);
                assert!(ulp <= *bound, "{op} (set {set}): {ulp} ulp at {at:e}");
            }
        }
    }
    // The vector sets agree with the scalar fallback within twice their
    // bounds, NaN for NaN.
    let (scalar, vector) = results.split_first().unwrap();
    for (set, per_op) in vector.iter().enumerate() {
        for (((op, bound, _), s), v) in OPS.iter().zip(scalar).zip(per_op) {
            for ((s, v), x) in s.iter().zip(v).zip(&xs) {
                let apart = ulps(*s, *v as f64);
                assert!(apart <= 2.0 * bound, "{op}({x:e}): scalar {s:e}, set {} {v:e}", set + 1);
            }
        }
    }
}

#[test]
fn pow_keeps_its_bound_with_broadcasting() {
    let bases: Vec<f32> = sweep().into_iter().filter(|x| x.is_finite()).map(f32::abs).collect();
    let exps = [-3.5f32, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 10.25];
    for set in available_sets() {
        let mut w = forced(set);
        w.upload_f32(1, &[bases.len() as i32, 1], &bases);
        w.upload_f32(2, &[exps.len() as i32], &exps);
        w.request(0, "pow", &[3], &[1, 2], typed("f", 32));
        let got = w.read_f32(1, 3);
        assert_eq!(got.len(), bases.len() * exps.len());
        for (i, b) in bases.iter().enumerate() {
            for (j, e) in exps.iter().enumerate() {
                let g = got[i * exps.len() + j];
                let ulp = ulps(g, (*b as f64).powf(*e as f64));
                assert!(ulp <= 1.0, "{set}: {b:e} ** {e} = {g:e} ({ulp} ulp)");
            }
        }
    }
}

#[test]
fn pow_by_one_exponent_keeps_its_bound_and_half_types_round_once() {
    let bases: Vec<f32> = sweep().into_iter().filter(|x| !x.is_nan()).collect();
    let exps = [
        -64.0f32, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 64.0, 0.5, -1.5, 7.25, 65.0,
    ];
    for set in available_sets() {
        let mut w = forced(set);
        w.upload_f32(1, &[bases.len() as i32], &bases);
        for (k, e) in exps.iter().enumerate() {
            let id = 10 + 10 * k as u64;
            // A 0-d exponent and a {1} one both broadcast as one element.
            let shape: &[i32] = if k % 2 == 0 { &[] } else { &[1] };
            w.upload_f32(id, shape, &[*e]);
            w.request(0, "pow", &[id + 1], &[1, id], typed("f", 32));
            let got = w.read_f32(id, id + 1);
            for (b, g) in bases.iter().zip(&got) {
                let exact = (*b as f64).powf(*e as f64);
                assert!(ulps(*g, exact) <= 1.0, "{set}: {b:e} ** {e} = {g:e}, want {exact:e}");
            }
            // bf16: the f32 result rounded once.
            w.request(0, "astype", &[id + 2], &[1], typed("bf", 16));
            w.request(0, "astype", &[id + 3], &[id], typed("bf", 16));
            w.request(0, "pow", &[id + 4], &[id + 2, id + 3], typed("bf", 16));
            w.request(0, "astype", &[id + 5], &[id + 2], typed("f", 32));
            w.request(0, "astype", &[id + 6], &[id + 3], typed("f", 32));
            w.request(0, "pow", &[id + 7], &[id + 5, id + 6], typed("f", 32));
            w.request(0, "astype", &[id + 8], &[id + 7], typed("bf", 16));
            let (direct, via) = (w.read_bytes(id + 4, id + 4), w.read_bytes(id + 8, id + 8));
            for (d, v) in direct.chunks(2).zip(via.chunks(2)) {
                let nan = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]) & 0x7fff > 0x7f80;
                assert!(d == v || (nan(d) && nan(v)), "{set}: bf16 ** {e}: {d:?} vs {v:?}");
            }
        }
    }
}

#[test]
fn strided_broadcast_and_empty_inputs_give_what_contiguous_ones_do() {
    let mut w = Worker::start(&CPU);
    let xs: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 4.0).collect();
    w.upload_f32(1, &[4, 6], &xs);
    let f32_type = || ("type", ty("f", 32));
    // A transpose and a strided slice, each against its copy.
    w.request(
        0,
        "transpose",
        &[2],
        &[1],
        map(vec![("axes", ints(&[1, 0])), f32_type()]),
    );
    let slice = map(vec![
        ("starts", ints(&[1, 0])),
        ("lengths", ints(&[3, 5])),
        ("strides", ints(&[2, 3])),
        f32_type(),
    ]);
    w.request(0, "slice", &[3], &[1], slice);
    // A broadcast view: its evaluated form has zero strides and 6 elements.
    w.upload_f32(4, &[6], &xs[..6]);
    w.request(
        0,
        "broadcast_to",
        &[5],
        &[4],
        map(vec![("shape", ints(&[4, 6])), f32_type()]),
    );
    for (seq, view) in [(1u64, 2u64), (2, 3), (8, 5)] {
        let copy = w.read_f32(10 * seq, view);
        w.upload_f32(20 + view, &[copy.len() as i32], &copy);
        for (k, (op, _, _)) in OPS.iter().enumerate() {
            let k = k as u64;
            w.request(0, op, &[1000 + 100 * seq + k], &[view], typed("f", 32));
            w.request(0, op, &[2000 + 100 * seq + k], &[20 + view], typed("f", 32));
            let strided = w.read_bytes(10 * seq + 1, 1000 + 100 * seq + k);
            let flat = w.read_bytes(10 * seq + 2, 2000 + 100 * seq + k);
            assert_eq!(strided, flat, "{op} of view {view}");
        }
    }
    // Broadcasting: {4, 6} ** {6} and {1} ** {4, 6}.
    w.upload_f32(30, &[6], &[0.5, 1.0, 2.0, 3.0, -1.0, 0.0]);
    w.request(0, "pow", &[31], &[1, 30], typed("f", 32));
    let got = w.read_f32(3, 31);
    for (i, g) in got.iter().enumerate() {
        let want = xs[i].powf([0.5f32, 1.0, 2.0, 3.0, -1.0, 0.0][i % 6]);
        assert!(
            g == &want || (g.is_nan() && want.is_nan()) || ulps(*g, want as f64) <= 1.0,
            "{i}: {g} vs {want}"
        );
    }
    w.upload_f32(32, &[1], &[2.0]);
    w.request(0, "pow", &[33], &[32, 1], typed("f", 32));
    let got = w.read_f32(4, 33);
    assert!(got.iter().zip(&xs).all(|(g, x)| ulps(*g, 2f64.powf(*x as f64)) <= 1.0));
    // Empty tensors.
    w.upload_f32(40, &[0], &[]);
    w.upload(41, &[2, 0], "f", 32, &[]);
    for (op, _, _) in OPS {
        w.request(0, op, &[42], &[40], typed("f", 32));
        assert!(w.read_bytes(5, 42).is_empty(), "{op}");
        w.request(0, op, &[43], &[41], typed("f", 32));
        let (meta, data) = w.read(6, 43).unwrap();
        assert!(data.is_empty());
        assert_eq!(meta.get("shape"), Some(&ints(&[2, 0])), "{op}");
        w.request(0, "release", &[], &[42, 43], nil());
    }
    w.request(0, "pow", &[44], &[41, 40], typed("f", 32));
    assert!(w.read_bytes(7, 44).is_empty());
}

#[test]
fn half_width_types_round_the_f32_result_once() {
    let xs: Vec<f32> = sweep()
        .into_iter()
        .filter(|x| x.abs() < 1e4 || !x.is_finite())
        .collect();
    for set in available_sets() {
        let mut w = forced(set);
        w.upload_f32(1, &[xs.len() as i32], &xs);
        for (t, (kind, bits)) in [("f", 16u32), ("bf", 16)].into_iter().enumerate() {
            let t = t as u64;
            w.request(0, "astype", &[2], &[1], typed(kind, bits));
            w.request(0, "astype", &[3], &[2], typed("f", 32));
            for (k, (op, _, _)) in OPS.iter().enumerate() {
                let id = 1000 * (t + 1) + 10 * k as u64;
                w.request(0, op, &[id], &[2], typed(kind, bits));
                w.request(0, op, &[id + 1], &[3], typed("f", 32));
                w.request(0, "astype", &[id + 2], &[id + 1], typed(kind, bits));
                let direct = w.read_bytes(id, id);
                let via_f32 = w.read_bytes(id + 2, id + 2);
                for (i, (d, v)) in direct.chunks(2).zip(via_f32.chunks(2)).enumerate() {
                    let nan = |b: &[u8]| {
                        let h = u16::from_le_bytes([b[0], b[1]]) & 0x7fff;
                        if bits == 16 && kind == "bf" {
                            h > 0x7f80
                        } else {
                            h > 0x7c00
                        }
                    };
                    assert!(
                        d == v || (nan(d) && nan(v)),
                        "{set} {op} {kind}{bits} of {:e}: {d:?} vs {v:?}",
                        xs[i]
                    );
                }
                w.request(0, "release", &[], &[id, id + 1, id + 2], nil());
            }
            w.request(0, "release", &[], &[2, 3], nil());
        }
    }
}

#[test]
fn on_a_gpu_f32_functions_are_computed_in_double_and_rounded_once() {
    let mut w = Worker::start(&[]);
    if !w.on_gpu() {
        eprintln!("skipped: this worker runs on the CPU (the GPU kernels run where the hello announces device gpu)");
        return;
    }
    let xs = sweep();
    w.upload_f32(1, &[xs.len() as i32], &xs);
    // Rounded once from double: within half an ulp (and a hair for the
    // double result's own error); subnormal results are left out (a kernel
    // may flush them to zero).
    let normal = |e: f64| !(e != 0.0 && e.abs() < f32::MIN_POSITIVE as f64);
    let worst_normal = |got: &[f32], exact: &dyn Fn(usize) -> f64| {
        (0..got.len())
            .filter(|&i| normal(exact(i)))
            .map(|i| (ulps(got[i], exact(i)), i))
            .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a })
    };
    for (i, (op, _, exact)) in OPS.iter().enumerate() {
        let got = compute(&mut w, op, i as u64 + 1);
        if let Some(exact) = exact {
            let (ulp, at) = worst_normal(&got, &|i| exact(xs[i] as f64));
            assert!(ulp <= 0.51, "{op} on the GPU: {ulp} ulp at {:e}", xs[at]);
        }
    }
    let ys: Vec<f32> = xs.iter().rev().copied().collect();
    w.upload_f32(2, &[ys.len() as i32], &ys);
    w.request(0, "atan2", &[50], &[1, 2], typed("f", 32));
    let got = w.read_f32(40, 50);
    let (ulp, at) = worst_normal(&got, &|i| (xs[i] as f64).atan2(ys[i] as f64));
    assert!(
        ulp <= 0.51,
        "atan2 on the GPU: {ulp} ulp at ({:e}, {:e})",
        xs[at],
        ys[at]
    );
    w.close(Duration::from_secs(5));
}
