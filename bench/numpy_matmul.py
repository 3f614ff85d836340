"""f32 matmul with numpy on this machine. Prints `numpy VERSION`, then one
`N MEDIAN_SECONDS` line per size."""
import sys
import time

import numpy as np

sizes = [int(s) for s in sys.argv[1:]] or [1024, 2048]
rng = np.random.default_rng(0)
print("numpy", np.__version__)
for n in sizes:
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    a @ b  # warm up threads and caches
    times = []
    for _ in range(10 if n <= 1024 else 5):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    print(n, sorted(times)[len(times) // 2])
