# Moat.Fast's kernels against their reference compositions, both on Moat,
# at decode shapes (one token, a 4096-wide model, 32 query heads of 128 over
# 8 kv heads, a 1024-token prefix). Each sample builds the op(s) and reads
# the (small) result back, or builds a batch of 16 and evaluates them with
# one request; medians of one run. Run with
#   mix run -r bench/support.exs bench/fast.exs
# On the CPU, MLX's fast kernels fall back to compositions of the same ops
# (mlx-cpu 0.32.4); rms_norm and attention run the worker's own one-pass
# kernels instead (fast.cpp: one read and one write per row; attention reads
# each kv head's keys and values once for all its query heads, online
# softmax), the others save frames and graph nodes, not arithmetic.

import Bench
alias Moat.Fast

info = Moat.Worker.info()
IO.puts("Moat worker: MLX #{info.mlx}, BLAS #{info.blas}, #{System.schedulers_online()} schedulers\n")

random = fn seed, shape, type ->
  {t, _} = Nx.Random.normal(Nx.Random.key(seed), shape: shape)
  t |> Nx.as_type(type) |> Nx.backend_transfer(Moat.Backend)
end

cases = fn type ->
  x = random.(1, {1, 1, 4096}, type)
  w = random.(2, {4096}, type)
  q = random.(3, {1, 32, 1, 128}, type)
  k = random.(4, {1, 8, 1024, 128}, type)
  v = random.(5, {1, 8, 1024, 128}, type)

  [
    {"rms_norm {1, 1, 4096}", %Fast.RMSNorm{eps: 1.0e-5}, [x, w]},
    {"layer_norm {1, 1, 4096}", %Fast.LayerNorm{eps: 1.0e-5}, [x, w, w]},
    {"rope {1, 32, 1, 128}, offset 1000", %Fast.Rope{dims: 128, offset: 1000, seq_axis: 2}, [q]},
    {"sdpa q {1, 32, 1, 128}, kv {1, 8, 1024, 128}, causal", %Fast.SDPA{scale: 0.088, causal: true}, [q, k, v]}
  ]
end

n = String.to_integer(System.get_env("MOAT_BENCH_N", "200"))

batch = 16

IO.puts("### Moat.Fast: fused kernel vs reference composition, both on Moat (µs, median of #{n})\n")

IO.puts(
  "Call + readback: one op built and its result read back. Per op in a batch: #{batch} independent ops " <>
    "built, then one `Moat.eval/1` of all, the total divided by #{batch} (one round trip shared, as " <>
    "inside a decode step's graph).\n"
)

row([
  "op",
  "type",
  "fused",
  "reference",
  "reference / fused",
  "fused, per op in a batch",
  "reference, per op in a batch",
  "reference / fused, batched"
])

row(["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"])

for type <- [{:f, 32}, {:bf, 16}], {name, struct, args} <- cases.(type) do
  out = apply(Fast, :reference, [struct, args])
  template = Nx.template(out.shape, out.type)
  fused = fn -> Moat.Backend.block(struct, template, args, nil) |> Nx.to_binary() end
  reference = fn -> Fast.reference(struct, args) |> Nx.to_binary() end
  for _ <- 1..20, do: {fused.(), reference.()}
  # Interleaved, so that drift on a shared machine hits both alike.
  {fs, rs} = Enum.unzip(for _ <- 1..n, do: {time_us(fused), time_us(reference)})
  {f, r} = {median(fs), median(rs)}
  batched = fn op -> time_us(fn -> Moat.eval(for _ <- 1..batch, do: op.()) end) / batch end
  fused_op = fn -> Moat.Backend.block(struct, template, args, nil) end
  reference_op = fn -> Fast.reference(struct, args) end
  {fbs, rbs} = Enum.unzip(for _ <- 1..div(n, 4), do: {batched.(fused_op), batched.(reference_op)})
  {fb, rb} = {median(fbs), median(rbs)}
  row([name, Nx.Type.to_string(type), fmt(f), fmt(r), ratio(r, f), fmt(fb), fmt(rb), ratio(rb, fb)])
end
