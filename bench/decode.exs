# Greedy generation with a synthetic decoder-only transformer (random
# weights; Llama-shaped: RMS norm, rotary embeddings, grouped-query
# attention over a Moat.KVCache, SwiGLU, tied embeddings): prefill of a
# prompt, then one token per step, each read back (as a streaming server
# does). Variants, all on one worker, in one run:
#
#   eager            Nx ops on Moat.Backend, Moat.Fast's reference compositions
#   compiled         the same step as one Moat.Compiler program
#   compiled + fused the program with Moat.Fast's kernels (the worker's
#                    one-pass rms_norm and attention on the CPU)
#   4-bit            compiled + fused with Moat.quantize(w, bits: 4,
#                    group_size: 64) weights (skipped without Moat.quantize)
#
#   compiled + fused, donate: false
#                    the same program with the caches copied per step
#                    (Moat.Compiler's donate: false), for the copy that
#                    donation saves
#
# Then the roofline: every decode step reads each weight matrix once (and
# the tied head), so no path beats (read bandwidth) / (weight bytes) tok/s.
# The bandwidth is measured in the same run by reading the same weights in
# the worker: the sum of each, and a one-row product with each (the
# decode's own kernel); the faster counts.
#
# Run with `bin/bench decode` (or mix run -r bench/support.exs bench/decode.exs).
# Defaults (~100M parameters): MOAT_DECODE_LAYERS=12 DIM=768 HEADS=12
# KV_HEADS=4 FFN=2048 VOCAB=32000 PROMPT=32 TOKENS=128 TYPES=f32,bf16,
# each read as MOAT_DECODE_<NAME>; MOAT_DECODE_SIZE=small for ~9M. Decode
# tok/s is 1 / the median step; prefill is the median of 3.

import Bench
alias Moat.{Fast, KVCache}

env = fn name, default -> System.get_env("MOAT_DECODE_" <> name, default) end
int = fn name, default -> String.to_integer(env.(name, Integer.to_string(default))) end

# MOAT_DECODE_SIZE=small: a ~9M-parameter model, where per-op costs weigh
# more than the weights' bytes (each variable still overrides it).
preset =
  case env.("SIZE", "default") do
    "small" -> %{layers: 4, dim: 384, heads: 6, kv_heads: 2, ffn: 1024, vocab: 8000}
    _ -> %{layers: 12, dim: 768, heads: 12, kv_heads: 4, ffn: 2048, vocab: 32000}
  end

cfg = %{
  layers: int.("LAYERS", preset.layers),
  dim: int.("DIM", preset.dim),
  heads: int.("HEADS", preset.heads),
  kv_heads: int.("KV_HEADS", preset.kv_heads),
  ffn: int.("FFN", preset.ffn),
  vocab: int.("VOCAB", preset.vocab),
  prompt: int.("PROMPT", 32),
  tokens: int.("TOKENS", 128)
}

cfg = Map.put(cfg, :head_dim, div(cfg.dim, cfg.heads))
types = env.("TYPES", "f32,bf16") |> String.split(",") |> Enum.map(&Nx.Type.normalize!(String.to_atom(&1)))

