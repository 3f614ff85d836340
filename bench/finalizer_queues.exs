# Finalizer.new/2 with 5,001 releaser queues, the oldest one's (as after many
# worker restarts: each start adds a releaser; docs/latency.md, "Tokens after many restarts").
#
#   mix run bench/finalizer_queues.exs
sink = spawn(fn -> Process.sleep(:infinity) end)
_ = Moat.Finalizer.new(sink, 0)
pids = for _ <- 1..5000, do: spawn(fn -> Process.sleep(:infinity) end)
Enum.each(pids, &Moat.Finalizer.new(&1, 0))
:erlang.garbage_collect()

for _ <- 1..3 do
  {us, toks} = :timer.tc(fn -> for i <- 1..20_000, do: Moat.Finalizer.new(sink, i) end)
  Enum.each(toks, &Moat.Finalizer.release/1)
  IO.puts("Finalizer.new with 5001 queues, the oldest's releaser: #{Float.round(us / 20_000, 3)} us")
end
