# The hop-by-hop profile of docs/latency.md. Three modes (that document has
# the exact commands):
#
#   paths              wall medians of each path (a bare echo, an echo relayed
#                      through a process as Moat.Worker relays replies, a
#                      worker port owned by the caller, the Moat path); with
#                      MOAT_TRACE=1 in the environment every worker stamps its
#                      hops on stderr and this run writes the caller's stamps
#                      to $MOAT_STAMPS (default /tmp/moat_stamps.bin)
#   join STDERR_LOG    joins those stamps into the hop table
#   dispatch           the caller's cost of each part of a fire-and-forget op
#   frontend           Moat.Backend's front end of a fire-and-forget `Nx.add`,
#                      step by step (each step alone, 20,000 in a row,
#                      round by round beside Nx.BinaryBackend's add)
#   eprof              where a chain of fire-and-forget `Nx.add`s spends the
#                      caller's time, function by function (:eprof; its own
#                      overhead inflates every row: read the shares)
#   ab BEFORE AFTER    two worker binaries side by side in one VM: paired wall
#                      medians, and per call the worker's CPU time and context
#                      switches (from /proc, which load does not move much)

# A backend whose add returns its output template: Nx's own front end alone.
defmodule Profile.NullBackend do
  @moduledoc false
  defstruct []
  def add(out, _a, _b), do: %{out | data: %__MODULE__{}}
end

# The least a backend behind a pipe with release on GC can do per op: an
# id, a finalizer token, the frame's encoding and its write (a port command,
# or a push into a batch outbox). No checks, no scopes, no window: a floor
# for Moat.Backend's dispatch, not a backend (docs/latency.md, "The floor
# of a dispatch").
defmodule Profile.FloorBackend do
  @moduledoc false
  defstruct [:conn, :id, :token]

  def add(out, %{data: %__MODULE__{conn: c, id: a}}, %{data: %__MODULE__{id: b}}) do
    id = :erlang.unique_integer([:positive, :monotonic])
    token = Moat.Finalizer.new(c.releaser, id)
    frame = Moat.Protocol.request(0, c.generation, :add, [id], [a, b], %{type: out.type})
    write(c, frame)
    %{out | data: %__MODULE__{conn: c, id: id, token: token}}
  end

  defp write(%{outbox: nil, port: port}, frame), do: Port.command(port, frame)
  defp write(%{outbox: outbox}, frame), do: :ok = Moat.Finalizer.outbox_push(outbox, frame)

  # A tensor of `conn`'s worker that stands for Moat tensor `t` (kept alive by the caller).
  def wrap(%{data: %Moat.Backend{ref: ref}} = t, conn), do: %{t | data: %__MODULE__{conn: conn, id: ref.id}}
end

