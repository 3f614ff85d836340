# What automatic release costs and how fast it is. Prints medians.
# Run with: mix run bench/release.exs
#
#   1. per-handle overhead: Moat.Handles.ref/2 (token, scope check, creator
#      announcement) against building the bare struct, and an Nx op end to end
#   2. release delay: garbage collection of the last holder -> id gone in the
#      worker, and an idle process's dropped handle -> gone (nudge)
#   3. the cost that grows with live tensors: for the finalizer NIF, the
#      destructors run during the collection that frees the handles (so the
#      collection is timed); for the pure-Erlang alternative (off-heap binary
#      tokens swept with process_info(self(), :binary)), one sweep
#   4. what the memory-pressure reports cost in a loop of 4 MiB temporaries

alias Moat.{Client, Ref}

defmodule Bench do
  def median(samples), do: samples |> Enum.sort() |> Enum.at(div(length(samples), 2))

  # Median microseconds per call of `fun` over `rounds` rounds of `n` calls.
  def per_call(n, rounds \\ 15, fun) do
    for _ <- 1..rounds do
      {us, _} = :timer.tc(fn -> for _ <- 1..n, do: fun.() end)
      us / n
    end
    |> median()
  end

  def forward(_event, _measurements, _metadata, pid), do: send(pid, :pressure)

  def us(x), do: :erlang.float_to_binary(x * 1.0, decimals: 3) <> " µs"
  def ms(x), do: :erlang.float_to_binary(x / 1000, decimals: 2) <> " ms"

  def alive?(conn, id) do
    Moat.shape(%Ref{
      worker: conn.name,
      generation: conn.generation,
      incarnation: conn.incarnation,
      owner: conn.owner,
      id: id,
      token: nil
    })

    true
  rescue
    Moat.Error -> false
  end
end

IO.puts("finalizer NIF loaded: #{Moat.Finalizer.loaded?()}\n")
conn = Client.conn(Moat.Worker)
f32 = fn v -> <<v::float-32-native>> end

# 1. Per-handle overhead. Tokens here name a sink process, not the releaser,
# so that the worker sees none of them.
sink = spawn(fn -> Stream.repeatedly(fn -> receive(do: (_ -> :ok)) end) |> Stream.run() end)
id = Client.new_id()

bare =
  Bench.per_call(10_000, fn ->
    %Ref{
      worker: conn.name,
      generation: conn.generation,
      incarnation: conn.incarnation,
      owner: conn.owner,
      id: id,
      token: nil
    }
  end)

ref = Bench.per_call(10_000, fn -> Moat.Handles.ref(%{conn | releaser: sink}, id) end)

# Making a token, and the collection that frees it (its destructor sends).
{create, collect} =
  for _ <- 1..15 do
    {_, mref} =
      spawn_monitor(fn ->
        {create, tokens} = :timer.tc(fn -> for i <- 1..10_000, do: Moat.Finalizer.new(sink, i) end)
        _ = length(tokens)
        tokens = nil
        _ = tokens
        {collect, _} = :timer.tc(fn -> :erlang.garbage_collect() end)
        exit({:done, create / 10_000, collect / 10_000})
      end)

    receive do: ({:DOWN, ^mref, _, _, {:done, c, g}} -> {c, g})
  end
  |> Enum.unzip()

# An op whose result is dropped at once: its release is part of its cost.
a = Nx.from_binary(:binary.copy(f32.(1.0), 16), :f32, backend: Moat.Backend)
Moat.memory_info()
sent = :atomics.get(conn.counters, 2)

op =
  for _ <- 1..15 do
    {us, _} = :timer.tc(fn -> Enum.each(1..2_000, fn _ -> Nx.add(a, a) end) end)
    us / 2_000
  end
  |> Bench.median()

Moat.memory_info()
release_frames = :atomics.get(conn.counters, 2) - sent - 30_001

IO.puts("""
1. per handle
   bare %Moat.Ref{}                         #{Bench.us(bare)}
   Moat.Handles.ref/2 (token and all)        #{Bench.us(ref)}
   token: made                              #{Bench.us(Bench.median(create))}
   token: freed by a collection (sends)     #{Bench.us(Bench.median(collect))}
   Nx.add/2 end to end, result dropped      #{Bench.us(op)}
   (30,000 results released in #{release_frames} :release frames)
""")

