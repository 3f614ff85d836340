# Moat.Compiler against eager Moat, Nx.Defn.Evaluator on Moat and
# Nx.BinaryBackend: medians of call + readback (µs unless stated).
# Run with bin/bench (or: mix run -r bench/support.exs bench/compiler.exs).

defmodule Bench.Models do
  import Nx.Defn

  defdelegate mlp(x, w1, b1, w2, b2), to: Bench.MLP

  # The same MLP as plain Nx calls: eager on the default backend.
  def mlp_eager(x, w1, b1, w2, b2) do
    h = Nx.max(Nx.add(Nx.dot(x, w1), b1), 0)
    logits = Nx.add(Nx.dot(h, w2), b2)
    e = Nx.exp(Nx.subtract(logits, Nx.reduce_max(logits, axes: [1], keep_axes: true)))
    Nx.divide(e, Nx.sum(e, axes: [1], keep_axes: true))
  end

  def chain(x, n), do: Enum.reduce(1..n, x, fn _, acc -> Nx.add(Nx.multiply(acc, 0.5), 1.0) |> Nx.subtract(0.25) end)

  defn counter(x) do
    {_i, acc} =
      while {i = 0, acc = x}, i < 1000 do
        {i + 1, acc * 0.5 + 1}
      end

    acc
  end

  # The decoder block (bench/support.exs), plain Nx calls.
  defdelegate decoder(x, p), to: Bench.Decoder, as: :block

  # SMACOF multidimensional scaling (Guttman transform), as Scholar's MDS
  # iterates it: 300 iterations of a while loop over 100 points in 2-d.
  defn smacof(d, x0) do
    n = Nx.axis_size(d, 0)
    off_diagonal = 1 - Nx.eye(n)

    {_i, x, _d} =
      while {i = 0, x = x0, d}, i < 300 do
        diff = Nx.new_axis(x, 1) - Nx.new_axis(x, 0)
        dist = Nx.sqrt(Nx.sum(diff * diff, axes: [2]) + 1.0e-9)
        ratio = off_diagonal * d / dist
        b = Nx.eye(n) * Nx.new_axis(Nx.sum(ratio, axes: [1]), 1) - ratio
        {i + 1, Nx.dot(b, x) / n, d}
      end

    x
  end
end

alias Bench.Models, as: M

conn = Moat.Client.conn(Moat.Worker)
frames = fn -> :atomics.get(conn.counters, 2) end
jit = &Nx.Defn.jit(&1, compiler: Moat.Compiler)
eval = &Nx.Defn.jit(&1, compiler: Nx.Defn.Evaluator)
read = fn result -> Nx.to_binary(result) end
med = fn n, fun -> Bench.median(Bench.samples(n, fun)) end

binary = fn shape, seed ->
  Nx.with_default_backend(Nx.BinaryBackend, fn ->
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape)
    t
  end)
end

to_moat = &Nx.backend_copy(&1, Moat.Backend)

IO.puts("### Moat.Compiler (µs, medians of call + readback)\n")

shapes = [{32, 784}, {784, 256}, {256}, {256, 10}, {10}]
bin_args = shapes |> Enum.with_index() |> Enum.map(fn {s, i} -> binary.(s, i) end)
args = Enum.map(bin_args, to_moat)
jit_mlp = jit.(&M.mlp/5)
fused_mlp = Nx.Defn.jit(&M.mlp/5, compiler: Moat.Compiler, fuse: true)
eval_mlp = eval.(&M.mlp/5)
# The first fused call compiles its kernels (or finds them in the kernel cache).
read.(apply(fused_mlp, args))
reps = 300

