defmodule Moat do
  @moduledoc """
  Nx on Apple's MLX, with MLX in a separate, supervised OS process.

  Most users only set the backend:

      Nx.global_default_backend(Moat.Backend)
      Nx.tensor([[1.0, 2.0], [3.0, 4.0]]) |> Nx.dot(Nx.eye(2)) |> Nx.sum()

  Every MLX call runs in `moat_port`, a Rust executable the VM starts as an
  Erlang port and `Moat.Worker` supervises. A crash inside MLX kills only that
  process: calls in flight fail with a `Moat.Error`, the worker restarts, and
  the VM never goes down.

  This module is the low-level API: move raw bytes in and out of the worker,
  read metadata, and force evaluation (MLX is lazy: ops only build a graph
  until something needs the values).

    * `from_binary/4` — binary → tensor in the worker (`t:Moat.Ref.t/0`)
    * `to_binary/1` — tensor → binary (evaluates)
    * `shape/1`, `dtype/1` — metadata (one round trip, no evaluation)
    * `eval/1`, `async_eval/1` — evaluate now, or start evaluating
    * `deallocate/1`, `scope/1` — free tensors now (see "Memory")
    * `memory_info/1`, `set_memory_limit/2`, `set_cache_limit/2`,
      `clear_cache/1`, `reset_peak_memory/1` — the worker's memory

  ## Memory

  A tensor's data lives in the worker until it is released. You rarely have
  to do it yourself:

    * **Automatically.** Each handle carries a token, a resource of a tiny NIF
      (`nif/moat_finalizer.c`: no MLX in it, nothing but a destructor that
      sends a message). When the VM has garbage-collected every copy of a
      handle, in every process, ETS table and `:persistent_term`, the token's
      destructor tells the worker's releaser, which sends ids to the worker
      in batches (one `:release` frame for many). A tensor stored in ETS or
      held by another process stays alive; a process that exits frees what
      only it held.
    * **By scope.** `scope/1` releases every tensor the function created
      (in the calling process) except those in its result.
    * **Explicitly.** `deallocate/1` (and `Nx.backend_deallocate/1`) returns
      `:ok`, then `:already_deallocated` for the same tensor.

  **When.** A dropped handle is freed when the process that held it next
  garbage-collects. A handle is a few words on the heap, so a process could
  drop gigabytes of tensors without needing a collection; two things make
  one happen for every process that has created tensors of the worker:

    * *memory pressure*: when the worker's live buffers have grown by half
      since their last low point (and by at least 16 MiB), the worker says
      so; each creator gets a full-sweep collection, and a busy one collects
      itself before it makes its next tensor. A loop that drops its
      temporaries stays within about twice its live set (measured: 20,000
      iterations of 4 MiB temporaries over a 48 MiB live set peak at 96 MiB);
    * *idleness*: a process that stops running (a Livebook evaluator between
      cells) is collected once after a full `:gc_nudge` tick without
      activity (1 s by default, see `Moat.Worker`), so what it dropped is
      freed within about two ticks.

  A handle held by a process that never created a tensor of the worker
  (it received it) is freed at that process's own next collection. ETS,
  `:persistent_term` and other processes keep tensors alive, as they keep
  any term. `scope/1` and `deallocate/1` free at once;
  `:erlang.garbage_collect/0` frees what it collects at the releaser's next
  batch.

  **Across nodes.** A handle on another node (sent in a message) does not
  hold its tensor: its own node's copies decide when it is freed. That
  node's worker serves it to others while it lives (see `Moat.Backend`,
  "Across nodes"); `deallocate/1` of such a handle releases it there.

  **Without the NIF** (no C compiler when Moat was built, or
  `MOAT_FINALIZER=off`), a warning is logged once and only `scope/1`,
  `deallocate/1` and worker restarts free tensors; everything else works.

  **Limits.** The worker enforces a memory limit (by default MLX's, about 80%
  of RAM; `set_memory_limit/2`). MLX's CPU allocator does not, and crashes
  when memory runs out, so the worker checks before it allocates:

    * an upload that does not fit next to the live buffers is refused;
    * an op whose result does not fit fails when it is built;
    * a blocking call first adds up every result its evaluation would
      compute, the whole lazy chain. A chain too long to fit at once is
      evaluated in steps that each fit, as MLX frees the intermediates that
      no live tensor holds; if what must stay does not fit, the call raises.

  Each raises a `Moat.Error` (at the next blocking call for the first two)
  naming the sizes; the worker lives and serves the next call. The limit
  bounds result buffers, tensors uploaded through shared memory included
  (`Moat.Worker`'s `:shared_memory`): views (broadcasts, transposes,
  slices, reshapes of dense tensors) count nothing, MLX may reuse an input's
  buffer for a result, and a kernel's scratch space is not counted. Freed
  buffers (and the memory files of shared-memory uploads) are cached for
  reuse up to the cache limit (`set_cache_limit/2`), and the cache is
  cleared when a request fits only without it.

  ## Telemetry

    * `[:moat, :to_binary, :start | :stop | :exception]` — metadata `:worker`;
      `:stop` adds `:shape`, `:dtype`, `:byte_size` and `:transfer`
      (`:pipe` or `:shared_memory`, see `Moat.Worker`'s `:shared_memory`;
      `:distribution` for a tensor of another node's worker)
    * `[:moat, :eval, :start | :stop | :exception]` — metadata `:worker`, `:count`
    * `[:moat, :memory, :stats]` — on every `memory_info/1`; measurements
      `:active`, `:peak`, `:cache` (bytes) and `:tensors`; metadata `:worker`
    * `[:moat, :memory, :pressure]` — the worker reported memory pressure
      (creators are collected); measurement `:active`; metadata `:worker`
    * `[:moat, :worker, :up]` and `[:moat, :worker, :down]` — see `Moat.Worker`
  """

  alias Moat.{Client, Error, Handles, Ref, Releaser, Transfer}

  @supported [
    {:u, 8},
    {:u, 16},
    {:u, 32},
    {:u, 64},
    {:s, 8},
    {:s, 16},
    {:s, 32},
    {:s, 64},
    {:f, 16},
    {:bf, 16},
    {:f, 32},
    {:f, 64},
    {:c, 64}
  ]

  @doc "The Nx types MLX can hold."
  @spec supported_types() :: [Nx.Type.t()]
  def supported_types, do: @supported

  @doc """
  Raises `ArgumentError` unless MLX can hold `type`. This module's functions
  move MLX types only; `Moat.Backend` also holds the Nx types MLX does not
  have, in one of these (see `Moat.Types`). Nothing is ever silently
  downcast.
  """
  @spec check_type!(Nx.Type.t()) :: Nx.Type.t()
  def check_type!(type) when type in @supported, do: type

  def check_type!(type) do
    held =
      if Moat.Types.emulated?(type),
        do: "Moat.Backend (Nx) holds it as #{inspect(Moat.Types.storage(type))}, see Moat.Types",
        else: "the worker's types are #{inspect(@supported)}"

    raise ArgumentError, "MLX has no type #{inspect(type)}: #{held}"
  end

  @doc """
  Uploads `binary` (Nx's layout: row-major, native little-endian) as a tensor
  of `shape` and `type`. Returns once the bytes are on their way (a large
  binary that goes through shared memory is written before it returns);
  upload errors surface at the next blocking call on the tensor.

  Options: `:worker` (default `Moat.Worker`).
  """
  @spec from_binary(binary(), tuple() | [non_neg_integer()], Nx.Type.t(), keyword()) :: Ref.t()
  def from_binary(binary, shape, type, opts \\ []) when is_bitstring(binary) do
    type = check_type!(type)
    dims = if is_tuple(shape), do: Tuple.to_list(shape), else: shape
    {_, bits} = type
    expected = Enum.reduce(dims, div(bits, 8), &(&1 * &2))

    if byte_size(binary) != expected do
      raise ArgumentError,
            "from_binary: #{byte_size(binary)} bytes given, but shape #{inspect(shape)} of " <>
              "#{inspect(type)} needs #{expected}"
    end

    conn = Client.conn(Keyword.get(opts, :worker, Moat.Worker))
    id = Client.new_id()
    ref = Handles.ref(conn, id)
    Transfer.upload(conn, id, binary, dims, type)
    ref
  end

  @doc """
  Evaluates the tensor and returns its bytes (from the node whose worker
  holds it, where that is another node).
  """
  @spec to_binary(Ref.t()) :: binary()
  def to_binary(%Ref{} = ref), do: to_binary(ref, nil)

  @doc false
  # `to_binary/1` of a tensor its caller knows to hold at most `max_bytes`
  # (Moat.Backend knows its shape): see `Moat.Transfer.read/4`.
  def to_binary(%Ref{worker: worker} = ref, max_bytes) do
    :telemetry.span([:moat, :to_binary], %{worker: worker}, fn ->
      {:ok, meta, data} = ok!(Handles.to_binary(ref, max_bytes))
      shape = List.to_tuple(meta.shape)
      transfer = Map.get(meta, :transfer, :pipe)
      {data, %{worker: worker, shape: shape, dtype: meta.dtype, byte_size: meta.bytes, transfer: transfer}}
    end)
  end

  @doc "The tensor's shape, as a tuple."
  @spec shape(Ref.t()) :: tuple()
  def shape(%Ref{} = ref), do: ref |> metadata() |> Map.fetch!(:shape) |> List.to_tuple()

  @doc "The tensor's Nx type."
  @spec dtype(Ref.t()) :: Nx.Type.t()
  def dtype(%Ref{} = ref), do: ref |> metadata() |> Map.fetch!(:dtype)

  defp metadata(ref), do: ref |> call!(:metadata) |> elem(0)

  @doc """
  Evaluates tensors now, raising the first failure among them. Takes a
  `Moat.Backend` tensor, a handle (`Moat.Ref`), or a list of them.
  """
  @spec eval(Nx.Tensor.t() | Ref.t() | [Nx.Tensor.t() | Ref.t()]) :: :ok
  def eval([]), do: :ok

  def eval(tensors) do
    [%Ref{worker: worker} | _] = refs = refs!(tensors, :eval)

    :telemetry.span([:moat, :eval], %{worker: worker, count: length(refs)}, fn ->
      conn = Client.conn(worker)
      ids = Handles.ids!(conn, refs, :eval)
      {:ok, _, _} = ok!(Client.call(conn, :eval, ids, nil))
      {:ok, %{worker: worker, count: length(refs)}}
    end)
  end

  @doc """
  Starts evaluating tensors and returns at once; errors surface at the next
  blocking call on them.
  """
  @spec async_eval(Nx.Tensor.t() | Ref.t() | [Nx.Tensor.t() | Ref.t()]) :: :ok
  def async_eval([]), do: :ok

  def async_eval(tensors) do
    [%Ref{worker: worker} | _] = refs = refs!(tensors, :async_eval)
    conn = Client.conn(worker)
    Client.cast(conn, :async_eval, [], Handles.ids!(conn, refs, :async_eval), nil)
  end

  defp refs!(tensors, op) do
    for tensor <- List.wrap(tensors) do
      case tensor do
        %Ref{} = ref ->
          ref

        # Not %Moat.Backend{}: the struct would make this module depend on
        # the backend, which depends on it (an xref cycle).
        %Nx.Tensor{data: %{__struct__: Moat.Backend, ref: %Ref{} = ref}} ->
          ref

        other ->
          raise ArgumentError,
                "Moat.#{op}: expected Moat.Backend tensors or Moat.Ref handles, got: #{inspect(other)}"
      end
    end
  end

  ## Memory

  @doc """
  Releases the tensor now: `:ok`, or `:already_deallocated` if it was
  released before (or its worker has restarted since). Using it afterwards
  raises.
  """
  @spec deallocate(Ref.t()) :: :ok | :already_deallocated
  def deallocate(%Ref{} = ref), do: Handles.release(ref)

  @doc """
  Runs `fun` and releases every tensor it created in this process, except
  those in its result (found inside tuples, lists, maps and structs, such as
  `Nx.Tensor`s and `Nx.Container`s). Returns the result. On an exception
  everything it created is released.

  Tensors created by other processes are not tracked; one created inside
  and stored elsewhere (ETS, another process) is released all the same.
  Scopes nest: what an inner scope returns belongs to the outer one. A
  scope remembers every id created inside it until it closes (about 50
  bytes each), so scope each iteration of a long loop rather than the loop.
  Using a tensor the scope released fails at the next blocking call
  (`Moat.Error`, "unknown tensor id").

      result = Moat.scope(fn -> x |> Nx.multiply(2) |> Nx.sum() end)
  """
  @spec scope((-> result)) :: result when result: term()
  def scope(fun) when is_function(fun, 0), do: Moat.Scope.run(fun, &Handles.release_ids/3)

  @doc """
  `w` (f32, f16 or bf16, `{..., out, in}`) quantized along its last axis,
  as a tensor of `w`'s shape and type whose data stays packed in the
  worker: `Nx.dot(x, [-1], qw, [1])` runs MLX's `quantized_matmul` (on the
  CPU, Moat's own kernel), eagerly and in `Moat.Compiler` programs; other
  ops dequantize it first. Options: `:bits` (2, 3, 4, 6, 8; default 4),
  `:group_size` (32, 64, 128; default 64), `:mode` (`:affine`, or the
  microscaled `:mxfp4`, `:mxfp8`, `:nvfp4`). See `Moat.Quantized`.

      qw = Moat.quantize(w, bits: 4, group_size: 64)
  """
  @spec quantize(Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  defdelegate quantize(w, opts \\ []), to: Moat.Quantized

  @doc "The dense values of a quantized weight (`quantize/2`), in the worker."
  @spec dequantize(Nx.Tensor.t()) :: Nx.Tensor.t()
  defdelegate dequantize(qw), to: Moat.Quantized

  @doc "MLX's `gather_qmm` over a quantized `{experts, out, in}` weight: see `Moat.Quantized.gather_qmm/4`."
  @spec gather_qmm(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  defdelegate gather_qmm(x, qw, rhs_indices, opts \\ []), to: Moat.Quantized

  # The keys of the worker's :memory_info reply. Naming them here makes the
  # atoms exist, which the client's :safe decoding requires.
  @memory_keys [:active, :peak, :cache, :limit, :cache_limit, :tensors]

  @typedoc "Bytes in live buffers, peak, cache, the limits, and the tensor ids defined."
  @type memory_info :: %{
          active: non_neg_integer(),
          peak: non_neg_integer(),
          cache: non_neg_integer(),
          limit: non_neg_integer(),
          cache_limit: non_neg_integer(),
          tensors: non_neg_integer()
        }

  @doc """
  `Moat.Compiler`'s counts: `:programs` (programs held by `worker`'s current
  incarnation), `:lowered` (jitted functions kept lowered), and, for this VM
  since start, `:lowerings` (graphs lowered), `:defined` (programs sent to
  a worker), `:replays` (program calls) and `:fallbacks` (graphs that ran
  on `Nx.Defn.Evaluator`).
  """
  @spec compiler_info(atom()) :: %{atom() => non_neg_integer()}
  def compiler_info(worker \\ Moat.Worker), do: Moat.Compiler.Cache.info(worker)

  @doc """
  The worker's memory, in bytes: `:active` (live tensor buffers), `:peak`
  (the most `:active` reached since start or `reset_peak_memory/1`),
  `:cache` (freed buffers kept for reuse), `:limit`, `:cache_limit`, and
  `:tensors` (ids defined in the worker). Releases requested before the call
  are applied first. Emits `[:moat, :memory, :stats]`.
  """
  @spec memory_info(atom()) :: memory_info()
  def memory_info(worker \\ Moat.Worker) do
    conn = Client.conn(worker)
    Releaser.flush(conn.releaser)
    {:ok, info, _} = ok!(Client.call(conn, :memory_info, [], nil))
    info = Map.take(info, @memory_keys)
    measurements = Map.drop(info, [:limit, :cache_limit])
    :telemetry.execute([:moat, :memory, :stats], measurements, %{worker: worker})
    info
  end

  @doc "Starts the peak over (from 0: it counts allocations from now on)."
  @spec reset_peak_memory(atom()) :: :ok
  def reset_peak_memory(worker \\ Moat.Worker), do: memory_call(worker, :reset_peak_memory, nil)

  @doc """
  Returns the worker's cached buffers to the system, and this VM's few
  readback buffers kept for reuse (`Moat.Finalizer.trim_pool/0`: large
  readbacks copied out of a worker's memory land in them).
  """
  @spec clear_cache(atom()) :: :ok
  def clear_cache(worker \\ Moat.Worker) do
    Moat.Finalizer.trim_pool()
    memory_call(worker, :clear_cache, nil)
  end

  @doc """
  Sets how many bytes of freed buffers the worker keeps for reuse (0 turns
  the cache off). Returns the previous limit.
  """
  @spec set_cache_limit(non_neg_integer(), atom()) :: non_neg_integer()
  def set_cache_limit(bytes, worker \\ Moat.Worker) when is_integer(bytes) and bytes >= 0,
    do: memory_call(worker, :set_cache_limit, bytes)

  @doc """
  Sets the worker's memory limit in bytes; returns the previous one. Requests
  sent after it returns that would take the worker's live buffers past it
  fail with a `Moat.Error` naming the sizes (see "Memory" above).
  """
  @spec set_memory_limit(non_neg_integer(), atom()) :: non_neg_integer()
  def set_memory_limit(bytes, worker \\ Moat.Worker) when is_integer(bytes) and bytes >= 0,
    do: memory_call(worker, :set_memory_limit, bytes)

  defp memory_call(worker, op, attrs) do
    conn = Client.conn(worker)
    {:ok, result, _} = ok!(Client.call(conn, op, [], attrs))
    result || :ok
  end

  defp call!(%Ref{worker: worker} = ref, op) do
    conn = Client.conn(worker)
    [id] = Handles.ids!(conn, [ref], op)
    {:ok, result, payload} = ok!(Client.call(conn, op, [id], nil))
    {result, payload}
  end

  defp ok!({:ok, _, _} = ok), do: ok
  defp ok!({:error, %Error{} = e}), do: raise(e)
end