# 2. Release delay.
gc_delay =
  for _ <- 1..200 do
    t = Moat.from_binary(f32.(1.0), {1}, {:f, 32})
    %Ref{id: id} = t
    Moat.memory_info()
    _ = t
    t0 = System.monotonic_time(:microsecond)
    :erlang.garbage_collect()
    Stream.repeatedly(fn -> Moat.memory_info() && Bench.alive?(conn, id) end) |> Enum.find(&(!&1))
    System.monotonic_time(:microsecond) - t0
  end

nudge = Keyword.get(Application.get_all_env(:moat), :gc_nudge, 1_000)

idle_delay =
  for _ <- 1..3 do
    parent = self()

    pid =
      spawn(fn ->
        %Ref{id: id} = Moat.from_binary(f32.(1.0), {1}, {:f, 32})
        send(parent, {:made, id})
        receive do: (:exit -> :ok)
      end)

    id = receive do: ({:made, id} -> id)
    t0 = System.monotonic_time(:microsecond)
    Stream.repeatedly(fn -> Process.sleep(10) && Bench.alive?(conn, id) end) |> Enum.find(&(!&1))
    send(pid, :exit)
    System.monotonic_time(:microsecond) - t0
  end

IO.puts("""
2. release delay (median)
   collection of the holder -> released in the worker   #{Bench.ms(Bench.median(gc_delay))} (includes one memory_info round trip)
   idle holder, gc_nudge #{nudge} ms -> released           #{Bench.ms(Bench.median(idle_delay))}
""")

# 3. Cost that grows with the number of live tensors.
rows =
  for n <- [1_000, 10_000, 100_000] do
    gc =
      for _ <- 1..5 do
        {_, mref} =
          spawn_monitor(fn ->
            tokens = for i <- 1..n, do: Moat.Finalizer.new(sink, i)
            _ = length(tokens)
            tokens = nil
            _ = tokens
            {us, _} = :timer.tc(fn -> :erlang.garbage_collect() end)
            exit({:gc, us})
          end)

        receive do: ({:DOWN, ^mref, _, _, {:gc, us}} -> us)
      end

    sweep =
      for _ <- 1..5 do
        {_, mref} =
          spawn_monitor(fn ->
            tokens = for i <- 1..n, do: :binary.copy(<<i::64, 0::512>>)
            {us, info} = :timer.tc(fn -> :erlang.process_info(self(), :binary) end)
            {:binary, list} = info
            true = length(list) >= n and length(tokens) == n
            exit({:sweep, us})
          end)

        receive do: ({:DOWN, ^mref, _, _, {:sweep, us}} -> us)
      end

    {n, Bench.median(gc), Bench.median(sweep)}
  end

IO.puts("3. live tensors   a collection freeing that many   one sweep of that many")
IO.puts("                  finalizer tokens (paid once)     binary tokens (paid per sweep)")

for {n, gc, sweep} <- rows do
  IO.puts(
    "   #{String.pad_leading(Integer.to_string(n), 7)}        #{String.pad_leading(Bench.ms(gc), 10)}                   #{Bench.ms(sweep)}"
  )
end

# 4. Memory pressure in a loop of 4 MiB temporaries.
parent = self()
:telemetry.attach("bench-pressure", [:moat, :memory, :pressure], &Bench.forward/4, parent)
x = Nx.from_binary(:binary.copy(f32.(1.0), 1024 * 1024), :f32, backend: Moat.Backend)
Moat.reset_peak_memory()
{us, _} = :timer.tc(fn -> for _ <- 1..500, do: x |> Nx.multiply(x) |> Nx.sum() |> Nx.to_number() end)

pressures =
  Stream.repeatedly(fn -> receive(do: (:pressure -> 1), after: (0 -> nil)) end) |> Enum.take_while(& &1) |> length()

%{peak: peak} = Moat.memory_info()

IO.puts("""

4. 500 iterations of a 4 MiB temporary, never deallocated
   #{Bench.ms(us / 500)} per iteration, #{pressures} memory-pressure collections, peak #{div(peak, 1024 * 1024)} MiB
""")
