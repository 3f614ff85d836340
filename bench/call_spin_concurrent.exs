# Many callers at once with `call_spin_us` 50 and 0 in turn (docs/latency.md,
# "The caller waits awake"): 8 processes, each 2,000 `Nx.to_binary` of its
# own evaluated f32[4]; wall time per call, 6 alternating rounds.
#
#   mix run -r bench/support.exs bench/call_spin_concurrent.exs
t = fn ->
  parent = self()

  {us, _} =
    :timer.tc(fn ->
      for i <- 1..8 do
        spawn_link(fn ->
          x0 = Nx.tensor([i * 1.0, 2.0, 3.0, 4.0], backend: Moat.Backend)
          x = Nx.add(x0, x0)
          for _ <- 1..2000, do: Nx.to_binary(x)
          send(parent, :done)
        end)
      end

      for _ <- 1..8, do: receive(do: (:done -> :ok))
    end)

  us / 16000
end

for _ <- 1..6, v <- [50, 0] do
  Application.put_env(:moat, :call_spin_us, v)
  t.()
  IO.puts("spin #{v}: #{Float.round(t.(), 2)} us per call (wall, 8 callers)")
end
