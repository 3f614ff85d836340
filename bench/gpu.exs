# Moat on a GPU next to PyTorch on the same card, in the same run: matmul
# (bf16, f16, f32 at 8192), elementwise bandwidth, an eager and a jitted
# MLP (Moat.Compiler), a transformer decoder block, SDPA (Moat.Fast),
# transfers and op dispatch. Run by bin/gpu on the H200 (mix run -r
# bench/support.exs bench/gpu.exs); MOAT_BENCH_PYTHON names the python that
# has torch (bench/gpu_torch.py runs first). Medians; every ratio is Moat /
# PyTorch (above 1× a rate is ahead, a time behind).

import Bench

defmodule Bench.GpuModels do
  import Nx.Defn

  defn(mlp(x, w1, w2), do: x |> Nx.dot(w1) |> Nx.max(0) |> Nx.dot(w2))

  # bench/compiler.exs's MLP: 32×784→256→10, relu, softmax.
  defdelegate small_mlp(x, w1, b1, w2, b2), to: Bench.MLP, as: :mlp

  # A pre-norm decoder block (GPT-2 style): d_model 512, 8 heads of 64,
  # causal self-attention, a 4×d MLP with GELU (sigmoid approximation).
  # Plain Nx calls (Moat.Fast's are not defn), jitted by Moat.Compiler;
  # bench/gpu_torch.py has the same block.
  def decoder_block(x, ln1_w, ln1_b, wqkv, wo, ln2_w, ln2_b, w1, w2, t) do
    heads = fn m -> m |> Nx.reshape({1, t, 8, 64}) |> Nx.transpose(axes: [0, 2, 1, 3]) end
    qkv = x |> Moat.Fast.layer_norm(ln1_w, ln1_b, eps: 1.0e-5) |> Nx.dot(wqkv)
    [q, k, v] = for i <- 0..2, do: heads.(Nx.slice_along_axis(qkv, 512 * i, 512, axis: 2))
    a = Moat.Fast.scaled_dot_product_attention(q, k, v, mask: :causal)
    x = a |> Nx.transpose(axes: [0, 2, 1, 3]) |> Nx.reshape({1, t, 512}) |> Nx.dot(wo) |> Nx.add(x)
    u = x |> Moat.Fast.layer_norm(ln2_w, ln2_b, eps: 1.0e-5) |> Nx.dot(w1)
    u |> Nx.multiply(Nx.sigmoid(Nx.multiply(u, 1.702))) |> Nx.dot(w2) |> Nx.add(x)
  end
end

alias Bench.GpuModels

info = Moat.Worker.info()
:gpu = info.device
[gpu | _] = for %{kind: :gpu} = d <- info.device_info, do: d
{maj, min} = gpu.compute_capability
IO.puts("Moat worker: MLX #{info.mlx} on #{gpu.name} (#{div(gpu.memory, 1024 ** 2)} MiB, sm_#{maj}#{min})")

python = System.get_env("MOAT_BENCH_PYTHON", "python3")
{out, 0} = System.cmd(python, [Path.join(__DIR__, "gpu_torch.py")], stderr_to_stdout: true)

torch =
  for line <- String.split(out, "\n"), String.starts_with?(line, "RESULT "), into: %{} do
    ["RESULT", key, value] = String.split(line, " ")
    {key, String.to_float(value)}
  end

IO.puts(out |> String.split("\n") |> Enum.reject(&String.starts_with?(&1, "RESULT ")) |> Enum.join("\n"))

backend = Moat.Backend
# Independent ops queued fire-and-forget and evaluated in one call: the
# round trip is paid once per batch, as a real pipeline pays it.
batch = fn n, build ->
  outs = for _ <- 1..n, do: build.()
  :ok = Moat.eval(Enum.map(outs, & &1.data.ref))
  Enum.each(outs, &Nx.backend_deallocate/1)
end

timed = fn reps, n, build ->
  batch.(2, build)
  samples(reps, fn -> batch.(n, build) end) |> median() |> Kernel./(n)
end

# Deterministic non-constant data (zeros run faster than real data).
data = fn shape, type ->
  size = Tuple.product(shape)
  t = Nx.iota({size}, type: :s32, backend: backend) |> Nx.multiply(0.618034) |> Nx.sin()
  t |> Nx.reshape(shape) |> Nx.as_type(type)
end

# The TF32 worker: f32 products on TF32 tensor cores (Moat's default is full f32).
{:ok, _} = Moat.Worker.start_link(name: :bench_tf32, tf32: true)

matmul = fn type, worker ->
  n = 8192
  a = data.({n, n}, type) |> Nx.backend_transfer({Moat.Backend, worker: worker})
  b = data.({n, n}, type) |> Nx.backend_transfer({Moat.Backend, worker: worker})
  us = timed.(10, 10, fn -> Nx.dot(a, b) end)
  Nx.backend_deallocate(a)
  Nx.backend_deallocate(b)
  2 * n ** 3 / (us * 1.0e6)
