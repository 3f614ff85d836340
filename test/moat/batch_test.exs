defmodule Moat.BatchTest do
  # Batched writes (docs/latency.md, "Batched writes"; protocol.md §1,
  # "Batches"): casts queue in the connection's ordered outbox and its writer
  # sends them as batch packets; calls write directly when nothing is queued,
  # and otherwise write what is queued themselves, their own frame last.
  # Real workers and real frames; the writer is suspended where a test needs
  # frames to stay queued.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error, Finalizer}

  @moduletag timeout: 120_000

  setup_all do
    if not Finalizer.loaded?(), do: raise("these tests need the finalizer NIF")
    :ok
  end

  defp writer(worker), do: :sys.get_state(Process.whereis(worker)).writer

  defp t(values, worker), do: Nx.tensor(values, type: :f32, backend: {Moat.Backend, worker: worker})

  # Runs `fun` with the writer suspended: frames pushed meanwhile stay queued.
  defp with_writer_held(worker, fun) do
    w = writer(worker)
    true = :erlang.suspend_process(w)

    try do
      fun.()
    after
      if Process.alive?(w), do: :erlang.resume_process(w)
    end
  end

  defp queued(worker), do: Finalizer.outbox_queued(Client.conn(worker).outbox)

  defp await_blocked(pids) do
    eventually(fn -> Enum.all?(pids, &(Process.info(&1, :status) in [{:status, :waiting}, nil])) end, 10_000)
  end

  test "a local worker has an outbox; a chain of casts comes out right" do
    w = start_worker(:batch_chain, log_level: :error)
    assert Client.conn(w).outbox != nil
    one = t([1.0, 2.0, 3.0, 4.0], w)
    sum = Enum.reduce(1..3000, one, fn _, acc -> Nx.add(acc, one) end)
    assert Nx.to_flat_list(sum) == [3001.0, 6002.0, 9003.0, 12004.0]
  end

  test "without batch_writes, callers write themselves" do
    w = start_worker(:batch_off, batch_writes: false, log_level: :error)
    assert Client.conn(w).outbox == nil
    assert :sys.get_state(Process.whereis(w)).writer == nil
    one = t([1.0, 2.0], w)
    assert Nx.to_flat_list(Enum.reduce(1..100, one, fn _, acc -> Nx.add(acc, one) end)) == [101.0, 202.0]
  end

  test "a handle passed to other processes before its defining frame is written reads back right" do
    w = start_worker(:batch_handoff, log_level: :error)
    parent = self()

    for round <- 1..20 do
      base = t([round * 1.0, 2.0, 3.0], w)

      readers =
        with_writer_held(w, fn ->
          # Defined by casts still queued when the readers get the handles.
          tensors = for k <- 1..8, do: {k, Nx.multiply(Nx.add(base, k), 2)}

          assert queued(w) >= 16

          readers =
            for {k, tensor} <- tensors do
              spawn_link(fn -> send(parent, {:read, round, k, Nx.to_flat_list(tensor)}) end)
            end

          # Each read writes the frames queued before it, its own last.
          for {_, k} <- Enum.with_index(readers, 1) do
            expected = [(round + k) * 2.0, (2.0 + k) * 2, (3.0 + k) * 2]
            assert_receive {:read, ^round, ^k, ^expected}, 10_000
          end

          readers
        end)

      assert length(readers) == 8
    end

    # And without holding the writer: many processes, many times.
    for _ <- 1..200 do
      x = Nx.add(t([1.0, 2.0], w), 1)
      task = Task.async(fn -> Nx.to_flat_list(x) end)
      assert Task.await(task) == [2.0, 3.0]
    end
  end

  test "casts and calls from many processes interleave, each caller's answers its own and in order" do
    w = start_worker(:batch_many, log_level: :error)

    tasks =
      for p <- 1..8 do
        Task.async(fn ->
          one = t([p * 1.0], w)

          Enum.reduce(1..300, {one, []}, fn i, {acc, seen} ->
            acc = Nx.add(acc, one)
            if rem(i, 7) == 0, do: {acc, [{i, Nx.to_flat_list(acc)} | seen]}, else: {acc, seen}
          end)
          |> elem(1)
          |> Enum.reverse()
          |> Enum.map(fn {i, got} -> {p, i, got} end)
        end)
      end

    for results <- Task.await_many(tasks, 60_000), {p, i, got} <- results do
      assert got == [(i + 1) * p * 1.0], "process #{p}, step #{i}"
    end
  end

  test "an upload behind pending casts goes in its place, whole" do
    w = start_worker(:batch_upload, shared_memory: false, chunk_bytes: 256 * 1024, log_level: :error)
    data = for i <- 0..(300_000 - 1), into: <<>>, do: <<rem(i, 251)::8>>
    one = t([1.0], w)

    {up, sum} =
      with_writer_held(w, fn ->
        sum = Enum.reduce(1..50, one, fn _, acc -> Nx.add(acc, one) end)
        assert queued(w) >= 50
        # The upload's chunks go after the casts queued before them.
        up = Task.async(fn -> Moat.from_binary(data, {300_000}, {:u, 8}, worker: w) end)
        {Task.await(up, 30_000), sum}
      end)

    assert Moat.to_binary(up) == data
    assert Nx.to_flat_list(sum) == [51.0]
  end

  test "the window holds a batched producer: pushed frames count against it" do
    w = start_worker(:batch_window, window: 8, log_level: :error)
    conn = Client.conn(w)
    one = t([1.0], w)
    parent = self()

    with_writer_held(w, fn ->
      producer =
        spawn_link(fn ->
          sum = Enum.reduce(1..200, one, fn _, acc -> Nx.add(acc, one) end)
          send(parent, {:sum, Nx.to_flat_list(sum)})
        end)

      await_blocked([producer])
      sent = :atomics.get(conn.counters, 2)
      # Waiting for acks the worker cannot send: nothing was written.
      assert sent - Client.acked(conn) <= 8 + 3
      refute_received {:sum, _}
    end)

    assert_receive {:sum, [201.0]}, 30_000
  end

  test "a batch pending when the worker is SIGKILLed: every caller is answered, none hangs" do
    w = start_worker(:batch_killed, log_level: :error)
    generation = Moat.Worker.info(w).generation
    os = os_pid(w)
    parent = self()
    one = t([1.0], w)

    callers =
      with_writer_held(w, fn ->
        # Some callers wait for replies (their calls wrote the batch ahead of
        # them), some have only queued casts, and read after the kill.
        callers =
          for p <- 1..8 do
            spawn(fn ->
              result =
                try do
                  x = Enum.reduce(1..20, one, fn _, acc -> Nx.add(acc, one) end)
                  if rem(p, 2) == 0, do: receive(do: (:go -> :ok))
                  {:ok, Nx.to_flat_list(x)}
                rescue
                  e in Error -> {:error, e.reason}
                end

              send(parent, {:answered, p, result})
            end)
          end

        eventually(fn -> queued(w) > 0 end, 10_000)
        kill(os)
        eventually(fn -> not os_alive?(os) end, 5_000)
        eventually(fn -> Moat.Worker.info(w).generation > generation end, 10_000)
        for {pid, p} <- Enum.with_index(callers, 1), rem(p, 2) == 0, do: send(pid, :go)
        callers
      end)

    for {_, p} <- Enum.with_index(callers, 1) do
      assert_receive {:answered, ^p, answer}, 10_000
      # A caller whose chain was computed before the kill may have its answer;
      # one that reads after it holds a handle of the dead generation.
      assert answer == {:ok, [21.0]} or
               match?({:error, r} when r in [:worker_died, :worker_unavailable, :stale_generation], answer),
             inspect(answer)
    end

    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end

  test "a writer killed on purpose takes its worker down: callers get :worker_died, the worker restarts" do
    w = start_worker(:batch_writer_killed, log_level: :error)
    generation = Moat.Worker.info(w).generation
    os = os_pid(w)
    parent = self()
    writer = writer(w)
    old = Client.conn(w)
    one = t([1.0], w)
    true = :erlang.suspend_process(writer)
    _queued = Nx.add(one, one)

    caller =
      spawn(fn ->
        receive do: (:go -> :ok)
        send(parent, {:answered, Client.call(old, :sync, [], nil)})
      end)

    Process.exit(writer, :kill)
    await_generation_after(w, generation)
    eventually(fn -> not os_alive?(os) end, 5_000)
    send(caller, :go)

    assert_receive {:answered, {:error, %Error{reason: reason, message: message}}}, 10_000
    assert reason in [:worker_died, :worker_unavailable]
    assert message =~ "writer exited"

    # A cast into the dead generation's (closed) outbox is refused, naming the cause.
    e = assert_raise Error, fn -> Client.cast(old, :sync, [], [], nil) end
    assert e.reason == :worker_unavailable
    assert e.message =~ "writer exited"
    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end
end
