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

  ## Telemetry

    * `[:moat, :to_binary, :start | :stop | :exception]` — metadata `:worker`;
      `:stop` adds `:shape`, `:dtype` and `:byte_size`
    * `[:moat, :eval, :start | :stop | :exception]` — metadata `:worker`, `:count`
    * `[:moat, :worker, :up]` and `[:moat, :worker, :down]` — see `Moat.Worker`
  """

  alias Moat.{Client, Error, Ref}

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
  Raises `ArgumentError` unless MLX can hold `type`, naming what to use
  instead. Nothing is ever silently downcast.
  """
  @spec check_type!(Nx.Type.t()) :: Nx.Type.t()
  def check_type!(type) when type in @supported, do: type
  def check_type!({:c, 128}), do: unsupported!({:c, 128}, "{:c, 64}")
  def check_type!({:s, b} = t) when b in [2, 4], do: unsupported!(t, "{:s, 8}")
  def check_type!({:u, b} = t) when b in [2, 4], do: unsupported!(t, "{:u, 8}")
  def check_type!({:f, 8} = t), do: unsupported!(t, "{:f, 16} or {:bf, 16}")
  def check_type!({:f8_e4m3fn, 8} = t), do: unsupported!(t, "{:f, 16} or {:bf, 16}")
  def check_type!(t), do: unsupported!(t, "one of #{inspect(@supported)}")

  defp unsupported!(type, instead) do
    raise ArgumentError,
          "Moat cannot hold tensors of type #{inspect(type)}: MLX has no such type; use #{instead}"
  end

  @doc """
  Uploads `binary` (Nx's layout: row-major, native little-endian) as a tensor
  of `shape` and `type`. Returns at once; upload errors surface at the next
  blocking call on the tensor.

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
    Client.upload(conn, id, binary, dims, type)
    Client.ref(conn, id)
  end

  @doc "Evaluates the tensor and returns its bytes."
  @spec to_binary(Ref.t()) :: binary()
  def to_binary(%Ref{worker: worker} = ref) do
    :telemetry.span([:moat, :to_binary], %{worker: worker}, fn ->
      {meta, data} = call!(ref, :to_binary)
      shape = List.to_tuple(meta.shape)
      {data, %{worker: worker, shape: shape, dtype: meta.dtype, byte_size: meta.bytes}}
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
  Evaluates tensors now, raising the first failure among them.
  """
  @spec eval(Ref.t() | [Ref.t()]) :: :ok
  def eval(refs) do
    [%Ref{worker: worker} | _] = refs = List.wrap(refs)

    :telemetry.span([:moat, :eval], %{worker: worker, count: length(refs)}, fn ->
      conn = Client.conn(worker)
      ids = Client.ids!(conn, refs, :eval)
      {:ok, _, _} = ok!(Client.call(conn, :eval, ids, nil))
      {:ok, %{worker: worker, count: length(refs)}}
    end)
  end

  @doc """
  Starts evaluating tensors and returns at once; errors surface at the next
  blocking call on them.
  """
  @spec async_eval(Ref.t() | [Ref.t()]) :: :ok
  def async_eval(refs) do
    [%Ref{worker: worker} | _] = refs = List.wrap(refs)
    conn = Client.conn(worker)
    Client.cast(conn, :async_eval, [], Client.ids!(conn, refs, :async_eval), nil)
  end

  defp call!(%Ref{worker: worker} = ref, op) do
    conn = Client.conn(worker)
    [id] = Client.ids!(conn, [ref], op)
    {:ok, result, payload} = ok!(Client.call(conn, op, [id], nil))
    {result, payload}
  end

  defp ok!({:ok, _, _} = ok), do: ok
  defp ok!({:error, %Error{} = e}), do: raise(e)
end
