# What the writer's wake-up costs a cast then a call (docs/latency.md,
# "Batched writes, a cast then a call"): Nx.add + Nx.to_binary on a
# batch_writes worker and on the default one, in one VM, with the batching
# worker's writer free, then suspended (the call writes the queued add with
# its own frame; the first push's wake-up stays pending, so no other is
# sent), alternated in 6 rounds of 300 samples. Medians in µs.
# mix run -r bench/support.exs bench/batch_writer_held.exs
import Bench
{:ok, _} = Moat.Worker.start_link(name: :ab_on, batch_writes: true)
on = moat(f32(4, 1.5), {4}, :ab_on)
off = moat(f32(4, 1.5), {4})
writer = :sys.get_state(:ab_on).writer

rows = [
  {"on", fn -> on |> Nx.add(on) |> Nx.to_binary() end},
  {"off", fn -> off |> Nx.add(off) |> Nx.to_binary() end}
]

variants = [
  {"free", fn -> :ok end, fn -> :ok end},
  {"held", fn -> :erlang.suspend_process(writer) end, fn -> :erlang.resume_process(writer) end}
]

for {_, f} <- rows, _ <- 1..300, do: f.()

res =
  for _ <- 1..6, {v, pre, post} <- variants, {l, f} <- rows, reduce: %{} do
    acc ->
      pre.()
      for _ <- 1..50, do: f.()
      s = samples(300, f)
      post.()
      Map.update(acc, {v, l}, s, &(&1 ++ s))
  end

IO.puts(
  Enum.map_join(variants, "  ", fn {v, _, _} ->
    "writer #{v}: on #{fmt(median(res[{v, "on"}]))} off #{fmt(median(res[{v, "off"}]))}"
  end)
)
