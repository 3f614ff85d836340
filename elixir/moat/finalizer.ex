defmodule Moat.Finalizer do
  @moduledoc false
  # Tokens that tell a tensor's worker when the VM has garbage-collected the
  # last copy of its handle.
  #
  # A token is a resource of a tiny NIF (nif/moat_finalizer.c, no MLX in it)
  # whose destructor queues its id for the worker's releaser, and wakes it
  # with `{:moat_released}` when the queue was empty; the releaser takes the
  # queued ids with `drain/1`.
  # Where the NIF cannot load (no C compiler at build time, or
  # MOAT_FINALIZER=off), the Elixir bodies below run instead: a token is an
  # :atomics flag that only remembers an explicit release, and nothing is
  # released automatically (Moat's moduledoc says what still is).
  #
  # Why a NIF rather than pure Erlang refcount tokens (an off-heap binary per
  # handle, swept with process_info(owner, :binary)): that BIF reports each
  # binary's address, size and refcount, not its contents, so the owner must
  # learn which address belongs to which id, which only a sweep of its own
  # binaries can tell; and it must sweep every live token periodically to
  # find the dead ones (measured here: 20-45 ms per sweep of 100,000 tokens,
  # paid on every sweep, on an implementation detail, erlang/otp#6573). A
  # resource destructor costs about 0.15 µs once, when the handle dies, and
  # tells exactly which id, with no polling (bench/release.exs).

  @on_load :load

  @doc false
  def load do
    path =
      case :code.priv_dir(:moat) do
        {:error, _} -> "moat_finalizer"
        dir -> dir |> to_string() |> Path.join("moat_finalizer")
      end

    result =
      if System.get_env("MOAT_FINALIZER") == "off" do
        {:error, {:disabled, "MOAT_FINALIZER=off"}}
      else
        :erlang.load_nif(String.to_charlist(path), 0)
      end

    case result do
      :ok -> :ok
      {:error, {:reload, _}} -> :ok
      {:error, reason} -> :persistent_term.put({__MODULE__, :load_error}, reason)
    end

    # Loading must never fail the module: the fallback bodies work everywhere.
    :ok
  end

  @doc "Whether tokens are NIF resources (automatic release is on)."
  @spec loaded?() :: boolean()
  # (The NIF answers true; this body, which only runs without it, reads a
  # key nobody writes, so the compiler does not take `false` for granted.)
  def loaded?, do: :persistent_term.get({__MODULE__, :loaded}, false)

  @doc "Why the NIF did not load, or nil."
  @spec load_error() :: term()
  def load_error, do: :persistent_term.get({__MODULE__, :load_error}, nil)

  @doc "A token for tensor `id`; `releaser` hears of it once it is garbage."
  @spec new(pid(), pos_integer()) :: reference()
  def new(releaser, id) when is_pid(releaser) and is_integer(id), do: :atomics.new(1, signed: false)

  @doc """
  Marks the token released: true for the first call, false afterwards. A
  released token's destructor sends nothing.
  """
  @spec release(reference()) :: boolean()
  def release(token), do: :atomics.compare_exchange(token, 1, 0, 1) == :ok

  @doc """
  The ids whose tokens for `releaser` were garbage-collected since the last
  call (at most 65,536; call again while the list is that long).
  """
  @spec drain(pid()) :: [pos_integer()]
  def drain(releaser) when is_pid(releaser), do: []

  @doc """
  Maps a worker's sealed readback file (protocol.md §6, "Shared memory")
  read-only and returns it as a binary over the mapping: `{:ok, binary}`, or
  `{:error, why}` when the file at `path` is not the one announced
  (`:not_the_workers_file`), is not `bytes` long (`:wrong_size`), is not
  sealed against shrinking and writing (`:not_sealed`), or cannot be opened
  or mapped (an errno atom). Without the NIF: `{:error, :no_nif}`.
  """
  @spec map_sealed(binary(), non_neg_integer(), pos_integer()) :: {:ok, binary()} | {:error, atom()}
  # (As in loaded?/0, the fallback's answer is read from a key nobody
  # writes, so the compiler does not take it for the NIF's.)
  def map_sealed(path, inode, bytes) when is_binary(path) and is_integer(inode) and is_integer(bytes),
    do: {:error, :persistent_term.get({__MODULE__, :no_nif}, :no_nif)}

  @doc """
  As `map_sealed/3`, for `bytes` bytes at `offset` of a sealed file of
  `file_bytes` bytes (a worker's exported buffer, protocol.md §6,
  "Zero-copy readback"): the whole file is mapped, and the binary is the
  range. The same refusals, checked against `file_bytes`.
  """
  @spec map_sealed(binary(), non_neg_integer(), pos_integer(), non_neg_integer(), pos_integer()) ::
          {:ok, binary()} | {:error, atom()}
  def map_sealed(path, inode, file_bytes, offset, bytes)
      when is_binary(path) and is_integer(inode) and is_integer(file_bytes) and is_integer(offset) and
             is_integer(bytes),
      do: :persistent_term.get({__MODULE__, :no_nif_map}, {:error, :no_nif})

  @doc """
  Copies `bytes` bytes at `address` of process `os_pid` (a worker, which
  holds them pinned) into memory of this VM and returns them as a binary:
  `{:ok, binary}`, or `{:error, why}` when the 16 bytes at
  `probe_address` read in the same call are not `nonce` (`:not_the_worker`:
  another process has the pid), fewer bytes could be read (`:short_read`),
  or the kernel refuses (`:eperm`, `:esrch`, `:efault`, ...). One
  `process_vm_readv`, on a dirty scheduler; the binary's memory is this
  VM's and does not depend on the worker. Buffers whose binaries are gone
  are kept a few seconds for the next readback of their size
  (`trim_pool/0`). Without the NIF: `{:error, :no_nif}`.
  """
  @spec read_memory(pos_integer(), non_neg_integer(), binary(), non_neg_integer(), non_neg_integer()) ::
          {:ok, binary()} | {:error, atom()}
  def read_memory(os_pid, probe_address, nonce, address, bytes)
      when is_integer(os_pid) and is_integer(probe_address) and is_binary(nonce) and is_integer(address) and
             is_integer(bytes),
      do: :persistent_term.get({__MODULE__, :no_nif_read}, {:error, :no_nif})

  @doc "Unmaps the readback buffers kept for reuse (see `read_memory/5`)."
  @spec trim_pool() :: :ok
  def trim_pool, do: :ok

  @doc """
  Waits up to `max_us` microseconds (at most 200) for file descriptor `fd`
  of this VM to become readable, without sleeping: true once it is, false
  when the time is up (and without the NIF).
  """
  @spec wait_readable(non_neg_integer(), 0..200) :: boolean()
  def wait_readable(_fd, _max_us), do: false

  @doc """
  Keeps `term` on the token until it is released or collected (a copy; a
  binary in it is shared, not copied): `true`, or `false` where it keeps a
  term already, was released, or there is no NIF. Moat.Transfer keeps a
  tensor's mapped readback there (protocol.md §6, "Zero-copy readback").
  """
  @spec keep(term(), term()) :: boolean()
  def keep(_token, _term), do: :persistent_term.get({__MODULE__, :no_nif_keep}, false)

  @doc "The term `keep/2` kept on the token, or nil."
  @spec kept(term()) :: term()
  def kept(_token), do: :persistent_term.get({__MODULE__, :no_nif_keep}, nil)

  @doc "Whether the token was released (explicitly, or by its destructor)."
  @spec released?(reference()) :: boolean()
  def released?(token), do: :atomics.get(token, 1) == 1

  # The outbox of a connection (Moat.Writer): without the NIF there is none,
  # and callers write to the port themselves. (As in loaded?/0, the
  # fallbacks' answers are read from a key nobody writes.)

  @doc "The outbox of the connection on `port`, flushed by `writer` (`outbox_flush/1`)."
  @spec outbox_new(pid(), port()) :: reference()
  def outbox_new(writer, port) when is_pid(writer) and is_port(port),
    do: :persistent_term.get({__MODULE__, :no_nif_outbox}, make_ref())

  @doc "Queues `frame` behind every frame pushed before it: `:ok`, or `:closed`."
  @spec outbox_push(reference(), iodata()) :: :ok | :closed
  def outbox_push(_outbox, _frame), do: :persistent_term.get({__MODULE__, :no_nif_outbox}, :closed)

  @doc """
  `:direct` when nothing is queued (the caller writes `frame` itself); else
  writes everything queued and `frame` last, as one batch: `:ok`, or
  `:closed`.
  """
  @spec outbox_call(reference(), iodata()) :: :direct | :ok | :closed
  def outbox_call(_outbox, _frame), do: :persistent_term.get({__MODULE__, :no_nif_outbox}, :closed)

  @doc "Writes everything queued, in order, as batch packets: `:ok`, or `:closed`."
  @spec outbox_flush(reference()) :: :ok | :closed
  def outbox_flush(_outbox), do: :persistent_term.get({__MODULE__, :no_nif_outbox}, :closed)

  @doc "How many frames are queued."
  @spec outbox_queued(reference()) :: non_neg_integer()
  def outbox_queued(_outbox), do: :persistent_term.get({__MODULE__, :no_nif_outbox}, 0)
end
