# Phases of back-to-back small calls, for a system-wide scheduling trace
# (docs/latency.md, "A small readback, on the scheduler timeline"): a bare
# echo, `:sync`, a raw `:to_binary` call, `Nx.to_binary` of an evaluated
# f32[4], and `Nx.add` + `Nx.to_binary`. Run with
#
#   mix run -r bench/support.exs bench/sched_timeline.exs
#
# Each phase is TL_N calls (default 2000) in TL_ROUNDS rounds (default 1).
# Per phase it prints the wall median and p90 and, from /proc (no tracer
# needed), per call: the voluntary context switches of the worker's session
# thread and of the VM's scheduler threads, and the CPUs each ran on at the
# phase's end. With TL_CTL naming a perf control fifo (`perf record -D -1
# --control fifo:...`), it enables perf around the phases; each phase's
# bounds are marked by a write to the trace_marker file of that length
# (200 + 2i begins phase i, 201 + 2i ends it), which a syscall trace shows
# as writev's return value (bench/sched_timeline.py reads both).

import Bench

n = String.to_integer(System.get_env("TL_N", "2000"))
rounds = String.to_integer(System.get_env("TL_ROUNDS", "1"))

marker =
  case File.open("/sys/kernel/tracing/trace_marker", [:write, :raw]) do
    {:ok, f} -> f
    _ -> nil
  end

mark = fn s -> if marker, do: :ok = :file.write(marker, s) end
ctl = System.get_env("TL_CTL") && File.open!(System.get_env("TL_CTL"), [:write, :raw])

perf = fn cmd ->
  if ctl do
    :ok = :file.write(ctl, cmd <> "\n")
    Process.sleep(200)
  end
end

small = moat(f32(4, 1.5), {4})
evaluated = Nx.add(small, small)
Nx.to_binary(evaluated)
conn = Moat.Client.conn(Moat.Worker)
id = evaluated.data.ref.id
cat = Port.open({:spawn_executable, System.find_executable("cat")}, [:binary, {:packet, 4}])

echo = fn ->
  Port.command(cat, "a small frame")
  receive do: ({^cat, {:data, _}} -> :ok)
end

# Threads to watch: the worker's session thread (its main thread) and the
# VM's normal schedulers.
%{os_pid: worker} = Moat.Worker.info(Moat.Worker)
vm = System.pid()

threads = fn pid, keep ->
  for dir <- Path.wildcard("/proc/#{pid}/task/*"),
      name = String.trim(File.read!(Path.join(dir, "comm"))),
      keep.(name),
      do: {name, dir}
end

watched = [{"session", "/proc/#{worker}/task/#{worker}"} | threads.(vm, &Regex.match?(~r/^\d+_scheduler$/, &1))]

counters = fn ->
  for {name, dir} <- watched, into: %{} do
    status = File.read!(Path.join(dir, "status"))
    [_, vol] = Regex.run(~r/voluntary_ctxt_switches:\s+(\d+)/, status)
    [_, invol] = Regex.run(~r/nonvoluntary_ctxt_switches:\s+(\d+)/, status)
    stat = File.read!(Path.join(dir, "stat"))
    [_, rest] = String.split(stat, ") ", parts: 2)
    cpu = rest |> String.split() |> Enum.at(36)
    {name, {String.to_integer(vol), String.to_integer(invol), cpu}}
  end
end

phases = [
  {"echo", echo},
  {"sync", fn -> {:ok, _, _} = Moat.Client.call(conn, :sync, [], nil) end},
  {"raw_to_binary", fn -> {:ok, _, _} = Moat.Client.call(conn, :to_binary, [id], nil) end},
  {"nx_to_binary", fn -> Nx.to_binary(evaluated) end},
  {"add_to_binary", fn -> small |> Nx.add(small) |> Nx.to_binary() end}
]

for {_, f} <- phases, _ <- 1..300, do: f.()
perf.("enable")

results =
  for r <- 1..rounds, {{label, f}, i} <- Enum.with_index(phases), reduce: %{} do
    acc ->
      mark.(String.pad_trailing("TL begin #{label} #{r}", 200 + 2 * i))
      before = counters.()
      xs = samples(div(n, rounds), f)
      now = counters.()
      mark.(String.pad_trailing("TL end #{label} #{r}", 201 + 2 * i))

      switches =
        for {name, {v1, i1, cpu}} <- now, {v0, i0, _} = before[name], into: %{} do
          {name, {(v1 - v0) / length(xs), (i1 - i0) / length(xs), cpu}}
        end

      Map.update(acc, label, {xs, [switches]}, fn {ys, s} -> {ys ++ xs, s ++ [switches]} end)
  end

perf.("disable")
Port.close(cat)

IO.puts(
  "| phase | median µs | p90 µs | context switches per call (voluntary/involuntary) and CPU at the end, by thread |"
)

IO.puts("| --- | ---: | ---: | --- |")

for {label, _} <- phases do
  {xs, switches} = results[label]

  by_thread =
    for s <- switches, {name, {v, inv, cpu}} <- s, v + inv >= 0.01 do
      "#{name} #{:erlang.float_to_binary(v, decimals: 2)}/#{:erlang.float_to_binary(inv, decimals: 2)} cpu#{cpu}"
    end

  IO.puts("| #{label} | #{fmt(median(xs))} | #{fmt(percentile(xs, 90))} | #{Enum.join(by_thread, ", ")} |")
end
