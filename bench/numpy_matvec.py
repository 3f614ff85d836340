"""x {M, K} @ w.T with w {N, K} in f32 through numpy (OpenBLAS). Arguments:
rounds, then M:K:N shapes, or M:K:N:R to take R different weights in turn
(each product reads another, as a decode step's layers do). Prints `numpy
VERSION`, then one `SHAPE MEDIAN_SECONDS` line per shape."""
import sys
import time

import numpy as np

rounds = int(sys.argv[1])
rng = np.random.default_rng(0)
print("numpy", np.__version__)
for shape in sys.argv[2:]:
    m, k, n, r = ([int(d) for d in shape.split(":")] + [1])[:4]
    x = rng.standard_normal((m, k), dtype=np.float32)
    ws = [rng.standard_normal((n, k), dtype=np.float32) for _ in range(r)]
    for w in ws:
        x @ w.T  # warm up threads and caches
    times = []
    for i in range(rounds * r):
        w = ws[i % r]
        t0 = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - t0)
    print(shape, sorted(times)[len(times) // 2])