defmodule Decoder do
  @moduledoc false

  # {name, shape} of each layer's weights; matrices are {out, in}.
  def layer_shapes(c) do
    kv = c.kv_heads * c.head_dim

    [
      attn_norm: {c.dim},
      wq: {c.dim, c.dim},
      wk: {kv, c.dim},
      wv: {kv, c.dim},
      wo: {c.dim, c.dim},
      mlp_norm: {c.dim},
      wg: {c.ffn, c.dim},
      wu: {c.ffn, c.dim},
      wd: {c.dim, c.ffn}
    ]
  end

  def params(c, type) do
    key = Nx.Random.key(42) |> Nx.backend_transfer(Moat.Backend)

    # Drawn in the worker (100M normals on Nx.BinaryBackend take hours), and
    # evaluated one by one: left lazy, the first step would evaluate all of
    # them with their f32 draws at once.
    random = fn shape, seed ->
      Nx.with_default_backend(Moat.Backend, fn ->
        {t, _} = Nx.Random.normal(Nx.Random.fold_in(key, seed), 0.0, 0.02, shape: shape, type: {:f, 32})
        t = Nx.as_type(t, type)
        Moat.eval([t])
        t
      end)
    end

    ones = fn shape -> Nx.broadcast(Nx.tensor(1.0, type: type, backend: Moat.Backend), shape) end

    layers =
      for l <- 1..c.layers do
        Map.new(layer_shapes(c), fn
          {name, {_} = shape} -> {name, ones.(shape)}
          {name, shape} -> {name, random.(shape, l * 100 + :erlang.phash2(name, 100))}
        end)
      end

    embed = random.({c.vocab, c.dim}, 7)
    %{layers: List.to_tuple(layers), embed: embed, head: embed, norm: ones.({c.dim})}
  end

  def count(c), do: c.layers * Enum.sum(for {_, s} <- layer_shapes(c), do: Nx.size(s)) + c.vocab * c.dim + c.dim

  # Each {out, in} matrix through Moat.quantize; the embedding stays dense
  # for the lookup, the tied head gets its own quantized copy.
  def quantize(params) do
    q = fn w -> apply(Moat, :quantize, [w, [bits: 4, group_size: 64]]) end

    layers =
      for layer <- Tuple.to_list(params.layers) do
        Map.new(layer, fn {k, w} -> {k, if(Nx.rank(w) == 2, do: q.(w), else: w)} end)
      end

    %{params | layers: List.to_tuple(layers), head: q.(params.head)}
  end

  # One step: `tokens` {B, T} at the caches' offset; the next token {B}
  # (greedy) and the caches. `fused` picks Moat.Fast's kernels or their
  # reference compositions (the same math).
  def step(c, fused, params, caches, tokens) do
    {b, t} = Nx.shape(tokens)
    x = params.embed |> Nx.take(Nx.reshape(tokens, {b * t})) |> Nx.reshape({b * t, c.dim})

    {x, caches} =
      Enum.reduce(0..(c.layers - 1), {x, []}, fn l, {x, done} ->
        w = elem(params.layers, l)
        cache = elem(caches, l)
        h = norm(fused, x, w.attn_norm)
        heads = fn m, n -> h |> mm(m) |> Nx.reshape({b, t, n, c.head_dim}) |> Nx.transpose(axes: [0, 2, 1, 3]) end
        pos = KVCache.positions(cache)
        q = rope(fused, heads.(w.wq, c.heads), c.head_dim, pos)
        k = rope(fused, heads.(w.wk, c.kv_heads), c.head_dim, pos)
        cache = KVCache.update(cache, k, heads.(w.wv, c.kv_heads))
        a = attend(fused, cache, q) |> Nx.transpose(axes: [0, 2, 1, 3]) |> Nx.reshape({b * t, c.dim})
        x = Nx.add(x, mm(a, w.wo))
        h = norm(fused, x, w.mlp_norm)
        x = Nx.add(x, mm(Fast.swiglu(mm(h, w.wg), mm(h, w.wu)), w.wd))
        {x, [cache | done]}
      end)

    last = x |> Nx.reshape({b, t, c.dim}) |> Nx.slice_along_axis(t - 1, 1, axis: 1) |> Nx.reshape({b, c.dim})
    logits = mm(norm(fused, last, params.norm), params.head)
    {Nx.argmax(logits, axis: 1, type: {:s, 32}), caches |> Enum.reverse() |> List.to_tuple()}
  end

  # x {N, in} . w {out, in}
  defp mm(x, w), do: Nx.dot(x, [1], w, [1])

  defp norm(true, x, w), do: Fast.rms_norm(x, w, eps: 1.0e-5)
  defp norm(false, x, w), do: Fast.reference(%Fast.RMSNorm{eps: 1.0e-5}, [x, w])

  defp rope(true, x, d, pos), do: Fast.rope(x, d, offset: pos)

  defp rope(false, x, d, pos) when is_integer(pos),
    do: Fast.reference(%Fast.Rope{dims: d, offset: pos, seq_axis: 2}, [x])

  defp rope(false, x, d, pos), do: Fast.reference(%Fast.Rope{dims: d, offset: nil, seq_axis: 2}, [x, pos])

  defp attend(true, cache, q), do: KVCache.attend(cache, q, mask: :causal)

  defp attend(false, cache, q) do
    lengths = if is_integer(cache.offset), do: Nx.tensor(cache.offset, backend: Moat.Backend), else: cache.offset
    struct = %Fast.SDPA{scale: 1.0 / :math.sqrt(elem(q.shape, 3)), causal: true, extras: [:lengths]}
    Fast.reference(struct, [q, cache.keys, cache.values, lengths])
  end

  def caches(c, type, tensor_offsets) do
    for _ <- 1..c.layers do
      cache = KVCache.new(batch: 1, heads: c.kv_heads, max_len: c.prompt + c.tokens, head_dim: c.head_dim, type: type)

      if tensor_offsets,
        do: %{cache | offset: Nx.tensor(0, backend: Moat.Backend), starts: Nx.tensor(0, backend: Moat.Backend)},
        else: cache
    end
    |> List.to_tuple()
  end
