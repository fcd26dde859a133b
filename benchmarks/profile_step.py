"""Where a step goes on the GPU: wall time, GPU-busy time, kernel launches.

    python benchmarks/profile_step.py [--model random:s] [--molecules 64] [--precisions fp32,tf32x3] [--engine lean]
                                      [--kind conservative|direct|energy] [--compile] [--gpu-ops] [--shapes]

For each precision: ``torch.profiler`` over ``--steps`` calls after warm-up; prints the
wall time per step, the summed CUDA kernel time per step (if it is much smaller than the
wall time, the step is bound by the host: launching kernels, or its own work before the
first kernel and after the last), the number of kernels per step, the operators with the
most host time and those with the most GPU time (``--shapes``: by their inputs' shapes, so
that each layer's GEMM has its own line). ``--kind`` says what a step computes: energy,
forces and stress (``conservative``), the direct heads' forces and stress
(``direct``, ``non_conservative=True``) or the energy alone (``energy``).
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
    model: str,
    precision: str,
    atoms,
    steps: int,
    engine: str = "metatomic",
    compile: bool = False,
    kind: str = "conservative",
    shapes: bool = False,
) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        atoms = atoms.copy()
        atoms.calc = TCPETCalculator(
            model, precision=precision, device=device, engine=engine, compile=compile, non_conservative=kind == "direct"
        )
    rng = np.random.default_rng(0)

    def step():
        atoms.positions += rng.normal(scale=1e-3, size=atoms.positions.shape)
        if kind == "energy":
            atoms.get_potential_energy()
        else:
            atoms.get_forces()

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    for _ in range(3):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - start) / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    averages = prof.key_averages(group_by_input_shape=shapes)
    return {
        "precision": precision,
        "engine": engine,
        "compiled": compile,
        "kind": kind,
        "wall_ms": 1000 * wall,
        "gpu_busy_ms": sum(e.device_time for e in kernels) / 1000 / steps,
        "kernels_per_step": len(kernels) / steps,
        "top_host_ops": averages.table(sort_by="self_cpu_time_total", row_limit=12),
        "top_gpu_ops": averages.table(
            sort_by="device_time_total" if shapes else "self_device_time_total",
            row_limit=60 if shapes else 25,
            max_shapes_column_width=100,
        ),
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
    parser.add_argument("--kind", choices=["conservative", "direct", "energy"], default="conservative")
    parser.add_argument("--gpu-ops", action="store_true", help="also print the operators with the most GPU time")
    parser.add_argument("--shapes", action="store_true", help="the operators by their inputs' shapes (with --gpu-ops)")
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/profile_step_<gpu>.json)"
    )
    args = parser.parse_args()
    model, atoms = resolve_model(args.model), water_box(args.molecules, seed=0)
    rows = [
        profile_precision(model, p, atoms, args.steps, args.engine, args.compile, args.kind, args.shapes)
        for p in args.precisions.split(",")
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
    _results.write("profile_step", rows, ("model", "atoms", "precision", "engine", "compiled", "kind"), out=args.out)


if __name__ == "__main__":
    main()
