"""x {M, K} @ w.T with w {N, K} in f32 through numpy (OpenBLAS). Arguments:
rounds, then M:K:N shapes. Prints `numpy VERSION`, then one `M:K:N
MEDIAN_SECONDS` line per shape."""
import sys
import time

import numpy as np

rounds = int(sys.argv[1])
rng = np.random.default_rng(0)
print("numpy", np.__version__)
for shape in sys.argv[2:]:
    m, k, n = (int(d) for d in shape.split(":"))
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    x @ w.T  # warm up threads and caches
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - t0)
    print(shape, sorted(times)[len(times) // 2])
