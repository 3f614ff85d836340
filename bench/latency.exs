# The eager path's latency (issue 13, docs/latency.md): what a small
# synchronous call costs against a bare port echo, what the caller pays per
# fire-and-forget op against Nx.BinaryBackend computing it, and large
# readbacks and uploads against a plain copy in the VM. Run with bin/bench
# (mix run -r bench/support.exs bench/latency.exs). Every row is measured in
# the same run, round by round (each round takes one batch of samples of
# every row), and reported as a median; compare ratios within one run.

import Bench

rounds = 10
per_round = 200

small_bin = Nx.tensor([1.5, 1.5, 1.5, 1.5], type: :f32, backend: Nx.BinaryBackend)
small = moat(f32(4, 1.5), {4})
evaluated = Nx.add(small, small)
Nx.to_binary(evaluated)
conn = Moat.Client.conn(Moat.Worker)

# The floor: a port that only echoes (cat copies {packet, 4} frames as they are).
cat = Port.open({:spawn_executable, System.find_executable("cat")}, [:binary, {:packet, 4}])

echo = fn ->
  Port.command(cat, "a small frame")
  receive do: ({^cat, {:data, _}} -> :ok)
end

calls = [
  {"bare port echo (`cat`): the floor", echo},
  {"`:sync` call", fn -> {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil) end},
  {"`Nx.to_binary` of an evaluated f32[4]", fn -> Nx.to_binary(evaluated) end},
  {"`Nx.add` of f32[4] + `Nx.to_binary`", fn -> small |> Nx.add(small) |> Nx.to_binary() end},
  {"`Nx.sum` of f32[4] + `Nx.to_number`", fn -> small |> Nx.sum() |> Nx.to_number() end},
  {"`inspect` of an evaluated f32[4]", fn -> inspect(evaluated) end},
  {"the add + `Nx.to_binary` on Nx.BinaryBackend", fn -> small_bin |> Nx.add(small_bin) |> Nx.to_binary() end}
]

for {_, f} <- calls, _ <- 1..per_round, do: f.()

latency =
  for _ <- 1..rounds, {label, f} <- calls, reduce: %{} do
    acc -> Map.update(acc, label, samples(per_round, f), &(&1 ++ samples(per_round, f)))
  end

Port.close(cat)
[{echo_label, _} | _] = calls
floor = median(latency[echo_label])

IO.puts("### Eager latency (µs; #{rounds} rounds of #{per_round} samples each)\n")
row(["", "median", "p90", "× echo"])
row(["---", "---:", "---:", "---:"])

for {label, _} <- calls do
  xs = latency[label]
  row([label, fmt(median(xs)), fmt(percentile(xs, 90)), ratio(median(xs), floor)])
end

## Dispatch

# The caller's time for a chain of adds (each op's handle, encoding and port
# write; its release comes later, on GC), then a barrier outside the timing
# so that no backlog carries into the next rep. Nx.BinaryBackend computes
# the same chain in the VM.
n_ops = 20_000
chain = fn start -> Enum.reduce(1..n_ops, start, fn _, acc -> Nx.add(acc, start) end) end

dispatch =
  for _ <- 1..9 do
    moat_us = time_us(fn -> chain.(small) end)
    {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
    :erlang.garbage_collect()
    {moat_us / n_ops, time_us(fn -> chain.(small_bin) end) / n_ops}
  end

{moat_op, bin_op} = {median(Enum.map(dispatch, &elem(&1, 0))), median(Enum.map(dispatch, &elem(&1, 1)))}

IO.puts("\n### Dispatch (µs per op, a chain of #{n_ops} `Nx.add` of f32[4], 9 reps)\n")
row(["", "median", "vs Nx.BinaryBackend"])
row(["---", "---:", "---:"])
row(["fire-and-forget `Nx.add` on Moat (the caller's cost)", fmt(moat_op), ratio(moat_op, bin_op)])
row(["the same add computed by Nx.BinaryBackend", fmt(bin_op), "1×"])

## 64 MiB

# The default worker (shared memory from 1 MiB: readbacks copied out of the
# worker's memory into the VM's), one that reads back through sealed files
# (mapped as binaries, kept for the tensor's next readback) and a pipe-only
# one, rep by rep, beside a plain copy of a binary made in the VM.
reps = 7
{:ok, _} = Moat.Worker.start_link(name: :latency_sealed, shared_memory: :sealed_files)
{:ok, _} = Moat.Worker.start_link(name: :latency_pipe, shared_memory: false)

workers = [
  {"default (shared memory)", Moat.Worker},
  {"`shared_memory: :sealed_files`", :latency_sealed},
  {"pipe only", :latency_pipe}
]

big = Bench.Transfers.measure(workers, reps)

IO.puts("\n### 64 MiB (GB/s, 10⁹ bytes/s; #{reps} reps)\n")
Bench.Transfers.table(workers, big)
GenServer.stop(:latency_pipe)
GenServer.stop(:latency_sealed)