# Interleaved rounds, so that the load of this shared VM hits every row alike.
rounds =
  for _ <- 1..3 do
    %{
      jit: med.(reps, fn -> read.(apply(jit_mlp, args)) end),
      fused: med.(reps, fn -> read.(apply(fused_mlp, args)) end),
      eager: Nx.with_default_backend(Moat.Backend, fn -> med.(reps, fn -> read.(apply(&M.mlp_eager/5, args)) end) end),
      evaluator: med.(reps, fn -> read.(apply(eval_mlp, args)) end)
    }
  end

best = fn key -> rounds |> Enum.map(& &1[key]) |> Enum.min() end

binary_mlp =
  Nx.with_default_backend(Nx.BinaryBackend, fn -> med.(3, fn -> read.(apply(eval_mlp, bin_args)) end) end)

IO.puts("2-layer MLP, batch 32, 784→256→10, relu, softmax (best of 3 rounds of #{reps} calls):\n")
Bench.row(["", "median", "vs jit"])
Bench.row(["---", "---:", "---:"])
Bench.row(["Moat.Compiler (jit)", Bench.fmt(best.(:jit)), "1×"])
Bench.row(["Moat.Compiler (jit, fuse: true)", Bench.fmt(best.(:fused)), Bench.ratio(best.(:fused), best.(:jit))])
Bench.row(["Moat eager (plain Nx calls)", Bench.fmt(best.(:eager)), Bench.ratio(best.(:eager), best.(:jit))])
Bench.row(["Nx.Defn.Evaluator on Moat", Bench.fmt(best.(:evaluator)), Bench.ratio(best.(:evaluator), best.(:jit))])
Bench.row(["Nx.Defn.Evaluator on Nx.BinaryBackend", Bench.fmt(binary_mlp), Bench.ratio(binary_mlp, best.(:jit))])

# The decoder block at sequence 1 (a decode step) and 128.
weight_shapes = Bench.Decoder.weight_shapes()

bin_weights =
  weight_shapes
  |> Enum.with_index()
  |> Map.new(fn {{k, s}, i} -> {k, Nx.multiply(binary.(s, 100 + i), 0.05)} end)

weights = Map.new(bin_weights, fn {k, t} -> {k, to_moat.(t)} end)
jit_block = jit.(&M.decoder/2)
fused_block = Nx.Defn.jit(&M.decoder/2, compiler: Moat.Compiler, fuse: true)

IO.puts("\nTransformer decoder block (d_model 512, 8 heads, causal attention, MLP 2048, sigmoid-GELU; ms):\n")
Bench.row(["sequence", "eager", "jit", "jit, fuse: true", "Nx.BinaryBackend", "jit vs eager", "fused vs eager"])
Bench.row(["---", "---:", "---:", "---:", "---:", "---:", "---:"])

for seq <- [1, 128] do
  bin_x = binary.({seq, 512}, 99)
  x = to_moat.(bin_x)
  read.(fused_block.(x, weights))
  n = if seq == 1, do: 100, else: 20

  block_rounds =
    for _ <- 1..3 do
      %{
        eager: Nx.with_default_backend(Moat.Backend, fn -> med.(n, fn -> read.(M.decoder(x, weights)) end) end),
        jit: med.(n, fn -> read.(jit_block.(x, weights)) end),
        fused: med.(n, fn -> read.(fused_block.(x, weights)) end)
      }
    end

  b = fn key -> block_rounds |> Enum.map(& &1[key]) |> Enum.min() end

  binary_block =
    if seq == 1,
      do:
        Nx.with_default_backend(Nx.BinaryBackend, fn ->
          Bench.fmt(med.(1, fn -> read.(M.decoder(bin_x, bin_weights)) end) / 1000)
        end),
      else: "–"

  Bench.row([
    "#{seq}",
    Bench.fmt(b.(:eager) / 1000),
    Bench.fmt(b.(:jit) / 1000),
    Bench.fmt(b.(:fused) / 1000),
    binary_block,
    Bench.ratio(b.(:eager), b.(:jit)),
    Bench.ratio(b.(:eager), b.(:fused))
  ])
end

