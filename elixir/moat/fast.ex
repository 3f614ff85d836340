defmodule Moat.Fast do
  @moduledoc """
  Transformer kernels: RMS and layer norm, rotary embeddings, scaled
  dot-product attention and SwiGLU.

  Each is an `Nx.block/4`: on `Moat.Backend` it is one op in the worker, one
  call to MLX's `mlx::core::fast` kernel (fused on the GPU; on the CPU MLX
  runs its own composition of the same ops), except that on the CPU
  `rms_norm/3` and `scaled_dot_product_attention/4` (without a mask tensor)
  run the worker's own one-pass kernels, vectorized for the kernel set
  picked at start (AVX-512, AVX2 or scalar; `MOAT_CPU_FEATURES`, or `mlx`
  for MLX's). On every other backend, and
  under `defn` on any compiler, the reference composition of Nx ops written
  here runs, and `Nx.Defn.grad/2` differentiates that composition.

      x = Nx.iota({1, 4, 8}, type: :f32, backend: Moat.Backend)
      Moat.Fast.rms_norm(x, Nx.broadcast(1.0, {8}), eps: 1.0e-5)

  Types. Inputs are converted to their merged float type, which is the
  output type. The references compute `f16` and `bf16` in `f32` and round
  the result once, as MLX's kernels do. Integer inputs become floats
  (`Nx.Type.to_floating/1`); complex inputs are refused.

  `swiglu/2` has no MLX kernel: it is the composition `silu(gate) * up`
  everywhere.

  Vectorized tensors are refused.
  """

  import Nx.Defn.Kernel, only: [keyword!: 2]

  defmodule RMSNorm do
    @moduledoc false
    defstruct eps: 1.0e-5
  end

  defmodule LayerNorm do
    @moduledoc false
    defstruct eps: 1.0e-5
  end

  defmodule Rope do
    @moduledoc false
    # positions: the input after x is a {T} or {B, T} tensor of position ids
    # (MLX's kernel has none: the reference runs everywhere).
    defstruct dims: nil, traditional: false, base: 10_000.0, scale: 1.0, offset: 0, seq_axis: nil, positions: false
  end

  defmodule SDPA do
    @moduledoc false
    # extras: the roles of the inputs after q, k, v, in order (a subset of
    # [:mask, :lengths, :starts, :sinks]).
    defstruct scale: nil, causal: false, extras: []
  end

  ## RMS norm

  @doc """
  `x / sqrt(mean(x², last axis) + eps) * weight`, `weight` of shape
  `{last axis}`.

  Options: `:eps` (default `1.0e-5`).
  """
  @spec rms_norm(Nx.Tensor.t(), Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  def rms_norm(x, weight, opts \\ []) do
    opts = keyword!(opts, eps: 1.0e-5)
    [x, weight] = floats!(:rms_norm, [x, weight])
    vector!(:rms_norm, x, weight, "weight")
    out = Nx.template(x.shape, x.type, names: x.names)
    Nx.block(%RMSNorm{eps: opts[:eps]}, [x, weight], out, &rms_norm_ref/3)
  end

  defp rms_norm_ref(%RMSNorm{eps: eps}, x, weight) do
    {c, t} = {compute(x), x.type}
    x = Nx.as_type(x, c)
    ms = Nx.mean(Nx.multiply(x, x), axes: [-1], keep_axes: true)
    x |> Nx.multiply(Nx.rsqrt(Nx.add(ms, eps))) |> Nx.as_type(t) |> Nx.multiply(weight)
  end

  ## Layer norm

  @doc """
  `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis;
  `weight` and `bias` of shape `{last axis}`, `bias` may be `nil`.

  Options: `:eps` (default `1.0e-5`).
  """
  @spec layer_norm(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t() | nil, keyword()) :: Nx.Tensor.t()
  def layer_norm(x, weight, bias, opts \\ []) do
    opts = keyword!(opts, eps: 1.0e-5)
    args = floats!(:layer_norm, Enum.reject([x, weight, bias], &is_nil/1))
    [x | vectors] = args
    Enum.zip_with(vectors, ["weight", "bias"], &vector!(:layer_norm, x, &1, &2))
    out = Nx.template(x.shape, x.type, names: x.names)
    struct = %LayerNorm{eps: opts[:eps]}

    case args do
      [x, w] -> Nx.block(struct, [x, w], out, &layer_norm_ref(&1, &2, &3, nil))
      [x, w, b] -> Nx.block(struct, [x, w, b], out, &layer_norm_ref/4)
    end
  end

  defp layer_norm_ref(%LayerNorm{eps: eps}, x, weight, bias) do
    {c, t} = {compute(x), x.type}
    x = Nx.as_type(x, c)
    centered = Nx.subtract(x, Nx.mean(x, axes: [-1], keep_axes: true))
    var = Nx.mean(Nx.multiply(centered, centered), axes: [-1], keep_axes: true)
    y = centered |> Nx.multiply(Nx.rsqrt(Nx.add(var, eps))) |> Nx.as_type(t) |> Nx.multiply(weight)
    if bias, do: Nx.add(y, bias), else: y
  end

  ## Rotary embedding

  @doc """
  Rotary position embedding of the first `dims` features of `x` (the rest
  pass through), positions `offset, offset + 1, ...` along `:seq_axis`.

  Feature `i < dims / 2` turns by `scale * position * base^(-2i / dims)`
  (or `scale * position / freqs[i]` with `:freqs`). Split-half layout
  (default) pairs feature `i` with `i + dims / 2`; `traditional: true` pairs
  `2i` with `2i + 1`.

  Options: `:traditional` (`false`), `:base` (`10_000.0`), `:scale` (`1.0`),
  `:offset` (`0`: an integer; or an integer tensor, a scalar or one start
  per batch `{B}` along axis 0, so that a decode loop under `defn` does not
  retrace per step), `:freqs` (a `{dims / 2}` tensor,
  replaces `:base`), `:seq_axis` (default `-2`: `{B, H, T, D}` or
  `{B, T, D}`; pass `seq_axis: 1` for `{B, T, H, D}`, where every head of a
  row shares the row's position), `:positions` (an integer tensor of
  position ids, `{T}` or one row per batch `{B, T}`, in place of
  `:offset`: packed or left-padded batches; MLX has no kernel for it, so it
  runs the reference composition on every backend).
  """
  @spec rope(Nx.Tensor.t(), pos_integer(), keyword()) :: Nx.Tensor.t()
  def rope(x, dims, opts \\ []) do
    opts =
      keyword!(opts,
        traditional: false,
        base: 10_000.0,
        scale: 1.0,
        offset: 0,
        freqs: nil,
        seq_axis: -2,
        positions: nil
      )

    [x] = floats!(:rope, [x])
    rank = Nx.rank(x)
    last = if rank > 0, do: elem(x.shape, rank - 1), else: 0

    unless rank >= 2 and is_integer(dims) and dims > 0 and rem(dims, 2) == 0 and dims <= last do
      raise ArgumentError,
            "Moat.Fast.rope: dims must be a positive even integer at most the last axis of a tensor " <>
              "of rank at least 2, got dims #{inspect(dims)} for shape #{inspect(x.shape)}"
    end

    seq_axis = Nx.axis_index(x, opts[:seq_axis])

    if seq_axis == rank - 1 do
      raise ArgumentError, "Moat.Fast.rope: :seq_axis cannot be the feature (last) axis"
    end

    offset = opts[:offset]
    positions = positions!(opts[:positions], offset, x, seq_axis)
    offsets = positions || offsets!(offset, x, seq_axis)

    struct = %Rope{
      dims: dims,
      traditional: opts[:traditional] == true,
      base: opts[:base] * 1.0,
      scale: opts[:scale] * 1.0,
      offset: if(offsets, do: nil, else: offset),
      seq_axis: seq_axis,
      positions: positions != nil
    }

    freqs =
      if freqs = opts[:freqs] do
        freqs = Nx.as_type(freqs, {:f, 32})

        if freqs.shape != {div(dims, 2)} do
          raise ArgumentError,
                "Moat.Fast.rope: :freqs must have shape {#{div(dims, 2)}}, got #{inspect(freqs.shape)}"
        end

        freqs
      end

    out = Nx.template(x.shape, x.type, names: x.names)

    case {offsets, freqs} do
      {nil, nil} -> Nx.block(struct, [x], out, &rope_ref(&1, &2, nil, nil))
      {nil, f} -> Nx.block(struct, [x, f], out, &rope_ref(&1, &2, nil, &3))
      {o, nil} -> Nx.block(struct, [x, o], out, &rope_ref(&1, &2, &3, nil))
      {o, f} -> Nx.block(struct, [x, o, f], out, &rope_ref/4)
    end
  end

  defp positions!(nil, _offset, _x, _seq_axis), do: nil

  defp positions!(%Nx.Tensor{type: {k, _}} = p, 0, x, seq_axis) when k in [:s, :u] do
    {batch, len} = {elem(x.shape, 0), elem(x.shape, seq_axis)}

    cond do
      p.shape == {len} ->
        p

      p.shape == {batch, len} and Nx.rank(x) >= 3 and seq_axis != 0 ->
        p

      true ->
        raise ArgumentError,
              "Moat.Fast.rope: :positions must have shape {#{len}} or {#{batch}, #{len}} (one row per batch, " <>
                "with :seq_axis not 0), got #{inspect(p.shape)}"
    end
  end

  defp positions!(positions, offset, _x, _seq_axis) do
    raise ArgumentError,
          "Moat.Fast.rope: :positions must be an integer tensor and comes instead of :offset, got " <>
            "positions #{inspect(positions)} with offset #{inspect(offset)}"
  end

  defp offsets!(offset, _x, _seq_axis) when is_integer(offset) and offset >= 0 and offset < 2_147_483_648, do: nil

  defp offsets!(%Nx.Tensor{type: {k, _}} = offset, x, seq_axis) when k in [:s, :u] do
    batch = elem(x.shape, 0)

    cond do
      offset.shape == {} ->
        offset

      offset.shape == {batch} and Nx.rank(x) >= 3 and seq_axis != 0 ->
        offset

      true ->
        raise ArgumentError,
              "Moat.Fast.rope: an :offset tensor must be a scalar or {#{batch}} (one per batch, " <>
                "with :seq_axis not 0), got shape #{inspect(offset.shape)}"
    end
  end

  defp offsets!(offset, _x, _seq_axis) do
    raise ArgumentError,
          "Moat.Fast.rope: :offset must be a non-negative integer or an integer tensor, got #{inspect(offset)}"
  end

  defp rope_ref(%Rope{} = r, x, offsets, freqs) do
    {c, t, shape, rank} = {compute(x), x.type, x.shape, Nx.rank(x)}
    half = div(r.dims, 2)
    len = elem(shape, r.seq_axis)
    xc = Nx.as_type(x, c)

    inv_freqs =
      if freqs,
        do: Nx.divide(1.0, Nx.as_type(freqs, c)),
        else: Nx.exp(Nx.multiply(Nx.iota({half}, type: c), -:math.log(r.base) / half))

    # Positions {P, T}: P is 1, or the batch with per-batch offsets.
    positions =
      if r.positions do
        offsets |> Nx.as_type(c) |> Nx.reshape({:auto, len}) |> Nx.multiply(r.scale)
      else
        start = if offsets, do: Nx.as_type(offsets, c), else: r.offset
        start = if is_struct(start) and Nx.rank(start) == 1, do: Nx.reshape(start, {:auto, 1}), else: start
        Nx.multiply(Nx.add(Nx.iota({1, len}, type: c), start), r.scale)
      end

    per = elem(positions.shape, 0)
    theta = Nx.multiply(Nx.reshape(positions, {per, len, 1}), Nx.reshape(inv_freqs, {1, 1, half}))
    # {P, T, half} placed at the batch, sequence and feature axes, 1 elsewhere.
    angle_shape =
      for i <- 0..(rank - 1) do
        cond do
          i == r.seq_axis -> len
          i == rank - 1 -> half
          i == 0 -> per
          true -> 1
        end
      end

    angle_shape = List.to_tuple(angle_shape)
    {cos, sin} = {Nx.reshape(Nx.cos(theta), angle_shape), Nx.reshape(Nx.sin(theta), angle_shape)}

    {a, b} =
      if r.traditional do
        pairs =
          Nx.reshape(Nx.slice_along_axis(xc, 0, r.dims, axis: -1), Tuple.insert_at(put_last(shape, half), rank, 2))

        {Nx.squeeze(Nx.slice_along_axis(pairs, 0, 1, axis: -1), axes: [-1]),
         Nx.squeeze(Nx.slice_along_axis(pairs, 1, 1, axis: -1), axes: [-1])}
      else
        {Nx.slice_along_axis(xc, 0, half, axis: -1), Nx.slice_along_axis(xc, half, half, axis: -1)}
      end

    ra = Nx.subtract(Nx.multiply(a, cos), Nx.multiply(b, sin))
    rb = Nx.add(Nx.multiply(a, sin), Nx.multiply(b, cos))

    rotated =
      if r.traditional,
        do: Nx.reshape(Nx.stack([ra, rb], axis: -1), put_last(shape, r.dims)),
        else: Nx.concatenate([ra, rb], axis: -1)

    last = elem(shape, rank - 1)

    rotated =
      if r.dims < last,
        do: Nx.concatenate([rotated, Nx.slice_along_axis(xc, r.dims, last - r.dims, axis: -1)], axis: -1),
        else: rotated

    Nx.as_type(rotated, t)
  end

  # `shape` with its last axis replaced by `size`.
  defp put_last(shape, size),
    do: Tuple.insert_at(Tuple.delete_at(shape, tuple_size(shape) - 1), tuple_size(shape) - 1, size)

  ## Attention

  @doc """
  `softmax(q · kᵀ * scale + mask) · v` for `q` `{B, Hq, Tq, D}`, `k`
  `{B, Hkv, Tk, D}` and `v` `{B, Hkv, Tk, Dv}`; the result is
  `{B, Hq, Tq, Dv}`.

  Grouped-query attention: `Hkv` may be any divisor of `Hq`; query head `h`
  reads key/value head `div(h, Hq / Hkv)`. K and V are not repeated.

  Options:

    * `:scale` — default `1 / sqrt(D)`;
    * `:mask` — `nil` (default); `:causal` (query `i` sees keys
      `j <= i + Tk - Tq`, as MLX aligns it: the queries are the last `Tq`
      positions, so with `Tq > Tk` the first rows see nothing); or a
      tensor broadcastable to `{B, Hq, Tq, Tk}`: a float mask is added to
      the scores, an integer one (`u8`, as Nx's comparisons give) is boolean,
      non-zero where a query may attend;
    * `:lengths` — an integer tensor, `{B}` or a scalar: row `b` attends to
      keys `j < lengths[b]` only (the valid prefix of a KV cache; values are
      clamped to `0..Tk`). With `mask: :causal` the queries are the last
      `Tq` positions of that prefix: query `i` sees `j <= lengths[b] - Tq + i`;
    * `:starts` — an integer tensor, `{B}` or a scalar: keys `j < starts[b]`
      are masked (left padding in batched decoding);
    * `:sinks` — a `{Hq}` tensor of attention-sink logits: one extra logit
      per query head in the softmax's denominator, with no value.

  A row in which no key is kept is not defined (Moat's CPU kernel gives
  zeros, the reference the mean of V).

  On Moat's CPU worker, without a `:mask` tensor, this is the worker's
  one-pass kernel (scores, softmax and the weighted sum per query row,
  over the kept keys only, vectorized for the kernel set picked at start:
  see `MOAT_CPU_FEATURES`); otherwise MLX's `fast` kernel.
  """
  @spec scaled_dot_product_attention(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  def scaled_dot_product_attention(q, k, v, opts \\ []) do
    opts = keyword!(opts, scale: nil, mask: nil, lengths: nil, starts: nil, sinks: nil)
    [q, k, v] = floats!(:scaled_dot_product_attention, [q, k, v])
    # Sinks take the output type; they do not widen it.
    sinks =
      case opts[:sinks] do
        nil -> []
        s -> Enum.map(floats!(:scaled_dot_product_attention, [s]), &Nx.as_type(&1, q.type))
      end

    {b, hq, tq, d, _hkv, tk, dv} = attention_shapes!(q, k, v)
    scale = if opts[:scale], do: opts[:scale] * 1.0, else: 1.0 / :math.sqrt(d)
    out = Nx.template({b, hq, tq, dv}, q.type)

    {causal, mask} =
      case opts[:mask] do
        nil -> {false, []}
        :causal -> {true, []}
        mask -> {false, [mask: mask!(Nx.to_tensor(mask), {b, hq, tq, tk})]}
      end

    extras =
      Enum.reject(
        mask ++
          [
            lengths: per_batch!(opts[:lengths], :lengths, b),
            starts: per_batch!(opts[:starts], :starts, b),
            sinks: sinks!(sinks, hq)
          ],
        fn {_, t} -> t == nil end
      )

    struct = %SDPA{scale: scale, causal: causal, extras: Keyword.keys(extras)}
    Nx.block(struct, [q, k, v | Keyword.values(extras)], out, sdpa_fun(length(extras)))
  end

  # Nx.block/4 applies its function to the arguments one by one.
  defp sdpa_fun(0), do: &sdpa_ref(&1, &2, &3, &4, [])
  defp sdpa_fun(1), do: &sdpa_ref(&1, &2, &3, &4, [&5])
  defp sdpa_fun(2), do: &sdpa_ref(&1, &2, &3, &4, [&5, &6])
  defp sdpa_fun(3), do: &sdpa_ref(&1, &2, &3, &4, [&5, &6, &7])
  defp sdpa_fun(4), do: &sdpa_ref(&1, &2, &3, &4, [&5, &6, &7, &8])

  defp per_batch!(nil, _name, _b), do: nil

  defp per_batch!(t, name, b) do
    t = Nx.to_tensor(t)

    unless Nx.Type.integer?(t.type) and t.shape in [{}, {b}] do
      raise ArgumentError,
            "Moat.Fast.scaled_dot_product_attention: :#{name} must be an integer scalar or {#{b}} " <>
              "(one per batch), got #{inspect(t.type)} of shape #{inspect(t.shape)}"
    end

    t
  end

  defp sinks!([], _hq), do: nil

  defp sinks!([s], hq) do
    unless s.shape == {hq} do
      raise ArgumentError,
            "Moat.Fast.scaled_dot_product_attention: :sinks must have shape {#{hq}} (one logit per " <>
              "query head), got #{inspect(s.shape)}"
    end

    s
  end

  defp sdpa_ref(%SDPA{scale: scale, causal: causal, extras: roles}, q, k, v, extras) do
    extras = Map.new(Enum.zip(roles, extras))
    {b, hq, tq, d} = q.shape
    {_, hkv, tk, dv} = v.shape
    {c, t} = {compute(q), q.type}
    reps = div(hq, hkv)
    # Query heads h = g * reps + r read kv head g: {B, Hkv, reps * Tq, D}.
    qg = q |> Nx.as_type(c) |> Nx.multiply(scale) |> Nx.reshape({b, hkv, reps * tq, d})
    scores = Nx.dot(qg, [3], [0, 1], Nx.as_type(k, c), [3], [0, 1]) |> Nx.reshape({b, hq, tq, tk})
    floor = Nx.Constants.min_finite(c)
    keys = Nx.iota({1, 1, 1, tk})
    bound = fn x -> x |> Nx.as_type({:s, 64}) |> Nx.clip(0, tk) |> Nx.broadcast({b}) |> Nx.reshape({b, 1, 1, 1}) end
    ends = if l = extras[:lengths], do: bound.(l), else: Nx.broadcast(tk, {b, 1, 1, 1})

    keep =
      Enum.reduce(
        [
          causal && Nx.less_equal(keys, Nx.add(Nx.subtract(ends, tq), Nx.iota({1, 1, tq, 1}))),
          extras[:lengths] && Nx.less(keys, ends),
          extras[:starts] && Nx.greater_equal(keys, bound.(extras[:starts]))
        ],
        nil,
        fn
          x, acc when x in [nil, false] -> acc
          x, nil -> x
          x, acc -> Nx.logical_and(x, acc)
        end
      )

    scores = if keep, do: Nx.select(Nx.broadcast(keep, scores.shape), scores, floor), else: scores

    scores =
      case extras[:mask] do
        nil ->
          scores

        mask ->
          if Nx.Type.integer?(mask.type),
            do: Nx.select(Nx.broadcast(mask, scores.shape), scores, floor),
            else: Nx.add(scores, Nx.as_type(mask, c))
      end

    sinks = if s = extras[:sinks], do: s |> Nx.as_type(c) |> Nx.reshape({1, hq, 1, 1}) |> Nx.broadcast({b, hq, tq, 1})

    top =
      Nx.reduce_max(if(sinks, do: Nx.concatenate([scores, sinks], axis: 3), else: scores), axes: [-1], keep_axes: true)

    e = Nx.exp(Nx.subtract(scores, top))
    sum = Nx.sum(e, axes: [-1], keep_axes: true)
    sum = if sinks, do: Nx.add(sum, Nx.exp(Nx.subtract(sinks, top))), else: sum
    probs = Nx.divide(e, sum) |> Nx.reshape({b, hkv, reps * tq, tk})

    probs
    |> Nx.dot([3], [0, 1], Nx.as_type(v, c), [2], [0, 1])
    |> Nx.reshape({b, hq, tq, dv})
    |> Nx.as_type(t)
  end

  defp attention_shapes!(q, k, v) do
    case {q.shape, k.shape, v.shape} do
      {{b, hq, tq, d}, {b, hkv, tk, d}, {b, hkv, tk, dv}} when hkv > 0 and rem(hq, hkv) == 0 ->
        {b, hq, tq, d, hkv, tk, dv}

      {qs, ks, vs} ->
        raise ArgumentError,
              "Moat.Fast.scaled_dot_product_attention: expected q {B, Hq, Tq, D}, k {B, Hkv, Tk, D} " <>
                "and v {B, Hkv, Tk, Dv} with Hkv dividing Hq, got #{inspect(qs)}, #{inspect(ks)}, #{inspect(vs)}"
    end
  end

  defp mask!(%Nx.Tensor{shape: shape, type: type} = mask, scores) do
    rank = tuple_size(shape)

    fits =
      rank <= 4 and
        Enum.all?(Enum.zip(Enum.reverse(Tuple.to_list(shape)), Enum.reverse(Tuple.to_list(scores))), fn {m, s} ->
          m == 1 or m == s
        end)

    cond do
      match?({:c, _}, type) ->
        raise ArgumentError, "Moat.Fast.scaled_dot_product_attention: a complex mask is neither boolean nor additive"

      not fits ->
        raise ArgumentError,
              "Moat.Fast.scaled_dot_product_attention: mask of shape #{inspect(shape)} does not broadcast " <>
                "to the scores' #{inspect(scores)}"

      true ->
        mask
    end
  end

  ## SwiGLU

  @doc """
  `silu(gate) * up`, i.e. `gate * sigmoid(gate) * up`. MLX has no fast
  kernel for it: this is the composition on every backend.
  """
  @spec swiglu(Nx.Tensor.t(), Nx.Tensor.t()) :: Nx.Tensor.t()
  def swiglu(gate, up), do: gate |> Nx.multiply(Nx.sigmoid(gate)) |> Nx.multiply(up)

  ## References

  @doc """
  The reference composition of a kernel's block struct, on `args` as the
  kernel's `Nx.block/4` receives them (inputs already in the output type).
  What every backend other than Moat runs; `bench/fast.exs` times it on Moat.
  """
  @spec reference(struct(), [Nx.Tensor.t()]) :: Nx.Tensor.t()
  def reference(%RMSNorm{} = s, [x, w]), do: rms_norm_ref(s, x, w)
  def reference(%LayerNorm{} = s, [x, w]), do: layer_norm_ref(s, x, w, nil)
  def reference(%LayerNorm{} = s, [x, w, b]), do: layer_norm_ref(s, x, w, b)
  def reference(%Rope{offset: nil} = s, [x, offsets | freqs]), do: rope_ref(s, x, offsets, List.first(freqs))
  def reference(%Rope{} = s, [x]), do: rope_ref(s, x, nil, nil)
  def reference(%Rope{} = s, [x, freqs]), do: rope_ref(s, x, nil, freqs)
  def reference(%SDPA{} = s, [q, k, v | extras]), do: sdpa_ref(s, q, k, v, extras)

  ## Helpers

  # f16 and bf16 are computed in f32, as MLX's kernels do.
  defp compute(%Nx.Tensor{type: {_, 16}}), do: {:f, 32}
  defp compute(%Nx.Tensor{type: t}), do: t

  defp floats!(name, tensors) do
    tensors = Enum.map(tensors, &Nx.to_tensor/1)

    if Enum.any?(tensors, &(&1.vectorized_axes != [])) do
      raise ArgumentError, "Moat.Fast.#{name}: vectorized tensors are not supported"
    end

    type = tensors |> Enum.map(& &1.type) |> Enum.reduce(&Nx.Type.merge/2) |> Nx.Type.to_floating()

    if match?({:c, _}, type) do
      raise ArgumentError, "Moat.Fast.#{name}: complex tensors are not supported"
    end

    Enum.map(tensors, &Nx.as_type(&1, type))
  end

  defp vector!(name, x, v, what) do
    last = if Nx.rank(x) > 0, do: elem(x.shape, Nx.rank(x) - 1)

    if last == nil or v.shape != {last} do
      raise ArgumentError,
            "Moat.Fast.#{name}: #{what} must have shape {#{inspect(last)}} (the last axis of x, " <>
              "#{inspect(x.shape)}), got #{inspect(v.shape)}"
    end
  end
end
