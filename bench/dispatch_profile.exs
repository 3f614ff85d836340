# Where a fire-and-forget op's time goes (docs/latency.md, "Dispatch, where
# the rest goes"). The chain of bench/latency.exs (20,000 `Nx.add`s of an
# f32[4]) on Moat, rep by rep beside Nx.BinaryBackend's, and for each Moat
# rep: the wall time, the CPU time of this VM and of the worker (from
# /proc), their context switches, the caller's garbage collections, how
# many times the caller waited for the window, the releaser's and the
# owner's reductions, and the VM's microstate accounting (:msacc).
#
#   mix run -r bench/support.exs bench/dispatch_profile.exs           # the table
#   mix run -r bench/support.exs bench/dispatch_profile.exs loop SECS # chains for SECS s (for perf)

defmodule Profile.NullBackend do
  @moduledoc false
  defstruct []
  def add(out, _a, _b), do: %{out | data: %__MODULE__{}}
end

defmodule DispatchProfile do
  import Bench

  @n 20_000

  def main(["loop", secs | fake?]) do
    {small, _bin, conn} = setup()

    small =
      case fake? do
        ["fake"] -> elem(fake(small, conn, :fake_loop, dummy_releaser()), 0)
        ["spin"] -> elem(fake(small, conn, :fake_loop, dummy_releaser(), {"/tmp/dsink/spin_sink", []}), 0)
        [] -> small
      end

    deadline = System.monotonic_time(:millisecond) + String.to_integer(secs) * 1000
    IO.puts("beam #{System.pid()} worker #{conn.info.os_pid}")
    loop(small, conn, deadline, 0)
  end

  # Two workers in one VM, chain by chain: this tree's default worker and a
  # second one of binary BASE (with `release_coalesce_ms: MS` when given).
  def main(["ab", base | coalesce]) do
    {small, bin, conn} = setup()
    coalesce = Enum.map(coalesce, &String.to_integer/1)
    opts = if coalesce == [], do: [], else: [release_coalesce_ms: hd(coalesce)]
    {:ok, _} = Moat.Worker.start_link([name: :dispatch_base, worker_path: base] ++ opts)
    base_small = moat(f32(4, 1.5), {4}, :dispatch_base)
    base_conn = Moat.Client.conn(:dispatch_base)
    count_calls()
    reps = String.to_integer(System.get_env("REPS", "9"))
    cases = [{"base", base_small, base_conn}, {"this tree", small, conn}, {"Nx.BinaryBackend", bin, nil}]
    for {_, t, _} <- cases, do: chain(t)

    results =
      for _ <- 1..reps, {label, t, c} <- cases, reduce: %{} do
        acc ->
          :erlang.garbage_collect()
          {:call_count, a0} = :erlang.trace_info({Moat.Client, :record_ack, 2}, :call_count)
          {b0, w0} = {proc(System.pid()).cpu, if(c, do: proc(c.info.os_pid).cpu, else: 0)}
          us = time_us(fn -> chain(t) end) / @n
          # The releases and acks of the chain, before the CPU is read again.
          if c, do: {:ok, _, _} = Moat.Client.call(c, :sync, [], nil)
          {b1, w1} = {proc(System.pid()).cpu, if(c, do: proc(c.info.os_pid).cpu, else: 0)}
          {:call_count, a1} = :erlang.trace_info({Moat.Client, :record_ack, 2}, :call_count)
          x = {us, a1 - a0, (b1 - b0) / 1000 / @n, (w1 - w0) / 1000 / @n}
          Map.update(acc, label, [x], &[x | &1])
      end

    bb = median(Enum.map(results["Nx.BinaryBackend"], &elem(&1, 0)))

    row([
      "chain of #{@n} `Nx.add` f32[4] (#{reps} reps)",
      "µs per op",
      "× BB",
      "acks per chain",
      "VM CPU µs/op",
      "worker CPU µs/op",
      "per rep (µs)"
    ])

    row(["---", "---:", "---:", "---:", "---:", "---:", "---"])

    for {label, _, _} <- cases do
      xs = Enum.reverse(results[label])
      m = fn i -> median(Enum.map(xs, &elem(&1, i))) end
      us = m.(0)

      row([
        label,
        fmt(us),
        ratio(us, bb),
        "#{m.(1)}",
        fmt(m.(2)),
        fmt(m.(3)),
        Enum.map_join(xs, " ", &fmt(elem(&1, 0)))
      ])
    end
  end

  def main(["split"]) do
    {small, bin, conn} = setup()
    {fake_small, _} = fake(small, conn, :fake_cat, dummy_releaser())
    spin_sink = System.get_env("SPIN_SINK", "/tmp/dsink/spin_sink")
    {fake_small2, _} = fake(small, conn, :fake_spin, dummy_releaser(), {spin_sink, []})

    null =
      Nx.tensor([1.5, 1.5, 1.5, 1.5], type: :f32, backend: Nx.BinaryBackend)
      |> then(&%{&1 | data: %Profile.NullBackend{}})

    reps = String.to_integer(System.get_env("REPS", "9"))

    cases = [
      {"Moat, the real worker", small},
      {"Moat, no worker: frames to `cat > /dev/null` (a reader that sleeps)", fake_small},
      {"Moat, no worker: frames to bench/spin_sink.c (a reader that never sleeps)", fake_small2},
      {"Nx.BinaryBackend", bin},
      {"a backend whose add does nothing (Nx's front end)", null}
    ]

    spin_pid = fake_small2 |> then(& &1.data.ref.worker) |> Moat.Client.conn() |> then(&Port.info(&1.port)[:os_pid])
    signal = fn sig -> System.cmd("kill", ["-#{sig}", "#{spin_pid}"]) end
    for {_, t} <- cases, do: chain(t)
    signal.("STOP")

    results =
      for _ <- 1..reps, {label, t} <- cases, reduce: %{} do
        acc ->
          :erlang.garbage_collect()
          if t == fake_small2, do: signal.("CONT")
          us = time_us(fn -> chain(t) end) / @n
          if t == fake_small2, do: signal.("STOP")
          {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
          Map.update(acc, label, [us], &[us | &1])
      end

    # Let the sink see its input close (it holds this VM's stdout).
    signal.("CONT")
    System.cmd("kill", ["#{spin_pid}"])
    bb = median(results["Nx.BinaryBackend"])
    row(["chain of #{@n} `Nx.add` f32[4], µs per op (#{reps} reps)", "median", "× BB", "per rep"])
    row(["---", "---:", "---:", "---"])

    for {label, _} <- cases do
      xs = Enum.reverse(results[label])
      row([label, fmt(median(xs)), ratio(median(xs), bb), Enum.map_join(xs, " ", &fmt/1)])
    end
  end

  def main(_) do
    {small, bin, conn} = setup()
    count_calls()
    reps = String.to_integer(System.get_env("REPS", "9"))
    rows = for _ <- 1..reps, do: rep(small, bin, conn)
    report(rows)
  end

  # A connection like `conn` whose frames go to `cat > /dev/null` (a port
  # owned by another process, as the worker's is), with no window, and
  # whose tokens go to `releaser`: Moat's client side without the worker.
  defp fake(small, conn, name, releaser, program \\ {"/bin/sh", ["-c", "exec cat <&3 > /dev/null"]}) do
    {path, args} = program
    me = self()

    holder =
      spawn(fn ->
        port = Port.open({:spawn_executable, path}, [:binary, {:packet, 4}, :nouse_stdio, args: args])
        send(me, {:port, port})
        Process.sleep(:infinity)
      end)

    port = receive do: ({:port, p} -> p)
    _ = holder

    fake = %{
      conn
      | name: name,
        port: port,
        window: 1_000_000_000,
        counters: Moat.Client.new_counters(),
        releaser: releaser,
        outbox: nil
    }

    :persistent_term.put({Moat.Client, name}, fake)
    %Nx.Tensor{data: %Moat.Backend{ref: ref} = data} = small
    {%{small | data: %{data | ref: %{ref | worker: name}}}, releaser}
  end

  defp dummy_releaser do
    spawn(fn -> dummy_loop() end)
  end

  defp dummy_loop do
    receive do
      {:moat_released} -> drain_all()
      _ -> :ok
    end

    dummy_loop()
  end

  defp drain_all do
    case Moat.Finalizer.drain(self()) do
      [] -> :ok
      _ -> drain_all()
    end
  end

  defp loop(small, conn, deadline, k) do
    if System.monotonic_time(:millisecond) < deadline do
      chain(small)
      {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
      :erlang.garbage_collect()
      loop(small, conn, deadline, k + 1)
    else
      IO.puts("#{k} chains")
    end
  end

  defp setup do
    small = moat(f32(4, 1.5), {4})
    bin = Nx.tensor([1.5, 1.5, 1.5, 1.5], type: :f32, backend: Nx.BinaryBackend)
    conn = Moat.Client.conn(Moat.Worker)
    for _ <- 1..3, do: chain(small)
    {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
    chain(bin)
    {small, bin, conn}
  end

  defp chain(start), do: Enum.reduce(1..@n, start, fn _, acc -> Nx.add(acc, start) end)

  defp rep(small, bin, conn) do
    wpid = conn.info.os_pid
    owner = conn.owner
    releaser = conn.releaser
    me = self()
    :erlang.garbage_collect()
    w0 = proc(wpid)
    b0 = proc(System.pid())
    {g0, rw0, _} = :erlang.statistics(:garbage_collection)
    {:reductions, r0} = Process.info(releaser, :reductions)
    {:reductions, o0} = Process.info(owner, :reductions)
    waits0 = waits(owner)
    :erlang.system_flag(:microstate_accounting, :reset)
    :erlang.system_flag(:microstate_accounting, true)
    t0 = System.monotonic_time(:nanosecond)
    chain(small)
    t1 = System.monotonic_time(:nanosecond)
    :erlang.system_flag(:microstate_accounting, false)
    msacc = :erlang.statistics(:microstate_accounting)
    {g1, rw1, _} = :erlang.statistics(:garbage_collection)
    {:heap_size, heap} = Process.info(me, :heap_size)
    b1 = proc(System.pid())
    w1 = proc(wpid)
    {:reductions, r1} = Process.info(releaser, :reductions)
    {:reductions, o1} = Process.info(owner, :reductions)
    waits1 = waits(owner)
    {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil)
    :erlang.garbage_collect()
    bin_us = time_us(fn -> chain(bin) end)

    %{
      wall: (t1 - t0) / 1000 / @n,
      bb: bin_us / @n,
      beam_cpu: (b1.cpu - b0.cpu) / 1000 / @n,
      worker_cpu: (w1.cpu - w0.cpu) / 1000 / @n,
      beam_cs: (b1.cs - b0.cs) / @n,
      worker_cs: (w1.cs - w0.cs) / @n,
      worker_threads: threads(w0, w1, "worker"),
      beam_threads: threads(b0, b1, "beam"),
      minor_gcs: g1 - g0,
      words_reclaimed: rw1 - rw0,
      heap_size: heap,
      releaser_reds: r1 - r0,
      owner_reds: o1 - o0,
      waits: waits1.waits - waits0.waits,
      counts: Map.new(waits1, fn {k, v} -> {k, v - waits0[k]} end),
      msacc: msacc
    }
  end

  # How many times callers waited for the window: the owner's {:await_ack}
  # calls (each is a message to it); read off its message counter.
  @counted [
    waits: {Moat.Worker, :handle_call, 3},
    acks: {Moat.Client, :record_ack, 2},
    owner_msgs: {Moat.Worker, :handle_info, 2},
    releaser_msgs: {Moat.Releaser, :handle_info, 2},
    release_frames: {Moat.Releaser, :send_batch, 1},
    drains: {Moat.Finalizer, :drain, 1}
  ]

  def count_calls do
    for {_, mfa} <- @counted, do: :erlang.trace_pattern(mfa, true, [:call_count])
  end

  defp waits(_owner) do
    Map.new(@counted, fn {k, mfa} ->
      {:call_count, n} = :erlang.trace_info(mfa, :call_count)
      {k, n || 0}
    end)
  end

  defp threads(p0, p1, who) do
    Map.new(p1.threads, fn {tid, {name, cpu, cs, wait}} ->
      {_, c0, s0, w0} = Map.get(p0.threads, tid, {name, 0, 0, 0})
      {"#{who} #{name}/#{tid}", {(cpu - c0) / 1000 / @n, (cs - s0) / @n, (wait - w0) / 1000 / @n}}
    end)
  end

  defp proc(pid) do
    pid = to_string(pid)

    threads =
      for tid <- File.ls!("/proc/#{pid}/task"), into: %{} do
        {tid, thread("/proc/#{pid}/task/#{tid}")}
      end

    {cpu, cs} =
      Enum.reduce(threads, {0, 0}, fn {_, {_, c, s, _}}, {a, b} -> {a + c, b + s} end)

    %{cpu: cpu, cs: cs, threads: threads}
  end

  # {name, CPU ns, context switches (voluntary + involuntary)}
  defp thread(dir) do
    with {:ok, stat} <- File.read(dir <> "/stat"),
         {:ok, status} <- File.read(dir <> "/status"),
         {:ok, sched} <- File.read(dir <> "/schedstat") do
      [name_part, _rest] = :binary.split(stat, ") ")
      name = name_part |> :binary.split("(") |> List.last()
      # schedstat: ns on the CPU, ns waiting for one, timeslices
      [on_cpu, waiting | _] = String.split(sched, " ")

      cs =
        for line <- String.split(status, "\n"),
            String.contains?(line, "ctxt_switches"),
            reduce: 0 do
          acc -> acc + String.to_integer(String.trim(List.last(String.split(line, ":"))))
        end

      {name, String.to_integer(on_cpu), cs, String.to_integer(waiting)}
    else
      _ -> {"?", 0, 0, 0}
    end
  end

  defp report(rows) do
    med = fn key -> median(Enum.map(rows, &Map.fetch!(&1, key))) end
    IO.puts("### The chain, #{length(rows)} reps (medians; per op)\n")
    row(["", "median", "per rep"])
    row(["---", "---:", "---"])

    for {label, key} <- [
          {"wall µs, Moat", :wall},
          {"wall µs, Nx.BinaryBackend", :bb},
          {"BEAM CPU µs", :beam_cpu},
          {"worker CPU µs", :worker_cpu},
          {"BEAM context switches", :beam_cs},
          {"worker context switches", :worker_cs}
        ] do
      row([label, fmt(med.(key)), Enum.map_join(rows, " ", &fmt(Map.fetch!(&1, key)))])
    end

    for key <- [:waits, :minor_gcs, :words_reclaimed, :heap_size, :releaser_reds, :owner_reds] do
      row(["#{key} per chain", "#{med.(key)}", Enum.map_join(rows, " ", &"#{Map.fetch!(&1, key)}")])
    end

    IO.puts("\nper chain: " <> Enum.map_join(Enum.sort(List.last(rows).counts), ", ", fn {k, v} -> "#{k} #{v}" end))
    IO.puts("\n### Threads (per op: CPU µs, context switches, µs runnable but waiting for a CPU; medians)\n")
    last = List.last(rows)
    row(["thread", "CPU µs", "switches", "run-queue wait µs"])
    row(["---", "---:", "---:", "---:"])

    for k <- Enum.sort(Map.keys(Map.merge(last.worker_threads, last.beam_threads))) do
      per = Enum.map(rows, &(Map.merge(&1.worker_threads, &1.beam_threads)[k] || {0, 0, 0}))

      {cpu, cs, wait} =
        {median(Enum.map(per, &elem(&1, 0))), median(Enum.map(per, &elem(&1, 1))), median(Enum.map(per, &elem(&1, 2)))}

      if cpu > 0.005 or cs > 0.001, do: row([k, fmt(cpu), :erlang.float_to_binary(cs / 1, decimals: 4), fmt(wait)])
    end

    IO.puts("\n### msacc (scheduler threads, last rep; µs per op)\n")

    for %{type: type, id: id, counters: c} <- last.msacc, type == :scheduler do
      c = Map.new(c, fn {k, v} -> {k, :erlang.convert_time_unit(v, :perf_counter, :nanosecond) / 1000} end)
      total = Enum.sum(Map.values(c))

      parts =
        c
        |> Enum.filter(fn {_, v} -> v / total > 0.005 end)
        |> Enum.sort_by(fn {_, v} -> -v end)
        |> Enum.map_join(", ", fn {state, v} -> "#{state} #{fmt(v / @n)}" end)

      IO.puts("scheduler #{id}: #{parts}")
    end
  end
end

DispatchProfile.main(System.argv())
