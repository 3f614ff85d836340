defmodule Moat.Reliability.LoadTest do
  # 200 processes x 1,000 mixed ops and readbacks on one worker. Each process
  # walks its own tensor through exact integer arithmetic, so any reply that
  # reached the wrong caller, or carried wrong data, shows up as a mismatch.
  # A tracer on the worker's owner counts the replies it routes: each call
  # gets exactly one. Meanwhile the worker's and the VM's memory are sampled,
  # and an unrelated pair of processes ping-pongs to show that a saturated
  # port blocks no one else.
  #
  # MOAT_LOAD_PROCS and MOAT_LOAD_OPS change the size (default 200 x 1000;
  # the :soak test runs 200 x 3000).
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Reliability}

  @moduletag :capture_log
  @moduletag timeout: 1_800_000

  test "many processes, mixed ops and readbacks: every reply reaches its caller exactly once" do
    load(Reliability.env_int("MOAT_LOAD_PROCS", 200), Reliability.env_int("MOAT_LOAD_OPS", 1_000))
  end

  @tag :soak
  test "soak: three times the ops" do
    load(200, 3_000)
  end

  defp load(procs, ops) do
    worker = start_worker(:load, log_level: :error)
    conn = Client.conn(worker)
    os_pid = conn.info.os_pid
    # The first ops start what the worker keeps for its life (on a GPU,
    # CUDA's context and the walk's kernels, about 0.5 GB): the baseline
    # comes after them.
    Nx.with_default_backend({Moat.Backend, worker: worker}, fn -> walk(0, 100) end)

    tracer = start_reply_counter(conn.owner)
    sampler = spawn_link(fn -> sample(os_pid, tracer, %{worker: 0, vm: 0}) end)
    baseline = %{worker: Reliability.proc_status_bytes(os_pid, "VmRSS"), vm: :erlang.memory(:total)}
    pinger = spawn_link(fn -> ping_pong([]) end)

    # Processes' values start `spacing` apart, so no walk (at most 3 per op)
    # reaches another's, and every value and every sum of 4 stays an exact
    # f32 integer (below 2^24).
    spacing = div(4_000_000, procs)
    assert spacing > 6 * ops + 8, "too many processes or ops for exact f32 values"
    test = self()
    started = System.monotonic_time(:millisecond)

    for i <- 1..procs do
      spawn_link(fn ->
        Nx.default_backend({Moat.Backend, worker: worker})
        send(test, {:done, i, walk(i * spacing, ops)})
      end)
    end

    results = for i <- 1..procs, do: assert_receive({:done, ^i, result}, 600_000) && result
    elapsed = System.monotonic_time(:millisecond) - started

    calls = results |> Enum.map(& &1.calls) |> Enum.sum()

    assert Enum.all?(results, &(&1.mismatches == [])),
           "wrong data: #{inspect(Enum.flat_map(results, & &1.mismatches) |> Enum.take(5))}"

    assert Enum.all?(results, &(&1.stray == 0)), "a caller received a message it did not ask for"

    # Exactly one reply per call, none left registered.
    peak = stop(sampler)
    %{finals: finals, repeated: repeated} = stop(tracer)
    assert repeated == 0, "#{repeated} calls got more than one reply"
    assert finals == calls, "#{calls} calls, #{finals} replies"
    assert :ets.info(conn.table, :size) == 0

    latencies = stop(pinger)
    worker_growth = peak.worker - baseline.worker
    vm_growth = peak.vm - baseline.vm
    p = percentiles(latencies)

    # Released intermediates keep the worker small; only requested data
    # comes back, so the VM stays small too.
    assert worker_growth < 128 * 1024 * 1024, "worker RSS grew #{mib(worker_growth)}"
    assert vm_growth < 128 * 1024 * 1024, "VM memory grew #{mib(vm_growth)}"
    # A saturated port suspends only its senders: the unrelated pair keeps
    # running (its worst round trip is the schedulers' fairness, not a block).
    assert p.max < 1_000_000, "an unrelated round trip took #{div(p.max, 1000)} ms"

    note =
      "#{calls} readback calls; #{elapsed} ms; 0 wrong, 0 lost, 0 duplicated; " <>
        "peak growth: worker RSS #{mib(worker_growth)}, VM #{mib(vm_growth)}; unrelated ping-pong " <>
        "p50 #{p.p50} µs, p99 #{p.p99} µs, max #{p.max} µs over #{length(latencies)} round trips"

    Reliability.record(
      :load,
      "load: #{procs} processes x #{ops} mixed ops and readbacks",
      procs * ops,
      procs * ops,
      0,
      note
    )
  end

  # One process's walk: `ops` steps, each an op or a readback, on a 4-vector
  # whose exact values are tracked here.
  defp walk(start, ops) do
    base = Enum.map(0..3, &((start + &1) * 1.0))
    # Made in the worker: a tensor made from BEAM data keeps its bytes there
    # (Moat.Backend's `host`) and a read of it takes no round trip, so no
    # reply to count; every readback of the walk is a call.
    x = Nx.negate(Nx.tensor(Enum.map(base, &(-&1)), type: :f32))
    true = x.data.host == nil
    step = Nx.tensor([1.0, -2.0, 3.0, 0.0], type: :f32)
    signs = Nx.tensor([1.0, -1.0, 1.0, -1.0], type: :f32)
    ones = Nx.tensor([[1.0], [1.0], [1.0], [1.0]], type: :f32)
    consts = %{step: step, signs: signs, ones: ones}
    acc = %{x: x, expected: base, calls: 0, mismatches: []}
    acc = Enum.reduce(1..ops, acc, fn _, acc -> step(acc, consts, Enum.random(1..10)) end)
    stray = receive_stray(0)
    %{calls: acc.calls, mismatches: acc.mismatches, stray: stray}
  end

  defp step(acc, c, pick) when pick <= 2,
    do: apply_op(acc, Nx.add(acc.x, c.step), &zip(&1, [1, -2, 3, 0], fn a, b -> a + b end))

  defp step(acc, c, 3), do: apply_op(acc, Nx.subtract(acc.x, c.step), &zip(&1, [1, -2, 3, 0], fn a, b -> a - b end))
  defp step(acc, c, 4), do: apply_op(acc, Nx.multiply(acc.x, c.signs), &zip(&1, [1, -1, 1, -1], fn a, b -> a * b end))
  defp step(acc, c, 5), do: apply_op(acc, Nx.divide(acc.x, c.signs), &zip(&1, [1, -1, 1, -1], fn a, b -> a / b end))

  defp step(acc, _c, 6) do
    square = Nx.reshape(acc.x, {2, 2})
    acc = apply_op(acc, Nx.reshape(square, {4}), & &1)
    release(square, acc)
  end

  defp step(acc, _c, 7) do
    ints = Nx.as_type(acc.x, :s32)
    acc = apply_op(acc, Nx.as_type(ints, :f32), & &1)
    release(ints, acc)
  end

  defp step(acc, c, 8) do
    row = Nx.reshape(acc.x, {1, 4})
    dot = Nx.dot(row, c.ones)
    acc = check(acc, Nx.to_flat_list(dot), [Enum.sum(acc.expected)])
    release(row, release(dot, acc))
  end

  defp step(acc, _c, 9) do
    sum = Nx.sum(acc.x)
    acc = check(acc, [Nx.to_number(sum)], [Enum.sum(acc.expected)])
    release(sum, acc)
  end

  defp step(acc, _c, 10), do: check(acc, Nx.to_flat_list(acc.x), acc.expected)

  # Every intermediate is released, so the worker's registry stays small.
  defp release(tensor, acc) do
    Nx.backend_deallocate(tensor)
    acc
  end

  defp apply_op(acc, new_x, expect) do
    Nx.backend_deallocate(acc.x)
    %{acc | x: new_x, expected: expect.(acc.expected)}
  end

  defp zip(xs, ys, f), do: Enum.zip_with(xs, ys, f)

  defp check(acc, got, expected) do
    acc = %{acc | calls: acc.calls + 1}
    if got == expected, do: acc, else: %{acc | mismatches: [{got, expected} | acc.mismatches]}
  end

  defp receive_stray(n) do
    receive do
      _ -> receive_stray(n + 1)
    after
      0 -> n
    end
  end

  # Counts the final replies ({:ok, ...} or {:error, ...}) the owner sends to
  # each call's alias.
  defp start_reply_counter(owner) do
    tracer = spawn_link(fn -> count_replies(%{}) end)
    :erlang.trace(owner, true, [:send, {:tracer, tracer}])
    tracer
  end

  defp count_replies(seen) do
    receive do
      {:trace, _, :send, {alias, {tag, _, _}}, _to} when tag in [:ok, :error] and is_reference(alias) ->
        count_replies(Map.update(seen, alias, 1, &(&1 + 1)))

      {:trace, _, _, _, _} ->
        count_replies(seen)

      {:stop, from} ->
        counts = Map.values(seen)
        send(from, {:result, %{finals: Enum.sum(counts), repeated: Enum.count(counts, &(&1 > 1))}})
    end
  end

  # Peak memory of the worker and of the VM (less the tracer's bookkeeping).
  defp sample(os_pid, tracer, peak) do
    receive do
      {:stop, from} -> send(from, {:result, peak})
    after
      50 ->
        rss = Reliability.proc_status_bytes(os_pid, "VmRSS")
        tracer_bytes = with {:memory, bytes} <- Process.info(tracer, :memory), do: bytes
        vm = :erlang.memory(:total) - (tracer_bytes || 0)
        sample(os_pid, tracer, %{worker: max(peak.worker, rss), vm: max(peak.vm, vm)})
    end
  end

  # An unrelated pair of processes: round trips, in microseconds.
  defp ping_pong(acc) do
    partner = spawn_link(fn -> pong() end)
    ping_loop(partner, acc)
  end

  defp pong do
    receive do
      {:ping, from} ->
        send(from, :pong)
        pong()
    end
  end

  defp ping_loop(partner, acc) do
    receive do
      {:stop, from} -> send(from, {:result, acc})
    after
      5 ->
        t0 = System.monotonic_time(:microsecond)
        send(partner, {:ping, self()})

        receive do
          :pong -> ping_loop(partner, [System.monotonic_time(:microsecond) - t0 | acc])
        end
    end
  end

  defp stop(pid) do
    send(pid, {:stop, self()})
    assert_receive {:result, result}, 60_000
    result
  end

  defp percentiles(samples) do
    sorted = Enum.sort(samples)
    at = fn q -> Enum.at(sorted, min(length(sorted) - 1, trunc(q * length(sorted)))) end
    %{p50: at.(0.5), p99: at.(0.99), max: List.last(sorted)}
  end

  defp mib(bytes), do: "#{Float.round(bytes / 1_048_576, 1)} MiB"
end
