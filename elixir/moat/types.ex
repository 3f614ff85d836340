defmodule Moat.Types do
  @moduledoc """
  The Nx types MLX does not have, and how `Moat.Backend` holds them.

  MLX has no 8-bit floats, no integers narrower than 8 bits and no
  complex128. `Moat.Backend` keeps tensors of these types in the worker in
  an MLX storage type, computes in a wider MLX type and rounds back after
  every op, the way Nx.BinaryBackend writes each result in its type:

  | Nx type | held in the worker as | computed in | rounded back |
  | --- | --- | --- | --- |
  | `{:f, 8}` (E5M2) | u8: the bytes | f64 | to f16 (nearest, ties to even), then its high byte, as Nx does; NaN is `0x7E` |
  | `{:f8_e4m3fn, 8}` | u8: the bytes | f64 | as `Nx.Floating.dump_f8_e4m3fn/1`: saturating at ±448, NaN `0x7F` |
  | `{:s, 2}`, `{:s, 4}` | s8, one value a byte | s8 | wrapped into range (the low bits, sign-extended) |
  | `{:u, 2}`, `{:u, 4}` | u8, one value a byte | u8 | wrapped into range (the low bits) |
  | `{:c, 128}` | f64 with a hidden trailing axis of 2 (real, imaginary): Nx's byte layout | f64 parts, or Nx.BinaryBackend | – |

  Sub-byte integers are unpacked from Nx's bitstrings (first element in the
  most significant bits) on upload and packed again on readback; the other
  types travel in Nx's byte layout unchanged.

  Per op (see `Moat.Backend`, "Types MLX does not have"): data movement
  (reshape, transpose, slices, gathers, concatenation, padding…) runs on the
  stored bytes as they are (native); everything else on f8 and sub-byte
  integers is emulated (widened, computed by MLX, rounded back, in the
  worker). `{:c, 128}` moves natively, is converted from real types and
  added, subtracted, multiplied, negated, conjugated, split into its
  parts and measured (`abs`) natively (f64 operations on the parts, as `Complex` computes them);
  every other op on it runs on Nx.BinaryBackend with `[:moat, :fallback,
  ...]` telemetry, since a complex128 computed in complex64 would be wrong
  data.
  """

  alias Nx.Tensor, as: T

  @storage %{
    {:f, 8} => {:u, 8},
    {:f8_e4m3fn, 8} => {:u, 8},
    {:s, 2} => {:s, 8},
    {:s, 4} => {:s, 8},
    {:u, 2} => {:u, 8},
    {:u, 4} => {:u, 8},
    {:c, 128} => {:f, 64}
  }

  @f8 [{:f, 8}, {:f8_e4m3fn, 8}]

  @doc "The Nx types `Moat.Backend` holds in a storage type."
  @spec emulated() :: [Nx.Type.t()]
  def emulated, do: Map.keys(@storage)

  @doc "Whether `type` is held in a storage type."
  @spec emulated?(Nx.Type.t()) :: boolean()
  def emulated?(type), do: is_map_key(@storage, type)

  @doc "The MLX type that holds `type` in the worker (`type` itself for MLX's own)."
  @spec storage(Nx.Type.t()) :: Nx.Type.t()
  def storage(type), do: Map.get(@storage, type, type)

  @doc "The bytes an element of `type` takes in the worker (c128: two f64 parts)."
  @spec stored_bytes(Nx.Type.t()) :: pos_integer()
  def stored_bytes({_, bits} = type), do: div(max(bits, elem(storage(type), 1)), 8)

  ## Bytes

  @doc false
  # Nx's binary of `type` as the worker's: {binary, dims, storage type}.
  def to_storage(binary, dims, {:c, 128}), do: {binary, dims ++ [2], {:f, 64}}

  def to_storage(binary, dims, {:s, bits}) when bits < 8,
    do: {for(<<x::signed-size(bits) <- binary>>, into: <<>>, do: <<x::signed-8>>), dims, {:s, 8}}

  def to_storage(binary, dims, {:u, bits}) when bits < 8,
    do: {for(<<x::size(bits) <- binary>>, into: <<>>, do: <<x::8>>), dims, {:u, 8}}

  def to_storage(binary, dims, type), do: {binary, dims, storage(type)}

  @doc false
  # The worker's bytes of a `type` tensor as Nx's binary.
  def from_storage(binary, {kind, bits}) when kind in [:s, :u] and bits < 8,
    do: for(<<x::8 <- binary>>, into: <<>>, do: <<x::size(bits)>>)

  def from_storage(binary, _type), do: binary

  @doc false
  # Nx's binary of `type` as one Nx.Backend.inspect/3 can print.
  def printable({kind, bits} = type, binary) when kind in [:s, :u] and bits < 8 do
    {stored, _, _} = to_storage(binary, [], type)
    {storage(type), stored}
  end

  def printable(type, binary), do: {type, binary}

  ## Routing

  # Callbacks that run natively on complex128's storage when their data
  # inputs are all complex128 (as_type from a real type is built natively).
  @c128_native [:reshape, :squeeze, :broadcast, :transpose, :reverse, :slice, :concatenate, :stack, :to_batched]

  # Element-wise ops composed from f64 parts, exactly as Complex computes
  # them (each part one IEEE operation), with any input types.
  @c128_parts [:add, :subtract, :multiply, :negate, :conjugate, :real, :imag, :abs]

  @doc false
  # How Moat.Backend runs callback `name` given its output and arguments:
  # :native (its worker op, through `run/4` when a type is emulated),
  # :fallback (Nx.BinaryBackend), or :default (a block's default function).
  def route(name, out, args) do
    if emulated_in?([out | args]), do: route_emulated(name, out, args), else: :native
  end

  # On every callback: a walk that allocates nothing.
  defp emulated_in?([]), do: false
  defp emulated_in?([%T{type: type} | _]) when is_map_key(@storage, type), do: true
  defp emulated_in?([%T{} | rest]), do: emulated_in?(rest)
  defp emulated_in?([list | rest]) when is_list(list), do: emulated_in?(list) or emulated_in?(rest)
  defp emulated_in?([tuple | rest]) when is_tuple(tuple), do: emulated_in?(Tuple.to_list(tuple)) or emulated_in?(rest)
  defp emulated_in?([_ | rest]), do: emulated_in?(rest)

  defp route_emulated(name, out, args) do
    types = types([out | args], [])

    cond do
      {:c, 128} not in types -> if name == :block, do: :default, else: :native
      name == :as_type and not Nx.Type.complex?(hd(args).type) -> :native
      name in @c128_parts -> :native
      name in @c128_native and Enum.all?(data_types(name, args), &(&1 == {:c, 128})) -> :native
      true -> :fallback
    end
  end

  defp types(%T{type: type}, acc), do: [type | acc]
  defp types(list, acc) when is_list(list), do: Enum.reduce(list, acc, &types/2)
  defp types(tuple, acc) when is_tuple(tuple), do: types(Tuple.to_list(tuple), acc)
  defp types(_other, acc), do: acc

  defp data_types(name, [list | _]) when name in [:concatenate, :stack], do: types(list, [])
  defp data_types(_name, [%T{type: type} | _]), do: [type]

  ## Running ops

  @doc false
  # Runs worker op `name` whose outputs (templates, a tuple) or inputs (Moat
  # tensors of one worker) have emulated types: `send.(outs, name, inputs,
  # attrs)` sends one op of MLX types. Returns the outputs, of their Nx types.
  def run(outs, name, inputs, attrs, send) do
    outs = Tuple.to_list(outs)

    results =
      cond do
        Enum.any?(outs ++ inputs, &(&1.type == {:c, 128})) -> run_c128(outs, name, inputs, attrs, send)
        storage_op?(name, outs, inputs) -> run_storage(outs, name, inputs, attrs, send)
        true -> run_emulated(outs, name, inputs, attrs, send)
      end

    results |> Enum.zip_with(outs, &%{&1 | type: &2.type, shape: &2.shape, names: &2.names}) |> List.to_tuple()
  end

  # Data movement: the stored bytes move as they are. The inputs carrying
  # data (by position; the others are indices, starts or predicates) must be
  # of the output's type.
  @data_inputs %{
    reshape: [0],
    broadcast: [0],
    transpose: [0],
    reverse: [0],
    copy: [0],
    to_batched: [0],
    slice: [0],
    gather: [0],
    take: [0],
    take_along_axis: [0],
    concatenate: :all,
    stack: :all,
    pad: [0, 1],
    select: [1, 2],
    put_slice: [0, 1],
    indexed_put: [0, 2]
  }

  defp storage_op?(name, [%T{type: type} | _], inputs) when is_map_key(@data_inputs, name) do
    emulated?(type) and Enum.all?(data_inputs(name, inputs), fn {t, data?} -> not data? or t.type == type end)
  end

  defp storage_op?(_name, _outs, _inputs), do: false

  # Each input with whether it carries data.
  defp data_inputs(name, inputs) do
    case @data_inputs[name] do
      :all -> Enum.map(inputs, &{&1, true})
      positions -> inputs |> Enum.with_index() |> Enum.map(fn {t, i} -> {t, i in positions} end)
    end
  end

  # The data moves as stored; a predicate or index of an f8 type is read
  # by value (its -0.0 is false).
  defp run_storage(outs, name, inputs, attrs, send) do
    stored = for t <- outs, do: %{t | type: storage(t.type)}
    inputs = for {t, data?} <- data_inputs(name, inputs), do: if(data?, do: relabel(t), else: widen(t))
    send.(List.to_tuple(stored), name, inputs, map_types(attrs, &storage/1)) |> Tuple.to_list()
  end

  defp relabel(%T{type: type} = t), do: %{t | type: storage(type)}

  # Every other op: f8 inputs widen (to f64, where the op runs: Nx.BinaryBackend
  # computes f8 in Elixir floats, and f32 would round differently near the
  # f8 steps), sub-byte integers are read as
  # the 8-bit integers that hold them; the op runs in those types; the
  # results of emulated types are rounded (floats) or wrapped (integers).
  defp run_emulated(outs, :astype, [x], _attrs, _send), do: Enum.map(outs, &narrow(widen(x), &1.type))

  defp run_emulated([out], :bitcast, [x], _attrs, send) do
    {bits} = send.({%{out | type: storage(out.type)}}, :bitcast, [relabel(x)], %{type: storage(out.type)})
    [wrap(bits, out.type)]
  end

  defp run_emulated(outs, name, [%T{type: {k, bits}} = x], _attrs, send)
       when name in [:population_count, :count_leading_zeros] and k in [:s, :u] and bits < 8 do
    # Counted in the value's own bits: the stored byte's unsigned low bits.
    low = x |> relabel() |> Nx.bitcast(:u8) |> Nx.bitwise_and(const(x, Integer.pow(2, bits) - 1, :u8))
    [out] = outs
    {counted} = send.({%{out | type: {:u, 8}}}, name, [low], %{type: {:u, 8}})
    counted = if name == :count_leading_zeros, do: Nx.subtract(counted, const(x, 8 - bits, :u8)), else: counted
    [narrow(counted, out.type)]
  end

  defp run_emulated(outs, name, inputs, attrs, send) do
    computed = for t <- outs, do: %{t | type: compute(t.type)}
    results = send.(List.to_tuple(computed), name, Enum.map(inputs, &widen/1), map_types(attrs, &compute/1))
    results |> Tuple.to_list() |> Enum.zip_with(outs, &narrow(&1, &2.type))
  end

  defp compute(type) when type in @f8, do: {:f, 64}
  defp compute(type), do: storage(type)

  # Attribute values that are types (:type, :input_type, :index_type...).
  defp map_types(attrs, fun) when is_map(attrs) do
    Map.new(attrs, fn
      {key, {kind, bits} = type} when is_atom(kind) and is_integer(bits) -> {key, fun.(type)}
      pair -> pair
    end)
  end

  defp map_types(attrs, _fun), do: attrs

  ## complex128

  # Storage ops see the hidden trailing axis of 2 in shapes and axes.
  defp run_c128([out], :astype, [x], _attrs, _send) do
    re = x |> widen() |> Nx.as_type({:f, 64})
    im = Nx.broadcast(const(x, 0.0, {:f, 64}), re.shape)
    [%{Nx.stack([re, im], axis: -1) | type: out.type}]
  end

  defp run_c128([out], name, inputs, _attrs, _send) when name in @c128_parts do
    [c128_parts(name, Enum.map(inputs, &parts/1), out)]
  end

  defp run_c128(outs, name, inputs, attrs, send) do
    stored = for t <- outs, do: c128_storage(t)
    inputs = for t <- inputs, do: if(t.type == {:c, 128}, do: c128_storage(t), else: t)
    send.(List.to_tuple(stored), name, inputs, c128_attrs(name, attrs, hd(outs))) |> Tuple.to_list()
  end

  defp c128_parts(:add, [{ra, ia}, {rb, ib}], out), do: from_parts(Nx.add(ra, rb), Nx.add(ia, ib), out)
  defp c128_parts(:subtract, [{ra, ia}, {rb, ib}], out), do: from_parts(Nx.subtract(ra, rb), Nx.subtract(ia, ib), out)

  defp c128_parts(:multiply, [{ra, ia}, {rb, ib}], out) do
    re = Nx.subtract(Nx.multiply(ra, rb), Nx.multiply(ia, ib))
    from_parts(re, Nx.add(Nx.multiply(ia, rb), Nx.multiply(ra, ib)), out)
  end

  defp c128_parts(:negate, [{re, im}], out), do: from_parts(Nx.negate(re), Nx.negate(im), out)
  defp c128_parts(:conjugate, [{re, im}], out), do: from_parts(re, Nx.negate(im), out)
  defp c128_parts(:real, [{re, _}], out), do: narrow(re, out.type)

  # Complex.abs/1: |big| * sqrt(1 + (small / big)^2), a zero part gives the
  # other; infinite with any non-finite part, NaN only when both are NaN.
  defp c128_parts(:abs, [{re, im}], out) do
    c = &const(re, &1, {:f, 64})
    {x, y} = {Nx.abs(re), Nx.abs(im)}
    {big, small} = {Nx.max(x, y), Nx.min(x, y)}
    ratio = Nx.divide(small, big)
    hypot = Nx.multiply(big, Nx.sqrt(Nx.add(c.(1.0), Nx.multiply(ratio, ratio))))
    finite = Nx.select(Nx.equal(x, c.(0.0)), y, Nx.select(Nx.equal(y, c.(0.0)), x, hypot))
    non_finite = [re, im] |> Enum.flat_map(&[Nx.is_nan(&1), Nx.is_infinity(&1)]) |> Enum.reduce(&Nx.logical_or/2)
    both_nan = Nx.logical_and(Nx.is_nan(re), Nx.is_nan(im))
    result = Nx.select(both_nan, c.(:nan), Nx.select(non_finite, c.(:infinity), finite))
    narrow(result, out.type)
  end

  defp c128_parts(:imag, [{_, im}], out), do: narrow(im, out.type)

  defp from_parts(re, im, %T{type: {:c, 128}} = out), do: %{Nx.stack([re, im], axis: -1) | type: out.type}

  # The real and imaginary parts, as f64 tensors of `t`'s shape.
  defp parts(%T{type: {:c, 128}} = t) do
    stored = c128_storage(t)
    part = &(stored |> Nx.slice_along_axis(&1, 1, axis: -1) |> Nx.squeeze(axes: [-1]))
    {part.(0), part.(1)}
  end

  defp parts(%T{type: {:c, _}} = t), do: {Nx.as_type(Nx.real(t), {:f, 64}), Nx.as_type(Nx.imag(t), {:f, 64})}

  defp parts(t) do
    re = t |> widen() |> Nx.as_type({:f, 64})
    {re, Nx.broadcast(const(t, 0.0, {:f, 64}), re.shape)}
  end

  defp c128_storage(%T{type: {:c, 128}, shape: shape, names: names} = t),
    do: %{t | type: {:f, 64}, shape: Tuple.insert_at(shape, tuple_size(shape), 2), names: names ++ [nil]}

  defp c128_attrs(:reshape, %{shape: shape} = a, _out), do: %{a | shape: shape ++ [2]}

  defp c128_attrs(:broadcast, %{shape: shape, axes: axes} = a, _out),
    do: %{a | shape: shape ++ [2], axes: axes ++ [length(shape)]}

  defp c128_attrs(:transpose, %{axes: axes} = a, _out), do: %{a | axes: axes ++ [length(axes)]}

  defp c128_attrs(:slice, %{starts: s, lengths: l, strides: st} = a, _out),
    do: %{a | starts: s ++ [0], lengths: l ++ [2], strides: st ++ [1]}

  defp c128_attrs(_name, attrs, out), do: map_types(attrs, fn t -> if t == out.type, do: {:f, 64}, else: t end)

  ## Widening and narrowing

  # An f8 tensor as f32 (exactly: a lookup of its byte); others as stored.
  f32 = fn
    x when is_number(x) -> <<x::float-32-native>>
    :nan -> Nx.Type.nan_binary({:f, 32})
    :infinity -> Nx.Type.infinity_binary({:f, 32})
    :neg_infinity -> Nx.Type.neg_infinity_binary({:f, 32})
  end

  for type <- @f8 do
    load = if type == {:f, 8}, do: &Nx.Floating.load_f8/1, else: &Nx.Floating.load_f8_e4m3fn/1
    table = for byte <- 0..255, into: <<>>, do: f32.(load.(<<byte>>))

    defp widen(%T{type: unquote(type)} = t) do
      table = Nx.from_binary(unquote(table), {:f, 32}, backend: backend(t))
      Nx.take(table, relabel(t))
    end
  end

  defp widen(t), do: relabel(t)

  # `x` (of an MLX type) rounded or wrapped into `type`, as Nx.BinaryBackend
  # writes a value of that type.
  defp narrow(%T{type: type} = x, type), do: x

  defp narrow(%T{type: {:c, _}} = x, type) when type != {:c, 128}, do: narrow(Nx.real(x), type)

  defp narrow(x, {:f, 8} = type) do
    # Nx writes the f16 (rounded to nearest even) and keeps its high byte.
    high = x |> Nx.as_type({:f, 16}) |> Nx.bitcast({:u, 16}) |> Nx.right_shift(const(x, 8, :u16))
    bytes = Nx.select(Nx.is_nan(x), const(x, 0x7E, :u8), Nx.as_type(high, {:u, 8}))
    %{bytes | type: type}
  end

  defp narrow(x, {:f8_e4m3fn, 8} = type), do: %{e4m3fn(Nx.as_type(x, {:f, 64})) | type: type}

  defp narrow(%T{type: {k, _}} = x, {kind, bits} = type) when kind in [:s, :u] and bits < 8 and k in [:f, :bf] do
    # NaN is 0 and infinities the type's limits, as in Nx; the worker
    # converts the rest wrapping like Nx.
    {min, max} =
      if kind == :s, do: {-Integer.pow(2, bits - 1), Integer.pow(2, bits - 1) - 1}, else: {0, Integer.pow(2, bits) - 1}

    stored = storage(type)
    wrapped = x |> Nx.as_type(stored) |> wrap(type)
    limits = Nx.select(Nx.greater(x, const(x, 0.0, x.type)), const(x, max, stored), const(x, min, stored))
    %{Nx.select(Nx.is_infinity(x), limits, relabel(wrapped)) | type: type}
  end

  defp narrow(x, {kind, bits} = type) when kind in [:s, :u] and bits < 8,
    do: x |> Nx.as_type(storage(type)) |> wrap(type)

  defp narrow(x, type), do: Nx.as_type(x, type)

  # Storage bytes of a sub-byte integer type put back into its range.
  defp wrap(%T{} = x, {:s, bits} = type) when bits < 8 do
    x = %{x | type: {:s, 8}}
    shift = const(x, 8 - bits, :s8)
    %{Nx.right_shift(Nx.left_shift(x, shift), shift) | type: type}
  end

  defp wrap(%T{} = x, {:u, bits} = type) when bits < 8,
    do: %{Nx.bitwise_and(%{x | type: {:u, 8}}, const(x, Integer.pow(2, bits) - 1, :u8)) | type: type}

  defp wrap(x, _type), do: x

  # Nx.Floating.dump_f8_e4m3fn/1 on every element of an f64 tensor, bit for
  # bit: clamp to ±448; below 2^-6 the subnormal mantissa round(|x| * 512),
  # at most 7; else the exponent and round((significand - 1) * 8), at most 7
  # (Nx caps the mantissa instead of carrying into the exponent); the sign
  # of negative values (not of -0.0); NaN is 0x7F.
  defp e4m3fn(x) do
    c = &const(x, &1, &2)
    a = Nx.min(Nx.abs(x), c.(448.0, :f64))
    bits = Nx.bitcast(a, :s64)
    exp = Nx.subtract(Nx.right_shift(bits, c.(52, :s64)), c.(1016, :s64))
    # round((significand - 1) * 8): the 52-bit fraction over 2^49, half up.
    fraction = Nx.bitwise_and(bits, c.(Integer.pow(2, 52) - 1, :s64))
    mantissa = Nx.right_shift(Nx.add(fraction, c.(Integer.pow(2, 48), :s64)), c.(49, :s64))
    normal = Nx.add(Nx.multiply(exp, c.(8, :s64)), Nx.min(mantissa, c.(7, :s64)))
    subnormal = Nx.add(Nx.multiply(a, c.(512.0, :f64)), c.(0.5, :f64)) |> Nx.floor() |> Nx.min(c.(7.0, :f64))
    magnitude = Nx.select(Nx.greater(exp, c.(0, :s64)), normal, Nx.as_type(subnormal, {:s, 64}))
    code = Nx.add(magnitude, Nx.select(Nx.less(x, c.(0.0, :f64)), c.(128, :s64), c.(0, :s64)))
    Nx.select(Nx.is_nan(x), c.(0x7F, :u8), Nx.as_type(code, {:u, 8}))
  end

  # A scalar constant on the worker of `like`.
  defp const(like, value, type), do: Nx.tensor(value, type: type, backend: backend(like))

  defp backend(%T{data: %backend{ref: ref, device: device}}), do: {backend, worker: ref.worker, device: device}
end
