# What `fuse: true` costs and saves, for Moat.Compiler's default: for each
# function, the first fused call on an empty kernel cache (MLX runs g++)
# and on a cache an earlier worker filled, the steady-state call unfused
# and fused, and how many calls repay the first fused call's extra cost.
# Medians of call + readback. Run: mix run -r bench/support.exs bench/fuse_default.exs

defmodule Bench.FuseModels do
  import Nx.Defn

  defdelegate mlp(x, w1, b1, w2, b2), to: Bench.MLP

  def chain(x), do: Enum.reduce(1..34, x, fn _, acc -> Nx.add(Nx.multiply(acc, 0.5), 1.0) |> Nx.subtract(0.25) end)

  defn counter(x) do
    {_i, acc} =
      while {i = 0, acc = x}, i < 1000 do
        {i + 1, acc * 0.5 + 1}
      end

    acc
  end
end

alias Bench.FuseModels, as: M

random = fn shape, seed ->
  Nx.with_default_backend(Nx.BinaryBackend, fn ->
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape)
    t
  end)
end

cases = [
  {"MLP 784→256→10, batch 32", &M.mlp/5,
   Enum.with_index([{32, 784}, {784, 256}, {256}, {256, 10}, {10}], fn s, i -> random.(s, i) end), 200},
  {"102 element-wise ops on f32[4]", &M.chain/1, [random.({4}, 1)], 300},
  {"while, 1000 iterations of a small body", &M.counter/1, [random.({4}, 2)], 10}
]

read = &Nx.to_binary/1

IO.puts("### fuse: true against fuse: false (ms; the last columns in calls)\n")

Bench.row([
  "",
  "first call, unfused",
  "first fused call, empty kernel cache",
  "first fused call, cached kernels",
  "call, unfused",
  "call, fused",
  "fused vs unfused",
  "calls to repay (empty cache)",
  "calls to repay (cached)"
])

Bench.row(["---" | List.duplicate("---:", 8)])

for {name, fun, bin_args, reps} <- cases do
  cache = Path.join(System.tmp_dir!(), "moat-fuse-bench-#{System.unique_integer([:positive])}")
  templates = Enum.map(bin_args, &Nx.to_template/1)

  # A fresh worker per measurement: nothing of the structure is held.
  run = fn worker, fuse, n ->
    {:ok, _} = Moat.Worker.start_link(name: worker, kernel_cache: cache)
    args = Enum.map(bin_args, &Nx.backend_copy(&1, {Moat.Backend, worker: worker}))
    compile = fn -> Nx.Defn.compile(fun, templates, compiler: Moat.Compiler, worker: worker, fuse: fuse) end
    first = Bench.time_us(fn -> read.(apply(compile.(), args)) end)
    compiled = compile.()
    steady = Bench.median(Bench.samples(n, fn -> read.(apply(compiled, args)) end))
    GenServer.stop(worker)
    {first, steady}
  end

  {first_plain, plain} = run.(:fuse_bench_plain, false, reps)
  {cold, _} = run.(:fuse_bench_cold, true, 1)
  {warm, fused} = run.(:fuse_bench_warm, true, reps)
  File.rm_rf!(cache)
  saved = plain - fused
  # 0: the first fused call already costs no more than the unfused one.
  repay = fn first -> if saved > 0, do: "#{max(0, round((first - first_plain) / saved))}", else: "never" end

  Bench.row([
    name,
    Bench.fmt(first_plain / 1000),
    Bench.fmt(cold / 1000),
    Bench.fmt(warm / 1000),
    Bench.fmt(plain / 1000),
    Bench.fmt(fused / 1000),
    Bench.ratio(plain, fused),
    repay.(cold),
    repay.(warm)
  ])
end