end

info = Moat.Worker.info()

IO.puts(
  "Moat worker: MLX #{info.mlx}, BLAS #{info.blas}, CPU kernels #{info.cpu}, #{System.schedulers_online()} schedulers; " <>
    "#{Float.round(Decoder.count(cfg) / 1.0e6, 1)}M parameters (#{cfg.layers} layers, dim #{cfg.dim}, " <>
    "#{cfg.heads} heads / #{cfg.kv_heads} kv, ffn #{cfg.ffn}, vocab #{cfg.vocab}); prompt #{cfg.prompt}, #{cfg.tokens} tokens\n"
)

prompt = Nx.iota({1, cfg.prompt}, type: {:s, 32}, backend: Moat.Backend) |> Nx.remainder(cfg.vocab)

# Prefill, then `tokens` steps; {prefill µs, [step µs], generated tokens}.
generate = fn step, caches_fun, params, tokens ->
  t0 = System.monotonic_time(:microsecond)
  {next, caches} = step.(params, caches_fun.(), prompt)
  first = Nx.to_flat_list(next)
  prefill = System.monotonic_time(:microsecond) - t0

  {times, {_, _, out}} =
    Enum.map_reduce(1..(tokens - 1)//1, {next, caches, first}, fn _, {next, caches, out} ->
      t = System.monotonic_time(:microsecond)
      {next, caches} = step.(params, caches, Nx.reshape(next, {1, 1}))
      tok = Nx.to_flat_list(next)
      {System.monotonic_time(:microsecond) - t, {next, caches, out ++ tok}}
    end)

  {prefill, times, out}
end

jit = fn fused, opts -> Nx.Defn.jit(&Decoder.step(cfg, fused, &1, &2, &3), [compiler: Moat.Compiler] ++ opts) end

variants = [
  {"eager", fn -> &Decoder.step(cfg, false, &1, &2, &3) end, false, false},
  {"compiled", fn -> jit.(false, []) end, true, false},
  {"compiled + fused", fn -> jit.(true, []) end, true, false},
  {"compiled + fused, donate: false", fn -> jit.(true, donate: false) end, true, false},
  {"compiled + fused", fn -> jit.(true, []) end, true, true}
]

# {bytes, GB/s of the sums, GB/s of the one-row products}: the weights a
# decode step reads, and the rate at which the worker reads them (the best
# of 7, as STREAM reports: on a shared machine the median is the load's).
bandwidth = fn params ->
  weights = for(l <- Tuple.to_list(params.layers), {_, w} <- l, Nx.rank(w) == 2, do: w) ++ [params.head]
  bytes = Enum.sum(for w <- weights, do: Nx.byte_size(w))

  ones =
    Map.new(weights, fn w ->
      {elem(w.shape, 1), Nx.broadcast(Nx.tensor(1.0, type: w.type, backend: Moat.Backend), {1, elem(w.shape, 1)})}
    end)

  sums = fn -> weights |> Enum.map(&Nx.sum/1) |> Nx.stack() |> Nx.to_binary() end

  rows = fn ->
    weights |> Enum.map(&(Nx.dot(ones[elem(&1.shape, 1)], [1], &1, [1]) |> Nx.sum())) |> Nx.stack() |> Nx.to_binary()
  end

  for f <- [sums, rows], do: f.()
  {bytes, for(f <- [sums, rows], do: bytes / Enum.min(samples(7, f)) / 1000)}
