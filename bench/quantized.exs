# Quantized matrix products x {M, K} · wᵀ (w {N, K}, affine, group 64) at
# decode shapes: the worker's own CPU kernel (the default worker's set and
# the scalar fallback), MLX's own CPU quantized_matmul (cpu_kernels: :mlx),
# Moat's dense f32 dot (OpenBLAS) and numpy's f32 product in the same run.
# Run with bin/bench (mix run -r bench/support.exs bench/quantized.exs).
# Each Moat time is the product plus an eval in the worker (no readback);
# medians of rounds (interleaved per worker, below); compare ratios within
# one run.

import Bench

rounds = 30
Moat.Worker.start_link(name: :bench_q_scalar, cpu_kernels: :scalar)
Moat.Worker.start_link(name: :bench_q_mlx, cpu_kernels: :mlx)
Moat.Worker.start_link(name: :bench_q_avx2, cpu_kernels: :avx2)
info = Moat.Worker.info()
shapes = [{1, 4096, 4096}, {1, 1024, 4096}, {2, 4096, 4096}, {4, 4096, 4096}, {8, 4096, 4096}, {16, 4096, 4096}]

Nx.global_default_backend(Moat.Backend)

normal = fn seed, shape ->
  {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape, type: :f32)
  t
end

# One weight per {K, N}, uploaded to each worker and quantized there.
weights =
  for {k, n} <- shapes |> Enum.map(fn {_, k, n} -> {k, n} end) |> Enum.uniq(), into: %{} do
    {{k, n}, normal.(k + n, {n, k})}
  end

variants = [
  {"f32", Moat.Worker, nil},
  {"4-bit", Moat.Worker, 4},
  {"8-bit", Moat.Worker, 8},
  {"4-bit AVX2", :bench_q_avx2, 4},
  {"8-bit AVX2", :bench_q_avx2, 8},
  {"4-bit scalar", :bench_q_scalar, 4},
  {"8-bit scalar", :bench_q_scalar, 8},
  {"4-bit MLX", :bench_q_mlx, 4},
  {"8-bit MLX", :bench_q_mlx, 8}
]

held =
  for {{k, n}, w} <- weights, {name, worker, bits} <- variants, into: %{} do
    dense = Nx.backend_copy(w, {Moat.Backend, worker: worker})
    {{name, k, n}, if(bits, do: Moat.quantize(dense, bits: bits, group_size: 64), else: dense)}
  end

xs =
  for {m, k, _} <- shapes,
      {_, worker, _} <- variants,
      into: %{},
      do: {{m, k, worker}, Nx.backend_copy(normal.(m, {m, k}), {Moat.Backend, worker: worker})}

product = fn {m, k, n}, {name, worker, _} ->
  Nx.dot(xs[{m, k, worker}], [1], held[{name, k, n}], [1])
end

time = fn shape, v -> time_us(fn -> product.(shape, v).data.ref |> Moat.eval() end) end
# The scalar fallback and MLX's kernel (tens of ms a product) only at M = 1.
measured? = fn {m, _, _}, {name, _, _} -> m == 1 or not String.contains?(name, ["scalar", "MLX"]) end
for shape <- shapes, v <- variants, measured?.(shape, v), do: time.(shape, v)

# Rounds interleave the variants of one worker, and each worker's rounds
# run in turn: interleaved across workers, every product found its worker's
# threads parked and its weight evicted by the three other workers' (and
# their helpers still spinning), which a decode loop on one worker does not
# see (1 × 1024 × 4096 4-bit: 0.62 ms that way).
times =
  for vs <- Enum.chunk_by(variants, &elem(&1, 1)),
      _ <- 1..rounds,
      shape <- shapes,
      v <- vs,
      measured?.(shape, v),
      reduce: %{} do
    acc ->
      t = time.(shape, v)
      Map.update(acc, {shape, elem(v, 0)}, [t], &[t | &1])
  end

