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

  ## Checks

  MLX does not check indices, integer division or element counts, and on the
  CPU some of those inputs kill its process or corrupt memory. The worker
  checks them before MLX sees them, always: an op given out-of-range indices
  (`gather`, `take`, `take_along_axis`, `indexed_add`, `indexed_put`), an
  integer divisor of zero, or whose result would be larger than an address
  space fails, and reading its result raises a `Moat.Error` naming the op.
  The worker and every other tensor carry on. Checking indices and integer
  divisors evaluates them in the worker (not the op's result, and with no
  round trip to the VM).

  A debug check is off by default:

      config :moat, debug: [detect_non_finite: true]

  makes every op evaluate its float results and fail if they hold NaN or an
  infinity, so reading raises a `Moat.Error` naming the op that produced the
  first one. Evaluating every op forgoes MLX's lazy fusion; use it to find
  where NaN appears, not in production.

  ## Divergences from Nx.BinaryBackend

  Indexing, dot, convolution, linear algebra, windows, FFT and integer
  division:

    * Failures of asynchronous ops (out-of-range indices, integer division by
      zero, singular matrices in `triangular_solve` and `solve`) raise a
      `Moat.Error` naming the op when the result is read, where
      Nx.BinaryBackend raises `ArgumentError` or `ArithmeticError` at the call.
    * `quotient` and `remainder` follow Nx (truncation; the remainder has the
      dividend's sign; `MIN / -1` wraps to `MIN`). A float `remainder` by zero
      is NaN (Nx.BinaryBackend raises).
    * `indexed_add`/`indexed_put` with updates smaller than the target's other
      axes write them as a block at the index (as EXLA does);
      Nx.BinaryBackend writes them contiguously from the index's offset.
    * FFTs along an axis before the last two of a tensor (`fft`, `ifft`, and
      `fft2`/`ifft2` over such an axis) transform along that axis;
      Nx.BinaryBackend 0.13 scrambles that result. FFTs of
      length 1 and windows whose last position overhangs the padded input
      (Nx's shape rule allows it) return the transform or the reduction over
      the part inside (the rest counts as padding); Nx.BinaryBackend returns
      tensors without data there.
    * Linear algebra comes from LAPACK (through MLX) in f32 (f64 for f64), not
      from Nx's iterative algorithms: results agree to rounding (the last
      digits of f32). Eigenvector and singular vector signs are normalised
      (each vector's largest component positive); QR signs follow Nx's
      Householder convention; in `qr(mode: :complete)` the columns of q past
      min(m, n) are an orthonormal completion, not necessarily Nx's.
      `triangular_solve` computes in f64, as Nx.BinaryBackend does.
    * `cholesky` of a matrix that is not positive definite is NaN from the
      first non-positive pivot on (MLX's result there is garbage; Nx's
      algorithm gives NaN from the first negative pivot and huge values after
      a zero one).
    * `dot` and `conv` of f16/bf16 accumulate in f32 and round once.

  ## Fallbacks

  Indexing, dot, convolution, linear algebra, windows and FFT:

    * On Nx.BinaryBackend (inputs copied out of the worker and back; each
      emits `[:moat, :fallback, ...]` telemetry and obeys
      `config :moat, fallback: :silent | :warn | :raise`): `reduce` and
      `window_reduce` (a user function cannot run in the worker), `conv` over
      more than 3 spatial axes, complex `triangular_solve`.
    * Through Nx's default implementations, built from Moat's own ops (MLX's
      decompositions are real): complex QR, Cholesky, eigh, LU, solve and
      determinant.
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

  # Indices are checked in the worker before MLX sees them; out-of-range
  # indices fail the op (Moat.Error when the result is read), as they raise
  # in Nx.BinaryBackend.

  @impl true
  def gather(out, tensor, indices, opts), do: op(out, :gather, [tensor, indices], %{axes: opts[:axes]})

  for name <- [:indexed_add, :indexed_put] do
    @impl true
    def unquote(name)(out, target, indices, updates, opts) do
      op(out, unquote(name), [target, indices, updates], %{axes: opts[:axes], type: out.type})
    end
  end

  # Start indices may be scalar tensors (Nx's dynamic slices); the worker
  # clamps every start into the tensor, as Nx does.
  @impl true
  def slice(out, tensor, starts, lengths, strides) do
    {starts, tensors} = split_starts(starts)
    attrs = %{starts: starts, lengths: lengths, strides: strides}
    op(out, :dynamic_slice, [tensor | tensors], attrs)
  end

  @impl true
  def put_slice(out, tensor, starts, slice) do
    {starts, tensors} = split_starts(starts)
    op(out, :dynamic_put_slice, [tensor, slice | tensors], %{starts: starts, type: out.type})
  end

  # Integer starts travel as attributes, tensor starts as inputs (nil marks
  # their places).
  defp split_starts(starts) do
    {attrs, tensors} =
      Enum.map_reduce(starts, [], fn
        start, acc when is_integer(start) -> {start, acc}
        %T{} = start, acc -> {nil, [start | acc]}
      end)

    {attrs, Enum.reverse(tensors)}
  end

  ## Dot, convolution and linear algebra

  @impl true
  def dot(out, a, contract_a, batch_a, b, contract_b, batch_b) do
    attrs = %{contract_a: contract_a, batch_a: batch_a, contract_b: contract_b, batch_b: batch_b}
    op(out, :dot, [a, b], Map.put(attrs, :type, out.type))
  end

  # MLX convolves over 1 to 3 spatial axes.
  @impl true
  def conv(out, input, kernel, opts) when tuple_size(input.shape) in 3..5 do
    keys =
      [:strides, :input_dilation, :kernel_dilation, :feature_group_size, :batch_group_size] ++
        [:input_permutation, :kernel_permutation, :output_permutation]

    attrs = opts |> Keyword.take(keys) |> Map.new() |> Map.merge(%{padding: opts[:padding], type: out.type})
    op(out, :conv, [input, kernel], attrs)
  end

  def conv(out, input, kernel, opts), do: via_binary(:conv, out, [input, kernel, opts])

  # MLX solves real systems only.
  @impl true
  def triangular_solve(%T{type: {:c, _}} = out, a, b, opts),
    do: via_binary(:triangular_solve, out, [a, b, opts])

  def triangular_solve(out, a, b, opts) do
    attrs = %{left_side: opts[:left_side], lower: opts[:lower], transform_a: opts[:transform_a]}
    op(out, :triangular_solve, [a, b], Map.put(attrs, :type, out.type))
  end

  ## Windows

  for name <- [:window_sum, :window_product, :window_max, :window_min] do
    @impl true
    def unquote(name)(out, tensor, window_dimensions, opts) do
      op(out, unquote(name), [tensor], window_attrs(out, window_dimensions, opts))
    end
  end

  for name <- [:window_scatter_max, :window_scatter_min] do
    @impl true
    def unquote(name)(out, tensor, source, init_value, window_dimensions, opts) do
      attrs = window_attrs(out, window_dimensions, opts)
      op(out, unquote(name), [tensor, source, init_value], attrs)
    end
  end

  defp window_attrs(out, window_dimensions, opts) do
    %{
      window_dimensions: Tuple.to_list(window_dimensions),
      strides: opts[:strides],
      padding: opts[:padding],
      window_dilations: opts[:window_dilations] || List.duplicate(1, tuple_size(window_dimensions)),
      type: out.type
    }
  end

  # A user function cannot run in the worker. It runs on Nx.BinaryBackend,
  # with that as the default backend for the tensors it creates.
  @impl true
  def reduce(out, tensor, acc, opts, fun) do
    Nx.with_default_backend(Nx.BinaryBackend, fn ->
      via_binary(:reduce, out, [tensor, acc, opts, fun], backend_options(tensor))
    end)
  end

  @impl true
  def window_reduce(out, tensor, acc, window_dimensions, opts, fun) do
    Nx.with_default_backend(Nx.BinaryBackend, fn ->
      args = [tensor, acc, window_dimensions, opts, fun]
      via_binary(:window_reduce, out, args, backend_options(tensor))
    end)
  end

  defp backend_options(%T{data: %__MODULE__{ref: ref, device: device}}),
    do: [worker: ref.worker, device: device]

  defp backend_options(_tensor), do: []

  ## FFT

  for name <- [:fft, :ifft] do
    @impl true
    def unquote(name)(out, tensor, opts) do
      attrs = %{axis: opts[:axis], length: opts[:length], eps: opts[:eps], type: out.type}
      op(out, unquote(name), [tensor], attrs)
    end
  end

  ## Integer division and bit counts

  # Nx's semantics (truncating quotient, remainder with the dividend's sign)
  # are applied in the worker, which also keeps `MIN / -1` away from MLX.
  for name <- [:quotient, :remainder] do
    @impl true
    def unquote(name)(out, a, b), do: op(out, unquote(name), [a, b], %{type: out.type})
  end

  for name <- [:population_count, :count_leading_zeros] do
    @impl true
    def unquote(name)(out, tensor), do: op(out, unquote(name), [tensor], %{type: out.type})
  end

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

  alias Nx.Block.LinAlg

  defp indexing_block(%Nx.Block.Take{axis: axis}, out, [tensor, indices]),
    do: op(out, :take, [tensor, indices], %{axis: axis})

  defp indexing_block(%Nx.Block.TakeAlongAxis{axis: axis}, out, [tensor, indices]),
    do: op(out, :take_along_axis, [tensor, indices], %{axis: axis})

  # MLX's decompositions are real (f32/f64); complex inputs take Nx's
  # default implementations (the last clause).
  defp indexing_block(%LinAlg.QR{mode: mode, eps: eps}, {%T{type: {k, _}} = q, _} = out, [t]) when k != :c,
    do: multi_op(out, :qr, [t], %{mode: mode, eps: eps, type: q.type})

  defp indexing_block(%LinAlg.Cholesky{}, %T{type: {k, _}} = out, [t]) when k != :c,
    do: op(out, :cholesky, [t], %{type: out.type})

  defp indexing_block(%LinAlg.Eigh{eps: eps}, {%T{type: {k, _}}, v} = out, [t]) when k != :c,
    do: multi_op(out, :eigh, [t], %{eps: eps, type: v.type})

  defp indexing_block(%LinAlg.SVD{full_matrices?: full}, {%T{type: {k, _}} = u, _, _} = out, [t])
       when k != :c,
       do: multi_op(out, :svd, [t], %{full_matrices: full, type: u.type})

  defp indexing_block(%LinAlg.LU{}, {p, %T{type: {k, _}} = l, _} = out, [t]) when k != :c,
    do: multi_op(out, :lu, [t], %{p_type: p.type, type: l.type})

  defp indexing_block(%LinAlg.Solve{}, %T{type: {k, _}} = out, [a, b]) when k != :c,
    do: op(out, :solve, [a, b], %{type: out.type})

  defp indexing_block(%LinAlg.Determinant{}, %T{type: {k, _}} = out, [t]) when k != :c,
    do: op(out, :determinant, [t], %{type: out.type})

  defp indexing_block(%Nx.Block.FFT2{} = s, out, [t]),
    do: op(out, :fft2, [t], %{axes: s.axes, lengths: s.lengths, eps: s.eps, type: out.type})

  defp indexing_block(%Nx.Block.IFFT2{} = s, out, [t]),
    do: op(out, :ifft2, [t], %{axes: s.axes, lengths: s.lengths, eps: s.eps, type: out.type})

  defp indexing_block(%Nx.Block.RFFT{} = s, out, [t]),
    do: op(out, :rfft, [t], %{axis: s.axis, length: s.length, eps: s.eps, type: out.type})

  defp indexing_block(%Nx.Block.IRFFT{} = s, out, [t]),
    do: op(out, :irfft, [t], %{axis: s.axis, length: s.length, eps: s.eps, type: out.type})

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

  defp from_binary_backend(%T{} = t, opts), do: Nx.backend_transfer(t, {__MODULE__, opts})

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

  # Sends one graph-building op that defines several tensors (a tuple of
  # outputs, in the order the worker returns them).
  defp multi_op(outs, name, inputs, attrs) when is_tuple(outs) do
    [%T{data: %__MODULE__{ref: first, device: device}} | _] =
      inputs = Enum.map(inputs, &to_moat/1)

    conn = Client.conn(first.worker)
    ids = Client.ids!(conn, Enum.map(inputs, &ref/1), name)
    out_ids = Client.new_ids(tuple_size(outs))
    Client.cast(conn, name, out_ids, ids, attrs)

    outs
    |> Tuple.to_list()
    |> Enum.zip_with(out_ids, &%{&1 | data: %__MODULE__{ref: Client.ref(conn, &2), device: device}})
    |> List.to_tuple()
  end

  defp to_moat(%T{data: %__MODULE__{}} = t), do: t
  defp to_moat(%T{} = t), do: Nx.backend_copy(t, __MODULE__)
end
