# The foundation's numbers, all measured in one run: round-trip latency,
# fire-and-forget throughput, transfer bandwidth, and f32 matmul next to
# numpy, Nx.BinaryBackend and MLX's bundled reference BLAS. Run with
# bin/bench (mix run -r bench/support.exs bench/foundation.exs). Medians
# (p99 where it matters); the machine is noisy, so compare ratios within one
# run.

import Bench

info = Moat.Worker.info()
IO.puts("Moat worker: MLX #{info.mlx}, BLAS #{info.blas}, #{System.schedulers_online()} schedulers\n")

## Latency

small_moat = moat(f32(4, 1.5), {4})
small_bin = Nx.tensor([1.5, 1.5, 1.5, 1.5], backend: Nx.BinaryBackend)
conn = Moat.Client.conn(Moat.Worker)
for _ <- 1..200, do: small_moat |> Nx.add(small_moat) |> Nx.to_binary()

# The floor: a port that only echoes (cat copies {packet, 4} frames as they are).
cat = Port.open({:spawn_executable, System.find_executable("cat")}, [:binary, {:packet, 4}])

echo = fn ->
  Port.command(cat, "a small frame")
  receive do: ({^cat, {:data, _}} -> :ok)
end

for _ <- 1..200, do: echo.()
echoes = samples(5000, echo)
Port.close(cat)

sync = samples(5000, fn -> {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil) end)
moat_rt = samples(5000, fn -> small_moat |> Nx.add(small_moat) |> Nx.to_binary() end)
bin_rt = samples(5000, fn -> small_bin |> Nx.add(small_bin) |> Nx.to_binary() end)

IO.puts("### Round trip (µs)\n")
row(["", "median", "p99"])
row(["---", "---:", "---:"])
row(["bare port echo (`cat`): the floor on this machine", fmt(median(echoes)), fmt(percentile(echoes, 99))])
row(["protocol round trip (`:sync` call)", fmt(median(sync)), fmt(percentile(sync, 99))])
row(["Nx.add of f32[4] + Nx.to_binary, Moat", fmt(median(moat_rt)), fmt(percentile(moat_rt, 99))])
row(["the same on Nx.BinaryBackend", fmt(median(bin_rt)), fmt(percentile(bin_rt, 99))])

## Fire-and-forget throughput

n_ops = 100_000