python = System.get_env("MOAT_BENCH_PYTHON", "python3")
args = for {m, k, n} <- shapes, do: "#{m}:#{k}:#{n}"
{out, 0} = System.cmd(python, [Path.join(__DIR__, "numpy_matvec.py"), "#{rounds}" | args])
[["numpy", numpy_version] | rows] = out |> String.split("\n", trim: true) |> Enum.map(&String.split/1)
numpy = Map.new(rows, fn [s, t] -> {s, String.to_float(t) * 1_000_000} end)

ms = fn us -> fmt(us / 1000) end

q4 = Moat.Quantized.info(held[{"4-bit", 4096, 4096}])

packed = fn bits ->
  Moat.Quantized.packed_bytes({4096, 4096}, {:f, 32}, %{q4 | bits: bits})
end

IO.puts("### Quantized products (ms, median of #{rounds}; numpy #{numpy_version} in the same run)\n")

IO.puts(
  "x {M, K} · wᵀ, w {N, K} affine, group 64, #{Nx.Type.to_string(q4.scale_type)} scales " <>
    "(4-bit: #{fmt(packed.(4) * 8 / 4096 / 4096)} bits a weight, " <>
    "8-bit: #{fmt(packed.(8) * 8 / 4096 / 4096)}); Moat kernels #{info.cpu}.\n"
)

names = Enum.map(variants, &elem(&1, 0))
row(["M × K × N", "numpy f32"] ++ Enum.map(names, &"Moat #{&1}") ++ ["numpy / 4-bit", "numpy / 8-bit"])
row(["---" | List.duplicate("---:", length(names) + 3)])

for {m, k, n} = shape <- shapes do
  np = numpy["#{m}:#{k}:#{n}"]
  med = fn name -> if ts = times[{shape, name}], do: median(ts) end

  row(
    ["#{m} × #{k} × #{n}", ms.(np)] ++
      Enum.map(names, &if(t = med.(&1), do: ms.(t), else: "—")) ++ [ratio(np, med.("4-bit")), ratio(np, med.("8-bit"))]
  )
end

# The same one-row product reading a different weight each time, as a
# decode step's layers do: `spread` weights of 64 MiB in f32 (1.5 GiB by
# default), more than the last-level cache of the machines measured so far
# (32 MiB on an AMD EPYC VM, 480 MiB on an Intel Sapphire Rapids one), so the
# f32 product reads from memory where the repeated one above may read from
# cache.
spread = String.to_integer(System.get_env("MOAT_BENCH_SPREAD", "24"))
spread_ws = for i <- 1..spread, do: normal.(1000 + i, {4096, 4096})

spread_held =
  for {name, bits} <- [{"f32", nil}, {"4-bit", 4}, {"8-bit", 8}], into: %{} do
    {name, Enum.map(spread_ws, &if(bits, do: Moat.quantize(&1, bits: bits, group_size: 64), else: &1))}
  end

x1 = xs[{1, 4096, Moat.Worker}]

spread_times =
  for name <- ["f32", "4-bit", "8-bit"], into: %{} do
    ws = spread_held[name]
    for w <- ws, do: Nx.dot(x1, [1], w, [1]).data.ref |> Moat.eval()
    ts = for _ <- 1..rounds, w <- ws, do: time_us(fn -> Nx.dot(x1, [1], w, [1]).data.ref |> Moat.eval() end)
    {name, median(ts)}
  end

{out, 0} = System.cmd(python, [Path.join(__DIR__, "numpy_matvec.py"), "#{rounds}", "1:4096:4096:#{spread}"])
[_, [_, np_spread]] = out |> String.split("\n", trim: true) |> Enum.map(&String.split/1)
np_spread = String.to_float(np_spread) * 1_000_000

IO.puts(
  "\n1 × 4096 × 4096, a different weight each product (#{spread} weights in turn, " <>
    "#{spread * 64} MiB in f32), as a decode step reads its layers:\n"
)

row(["numpy f32", "Moat f32", "Moat 4-bit", "Moat 8-bit", "numpy / 4-bit", "numpy / 8-bit"])
row(List.duplicate("---:", 6))

row(
  [ms.(np_spread)] ++
    Enum.map(["f32", "4-bit", "8-bit"], &ms.(spread_times[&1])) ++
    [ratio(np_spread, spread_times["4-bit"]), ratio(np_spread, spread_times["8-bit"])]
)
