"""Time per ASE MD step (forces + velocity Verlet + neighbor-list updates) per precision.

    python benchmarks/md_step.py [--models s,m] [--molecules 64,5760] [--engines metatomic,lean,graphs]
                                 [--compile both] [--low-memory] [--kinds conservative,direct,energy]
                                 [--unfused] [--out FILE.json]

Writes its rows into ``benchmarks/results/md_step_<gpu>.json`` (``--out``: elsewhere),
replacing the rows of the same configurations and keeping the others.

For PET-MAD-S/-M-shaped models with random weights (speed only: their forces are not
physical, so the runs are short and the time step small) and water boxes of 192 and
17,280 atoms, runs velocity Verlet through ``TCPETCalculator`` in each precision and
prints the median ms per step, the speed-up against FP32 measured in the same run (in the
same configuration, and the best FP32 of all engines and compile modes measured: the
best FP32 a user can get), and the peak GPU memory. ``--engines`` picks the calculator's
evaluation engines (``TCPETCalculator(engine=...)``). A configuration that runs out of
memory or fails is reported as such. ``--low-memory`` recomputes the GNN layers in the
backward pass (``TCPETCalculator(low_memory=True)``). ``--kinds`` says what a step computes:
``conservative`` (forces and stress by the backward pass, the default), ``direct`` (the
model's direct force and stress heads, ``non_conservative=True``: one forward pass) and
``energy`` (not an MD step: energy-only calls, ``get_potential_energy()`` on moved atoms,
next to the same calls asking for forces too, ``energy_forces``). ``--unfused`` also times
each FP32-accurate row with the GEMM epilogues unfused (``ase_tcfp32._epilogues.unfused``:
norms, residuals, activations and the folded embeddings as separate passes), in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import warnings

import _results
import numpy as np
import torch
from _timing import md_step_times
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from ase_tcfp32 import TCPETCalculator, _epilogues
from ase_tcfp32._lean import LeanPET
from ase_tcfp32.precision import FP32_ACCURATE
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box


def time_steps(
    model,
    precision: str,
    atoms,
    steps: int,
    compile: bool,
    engine: str = "metatomic",
    low_memory: bool = False,
    skin: float = 2.0,
    warmup: int = 3,
    table: bool = False,
    kind: str = "conservative",
) -> dict:
    """Median and minimum ms per MD step and peak GPU memory (GB) of one configuration;
    the first call's time (compilation and graph recording included) separately; for the
    lean engines the neighbor table's final width, its widenings, the pair-list builds and
    whether PET ran on packed rows (``table``: on the neighbor table, even where the
    calculator packs them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = TCPETCalculator(
            model,
            precision=precision,
            device="cuda",
            compile=compile,
            low_memory=low_memory,
            engine=engine,
            neighbor_skin=skin,
            non_conservative=kind == "direct",
        )
    if table and calc._engine is not None:
        calc._engine.packed = False
    atoms = atoms.copy()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, 0.25 * fs)
    gc.collect()  # the earlier rows' calculators, so that the peak is this one's
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if kind in ("energy", "energy_forces"):
        times = call_times(atoms, ["energy"] if kind == "energy" else ["energy", "forces"], warmup + steps)
    else:
        times = md_step_times(dyn, warmup + steps)
    row = {
        "ms": 1000 * float(np.median(times[warmup:])),
        "ms_min": 1000 * float(np.min(times[warmup:])),
        "first_s": times[0],
        "peak_GB": torch.cuda.max_memory_allocated() / 1e9,
    }
    if isinstance(calc._engine, LeanPET):  # the lean engines' neighbor table and Verlet list
        row.update(
            table_width=calc._engine.width,
            widenings=calc._engine.widenings,
            pair_rebuilds=calc._engine.rebuilds,
            edge_rows="packed" if calc._engine.packed else "table",
            packed_rows=calc._engine.rows,
        )
    return row