end

results =
  %{
    "matmul_bf16" => matmul.(:bf16, Moat.Worker),
    "matmul_f16" => matmul.(:f16, Moat.Worker),
    "matmul_f32" => matmul.(:f32, Moat.Worker),
    "matmul_tf32" => matmul.(:f32, :bench_tf32)
  }

GenServer.stop(:bench_tf32)

elems = 256 * 1024 * 1024
x = data.({elems}, :f32)
y = data.({elems}, :f32)
us = timed.(10, 10, fn -> Nx.add(x, y) end)
results = Map.put(results, "add_gbps", 3 * 4 * elems / (us * 1000))
Enum.each([x, y], &Nx.backend_deallocate/1)

# An eager two-layer MLP, bf16: 4096 tokens, 4096 -> 16384 -> 4096.
{tok, d, h} = {4096, 4096, 16384}
xin = data.({tok, d}, :bf16)
w1 = data.({d, h}, :bf16) |> Nx.divide(64)
w2 = data.({h, d}, :bf16) |> Nx.divide(128)
:ok = Moat.eval(Enum.map([xin, w1, w2], & &1.data.ref))
mlp = fn -> xin |> Nx.dot(w1) |> Nx.max(0) |> Nx.dot(w2) end
us = timed.(10, 5, mlp)
results = Map.put(results, "mlp_tflops", 2 * 2 * tok * d * h / (us * 1.0e6))
# The same MLP jitted by Moat.Compiler: one program per call.
jit_mlp = Nx.Defn.jit(&GpuModels.mlp/3, compiler: Moat.Compiler)
us = timed.(10, 5, fn -> jit_mlp.(xin, w1, w2) end)
results = Map.put(results, "jit_mlp_tflops", 2 * 2 * tok * d * h / (us * 1.0e6))
Enum.each([xin, w1, w2], &Nx.backend_deallocate/1)

# The small MLP of bench/compiler.exs, jitted: one call and its readback.
small =
  for {s, i} <- Enum.with_index([{32, 784}, {784, 256}, {256}, {256, 10}, {10}]), do: data.(s, :f32) |> Nx.divide(i + 8)

jit_small = Nx.Defn.jit(&GpuModels.small_mlp/5, compiler: Moat.Compiler)
for _ <- 1..20, do: Nx.to_binary(apply(jit_small, small))
results = Map.put(results, "small_mlp_us", samples(500, fn -> Nx.to_binary(apply(jit_small, small)) end) |> median())

# The decoder block, jitted, bf16, batch 1: ten calls queued per evaluation
# (µs per block), and one call waited for (Moat.eval, no readback).
params =
  for {s, i} <- Enum.with_index([{512}, {512}, {512, 1536}, {512, 512}, {512}, {512}, {512, 2048}, {2048, 512}]),
      do:
        data.(s, :bf16) |> Nx.divide(if(tuple_size(s) == 1, do: 1, else: 32)) |> Nx.add(if(i in [0, 4], do: 1, else: 0))

results =
  Enum.reduce([1, 128], results, fn t, acc ->
    x = data.({1, t, 512}, :bf16)
    block = Nx.Defn.jit(&GpuModels.decoder_block(&1, &2, &3, &4, &5, &6, &7, &8, &9, t), compiler: Moat.Compiler)
    call = fn -> apply(block, [x | params]) end
    queued = timed.(10, 10, call)
    one = samples(200, fn -> :ok = Moat.eval([call.().data.ref]) end) |> median()
    acc |> Map.put("block#{t}_us", queued) |> Map.put("block#{t}_one_us", one)
  end)

# SDPA (Moat.Fast), bf16, causal: prefill (4 × 32 heads × 2048 tokens of
# 128) in TFLOP/s (the causal half counted), and one decode step (32 query
# heads over 8 kv heads, a 1024-token prefix) in µs, ten queued.
[q, k, v] = for _ <- 1..3, do: data.({4, 32, 2048, 128}, :bf16)
us = timed.(10, 10, fn -> Moat.Fast.scaled_dot_product_attention(q, k, v, mask: :causal) end)
results = Map.put(results, "sdpa_tflops", 2 * 2 * 4 * 32 * 2048 * 2048 * 128 * 0.5 / (us * 1.0e6))
Enum.each([q, k, v], &Nx.backend_deallocate/1)
{q, k, v} = {data.({1, 32, 1, 128}, :bf16), data.({1, 8, 1024, 128}, :bf16), data.({1, 8, 1024, 128}, :bf16)}

results =
  Map.put(
    results,
    "sdpa_decode_us",
    timed.(10, 10, fn -> Moat.Fast.scaled_dot_product_attention(q, k, v, mask: :causal) end)
  )

# Transfers of 1 GiB: bytes in the VM to a tensor in the worker (the first
# GPU op moves it to the card), and an evaluated GPU tensor back.
bytes = 1024 ** 3
binary = :binary.copy(<<1, 2, 3, 4, 5, 6, 7, 8>>, div(bytes, 8))

