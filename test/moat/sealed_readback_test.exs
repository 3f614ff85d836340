defmodule Moat.SealedReadbackTest do
  # Large readbacks through a sealed memory file mapped as a binary
  # (protocol.md §6, "Shared memory"; Moat.Finalizer.map_sealed/3, chosen
  # with `shared_memory: :sealed_files`, and where the kernel refuses
  # process_vm_readv): what the VM holds survives the worker, a file that is
  # not sealed is refused for the pipe, and small reads from many callers
  # each get their own answer.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Finalizer, Reliability}

  @mib 1024 * 1024

  defp bytes(n), do: :crypto.strong_rand_bytes(n)

  defp readback_files(worker) do
    worker |> os_pid() |> Reliability.open_fds() |> Enum.count(fn {_, target} -> target =~ "moat-readback" end)
  end

  # Spare readback files: made in the background, not sealed yet, waiting
  # for the next readback of their size.
  defp spare_files(worker) do
    worker |> os_pid() |> Reliability.open_fds() |> Enum.count(fn {_, target} -> target =~ "moat-spare" end)
  end

  defp spare_mappings do
    "/proc/self/maps" |> File.read!() |> String.split("\n") |> Enum.count(&(&1 =~ "moat-spare"))
  end

  # The VM's mappings of sealed readback files (a binary over one is not
  # memory of the VM's own allocators).
  defp mapped_files do
    "/proc/self/maps" |> File.read!() |> String.split("\n") |> Enum.count(&(&1 =~ "moat-readback"))
  end

  @moduletag :capture_log

  test "a large readback is a mapping of a sealed file, kept for the tensor's next readback" do
    assert Finalizer.loaded?()
    w = start_worker(:sealed_trips, shared_memory: :sealed_files, shared_memory_threshold: 64 * 1024, log_level: :error)
    assert Client.conn(w).shared.via == :sealed
    data = bytes(3 * @mib + 5)
    ref = Moat.from_binary(data, {byte_size(data)}, {:u, 8}, worker: w)
    before = mapped_files()

    assert {:shared_memory, first} = read_back(ref)
    assert first == data
    assert readback_files(w) == 1
    # Two readbacks alive, each a mapping of the first readback's file.
    assert {:shared_memory, second} = read_back(ref)
    assert second == data
    assert readback_files(w) == 1
    assert mapped_files() == before + 2
    assert first == second
    assert Moat.memory_info(w).cache >= byte_size(data)

    # A computed tensor, and Nx tensors of several types.
    sum = Nx.add(Nx.from_binary(data, :u8, backend: {Moat.Backend, worker: w}), 1)
    expected = for <<b <- data>>, into: <<>>, do: <<rem(b + 1, 256)>>
    assert Nx.to_binary(sum) == expected

    for type <- device_types([{:s, 16}, {:f, 32}, {:f, 64}, {:c, 64}]) do
      t = Nx.iota({300, 257}, type: type, backend: Nx.BinaryBackend)
      assert Nx.to_binary(Nx.backend_transfer(t, {Moat.Backend, worker: w})) == Nx.to_binary(t), inspect(type)
    end

    # Releasing a tensor drops its file from the cache.
    Moat.deallocate(ref)
    Nx.backend_deallocate(sum)
    Moat.memory_info(w)
    Moat.clear_cache(w)
    assert readback_files(w) == 0
  end

  test "readbacks of one size in a row take spare files: each its own bytes; a spare is cache" do
    w =
      start_worker(:sealed_spares, shared_memory: :sealed_files, shared_memory_threshold: 64 * 1024, log_level: :error)

    n = 2 * @mib + 3

    read_fresh = fn ->
      data = bytes(n)
      ref = Moat.from_binary(data, {n}, {:u, 8}, worker: w)
      assert {:shared_memory, binary} = read_back(ref)
      Moat.deallocate(ref)
      assert binary == data
      binary
    end

    # A readback from a spare file: the VM maps one more spare.
    from_spare? = fn ->
      before = spare_mappings()
      binary = read_fresh.()
      {spare_mappings() > before, binary}
    end

    # One readback of a size gets no spare; from the second in a row on, a
    # spare is made in the background, and a later readback is written
    # into it.
    read_fresh.()
    assert spare_files(w) == 0
    held = eventually(fn -> with {true, binary} <- from_spare?.(), do: binary, else: (_ -> false) end, 30_000)
    assert Moat.memory_info(w).cache >= n
    # More in a row, spares or not: every one its own bytes, and what the
    # VM holds from the spare unchanged by the spares that follow.
    snapshot = :binary.copy(held)
    for _ <- 1..8, do: read_fresh.()
    assert held == snapshot

    # A spare counts as cache: clear_cache drops it, and one being made
    # when the cache is cleared is not kept, so the next readback of the
    # size is not written into a spare.
    Moat.clear_cache(w)
    assert {false, _} = from_spare?.()

    # Without room in the cache no spare is kept, and readbacks of the size
    # still come back right, through new files.
    Moat.set_cache_limit(0, w)
    for _ <- 1..6, do: assert({false, _} = from_spare?.())
    assert held == snapshot
  end

  test "a readback file that is not sealed is refused, and the pipe carries the tensor" do
    w =
      start_worker(:sealed_refused,
        shared_memory: :sealed_files,
        worker_path: Reliability.fault_worker_path(),
        log_level: :error
      )

    data = bytes(2 * @mib)
    ref = Moat.from_binary(data, {2 * @mib}, {:u, 8}, worker: w)
    assert {:shared_memory, ^data} = read_back(ref)

    # From now on the worker hands out files nobody sealed: were they
    # mapped, it could change (or shrink) them under the VM's binary.
    Reliability.inject(w, :unsealed)
    more = bytes(2 * @mib)
    fresh = Moat.from_binary(more, {2 * @mib}, {:u, 8}, worker: w)
    assert {:pipe, ^more} = read_back(fresh)
    # The file already sealed and kept for `ref` is still used.
    assert {:shared_memory, ^data} = read_back(ref)
  end

  test "map_sealed refuses files that are not a sealed file of the announced size and inode" do
    path = Path.join(System.tmp_dir!(), "moat-sealed-#{System.unique_integer([:positive])}")
    File.write!(path, "not sealed")
    on_exit(fn -> File.rm(path) end)
    %File.Stat{inode: inode, size: size} = File.stat!(path)

    assert Finalizer.map_sealed(path, inode, size) == {:error, :not_sealed}
    assert Finalizer.map_sealed(path, inode + 1, size) == {:error, :not_the_workers_file}
    assert Finalizer.map_sealed(path, inode, size + 1) == {:error, :wrong_size}
    assert Finalizer.map_sealed(path <> "-gone", inode, size) == {:error, :enoent}
    assert_raise ArgumentError, fn -> Finalizer.map_sealed(path, inode, 0) end
  end

  test "many concurrent small reads: every caller gets its own answers, in order" do
    w = start_worker(:sealed_many, log_level: :error)
    backend = {Moat.Backend, worker: w}

    # Beside them, a few callers read large tensors through sealed files.
    large =
      for i <- 1..4 do
        Task.async(fn ->
          data = :binary.copy(<<i>>, @mib + i)
          ref = Moat.from_binary(data, {@mib + i}, {:u, 8}, worker: w)
          for _ <- 1..10, do: assert(Moat.to_binary(ref) == data)
        end)
      end

    results =
      1..32
      |> Enum.map(fn i ->
        Task.async(fn ->
          t = Nx.tensor([i, i * 2, i * 3, i * 4], type: :s32, backend: backend)

          for j <- 1..50 do
            # A fire-and-forget op, then a read that depends on it.
            {j, t |> Nx.add(j) |> Nx.to_binary()}
          end
        end)
      end)
      |> Task.await_many(60_000)

    Task.await_many(large, 60_000)

    for {answers, i} <- Enum.with_index(results, 1), {{j, got}, k} <- Enum.with_index(answers, 1) do
      assert j == k
      assert got == for(k <- 1..4, into: <<>>, do: <<k * i + j::signed-32-native>>)
    end
  end
end