# Sends a chain of n_ops adds, then a :sync barrier (every op is built in the
# worker), then reads the result (MLX evaluates the chain). Returns both times.
chain = fn send_one, start, read ->
  t0 = System.monotonic_time(:microsecond)
  last = Enum.reduce(1..n_ops, start, fn _, acc -> send_one.(acc) end)
  {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
  t1 = System.monotonic_time(:microsecond)
  read.(last)
  {t1 - t0, System.monotonic_time(:microsecond) - t1}
end

one = Moat.from_binary(f32(4, 1.0), {4}, {:f, 32})

# ids!/3 keeps the handles alive until the frame that reads them is sent
# (a collection while the cast waits for the window would release them).
raw_add = fn acc ->
  id = Moat.Client.new_id()
  Moat.Client.cast(conn, :add, [id], Moat.Handles.ids!(conn, [acc, one], :add), %{type: {:f, 32}})
  Moat.Handles.ref(conn, id)
end

nx_runs = for _ <- 1..3, do: chain.(&Nx.add(&1, small_moat), small_moat, &Nx.to_binary/1)
raw_runs = for _ <- 1..3, do: chain.(raw_add, one, &Moat.to_binary/1)

bin_ops =
  for _ <- 1..3, do: time_us(fn -> Enum.reduce(1..n_ops, small_bin, fn _, acc -> Nx.add(acc, small_bin) end) end)

dispatch = fn runs -> n_ops / (median(Enum.map(runs, &elem(&1, 0))) / 1_000_000) end
eval_us = fn runs -> median(Enum.map(runs, &elem(&1, 1))) / n_ops end

IO.puts("\n### Fire-and-forget ops (a chain of #{n_ops} adds of f32[4])\n")
row(["", "dispatch (ops/s, built in the worker)", "MLX evaluation of the chain (µs/op)"])
row(["---", "---:", "---:"])
row(["Nx.add on Moat.Backend", fmt(dispatch.(nx_runs)), fmt(eval_us.(nx_runs))])
row(["raw `Moat.Client.cast`", fmt(dispatch.(raw_runs)), fmt(eval_us.(raw_runs))])
row(["Nx.add on Nx.BinaryBackend (computed eagerly)", fmt(n_ops / (median(bin_ops) / 1_000_000)), "–"])

## Transfers

# The same sizes through the pipe and through shared memory (protocol.md §6),
# each from a worker of its own, alternating rep by rep so that both see the
# same machine. Uploads include the eval that waits for them; each sample
# then drops its tensor (so a shared-memory upload may reuse the file of the
# one before, as the pipe's reuses MLX's cached buffer).
{:ok, _} = Moat.Worker.start_link(name: :bench_pipe, shared_memory: false)
{:ok, _} = Moat.Worker.start_link(name: :bench_shared, shared_memory_threshold: 1)
paths = [pipe: :bench_pipe, shared_memory: :bench_shared]
true = Moat.Client.conn(:bench_shared).shared != nil

IO.puts("\n### Transfers (GB/s, 10⁹ bytes/s)\n")
IO.puts("Uploads are `Moat.from_binary` + `Moat.eval`; readbacks `Moat.to_binary` of an evaluated tensor.\n")
row(["size", "upload, pipe", "upload, shared memory", "readback, pipe", "readback, shared memory", "reps"])
row(["---", "---:", "---:", "---:", "---:", "---:"])

for {label, bytes, reps} <- [{"1 MB", 1_000_000, 50}, {"64 MB", 64_000_000, 5}, {"1.5 GiB", 1_610_612_736, 3}] do
  binary = :binary.copy(<<1, 2, 3, 4, 5, 6, 7, 8>>, div(bytes, 8))

  upload = fn worker ->
    time_us(fn ->
      ref = Moat.from_binary(binary, {bytes}, {:u, 8}, worker: worker)
      :ok = Moat.eval(ref)
      Moat.deallocate(ref)
    end)
  end

  ups = for _ <- 1..reps, {path, worker} <- paths, do: {path, upload.(worker)}

  refs = for {path, worker} <- paths, into: %{}, do: {path, Moat.from_binary(binary, {bytes}, {:u, 8}, worker: worker)}
  Enum.each(refs, fn {_, ref} -> :ok = Moat.eval(ref) end)
  read = fn path -> time_us(fn -> ^bytes = byte_size(Moat.to_binary(refs[path])) end) end
  downs = for _ <- 1..reps, {path, _} <- paths, do: {path, read.(path)}
  Enum.each(refs, fn {_, ref} -> Moat.deallocate(ref) end)

  gbps = fn samples, path -> fmt(bytes / (median(for {^path, us} <- samples, do: us) * 1000)) end
  cells = for samples <- [ups, downs], path <- [:pipe, :shared_memory], do: gbps.(samples, path)
  row([label | cells] ++ ["#{reps}"])
  :erlang.garbage_collect()
end

IO.puts("\nBy default tensors under 1 MiB take the pipe (`:shared_memory_threshold`), where it is faster.")
Enum.each(paths, fn {_, worker} -> GenServer.stop(worker) end)

## Matmul

python = System.get_env("MOAT_BENCH_PYTHON", "python3")
{out, 0} = System.cmd(python, [Path.join(__DIR__, "numpy_matmul.py"), "1024", "2048"])
[["numpy", numpy_version] | sizes] = out |> String.split("\n", trim: true) |> Enum.map(&String.split/1)
numpy = Map.new(sizes, fn [n, s] -> {String.to_integer(n), String.to_float(s)} end)

bundled_path = System.get_env("MOAT_BUNDLED_BLAS_WORKER")

bundled =
  if bundled_path && File.exists?(bundled_path) do
    {:ok, _} = Moat.Worker.start_link(name: :bundled_blas, worker_path: bundled_path)
    :bundled_blas
  end

gflops = fn n, us -> 2 * n * n * n / (us * 1000) end

matmul_us = fn worker, n, reps ->
  a = moat(f32(n * n, 0.5), {n, n}, worker)
  b = moat(f32(n * n, 0.25), {n, n}, worker)
  Moat.eval(Nx.dot(a, b).data.ref)
  median(samples(reps, fn -> Moat.eval(Nx.dot(a, b).data.ref) end))
end

binary_256 =
  median(
    samples(2, fn ->
      a = Nx.iota({256, 256}, type: :f32, backend: Nx.BinaryBackend)
      Nx.dot(a, a)
    end)
  )

IO.puts("\n### f32 matmul (GFLOP/s; numpy #{numpy_version} on the same machine)\n")
row(["n", "Moat (OpenBLAS)", "numpy", "Moat / numpy", "Moat, MLX's bundled BLAS", "Nx.BinaryBackend"])
row(["---", "---:", "---:", "---:", "---:", "---:"])

for n <- [1024, 2048] do
  moat_g = gflops.(n, matmul_us.(Moat.Worker, n, if(n == 1024, do: 10, else: 5)))
  numpy_g = gflops.(n, numpy[n] * 1_000_000)
  bundled_g = if bundled, do: fmt(gflops.(n, matmul_us.(bundled, n, 1))), else: "–"
  binary_g = if n == 1024, do: "#{fmt(gflops.(256, binary_256))} (at n = 256)", else: "–"
  row(["#{n}", fmt(moat_g), fmt(numpy_g), ratio(moat_g, numpy_g), bundled_g, binary_g])
end
