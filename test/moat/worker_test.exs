defmodule Moat.WorkerTest do
  # The client, the worker process and the supervisor, driven for real.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error, Handles}

  defp matmul(a, b) do
    conn = Client.conn(a.worker)
    id = Client.new_id()
    Client.cast(conn, :matmul, [id], Handles.ids!(conn, [a, b], :matmul), %{type: {:f, 32}})
    Handles.ref(conn, id)
  end

  defp filled(worker, value, n) do
    Moat.from_binary(:binary.copy(f32([value]), n * n), {n, n}, {:f, 32}, worker: worker)
  end

  describe "low-level API" do
    test "round-trips bytes, shapes and types" do
      ref = Moat.from_binary(f32([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), {2, 3}, {:f, 32})
      assert Moat.to_binary(ref) == f32([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
      assert Moat.shape(ref) == {2, 3}
      assert Moat.dtype(ref) == {:f, 32}
      assert Moat.eval(ref) == :ok
      assert Moat.async_eval([ref, ref]) == :ok

      ints = Moat.from_binary(<<-1::64-signed-native, 7::64-signed-native>>, {2}, {:s, 64})
      assert Moat.to_binary(ints) == <<-1::64-signed-native, 7::64-signed-native>>
      assert Moat.dtype(ints) == {:s, 64}
    end

    test "eval/1 and async_eval/1 take Nx tensors too, and refuse other backends' by name" do
      t = Nx.tensor([1.0, 2.0], backend: Moat.Backend) |> Nx.exp()
      assert Moat.eval(t) == :ok
      assert Moat.async_eval([t, t.data.ref]) == :ok

      assert_raise ArgumentError, ~r/Moat.eval: expected Moat.Backend tensors/, fn ->
        Moat.eval(Nx.tensor([1.0], backend: Nx.BinaryBackend))
      end
    end

    test "f64 is held as f64, never downcast" do
      ref = Moat.from_binary(<<0.1::float-64-native>>, {1}, {:f, 64})
      assert Moat.to_binary(ref) == <<0.1::float-64-native>>
    end

    test "types MLX does not have raise here and name where Moat.Backend holds them" do
      assert_raise ArgumentError, ~r/no type \{:c, 128\}: Moat.Backend \(Nx\) holds it as \{:f, 64\}/, fn ->
        Moat.from_binary(<<0::128>>, {1}, {:c, 128})
      end

      assert_raise ArgumentError, ~r/shape \{3\}.*needs 12/, fn ->
        Moat.from_binary(<<0::64>>, {3}, {:f, 32})
      end
    end

    test "handles of two workers in one call raise, naming both workers, before anything is sent" do
      w1 = start_worker(:mixed_one)
      w2 = start_worker(:mixed_two)
      a = filled(w1, 1.0, 2)
      b = filled(w2, 2.0, 2)
      message = ~r/^eval: tensor #{b.id} belongs to worker :mixed_two, but this call runs on :mixed_one; /

      # The worker would answer an id it does not hold with a Moat.Error: an
      # ArgumentError comes from the client.
      assert_raise ArgumentError, message, fn -> Moat.eval([a, b]) end

      assert_raise ArgumentError, ~r/^async_eval: tensor #{a.id} belongs to worker :mixed_one/, fn ->
        Moat.async_eval([b, a])
      end

      assert_raise ArgumentError, ~r/^matmul: .* :mixed_two, but this call runs on :mixed_one/, fn -> matmul(a, b) end
      assert Moat.to_binary(a) == f32([1.0, 1.0, 1.0, 1.0])
      assert Moat.to_binary(b) == f32([2.0, 2.0, 2.0, 2.0])
    end

    test "a failed op surfaces at the next blocking call, naming the op that failed first" do
      a = Moat.from_binary(f32(List.duplicate(1.0, 6)), {2, 3}, {:f, 32})
      b = Moat.from_binary(f32(List.duplicate(1.0, 4)), {2, 2}, {:f, 32})
      bad = matmul(a, b)
      downstream = matmul(bad, b)
      error = assert_raise Error, fn -> Moat.to_binary(downstream) end
      assert error.reason == :op_failed
      assert error.op == :matmul
      assert error.message =~ "[matmul]"
      # Everything else is still there.
      assert Moat.to_binary(b) == f32(List.duplicate(1.0, 4))
    end

    test "large tensors travel in chunks both ways" do
      worker = start_worker(:small_chunks, chunk_bytes: 4096, max_frame_bytes: 8192)
      values = Enum.map(1..100_000, &(&1 * 1.0))
      ref = Moat.from_binary(f32(values), {100_000}, {:f, 32}, worker: worker)
      assert from_f32(Moat.to_binary(ref)) == values
    end

    test "concurrent readbacks, small (written by the session) and chunked (by the writer), reach their callers" do
      # Small replies pass queued large ones (docs/latency.md): each caller
      # must still get its own bytes, every chunk in order.
      worker = start_worker(:mixed_readbacks, chunk_bytes: 4096, shared_memory: false)

      callers =
        for caller <- 1..12 do
          Task.async(fn ->
            n = if rem(caller, 3) == 0, do: 20_000, else: 4
            values = Enum.map(1..n, &(&1 * 1.0 + caller))
            ref = Moat.from_binary(f32(values), {n}, {:f, 32}, worker: worker)
            Enum.all?(1..30, fn _ -> from_f32(Moat.to_binary(ref)) == values end)
          end)
        end

      assert Task.await_many(callers, 60_000) == List.duplicate(true, 12)
    end

    test "telemetry spans to_binary and eval" do
      forward_events([[:moat, :to_binary, :stop], [:moat, :eval, :stop]])

      ref = Moat.from_binary(f32([1.0, 2.0]), {2}, {:f, 32})
      Moat.to_binary(ref)

      assert_receive {:telemetry, [:moat, :to_binary, :stop], %{duration: d},
                      %{shape: {2}, dtype: {:f, 32}, byte_size: 8}}

      assert d > 0
      Moat.eval([ref, ref])
      assert_receive {:telemetry, [:moat, :eval, :stop], %{duration: _}, %{count: 2}}
    end
  end

  describe "the worker's environment" do
    defp worker_env(name) do
      "/proc/#{os_pid(name)}/environ"
      |> File.read!()
      |> String.split(<<0>>, trim: true)
      |> Map.new(&List.to_tuple(String.split(&1, "=", parts: 2)))
    end

    # The VM's own value of each variable, put back after the test.
    defp with_vm_env(vars, fun) do
      saved = Map.new(vars, fn {k, _} -> {k, System.get_env(k)} end)

      try do
        for {k, v} <- vars, do: if(v, do: System.put_env(k, v), else: System.delete_env(k))
        fun.()
      after
        for {k, v} <- saved, do: if(v, do: System.put_env(k, v), else: System.delete_env(k))
      end
    end

    test "sets OpenBLAS's spin and glibc's malloc cache where the VM's environment does not" do
      with_vm_env([{"OPENBLAS_THREAD_TIMEOUT", nil}, {"GLIBC_TUNABLES", nil}], fn ->
        env = worker_env(start_worker(:default_env))
        assert env["OPENBLAS_THREAD_TIMEOUT"] == "20"
        assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=512"
      end)
    end

    test "keeps the VM's own values" do
      with_vm_env([{"OPENBLAS_THREAD_TIMEOUT", "28"}, {"GLIBC_TUNABLES", "glibc.malloc.tcache_count=7"}], fn ->
        name = start_worker(:user_env)
        env = worker_env(name)
        assert env["OPENBLAS_THREAD_TIMEOUT"] == "28"
        assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=7"
        # A matrix product through OpenBLAS's pool works under either.
        a = filled(name, 1.0, 64)
        assert Moat.to_binary(matmul(a, a)) == :binary.copy(f32([64.0]), 64 * 64)
      end)
    end
  end

  # A chain of `n` casts of `acc + 1`, each checked against the window just
  # after it is sent. Every handle stays alive, so no :release frame
  # (another sender) shares the window while it is measured.
  defp chain_within_window(worker, conn, n, window) do
    one = Moat.from_binary(f32([1.0]), {1}, {:f, 32}, worker: worker)

    [last | _] =
      Enum.reduce(1..n, [one], fn _, [acc | _] = all ->
        id = Client.new_id()
        Client.cast(conn, :add, [id], Handles.ids!(conn, [acc, one], :add), %{type: {:f, 32}})
        assert :atomics.get(conn.counters, 2) - Client.acked(conn) <= window
        [Handles.ref(conn, id) | all]
      end)

    last
  end

  describe "backpressure" do
    test "fire-and-forget frames never exceed the window of unacknowledged frames" do
      worker = start_worker(:narrow_window, window: 16)
      conn = Client.conn(worker)
      assert Moat.to_binary(chain_within_window(worker, conn, 3_000, 16)) == f32([3001.0])
    end

    test "a window of 1: each cast waits for the ack the worker sends once its input stays empty" do
      worker = start_worker(:window_of_one, window: 1)
      conn = Client.conn(worker)
      assert Moat.to_binary(chain_within_window(worker, conn, 300, 1)) == f32([301.0])
    end
  end

  describe "crashes" do
    test "SIGKILL while 20 callers wait: each gets an error within 1 s, the worker returns, old handles are stale" do
      worker = start_worker(:crash_victim)
      %{generation: generation, os_pid: os_pid} = Moat.Worker.info(worker)
      before = Moat.from_binary(f32([1.0, 2.0]), {2}, {:f, 32}, worker: worker)
      assert Moat.to_binary(before) == f32([1.0, 2.0])

      big = filled(worker, 0.001, 1024)
      slow = Enum.reduce(1..400, big, fn _, acc -> matmul(acc, big) end)
      parent = self()

      for i <- 1..20 do
        spawn(fn ->
          result =
            try do
              Moat.to_binary(slow)
            rescue
              e -> e
            end

          send(parent, {:done, i, result, System.monotonic_time(:millisecond)})
        end)
      end

      table = Client.conn(worker).table
      eventually(fn -> :ets.info(table, :size) == 20 end)
      killed_at = System.monotonic_time(:millisecond)
      kill(os_pid)

      for i <- 1..20 do
        assert_receive {:done, ^i, %Error{reason: :worker_died} = e, at}, 1_000
        assert e.message =~ "SIGKILL"
        assert at - killed_at < 1_000
      end

      await_generation_after(worker, generation)
      assert Moat.Worker.info(worker).os_pid != os_pid
      refute os_alive?(os_pid)

      fresh = Moat.from_binary(f32([5.0]), {1}, {:f, 32}, worker: worker)
      assert Moat.to_binary(fresh) == f32([5.0])

      stale = assert_raise Error, fn -> Moat.to_binary(before) end
      assert stale.reason == :stale_generation
      assert stale.message =~ "generation #{generation}"
    end

    test "worker up and down telemetry carry the generation and the cause" do
      forward_events([[:moat, :worker, :up], [:moat, :worker, :down]])

      worker = start_worker(:telemetry_victim)
      assert_receive {:telemetry, [:moat, :worker, :up], _, %{worker: ^worker, generation: g}}
      kill(os_pid(worker))
      assert_receive {:telemetry, [:moat, :worker, :down], _, %{worker: ^worker, generation: ^g, reason: reason}}, 1_000
      assert reason =~ "SIGKILL"
      assert_receive {:telemetry, [:moat, :worker, :up], _, %{worker: ^worker, generation: g2}}, 2_000
      assert g2 == g + 1
    end

    test "stopping the owner closes the port and the worker exits" do
      worker = start_worker(:stopped_cleanly)
      os_pid = os_pid(worker)
      assert os_alive?(os_pid)
      :ok = ExUnit.Callbacks.stop_supervised(worker)
      eventually(fn -> not os_alive?(os_pid) end, 1_000)
    end

    @tag timeout: 120_000
    test "the VM killed while the worker is busy leaves no orphan" do
      elixir = System.find_executable("elixir")
      paths = Enum.flat_map(Path.wildcard(Path.join(Mix.Project.build_path(), "lib/*/ebin")), &["-pa", &1])

      # The worker is made as deaf as it can be: its MLX thread is inside a
      # long eval and its reader is blocked on a full queue behind it, so
      # nothing reads the input pipe and end-of-file goes unseen. Only the
      # parent-death signal can stop it then.
      script = ~S"""
      {:ok, _} = Application.ensure_all_started(:moat)
      conn = Moat.Client.conn(Moat.Worker)
      one = Moat.from_binary(:binary.copy(<<0.001::float-32-native>>, 1024 * 1024), {1024, 1024}, {:f, 32})
      chain = fn n, op ->
        Enum.reduce(1..n, one, fn _, acc ->
          id = Moat.Client.new_id()
          Moat.Client.cast(conn, op, [id], Moat.Handles.ids!(conn, [acc, one], op), %{type: {:f, 32}})
          Moat.Handles.ref(conn, id)
        end)
      end
      slow = chain.(2000, :matmul)
      spawn(fn -> Moat.eval(slow) end)
      spawn(fn -> chain.(100_000, :add) end)
      Process.sleep(500)
      IO.puts("vm=#{System.pid()} worker=#{Moat.Worker.info().os_pid}")
      Process.sleep(:infinity)
      """

      port =
        Port.open({:spawn_executable, elixir}, [:binary, :exit_status, :stderr_to_stdout, args: paths ++ ["-e", script]])

      {vm, worker} = read_pids(port, "")
      # Let the worker get deep into MLX, where it no longer reads its input.
      eventually(fn -> busy?(worker) end, 10_000)
      holders = Path.wildcard("/proc/#{worker}/task/*/children") |> Enum.flat_map(&String.split(File.read!(&1)))
      kill(vm)
      eventually(fn -> not os_alive?(worker) and not Enum.any?(holders, &os_alive?/1) end, 1_000)

      Moat.Reliability.record(
        :crashes,
        "VM SIGKILLed while the worker is busy in MLX",
        1,
        1,
        0,
        "worker and its input holder gone within 1 s"
      )
    end
  end

  defp read_pids(port, acc) do
    receive do
      {^port, {:data, data}} ->
        acc = acc <> data

        case Regex.run(~r/vm=(\d+) worker=(\d+)/, acc) do
          [_, vm, worker] -> {vm, worker}
          nil -> read_pids(port, acc)
        end

      {^port, {:exit_status, status}} ->
        flunk("the child VM exited with #{status}: #{acc}")
    after
      60_000 -> flunk("the child VM printed no pids: #{acc}")
    end
  end

  # Busy = the worker burned CPU time in the last 100 ms.
  defp busy?(pid) do
    t0 = cpu_ticks(pid)
    Process.sleep(100)
    cpu_ticks(pid) - t0 > 2
  end

  defp cpu_ticks(pid) do
    fields = File.read!("/proc/#{pid}/stat") |> String.split(") ") |> List.last() |> String.split(" ")
    String.to_integer(Enum.at(fields, 11)) + String.to_integer(Enum.at(fields, 12))
  end
end
