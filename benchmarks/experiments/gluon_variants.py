"""Variants of the Gluon kernels (tf32x3, fp16x3) on the large PET-S GEMMs (Hopper).

    python benchmarks/experiments/gluon_variants.py [--out FILE.json]

For each variant (compiled offline first: registers, spills, waits in
``benchmarks/experiments/compile_sm90.py``), forward time on the 17,280-atom PET-S shapes against
cuBLAS FP32 and the production Triton tf32x3 kernel in the same run, and the error vs FP64
as a multiple of cuBLAS FP32's; cuBLAS TF32 and FP16 (one pass each, not FP32-accurate)
are timed as the tensor cores' practical rates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gluon_tf32x3  # this folder's experiment
import torch
from triton.testing import do_bench

from ase_tcfp32._kernels import fp16x3
from ase_tcfp32._kernels.triton_gemm import TritonBackend
from ase_tcfp32.precision import ieee_fp32_matmul

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for gemm.py
from gemm import environment  # noqa: E402

VARIANTS = {
    "128x128x32 s4 w8 ws": dict(BM=128, BN=128, BK=32, STAGES=4, GROUP_M=8, num_warps=8, WS=True),  # the default
    "128x128x16 s8 w8 ws": dict(BM=128, BN=128, BK=16, STAGES=8, GROUP_M=8, num_warps=8, WS=True),
}
FP16X3_VARIANTS = {
    "fp16x3 128x128x32 s4": dict(BM=128, BN=128, BK=32, STAGES=4, GROUP_M=8, num_warps=8),  # the default
    "fp16x3 128x128x64 s3": dict(BM=128, BN=128, BK=64, STAGES=3, GROUP_M=8, num_warps=8),
    "fp16x3 128x128x32 s6": dict(BM=128, BN=128, BK=32, STAGES=6, GROUP_M=8, num_warps=8),
    "fp16x3 128x128x16 s6": dict(BM=128, BN=128, BK=16, STAGES=6, GROUP_M=8, num_warps=8),
}
SHAPES = [
    (673920, 768, 256),
    (673920, 256, 256),
    (691200, 256, 768),
    (691200, 256, 256),
    (673920, 256, 1024),
    (673920, 512, 256),
    (673920, 512, 512),
]
"""(M, K, N) of the 17,280-atom PET-S layers (benchmarks/gemm.py)."""


def rel_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).norm() / exact.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    triton_backend = TritonBackend("tf32x3")
    rows = []
    for m, k, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(m + k + n)
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        b = torch.randn(n, device="cuda", generator=g)
        exact = x[:16384].double() @ w.double().T + b.double()
        prepared = triton_backend.prepare(w)
        row = {"M": m, "K": k, "N": n}
        row["cublas_fp32_ms"] = do_bench(lambda: torch.addmm(b, x, w.T), return_mode="median")
        base_error = rel_error(torch.addmm(b, x[:16384], w.T), exact)
        with ieee_fp32_matmul():
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            row["cublas_tf32_ms"] = do_bench(lambda: torch.addmm(b, x, w.T), return_mode="median")
        xh, wh, bh = x.half(), w.half(), b.half()
        row["cublas_fp16_ms"] = do_bench(lambda: torch.addmm(bh, xh, wh.T), return_mode="median")
        row["triton_ms"] = do_bench(lambda: triton_backend.forward(x, prepared, b), return_mode="median")
        line = f"{m}x{k}x{n}: cuBLAS {row['cublas_fp32_ms']:.3f} ms, cuBLAS tf32 {row['cublas_fp32_ms'] / row['cublas_tf32_ms']:.2f}x, fp16 {row['cublas_fp32_ms'] / row['cublas_fp16_ms']:.2f}x, triton {row['cublas_fp32_ms'] / row['triton_ms']:.2f}x"
        words = fp16x3.split_weight(w)
        variants = [(name, config, gluon_tf32x3.launch, prepared.forward) for name, config in VARIANTS.items()]
        variants += [(name, config, fp16x3.launch, words) for name, config in FP16X3_VARIANTS.items()]
        for name, config, launch, weight in variants:
            try:
                ms = do_bench(lambda: launch(x, weight, b, config), return_mode="median")
                error = rel_error(launch(x[:16384].contiguous(), weight, b, config), exact)
                row[name] = {"ms": ms, "speedup": row["cublas_fp32_ms"] / ms, "error_vs_fp32": error / base_error}
                line += f", {name} {row[name]['speedup']:.2f}x (err {row[name]['error_vs_fp32']:.2f})"
            except Exception as error:  # a variant that fails must not stop the others
                row[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                line += f", {name} failed"
        row["base_error"] = base_error
        print(line, flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
