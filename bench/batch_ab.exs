# batch_writes on and off in one VM, interleaved round by round (docs/latency.md,
# "Batched writes, landed"): a worker with batch_writes: true and the
# default one (false), each with its own tensors. mix run -r bench/support.exs bench/batch_ab.exs
import Bench
{:ok, _} = Moat.Worker.start_link(name: :ab_on, batch_writes: true)
on = moat(f32(4, 1.5), {4}, :ab_on)
off = moat(f32(4, 1.5), {4})
c_on = Moat.Client.conn(:ab_on)
c_off = Moat.Client.conn(Moat.Worker)
true = c_on.outbox != nil and c_off.outbox == nil

rows = [
  {"add+tb on", fn -> on |> Nx.add(on) |> Nx.to_binary() end},
  {"add+tb off", fn -> off |> Nx.add(off) |> Nx.to_binary() end},
  {"sync on", fn -> {:ok, _, _} = Moat.Client.call(c_on, :sync, [], nil) end},
  {"sync off", fn -> {:ok, _, _} = Moat.Client.call(c_off, :sync, [], nil) end}
]

for {_, f} <- rows, _ <- 1..300, do: f.()

res =
  for _ <- 1..10,
      {l, f} <- rows,
      reduce: %{},
      do: (acc -> Map.update(acc, l, samples(200, f), &(&1 ++ samples(200, f))))

n = 20_000
chain = fn start -> Enum.reduce(1..n, start, fn _, acc -> Nx.add(acc, start) end) end

disp =
  for _ <- 1..7, {l, t, c} <- [{"disp on", on, c_on}, {"disp off", off, c_off}] do
    us = time_us(fn -> chain.(t) end)
    {:ok, _, _} = Moat.Client.call(c, :sync, [], nil)
    :erlang.garbage_collect()
    {l, us / n}
  end

d = Enum.group_by(disp, &elem(&1, 0), &elem(&1, 1))

IO.puts(
  Enum.map_join(rows, "  ", fn {l, _} -> "#{l}: #{fmt(median(res[l]))}" end) <>
    "  disp on: #{fmt(median(d["disp on"]))}  disp off: #{fmt(median(d["disp off"]))}"
)
