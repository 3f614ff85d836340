# Ops on large tensors with MLX's large CPU buffers in memory files (the
# default, port/shim/alloc.cpp) and without (MOAT_BUFFER_FILES=0, MLX's own
# allocator), and with buffer files but no cache (`Moat.set_cache_limit(0)`),
# rep by rep in one run, beside another worker build named by
# MOAT_WORKER_B (docs/latency.md, "Zero-copy readbacks"):
#
#   MOAT_WORKER_B=/path/to/main/moat_port mix run -r bench/support.exs bench/zero_copy_ops.exs
import Bench

reps = String.to_integer(System.get_env("REPS", "9"))
System.put_env("MOAT_BUFFER_FILES", "0")
{:ok, _} = Moat.Worker.start_link(name: :ops_no_files)
System.delete_env("MOAT_BUFFER_FILES")

# Buffer files with no cache of freed ones (nor of MLX's).
{:ok, _} = Moat.Worker.start_link(name: :ops_no_cache)
Moat.set_cache_limit(0, :ops_no_cache)

workers =
  [
    {"buffer files (default)", Moat.Worker},
    {"buffer files, cache limit 0", :ops_no_cache},
    {"`MOAT_BUFFER_FILES=0`", :ops_no_files}
  ] ++
    case System.get_env("MOAT_WORKER_B") do
      nil ->
        []

      path ->
        {:ok, _} = Moat.Worker.start_link(name: :ops_b, worker_path: path)
        [{path, :ops_b}]
    end

bytes = 64 * 1024 * 1024
data = :binary.copy(<<1.0::float-32-native>>, div(bytes, 4))

cases = [
  # 8 ops, each a fresh 64 MiB output (the inputs' buffers free as it goes).
  {"chain of 4 × (add, exp) on f32[16M], eval",
   fn w ->
     x = Nx.from_binary(data, :f32, backend: {Moat.Backend, worker: w})
     :ok = Moat.eval(x.data.ref)

     time_us(fn ->
       y = Enum.reduce(1..4, x, fn _, y -> Nx.exp(Nx.add(y, -1.0)) end)
       :ok = Moat.eval(y.data.ref)
     end)
   end},
  {"one add on f32[16M], eval",
   fn w ->
     x = Nx.from_binary(data, :f32, backend: {Moat.Backend, worker: w})
     :ok = Moat.eval(x.data.ref)
     time_us(fn -> :ok = Moat.eval(Nx.add(x, 1.0).data.ref) end)
   end},
  {"upload 64 MiB (+ eval)",
   fn w ->
     time_us(fn -> :ok = Moat.eval(Moat.from_binary(data, {bytes}, {:u, 8}, worker: w)) end)
   end}
]

times =
  for _ <- 1..reps, {label, fun} <- cases, {_, w} <- workers, reduce: %{} do
    acc ->
      us = fun.(w)
      :erlang.garbage_collect()
      Map.update(acc, {label, w}, [us], &[us | &1])
  end

IO.puts("### Ops on 64 MiB (ms, medians of #{reps} reps)\n")
row(["" | Enum.map(workers, &elem(&1, 0))])
row(["---" | Enum.map(workers, fn _ -> "---:" end)])

for {label, _} <- cases do
  row([label | Enum.map(workers, fn {_, w} -> fmt(median(times[{label, w}]) / 1000) end)])
end
