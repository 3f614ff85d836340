defmodule Moat.ZeroCopyReadbackTest do
  # Large CPU results live in memory files (port/shim/alloc.cpp), and a
  # readback on a process_vm connection maps the tensor's own buffer,
  # made read-only and sealed by the worker (protocol.md §6, "Zero-copy
  # readback"): no copy at all, the binary outlives the worker, and MLX
  # never writes into an exported buffer again (it copies where it would
  # have donated it).
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Finalizer, KVCache, Ref, Reliability}

  @mib 1024 * 1024

  @moduletag :capture_log
  # A GPU worker exports nothing (its buffers are CUDA memory, read back
  # through sealed files: Moat.Shared.negotiate/3).
  @moduletag :cpu_only

  defp bytes(n), do: :crypto.strong_rand_bytes(n)

  # The VM's mappings of workers' buffer files, as the set of the files'
  # inodes: a binary mapped by an earlier step can be collected (and
  # unmapped) at any GC, so tests look for new files, not for counts.
  defp buffer_maps, do: mapped_files("memfd:moat-buffer")
  defp upload_maps, do: mapped_files("memfd:moat-upload")

  defp mapped_files(name) do
    for line <- String.split(File.read!("/proc/self/maps"), "\n"),
        line =~ name,
        into: MapSet.new(),
        do: line |> String.split() |> Enum.at(4)
  end

  # The files mapped now and not in `before`.
  defp new_maps(now, before), do: MapSet.difference(now, before)

  # The worker's descriptors of buffer files (live and cached).
  defp buffer_fds(worker) do
    worker |> os_pid() |> Reliability.open_fds() |> Enum.count(fn {_, target} -> target =~ "memfd:moat-buffer" end)
  end

  defp ref(%Nx.Tensor{data: %Moat.Backend{ref: ref}}), do: ref

  defp upload(data, type, w), do: Nx.from_binary(data, type, backend: {Moat.Backend, worker: w})

  test "a large computed result is read back as a mapping of its own buffer: right bytes, several types, offsets" do
    assert Finalizer.loaded?()
    w = start_worker(:zero_copy_types, log_level: :error)
    assert Client.conn(w).shared.via == :process_vm

    # The binaries read so far stay alive, so that the counts of mappings
    # only grow.
    Process.put(:held, [])

    for type <- device_types([{:u, 8}, {:s, 16}, {:f, 32}, {:f, 64}, {:c, 64}]) do
      data = bytes(2 * @mib + 64)
      t = upload(data, type, w)
      # A result of MLX's: a buffer of its own, in a memory file.
      both = Nx.concatenate([t, t])
      :ok = Moat.eval(ref(both))
      assert File.read!("/proc/#{os_pid(w)}/maps") =~ ~r/rw-s .*memfd:moat-buffer/
      before = buffer_maps()
      assert {:shared_memory, got} = read_back(ref(both))
      assert got == data <> data, inspect(type)
      assert MapSet.size(new_maps(buffer_maps(), before)) == 1, "the readback maps the buffer's file (#{inspect(type)})"
      Process.put(:held, [got | Process.get(:held)])

      # The tail from an element past the start (negative padding: a view
      # into the buffer of the padded result, read at its offset there).
      {_, bits} = type
      item = div(bits, 8)
      n = div(byte_size(data), item)
      tail = Nx.pad(both, 0, [{-(n + 3), 0, 0}])
      expected_tail = binary_part(got, (n + 3) * item, (n - 3) * item)

      assert {:shared_memory, ^expected_tail} =
               read_back(ref(tail)) |> tap(&Process.put(:held, [&1 | Process.get(:held)]))
    end

    # The reply, at the protocol's level: the file, its size, the offset.
    conn = Client.conn(w)
    data = bytes(4 * @mib)
    t = upload(data, {:u, 8}, w)
    sliced = Nx.pad(Nx.concatenate([t, t]), 0, [{-(4 * @mib + 4096 + 5), -(3 * @mib - 4096 - 5), 0}])
    expected = binary_part(data, 4096 + 5, @mib)
    :ok = Moat.eval(ref(sliced))
    pin = Client.new_id()
    attrs = %{pin: 0, export: true}
    assert {:ok, reply, _} = Client.request(conn, :to_binary, [pin], [ref(sliced).id], attrs, :infinity)
    assert %{path: path, inode: inode, file_bytes: file_bytes, offset: offset, bytes: @mib} = reply
    assert offset == 8 + 4 * @mib + 4096 + 5
    assert file_bytes >= offset + @mib
    assert {:ok, ^expected} = Finalizer.map_sealed(path, inode, file_bytes, offset, @mib)
    # The worker's own mapping of it is read-only now.
    [_, fd] = Regex.run(~r{/fd/(\d+)$}, path)
    worker_maps = File.read!("/proc/#{os_pid(w)}/maps")
    assert worker_maps =~ ~r/r--s .*memfd:moat-buffer/
    assert Finalizer.map_sealed(path, inode, file_bytes + 1, 0, 1) == {:error, :wrong_size}
    assert Finalizer.map_sealed(path, inode + 1, file_bytes, 0, 1) == {:error, :not_the_workers_file}
    assert_raise ArgumentError, fn -> Finalizer.map_sealed(path, inode, file_bytes, file_bytes, 1) end
    assert File.exists?("/proc/#{os_pid(w)}/fd/#{fd}")
    send(conn.releaser, {:moat_release, pin})

    # A small result comes through the pipe.
    small = Nx.add(upload(bytes(1000), {:u, 8}, w), 1)
    assert {:pipe, <<_::binary-size(1000)>>} = read_back(ref(small))
  end

  test "an upload's readback maps its memory file, and a tensor read back again returns the mapping it kept" do
    w = start_worker(:zero_copy_again, log_level: :error)
    data = bytes(4 * @mib)
    up = Moat.from_binary(data, {4 * @mib}, {:u, 8}, worker: w)
    before = upload_maps()
    assert {:shared_memory, ^data} = read_back(up)
    assert MapSet.size(mapped = new_maps(upload_maps(), before)) == 1
    # Again: the same mapping, no new one, the same bytes.
    for _ <- 1..3, do: assert({:shared_memory, ^data} = read_back(up))
    assert new_maps(upload_maps(), before) == mapped

    computed = Nx.concatenate([upload(data, {:u, 8}, w), upload(data, {:u, 8}, w)])
    maps = buffer_maps()
    for _ <- 1..3, do: assert({:shared_memory, _} = read_back(ref(computed)))
    assert MapSet.size(new_maps(buffer_maps(), maps)) == 1
    assert Nx.to_binary(computed) == data <> data

    # Another tensor over the same buffer (a view) reads the same bytes.
    tail = Nx.pad(computed, 0, [{-(4 * @mib), 0, 0}])
    assert Nx.to_binary(tail) == data

    # An exported upload's file is never reused for another upload (the
    # client would write into the pages the VM's binary maps).
    held = Moat.to_binary(up)
    snapshot = :binary.copy(held)
    Moat.deallocate(up)

    for _ <- 1..3 do
      more = bytes(4 * @mib)
      fresh = Moat.from_binary(more, {4 * @mib}, {:u, 8}, worker: w)
      assert {:shared_memory, ^more} = read_back(fresh)
      Moat.deallocate(fresh)
    end

    assert held == snapshot
  end

  test "a mapped readback stays readable and correct after its worker is killed" do
    name = :zero_copy_killed
    w = start_worker(name, log_level: :error)
    data = bytes(8 * @mib)
    both = Nx.concatenate([upload(data, {:u, 8}, w), upload(data, {:u, 8}, w)])
    before = buffer_maps()
    assert {:shared_memory, held} = read_back(ref(both))
    assert MapSet.size(new_maps(buffer_maps(), before)) == 1
    generation = Moat.Worker.info(w).generation
    pid = os_pid(w)

    kill(pid)
    eventually(fn -> not os_alive?(pid) end)
    await_generation_after(name, generation)

    assert held == data <> data
    assert :crypto.hash(:sha256, :binary.copy(held)) == :crypto.hash(:sha256, data <> data)
    parent = self()
    spawn(fn -> send(parent, {:read, :erlang.md5(held)}) end)
    assert_receive {:read, digest}, 10_000
    assert digest == :erlang.md5(data <> data)
  end

  test "ops that would write into an exported buffer copy instead: right results, the worker alive, the binary unchanged" do
    w = start_worker(:zero_copy_donate, log_level: :error)
    backend = {Moat.Backend, worker: w}
    pid = os_pid(w)

    # A KV cache read back, then written: kv_write writes in place only into
    # a buffer nothing else holds.
    cache = KVCache.new(batch: 1, heads: 4, max_len: 2048, head_dim: 512, backend: backend)
    rows = Nx.iota({1, 4, 1, 512}, type: :f32, backend: backend)
    cache = KVCache.update(cache, rows, rows)
    held = Nx.to_binary(cache.keys)
    snapshot = :binary.copy(held)
    cache = KVCache.update(cache, Nx.add(rows, 1), rows)
    assert Nx.to_flat_list(Nx.slice(cache.keys, [0, 3, 0, 0], [1, 1, 2, 2])) == [1536.0, 1537.0, 1537.0, 1538.0]
    # Read back and written again, several times.
    cache =
      Enum.reduce(2..5, cache, fn i, cache ->
        _ = Nx.to_binary(cache.keys)
        KVCache.update(cache, Nx.add(rows, i), rows)
      end)

    assert Nx.to_flat_list(Nx.slice(cache.keys, [0, 0, 5, 0], [1, 1, 1, 2])) == [5.0, 6.0]
    assert held == snapshot

    # An add whose input is gone by the time it is evaluated: MLX would give
    # the input's buffer to the output.
    data = bytes(4 * @mib)

    {sum, held, snapshot, name} =
      (fn ->
         t = Nx.concatenate([upload(data, {:u, 8}, w), upload(data, {:u, 8}, w)])
         held = Nx.to_binary(t)
         {Nx.add(t, 1), held, :binary.copy(held), Map.from_struct(%{ref(t) | token: nil})}
       end).()

    :erlang.garbage_collect()

    eventually(fn ->
      Moat.memory_info(w)

      try do
        Moat.shape(struct!(Ref, name))
        false
      rescue
        Moat.Error -> true
      end
    end)

    expected = for <<b <- data <> data>>, into: <<>>, do: <<rem(b + 1, 256)>>
    assert Nx.to_binary(sum) == expected
    assert held == snapshot
    assert os_pid(w) == pid
  end

  test "exported buffers are freed once nothing holds them, and the memory limit counts buffer files" do
    w = start_worker(:zero_copy_freed, log_level: :error)
    data = bytes(2 * @mib)
    base = upload(data, {:u, 8}, w)
    :ok = Moat.eval(ref(base))
    Moat.clear_cache(w)
    fds = buffer_fds(w)
    maps = buffer_maps()

    for i <- 1..30 do
      t = Nx.add(base, i)
      <<first, _::binary>> = Nx.to_binary(t)
      assert first == rem(:binary.first(data) + i, 256)
    end

    :erlang.garbage_collect()

    eventually(fn ->
      # The releases of the collected tensors let go of their exported
      # buffers; what MLX freed before is cached (and cleared here).
      Moat.clear_cache(w)
      buffer_fds(w) <= fds
    end)

    eventually(fn ->
      :erlang.garbage_collect()
      MapSet.subset?(buffer_maps(), maps)
    end)

    # Live buffer files count against the limit.
    Moat.set_memory_limit(40 * @mib, w)
    t = Nx.concatenate(for _ <- 1..12, do: base)
    assert byte_size(Nx.to_binary(t)) == 24 * @mib
    assert Moat.memory_info(w).active >= 24 * @mib
    error = assert_raise Moat.Error, fn -> Nx.to_binary(Nx.concatenate([t, base])) end
    assert error.message =~ "memory limit exceeded"
    assert Nx.to_binary(Nx.add(base, 0)) == data
  end

  test "a buffer file that is not sealed is refused, and the tensor is read another way" do
    w = start_worker(:zero_copy_refused, worker_path: Reliability.fault_worker_path(), log_level: :error)
    assert Client.conn(w).shared.via == :process_vm
    data = bytes(2 * @mib)
    t = upload(data, {:u, 8}, w)
    assert {:shared_memory, first} = read_back(ref(Nx.concatenate([t, t])))
    assert first == data <> data

    Reliability.inject(w, :unsealed)
    before = buffer_maps()
    fresh = Nx.concatenate([t, t, t])
    assert {:shared_memory, got} = read_back(ref(fresh))
    assert got == data <> data <> data
    assert new_maps(buffer_maps(), before) == MapSet.new(), "an unsealed file is never mapped"
    # The same tensor again: still not mapped, still right.
    assert {:shared_memory, ^got} = read_back(ref(fresh))
    assert new_maps(buffer_maps(), before) == MapSet.new()
    assert first == data <> data
  end

  test "many concurrent large and small readers: each gets its own answer" do
    w = start_worker(:zero_copy_many, log_level: :error)
    backend = {Moat.Backend, worker: w}

    tasks =
      for i <- 1..8 do
        Task.async(fn ->
          n = if rem(i, 2) == 0, do: @mib + i, else: 100 + i
          data = :binary.copy(<<i>>, n)
          t = Nx.from_binary(data, :u8, backend: backend)

          for j <- 1..10 do
            expected = :binary.copy(<<i + j>>, 2 * n)
            assert Nx.to_binary(Nx.concatenate([Nx.add(t, j), Nx.add(t, j)])) == expected
          end

          :ok
        end)
      end

    assert Enum.map(tasks, &Task.await(&1, 60_000)) == List.duplicate(:ok, 8)
  end
end
