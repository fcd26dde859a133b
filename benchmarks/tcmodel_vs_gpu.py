"""Does the tensor-core model predict our kernels' bits on this GPU?

    python benchmarks/tcmodel_vs_gpu.py [--gpu-model H100] [--out FILE.json]

Runs each kernel on the GPU (directly: no small-GEMM dispatch to cuBLAS; fp16x3 on Hopper
only) and the model
of ``--gpu-model`` (and of A100, for contrast) on the CPU with the same inputs; prints
the share of bit-identical outputs and the largest difference in units of the last place.
"""

import argparse
import json

import _results
import numpy as np
import torch

from ase_tcfp32._kernels.triton_gemm import TritonBackend, launch
from ase_tcfp32.precision import support
from ase_tcfp32.tcmodel import emulated_matmul


def run_kernel(x: np.ndarray, w: np.ndarray, precision: str) -> np.ndarray:
    """``x @ w.T`` by our kernel for ``precision`` on the GPU, whatever the size."""
    x, w = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    if precision == "fp16x3":
        from ase_tcfp32._kernels import fp16x3

        return fp16x3.launch(x, fp16x3.split_weight(w)).cpu().numpy()
    return launch(x, TritonBackend(precision).gemm(w)).cpu().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-model", default="H100")
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/tcmodel_vs_gpu_<gpu>.json)"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in [(256, 256, 128), (300, 520, 136)]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        precisions = ["tf32", "tf32x3", "bf16x9"] + (["fp16x3"] if support("fp16x3", "cuda").available else [])
        for precision in precisions:
            gpu = run_kernel(x, w, precision)
            for model in (args.gpu_model, "A100"):
                predicted = emulated_matmul(x, w, precision, model)
                same = float(np.mean(predicted.view(np.uint32) == gpu.view(np.uint32)))
                ulp = int(np.abs(predicted.view(np.int32).astype(np.int64) - gpu.view(np.int32).astype(np.int64)).max())
                row = {
                    "shape": f"{m}x{k}x{n}",
                    "precision": precision,
                    "model": model,
                    "identical": same,
                    "max_ulp": ulp,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    _results.write("tcmodel_vs_gpu", rows, ("shape", "precision", "model"), out=args.out)


if __name__ == "__main__":
    main()
