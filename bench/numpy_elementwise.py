"""numpy's element-wise math on this machine, for bench/kernels.exs. Prints
`numpy VERSION`, then one `NAME MEDIAN_SECONDS` line per case, interleaving
the cases over ROUNDS rounds. The inputs are what bench/kernels.exs builds."""
import sys
import time

import numpy as np

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
n = 1 << 20
x = np.linspace(-4.0, 4.0, n, dtype=np.float32)
pos = np.linspace(0.01, 8.0, n, dtype=np.float32)
big = np.linspace(-0.5, 8.0, n, dtype=np.float32)
s = np.linspace(-4.0, 4.0, 8 * 128 * 128, dtype=np.float32).reshape(8, 128, 128)
g = np.linspace(-4.0, 4.0, 128 * 2048, dtype=np.float32).reshape(128, 2048)
c = np.float32(0.7978846)


def softmax(a):
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gelu_tanh(a):
    return 0.5 * a * (1 + np.tanh(c * (a + np.float32(0.044715) * a * a * a)))


cases = {
    "add": lambda: x + pos,
    "exp": lambda: np.exp(x),
    "expm1": lambda: np.expm1(x),
    "log": lambda: np.log(pos),
    "log1p": lambda: np.log1p(big),
    "tanh": lambda: np.tanh(x),
    "sigmoid": lambda: 1 / (1 + np.exp(-x)),
    "sin": lambda: np.sin(x),
    "cos": lambda: np.cos(x),
    "rsqrt": lambda: 1 / np.sqrt(pos),
    "pow": lambda: np.power(pos, x),
    "softmax": lambda: softmax(s),
    "gelu_tanh": lambda: gelu_tanh(g),
}
# The same ops writing into 8 preallocated outputs in turn (NAME@8), as
# Moat's per-op timing keeps its batch's 8 outputs alive (36 MB with the
# input, past the L3), where numpy's own call reuses the block it freed
# (still in the cache); and copies, the floor of any such op.
outs = [np.empty(n, dtype=np.float32) for _ in range(8)]
turn = [0]


def into(f, *args):
    def run():
        turn[0] = (turn[0] + 1) % 8
        f(*args, out=outs[turn[0]])

    return run


cases.update(
    {
        "copy@1": lambda: np.copyto(outs[0], x),
        "copy@8": into(lambda a, out: np.copyto(out, a), x),
        "exp@8": into(np.exp, x),
        "log@8": into(np.log, pos),
        "tanh@8": into(np.tanh, x),
        "add@8": into(np.add, x, pos),
    }
)
times = {k: [] for k in cases}
for f in cases.values():
    f()
for _ in range(rounds):
    for k, f in cases.items():
        t0 = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t0)
print("numpy", np.__version__)
for k, ts in times.items():
    print(k, sorted(ts)[len(ts) // 2])
