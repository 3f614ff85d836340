# The worker's CPU kernels of the transcendentals (f32 and bf16, 1M
# elements), softmax of {8, 128, 128} and GELU of {128, 2048}, next to numpy
# in the same run, through each kernel set the CPU has (the default worker
# takes the widest), the scalar fallback and MLX's own kernels; `add` (MLX's own kernel) shows
# what any 1M-element op costs in the worker. Run
# with bin/bench (mix run -r bench/support.exs bench/kernels.exs). Each Moat
# time is the op plus an eval in the worker (no readback); medians of
# interleaved rounds; the machine is noisy, so compare ratios within one run.

import Bench

rounds = 30
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

workers = [Moat.Worker, :bench_scalar, :bench_mlx] ++ if(avx2?, do: [:bench_avx2], else: [])

runs =
  for worker <- workers,
      type <- [:f32, :bf16],
      type == :f32 or worker == Moat.Worker,
      do: {worker, type, inputs.(worker, type)}

time = fn f, data -> time_us(fn -> f.(data).data.ref |> Moat.eval() end) end
# Warm up, then interleave every case and run in each round.
for {_, f} <- cases, {_, _, data} <- runs, do: time.(f, data)

times =
  for _ <- 1..rounds, {name, f} <- cases, {worker, type, data} <- runs, reduce: %{} do
    acc ->
      t = time.(f, data)
      Map.update(acc, {name, worker, type}, [t], &[t | &1])
  end

python = System.get_env("MOAT_BENCH_PYTHON", "python3")
{out, 0} = System.cmd(python, [Path.join(__DIR__, "numpy_elementwise.py"), "#{rounds}"])
[["numpy", numpy_version] | rows] = out |> String.split("\n", trim: true) |> Enum.map(&String.split/1)
numpy = Map.new(rows, fn [k, s] -> {k, String.to_float(s) * 1_000_000} end)

ms = fn us -> fmt(us / 1000) end
IO.puts("### CPU kernels (ms, median of #{rounds}; numpy #{numpy_version} in the same run)\n")
IO.puts("1,048,576 elements; softmax of {8, 128, 128} over the last axis; GELU of {128, 2048}.\n")
avx2_head = if avx2?, do: ["Moat f32, avx2"], else: []

row(
  ["op", "Moat f32 (#{info.cpu})", "Moat bf16"] ++
    avx2_head ++ ["Moat f32, scalar", "MLX's own f32", "MLX / Moat", "numpy f32", "numpy / Moat"]
)

row(["---" | List.duplicate("---:", 7 + length(avx2_head))])

for {name, _} <- cases do
  m = median(times[{name, Moat.Worker, :f32}])
  np = numpy[name]
  avx2 = if avx2?, do: [ms.(median(times[{name, :bench_avx2, :f32}]))], else: []

  row(
    ["`#{name}`", ms.(m), ms.(median(times[{name, Moat.Worker, :bf16}]))] ++
      avx2 ++
      [
        ms.(median(times[{name, :bench_scalar, :f32}])),
        # MLX has no erfc: that worker runs the scalar kernel for it.
        if(name == "erfc", do: "—", else: ms.(median(times[{name, :bench_mlx, :f32}]))),
        if(name == "erfc", do: "—", else: ratio(median(times[{name, :bench_mlx, :f32}]), m)),
        if(np, do: ms.(np), else: "—"),
        if(np, do: ratio(np, m), else: "—")
      ]
  )
end
