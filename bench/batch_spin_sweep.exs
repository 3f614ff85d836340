# A cast then a call (Nx.add + Nx.to_binary) on a batch_writes worker and on
# the default one, in one VM, for several `config :moat, call_spin_us:`
# values in turn, 5 rounds of 200 samples each (docs/latency.md, "Batched
# writes, a cast then a call"). Medians in µs.
# mix run -r bench/support.exs bench/batch_spin_sweep.exs
import Bench
{:ok, _} = Moat.Worker.start_link(name: :ab_on, batch_writes: true)
on = moat(f32(4, 1.5), {4}, :ab_on)
off = moat(f32(4, 1.5), {4})

rows = [
  {"on", fn -> on |> Nx.add(on) |> Nx.to_binary() end},
  {"off", fn -> off |> Nx.add(off) |> Nx.to_binary() end}
]

spins = [0, 10, 25, 50, 100]
for {_, f} <- rows, _ <- 1..300, do: f.()

res =
  for _ <- 1..5, s <- spins, {l, f} <- rows, reduce: %{} do
    acc ->
      Application.put_env(:moat, :call_spin_us, s)
      for _ <- 1..50, do: f.()
      Map.update(acc, {s, l}, samples(200, f), &(&1 ++ samples(200, f)))
  end

IO.puts(
  Enum.map_join(spins, "  ", fn s ->
    "spin #{s}: on #{fmt(median(res[{s, "on"}]))} off #{fmt(median(res[{s, "off"}]))}"
  end)
)
