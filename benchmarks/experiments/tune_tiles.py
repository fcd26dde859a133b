"""Time the tf32x3 forward kernel over tile configurations on large PET shapes.

    python benchmarks/experiments/tune_tiles.py

Prints ms and speed-up vs cuBLAS FP32 for each (BM, BN, BK, warps, stages, GROUP_M);
used to choose ``tile_config`` in ``ase_tcfp32/_kernels/triton_gemm.py``.
"""

import torch
import triton
from triton.testing import do_bench

from ase_tcfp32._kernels.triton_gemm import TritonBackend, launch

SHAPES = [(691200, 256, 768), (673920, 768, 256), (673920, 512, 256), (673920, 256, 1024), (673920, 256, 256)]
CONFIGS = [  # BM, BN, BK, warps, stages, GROUP_M
    (128, 128, 32, 8, 3, 8),
    (128, 128, 32, 8, 4, 8),
    (128, 128, 32, 8, 3, 16),
    (128, 128, 64, 8, 2, 8),
    (256, 128, 32, 8, 2, 8),
    (128, 256, 32, 8, 2, 8),
    (128, 64, 32, 4, 3, 8),
    (64, 128, 32, 4, 4, 8),
]


def main():
    backend = TritonBackend("tf32x3")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda")
        base = do_bench(lambda: x @ w.T, return_mode="median")
        print(f"{m}x{k}x{n}: cuBLAS FP32 {base:.3f} ms", flush=True)
        for bm, bn, bk, warps, stages, group in CONFIGS:
            if bn > triton.next_power_of_2(n):
                continue
            config = dict(BM=bm, BN=bn, BK=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
            gemm = backend.gemm(w, config=config)
            label = f"  {bm:4d} {bn:4d} {bk:3d} w{warps} s{stages} g{group}"
            try:
                t = do_bench(lambda: launch(x, gemm), return_mode="median")
            except Exception as error:  # out of shared memory or registers
                print(f"{label}: {type(error).__name__}")
                continue
            print(f"{label}: {t:.3f} ms  {base / t:.2f}x", flush=True)


if __name__ == "__main__":
    main()
