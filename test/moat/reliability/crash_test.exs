defmodule Moat.Reliability.CrashTest do
  # Crash containment under load. Callers keep a worker busy with mixed Nx
  # work while the worker dies at a random moment, by each crash class MLX
  # has (a real invalid write, a division trap, abort, SIGKILL, a panic, an
  # exit) and by a real MLX failed allocation. Every time: the VM lives, every
  # caller gets a correct result or an error naming the cause within a bound,
  # none hangs, no result is wrong, and the worker is back within 500 ms.
  #
  # Each test first records what it observed (faults injected, jobs answered
  # correctly, answered with an error, callers hung, results wrong) for
  # docs/reliability.md, and only then fails if any of it breaks the promise,
  # so that the report's table counts what happened rather than assume it.
  #
  # MOAT_CRASH_ROUNDS sets the rounds per fault (default 2); the :soak test
  # (bin/soak) injects MOAT_SOAK_FAULTS random ones (default 200).
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Error, Reliability}

  @moduletag :capture_log
  @moduletag timeout: 900_000

  @faults [:sigsegv, :sigfpe, :sigabrt, :sigkill, :panic, {:exit, 3}]
  @callers 12
  # Bounds: from the worker's death to each caller's error, and to the next
  # generation's handshake.
  @error_within_ms 1_000
  @back_within_ms 500

  setup do
    name = :"crash_#{System.unique_integer([:positive])}"
    attach_lifecycle(name)

    child = {Moat.Worker, name: name, worker_path: Reliability.fault_worker_path()}
    # Restart intensity has its own test (lifecycle_test.exs); here every crash restarts.
    spec = %{
      id: name,
      type: :supervisor,
      start: {Supervisor, :start_link, [[child], [strategy: :one_for_one, max_restarts: 10_000, max_seconds: 1]]}
    }

    start_supervised!(spec)
    assert_receive {:lifecycle, :up, %{generation: 1}, _}, 5_000
    %{worker: name}
  end

  test "the VM and every caller survive each crash class, at random moments under load", %{worker: worker} do
    rounds = Reliability.env_int("MOAT_CRASH_ROUNDS", 2)

    violations =
      for fault <- @faults do
        stats = Enum.map(1..rounds, fn _ -> crash_round(worker, fault, &inject_fault(&1, fault)) end)
        record(describe(fault), stats)
      end

    assert_kept(violations)
  end

  @tag :soak
  test "soak: faults of random kinds at random moments, many times over", %{worker: worker} do
    n = Reliability.env_int("MOAT_SOAK_FAULTS", 200)
    faults = for _ <- 1..n, do: Enum.random(@faults)
    stats = Enum.map(faults, fn fault -> crash_round(worker, fault, &inject_fault(&1, fault)) end)
    kinds = faults |> Enum.frequencies() |> Enum.map_join(", ", fn {f, k} -> "#{k} #{Reliability.cause(f)}" end)
    assert_kept(record("soak: random faults under load (#{kinds})", stats))
  end

  # MLX's CPU allocator: on a GPU 80 GB may fit, and the card's limit is
  # checked by test/moat/gpu_test.exs.
  @tag :cpu_only
  test "a real MLX crash (a failed allocation) is contained the same way", %{worker: worker} do
    rounds = Reliability.env_int("MOAT_CRASH_ROUNDS", 2)
    test = self()

    stats =
      Enum.map(1..rounds, fn _ ->
        crash_round(worker, :mlx_alloc, fn worker ->
          spawn(fn ->
            # 80 GB: MLX's CPU allocator returns NULL and MLX writes through it.
            Nx.default_backend({Moat.Backend, worker: worker})
            huge = Nx.broadcast(Nx.tensor([1.0, 2.0]), {100_000, 100_000, 2}) |> Nx.add(1.0)

            try do
              Nx.to_binary(huge)
              send(test, {:alloc, :returned})
            rescue
              e in Error -> send(test, {:alloc, e})
            end
          end)
        end)
      end)

    assert_kept(record("real MLX crash class: a failed 80 GB allocation", stats))
  end

  # Records a row of what the rounds observed; returns what broke the promise.
  defp record(fault, stats) do
    sum = fn key -> stats |> Enum.map(&Map.fetch!(&1, key)) |> Enum.sum() end

    observed = %{
      injected: length(stats),
      correct: sum.(:ok),
      errors: sum.(:errors),
      hung: sum.(:hung),
      lost: sum.(:wrong)
    }

    Reliability.record_observed(:crashes_under_load, fault, observed, summary(stats))
    Enum.flat_map(stats, & &1.violations)
  end

  defp assert_kept(violations) do
    violations = List.flatten(violations)
    assert violations == [], Enum.join(violations, "\n")
  end

  defp check(true, _why), do: []
  defp check(false, why), do: [why]

  # One fault while @callers processes are busy; returns what the callers saw.
  defp crash_round(worker, fault, inject) do
    %{generation: g, os_pid: os_pid} = Moat.Worker.info(worker)
    test = self()

    callers =
      for i <- 1..@callers do
        spawn_link(fn ->
          Nx.default_backend({Moat.Backend, worker: worker})
          caller(test, i, [])
        end)
      end

    Process.sleep(Enum.random(20..120))
    inject.(worker)

    receive do
      {:lifecycle, :down, %{generation: ^g, os_pid: ^os_pid, reason: reason}, down_at} ->
        died =
          check(
            reason =~ cause(fault),
            "#{inspect(fault)}: the worker's death (#{reason}) does not name #{cause(fault)}"
          )

        alloc = if fault == :mlx_alloc, do: alloc_error(), else: []
        # Without a new worker the rounds that follow mean nothing.
        assert_receive {:lifecycle, :up, %{generation: g2, os_pid: new_pid}, up_at}, 5_000

        restarted =
          check(g2 == g + 1 and new_pid != os_pid, "#{inspect(fault)}: generation #{g2} (os pid #{new_pid}) after #{g}") ++
            check(
              up_at - down_at < @back_within_ms * 1000,
              "#{inspect(fault)}: the worker took #{div(up_at - down_at, 1000)} ms to come back"
            )

        eventually(fn -> not os_alive?(os_pid) end, 1_000)
        # The callers carry on against the new worker for a while.
        Process.sleep(80)
        check_round(stop(callers), fault, down_at, up_at, died ++ alloc ++ restarted)

      {:alloc, %Error{reason: :op_failed} = e} ->
        # A memory guard refused the allocation: nothing crashed, nobody fails.
        refused = check(e.message =~ ~r/alloc|memory/i, "the refused allocation's error: #{e.message}")
        Process.sleep(80)
        check_round(stop(callers), fault, nil, nil, refused)
    after
      10_000 -> flunk("the worker neither died nor refused after #{inspect(fault)}")
    end
  end

  defp alloc_error do
    receive do
      {:alloc, %Error{reason: :worker_died}} -> []
      {:alloc, other} -> ["the allocating caller got #{inspect(other)}, not a worker_died error"]
    after
      @error_within_ms -> ["the allocating caller got no error within #{@error_within_ms} ms"]
    end
  end

  defp cause(:mlx_alloc), do: "SIGSEGV"
  defp cause(fault), do: Reliability.cause(fault)

  defp inject_fault(worker, fault), do: Reliability.inject(worker, fault, delay_ms: Enum.random(0..20))

  defp caller(test, i, acc) do
    receive do
      :stop -> send(test, {:stopped, self(), acc})
    after
      0 ->
        result = job()
        # Back off after a failure, as a real client would while the worker restarts.
        if elem(result, 0) != :ok, do: Process.sleep(5)
        caller(test, i, [result | acc])
    end
  end

  # {the results of the callers that stopped, how many did not (a caller hung
  # in a call never answers)}.
  defp stop(callers) do
    Enum.each(callers, &send(&1, :stop))
    deadline = System.monotonic_time(:millisecond) + 5_000

    {results, hung} =
      Enum.map_reduce(callers, 0, fn pid, hung ->
        receive do
          {:stopped, ^pid, results} -> {results, hung}
        after
          max(deadline - System.monotonic_time(:millisecond), 0) -> {[], hung + 1}
        end
      end)

    {List.flatten(results), hung}
  end

  # Mixed work on small integer-valued f32 tensors, so every result is exact
  # and is compared with Nx.BinaryBackend's.
  defp job do
    n = Enum.random([4, 8, 16, 32])
    xs = for _ <- 1..(n * n), do: Enum.random(0..3) * 1.0
    ys = for _ <- 1..(n * n), do: Enum.random(0..3) * 1.0
    readback = Enum.random([:dot, :sum, :ints])
    t0 = now()

    outcome =
      try do
        got = pipeline(Nx.tensor(xs, type: :f32), Nx.tensor(ys, type: :f32), n, readback)

        expected =
          Nx.with_default_backend(Nx.BinaryBackend, fn ->
            pipeline(Nx.tensor(xs, type: :f32), Nx.tensor(ys, type: :f32), n, readback)
          end)

        if got == expected, do: :ok, else: {:wrong, readback, n}
      rescue
        e in Error -> {:error, e}
        e -> {:raised, Exception.format(:error, e, __STACKTRACE__)}
      end

    {outcome, t0, now()}
  end

  defp pipeline(a, b, n, readback) do
    a = Nx.reshape(a, {n, n})
    b = Nx.reshape(b, {n, n})
    c = a |> Nx.multiply(b) |> Nx.add(a) |> Nx.subtract(b)
    d = c |> Nx.dot(b) |> Nx.divide(4.0)

    case readback do
      :dot -> Nx.to_binary(d)
      :sum -> d |> Nx.sum() |> Nx.to_binary()
      :ints -> d |> Nx.as_type(:s32) |> Nx.reshape({n * n}) |> Nx.to_binary()
    end
  end

  # What the callers got in one round, and what of it broke the promise.
  defp check_round({results, hung}, fault, down_at, up_at, violations) do
    broken =
      for {outcome, t0, t1} <- results, why <- judge(outcome, t0, t1, fault, down_at, up_at) do
        "#{inspect(fault)}: #{why}"
      end

    hung_callers = check(hung == 0, "#{inspect(fault)}: #{hung} callers hung (no answer within 5 s)")

    %{
      violations: violations ++ broken ++ hung_callers,
      hung: hung,
      wrong: Enum.count(results, &match?({{:wrong, _, _}, _, _}, &1)),
      jobs: length(results),
      ok: Enum.count(results, &match?({:ok, _, _}, &1)),
      errors: Enum.count(results, &match?({{kind, _}, _, _} when kind in [:error, :raised], &1)),
      in_flight: Enum.count(results, fn {o, t0, t1} -> match?({:error, _}, o) and t0 < down_at and t1 > down_at end),
      back_ms: up_at && div(up_at - down_at, 1000),
      after_restart: Enum.count(results, fn {o, t0, _} -> o == :ok and up_at != nil and t0 > up_at end)
    }
  end

  # Why one job's outcome breaks the promise ([] when it keeps it).
  defp judge(:ok, _t0, _t1, _fault, _down_at, _up_at), do: []

  defp judge({:wrong, readback, n}, _t0, _t1, _fault, _down_at, _up_at),
    do: ["a #{readback} readback of a #{n}x#{n} job returned wrong data"]

  defp judge({:raised, text}, _t0, _t1, _fault, _down_at, _up_at),
    do: ["a caller got something other than a Moat.Error: #{text}"]

  defp judge({:error, e}, _t0, _t1, _fault, nil, _up_at),
    do: ["nothing crashed, yet a caller failed: #{Exception.message(e)}"]

  defp judge({:error, e}, t0, t1, fault, down_at, up_at) do
    # Only jobs that overlapped the crash may fail, each within the bound.
    check(t0 < up_at, "a job started after the worker was back failed: #{Exception.message(e)}") ++
      check(t1 - down_at < @error_within_ms * 1000, "an error took #{div(t1 - down_at, 1000)} ms after the crash") ++
      names_cause(e, fault)
  end

  defp names_cause(%Error{reason: :stale_generation} = e, _fault),
    do: check(e.message =~ ~r/generation \d+.*restarted/, "a stale-generation error says: #{e.message}")

  defp names_cause(%Error{reason: reason} = e, fault) when reason in [:worker_died, :worker_unavailable],
    do: check(e.message =~ cause(fault), "the error does not name the cause (#{cause(fault)}): #{e.message}")

  defp names_cause(e, _fault), do: ["unexpected error: #{inspect(e)}"]

  defp summary(stats) do
    sum = fn key -> stats |> Enum.map(&Map.fetch!(&1, key)) |> Enum.sum() end
    back = stats |> Enum.map(& &1.back_ms) |> Enum.reject(&is_nil/1)
    back = if back == [], do: "never down", else: "worker back in #{Enum.min(back)}–#{Enum.max(back)} ms"

    "#{@callers} busy callers, #{sum.(:jobs)} jobs (#{sum.(:after_restart)} exact after the restart, " <>
      "#{sum.(:in_flight)} errors in flight at the crash); " <> back
  end

  defp describe({:exit, code}), do: "worker exits (status #{code})"
  defp describe(:panic), do: "Rust panic in the worker (status 101)"
  defp describe(signal), do: "#{Reliability.cause(signal)} in the worker, under load"

  # Microseconds: a job's start and the worker's return can fall in the same millisecond.
  defp now, do: System.monotonic_time(:microsecond)

  defp attach_lifecycle(name) do
    test = self()
    events = [[:moat, :worker, :up], [:moat, :worker, :down]]
    :telemetry.attach_many({__MODULE__, name}, events, &__MODULE__.lifecycle/4, {name, test})
    on_exit(fn -> :telemetry.detach({__MODULE__, name}) end)
  end

  @doc false
  def lifecycle([:moat, :worker, event], _measurements, %{worker: name} = meta, {name, test}) do
    send(test, {:lifecycle, event, meta, now()})
  end

  def lifecycle(_event, _measurements, _meta, _config), do: :ok
end
