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
  # its address; we read it with one pread from `/proc/<pid>/mem`, after
  # checking that the probe bytes the worker announced in its hello are
  # there (the same pid check). The worker then drops the pin on release.
  # Where the finalizer NIF is loaded, the worker copies the tensor into a
  # memory file sealed against shrinking and writing instead, and the NIF
  # maps that read-only as a binary (Moat.Finalizer.map_sealed/3): no copy
  # on this side, and the mapping outlives the worker (a sealed file cannot
  # be truncated under it, so no SIGBUS can reach the VM). A file that is not
  # sealed, or not the one announced, is refused: the pipe then carries it.
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
          sealed: boolean()
        }

  @doc """
  The shared-memory settings for a worker whose hello is `info`, or nil when
  it offers none or this VM cannot read its memory (another host, another
  user, a kernel that forbids it): transfers then use the pipe.
  """
  @spec negotiate(map(), non_neg_integer()) :: t() | nil
  def negotiate(%{shared_memory: %{address: address, nonce: nonce}, os_pid: os_pid}, threshold)
      when is_integer(address) and byte_size(nonce) == @probe_bytes do
    shared = %{
      mem: "/proc/#{os_pid}/mem",
      address: address,
      nonce: nonce,
      threshold: threshold,
      sealed: Finalizer.loaded?()
    }

    case read(shared, address, 0) do
      {:ok, _} -> shared
      {:error, _} -> nil
    end
  end

  def negotiate(_info, _threshold), do: nil

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
  def pin_attrs(%{threshold: threshold, sealed: true}), do: %{pin: threshold, sealed: true}
  def pin_attrs(%{threshold: threshold}), do: %{pin: threshold}

  @doc """
  The bytes of a pinned readback whose reply is `meta`: its sealed file
  mapped (`path`), or read at its `address`.
  """
  @spec read_pinned(t(), map()) :: {:ok, binary()} | {:error, term()}
  def read_pinned(_shared, %{path: path, inode: inode, bytes: bytes}), do: Finalizer.map_sealed(path, inode, bytes)
  def read_pinned(shared, %{address: address, bytes: bytes}), do: read(shared, address, bytes)

  @doc "Reads `bytes` bytes at `address` of the worker's memory."
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
