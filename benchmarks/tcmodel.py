"""Throughput of the tensor-core model on CPU (target: 512x256x256 tf32 under 0.3 s).

python benchmarks/tcmodel.py
"""

import os
import platform
import time

import numpy as np

from ase_tcfp32.tcmodel import emulated_matmul, matmul, round_to


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}")
    rng = np.random.default_rng(0)
    m, k, n = 512, 256, 256
    for fmt in ("tf32", "bf16", "fp16"):
        a = round_to(rng.standard_normal((m, k)), fmt)
        b = round_to(rng.standard_normal((k, n)), fmt)
        for gpu in ("A100", "H100"):
            t = best_of(lambda: matmul(a, b, gpu=gpu, in_fmt=fmt))
            print(f"matmul {m}x{k}x{n} {fmt:5} {gpu}: {t:.3f} s  ({t / (m * k * n) * 1e9:.1f} ns per MAC)")
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    for precision in ("tf32x3", "bf16x9"):
        for gpu in ("A100", "H100"):
            t = best_of(lambda: emulated_matmul(x, w, precision, gpu), repeats=1)
            print(f"emulated {precision} {m}x{k}x{n} on {gpu}: {t:.3f} s")


if __name__ == "__main__":
    main()
