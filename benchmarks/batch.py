"""Many structures in one call: ms per ``evaluate`` and per neighbor-list rebuild.

    python benchmarks/batch.py [--model s] [--copies 32] [--molecules 64] [--configs default,fp32,skin0.5]
                               [--calls 20] [--parts] [--out FILE.json]

``--copies`` copies of a water box of ``--molecules`` molecules, each displaced at random by
0.05 Å (like path-integral beads), go through one ``TCPETCalculator.evaluate`` call per
configuration (PET-MAD-shaped model with random weights; speed only). Reported per
configuration: the median ms per batched call (positions moved by 1e-4 Å between calls, so
no list is rebuilt), the median ms per call of one copy alone, how many times the batch's
throughput is that of one copy at a time, the speed-up against FP32's defaults in the same
run, and the ms of one neighbor-list rebuild of the batch (``LeanPET._update_pairs``, timed
alone, median of 3). ``--parts`` also times ``lean.build_pairs`` alone (the pair searches
and the list's assembly, without the copies into the recorded graph's buffers).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import _results
import numpy as np
import torch

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._neighbors import Structures, build_pairs
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box

CONFIGS = {
    "default": {},
    "fp32": {"precision": "fp32"},
    "skin0.5": {"neighbor_skin": 0.5},
    "lean": {"engine": "lean"},
    "compile": {"compile": True},
}
"""Calculator arguments per configuration name (``fp32``: FP32's defaults, the baseline)."""


def _timed(function, repeats: int) -> float:
    """Median ms of ``function()``, the GPU synchronised around each call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))


def measure(model, copies: list, kwargs: dict, calls: int, parts: bool) -> dict:
    """One configuration: batched and single calls, a rebuild, and its parts."""
    rng = np.random.default_rng(1)

    def moved(structures):
        for atoms in structures:
            atoms.positions += rng.normal(0, 1e-4, atoms.positions.shape)
        return structures

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = TCPETCalculator(model, device="cuda", **kwargs)
    start = time.perf_counter()
    calc.evaluate(copies)
    first = time.perf_counter() - start
    calc.evaluate(moved(copies))
    batch_ms = _timed(lambda: calc.evaluate(moved(copies)), calls)
    lean = calc._engine
    row = {
        "first_s": first,
        "batch_ms": batch_ms,
        "engine": calc.engine_used,
        "graphs": lean.cuda_graphs,
        "skin": lean.skin,
        "table_width": lean.width,
        "pairs": lean.pairs.count,
    }
    row["rebuild_ms"] = _timed(lambda: lean._update_pairs(Structures.of(copies)), 3)
    if parts:
        batch = Structures.of(copies)
        positions = torch.from_numpy(batch.positions).cuda()
        cutoff = lean.backend.cutoff + lean.skin
        row["build_pairs_ms"] = _timed(
            lambda: build_pairs(positions, batch.cells, batch.pbcs, batch.sizes, cutoff, 0), 3
        )
    single = [copies[0].copy()]
    calc.evaluate(single)
    calc.evaluate(moved(single))
    row["single_ms"] = _timed(lambda: calc.evaluate(moved(single)), calls)
    row["throughput_vs_single"] = len(copies) * row["single_ms"] / batch_ms
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="s", help="PET-MAD shape of the random-weight model (tiny, xs, s, m)")
    parser.add_argument("--copies", type=int, default=32)
    parser.add_argument("--molecules", type=int, default=64)
    parser.add_argument("--configs", default="default,fp32", help=f"among {', '.join(CONFIGS)}")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--parts", action="store_true", help="also time lean.build_pairs alone")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/batch_<gpu>.json)")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU calls and needs CUDA")
    model = random_checkpoint(args.model)
    box = water_box(args.molecules, seed=0)
    rng = np.random.default_rng(0)
    copies = []
    for _ in range(args.copies):
        atoms = box.copy()
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        copies.append(atoms)
    rows = []
    for name in names:
        row = {
            "config": name,
            "model": f"random-{args.model}",
            "copies": args.copies,
            "atoms": len(box),
            **measure(model, copies, CONFIGS[name], args.calls, args.parts),
        }
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    fp32 = next((r["batch_ms"] for r in rows if r["config"] == "fp32"), None)
    print(f"\n{'config':>10} {'batch ms':>9} {'single ms':>10} {'x single':>9} {'vs fp32':>8} {'rebuild ms':>11}")
    for r in rows:
        versus = f"{fp32 / r['batch_ms']:.2f}" if fp32 else "-"
        print(
            f"{r['config']:>10} {r['batch_ms']:9.1f} {r['single_ms']:10.2f} {r['throughput_vs_single']:9.2f} "
            f"{versus:>8} {r['rebuild_ms']:11.1f}"
        )
    _results.write("batch", rows, ("config", "model", "copies", "atoms"), out=args.out)


if __name__ == "__main__":
    main()
