defmodule Moat.Backend do
  @moduledoc """
  `Nx.Backend` on MLX, run inside the `moat_port` worker.

      Nx.global_default_backend(Moat.Backend)
      Nx.global_default_backend({Moat.Backend, device: :cpu})

  Tensor data stays in the worker; an `Nx.Tensor` here holds a
  `t:Moat.Ref.t/0`. Ops are sent fire-and-forget and MLX evaluates lazily, so a
  chain of ops costs one pipe write each and no round trip until something
  reads values (`Nx.to_binary/1`, `inspect/2`, …).

  ## Options

    * `:device` - `:cpu` (the default, and the only device on Linux CPU builds)
    * `:worker` - the `Moat.Worker` to use (default `Moat.Worker`)
  """

  @behaviour Nx.Backend

  @enforce_keys [:ref]
  defstruct [:ref, device: :cpu]

  @type t :: %__MODULE__{ref: Moat.Ref.t(), device: :cpu | :gpu}

  alias Moat.{Client, Ref}
  alias Nx.Tensor, as: T

  @impl true
  def init(opts) do
    opts = Keyword.validate!(opts, device: :cpu, worker: Moat.Worker)

    unless opts[:device] in [:cpu, :gpu] do
      raise ArgumentError, "Moat.Backend: unknown device #{inspect(opts[:device])}, expected :cpu or :gpu"
    end

    opts
  end

  ## Creation and conversion

  @impl true
  def from_binary(%T{shape: shape, type: type} = out, binary, opts) do
    ref = Moat.from_binary(binary, shape, type, worker: worker(opts))
    wrap(out, ref, opts)
  end

  @impl true
  def constant(%T{shape: shape} = out, number, opts) do
    scalar = Nx.BinaryBackend.constant(%{out | shape: {}}, number, []) |> Nx.to_binary()
    from_binary(out, :binary.copy(scalar, Nx.size(shape)), opts)
  end

  @impl true
  def to_binary(%T{type: {_, bits}} = tensor, limit) do
    binary = Moat.to_binary(ref(tensor))
    binary_part(binary, 0, min(byte_size(binary), div(limit * bits, 8)))
  end

  @impl true
  def inspect(%T{} = tensor, inspect_opts) do
    limit = if inspect_opts.limit == :infinity, do: :infinity, else: inspect_opts.limit + 1
    binary = to_binary(tensor, min(limit, Nx.size(tensor)))
    Nx.Backend.inspect(tensor, binary, inspect_opts)
  end

  @impl true
  def backend_copy(tensor, backend, opts) do
    backend.from_binary(tensor, Moat.to_binary(ref(tensor)), opts)
  end

  @impl true
  def backend_transfer(tensor, __MODULE__, _opts), do: tensor

  def backend_transfer(tensor, backend, opts) do
    result = backend_copy(tensor, backend, opts)
    backend_deallocate(tensor)
    result
  end

  @impl true
  def backend_deallocate(%T{data: %__MODULE__{ref: %Ref{} = ref}}) do
    conn = Client.conn(ref.worker)

    if conn.generation == ref.generation do
      Client.cast(conn, :release, [], [ref.id], nil)
      :ok
    else
      :already_deallocated
    end
  end

  ## Shape and type

  @impl true
  def as_type(%T{type: type} = out, tensor), do: op(out, :astype, [tensor], %{type: Moat.check_type!(type)})

  @impl true
  def reshape(%T{shape: shape} = out, tensor), do: op(out, :reshape, [tensor], %{shape: Tuple.to_list(shape)})

  @impl true
  def broadcast(%T{shape: shape} = out, %T{shape: in_shape} = tensor, shape, axes) do
    # Nx maps input axis i to output axis axes[i]; MLX aligns trailing axes,
    # so first give the input the output's rank with 1s elsewhere.
    aligned = List.duplicate(1, tuple_size(shape))

    aligned =
      Enum.zip(axes, Tuple.to_list(in_shape))
      |> Enum.reduce(aligned, fn {axis, dim}, acc -> List.replace_at(acc, axis, dim) end)

    reshaped = reshape(%{tensor | shape: List.to_tuple(aligned)}, tensor)
    op(out, :broadcast_to, [reshaped], %{shape: Tuple.to_list(shape)})
  end

  ## Element-wise

  for {name, mlx} <- [add: :add, subtract: :subtract, multiply: :multiply, divide: :divide] do
    @impl true
    def unquote(name)(out, a, b), do: op(out, unquote(mlx), [a, b], %{type: out.type})
  end

  ## Reductions, cumulative ops and sorting

  @impl true
  def sum(%T{} = out, tensor, opts) do
    axes = opts[:axes] || Nx.axes(tensor)
    op(out, :sum, [tensor], %{axes: axes, keep_axes: opts[:keep_axes] || false, type: out.type})
  end

  ## Indexing

  ## Dot, convolution and linear algebra

  @impl true
  def dot(out, a, [1], [], b, [0], []) when tuple_size(a.shape) == 2 and tuple_size(b.shape) == 2 do
    op(out, :matmul, [a, b], %{type: out.type})
  end

  ## Windows

  ## FFT

  ## Blocks

  # Nx.block/4 structs (linear algebra, cumulative ops, take, top_k, fft2...)
  # run natively where a family implements them; otherwise Nx's default
  # implementation runs, built from the callbacks above.
  @impl true
  def block(struct, output, args, fun) do
    with :default <- elementwise_block(struct, output, args),
         :default <- indexing_block(struct, output, args) do
      apply(fun, [struct | args])
    end
  end

  defp elementwise_block(_struct, _output, _args), do: :default

  defp indexing_block(_struct, _output, _args), do: :default

  ## Fallbacks

  @doc false
  # Runs `op` on Nx.BinaryBackend: inputs are read back, the result is
  # uploaded again. Emits [:moat, :fallback, :start | :stop | :exception] and
  # obeys `config :moat, fallback: :silent | :warn | :raise`.
  def via_binary(op, out, args, opts \\ []) do
    meta = %{
      op: op,
      input_shapes: for(%T{shape: s} <- args, do: s),
      input_types: for(%T{type: t} <- args, do: t)
    }

    policy = Application.get_env(:moat, :fallback, :silent)
    fallback_policy(policy, op)

    :telemetry.span([:moat, :fallback], meta, fn ->
      args = Enum.map(args, &to_binary_backend/1)
      result = apply(Nx.BinaryBackend, op, [out | args])
      {from_binary_backend(result, opts), meta}
    end)
  end

  defp fallback_policy(:silent, _op), do: :ok

  defp fallback_policy(:warn, op) do
    key = {__MODULE__, :warned, op}

    unless :persistent_term.get(key, false) do
      :persistent_term.put(key, true)

      require Logger

      Logger.warning(
        "Moat.Backend: #{op} has no MLX implementation; it runs on Nx.BinaryBackend " <>
          "(inputs copied out of the worker and back; warned once per op)"
      )
    end
  end

  defp fallback_policy(:raise, op) do
    raise ArgumentError,
          "Moat.Backend: #{op} has no MLX implementation and `config :moat, fallback: :raise` forbids " <>
            "running it on Nx.BinaryBackend"
  end

  defp to_binary_backend(%T{data: %__MODULE__{}} = t), do: Nx.backend_copy(t, Nx.BinaryBackend)
  defp to_binary_backend(list) when is_list(list), do: Enum.map(list, &to_binary_backend/1)
  defp to_binary_backend(other), do: other

  defp from_binary_backend(%T{} = t, opts), do: Nx.backend_transfer(t, __MODULE__, opts)

  defp from_binary_backend(tuple, opts) when is_tuple(tuple),
    do: tuple |> Tuple.to_list() |> Enum.map(&from_binary_backend(&1, opts)) |> List.to_tuple()

  ## Plumbing

  defp worker(opts), do: Keyword.get(opts, :worker, Moat.Worker)

  defp wrap(out, %Ref{} = ref, opts) do
    %{out | data: %__MODULE__{ref: ref, device: Keyword.get(opts, :device, :cpu)}}
  end

  defp ref(%T{data: %__MODULE__{ref: ref}}), do: ref

  defp ref(%T{data: %other{}}) do
    raise ArgumentError, "expected a Moat.Backend tensor, got one on #{inspect(other)}"
  end

  # Sends one graph-building op and returns `out` bound to its result.
  defp op(%T{} = out, name, inputs, attrs) do
    [%T{data: %__MODULE__{ref: first, device: device}} | _] =
      inputs = Enum.map(inputs, &to_moat/1)

    conn = Client.conn(first.worker)
    ids = Client.ids!(conn, Enum.map(inputs, &ref/1), name)
    id = Client.new_id()
    Client.cast(conn, name, [id], ids, attrs)
    %{out | data: %__MODULE__{ref: Client.ref(conn, id), device: device}}
  end

  defp to_moat(%T{data: %__MODULE__{}} = t), do: t
  defp to_moat(%T{} = t), do: Nx.backend_copy(t, __MODULE__)
end
