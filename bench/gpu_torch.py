"""PyTorch's side of bench/gpu.exs: the same measurements on the same card.

Prints `RESULT key value` lines that bench/gpu.exs puts next to Moat's.
Medians of CUDA-event timings; batches of independent ops as on Moat's side.
"""

import statistics
import time

import torch

dev = torch.device("cuda")
props = torch.cuda.get_device_properties(dev)
print(
    f"PyTorch {torch.__version__} on {props.name}, CUDA {torch.version.cuda}, "
    f"allow_tf32 (matmul) = {torch.backends.cuda.matmul.allow_tf32}"
)


def data(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    t = torch.sin(torch.arange(n, device=dev, dtype=torch.int32) * 0.618034)
    return t.reshape(shape).to(dtype)


def timed(reps, n, fn):
    """Median milliseconds of one op, from batches of n."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / n)
    return statistics.median(out)


def result(key, value):
    print(f"RESULT {key} {float(value)!r}")


n = 8192
for label, dtype in [("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32)]:
    a, b = data((n, n), dtype), data((n, n), dtype)
    ms = timed(10, 10, lambda: a @ b)
    result(f"matmul_{label}", 2 * n**3 / (ms * 1e9))
    del a, b

torch.backends.cuda.matmul.allow_tf32 = True
a, b = data((n, n), torch.float32), data((n, n), torch.float32)
result("matmul_tf32", 2 * n**3 / (timed(10, 10, lambda: a @ b) * 1e9))
torch.backends.cuda.matmul.allow_tf32 = False
del a, b

elems = 256 * 1024 * 1024
x, y = data((elems,), torch.float32), data((elems,), torch.float32)
ms = timed(10, 10, lambda: x + y)
result("add_gbps", 3 * 4 * elems / (ms * 1e6))
del x, y

tok, d, h = 4096, 4096, 16384
xin = data((tok, d), torch.bfloat16)
w1 = data((d, h), torch.bfloat16) / 64
w2 = data((h, d), torch.bfloat16) / 128
ms = timed(10, 5, lambda: torch.relu(xin @ w1) @ w2)
result("mlp_tflops", 2 * 2 * tok * d * h / (ms * 1e9))
# Moat's jitted MLP against the same eager PyTorch.
result("jit_mlp_tflops", 2 * 2 * tok * d * h / (ms * 1e9))
del xin, w1, w2


def wall_us(reps, fn):
    """Median microseconds of fn() and a synchronize."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


small = [data(s, torch.float32) / (i + 8) for i, s in enumerate([(32, 784), (784, 256), (256,), (256, 10), (10,)])]


def small_mlp(x, w1, b1, w2, b2):
    logits = torch.relu(x @ w1 + b1) @ w2 + b2
    e = torch.exp(logits - logits.amax(dim=1, keepdim=True))
    return e / e.sum(dim=1, keepdim=True)


for _ in range(20):
    small_mlp(*small).cpu()
result("small_mlp_us", wall_us(500, lambda: small_mlp(*small).cpu()))

# The decoder block of bench/gpu.exs.
F = torch.nn.functional
shapes = [(512,), (512,), (512, 1536), (512, 512), (512,), (512,), (512, 2048), (2048, 512)]
params = [data(s, torch.bfloat16) / (1 if len(s) == 1 else 32) + (1 if i in (0, 4) else 0) for i, s in enumerate(shapes)]


def decoder_block(x, ln1_w, ln1_b, wqkv, wo, ln2_w, ln2_b, w1, w2):
    t = x.shape[1]
    h = F.layer_norm(x, (512,), ln1_w, ln1_b, eps=1e-5)
    q, k, v = (m.reshape(1, t, 8, 64).transpose(1, 2) for m in (h @ wqkv).split(512, dim=2))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, t, 512)
    x = x + a @ wo
    u = F.layer_norm(x, (512,), ln2_w, ln2_b, eps=1e-5) @ w1
    return x + (u * torch.sigmoid(1.702 * u)) @ w2


for t in (1, 128):
    x = data((1, t, 512), torch.bfloat16)
    result(f"block{t}_us", timed(10, 10, lambda: decoder_block(x, *params)) * 1e3)
    result(f"block{t}_one_us", wall_us(200, lambda: decoder_block(x, *params)))

q, k, v = (data((4, 32, 2048, 128), torch.bfloat16) for _ in range(3))
ms = timed(10, 10, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
result("sdpa_tflops", 2 * 2 * 4 * 32 * 2048 * 2048 * 128 * 0.5 / (ms * 1e9))
del q, k, v
q, k, v = data((1, 32, 1, 128), torch.bfloat16), data((1, 8, 1024, 128), torch.bfloat16), data((1, 8, 1024, 128), torch.bfloat16)
# One query after the keys sees them all (MLX aligns a causal mask so;
# PyTorch's is_causal would let it see the first key only).
ms = timed(10, 10, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
result("sdpa_decode_us", ms * 1e3)

# Transfers of 1 GiB from and to Python bytes, as Moat's are from and to
# binaries in the VM.
nbytes = 1024**3
blob = bytes(range(8)) * (nbytes // 8)


def wall(reps, fn):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def up():
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev)
    (t + 1).sum()


s = wall(5, up)
result("from_binary_gbps", nbytes / (s * 1e9))
g = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev)
s = wall(5, lambda: g.cpu().numpy().tobytes())
result("to_binary_gbps", nbytes / (s * 1e9))
del g

small = torch.tensor([1.0, 2.0, 3.0, 4.0], device=dev)


def chain(k):
    acc = small
    for _ in range(k):
        acc = acc + small
    return acc.cpu()


chain(1000)
result("dispatch_us", wall(5, lambda: chain(10_000)) * 1e6 / 10_000)
rt = []
for _ in range(2000):
    t0 = time.perf_counter()
    (small + small).cpu()
    rt.append(time.perf_counter() - t0)
result("roundtrip_us", statistics.median(rt) * 1e6)
