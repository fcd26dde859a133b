"""Where an energy+forces step goes on the GPU: wall time, GPU-busy time, kernel launches.

    python benchmarks/profile_step.py [--model random:s] [--molecules 64] [--precisions fp32,tf32x3] [--engine lean]
                                      [--compile] [--gpu-ops]

For each precision: ``torch.profiler`` over ``--steps`` calls after warm-up; prints the
wall time per step, the summed CUDA kernel time per step (if it is much smaller than the
wall time, the step is bound by the host launching kernels), the number of kernels per
step, the operators with the most host time and those with the most GPU time.
"""

from __future__ import annotations

import argparse
import time
import warnings

import _results
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import water_box
from ase_tcfp32.validation.common import resolve_model


def profile_precision(
    model: str, precision: str, atoms, steps: int, engine: str = "metatomic", compile: bool = False
) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        atoms = atoms.copy()
        atoms.calc = TCPETCalculator(model, precision=precision, device="cuda", engine=engine, compile=compile)
    rng = np.random.default_rng(0)

    def step():
        atoms.positions += rng.normal(scale=1e-3, size=atoms.positions.shape)
        atoms.get_forces()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    averages = prof.key_averages()
    return {
        "precision": precision,
        "engine": engine,
        "compiled": compile,
        "wall_ms": 1000 * wall,
        "gpu_busy_ms": sum(e.device_time for e in kernels) / 1000 / steps,
        "kernels_per_step": len(kernels) / steps,
        "top_host_ops": averages.table(sort_by="self_cpu_time_total", row_limit=12),
        "top_gpu_ops": averages.table(sort_by="self_device_time_total", row_limit=25),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:s")
    parser.add_argument("--molecules", type=int, default=64)
    parser.add_argument("--precisions", default="fp32,tf32x3")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", default="metatomic", help="TCPETCalculator(engine=...)")
    parser.add_argument(
        "--compile", action="store_true", help="TCPETCalculator(compile=True) (compiled during warm-up)"
    )
    parser.add_argument("--gpu-ops", action="store_true", help="also print the operators with the most GPU time")
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/profile_step_<gpu>.json)"
    )
    args = parser.parse_args()
    model, atoms = resolve_model(args.model), water_box(args.molecules, seed=0)
    rows = [
        profile_precision(model, p, atoms, args.steps, args.engine, args.compile) for p in args.precisions.split(",")
    ]
    for row in rows:
        print(
            f"{row['precision']}: {row['wall_ms']:.1f} ms/step wall, {row['gpu_busy_ms']:.1f} ms GPU busy, "
            f"{row['kernels_per_step']:.0f} kernels/step"
        )
    for row in rows:
        print(f"\n{row['precision']}, host time by operator:\n{row['top_host_ops']}")
        if args.gpu_ops:
            print(f"\n{row['precision']}, GPU time by operator:\n{row['top_gpu_ops']}")
    rows = [{"model": args.model, "atoms": len(atoms), **row} for row in rows]
    _results.write("profile_step", rows, ("model", "atoms", "precision", "engine", "compiled"), out=args.out)


if __name__ == "__main__":
    main()
