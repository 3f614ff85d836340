defmodule Moat.Backend do
  @moduledoc """
  `Nx.Backend` on MLX, run inside the `moat_port` worker.

      Nx.global_default_backend(Moat.Backend)
      Nx.global_default_backend({Moat.Backend, device: :cpu})

  Tensor data stays in the worker; an `Nx.Tensor` here holds a
  `t:Moat.Ref.t/0`. Ops are sent fire-and-forget and MLX evaluates lazily, so a
  chain of ops costs one pipe write each and no round trip until something
  reads values (`Nx.to_binary/1`, `inspect/2`, …).

  Every callback is one op in the worker, which applies Nx's semantics
  (type promotion, NaN handling, rounding) itself. Tensors from other
  backends or other workers that meet a Moat tensor in an op are copied into
  its worker first.

  A tensor's data is freed in the worker once no process holds the tensor
  any more (see `Moat`, "Memory"), or at once with `Nx.backend_deallocate/1`
  (`:ok`, then `:already_deallocated`) or `Moat.scope/1`. The worker refuses
  what would exceed its memory limit (`Moat.set_memory_limit/2`) with a
  `Moat.Error` instead of running out of memory.

  ## Options

    * `:device` - `:cpu` (the default, and the only device on Linux CPU builds)
    * `:worker` - the `Moat.Worker` to use (default `Moat.Worker`)

  `inspect/2` shows the backend and device on a first line, like Torchx;
  `config :moat, inspect_backend: false` leaves it out.

  ## Checks

  MLX does not check indices, integer division or element counts, and on the
  CPU some of those inputs kill its process or corrupt memory. The worker
  checks them before MLX sees them, always: an op given out-of-range indices
  (`gather`, `take`, `take_along_axis`, `indexed_add`, `indexed_put`), an
  integer divisor of zero, or whose result would be larger than an address
  space fails, and reading its result raises a `Moat.Error` naming the op.
  The worker and every other tensor carry on. Checking indices and integer
  divisors evaluates them in the worker, within its memory limit (not the
  op's result, and with no round trip to the VM); only their lowest and
  highest values, or whether a zero is among them, are read.

  A debug check is off by default:

      config :moat, debug: [detect_non_finite: true]

  makes every op evaluate its float results and fail if they hold NaN or an
  infinity, so reading raises a `Moat.Error` naming the op that produced the
  first one. Evaluating every op forgoes MLX's lazy fusion; use it to find
  where NaN appears, not in production.

  ## Divergences from Nx.BinaryBackend

  Creation, conversion, shape and type ops, element-wise ops, reductions,
  cumulative ops and sorting:

    * Types MLX cannot hold raise `ArgumentError` before anything is sent:
      `{:f, 8}`, `{:f8_e4m3fn, 8}`, `{:s | :u, 2 | 4}` and `{:c, 128}` (so
      `Nx.conjugate/1` of an f64 tensor raises). `{:f, 64}` is computed on the
      CPU.
    * f64 `exp`, `sigmoid`, `sin`, `cos`, `erf`, `erfc` and `erf_inv` are
      built from MLX primitives that are exact in f64 (MLX's own f64 kernels
      of these are single precision), within a few ulp of the correctly
      rounded result; `sin`/`cos` lose accuracy beyond |x| ≈ 10⁶. `erf_inv`
      is more accurate than Nx.BinaryBackend's approximation (~3e-8).
    * f32, f16 and bf16 `exp`, `expm1`, `log`, `log1p`, `tanh`, `sigmoid`,
      `erf`, `erfc`, `sin`, `cos`, `rsqrt` and `pow` run on the worker's own
      vectorized CPU kernels (SLEEF; the set is chosen from what the CPU
      reports and named in the hello's `cpu`), computed in f32 over the
      whole range, denormals included: within 1 ulp of the exact result
      (`sigmoid` 3, `erfc` 2, `rsqrt` 1.5; `sin`/`cos` at any magnitude);
      f16 and bf16 results are the f32 result rounded once. Other math
      follows MLX's kernels: in f32 within ~5e-7 relative of Erlang's
      `:math`.
    * Where Nx.BinaryBackend has no answer or a wrong one: `tanh` and `erf`
      of ±inf are ±1 (BinaryBackend: NaN); `sign` of NaN is NaN and of -inf
      is -1 (BinaryBackend: 1); `ceil`, `floor` and `round` return
      non-finite values unchanged (BinaryBackend raises).
    * Integer `pow` with a negative exponent gives the truncated result (1
      for base 1, ±1 for base -1, else 0); BinaryBackend raises.
    * Shifts by a negative amount or by the bit width or more shift
      everything out: 0, or the sign for signed `right_shift`; BinaryBackend
      raises on negative amounts.
    * Operands of mixed types are converted to the output type before the
      op, as compilers do: an s64 beyond f16's range is infinite in an f16
      `divide`, where BinaryBackend divides the exact integer.
    * `min`, `max` and comparisons of a u64 with a signed integer run in
      their merged type, s64 (as compilers do), where BinaryBackend compares
      the exact integers.
    * `as_type` from float to integer maps NaN to 0 and ±inf to the type's
      max/min, and wraps other values like Nx, but values beyond the s64
      range are unspecified.
    * f32 `sum` accumulates in f32 (MLX's kernel), so long sums carry
      rounding error that BinaryBackend's exact sum does not (the sum of a
      1e6-element f32 iota is off by 1.2e-4 relative). f16 and bf16 sums,
      and cumulative ops on them, accumulate in f32 and round once.
    * A descending `sort` may order -0.0 and 0.0 differently (they compare
      equal); `argsort` is stable in both directions, as in Nx.
    * Complex functions follow C99 on signed zeros (`sqrt(-4 - 0i)` is
      `-2i`); BinaryBackend ignores the sign of a zero imaginary part.
    * `to_pointer/2` and `from_pointer/5` raise `ArgumentError`: tensor data
      lives in the worker process, whose addresses mean nothing to the BEAM
      or to other processes, and a shared-memory IPC segment would outlive
      the tensor with nothing to release it.

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

  Creation, conversion, shape and type ops, element-wise ops, reductions,
  cumulative ops, sorting and the blocks `Nx.Block.LogicalNot`,
  `Nx.Block.Phase`, `Nx.Block.AllClose`, `Nx.Block.Cumulative*` (any axis,
  both directions) and `Nx.Block.TopK` all run natively in the worker; none
  of them falls back to Nx.BinaryBackend.

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
    device = device!(worker(opts), opts)
    ref = Moat.from_binary(binary, shape, type, worker: worker(opts))
    wrap(out, ref, device)
  end

  @impl true
  def constant(%T{shape: shape, type: type} = out, number, opts) do
    value = Nx.BinaryBackend.constant(%{out | shape: {}}, number, []) |> Nx.to_binary()
    create(out, :constant, %{value: value, shape: Tuple.to_list(shape), type: Moat.check_type!(type)}, opts)
  end

  @impl true
  def eye(%T{shape: shape, type: type} = out, opts) do
    create(out, :eye, %{shape: Tuple.to_list(shape), type: Moat.check_type!(type)}, opts)
  end

  @impl true
  def iota(%T{shape: shape, type: type} = out, axis, opts) do
    create(out, :iota, %{shape: Tuple.to_list(shape), axis: axis, type: Moat.check_type!(type)}, opts)
  end

  @impl true
  def to_binary(%T{type: {_, bits}} = tensor, limit) do
    binary =
      if limit < Nx.size(tensor) do
        # Only the first `limit` elements leave the worker.
        flat = reshape(%{tensor | shape: {Nx.size(tensor)}}, tensor)
        head = slice(%{flat | shape: {limit}}, flat, [0], [limit], [1])
        read_and_release([flat, head])
      else
        Moat.to_binary(ref(tensor))
      end

    binary_part(binary, 0, min(byte_size(binary), div(limit * bits, 8)))
  end

  defp read_and_release(tensors) do
    binary = Moat.to_binary(ref(List.last(tensors)))
    Enum.each(tensors, &backend_deallocate/1)
    binary
  end

  @impl true
  def inspect(%T{data: %__MODULE__{device: device}} = tensor, inspect_opts) do
    limit = if inspect_opts.limit == :infinity, do: :infinity, else: inspect_opts.limit + 1
    binary = to_binary(tensor, min(limit, Nx.size(tensor)))
    doc = Nx.Backend.inspect(tensor, binary, inspect_opts)

    # `config :moat, inspect_backend: false` leaves the signature out.
    if Application.get_env(:moat, :inspect_backend, true) do
      Inspect.Algebra.concat(["Moat.Backend(#{device})", Inspect.Algebra.line(), doc])
    else
      doc
    end
  end

  @impl true
  def backend_copy(%T{} = tensor, __MODULE__, opts) do
    if worker(opts) == ref(tensor).worker do
      # MLX arrays are immutable: the copy is a new id for the same array.
      op(tensor, :copy, [tensor], %{})
    else
      from_binary(tensor, Moat.to_binary(ref(tensor)), opts)
    end
  end

  def backend_copy(tensor, backend, opts) do
    backend.from_binary(tensor, Moat.to_binary(ref(tensor)), opts)
  end

  @impl true
  def backend_transfer(tensor, __MODULE__, opts) do
    if worker(opts) == ref(tensor).worker do
      tensor
    else
      transfer(tensor, __MODULE__, opts)
    end
  end

  def backend_transfer(tensor, backend, opts), do: transfer(tensor, backend, opts)

  defp transfer(tensor, backend, opts) do
    result = backend_copy(tensor, backend, opts)
    backend_deallocate(tensor)
    result
  end

  @impl true
  def backend_deallocate(%T{data: %__MODULE__{ref: %Ref{} = ref}}), do: Moat.deallocate(ref)

  @impl true
  def to_batched(%T{shape: shape} = out, %T{shape: in_shape} = tensor, opts) do
    {size, n} = {elem(shape, 0), elem(in_shape, 0)}
    leftover = Keyword.get(opts, :leftover, :repeat)
    count = div(n, size) + if(rem(n, size) != 0 and leftover == :repeat, do: 1, else: 0)
    outs = List.to_tuple(List.duplicate(out, count))
    multi_op(outs, :to_batched, [tensor], %{batch_size: size, leftover: leftover}) |> Tuple.to_list()
  end

  @impl true
  def to_pointer(%T{}, opts) do
    case Keyword.get(opts, :mode, :local) do
      :ipc ->
        raise ArgumentError,
              "Moat.Backend does not export IPC handles: a shared-memory segment written by the " <>
                "moat_port worker would outlive the tensor with nothing to release it; copy the data " <>
                "out with Nx.to_binary/1 instead"

      mode ->
        raise ArgumentError,
              "Moat.Backend does not support to_pointer (mode: #{inspect(mode)}): tensor data lives in " <>
                "the moat_port worker, another OS process, so its address means nothing here; copy " <>
                "the data out with Nx.to_binary/1 instead"
    end
  end

  @impl true
  def from_pointer(_pointer, _type, _shape, _backend_opts, _opts) do
    raise ArgumentError,
          "Moat.Backend does not support from_pointer: the moat_port worker is another OS process " <>
            "and cannot adopt memory of the BEAM or of a third process; build the tensor with " <>
            "Nx.from_binary/3 instead"
  end

  ## Shape and type

  @impl true
  def as_type(%T{type: type} = out, tensor), do: op(out, :astype, [tensor], %{type: Moat.check_type!(type)})

  @impl true
  def bitcast(%T{type: type} = out, tensor), do: op(out, :bitcast, [tensor], %{type: Moat.check_type!(type)})

  @impl true
  def reshape(%T{shape: shape} = out, tensor), do: op(out, :reshape, [tensor], %{shape: Tuple.to_list(shape)})

  @impl true
  def squeeze(out, tensor, _axes), do: reshape(out, tensor)

  @impl true
  def broadcast(out, tensor, shape, axes) do
    op(out, :broadcast, [tensor], %{shape: Tuple.to_list(shape), axes: axes})
  end

  @impl true
  def transpose(out, tensor, axes), do: op(out, :transpose, [tensor], %{axes: axes})

  @impl true
  def reverse(out, tensor, axes), do: op(out, :reverse, [tensor], %{axes: axes})

  @impl true
  def pad(out, tensor, pad_value, config) do
    config = for {low, high, interior} <- config, do: [low, high, interior]
    op(out, :pad, [tensor, pad_value], %{config: config, type: out.type})
  end

  @impl true
  def concatenate(out, tensors, axis), do: op(out, :concatenate, tensors, %{axis: axis, type: out.type})

  @impl true
  def stack(out, tensors, axis), do: op(out, :stack, tensors, %{axis: axis, type: out.type})

  @impl true
  def select(out, pred, on_true, on_false), do: op(out, :select, [pred, on_true, on_false], %{type: out.type})

  @impl true
  def clip(out, tensor, min, max), do: op(out, :clip, [tensor, min, max], %{type: out.type})

  ## Element-wise

  # Every one is one worker op of the same name; the worker converts the
  # inputs to the output type first, as Nx does.
  @unary_ops [:exp, :expm1, :log, :log1p, :sigmoid, :cos, :sin, :tan, :cosh, :sinh, :tanh] ++
               [:acos, :asin, :atan, :acosh, :asinh, :atanh, :sqrt, :rsqrt, :cbrt] ++
               [:erf, :erfc, :erf_inv, :abs, :bitwise_not, :ceil, :conjugate, :floor] ++
               [:negate, :round, :sign, :real, :imag, :is_nan, :is_infinity]

  for name <- @unary_ops do
    @impl true
    def unquote(name)(out, tensor), do: op(out, unquote(name), [tensor], %{type: out.type})
  end

  @binary_ops [:add, :subtract, :multiply, :pow, :divide, :atan2, :min, :max] ++
                [:bitwise_and, :bitwise_or, :bitwise_xor, :left_shift, :right_shift] ++
                [:logical_and, :logical_or, :logical_xor]

  for name <- @binary_ops do
    @impl true
    def unquote(name)(out, a, b), do: op(out, unquote(name), [a, b], %{type: out.type})
  end

  # Both sides are compared in their merged type; the result is u8.
  @comparison_ops [:equal, :not_equal, :greater, :less, :greater_equal, :less_equal]

  for name <- @comparison_ops do
    @impl true
    def unquote(name)(out, a, b) do
      op(out, unquote(name), [a, b], %{type: out.type, input_type: Nx.Type.merge(a.type, b.type)})
    end
  end

  ## Reductions, cumulative ops and sorting

  for name <- [:sum, :product, :reduce_max, :reduce_min, :all, :any] do
    @impl true
    def unquote(name)(out, tensor, opts), do: op(out, unquote(name), [tensor], reduce_attrs(out, tensor, opts))
  end

  defp reduce_attrs(out, tensor, opts) do
    %{axes: opts[:axes] || Nx.axes(tensor), keep_axes: opts[:keep_axes] || false, type: out.type}
  end

  for name <- [:argmax, :argmin] do
    @impl true
    def unquote(name)(out, tensor, opts) do
      axis = opts[:axis]
      keep = axis != nil and (opts[:keep_axis] || false)
      attrs = %{axis: axis, tie_break: opts[:tie_break] || :low, keep_axes: keep, type: out.type}
      op(out, unquote(name), [tensor], attrs)
    end
  end

  @impl true
  def sort(out, tensor, opts) do
    op(out, :sort, [tensor], %{axis: opts[:axis], direction: opts[:direction] || :asc})
  end

  @impl true
  def argsort(out, tensor, opts) do
    op(out, :argsort, [tensor], %{axis: opts[:axis], direction: opts[:direction] || :asc, type: out.type})
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
    op(out, :slice, [tensor | tensors], attrs)
  end

  @impl true
  def put_slice(out, tensor, starts, slice) do
    {starts, tensors} = split_starts(starts)
    op(out, :put_slice, [tensor, slice | tensors], %{starts: starts, type: out.type})
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

  @cumulative_blocks %{
    Nx.Block.CumulativeSum => :cumulative_sum,
    Nx.Block.CumulativeProduct => :cumulative_product,
    Nx.Block.CumulativeMin => :cumulative_min,
    Nx.Block.CumulativeMax => :cumulative_max
  }

  defp elementwise_block(%Nx.Block.LogicalNot{}, out, [t]), do: op(out, :logical_not, [t], %{type: out.type})

  defp elementwise_block(%Nx.Block.Phase{}, out, [t]), do: op(out, :phase, [t], %{type: out.type})

  defp elementwise_block(%Nx.Block.AllClose{} = o, out, [a, b]) do
    input_type =
      if Nx.Type.integer?(a.type) and Nx.Type.integer?(b.type),
        do: {:f, 64},
        else: Nx.Type.merge(a.type, b.type)

    attrs = %{input_type: input_type, rtol: o.rtol, atol: o.atol, equal_nan: o.equal_nan, type: out.type}
    op(out, :all_close, [a, b], attrs)
  end

  defp elementwise_block(%block{axis: axis, reverse: reverse}, out, [t]) when is_map_key(@cumulative_blocks, block) do
    op(out, Map.fetch!(@cumulative_blocks, block), [t], %{axis: axis, reverse: reverse, type: out.type})
  end

  defp elementwise_block(%Nx.Block.TopK{k: k}, {_, indices} = out, [t]) do
    multi_op(out, :top_k, [t], %{k: k, index_type: indices.type})
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

  defp wrap(out, %Ref{} = ref, device) do
    %{out | data: %__MODULE__{ref: ref, device: device}}
  end

  # The device must be one the worker announced in its handshake.
  defp device!(worker, opts) do
    device = Keyword.get(opts, :device, :cpu)
    devices = Client.conn(worker).info.devices

    if device not in devices do
      raise ArgumentError,
            "Moat.Backend: device #{inspect(device)} is not available on worker #{inspect(worker)} " <>
              "(it has #{inspect(devices)})"
    end

    device
  end

  defp ref(%T{data: %__MODULE__{ref: ref}}), do: ref

  defp ref(%T{data: %other{}}) do
    raise ArgumentError, "expected a Moat.Backend tensor, got one on #{inspect(other)}"
  end

  # Sends one graph-building op and returns `out` bound to its result.
  # The common case, every input on one worker, skips multi_op's copying.
  defp op(%T{} = out, name, [%T{data: %__MODULE__{ref: %Ref{worker: worker}, device: device}} | _] = inputs, attrs) do
    if Enum.all?(inputs, &match?(%T{data: %__MODULE__{ref: %Ref{worker: ^worker}}}, &1)) do
      Moat.check_type!(out.type)
      conn = Client.conn(worker)
      ids = Client.ids!(conn, Enum.map(inputs, &ref/1), name)
      id = Client.new_id()
      # The handle exists before the frame that defines its id (see multi_op).
      handle = Client.ref(conn, id)
      Client.cast(conn, name, [id], ids, attrs)
      %{out | data: %__MODULE__{ref: handle, device: device}}
    else
      single_op(out, name, inputs, attrs)
    end
  end

  defp op(%T{} = out, name, inputs, attrs), do: single_op(out, name, inputs, attrs)

  defp single_op(out, name, inputs, attrs) do
    {result} = multi_op({out}, name, inputs, attrs)
    result
  end

  # Sends one graph-building op that defines several tensors (a tuple of
  # templates, in the order the worker returns them). Inputs from other
  # backends or workers are copied into the worker of the first Moat input;
  # those copies are released once the op holds them.
  defp multi_op(outs, name, inputs, attrs) when is_tuple(outs) do
    outs = Tuple.to_list(outs)
    Enum.each(outs, &Moat.check_type!(&1.type))
    {worker, device} = home(inputs)
    moved = Enum.map(inputs, &to_worker(&1, worker))
    conn = Client.conn(worker)
    ids = Client.ids!(conn, Enum.map(moved, &ref/1), name)
    out_ids = Client.new_ids(length(outs))
    # Handles (and their release tokens) exist before the frame that defines
    # their ids: a process that dies in between leaves no tensor behind.
    refs = Enum.map(out_ids, &Client.ref(conn, &1))
    Client.cast(conn, name, out_ids, ids, attrs)

    case for {m, i} <- Enum.zip(moved, inputs), m != i, do: ref(m).id do
      [] -> :ok
      copies -> Client.cast(conn, :release, [], copies, nil)
    end

    outs
    |> Enum.zip_with(refs, &%{&1 | data: %__MODULE__{ref: &2, device: device}})
    |> List.to_tuple()
  end

  defp home(inputs) do
    case Enum.find(inputs, &match?(%T{data: %__MODULE__{}}, &1)) do
      %T{data: %__MODULE__{ref: ref, device: device}} -> {ref.worker, device}
      nil -> {Moat.Worker, :cpu}
    end
  end

  defp to_worker(%T{data: %__MODULE__{ref: %Ref{worker: worker}}} = t, worker), do: t
  defp to_worker(%T{} = t, worker), do: Nx.backend_copy(t, {__MODULE__, worker: worker})

  # Sends one op without inputs (creation) to the worker named in `opts`.
  defp create(%T{} = out, name, attrs, opts) do
    device = device!(worker(opts), opts)
    conn = Client.conn(worker(opts))
    id = Client.new_id()
    ref = Client.ref(conn, id)
    Client.cast(conn, name, [id], [], attrs)
    wrap(out, ref, device)
  end
end