tiny = Nx.backend_copy(Nx.tensor([1.0, 2.0, 3.0, 4.0]), Moat.Backend)
jit_chain = jit.(&M.chain(&1, 34))
fused_chain = Nx.Defn.jit(&M.chain(&1, 34), compiler: Moat.Compiler, fuse: true)
read.(fused_chain.(tiny))
jit_one = jit.(&Nx.add(&1, 1.0))

# Frames sent on the connection during one call; the least of 20, as the
# releaser process sends :release frames of its own now and then.
count_frames = fn fun ->
  Enum.min(
    for _ <- 1..20 do
      f0 = frames.()
      fun.()
      frames.() - f0
    end
  )
end

chain_frames = count_frames.(fn -> jit_chain.(tiny) end)
eager_frames = Nx.with_default_backend(Moat.Backend, fn -> count_frames.(fn -> M.chain(tiny, 34) end) end)
chain_jit = med.(500, fn -> read.(jit_chain.(tiny)) end)
chain_fused = med.(500, fn -> read.(fused_chain.(tiny)) end)
one_jit = med.(500, fn -> read.(jit_one.(tiny)) end)
chain_eager = Nx.with_default_backend(Moat.Backend, fn -> med.(500, fn -> read.(M.chain(tiny, 34)) end) end)
one_eager = Nx.with_default_backend(Moat.Backend, fn -> med.(500, fn -> read.(Nx.add(tiny, 1.0)) end) end)

IO.puts("\n102 element-wise ops on f32[4] (34 × multiply, add, subtract by scalars):\n")
Bench.row(["", "frames per call (a readback adds one)", "median", "one op, same path", "difference"])
Bench.row(["---", "---:", "---:", "---:", "---:"])

Bench.row([
  "Moat.Compiler (jit)",
  "#{chain_frames}",
  Bench.fmt(chain_jit),
  Bench.fmt(one_jit),
  Bench.fmt(chain_jit - one_jit)
])

Bench.row([
  "Moat.Compiler (jit, fuse: true)",
  "#{count_frames.(fn -> fused_chain.(tiny) end)}",
  Bench.fmt(chain_fused),
  Bench.fmt(one_jit),
  Bench.fmt(chain_fused - one_jit)
])

Bench.row([
  "Moat eager",
  "#{eager_frames}",
  Bench.fmt(chain_eager),
  Bench.fmt(one_eager),
  Bench.fmt(chain_eager - one_eager)
])

x4 = Nx.backend_copy(Nx.tensor([1.0, 2.0, 3.0, 4.0]), Moat.Backend)
jit_loop = jit.(&M.counter/1)
fused_loop = Nx.Defn.jit(&M.counter/1, compiler: Moat.Compiler, fuse: true)
read.(fused_loop.(x4))
eval_loop = eval.(&M.counter/1)
loop_jit = med.(20, fn -> read.(jit_loop.(x4)) end)
loop_fused = med.(20, fn -> read.(fused_loop.(x4)) end)
loop_eval = med.(5, fn -> read.(eval_loop.(x4)) end)

n = 100
points = binary.({n, 2}, 7)
diff = Nx.subtract(Nx.new_axis(points, 1), Nx.new_axis(points, 0))
d = Nx.sqrt(Nx.sum(Nx.multiply(diff, diff), axes: [2]))
x0 = binary.({n, 2}, 8)
jit_mds = jit.(&M.smacof/2)
fused_mds = Nx.Defn.jit(&M.smacof/2, compiler: Moat.Compiler, fuse: true)
{d_moat, x0_moat} = {to_moat.(d), to_moat.(x0)}
read.(fused_mds.(d_moat, x0_moat))
mds_jit = med.(5, fn -> read.(jit_mds.(to_moat.(d), to_moat.(x0))) end)
mds_fused = med.(5, fn -> read.(fused_mds.(d_moat, x0_moat)) end)
mds_binary = Nx.with_default_backend(Nx.BinaryBackend, fn -> med.(1, fn -> read.(eval.(&M.smacof/2).(d, x0)) end) end)

