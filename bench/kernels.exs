# The worker's CPU kernels of the transcendentals (f32 and bf16, 1M
# elements), softmax of {8, 128, 128} and GELU of {128, 2048}, next to numpy
# in the same run, through each kernel set the CPU has (the default worker
# takes the widest), the scalar fallback and MLX's own kernels; `add` (MLX's
# own kernel) shows what any 1M-element op costs in the worker. Then the
# decoder block of bench/compiler.exs, eager at sequence 128, on the default
# worker and on one with MLX's own kernels: in rounds that take each worker
# in turn, alone, after a pause (300 ms) in which the other workers' pools
# (OpenBLAS's, ours) have gone to sleep, then a warm-up call and 5 timed
# calls; the ratio is of the medians of this one run. Alternating the
# workers call by call measured each with the other's OpenBLAS threads
# still spinning (up to 0.1 s after its last product under OpenBLAS's
# default timeout: docs/latency.md). Run with bin/bench (mix run -r
# bench/support.exs bench/kernels.exs).
#
# MOAT_BENCH_BASELINE=PATH adds a column from a worker of that executable
# (e.g. main's build), for a before/after in the same run.
#
# What each time is (medians of interleaved rounds; the machine is noisy, so
# compare ratios within one run):
#   * "per op": 8 independent ops on the same input, built and then
#     evaluated by one `Moat.eval/1`, divided by 8: the op as numpy's
#     is timed (one call that allocates its output and computes it), with
#     one request's round trip and thread wake-ups shared by the batch.
#   * "one op + eval": one op and its own `Moat.eval/1` (no readback): what
#     an eager caller that waits for each result pays.
#   * numpy: one call (`np.exp(x)`), which allocates and computes (and
#     reuses the block it freed the call before, still in the cache);
#     "8 live outputs": into 8 preallocated outputs in turn, as Moat's batch
#     writes 8 outputs, past the L3.

import Bench

rounds = String.to_integer(System.get_env("MOAT_BENCH_ROUNDS", "30"))
batch = 8
Moat.Worker.start_link(name: :bench_scalar, cpu_kernels: :scalar)
Moat.Worker.start_link(name: :bench_mlx, cpu_kernels: :mlx)
info = Moat.Worker.info()
# The AVX2 set beside a wider default, where the CPU has both.
avx2? = info.cpu == :avx512 and match?({:ok, _}, Moat.Worker.start_link(name: :bench_avx2, cpu_kernels: :avx2))

IO.puts(
  "Moat worker: MLX #{info.mlx}, CPU kernels #{info.cpu}; fallback worker: #{Moat.Worker.info(:bench_scalar).cpu}\n"
)

n = 1_048_576

inputs = fn worker, type ->
  line = fn lo, hi, count -> Nx.linspace(lo, hi, n: count, type: :f32) end
  to = fn t -> t |> Nx.as_type(type) |> Nx.backend_transfer({Moat.Backend, worker: worker}) end

  %{
    x: to.(line.(-4.0, 4.0, n)),
    pos: to.(line.(0.01, 8.0, n)),
    big: to.(line.(-0.5, 8.0, n)),
    s: to.(line.(-4.0, 4.0, 8 * 128 * 128) |> Nx.reshape({8, 128, 128})),
    g: to.(line.(-4.0, 4.0, 128 * 2048) |> Nx.reshape({128, 2048}))
  }
end

softmax = fn a ->
  e = Nx.exp(Nx.subtract(a, Nx.reduce_max(a, axes: [-1], keep_axes: true)))
  Nx.divide(e, Nx.sum(e, axes: [-1], keep_axes: true))
end

gelu_tanh = fn a ->
  inner = Nx.multiply(0.7978846, Nx.add(a, Nx.multiply(0.044715, Nx.pow(a, 3))))
  Nx.multiply(Nx.multiply(0.5, a), Nx.add(1, Nx.tanh(inner)))
end

gelu_erf = fn a -> Nx.multiply(Nx.multiply(0.5, a), Nx.add(1, Nx.erf(Nx.multiply(a, 0.70710678)))) end

cases = [
  {"add", &Nx.add(&1.x, &1.pos)},
  {"exp", &Nx.exp(&1.x)},
  {"expm1", &Nx.expm1(&1.x)},
  {"log", &Nx.log(&1.pos)},
  {"log1p", &Nx.log1p(&1.big)},
  {"tanh", &Nx.tanh(&1.x)},
  {"sigmoid", &Nx.sigmoid(&1.x)},
  {"erf", &Nx.erf(&1.x)},
  {"erfc", &Nx.erfc(&1.x)},
  {"sin", &Nx.sin(&1.x)},
  {"cos", &Nx.cos(&1.x)},
  {"rsqrt", &Nx.rsqrt(&1.pos)},
  {"pow", &Nx.pow(&1.pos, &1.x)},
  {"softmax", &softmax.(&1.s)},
  {"gelu_tanh", &gelu_tanh.(&1.g)},
  {"gelu_erf", &gelu_erf.(&1.g)}
]

baseline = System.get_env("MOAT_BENCH_BASELINE")
if baseline, do: {:ok, _} = Moat.Worker.start_link(name: :bench_base, worker_path: baseline)

workers =
  [Moat.Worker, :bench_scalar, :bench_mlx] ++
    if(avx2?, do: [:bench_avx2], else: []) ++ if(baseline, do: [:bench_base], else: [])

runs =
  for worker <- workers,
      type <- [:f32, :bf16],
      type == :f32 or worker == Moat.Worker,
      do: {worker, type, inputs.(worker, type)}