defmodule Profile do
  import Bench

  @stamps System.get_env("MOAT_STAMPS", "/tmp/moat_stamps.bin")

  def main(["join", log]), do: join(log)
  def main(["ab", before, after_]), do: ab(before, after_)
  def main(["dispatch"]), do: dispatch()
  def main(["eprof"]), do: eprof()
  def main(["frontend"]), do: frontend()
  def main(_), do: paths()

  ## paths

  defp paths do
    trace? = System.get_env("MOAT_TRACE") == "1"
    conn = Moat.Client.conn(Moat.Worker)
    path = System.get_env("MOAT_WORKER") || Application.app_dir(:moat, "priv/moat_port")
    direct = direct_port(path, conn.generation)
    # Seqs of the caller's own port start high, to tell its stamps apart.
    seqs = :counters.new(1, [])
    :counters.put(seqs, 1, 1_000_000_000)
    stamps = :ets.new(:stamps, [:public, :bag])
    small = moat(f32(4, 1.5), {4})
    evaluated = Nx.add(small, small)
    Nx.to_binary(evaluated)
    moat_seq = fn -> :atomics.get(conn.counters, 1) + 1 end
    direct_seq = fn -> :counters.get(seqs, 1) + 1 end

    timed = fn label, next_seq, fun ->
      fn ->
        seq = next_seq.()
        t0 = :os.system_time(:nanosecond)
        fun.()
        if trace?, do: :ets.insert(stamps, {label, seq, t0, :os.system_time(:nanosecond)})
      end
    end

    direct_add = fn ->
      id = Moat.Client.new_id()
      Port.command(direct, request(conn.generation, 0, :add, [id], [1, 1], %{type: {:f, 32}}))
      direct_call(direct, seqs, conn.generation, :to_binary, [id])
      Port.command(direct, request(conn.generation, 0, :release, [], [id], nil))
    end

    variants = [
      {"echo, `cat` owned by the caller", echo(self())},
      {"echo, `cat` owned by a relay process", echo(relay())},
      {"`:sync`, worker port owned by the caller",
       timed.(:direct_sync, direct_seq, fn -> direct_call(direct, seqs, conn.generation, :sync, []) end)},
      {"`:sync`, Moat.Client.call",
       timed.(:moat_sync, moat_seq, fn -> {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil) end)},
      {"readback f32[4], worker port owned by the caller",
       timed.(:direct_readback, direct_seq, fn -> direct_call(direct, seqs, conn.generation, :to_binary, [2]) end)},
      {"readback f32[4], Nx.to_binary", timed.(:moat_readback, moat_seq, fn -> Nx.to_binary(evaluated) end)},
      {"add + readback, worker port owned by the caller", timed.(:direct_add_readback, direct_seq, direct_add)},
      {"add + readback, Nx", timed.(:moat_add_readback, moat_seq, fn -> small |> Nx.add(small) |> Nx.to_binary() end)}
    ]

    for {_, f} <- variants, _ <- 1..200, do: f.()
    :ets.delete_all_objects(stamps)
    rounds = String.to_integer(System.get_env("PROFILE_ROUNDS", "10"))

    results =
      for _ <- 1..rounds, {name, f} <- variants, reduce: %{} do
        acc -> Map.update(acc, name, samples(200, f), &(&1 ++ samples(200, f)))
      end

    row(["path", "median µs", "p90 µs"])
    row(["---", "---:", "---:"])
    for {name, _} <- variants, do: row([name, fmt(median(results[name])), fmt(percentile(results[name], 90))])
    if trace?, do: File.write!(@stamps, :erlang.term_to_binary(:ets.tab2list(stamps)))
  end

  defp echo(owner) do
    port = if owner == self(), do: cat(), else: owner
    me = self()

    fn ->
      Port.command(port, "a small frame")

      receive do
        {^port, {:data, _}} -> :ok
        {:relayed, ^me} -> :ok
      end
    end
  end

  defp cat, do: Port.open({:spawn_executable, System.find_executable("cat")}, [:binary, {:packet, 4}])

  # A `cat` port owned by another process, which forwards each frame.
  defp relay do
    me = self()

    spawn_link(fn ->
      port = cat()
      send(me, {:relay_port, port})
      relay_loop(port, me)
    end)

    receive do: ({:relay_port, port} -> port)
  end

  defp relay_loop(port, to) do
    receive do: ({^port, {:data, _}} -> send(to, {:relayed, to}))
    relay_loop(port, to)
  end

  # A worker of the caller's own, holding tensor 1 (f32[4]) and 2 (1 + 1, evaluated).
  defp direct_port(path, generation) do
    env = if System.get_env("MOAT_TRACE") == "1", do: [{~c"MOAT_TRACE", ~c"1"}], else: []
    args = ["--generation", "#{generation}"]
    port = Port.open({:spawn_executable, path}, [:binary, {:packet, 4}, :nouse_stdio, {:env, env}, {:args, args}])
    receive do: ({^port, {:data, _hello}} -> :ok)
    attrs = %{bytes: 16, dtype: {:f, 32}, shape: [4]}
    Port.command(port, request(generation, 0, :from_binary, [1], [], attrs, f32(4, 1.5)))
    Port.command(port, request(generation, 0, :add, [2], [1, 1], %{type: {:f, 32}}))
    seqs = :counters.new(1, [])
    direct_call(port, seqs, generation, :to_binary, [2])
    port
  end

  defp request(generation, seq, op, outs, ins, attrs, payload \\ []),
    do: Moat.Protocol.request(seq, generation, op, outs, ins, attrs, payload)

  defp direct_call(port, seqs, generation, op, ins) do
    :counters.add(seqs, 1, 1)
    seq = :counters.get(seqs, 1)
    Port.command(port, request(generation, seq, op, [], ins, nil))
    await(port, seq)
  end

  # The reply to seq; acks are dropped.
  defp await(port, seq) do
    receive do
      {^port, {:data, <<len::32, header::binary-size(len), _::binary>>}} ->
        case :erlang.binary_to_term(header) do
          {:ok, ^seq, _} -> :ok
          _ -> await(port, seq)
        end
    end
  end

  ## join

  defp join(log) do
    worker =
      for line <- File.stream!(log), String.starts_with?(line, "T "), reduce: %{} do
        acc ->
          [_, stage, seq, t] = String.split(line)
          {seq, t} = {String.to_integer(seq), String.to_integer(t)}
          Map.update(acc, seq, %{stage => t}, &Map.put(&1, stage, t))
      end

    stamps = :erlang.binary_to_term(File.read!(@stamps))

    hops = [
      {"caller sends → reader has decoded the frame", fn {t0, w, _} -> w["R"] - t0 end},
      {"reader → session thread (channel wake-up)", fn {_, w, _} -> w["S"] - w["R"] end},
      {"session: the request, up to its reply handed off", fn {_, w, _} -> w["W"] - w["S"] end},
      {"  of which MLX eval and metadata", fn {_, w, _} -> w["E"] && w["E"] - w["S"] end},
      {"reply handed off → caller has it", fn {_, w, t1} -> t1 - w["W"] end},
      {"total", fn {t0, _, t1} -> t1 - t0 end}
    ]

    for label <- stamps |> Enum.map(&elem(&1, 0)) |> Enum.uniq() do
      rows = for {^label, seq, t0, t1} <- stamps, w = worker[seq], w["R"] && w["S"] && w["W"], do: {t0, w, t1}
      IO.puts("\n#{label} (#{length(rows)} traced calls; medians, µs)\n")
      row(["hop", "µs"])
      row(["---", "---:"])

      for {name, f} <- hops, xs = rows |> Enum.map(f) |> Enum.reject(&is_nil/1), xs != [] do
        row([name, fmt(median(xs) / 1000)])
      end
    end
  end

  ## dispatch

  defp dispatch do
    small = moat(f32(4, 1.5), {4})
    one = small.data.ref
    conn = Moat.Client.conn(Moat.Worker)
    n = 20_000
    bin = Nx.tensor([1.5, 1.5, 1.5, 1.5], type: :f32, backend: Nx.BinaryBackend)
    frame = fn -> Moat.Protocol.request(0, conn.generation, :add, [123], [1, 2], %{type: {:f, 32}}) end

    parts = [
      {"`Moat.Client.new_id/0`", fn -> Moat.Client.new_id() end},
      {"`Moat.Finalizer.new/2` (and the token's destructor, at GC)", fn -> Moat.Finalizer.new(conn.releaser, 1) end},
      {"`Moat.Handles.ref/2` (Finalizer.new and the checks around it)",
       fn -> Moat.Handles.ref(conn, Moat.Client.new_id()) end},
      {"`Moat.Handles.ids!/3` of two handles", fn -> Moat.Handles.ids!(conn, [one, one], :add) end},
      {"`Moat.Protocol.request/7`: encoding an add's frame", frame},
      {"`Port.command/2` of a `:sync` cast (seq 0: no reply)", fn -> Moat.Client.cast(conn, :sync, [], [], nil) end},
      {"all of a raw add: new_id, ids!, ref, cast", fn -> raw_add(conn, one) end},
      {"a chain of `Nx.add` on Nx.BinaryBackend (bench/latency.exs)", chain(bin)},
      {"a chain of `Nx.add` on Moat.Backend (bench/latency.exs)", chain(small)},
      {"`Nx.add` on Moat.Backend", fn -> Nx.add(small, small) end},
      {"`Nx.add` on Nx.BinaryBackend", fn -> Nx.add(bin, bin) end}
    ]

    row(["part (#{n} in a row, median of 5)", "µs each"])
    row(["---", "---:"])

    for {label, f} <- parts do
      each = median(for _ <- 1..5, do: time_us(fn -> for _ <- 1..n, do: f.() end) / n)
      {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
      :erlang.garbage_collect()
      row([label, fmt(each)])
    end
  end

  # What Moat.Backend's add sends, without the backend: new_id, ids!, ref, cast.
  defp raw_add(conn, one) do
    id = Moat.Client.new_id()
    Moat.Client.cast(conn, :add, [id], Moat.Handles.ids!(conn, [one, one], :add), %{type: {:f, 32}})
    Moat.Handles.ref(conn, id)
  end

  ## frontend

  # Each step of Moat.Backend's path for `Nx.add(a, b)` of two f32[4], timed
  # alone (public functions only, so that the same script measures an older
  # tree). Rows are cumulative where they say so: "callback" is
  # `Moat.Backend.add/3` called directly (no Nx front end), "Nx.add" all of
  # it. Round by round, so that load moves every row alike.
  defp frontend do
    small = moat(f32(4, 1.5), {4})
    one = small.data.ref
    conn = Moat.Client.conn(Moat.Worker)
    out = %{small | data: nil}
    bin = Nx.tensor([1.5, 1.5, 1.5, 1.5], type: :f32, backend: Nx.BinaryBackend)
    bout = %{bin | data: nil}
    n = 20_000
    rounds = String.to_integer(System.get_env("PROFILE_ROUNDS", "9"))

    null = %{bin | data: %Profile.NullBackend{}}
    {:ok, _} = Moat.Worker.start_link(name: :profile_batched, batch_writes: true)
    batched = moat(f32(4, 1.5), {4}, :profile_batched)
    floor = Profile.FloorBackend.wrap(small, conn)
    floor_batched = Profile.FloorBackend.wrap(batched, Moat.Client.conn(:profile_batched))

    parts = [
      {"`Nx.add` on a backend whose add does nothing: Nx's front end", fn -> Nx.add(null, null) end},
      {"`Nx.add` on Nx.BinaryBackend", fn -> Nx.add(bin, bin) end},
      {"`Nx.BinaryBackend.add/3` (no Nx front end)", fn -> Nx.BinaryBackend.add(bout, bin, bin) end},
      {"a chain of `Nx.add` on Nx.BinaryBackend (bench/latency.exs)", chain(bin)},
      {"a chain of `Nx.add` on Moat.Backend (bench/latency.exs)", chain(small)},
      {"a chain of `Nx.add` on Moat.Backend, `batch_writes: true`", chain(batched)},
      {"a chain on the floor backend: id, token, encoding, `Port.command/2`", chain(floor)},
      {"a chain on the floor backend: id, token, encoding, outbox push", chain(floor_batched)},
      {"`Nx.add` on Moat.Backend", fn -> Nx.add(small, small) end},
      {"`Moat.Backend.add/3` (no Nx front end)", fn -> Moat.Backend.add(out, small, small) end},
      {"raw add: new_id, ids!, ref, cast", fn -> raw_add(conn, one) end},
      {"`Moat.Client.cast/5` of a `:sync` (admit, encode, Port.command)",
       fn -> Moat.Client.cast(conn, :sync, [], [], nil) end},
      {"`Moat.Protocol.request/7`: encoding an add's frame",
       fn -> Moat.Protocol.request(0, conn.generation, :add, [123], [1, 2], %{type: {:f, 32}}) end},
      {"`Moat.Handles.ref/2`", fn -> Moat.Handles.ref(conn, Moat.Client.new_id()) end},
      {"`Moat.Finalizer.new/2` (and the token's destructor, at GC)", fn -> Moat.Finalizer.new(conn.releaser, 1) end},
      {"`Moat.Handles.ids!/3` of two handles", fn -> Moat.Handles.ids!(conn, [one, one], :add) end},
      {"`Moat.Quantized.any?/1` of two inputs", fn -> Moat.Quantized.any?([small, small]) end},
      {"`Moat.Types.route/3`", fn -> Moat.Types.route(:add, out, [small, small]) end},
      {"`Moat.Compiler.Recorder.active?/0`", fn -> Moat.Compiler.Recorder.active?() end},
      {"`Moat.Client.conn/1`", fn -> Moat.Client.conn(Moat.Worker) end},
      {"`Moat.check_type!/1`", fn -> Moat.check_type!({:f, 32}) end},
      {"the loop itself (an empty fn)", fn -> :ok end}
    ]

    for {_, f} <- parts, do: run_n(f, 2_000)

    vm = System.pid()

    results =
      for _ <- 1..rounds, {label, f} <- parts, reduce: %{} do
        acc ->
          cpu0 = cpu_ns(vm)
          each = time_us(fn -> run_n(f, n) end) / n
          cpu1 = cpu_ns(vm)
          {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
          {:ok, _, _} = Moat.Client.call(Moat.Client.conn(:profile_batched), :sync, [], nil)
          :erlang.garbage_collect()
          Map.update(acc, label, [{each, (cpu1 - cpu0) / n / 1000}], &[{each, (cpu1 - cpu0) / n / 1000} | &1])
      end

    # Results are dropped as they come (a `for` would hold 20,000 of them,
    # and every garbage collection would copy them). The VM's CPU time (every thread of its OS process, from /proc) is what
    # the caller spent, whatever else the machine runs (the worker included).
    row(["step (#{n} in a row, median of #{rounds} rounds)", "wall µs each", "VM CPU µs each"])
    row(["---", "---:", "---:"])

    for {label, _} <- parts do
      xs = results[label]
      row([label, fmt(median(Enum.map(xs, &elem(&1, 0)))), fmt(median(Enum.map(xs, &elem(&1, 1))))])
    end
  end

  # bench/latency.exs's chain, n long: acc = Nx.add(acc, start).
  defp chain(start), do: {:n, fn n -> Enum.reduce(1..n, start, fn _, acc -> Nx.add(acc, start) end) end}

  defp run_n({:n, f}, n), do: f.(n)
  defp run_n(f, n), do: repeat(n, f)

  defp repeat(0, _f), do: :ok

  defp repeat(n, f) do
    f.()
    repeat(n - 1, f)
  end

  ## eprof

  defp eprof do
    Mix.ensure_application!(:tools)
    small = moat(f32(4, 1.5), {4})
    conn = Moat.Client.conn(Moat.Worker)
    chain = fn n -> Enum.reduce(1..n, small, fn _, acc -> Nx.add(acc, small) end) end
    chain.(2_000)
    {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
    :eprof.start()
    :eprof.profile([], fn -> chain.(20_000) && :ok end)
    :eprof.analyze(:total, sort: :time)
  end

  ## ab

  defp ab(before, after_) do
    {:ok, _} = Moat.Worker.start_link(name: :profile_a, worker_path: before)
    {:ok, _} = Moat.Worker.start_link(name: :profile_b, worker_path: after_)
    {pa, a} = calls(:profile_a)
    {pb, b} = calls(:profile_b)
    n = String.to_integer(System.get_env("PROFILE_N", "3000"))
    IO.puts("A = #{before}, B = #{after_}\n")
    row(["call", "wall µs A", "B", "worker CPU µs/call A", "B", "worker context switches/call A", "B"])
    row(["---", "---:", "---:", "---:", "---:", "---:", "---:"])

    for {{k, fa}, {k, fb}} <- Enum.zip(a, b) do
      for _ <- 1..200, do: {fa.(), fb.()}
      costs = for r <- 1..6, do: if(rem(r, 2) == 0, do: {:a, cost(pa, n, fa)}, else: {:b, cost(pb, n, fb)})
      # Blocks of 200 calls, alternating: a worker's threads spin for a
      # while after each frame (port/src/spin.rs), so calls paired one by
      # one would have each worker spinning while the other serves.
      blocks = for i <- 1..div(n, 200), do: {samples(200, if(rem(i, 2) == 0, do: fa, else: fb)), rem(i, 2) == 0}
      {xs, ys} = {for({s, true} <- blocks, do: s), for({s, false} <- blocks, do: s)}
      m = fn side, i -> fmt(median(for {^side, c} <- costs, do: elem(c, i))) end
      row([k, fmt(median(List.flatten(xs))), fmt(median(List.flatten(ys))), m.(:a, 0), m.(:b, 0), m.(:a, 1), m.(:b, 1)])
    end
  end

  defp calls(worker) do
    conn = Moat.Client.conn(worker)
    small = moat(f32(4, 1.5), {4}, worker)
    evaluated = Nx.add(small, small)
    Nx.to_binary(evaluated)

    cat = Port.open({:spawn_executable, System.find_executable("cat")}, [:binary, {:packet, 4}])

    echo = fn ->
      Port.command(cat, "a small frame")
      receive do: ({^cat, {:data, _}} -> :ok)
    end

    {conn.info.os_pid,
     [
       {"bare port echo (`cat`; the same on both sides)", echo},
       {"`:sync`", fn -> {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil) end},
       {"readback f32[4]", fn -> Nx.to_binary(evaluated) end},
       {"add + readback", fn -> small |> Nx.add(small) |> Nx.to_binary() end},
       {"sum + `Nx.to_number`", fn -> small |> Nx.sum() |> Nx.to_number() end}
     ]}
  end

  # Per call: the worker's CPU µs (schedstat) and context switches, summed
  # over its threads.
  defp cost(os_pid, n, fun) do
    {c0, s0} = snap(os_pid)
    for _ <- 1..n, do: fun.()
    {c1, s1} = snap(os_pid)
    {(c1 - c0) / n / 1000, (s1 - s0) / n}
  end

  defp snap(os_pid) do
    for tid <- File.ls!("/proc/#{os_pid}/task"), reduce: {0, 0} do
      {cpu, switches} ->
        [run | _] = String.split(File.read!("/proc/#{os_pid}/task/#{tid}/schedstat"))
        status = File.read!("/proc/#{os_pid}/task/#{tid}/status")
        counts = for [_, n] <- Regex.scan(~r/ctxt_switches:\s+(\d+)/, status), do: String.to_integer(n)
        {cpu + String.to_integer(run), switches + Enum.sum(counts)}
    end
  end
end

Profile.main(System.argv())
