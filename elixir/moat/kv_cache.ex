defmodule Moat.KVCache do
  @moduledoc """
  A key/value cache for autoregressive decoding: preallocated `{B, H, L, D}`
  key and value buffers, written in place in the worker, and attention over
  their valid prefix.

      cache = Moat.KVCache.new(batch: 1, heads: 8, max_len: 160, head_dim: 64, type: :bf16)
      cache = Moat.KVCache.update(cache, k, v)          # k, v: {B, H, T, D}
      out = Moat.KVCache.attend(cache, q, mask: :causal) # q: {B, Hq, T, D}

  `update/3` writes the new rows at `offset` (the rows already held) and
  advances it. `attend/3` is `Moat.Fast.scaled_dot_product_attention/4`
  over the keys `starts[b] <= j < offset` (`:lengths` and `:starts`), so it
  never reads the unwritten rows, and its shapes do not change from step
  to step. `:starts` (`{B}`, default 0) is left padding: in a batch of
  prompts of different lengths, padded on the left to one length, row `b`'s
  first real token is at `starts[b]`; `positions/1` gives each row's
  position for `Moat.Fast.rope/3`'s `:offset`.

  ## In place, and what happens to the old handles

  On `Moat.Backend`, a write is one worker op, `kv_write`: MLX's
  `slice_update`, which writes the new rows into the cache's own buffer
  when nothing else holds that buffer, instead of copying the whole cache.
  For that, the op takes the cache's tensor over: **after `update/3`, the
  cache passed in is spent** — reading one of its tensors raises a
  `Moat.Error` saying which tensor it was moved into. Use the returned
  cache. Anything that still holds the old contents (a view of the old
  cache, an op built on it but not yet evaluated) makes MLX copy first,
  so no result ever sees rows written after it was built: the write is in
  place only when that is invisible.

  A write past the end (`offset + T > L`) raises an `ArgumentError` when
  the offset is an integer (eager use), and fails the `kv_write` op when it
  is a tensor: the worker reads it, and never clamps.

  ## Inside `defn`

  The cache is an `Nx.Container`: pass it into and out of a `defn`. There
  `update/3` is an `Nx.block/4`: on `Moat.Compiler` it is the same
  `kv_write` op in the program (other compilers run the reference,
  `Nx.put_slice/3`, which clamps the offset as Nx does). As eagerly, a
  cache passed to a compiled function and updated there is spent by the
  call (`Moat.Compiler`'s `:donate`, on by default): the program's write
  goes into the cache's own buffer, so a decode loop that calls a
  compiled step per token copies no cache. With `donate: false` the
  argument stays readable and each call copies the cache into its output
  once. Inside a `while` loop of one program the cache is the loop's own
  state and the writes happen in place either way.
  """

  alias Moat.KVCache.Write

  @derive {Nx.Container, containers: [:keys, :values, :offset, :starts]}
  defstruct [:keys, :values, offset: 0, starts: 0]

  @type t :: %__MODULE__{
          keys: Nx.Tensor.t(),
          values: Nx.Tensor.t(),
          offset: non_neg_integer() | Nx.Tensor.t(),
          starts: non_neg_integer() | Nx.Tensor.t()
        }

  @doc """
  An empty cache of `{batch, heads, max_len, head_dim}` keys and
  `{batch, heads, max_len, value_dim}` values.

  Options: `:batch`, `:heads`, `:max_len`, `:head_dim` (required),
  `:value_dim` (default `:head_dim`), `:type` (default `:f32`), `:starts`
  (left padding, see above; default 0), `:backend` (default
  `Moat.Backend`).
  """
  @spec new(keyword()) :: t()
  def new(opts) do
    opts =
      Keyword.validate!(opts, [
        :batch,
        :heads,
        :max_len,
        :head_dim,
        value_dim: nil,
        type: :f32,
        starts: 0,
        backend: Moat.Backend
      ])

    for key <- [:batch, :heads, :max_len, :head_dim], not (is_integer(opts[key]) and opts[key] > 0) do
      raise ArgumentError, "Moat.KVCache.new: :#{key} must be a positive integer, got #{inspect(opts[key])}"
    end

    {b, h, l, d} = {opts[:batch], opts[:heads], opts[:max_len], opts[:head_dim]}
    zero = Nx.tensor(0, type: opts[:type], backend: opts[:backend])

    %__MODULE__{
      keys: Nx.broadcast(zero, {b, h, l, d}),
      values: Nx.broadcast(zero, {b, h, l, opts[:value_dim] || d}),
      offset: 0,
      starts: opts[:starts]
    }
  end

  @doc """
  Writes `keys` and `values` (`{B, H, T, D}`, converted to the cache's
  type) at the cache's offset and advances it by `T`. The cache passed in
  is spent (see "In place").
  """
  @spec update(t(), Nx.Tensor.t(), Nx.Tensor.t()) :: t()
  def update(%__MODULE__{offset: offset} = cache, keys, values) do
    t = elem(Nx.shape(keys), 2)
    at = offset!(cache, t)

    %{
      cache
      | keys: write(cache.keys, keys, at),
        values: write(cache.values, values, at),
        offset: if(is_integer(offset), do: offset + t, else: Nx.add(offset, t))
    }
  end

  @doc """
  Attention of `q` (`{B, Hq, Tq, D}`) over the cache's valid keys, after
  `update/3` wrote this step's: `Moat.Fast.scaled_dot_product_attention/4`
  with `lengths: offset` and `starts:`. Options are that function's
  (`:scale`, `mask: :causal`, `:sinks`); with `mask: :causal` the queries
  are the last `Tq` written positions.
  """
  @spec attend(t(), Nx.Tensor.t(), keyword()) :: Nx.Tensor.t()
  def attend(%__MODULE__{} = cache, q, opts \\ []) do
    extra = [lengths: scalar(cache.offset, cache.keys)] ++ starts(cache)
    Moat.Fast.scaled_dot_product_attention(q, cache.keys, cache.values, Keyword.merge(opts, extra))
  end

  @doc """
  Each row's position of the next token (`offset - starts`): the
  `:offset` for `Moat.Fast.rope/3` (an integer when both are integers).
  """
  @spec positions(t()) :: integer() | Nx.Tensor.t()
  def positions(%__MODULE__{offset: o, starts: s}) when is_integer(o) and is_integer(s), do: o - s
  def positions(%__MODULE__{offset: o, starts: s}), do: Nx.subtract(o, s)

  @doc """
  `rows` written into `cache` at `offset` along `axis` (default 2), in
  place where it can be (see "In place"); the building block of
  `update/3`.
  """
  @spec write(Nx.Tensor.t(), Nx.Tensor.t(), integer() | Nx.Tensor.t(), non_neg_integer()) :: Nx.Tensor.t()
  def write(cache, rows, offset, axis \\ 2) do
    rows = Nx.as_type(rows, cache.type)
    offset = scalar(offset, cache)
    out = Nx.to_template(cache)
    Nx.block(%Write{axis: axis}, [cache, rows, offset], out, &write_ref/4)
  end

  defp write_ref(%Write{axis: axis}, cache, rows, offset) do
    starts = List.replace_at(List.duplicate(0, Nx.rank(cache)), axis, offset)
    Nx.put_slice(cache, starts, rows)
  end

  defp offset!(%__MODULE__{offset: offset, keys: keys}, t) when is_integer(offset) do
    max = elem(keys.shape, 2)

    if offset < 0 or offset + t > max do
      raise ArgumentError,
            "Moat.KVCache.update: #{t} new rows at offset #{offset} do not fit the cache's #{max} rows"
    end

    offset
  end

  defp offset!(%__MODULE__{offset: offset}, _t), do: offset

  defp starts(%__MODULE__{starts: 0}), do: []
  defp starts(%__MODULE__{starts: s, keys: k}), do: [starts: scalar(s, k)]

  # An integer as an s32 scalar on `like`'s backend.
  defp scalar(n, %Nx.Tensor{data: %Moat.Backend{ref: ref, device: device}}) when is_integer(n),
    do: Nx.tensor(n, type: {:s, 32}, backend: {Moat.Backend, worker: ref.worker, device: device})

  defp scalar(n, _like) when is_integer(n), do: Nx.tensor(n, type: {:s, 32})
  defp scalar(t, _like), do: t
end
