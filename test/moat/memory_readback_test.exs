defmodule Moat.MemoryReadbackTest do
  # Large readbacks copied out of the worker's memory into the VM's own
  # (protocol.md §6, "Shared memory"; Moat.Finalizer.read_memory/5, one
  # process_vm_readv): the default where the kernel allows it. The binary
  # belongs to the VM, so it survives the worker and what the worker does
  # next; a read that cannot get every byte of the worker's tensor fails,
  # and the pipe carries the tensor.
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.{Client, Finalizer, Reliability}

  @mib 1024 * 1024

  @moduletag :capture_log

  defp bytes(n), do: :crypto.strong_rand_bytes(n)

  # The VM's mappings of the worker's files (a readback copied into the VM
  # maps none).
  defp mapped_worker_files do
    "/proc/self/maps" |> File.read!() |> String.split("\n") |> Enum.count(&(&1 =~ ~r/moat-(readback|spare)/))
  end

  defp worker_files(worker) do
    worker |> os_pid() |> Reliability.open_fds() |> Enum.count(fn {_, target} -> target =~ "moat-readback" end)
  end

  # process_vm_readv is the CPU worker's way; a GPU worker keeps sealed files.
  @tag :cpu_only
  test "a large readback is a copy into the VM's memory: right bytes, no file, and later readbacks leave it alone" do
    assert Finalizer.loaded?()
    w = start_worker(:memory_trips, shared_memory_threshold: 64 * 1024, log_level: :error)
    assert Client.conn(w).shared.via == :process_vm
    before = mapped_worker_files()

    data = bytes(3 * @mib + 5)
    ref = Moat.from_binary(data, {byte_size(data)}, {:u, 8}, worker: w)
    assert {:shared_memory, first} = read_back(ref)
    assert first == data
    assert {:shared_memory, ^data} = read_back(ref)
    assert mapped_worker_files() == before
    assert worker_files(w) == 0

    # A computed tensor (MLX's own buffer), and Nx tensors of several types.
    sum = Nx.add(Nx.from_binary(data, :u8, backend: {Moat.Backend, worker: w}), 1)
    assert Nx.to_binary(sum) == for(<<b <- data>>, into: <<>>, do: <<rem(b + 1, 256)>>)

    for type <- device_types([{:s, 16}, {:f, 32}, {:f, 64}, {:c, 64}]) do
      t = Nx.iota({300, 257}, type: type, backend: Nx.BinaryBackend)
      assert Nx.to_binary(Nx.backend_transfer(t, {Moat.Backend, worker: w})) == Nx.to_binary(t), inspect(type)
    end

    # Buffers of dead readbacks are reused for the next ones of about their
    # size: each readback its own bytes, and a binary still alive is never
    # written into.
    snapshot = :binary.copy(first)

    for n <- [3 * @mib + 5, 3 * @mib, 2 * @mib + 1, 5 * @mib, 3 * @mib + 5, 70 * 1024] do
      more = bytes(n)
      fresh = Moat.from_binary(more, {n}, {:u, 8}, worker: w)
      assert {:shared_memory, ^more} = read_back(fresh)
      Moat.deallocate(fresh)
      :erlang.garbage_collect()
    end

    assert first == snapshot
    Finalizer.trim_pool()
    assert {:shared_memory, ^data} = read_back(ref)
  end

  # Both ways of reading back large tensors: a copy into the VM's memory,
  # and a sealed file mapped as a binary (whose pages belong to the mapping
  # once the worker is gone).
  for {mode, via} <- [{true, :process_vm}, {:sealed_files, :sealed}] do
    # process_vm_readv is the CPU worker's way; a GPU worker keeps sealed files.
    if via == :process_vm, do: @tag(:cpu_only)

    test "a #{via} readback stays readable and correct after its worker is killed" do
      name = :"memory_killed_#{unquote(via)}"
      w = start_worker(name, shared_memory: unquote(mode), log_level: :error)
      assert Client.conn(w).shared.via == unquote(via)
      data = bytes(8 * @mib)
      ref = Moat.from_binary(data, {8 * @mib}, {:u, 8}, worker: w)
      assert {:shared_memory, held} = read_back(ref)
      generation = Moat.Worker.info(w).generation
      pid = os_pid(w)

      kill(pid)
      eventually(fn -> not os_alive?(pid) end)
      await_generation_after(name, generation)

      assert held == data
      assert :crypto.hash(:sha256, :binary.copy(held)) == :crypto.hash(:sha256, data)
      # Sent to another process and read there too.
      parent = self()
      spawn(fn -> send(parent, {:read, :erlang.md5(held)}) end)
      assert_receive {:read, digest}, 10_000
      assert digest == :erlang.md5(data)
    end
  end

  # process_vm_readv is the CPU worker's way; a GPU worker keeps sealed files.
  @tag :cpu_only
  test "a pin at an address the worker does not map fails the read, and the pipe carries the tensor" do
    w = start_worker(:memory_wild, worker_path: Reliability.fault_worker_path(), log_level: :error)
    assert Client.conn(w).shared.via == :process_vm
    data = bytes(2 * @mib)
    ref = Moat.from_binary(data, {2 * @mib}, {:u, 8}, worker: w)
    assert {:shared_memory, ^data} = read_back(ref)

    Reliability.inject(w, :wild_pin)
    assert {:pipe, ^data} = read_back(ref)
    more = bytes(3 * @mib)
    fresh = Moat.from_binary(more, {3 * @mib}, {:u, 8}, worker: w)
    assert {:pipe, ^more} = read_back(fresh)
  end

  test "read_memory reads only the announced worker, and only every byte asked for" do
    w = start_worker(:memory_refusals, log_level: :error)
    %{os_pid: pid, address: probe, nonce: nonce} = Client.conn(w).shared

    assert Finalizer.read_memory(pid, probe, nonce, probe, 16) == {:ok, nonce}
    assert Finalizer.read_memory(pid, probe, nonce, probe, 0) == {:ok, <<>>}
    # Another nonce: the bytes at the probe are not what this pid announced
    # (another process that took a dead worker's pid).
    other = :binary.copy(<<0>>, 16)
    assert Finalizer.read_memory(pid, probe, other, probe, 16) == {:error, :not_the_worker}
    # Nothing mapped there: the probe read alone, or the data.
    assert Finalizer.read_memory(pid, 4096, nonce, probe, 16) == {:error, :efault}
    assert Finalizer.read_memory(pid, probe, nonce, 4096, 16) in [{:error, :efault}, {:error, :short_read}]
    # A process that is gone.
    # (`cat` runs until its input closes: its pid is read while it lives.)
    port = Port.open({:spawn, "cat"}, [:exit_status])
    {:os_pid, dead} = Port.info(port, :os_pid)
    Port.close(port)
    eventually(fn -> not os_alive?(dead) end)
    assert Finalizer.read_memory(dead, probe, nonce, probe, 16) == {:error, :esrch}

    assert_raise ArgumentError, fn -> Finalizer.read_memory(pid, probe, "short", probe, 16) end
    assert_raise ArgumentError, fn -> Finalizer.read_memory(0, probe, nonce, probe, 16) end
  end

  # From 16 MiB a readback is copied in parts, each on a thread of its own
  # with its own probe (nif/moat_finalizer.c, SPLIT_BYTES).
  test "a readback copied in parts: every byte in its place, and every part's probe checked" do
    w = start_worker(:memory_parts, log_level: :error)
    conn = Client.conn(w)
    %{os_pid: pid, address: probe, nonce: nonce} = conn.shared

    # Not a whole number of pages, nor of parts.
    data = bytes(20 * @mib + 4097)
    ref = Moat.from_binary(data, {byte_size(data)}, {:u, 8}, worker: w)
    assert {:shared_memory, ^data} = read_back(ref)
    # MLX's own buffer.
    t = Nx.from_binary(data, :u8, backend: {Moat.Backend, worker: w})
    assert Nx.to_binary(Nx.concatenate([t, t])) == data <> data

    # The pinned tensor, read directly.
    pin = Client.new_id()
    assert {:ok, %{address: at, bytes: n}, _} = Client.request(conn, :to_binary, [pin], [ref.id], %{pin: 0}, :infinity)
    assert n == byte_size(data)
    assert Finalizer.read_memory(pid, probe, nonce, at, n) == {:ok, data}
    assert Finalizer.read_memory(pid, probe, nonce, at + 4096, n - 8192) == {:ok, binary_part(data, 4096, n - 8192)}
    assert Finalizer.read_memory(pid, probe, :binary.copy(<<7>>, 16), at, n) == {:error, :not_the_worker}
    assert Finalizer.read_memory(pid, 4096, nonce, at, n) == {:error, :efault}
    send(conn.releaser, {:moat_release, pin})
  end
end
