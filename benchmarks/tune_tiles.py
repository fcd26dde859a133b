"""Time the tf32x3 forward kernel over tile configurations on large PET shapes.

    python benchmarks/tune_tiles.py

Prints ms and speed-up vs cuBLAS FP32 for each (BM, BN, BK, warps, stages); used to
choose ``tile_config`` in ``ase_tcfp32/kernels/triton_gemm.py``.
"""


import torch
import triton
from triton.testing import do_bench

from ase_tcfp32.kernels.triton_gemm import TritonBackend, _tf32_linear_kernel

SHAPES = [(691200, 256, 768), (673920, 512, 256), (673920, 256, 1024), (673920, 256, 256), (881280, 768, 384)]
CONFIGS = [  # BM, BN, BK, warps, stages, GROUP_M, FINITE_W (mask the A tile, not the output tile)
    (128, 128, 32, 8, 3, 8, False), (128, 128, 32, 8, 3, 8, True), (128, 128, 32, 8, 4, 8, True),
    (128, 64, 32, 4, 3, 8, True),
]


def main():
    backend = TritonBackend("tf32x3")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda")
        words = backend.prepare(w).forward.words
        y = torch.empty(m, n, device="cuda")
        base = do_bench(lambda: x @ w.T, return_mode="median")
        print(f"{m}x{k}x{n}: cuBLAS FP32 {base:.3f} ms", flush=True)
        for bm, bn, bk, warps, stages, group, cvt in CONFIGS:
            if bn > triton.next_power_of_2(n):
                continue
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

            def call():
                _tf32_linear_kernel[grid](x, words, y, y, m, n, k, k, n, PASSES=3, HAS_BIAS=False, FINITE_W=cvt,
                                          BM=bm, BN=bn, BK=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
            try:
                t = do_bench(call, return_mode="median")
            except Exception as error:  # out of shared memory or registers
                print(f"  {bm:4d} {bn:4d} {bk:3d} w{warps} s{stages} g{group} finite_w{cvt:d}: {type(error).__name__}")
                continue
            print(f"  {bm:4d} {bn:4d} {bk:3d} w{warps} s{stages} g{group} finite_w{cvt:d}: {t:.3f} ms  {base / t:.2f}x", flush=True)


if __name__ == "__main__":
    main()
