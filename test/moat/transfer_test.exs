defmodule Moat.TransferTest do
  # How tensor bytes travel: through shared memory on this host for large
  # tensors (protocol.md §6, "Shared memory"), through the pipe otherwise,
  # and what is left when a caller dies half way through either (nothing).
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Error, Finalizer, Reliability, Shared}

  @mib 1024 * 1024

  defp bytes(n), do: :crypto.strong_rand_bytes(n)

  # Memory files the worker has open (uploads in flight, tensors over a
  # file, and files kept for reuse).
  defp memory_files(worker) do
    worker |> os_pid() |> Reliability.open_fds() |> Enum.count(fn {_, target} -> target =~ "moat-upload" end)
  end

  describe "negotiation" do
    test "a worker on this host offers shared memory and the client takes it" do
      w = start_worker(:shm_offer, log_level: :error)
      assert %{address: a, nonce: nonce} = Moat.Worker.info(w).shared_memory
      assert %{mem: mem, address: ^a, nonce: ^nonce, threshold: @mib} = Client.conn(w).shared
      assert mem == "/proc/#{os_pid(w)}/mem"
    end

    test "shared_memory: false, and a probe that fails, leave the pipe" do
      w = start_worker(:shm_off, shared_memory: false, log_level: :error)
      assert Moat.Worker.info(w).shared_memory == nil
      assert Client.conn(w).shared == nil

      on = start_worker(:shm_probe, log_level: :error)
      info = Moat.Worker.info(on)
      assert Shared.negotiate(info, 1) != nil
      assert Shared.negotiate(info, 1, :sealed_files).via == :sealed
      # A GPU worker's buffers are CUDA managed memory: sealed files, as measured there.
      assert Shared.negotiate(%{info | devices: [:cpu, :gpu]}, 1).via == :sealed

      for mode <- [true, :sealed_files] do
        assert Shared.negotiate(%{info | shared_memory: %{info.shared_memory | nonce: <<0::128>>}}, 1, mode) == nil
        # Another process at that pid (here this VM) does not hold the nonce.
        assert Shared.negotiate(%{info | os_pid: String.to_integer(System.pid())}, 1, mode) == nil
      end
    end
  end

  describe "round trips" do
    setup do
      {:ok, worker: start_worker(:shm_trips, shared_memory_threshold: 64 * 1024, log_level: :error)}
    end

    test "large tensors go through shared memory, small ones through the pipe, intact", %{worker: w} do
      sizes = [{100, :pipe}, {64 * 1024 - 1, :pipe}, {64 * 1024, :shared_memory}, {3 * @mib + 7, :shared_memory}]

      for {size, path} <- sizes do
        data = bytes(size)
        ref = Moat.from_binary(data, {size}, {:u, 8}, worker: w)
        # A tensor uploaded through shared memory lives in a memory file.
        assert memory_files(w) == if(path == :pipe, do: 0, else: 1), "#{size} bytes"
        assert read_back(ref) == {path, data}
        Moat.deallocate(ref)
        Moat.memory_info(w)
        Moat.clear_cache(w)
      end
    end

    test "through shared memory, Nx tensors of every type come back as they went", %{worker: w} do
      for type <- device_types([{:u, 8}, {:s, 16}, {:s, 64}, {:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}, {:c, 64}]) do
        t = Nx.iota({300, 257}, type: type, backend: Nx.BinaryBackend)
        on_worker = Nx.backend_transfer(t, {Moat.Backend, worker: w})
        assert Nx.to_binary(on_worker) == Nx.to_binary(t), inspect(type)
      end
    end

    test "a readback is pinned only until it is read", %{worker: w} do
      data = bytes(2 * @mib)
      ref = Moat.from_binary(data, {2 * @mib}, {:u, 8}, worker: w)
      before = Moat.memory_info(w)
      t = Nx.from_binary(bytes(@mib), :u8, backend: {Moat.Backend, worker: w})
      sum = Nx.add(t, t)
      assert byte_size(Nx.to_binary(sum)) == @mib
      assert Moat.to_binary(ref) == data
      Nx.backend_deallocate(t)
      Nx.backend_deallocate(sum)
      info = Moat.memory_info(w)
      assert info.tensors == before.tensors
      assert info.active == before.active
      assert Moat.shape(ref) == {2 * @mib}
    end

    test "a shared upload over the memory limit fails like one through the pipe", %{worker: w} do
      Moat.set_memory_limit(8 * @mib, w)
      big = Moat.from_binary(bytes(16 * @mib), {16 * @mib}, {:u, 8}, worker: w)
      error = assert_raise Error, fn -> Moat.to_binary(big) end
      assert error.op == :from_binary
      assert error.message =~ "memory limit exceeded: needs 16.0 MiB"
      assert Moat.to_binary(Moat.from_binary(<<1, 2, 3>>, {3}, {:u, 8}, worker: w)) == <<1, 2, 3>>
    end

    test "a released upload's file is kept for the next of its size, and clear_cache closes it", %{worker: w} do
      data = bytes(4 * @mib)
      ref = Moat.from_binary(data, {4 * @mib}, {:u, 8}, worker: w)
      assert memory_files(w) == 1
      Moat.deallocate(ref)
      assert Moat.memory_info(w).cache >= 4 * @mib
      again = Moat.from_binary(data, {4 * @mib}, {:u, 8}, worker: w)
      assert memory_files(w) == 1
      assert Moat.to_binary(again) == data
      Moat.deallocate(again)
      Moat.memory_info(w)
      Moat.clear_cache(w)
      assert memory_files(w) == 0
    end
  end

  describe "the client" do
    test "checks that it opened the worker's file and memory, not another process's" do
      w = start_worker(:shm_checks, log_level: :error)
      conn = Client.conn(w)
      path = Path.join(System.tmp_dir!(), "moat-not-the-worker-#{System.unique_integer([:positive])}")
      File.write!(path, "untouched")
      on_exit(fn -> File.rm(path) end)
      %File.Stat{inode: inode} = File.stat!(path)
      assert {:error, {:not_the_workers_file, ^inode, 1}} = Shared.write(%{path: path, inode: 1}, "overwritten")
      assert File.read!(path) == "untouched"
      assert {:error, {:not_the_worker, _}} = Shared.read(%{conn.shared | nonce: <<1::128>>}, conn.shared.address, 16)
    end

    @tag :capture_log
    test "falls back to the pipe when it cannot read the worker's memory after all" do
      w = start_worker(:shm_fallback, shared_memory_threshold: 1, log_level: :error)
      data = bytes(@mib)
      ref = Moat.from_binary(data, {@mib}, {:u, 8}, worker: w)
      conn = Client.conn(w)
      Client.publish(%{conn | shared: %{conn.shared | nonce: <<1::128>>}})
      assert Moat.to_binary(ref) == data
      Client.publish(conn)
      # The pin of the failed read was released.
      assert Moat.memory_info(w).tensors == 1
      assert Moat.shape(ref) == {@mib}
    end

    test "refuses upload frames sent as calls at once, naming the op" do
      w = start_worker(:seq_uploads, log_level: :error)
      conn = Client.conn(w)
      attrs = %{bytes: 8, dtype: {:u, 8}, shape: [8]}
      assert {:error, %Error{op: :from_binary} = e} = Client.call(conn, :from_binary, [], attrs)
      assert e.message =~ "from_binary is fire-and-forget: send it with seq 0"
      assert {:error, %Error{op: :upload} = e} = Client.call(conn, :upload, [], 0)
      assert e.message =~ "upload is fire-and-forget"
    end
  end

  describe "a caller that dies half way" do
    # Callers killed at random moments of uploads and readbacks, large enough
    # to take many frames on the pipe; afterwards the worker holds only what
    # is still referenced.
    for shared <- [true, false] do
      @tag :capture_log
      test "leaves nothing in the worker (shared memory: #{shared})" do
        if not Finalizer.loaded?(), do: flunk("needs the finalizer NIF: dropped handles are never released without it")
        name = :"dies_#{unquote(shared)}"
        w = start_worker(name, shared_memory: unquote(shared), chunk_bytes: @mib, gc_nudge: 20, log_level: :error)
        kept = Moat.from_binary(bytes(8 * @mib), {8 * @mib}, {:u, 8}, worker: w)
        data = bytes(16 * @mib)
        baseline = Moat.memory_info(w)

        for round <- 1..40 do
          pid =
            spawn(fn ->
              Stream.repeatedly(fn ->
                if rem(round, 2) == 0,
                  do: Moat.to_binary(kept),
                  else: Moat.from_binary(data, {16 * @mib}, {:u, 8}, worker: w) |> Moat.eval()
              end)
              |> Stream.run()
            end)

          Process.sleep(:rand.uniform(30))
          Process.exit(pid, :kill)
        end

        eventually(
          fn ->
            info = Moat.memory_info(w)
            info.tensors == baseline.tensors and info.active == baseline.active
          end,
          5_000
        )

        Moat.clear_cache(w)
        # Only `kept`'s own file, through shared memory (on a GPU none: an
        # upload is copied to the card and its file closed).
        assert memory_files(w) == if(unquote(shared) and not gpu?(), do: 1, else: 0)
        assert Moat.to_binary(kept) |> byte_size() == 8 * @mib
      end
    end
  end

  describe "a worker that dies half way" do
    @tag :capture_log
    test "gives every caller of a large transfer an error naming the op" do
      name = :transfer_crash
      start_worker(name, worker_path: Reliability.fault_worker_path(), chunk_bytes: 4 * @mib, log_level: :error)
      kept = Moat.from_binary(bytes(32 * @mib), {32 * @mib}, {:u, 8}, worker: name)
      data = bytes(32 * @mib)
      generation = Moat.Worker.info(name).generation

      # Readers of `kept` always fail once it is gone; a writer that was
      # between uploads when the worker died goes on with the next worker.
      callers =
        for i <- 1..8 do
          Task.async(fn ->
            deadline = System.monotonic_time(:millisecond) + 3_000

            try do
              Stream.repeatedly(fn ->
                if rem(i, 2) == 0,
                  do: Moat.to_binary(kept),
                  else: Moat.from_binary(data, {32 * @mib}, {:u, 8}, worker: name) |> Moat.eval()
              end)
              |> Enum.find(fn _ -> System.monotonic_time(:millisecond) > deadline end)

              {i, :finished}
            rescue
              e in Error -> {i, e}
            end
          end)
        end

      Process.sleep(150)
      Reliability.inject(name, :sigkill)

      for {i, result} <- Task.await_many(callers, 15_000) do
        if result == :finished do
          assert rem(i, 2) == 1, "reader #{i} did not notice its worker die"
        else
          assert %Error{reason: reason, op: op, message: message} = result
          assert reason in [:worker_died, :worker_unavailable, :stale_generation], inspect(result)

          assert op in [:to_binary, :from_binary, :eval] or (reason == :worker_unavailable and op == nil),
                 inspect(result)

          assert message =~ ~r/SIGKILL|restarted|not running|no Moat worker|port is closed/, message
        end
      end

      await_generation_after(name, generation)
    end
  end
end
