# bench/readback.exs's pass for one worker (Bench.Transfers.measure's rows,
# in its order), with the readback + copy row split into its two halves and
# three extra rows right after the first readback + copy (docs/latency.md,
# "Readback plus copy: where the rest goes"): a 16-byte readback from an idle
# second worker, then two from this one. SETTLE=<ms> sleeps before the
# readback + copy row; SETTLE=full settles every row right before its timing
# (`Bench.Transfers.settle/1`, as bench/readback.exs does), so the 16-byte
# readbacks show whether anything was left to land on them.
#
#   REPS=15 mix run -r bench/support.exs bench/readback_split.exs
#   REPS=15 SETTLE=full mix run -r bench/support.exs bench/readback_split.exs

reps = String.to_integer(System.get_env("REPS", "15"))
full = System.get_env("SETTLE") == "full"
settle = if full, do: 0, else: String.to_integer(System.get_env("SETTLE", "0"))
bytes = 64 * 1024 * 1024
data = :binary.copy(<<1, 2, 3, 4, 5, 6, 7, 8>>, div(bytes, 8))
w = Moat.Worker
{:ok, _} = Moat.Worker.start_link(name: :readback_split_other)
pre = fn -> if full, do: Bench.Transfers.settle(w) end

us = fn f ->
  pre.()
  Bench.time_us(f)
end

small = fn worker ->
  t = Moat.from_binary(<<1::32, 2::32, 3::32, 4::32>>, {4}, {:f, 32}, worker: worker)
  :ok = Moat.eval(t)
  t
end

{other, mine} = {small.(:readback_split_other), small.(w)}

first_computed = fn read ->
  x = Nx.from_binary(data, :f32, backend: {Moat.Backend, worker: w})
  %Nx.Tensor{data: %Moat.Backend{ref: ref}} = y = Nx.multiply(x, 2.0)
  :ok = Moat.eval(ref)
  t = us.(fn -> ^bytes = byte_size(read.(Moat.to_binary(ref))) end)
  Nx.backend_deallocate(x)
  Nx.backend_deallocate(y)
  t
end

held = Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)
:ok = Moat.eval(held)

kinds = [
  vm_copy: fn -> us.(fn -> ^bytes = byte_size(:binary.copy(data)) end) end,
  first_readback: fn ->
    fresh = Moat.from_binary(data, {div(bytes, 4)}, {:f, 32}, worker: w)
    :ok = Moat.eval(fresh)
    t = us.(fn -> ^bytes = byte_size(Moat.to_binary(fresh)) end)
    Moat.deallocate(fresh)
    t
  end,
  first_computed: fn -> first_computed.(& &1) end,
  first_computed_copy: fn -> first_computed.(&:binary.copy/1) end,
  small_other_worker: fn -> us.(fn -> Moat.to_binary(other) end) end,
  small: fn -> us.(fn -> Moat.to_binary(mine) end) end,
  small_again: fn -> us.(fn -> Moat.to_binary(mine) end) end,
  readback: fn -> us.(fn -> ^bytes = byte_size(Moat.to_binary(held)) end) end,
  readback_copy: fn ->
    if settle > 0, do: Process.sleep(settle)
    pre.()
    t0 = System.monotonic_time(:nanosecond)
    b = Moat.to_binary(held)
    t1 = System.monotonic_time(:nanosecond)
    ^bytes = byte_size(:binary.copy(b))
    t2 = System.monotonic_time(:nanosecond)
    Process.put(:halves, [{(t1 - t0) / 1000, (t2 - t1) / 1000} | Process.get(:halves, [])])
    (t2 - t0) / 1000
  end,
  upload: fn -> us.(fn -> :ok = Moat.eval(Moat.from_binary(data, {bytes}, {:u, 8}, worker: w)) end) end
]

times =
  for _ <- 1..reps, {kind, f} <- kinds, reduce: %{} do
    acc ->
      t = f.()
      :erlang.garbage_collect()
      Map.update(acc, kind, [t], &[t | &1])
  end

base = Bench.median(times[:vm_copy])
IO.puts("medians of #{reps} reps, SETTLE=#{System.get_env("SETTLE", "0")}\n")
Bench.row(["row", "µs", "× the plain copy's time"])
Bench.row(["---", "---:", "---:"])

for {kind, _} <- kinds do
  m = Bench.median(times[kind])
  Bench.row(["#{kind}", Bench.fmt(m), Bench.fmt(base / m)])
end

halves = Process.get(:halves)
Bench.row(["readback + copy: the readback", Bench.fmt(Bench.median(Enum.map(halves, &elem(&1, 0)))), ""])
Bench.row(["readback + copy: the copy", Bench.fmt(Bench.median(Enum.map(halves, &elem(&1, 1)))), ""])
