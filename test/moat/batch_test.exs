defmodule Moat.BatchTest do
  # Batched writes (docs/latency.md, "Batched writes"; protocol.md §1,
  # "Batches"): casts queue in the connection's ordered outbox and its writer
  # sends them as batch packets; calls write directly when nothing is queued,
  # and otherwise write what is queued themselves, their own frame last.
  # Real workers and real frames; the writer is suspended where a test needs
  # frames to stay queued.
  use ExUnit.Case, async: false
  import Moat.Case

  import ExUnit.CaptureLog

  alias Moat.{Client, Error, Finalizer, Handles}

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
    w = start_worker(:batch_chain, batch_writes: true, log_level: :error)
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
    w = start_worker(:batch_handoff, batch_writes: true, log_level: :error)
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
    w = start_worker(:batch_many, batch_writes: true, log_level: :error)

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
    w =
      start_worker(:batch_upload, batch_writes: true, shared_memory: false, chunk_bytes: 256 * 1024, log_level: :error)

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
    w = start_worker(:batch_window, batch_writes: true, window: 8, log_level: :error)
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
    w = start_worker(:batch_killed, batch_writes: true, log_level: :error)
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
    w = start_worker(:batch_writer_killed, batch_writes: true, log_level: :error)
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

  test "iodata nested deeper than the NIF's walk is queued whole (flattened), not refused" do
    w = start_worker(:batch_deep, batch_writes: true, shared_memory: false, log_level: :error)
    conn = Client.conn(w)
    bytes = f32([1.0, 2.0, 3.0, 4.0])
    # 100 levels of nesting, bytes and binaries mixed at the bottom.
    <<first, rest::binary>> = bytes
    deep = Enum.reduce(1..100, [first, rest], fn _, acc -> [acc] end)
    attrs = %{shape: [4], dtype: {:f, 32}, bytes: 16}

    ids =
      with_writer_held(w, fn ->
        ids =
          for _ <- 1..3 do
            id = Client.new_id()
            :ok = Client.cast(conn, :from_binary, [id], [], attrs, deep)
            id
          end

        assert queued(w) >= 3
        ids
      end)

    for id <- ids, do: assert(Moat.to_binary(Handles.ref(conn, id)) == bytes)

    # A call behind queued frames takes the same path (outbox_call).
    with_writer_held(w, fn ->
      id = Client.new_id()
      :ok = Client.cast(conn, :from_binary, [id], [], attrs, deep)
      assert queued(w) >= 1
      assert Moat.to_binary(Handles.ref(conn, id)) == bytes
    end)

    # What is not iodata is refused by name, and nothing is queued for it.
    e =
      assert_raise ArgumentError, fn -> Client.cast(conn, :from_binary, [Client.new_id()], [], attrs, [deep, :nope]) end

    assert e.message =~ "from_binary: the frame is not iodata"
    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end

  test "without batched writes, what is not iodata is refused by name too, and the worker serves on" do
    w = start_worker(:unbatched_not_iodata, batch_writes: false, log_level: :error)
    conn = Client.conn(w)
    attrs = %{shape: {1}, type: {:f, 32}}

    e =
      assert_raise ArgumentError, fn ->
        Client.cast(conn, :from_binary, [Client.new_id()], [], attrs, [<<0::32>>, :nope])
      end

    assert e.message =~ "from_binary: the frame is not iodata"

    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end

  test "a failed cast in a batch poisons what depends on it, and only that" do
    w = start_worker(:batch_poison, batch_writes: true, log_level: :error)
    conn = Client.conn(w)
    one = t([1.0, 2.0], w)
    ins = Handles.ids!(conn, [one.data.ref], :add)

    {bad, dependent, fine} =
      with_writer_held(w, fn ->
        bad = Client.new_id()
        Client.cast(conn, :frobnicate, [bad], ins, nil)
        dependent = Client.new_id()
        Client.cast(conn, :add, [dependent], [bad | ins], %{type: {:f, 32}})
        fine = Nx.add(one, one)
        assert queued(w) >= 3
        # One handle per id (each owns its id's release).
        {bad, dependent} = {Handles.ref(conn, bad), Handles.ref(conn, dependent)}
        # This read writes the queued frames itself, its own frame last.
        e = assert_raise Error, fn -> Moat.to_binary(dependent) end
        assert e.message =~ "unknown op frobnicate"
        {bad, dependent, fine}
      end)

    for ref <- [bad, dependent] do
      e = assert_raise Error, fn -> Moat.to_binary(ref) end
      assert e.reason == :op_failed
      assert e.message =~ "unknown op frobnicate"
    end

    assert Nx.to_flat_list(fine) == [2.0, 4.0]
  end

  test "an op over the memory limit in a batch fails alone; the worker keeps serving" do
    w = start_worker(:batch_limit, batch_writes: true, log_level: :error)
    Moat.set_memory_limit(16 * 1024 * 1024, w)
    one = t([1.0], w)

    {big, small} =
      with_writer_held(w, fn ->
        # 64 MiB once evaluated, over the 16 MiB limit.
        big = Nx.sum(Nx.add(Nx.broadcast(one, {16 * 1024 * 1024}), one))
        small = Nx.add(one, one)
        assert queued(w) >= 3
        # The read writes the queued frames with its own last, and fails alone.
        e = assert_raise Error, fn -> Nx.to_flat_list(big) end
        assert e.reason == :op_failed
        assert e.kind == :memory_limit, inspect(e)
        {big, small}
      end)

    e = assert_raise Error, fn -> Nx.to_flat_list(big) end
    assert e.kind == :memory_limit, inspect(e)
    assert Nx.to_flat_list(small) == [2.0]
    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end

  test "releases of collected tensors queue behind the frames that use them" do
    w = start_worker(:batch_release, batch_writes: true, log_level: :error)
    base = t([1.0, 2.0], w)
    before = Moat.memory_info(w).tensors
    parent = self()

    for round <- 1..5 do
      with_writer_held(w, fn ->
        # A process makes temporaries (queued casts), keeps one result, and
        # exits: its dropped temporaries' releases are pushed while the
        # frames defining and using them are still queued.
        pid =
          spawn(fn ->
            result =
              Enum.reduce(1..50, base, fn i, acc -> Nx.add(acc, Nx.multiply(base, i)) end)
              |> Nx.multiply(round)

            send(parent, {:result, round, result})
          end)

        ref = Process.monitor(pid)
        assert_receive {:DOWN, ^ref, :process, ^pid, :normal}, 10_000
        :erlang.garbage_collect()
      end)

      assert_receive {:result, ^round, result}
      # 1 + sum(1..50) = 1276
      assert Nx.to_flat_list(result) == [1276.0 * round, 2552.0 * round]
    end

    eventually(fn -> Moat.memory_info(w).tensors <= before + 1 end, 10_000)
    assert Nx.to_flat_list(base) == [1.0, 2.0]
  end

  test "the port closed while frames are queued: every caller is answered, the worker restarts" do
    w = start_worker(:batch_closed, batch_writes: true, log_level: :error)
    generation = Moat.Worker.info(w).generation
    conn = Client.conn(w)
    one = t([1.0], w)
    parent = self()

    capture_log(fn ->
      with_writer_held(w, fn ->
        _queued = Enum.reduce(1..20, one, fn _, acc -> Nx.add(acc, one) end)
        assert queued(w) >= 20
        Port.close(conn.port)

        # A call behind the queued frames writes them with its own: the port
        # refuses the write, the outbox closes, and the call is answered.
        e =
          try do
            Client.call(conn, :sync, [], nil)
          rescue
            e in Error -> {:error, e}
          end

        assert {:error, %Error{reason: reason}} = e
        assert reason in [:worker_died, :worker_unavailable]

        callers =
          for p <- 1..4 do
            spawn(fn ->
              answer =
                try do
                  {:ok, Nx.to_flat_list(Nx.add(one, p))}
                rescue
                  e in Error -> {:error, e.reason}
                end

              send(parent, {:answered, p, answer})
            end)
          end

        for p <- 1..4 do
          assert_receive {:answered, ^p, answer}, 10_000

          assert match?({:error, r} when r in [:worker_died, :worker_unavailable, :stale_generation], answer),
                 inspect(answer)
        end

        # A cast into the closed connection is refused, not silently queued.
        assert_raise Error, fn -> Client.cast(conn, :sync, [], [], nil) end
        length(callers)
      end)
    end)

    await_generation_after(w, generation)
    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end

  test "protocol.md's malformed batch example, sent to a real worker: the documented refusals, once each" do
    w = start_worker(:batch_malformed_doc, batch_writes: true, log_level: :error)
    conn = Client.conn(w)
    doc = File.read!(Path.expand("../../protocol.md", __DIR__))
    [_, hex] = Regex.run(~r/```batch-malformed-hex\n(.*?)```/s, doc)
    [_, lines] = Regex.run(~r/```batch-malformed\n(.*?)```/s, doc)
    <<len::32, body::binary-size(len)>> = Base.decode16!(String.replace(hex, ~r/\s/, ""), case: :lower)

    expected =
      for "refused: " <> why <- String.split(lines, "\n", trim: true), do: why

    log =
      capture_log(fn ->
        # The port adds the packet length.
        Port.command(conn.port, body)
        assert {:ok, nil, ""} = Client.call(conn, :sync, [], nil)
        # Unprompted errors are logged by the owner; a call through it orders them.
        Moat.Worker.info(w)
      end)

    refused = Regex.scan(~r/refused a frame \(protocol\): (malformed batch: [^\n]*)/, log)
    assert Enum.map(refused, fn [_, why] -> why end) == expected, log
    assert Nx.to_flat_list(Nx.add(t([1.0], w), 1)) == [2.0]
  end
end