def call_times(atoms, properties: list[str], calls: int) -> list[float]:
    """Seconds of each of ``calls`` calculations of ``properties`` (ASE names) on atoms moved
    by 1e-4 Å between calls (no neighbor-list rebuild), the GPU synchronised around each."""
    rng = np.random.default_rng(1)
    times = []
    for _ in range(calls):
        atoms.positions += rng.normal(0, 1e-4, atoms.positions.shape)
        torch.cuda.synchronize()
        start = time.perf_counter()
        atoms.calc.calculate(atoms, properties, ["positions"])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def add_speedups(rows: list[dict]) -> None:
    """Speed-ups of each row of one (model, box) group against FP32 in the same
    configuration and against the best FP32 of the group (any engine, compiled or not)."""
    fp32 = {
        (r["engine"], r["compiled"]): r["ms"]
        for r in rows
        if r["precision"] == "fp32" and "ms" in r and r.get("kind", "conservative") == "conservative"
    }
    for row in rows:
        if "ms" not in row:
            continue
        same = fp32.get((row["engine"], row["compiled"]))
        row["speedup_vs_fp32_same_config"] = same / row["ms"] if same else None
        row["speedup_vs_best_fp32"] = min(fp32.values()) / row["ms"] if fp32 else None
        for (engine, compiled), ms in fp32.items():
            if engine == "metatomic":
                row[f"speedup_vs_fp32{'_compiled' if compiled else ''}"] = ms / row["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="s,m")
    parser.add_argument("--molecules", default="64,5760", help="water molecules per box (3 atoms each)")
    parser.add_argument("--precisions", default="fp32,tf32x3,tf32")
    parser.add_argument("--engines", default="metatomic", help="comma-separated: metatomic, lean, graphs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", choices=["no", "yes", "both"], default="no")
    parser.add_argument("--low-memory", action="store_true", help="low_memory=True for every row")
    parser.add_argument("--skin", type=float, default=2.0, help="neighbor_skin in Å")
    parser.add_argument(
        "--table",
        action="store_true",
        help="also time the lean engines' FP32-accurate rows on the neighbor table, not packed rows",
    )
    parser.add_argument(
        "--kinds", default="conservative", help="comma-separated: conservative, direct, energy (see the module doc)"
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="also time the FP32-accurate rows with the GEMM epilogues unfused: what the fusions save, in the same run",
    )
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/md_step_<gpu>.json)")
    args = parser.parse_args()
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    rows = []
    header = f"{'model':>5} {'atoms':>6} {'engine':>9} {'compiled':>8} {'precision':>9} {'ms/step':>9} {'first s':>8} {'peak GB':>8}"
    print(header)
    for shape in args.models.split(","):
        model = random_checkpoint(shape)
        for n_mol in map(int, args.molecules.split(",")):
            atoms = water_box(n_mol, seed=0)
            group = []
            for engine in args.engines.split(","):
                for compiled in modes:
                    layouts = [False, True] if args.table and engine != "metatomic" and not compiled else [False]
                    kinds = [
                        k
                        for kind in args.kinds.split(",")
                        for k in (["energy", "energy_forces"] if kind == "energy" else [kind])
                    ]
                    fusions = [True, False] if args.unfused else [True]
                    configurations = [
                        (p, t, k, f)
                        for p in args.precisions.split(",")
                        for t in layouts
                        for k in kinds
                        for f in fusions
                    ]
                    for precision, table, kind, fused in configurations:
                        if (
                            table
                            and precision not in FP32_ACCURATE
                            or kind != "conservative"
                            and (table or precision == "fp32" and engine != "lean")
                            or not fused
                            and (table or precision not in FP32_ACCURATE)
                        ):
                            continue
                        row = {
                            "model": f"random-{shape}",
                            "atoms": len(atoms),
                            "engine": engine,
                            "compiled": compiled,
                            "precision": precision,
                            "low_memory": args.low_memory,
                            "skin": args.skin,
                            "kind": kind,
                            **({} if fused else {"epilogues": "unfused"}),
                        }
                        try:
                            with contextlib.nullcontext() if fused else _epilogues.unfused():  # the whole run
                                row.update(
                                    time_steps(
                                        model,
                                        precision,
                                        atoms,
                                        args.steps,
                                        compiled,
                                        engine,
                                        args.low_memory,
                                        args.skin,
                                        table=table,
                                        kind=kind,
                                    )
                                )
                        except torch.OutOfMemoryError:
                            row["error"] = "out of memory"
                        except Exception as error:  # a configuration that fails must not stop the others
                            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                        torch.cuda.empty_cache()
                        result = (
                            f"{row['ms']:9.1f} {row['first_s']:8.1f} {row['peak_GB']:8.1f}"
                            if "ms" in row
                            else row["error"]
                        )
                        name = f"{precision}{' (table)' if table else ''}{'' if kind == 'conservative' else ' ' + kind}"
                        name += "" if fused else " unfused"
                        print(
                            f"{shape:>5} {len(atoms):>6} {engine:>9} {str(compiled):>8} {name:>9} {result}", flush=True
                        )
                        group.append(row)
                        save(args.out, rows + group)
            add_speedups(group)
            print(f"speed-ups, {len(atoms)} atoms, PET-{shape.upper()} shape: vs FP32 same config / vs best FP32")
            for row in group:
                if "ms" in row:
                    same = row["speedup_vs_fp32_same_config"]
                    print(
                        f"  {row['engine']:>9} compiled={str(row['compiled']):5} {row['precision']:>7} "
                        f"{row.get('edge_rows', ''):>6} "
                        f"{same if same else float('nan'):6.2f} {row['speedup_vs_best_fp32'] or float('nan'):6.2f}"
                    )
            rows += group
            save(args.out, rows)


KEY = ("model", "atoms", "engine", "compiled", "precision", "low_memory", "skin", "edge_rows", "kind", "epilogues")
"""What identifies a row of the results file: a new row replaces the old one with the same values."""


def save(path: str | None, rows: list[dict]) -> None:
    """Merge the rows so far into the results file (after every row: a run cut short keeps
    what it measured)."""
    _results.write("md_step", rows, KEY, out=path)


if __name__ == "__main__":
    main()