IO.puts("\nLoops (ms):\n")
Bench.row(["", "Moat.Compiler (jit)", "jit, fuse: true", "the other", "speed-up (unfused, fused)"])
Bench.row(["---", "---:", "---:", "---:", "---:"])

Bench.row([
  "while, 1000 iterations of a small body, vs Nx.Defn.Evaluator on Moat",
  Bench.fmt(loop_jit / 1000),
  Bench.fmt(loop_fused / 1000),
  Bench.fmt(loop_eval / 1000),
  Bench.ratio(loop_eval, loop_jit) <> ", " <> Bench.ratio(loop_eval, loop_fused)
])

Bench.row([
  "SMACOF MDS, 100 points, 300 iterations, vs Nx.Defn.Evaluator on Nx.BinaryBackend",
  Bench.fmt(mds_jit / 1000),
  Bench.fmt(mds_fused / 1000),
  Bench.fmt(mds_binary / 1000),
  Bench.ratio(mds_binary, mds_jit) <> ", " <> Bench.ratio(mds_binary, mds_fused)
])

# First calls. Lowering plus the worker's build of a structure it has not
# seen (its program ids are forgotten before each call, so each is a miss),
# then the same with the worker holding it; both with the first call and
# its readback.
templates = Enum.map(shapes, &Nx.template(&1, :f32))
forget = fn -> :ets.match_delete(Moat.Compiler.Cache, {{:program, :_, :_, :_}, :_, :_}) end

first_call = fn ->
  fun = Nx.Defn.compile(&M.mlp/5, templates, compiler: Moat.Compiler)
  read.(apply(fun, args))
end

miss = Bench.median(for _ <- 1..10, do: Bench.time_us(fn -> forget.() && first_call.() end))
hit = Bench.median(Bench.samples(10, first_call))
lowering = Bench.median(Bench.samples(10, fn -> Nx.Defn.compile(&M.mlp/5, templates, compiler: Moat.Compiler) end))

IO.puts(
  "\nFirst call of the MLP (ms: `Nx.Defn.compile/3` builds the graph, lowers it and defines its program; then one call and its readback):\n"
)

Bench.row(["", "median"])
Bench.row(["---", "---:"])
Bench.row(["a structure new to the worker (lowering, definition, call)", Bench.fmt(miss / 1000)])
Bench.row(["a structure the worker holds (lowering, call)", Bench.fmt(hit / 1000)])
Bench.row(["lowering alone (worker holds the program)", Bench.fmt(lowering / 1000)])
Bench.row(["a replay, for comparison", Bench.fmt(best.(:jit) / 1000)])

# Fused first calls: a worker whose kernel cache starts empty (cold: MLX
# runs g++), then a second worker on the same cache (warm).
cache = Path.join(System.tmp_dir!(), "moat-bench-kernels-#{System.unique_integer([:positive])}")

fused_first = fn name ->
  {:ok, _} = Moat.Worker.start_link(name: name, kernel_cache: cache)
  worker_args = Enum.map(bin_args, &Nx.backend_copy(&1, {Moat.Backend, worker: name}))

  time =
    Bench.time_us(fn ->
      fun = Nx.Defn.compile(&M.mlp/5, templates, compiler: Moat.Compiler, worker: name, fuse: true)
      read.(apply(fun, worker_args))
    end)

  GenServer.stop(name)
  time
end

cold = fused_first.(:bench_cold_kernels)
warm = fused_first.(:bench_warm_kernels)
File.rm_rf!(cache)
Bench.row(["fuse: true, empty kernel cache (MLX compiles the kernels with g++)", Bench.fmt(cold / 1000)])
Bench.row(["fuse: true, kernels cached by an earlier worker", Bench.fmt(warm / 1000)])
