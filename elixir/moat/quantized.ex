defmodule Moat.Quantized do
  @moduledoc """
  Quantized weights: `Moat.quantize/2`, `Moat.dequantize/1`,
  `Moat.gather_qmm/4`.

      w = Nx.iota({4096, 4096}, type: :f32, backend: Moat.Backend) |> Nx.divide(1.0e7)
      qw = Moat.quantize(w, bits: 4, group_size: 64)
      Nx.dot(x, [1], qw, [1])   # x {m, 4096}: the quantized x · wᵀ

  A quantized weight is an `Nx.Tensor` of the dense weight's shape `{...,
  out, in}` and type (f32, f16 or bf16), whose data stays packed in the
  worker, quantized along its last axis in MLX's own layout: per row, the
  `in` values as `bits`-bit integers in 32-bit words, and per group of
  `group_size` values a scale and (`:affine`) a bias, `w = scale * q +
  bias`. The worker holds the three as one uint8 array, so the memory
  limit and `Moat.memory_info/1` count the packed bytes
  (`packed_bytes/3`).

  ## The format: scales and biases

  Affine scales and biases are stored as `:scale_type`: by default bf16 for
  an f32 weight, and the weight's own type for an f16 or bf16 one (MLX's
  choice). 4-bit in groups of 64 is then 4.5 bits a weight (`bits +
  2 * 16 / group_size`; 8-bit: 8.5), where f32 scales (`scale_type: {:f,
  32}`) take 5 (8-bit: 9). As MLX quantizes a half-width weight, the
  values are quantized with f32 scales and biases, which are then rounded
  to the scale type; bf16 keeps f32's range, so no scale overflows. The
  same bytes serve every kernel: the CPU ones read bf16, f16 and f32
  scales directly (computing in f32), and MLX's `quantized_matmul` (the
  GPU) casts them to the product's type, as it does for a bf16 weight
  multiplied by an f32 `x`.

  Modes: `:affine` (bits 2, 3, 4, 6 or 8; groups of 32, 64 or 128), and
  MLX's microscaled floats, which fix bits and group: `:mxfp4` (4-bit
  E2M1, groups of 32, E8M0 scales), `:mxfp8` (E4M3, groups of 32),
  `:nvfp4` (E2M1, groups of 16, E4M3 scales). They have no bias.

  ## Operations

    * `Nx.dot(x, [-1], qw, [1])` with the weight `{out, in}` (contracting
      its last axis, as MLX stores a linear layer's weight), no batch axes:
      one `quantized_matmul` in the worker, eagerly and inside
      `Moat.Compiler` programs (a quantized argument of a jitted function
      is lowered as one). `Nx.dot(x, [-1], qw, [0])` (`x · w`, contracting
      the quantized-along axis' other one) too. On the CPU the affine
      product runs on the worker's own kernel (AVX-512, AVX2 or scalar, the
      hello's `cpu`), computing `scale * q + bias` in f32 exactly as
      `dequantize/1` does, then the product in f32; on the GPU, MLX's.
    * Every other op, and every other `dot`, first dequantizes its
      quantized inputs in the worker (to their type) and emits
      `[:moat, :quantized, :dequantize]` (measurements `%{}`, metadata
      `:op`, `:shape`, `:type`, `:bits`, `:group_size`, `:mode`), then runs
      as usual: nothing reads the packed bytes as values.
    * Reading (`Nx.to_binary/1`, `inspect/2`, copies to another backend)
      gives the dequantized values; copies within Moat (to another worker
      or node too) stay quantized.
  """

  alias Nx.Tensor, as: T

  # `scale_type`: the affine scales' and biases' type (nil: the weight's,
  # and for the microscaled modes, whose scales are uint8).
  @enforce_keys [:bits, :group_size, :mode]
  defstruct [:bits, :group_size, :mode, scale_type: nil]

  defmodule Op do
    @moduledoc false
    # A worker op (`:quantize`, `:dequantize`, `:gather_qmm`) as an
    # `Nx.block/4`, which Moat.Backend runs as that op: this module sends
    # nothing itself (Moat.Backend depends on it, not the reverse).
    defstruct [:name, :attrs]
  end

  @type mode :: :affine | :mxfp4 | :mxfp8 | :nvfp4
  @type t :: %__MODULE__{bits: 2..8, group_size: pos_integer(), mode: mode(), scale_type: Nx.Type.t() | nil}

  # Per mode: the bit widths and group sizes it takes, and its defaults.
  @modes %{
    affine: %{bits: [2, 3, 4, 6, 8], group_size: [32, 64, 128], default: {4, 64}},
    mxfp4: %{bits: [4], group_size: [32], default: {4, 32}},
    mxfp8: %{bits: [8], group_size: [32], default: {8, 32}},
    nvfp4: %{bits: [4], group_size: [16], default: {4, 16}}
  }

  @weight_types [{:f, 32}, {:f, 16}, {:bf, 16}]

  @doc """
  `w` quantized along its last axis; see the module doc.

  Options: `:mode` (default `:affine`), `:bits` (default 4; the mode's),
  `:group_size` (default 64; the mode's), `:scale_type` (`:affine` only:
  `{:bf, 16}` or `{:f, 32}` for any weight, `{:f, 16}` for an f16 one;
  default bf16 for an f32 weight, else the weight's type; see "The
  format"). `w` is f32, f16 or bf16 of rank
  at least 2 with a last axis that is a positive multiple of the group
  size. A weight on another backend is copied to `:backend` (as
  `Nx.backend_copy/2` takes it, e.g. `{Moat.Backend, worker: name}`;
  default: Nx's default backend, which must then be Moat.Backend). The packed weight is evaluated before
  this returns, so the dense one can be freed.
  """
  @spec quantize(Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  def quantize(%T{} = w, opts \\ []) do
    opts = Keyword.validate!(opts, [:bits, :group_size, :backend, :scale_type, mode: :affine])
    mode = opts[:mode]

    spec =
      Map.get(@modes, mode) ||
        raise ArgumentError,
              "Moat.quantize: unknown mode #{inspect(mode)}, expected one of #{inspect(Map.keys(@modes))}"

    {default_bits, default_group} = spec.default

    q = %__MODULE__{
      bits: opts[:bits] || default_bits,
      group_size: opts[:group_size] || default_group,
      mode: mode,
      scale_type: scale_type!(mode, w.type, opts[:scale_type])
    }

    check!(w, q, spec)
    w = on_moat(w, opts[:backend])
    attrs = Map.merge(%{bits: q.bits, group_size: q.group_size, mode: mode}, scale_attr(q))
    packed = worker_op(:quantize, [w], Nx.template({packed_bytes(w.shape, w.type, q)}, {:u, 8}), attrs)
    %{w | data: %{packed.data | quant: q}}
  end

  defp scale_type!(:affine, {:f, 32}, nil), do: {:bf, 16}
  defp scale_type!(:affine, type, nil), do: type

  defp scale_type!(:affine, type, wanted) do
    t = Nx.Type.normalize!(wanted)

    if t in [{:bf, 16}, {:f, 32}, type] do
      t
    else
      raise ArgumentError,
            "Moat.quantize: :scale_type is bf16, f32 or the weight's own type (f16 would not hold " <>
              "every scale of another), got #{inspect(wanted)} for a #{Nx.Type.to_string(type)} weight"
    end
  end

  defp scale_type!(_mode, _type, nil), do: nil

  defp scale_type!(mode, _type, _wanted),
    do: raise(ArgumentError, "Moat.quantize: #{mode} has uint8 scales, so it takes no :scale_type")

  defp scale_attr(%__MODULE__{scale_type: nil}), do: %{}
  defp scale_attr(%__MODULE__{scale_type: t}), do: %{scale_type: t}

  defp worker_op(name, args, out, attrs), do: Nx.block(%Op{name: name, attrs: attrs}, args, out, refuse(name, args))

  # The block's default function, on any backend but Moat's.
  defp refuse(name, args) do
    fail = fn -> raise ArgumentError, "Moat.#{name}: the tensors must be on Moat.Backend" end

    case length(args) do
      1 -> fn _, _ -> fail.() end
      2 -> fn _, _, _ -> fail.() end
      3 -> fn _, _, _, _ -> fail.() end
      4 -> fn _, _, _, _, _ -> fail.() end
    end
  end

  defp check!(%T{shape: shape, type: type}, q, spec) do
    cond do
      q.bits not in spec.bits ->
        raise ArgumentError, "Moat.quantize: #{q.mode} takes bits #{inspect(spec.bits)}, got #{inspect(q.bits)}"

      q.group_size not in spec.group_size ->
        raise ArgumentError,
              "Moat.quantize: #{q.mode} takes group_size #{inspect(spec.group_size)}, got #{inspect(q.group_size)}"

      type not in @weight_types ->
        raise ArgumentError,
              "Moat.quantize: weights are f32, f16 or bf16, got #{inspect(type)} (convert with Nx.as_type/2 first)"

      tuple_size(shape) < 2 or elem(shape, tuple_size(shape) - 1) == 0 or
          rem(elem(shape, tuple_size(shape) - 1), q.group_size) != 0 ->
        raise ArgumentError,
              "Moat.quantize: expected a weight of rank at least 2 whose last axis is a positive multiple " <>
                "of the group size #{q.group_size}, got shape #{inspect(shape)}"

      true ->
        :ok
    end
  end

  # Only Moat.Backend's data has `quant`; another tensor is copied to the
  # `:backend` option's backend, by default Nx's default backend.
  defp on_moat(%T{data: %{quant: nil}} = w, nil), do: w
  defp on_moat(w, nil), do: Nx.backend_copy(w)
  defp on_moat(w, backend), do: Nx.backend_copy(w, backend)

  @doc """
  The dense weight of a quantized one (in the worker, of its type); any
  other tensor as it is.
  """
  @spec dequantize(Nx.Tensor.t()) :: Nx.Tensor.t()
  def dequantize(%T{data: %{quant: %__MODULE__{} = q}} = t),
    do: worker_op(:dequantize, [packed(t)], %{t | data: nil}, Map.put(attrs(t, q), :type, t.type))

  def dequantize(%T{} = t), do: t

  @doc "Whether `t` is a quantized weight."
  @spec quantized?(term()) :: boolean()
  def quantized?(%T{data: %{quant: %__MODULE__{}}}), do: true
  def quantized?(_), do: false

  @doc "The quantization of `t` (`nil` for a dense tensor)."
  @spec info(Nx.Tensor.t()) :: t() | nil
  def info(%T{data: %{quant: q}}), do: q
  def info(%T{}), do: nil

  @doc """
  The bytes the worker holds for a weight of `shape` and `type` quantized
  as `q`: the packed words, the scales and (`:affine`) the biases, of
  `q.scale_type` (or `type` when that is nil).
  """
  @spec packed_bytes(tuple(), Nx.Type.t(), t()) :: non_neg_integer()
  def packed_bytes(shape, type, %__MODULE__{} = q) do
    k = elem(shape, tuple_size(shape) - 1)
    rows = div(Nx.size(shape), max(k, 1)) * if(k == 0, do: 0, else: 1)
    groups = div(k, q.group_size)
    {_, scale_bits} = q.scale_type || type
    scale_bytes = if q.mode == :affine, do: 2 * div(scale_bits, 8), else: 1
    rows * (div(k * q.bits, 8) + groups * scale_bytes)
  end

  @doc """
  MLX's `gather_qmm`, for mixture-of-experts layers: `x · w[i]ᵀ` for a
  quantized `w` `{experts, out, in}` and, per batch entry of `x` `{...,
  m, in}`, the expert `rhs_indices` names (integers, broadcast against
  `x`'s batch axes). The result is `{...batch, m, out}`.

  Options: `:lhs_indices` (pick `x`'s matrices too), `:transpose` (default
  `true`: `x · wᵀ`), `:sorted_indices` (default `false`; `true` when
  `rhs_indices` is sorted, which MLX's kernels exploit).
  """
  @spec gather_qmm(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  def gather_qmm(%T{} = x, %T{} = qw, %T{} = rhs_indices, opts \\ []) do
    opts = Keyword.validate!(opts, lhs_indices: nil, transpose: true, sorted_indices: false)
    q = info(qw) || raise ArgumentError, "Moat.gather_qmm: the weight is not quantized (use Moat.quantize/2)"

    unless tuple_size(qw.shape) == 3 and Nx.rank(x) >= 2 do
      raise ArgumentError,
            "Moat.gather_qmm: expected x of rank at least 2 and a weight {experts, out, in}, got " <>
              "#{inspect(x.shape)} and #{inspect(qw.shape)}"
    end

    {_e, n_out, n_in} = qw.shape
    {k, n} = if opts[:transpose], do: {n_in, n_out}, else: {n_out, n_in}
    {m, kx} = {elem(x.shape, Nx.rank(x) - 2), elem(x.shape, Nx.rank(x) - 1)}

    if kx != k do
      raise ArgumentError,
            "Moat.gather_qmm: x of shape #{inspect(x.shape)} does not contract with a weight of shape #{inspect(qw.shape)}"
    end

    indices = Enum.reject([opts[:lhs_indices], rhs_indices], &is_nil/1)

    unless Enum.all?(indices, &Nx.Type.integer?(&1.type)) do
      raise ArgumentError, "Moat.gather_qmm: indices must be integers"
    end

    batch = indices |> Enum.map(& &1.shape) |> Enum.reduce(&broadcast_shape!/2)
    type = Nx.Type.merge(Nx.Type.to_floating(x.type), qw.type)
    out = Nx.template(Tuple.to_list(batch) |> Kernel.++([m, n]) |> List.to_tuple(), type)
    attrs = Map.merge(attrs(qw, q), %{transpose: opts[:transpose] == true, sorted: opts[:sorted_indices] == true})
    worker_op(:gather_qmm, [x, packed(qw) | indices], out, Map.put(attrs, :type, type))
  end

  defp broadcast_shape!(a, b) do
    case Nx.Shape.binary_broadcast(a, [], b, []) do
      {shape, _} -> shape
    end
  rescue
    ArgumentError ->
      reraise ArgumentError, "Moat.gather_qmm: index shapes #{inspect(a)} and #{inspect(b)} do not broadcast", []
  end

  ## Routing (Moat.Backend's callbacks)

  @doc false
  # Whether any argument (in lists too) is a quantized weight: a walk that
  # allocates nothing.
  def any?([]), do: false
  def any?([%T{data: %{quant: %__MODULE__{}}} | _]), do: true
  def any?([list | rest]) when is_list(list), do: any?(list) or any?(rest)
  def any?([_ | rest]), do: any?(rest)

  @doc false
  # Runs `backend`'s callback `name` on arguments that hold a quantized
  # weight: the quantized product, or the callback on dequantized inputs.
  # `send.(out, name, inputs, attrs)` sends one worker op.
  def callback(backend, send, :dot, out, [a, [ca], [], b, [cb], []] = args) do
    if quantized?(b) and not quantized?(a) and tuple_size(b.shape) == 2 and ca == Nx.rank(a) - 1 do
      q = info(b)
      attrs = Map.merge(attrs(b, q), %{transpose: cb == 1, type: out.type})
      send.(out, :quantized_matmul, [a, packed(b)], attrs)
    else
      dense_callback(backend, send, :dot, out, args)
    end
  end

  def callback(backend, send, name, out, args), do: dense_callback(backend, send, name, out, args)

  defp dense_callback(backend, send, name, out, args),
    do: apply(backend, name, [out | Enum.map(args, &dense_arg(&1, name, send))])

  defp dense_arg(%T{data: %{quant: %__MODULE__{}}} = t, name, send), do: dense(t, name, send)
  defp dense_arg(list, name, send) when is_list(list), do: Enum.map(list, &dense_arg(&1, name, send))
  defp dense_arg(other, _name, _send), do: other

  @doc false
  # The dense weight of `t`, in the worker, sent by `send` (as callback/5);
  # `op` names the callback that needed it (telemetry).
  def dense(%T{data: %{quant: q}} = t, op, send) do
    meta = %{op: op, shape: t.shape, type: t.type, bits: q.bits, group_size: q.group_size, mode: q.mode}
    :telemetry.execute([:moat, :quantized, :dequantize], %{}, meta)
    send.(%{t | data: nil}, :dequantize, [packed(t)], Map.put(attrs(t, q), :type, t.type))
  end

  @doc false
  # The packed uint8 vector behind a quantized weight.
  def packed(%T{data: %{quant: q} = data} = t) do
    %T{shape: {packed_bytes(t.shape, t.type, q)}, type: {:u, 8}, names: [nil], data: %{data | quant: nil}}
  end

  @doc false
  # `packed` (a uint8 vector on Moat.Backend) as the quantized weight
  # `like` describes.
  def rewrap(%T{data: data}, %T{data: %{quant: q}} = like),
    do: %{like | data: %{data | quant: q}}

  defp attrs(t, q) do
    base = %{shape: Tuple.to_list(t.shape), dense: t.type, bits: q.bits, group_size: q.group_size, mode: q.mode}
    Map.merge(base, scale_attr(q))
  end

  @doc false
  # The label inspect/2 prints after the device.
  def label(%__MODULE__{mode: :affine, scale_type: t} = q) when t != nil,
    do: ", #{q.bits}-bit affine, group #{q.group_size}, #{Nx.Type.to_string(t)} scales"

  def label(%__MODULE__{mode: :affine} = q), do: ", #{q.bits}-bit affine, group #{q.group_size}"
  def label(%__MODULE__{mode: mode}), do: ", #{mode}"
end
