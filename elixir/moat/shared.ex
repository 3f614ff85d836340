defmodule Moat.Shared do
  @moduledoc false
  # Same-host transfers through shared memory, the client's file side
  # (protocol.md §6, "Shared memory"). Moat.Client runs the protocol; this
  # module opens, checks, reads and writes.
  #
  # Uploads: the worker makes a memory file (a memfd, which has no name and
  # dies with the worker) and answers with `/proc/<pid>/fd/<n>` and its
  # inode; we open it, check the inode (so that a dead worker's pid taken by
  # another process is never written to) and write the bytes with one pwrite.
  #
  # Readbacks: the worker keeps the evaluated tensor pinned and answers with
  # its address, and the worker drops the pin on release. Where the
  # finalizer NIF is loaded and the kernel lets this VM read the worker's
  # memory (the same user, no ptrace restriction against it), the NIF copies
  # the bytes with one process_vm_readv into memory of this VM
  # (Moat.Finalizer.read_memory/5, `via: :process_vm`): the binary is the
  # VM's own, so nothing the worker does later can touch it. Each read also
  # reads the probe bytes the worker announced in its hello, in the same
  # call, so a dead worker's pid taken by another process is never read.
  # Where that is refused but the NIF is loaded, the worker copies the tensor
  # into a memory file sealed against shrinking and writing, and the NIF maps
  # that read-only as a binary (Moat.Finalizer.map_sealed/3, `via: :sealed`):
  # the mapping outlives the worker (a sealed file cannot be truncated under
  # it, so no SIGBUS can reach the VM). A file that is not sealed, or not the
  # one announced, is refused: the pipe then carries it. Without the NIF,
  # one pread from `/proc/<pid>/mem` after the same probe check (`via:
  # :proc_mem`).
  #
  # Both are single copies, measured here (bench/foundation.exs): the pipe
  # costs two on the way in and three on the way out. Raw files belong to the
  # process that opens them and close when it exits, so nothing is left open
  # when a caller dies.

  alias Moat.Finalizer

  @probe_bytes 16

  @typedoc "What a connection uses for shared-memory transfers."
  @type t :: %{
          mem: String.t(),
          address: non_neg_integer(),
          nonce: binary(),
          threshold: non_neg_integer(),
          os_pid: pos_integer(),
          via: :process_vm | :sealed | :proc_mem
        }

  @doc """
  The shared-memory settings for a worker whose hello is `info`, or nil when
  it offers none or this VM cannot read its memory (another host, another
  user, a kernel that forbids it): transfers then use the pipe. `mode` is
  the `:shared_memory` option: `true` takes the fastest readback the host
  allows, `:sealed_files` only sealed files (their copy is kept as the
  worker's cache, so a tensor read back again maps it without a copy).
  """
  @spec negotiate(map(), non_neg_integer(), true | :sealed_files) :: t() | nil
  def negotiate(info, threshold, mode \\ true)

  def negotiate(%{shared_memory: %{address: address, nonce: nonce}, os_pid: os_pid} = info, threshold, mode)
      when is_integer(address) and byte_size(nonce) == @probe_bytes and mode in [true, :sealed_files] do
    shared = %{mem: "/proc/#{os_pid}/mem", address: address, nonce: nonce, threshold: threshold, os_pid: os_pid}

    # Every way checks the probe first: a pid that is not this worker's
    # leaves the pipe. A GPU worker keeps sealed files: MLX's CUDA allocator
    # puts every buffer in CUDA managed memory. process_vm_readv reads it
    # (bench/gpu_managed_readback.py on an H100: right bytes, 1.6 GB/s while
    # the pages migrate to the host, 6.9 GB/s once there), but Moat's GPU
    # worker has not been run that way (bin/gpu).
    cond do
      mode == true and :gpu not in Map.get(info, :devices, []) and match?({:ok, _}, read_memory(shared, address, 0)) ->
        Map.put(shared, :via, :process_vm)

      not match?({:ok, _}, read(shared, address, 0)) ->
        nil

      Finalizer.loaded?() ->
        Map.put(shared, :via, :sealed)

      true ->
        Map.put(shared, :via, :proc_mem)
    end
  end

  def negotiate(_info, _threshold, _mode), do: nil

  @doc "Writes `binary` into the memory file an `:upload_file` reply located."
  @spec write(%{path: binary(), inode: non_neg_integer()}, binary()) :: :ok | {:error, term()}
  def write(%{path: path, inode: inode}, binary) do
    with {:ok, fd} <- :file.open(path, [:read, :write, :raw, :binary]) do
      try do
        with :ok <- same_inode(fd, inode), do: :file.pwrite(fd, 0, binary)
      after
        :file.close(fd)
      end
    end
  end

  def write(location, _binary), do: {:error, {:bad_location, location}}

  defp same_inode(fd, inode) do
    # file:read_handle_info/2 is OTP 26+; prim_file has it since OTP 21.
    case :prim_file.read_handle_info(fd, []) do
      {:ok, info} when elem(info, 11) == inode -> :ok
      {:ok, info} -> {:error, {:not_the_workers_file, elem(info, 11), inode}}
      error -> error
    end
  end

  @doc "The attrs of a pinned `:to_binary` (protocol.md §6, \"Shared memory\")."
  @spec pin_attrs(t()) :: map()
  def pin_attrs(%{threshold: threshold, via: :sealed}), do: %{pin: threshold, sealed: true}
  def pin_attrs(%{threshold: threshold, via: :process_vm}), do: %{pin: threshold, export: true}
  def pin_attrs(%{threshold: threshold}), do: %{pin: threshold}

  @doc """
  The attrs of a pinned `:to_binary` that takes no exported buffer: after a
  refused mapping of one, the next try reads the pin's address (or a sealed
  copy).
  """
  @spec plain_pin_attrs(t()) :: map()
  def plain_pin_attrs(shared), do: shared |> pin_attrs() |> Map.delete(:export)

  @doc """
  The bytes of a pinned readback whose reply is `meta`: its sealed file
  mapped (`path`), or read at its `address`.
  """
  @spec read_pinned(t(), map()) :: {:ok, binary()} | {:error, term()}
  def read_pinned(_shared, %{path: path, inode: inode, file_bytes: file_bytes, offset: offset, bytes: bytes}),
    do: Finalizer.map_sealed(path, inode, file_bytes, offset, bytes)

  def read_pinned(_shared, %{path: path, inode: inode, bytes: bytes}), do: Finalizer.map_sealed(path, inode, bytes)

  def read_pinned(%{via: :process_vm} = shared, %{address: address, bytes: bytes}),
    do: read_memory(shared, address, bytes)

  def read_pinned(shared, %{address: address, bytes: bytes}), do: read(shared, address, bytes)

  defp read_memory(%{os_pid: os_pid, address: probe, nonce: nonce}, address, bytes),
    do: Finalizer.read_memory(os_pid, probe, nonce, address, bytes)

  @doc "Reads `bytes` bytes at `address` of the worker's memory through `/proc/<pid>/mem`."
  @spec read(t(), non_neg_integer(), non_neg_integer()) :: {:ok, binary()} | {:error, term()}
  def read(%{mem: mem, address: probe, nonce: nonce}, address, bytes) do
    with {:ok, fd} <- :file.open(mem, [:read, :raw, :binary]) do
      try do
        case pread(fd, probe, @probe_bytes, :probe) do
          {:ok, ^nonce} -> pread(fd, address, bytes, :data)
          {:ok, other} -> {:error, {:not_the_worker, other}}
          error -> error
        end
      after
        :file.close(fd)
      end
    end
  end

  defp pread(_fd, _at, 0, _what), do: {:ok, <<>>}

  defp pread(fd, at, n, what) do
    case :file.pread(fd, at, n) do
      {:ok, data} when byte_size(data) == n -> {:ok, data}
      {:ok, data} when what == :probe -> {:error, {:not_the_worker, data}}
      {:ok, data} -> {:error, {:short_read, byte_size(data), n}}
      :eof -> {:error, :eof}
      error -> error
    end
  end
end