end

# ms to copy the caches once (what a step without donation adds: each
# kv_write copies its buffer), the best of 7.
cache_copy = fn type ->
  caches = Decoder.caches(cfg, type, false)
  buffers = for c <- Tuple.to_list(caches), t <- [c.keys, c.values], do: Nx.add(t, 0)
  Moat.eval(Enum.map(buffers, & &1.data.ref))
  copy = fn -> Moat.eval(Enum.map(buffers, &Nx.multiply(&1, 1).data.ref)) end
  copy.()
  Enum.min(samples(7, copy)) / 1000
end

IO.puts("### Generation: prefill #{cfg.prompt} tokens, greedy decode of #{cfg.tokens} (one run)\n")
row(["weights", "path", "prefill (ms)", "decode (tok/s)", "vs eager", "tokens = eager's"])
row(["---", "---", "---:", "---:", "---:", "---"])

cache_bytes = fn type ->
  2 * cfg.layers * cfg.kv_heads * (cfg.prompt + cfg.tokens) * cfg.head_dim * elem(type, 1) / 8
end

summary =
  for type <- types do
    dense = Decoder.params(cfg, type)

    before = bandwidth.(dense)

    rates =
      Enum.reduce(variants, %{}, fn {name, make, tensors, quantized}, acc ->
        eager = acc[:eager]
        label = if quantized, do: "4-bit (#{Nx.Type.to_string(type)} activations)", else: Nx.Type.to_string(type)

        if quantized and not function_exported?(Moat, :quantize, 2) do
          row([label, name, "—", "—", "skipped: no Moat.quantize", "—"])
          acc
        else
          params = if quantized, do: Decoder.quantize(dense), else: dense
          step = make.()
          caches = fn -> Decoder.caches(cfg, type, tensors) end
          # Warm-up: lowering, program definition, first-call costs.
          generate.(step, caches, params, 3)
          prefills = for _ <- 1..2, do: elem(generate.(step, caches, params, 1), 0)
          {prefill, times, out} = generate.(step, caches, params, cfg.tokens)
          rate = 1.0e6 / median(times)
          {eager_rate, eager_out} = eager || {rate, out}
          same = Enum.count(Enum.zip(out, eager_out), fn {a, b} -> a == b end)

          row([
            label,
            name,
            fmt(median([prefill | prefills]) / 1000),
            fmt(rate),
            ratio(rate, eager_rate),
            "#{same}/#{length(out)}"
          ])

          acc |> Map.put_new(:eager, {rate, out}) |> Map.put({name, quantized}, median(times))
        end
      end)

    {bytes, after_} = bandwidth.(dense)
    {type, rates, {bytes, Enum.zip_with(elem(before, 1), after_, &max/2)}, cache_copy.(type)}
  end

IO.puts("\n### Against the roofline: each step reads every weight once (same run)\n")

row([
  "weights",
  "bytes read per token (MB)",
  "read bandwidth, sum / one-row product (GB/s)",
  "roofline (tok/s)",
  "eager",
  "compiled + fused",
  "3× eager",
  "compiled + fused / roofline",
  "cache copy per step: MB, ms (the copy alone), ms (median step, donate: false − donated)"
])

row(["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"])

for {type, rates, {bytes, [sum_bw, row_bw]}, copy_ms} <- summary do
  roof = max(sum_bw, row_bw) * 1.0e9 / bytes
  {eager, _} = rates.eager
  fused = 1.0e6 / rates[{"compiled + fused", false}]
  copy = rates[{"compiled + fused, donate: false", false}] - rates[{"compiled + fused", false}]

  row([
    Nx.Type.to_string(type),
    fmt(bytes / 1.0e6),
    "#{fmt(sum_bw)} / #{fmt(row_bw)}",
    fmt(roof),
    fmt(eager),
    fmt(fused),
    fmt(3 * eager) <> if(3 * eager > roof, do: " (above the roofline)", else: ""),
    "#{round(100 * fused / roof)}%",
    "#{fmt(cache_bytes.(type) / 1.0e6)}, #{fmt(copy_ms)}, #{fmt(copy / 1000)}"
  ])
end