one = fn f, data -> time_us(fn -> Moat.eval(f.(data)) end) end
per_op = fn f, data -> time_us(fn -> Moat.eval(for _ <- 1..batch, do: f.(data)) end) / batch end
# Warm up, then interleave every case and run in each round.
for {_, f} <- cases, {_, _, data} <- runs, do: per_op.(f, data)

times =
  for _ <- 1..rounds, {name, f} <- cases, {worker, type, data} <- runs, reduce: %{} do
    acc ->
      t = per_op.(f, data)
      acc = Map.update(acc, {name, worker, type}, [t], &[t | &1])

      if worker == Moat.Worker and type == :f32 do
        t = one.(f, data)
        Map.update(acc, {name, :one}, [t], &[t | &1])
      else
        acc
      end
  end

python = System.get_env("MOAT_BENCH_PYTHON", "python3")
{out, 0} = System.cmd(python, [Path.join(__DIR__, "numpy_elementwise.py"), "#{rounds}"])
[["numpy", numpy_version] | rows] = out |> String.split("\n", trim: true) |> Enum.map(&String.split/1)
numpy = Map.new(rows, fn [k, s] -> {k, String.to_float(s) * 1_000_000} end)

ms = fn us -> fmt(us / 1000) end
IO.puts("### CPU kernels (ms, median of #{rounds}; numpy #{numpy_version} in the same run)\n")

IO.puts(
  "1,048,576 elements; softmax of {8, 128, 128} over the last axis; GELU of {128, 2048}. " <>
    "Moat columns are per op in a batch of #{batch} unless named \"one op + eval\".\n"
)

avx2_head =
  if(avx2?, do: ["Moat f32, avx2"], else: []) ++ if(baseline, do: ["Moat f32, baseline worker"], else: [])

row(
  ["op", "Moat f32 (#{info.cpu})", "Moat f32, one op + eval", "Moat bf16"] ++
    avx2_head ++
    ["Moat f32, scalar", "MLX's own f32", "MLX / Moat", "numpy f32", "numpy / Moat", "numpy f32, 8 live outputs"]
)

row(["---" | List.duplicate("---:", 9 + length(avx2_head))])

for {name, _} <- cases do
  m = median(times[{name, Moat.Worker, :f32}])
  np = numpy[name]

  avx2 =
    for w <- [:bench_avx2, :bench_base], Map.has_key?(times, {name, w, :f32}), do: ms.(median(times[{name, w, :f32}]))

  row(
    ["`#{name}`", ms.(m), ms.(median(times[{name, :one}])), ms.(median(times[{name, Moat.Worker, :bf16}]))] ++
      avx2 ++
      [
        ms.(median(times[{name, :bench_scalar, :f32}])),
        # MLX has no erfc: that worker runs the scalar kernel for it.
        if(name == "erfc", do: "—", else: ms.(median(times[{name, :bench_mlx, :f32}]))),
        if(name == "erfc", do: "—", else: ratio(median(times[{name, :bench_mlx, :f32}]), m)),
        if(np, do: ms.(np), else: "—"),
        if(np, do: ratio(np, m), else: "—"),
        if(numpy["#{name}@8"], do: ms.(numpy["#{name}@8"]), else: "—")
      ]
  )
end

IO.puts(
  "\nThe floor (numpy, same run): copying 4 MB into one reused output #{ms.(numpy["copy@1"])} ms, " <>
    "into 8 outputs in turn (as a batch of 8 keeps them) #{ms.(numpy["copy@8"])} ms."
)

# The decoder block, eager at sequence 128, with the worker's kernels and
# with MLX's own: the call and a readback of its {128, 512} result.
block_weights = fn worker ->
  Map.new(Bench.Decoder.weight_shapes(), fn {k, shape} ->
    w =
      Nx.iota(shape, type: :f32, backend: {Moat.Backend, worker: worker})
      |> Nx.multiply(0.618)
      |> Nx.sin()
      |> Nx.multiply(0.05)

    {k, w}
  end)
end

blocks =
  for worker <- [Moat.Worker, :bench_mlx] ++ if(baseline, do: [:bench_base], else: []) do
    x = Nx.iota({128, 512}, type: :f32, backend: {Moat.Backend, worker: worker}) |> Nx.multiply(0.37) |> Nx.sin()
    {worker, x, block_weights.(worker)}
  end

# The block builds its causal mask with Nx.iota: on that worker too, as
# under `Nx.default_backend(Moat.Backend)`, not on Nx.BinaryBackend.
block = fn worker, x, w ->
  Nx.with_default_backend({Moat.Backend, worker: worker}, fn ->
    time_us(fn -> Nx.to_binary(Bench.Decoder.block(x, w)) end)
  end)
end

block_rounds = max(div(rounds, 3), 1)

block_times =
  for _ <- 1..block_rounds, {worker, x, w} <- blocks, reduce: %{} do
    acc ->
      Process.sleep(300)
      block.(worker, x, w)
      ts = for _ <- 1..5, do: block.(worker, x, w)
      Map.update(acc, worker, ts, &(ts ++ &1))
  end

[ours, mlx] = for worker <- [Moat.Worker, :bench_mlx], do: median(block_times[worker])
base = if baseline, do: [ms.(median(block_times[:bench_base]))], else: []

IO.puts(
  "\nDecoder block of bench/compiler.exs, eager, sequence 128 (ms, median of #{block_rounds} rounds of 5, " <>
    "each worker alone, call + readback):\n"
)

base_head = if baseline, do: ["baseline worker"], else: []
row(["", "Moat (#{info.cpu} kernels)", "Moat with MLX's own kernels", "MLX's / ours"] ++ base_head)
row(["---", "---:", "---:", "---:"] ++ Enum.map(base_head, fn _ -> "---:" end))
row(["decoder block, seq 128", ms.(ours), ms.(mlx), ratio(mlx, ours)] ++ base)