up =
  samples(5, fn ->
    t = Nx.from_binary(binary, :u8, backend: backend)
    s = Nx.add(t, 1)
    :ok = Moat.eval([s.data.ref])
    Nx.backend_deallocate(t)
    Nx.backend_deallocate(s)
  end)

t = Nx.from_binary(binary, :u8, backend: backend) |> Nx.add(0)
:ok = Moat.eval([t.data.ref])
down = samples(5, fn -> ^bytes = byte_size(Nx.to_binary(t)) end)
Nx.backend_deallocate(t)
:erlang.garbage_collect()

results =
  results
  |> Map.put("from_binary_gbps", bytes / (median(up) * 1000))
  |> Map.put("to_binary_gbps", bytes / (median(down) * 1000))

# Dispatch: a chain of small adds, evaluated once.
small = Nx.tensor([1.0, 2.0, 3.0, 4.0], backend: backend)

chain = fn small, n ->
  Enum.reduce(1..n, small, fn _, acc -> Nx.add(acc, small) end) |> Nx.to_binary()
end

chain.(small, 1000)
us = (samples(5, fn -> chain.(small, 10_000) end) |> median()) / 10_000
sync = samples(2000, fn -> small |> Nx.add(small) |> Nx.to_binary() end) |> median()

results = results |> Map.put("dispatch_us", us) |> Map.put("roundtrip_us", sync)

# The same with MLX's CUDA graphs off (MLX_USE_CUDA_GRAPHS=0, which the
# worker inherits from the VM's environment).
System.put_env("MLX_USE_CUDA_GRAPHS", "0")
{:ok, _} = Moat.Worker.start_link(name: :bench_no_graphs)
System.delete_env("MLX_USE_CUDA_GRAPHS")
small = Nx.tensor([1.0, 2.0, 3.0, 4.0], backend: {Moat.Backend, worker: :bench_no_graphs})
chain.(small, 1000)
us = (samples(5, fn -> chain.(small, 10_000) end) |> median()) / 10_000
sync = samples(2000, fn -> small |> Nx.add(small) |> Nx.to_binary() end) |> median()
results = results |> Map.put("dispatch_nographs_us", us) |> Map.put("roundtrip_nographs_us", sync)
GenServer.stop(:bench_no_graphs)

rows = [
  {"matmul bf16 8192³ (TFLOP/s)", "matmul_bf16"},
  {"matmul f16 8192³ (TFLOP/s)", "matmul_f16"},
  {"matmul f32 8192³, full f32 (TFLOP/s)", "matmul_f32"},
  {"matmul f32 8192³, TF32 (`tf32: true`; PyTorch `allow_tf32`) (TFLOP/s)", "matmul_tf32"},
  {"add f32, 256M elements (GB/s, 3 × 1 GiB moved)", "add_gbps"},
  {"eager MLP bf16 4096×4096→16384→4096 (TFLOP/s)", "mlp_tflops"},
  {"jitted MLP (Moat.Compiler; PyTorch eager), same shapes (TFLOP/s)", "jit_mlp_tflops"},
  {"jitted MLP f32 32×784→256→10 + softmax, call + readback (µs)", "small_mlp_us"},
  {"decoder block bf16 (d 512, 8 heads), seq 1, 10 queued (µs per block)", "block1_us"},
  {"decoder block, seq 1, one call waited for (µs)", "block1_one_us"},
  {"decoder block, seq 128, 10 queued (µs per block)", "block128_us"},
  {"decoder block, seq 128, one call waited for (µs)", "block128_one_us"},
  {"SDPA bf16 causal, 4×32 heads×2048×128 (TFLOP/s)", "sdpa_tflops"},
  {"SDPA bf16 decode, 32 q heads over 8 kv heads, 1024 keys (µs)", "sdpa_decode_us"},
  {"from_binary 1 GiB + first GPU op (GB/s)", "from_binary_gbps"},
  {"to_binary 1 GiB (GB/s)", "to_binary_gbps"},
  {"op dispatch, chained small adds (µs/op)", "dispatch_us"},
  {"round trip: small add + to_binary (µs)", "roundtrip_us"},
  {"op dispatch, MLX's CUDA graphs off (µs/op)", "dispatch_nographs_us"},
  {"round trip, MLX's CUDA graphs off (µs)", "roundtrip_nographs_us"}
]

transfer = if Moat.Client.conn(Moat.Worker).shared, do: "shared memory", else: "the pipe"
IO.puts("\n### GPU: Moat next to PyTorch (transfers through #{transfer})\n")
row(["", "Moat", "PyTorch", "Moat / PyTorch"])
row(["---", "---:", "---:", "---:"])

for {label, key} <- rows do
  m = results[key]
  p = torch[key]
  row([label, fmt(m), if(p, do: fmt(p), else: "–"), if(p, do: ratio(m, p), else: "–")])
end
