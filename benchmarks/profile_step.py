"""Where a step goes on the GPU: wall time, GPU-busy time, kernel launches.

    python benchmarks/profile_step.py [--model random:s] [--molecules 64] [--precisions fp32,tf32x3] [--engine lean]
                                      [--kind conservative|direct|energy] [--compile] [--gpu-ops] [--shapes] [--gaps]

For each precision: ``torch.profiler`` over ``--steps`` calls after warm-up; prints the
wall time per step, the summed CUDA kernel time per step (if it is much smaller than the
wall time, the step is bound by the host: launching kernels, or its own work before the
first kernel and after the last), the number of kernels per step, the operators with the
most host time and those with the most GPU time (``--shapes``: by their inputs' shapes, so
that each layer's GEMM has its own line). ``--kind`` says what a step computes: energy,
forces and stress (``conservative``), the direct heads' forces and stress
(``direct``, ``non_conservative=True``) or the energy alone (``energy``). ``--gaps``
profiles with Python stacks (host times inflated) and lists where the GPU idled: each gap
between its kernels by the innermost frame of this package (or ASE) the host was in when
the GPU fell idle and the one that launched the next kernel.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import tempfile
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
    gaps: bool = False,
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
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes, with_stack=gaps
    ) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - start) / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    averages = prof.key_averages(group_by_input_shape=shapes)
    return {
        **(idle_gaps(prof, steps) if gaps else {}),
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


def idle_gaps(prof, steps: int, top: int = 12, shortest_us: float = 10.0) -> dict:
    """Where the GPU waited for the host: the gaps of at least ``shortest_us`` between its
    busy intervals (kernels, copies, fills), each named by the innermost frames of this
    package (or ASE) the host was in when the GPU fell idle and when it launched the work
    that ended the gap (``with_stack`` profiles). Returns the idle ms per step and the
    ``top`` (start frame, launch frame) pairs by idle time per step."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    busy = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    frames = _timeline(e for e in events if e.get("cat") == "python_function" and _ours(e["name"]))
    threads = collections.defaultdict(list)  # the backward pass runs on autograd's own thread
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            threads[e["tid"]].append(e)
    operators = {tid: _timeline(ops) for tid, ops in threads.items()}
    python = frames[0][0]["tid"] if frames[0] else None

    def host_at(time: float, tid=python) -> str:
        """Where thread ``tid`` was at ``time`` (µs): our innermost frame, and its innermost operator or CUDA call."""
        return f"{_innermost(frames, time)} / {_innermost(operators.get(tid, ([], [])), time)}"

    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    end = busy[0]["ts"] + busy[0]["dur"] if busy else 0.0
    idle = 0.0
    for event in busy[1:]:
        gap = event["ts"] - end
        if gap >= shortest_us:
            idle += gap
            launch = launches.get(event.get("args", {}).get("correlation"))
            at_launch = host_at(launch["ts"], launch["tid"]) if launch else "(unknown launch)"
            entry = totals[(host_at(end), at_launch, event["name"][:60])]
            entry[0] += gap
            entry[1] += 1
        end = max(end, event["ts"] + event["dur"])
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return {
        "idle_ms_per_step": idle / 1000 / steps,
        "gaps": [
            {
                "idle_ms_per_step": total / 1000 / steps,
                "per_step": count / steps,
                "idle_from": a,
                "until_launch_in": b,
                "kernel": k,
            }
            for (a, b, k), (total, count) in ranked
        ],
    }


def _timeline(events) -> tuple[list, list]:
    """Complete host events sorted by start, with their start times (µs)."""
    ordered = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    return ordered, [e["ts"] for e in ordered]


def _innermost(timeline: tuple[list, list], time: float) -> str:
    """The innermost event of ``timeline`` running at ``time``: the latest start that has not ended
    (nested events start later than their parents; the host's Python runs on one thread)."""
    events, starts = timeline
    for index in range(bisect.bisect_right(starts, time) - 1, -1, -1):
        if time <= events[index]["ts"] + events[index]["dur"]:
            return events[index]["name"].split("/ase_tcfp32/")[-1]
    return "-"


def _ours(name: str) -> bool:
    return "ase_tcfp32" in name or "/ase/" in name or "benchmarks" in name


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
        "--gaps",
        action="store_true",
        help="where the GPU waited for the host: its idle gaps by the host's frames (profiles with Python stacks)",
    )
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/profile_step_<gpu>.json)"
    )
    args = parser.parse_args()
    model, atoms = resolve_model(args.model), water_box(args.molecules, seed=0)
    rows = [
        profile_precision(model, p, atoms, args.steps, args.engine, args.compile, args.kind, args.shapes, args.gaps)
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
        if args.gaps:
            print(f"\n{row['precision']}: GPU idle {row['idle_ms_per_step']:.2f} ms per step (gaps >= 10 µs), largest:")
            for gap in row["gaps"]:
                print(
                    f"  {gap['idle_ms_per_step']:6.3f} ms ({gap['per_step']:.1f}/step) idle from {gap['idle_from']}"
                    f"\n      until a launch in {gap['until_launch_in']} ({gap['kernel']})"
                )
    rows = [{"model": args.model, "atoms": len(atoms), **row} for row in rows]
    _results.write("profile_step", rows, ("model", "atoms", "precision", "engine", "compiled", "kind"), out=args.out)


if __name__ == "__main__":
    main()
