# The 64 MiB rows of bench/latency.exs alone, for large-readback work
# (docs/latency.md): a plain `:binary.copy` in the VM, a tensor's first
# readback, a repeated one, a repeated one with every byte read (copied),
# and an upload, all with shared memory on. With MOAT_WORKER_B set, a second
# worker runs that executable beside the default one, rep by rep, so two
# worker builds compare within one run:
#
#   MOAT_WORKER_B=/path/to/other/moat_port mix run -r bench/support.exs bench/readback.exs

import Bench

bytes = 64 * 1024 * 1024
reps = String.to_integer(System.get_env("REPS", "11"))

workers =
  case System.get_env("MOAT_WORKER_B") do
    nil ->
      [{"this worker", Moat.Worker}]

    path ->
      {:ok, _} = Moat.Worker.start_link(name: :readback_b, worker_path: path)
      [{"this worker", Moat.Worker}, {path, :readback_b}]
  end

data = :binary.copy(<<1, 2, 3, 4, 5, 6, 7, 8>>, div(bytes, 8))
held = for {_, w} <- workers, into: %{}, do: {w, Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)}
Enum.each(held, fn {_, ref} -> :ok = Moat.eval(ref) end)

first_readback = fn w ->
  fresh = Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)
  :ok = Moat.eval(fresh)
  us = time_us(fn -> ^bytes = byte_size(Moat.to_binary(fresh)) end)
  Moat.deallocate(fresh)
  us
end

measure = fn
  {:first_readback, w} -> first_readback.(w)
  {:readback, w} -> time_us(fn -> ^bytes = byte_size(Moat.to_binary(held[w])) end)
  {:readback_copy, w} -> time_us(fn -> ^bytes = byte_size(:binary.copy(Moat.to_binary(held[w]))) end)
  :vm_copy -> time_us(fn -> ^bytes = byte_size(:binary.copy(data)) end)
  {:upload, w} -> time_us(fn -> :ok = Moat.eval(Moat.from_binary(data, {bytes}, {:u, 8}, worker: w)) end)
end

cases =
  [:vm_copy] ++ for(kind <- [:first_readback, :readback, :readback_copy, :upload], {_, w} <- workers, do: {kind, w})

big =
  for _ <- 1..reps, c <- cases, reduce: %{} do
    acc ->
      us = measure.(c)
      :erlang.garbage_collect()
      Map.update(acc, c, [us], &[us | &1])
  end

gbps = fn c -> bytes / (median(big[c]) * 1000) end
vm_copy = gbps.(:vm_copy)

IO.puts("### 64 MiB (GB/s, medians of #{reps} reps)\n")
row(["", "first readback", "readback", "readback + copy", "vs a plain copy", "upload"])
row(["---", "---:", "---:", "---:", "---:", "---:"])

for {label, w} <- workers do
  copied = gbps.({:readback_copy, w})

  row([
    label,
    fmt(gbps.({:first_readback, w})),
    fmt(gbps.({:readback, w})),
    fmt(copied),
    ratio(copied, vm_copy),
    fmt(gbps.({:upload, w}))
  ])
end

row(["plain `:binary.copy` of 64 MiB", "–", "–", fmt(vm_copy), "1×", "–"])
