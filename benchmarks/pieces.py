"""Water boxes beyond what fits whole: the MD step in pieces against the 17,280-atom step.

    python benchmarks/pieces.py [--model s] [--precision auto] [--repeats 2,3] [--compare 2x2x1]
                                [--steps 2] [--out FILE.json]

For a PET-MAD-shaped model with random weights on the GPU: the 17,280-atom water box
(``water_box(5760)``) evaluated whole, then that box repeated ``k x k x k`` times for each
``k`` of ``--repeats`` (138,240 atoms for 2, 466,560 for 3), each rattled by 0.01 Å,
through the default calculator (which evaluates systems too large to fit whole in pieces,
one GNN layer at a time: ``ase_tcfp32._layerwise``). Per size: the mean time of an MD step
(energy + forces + stress after displacing every atom by ~0.005 Å, the neighbor list
reused) over ``--steps`` steps after one warm-up step, the peak memory, the pieces' size,
whether each layer's outputs were kept, and the cost per atom against the 17,280-atom step of the same run. ``--compare`` also
evaluates one box that fits whole both ways (whole, and in pieces of the automatic size)
and records the time ratio and the largest force difference.
"""

from __future__ import annotations

import argparse
import warnings

import _results
import numpy as np
import torch
from _timing import timed

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box


def calculator(model: str, precision: str, **options) -> TCPETCalculator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TCPETCalculator(random_checkpoint(model), precision=precision, progress=False, **options)


def step_time(calc: TCPETCalculator, atoms, steps: int) -> dict:
    """Mean seconds per MD step (after a warm-up step), peak GB, and the last forces."""
    atoms.calc = calc
    rng = np.random.default_rng(1)
    torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        atoms.get_forces()
        atoms.get_stress()

    first = timed(step)
    times = []
    for _ in range(steps):
        atoms.positions += rng.normal(scale=0.005, size=atoms.positions.shape)
        times.append(timed(step))
    return {
        "s": float(np.mean(times)),
        "first_s": first,
        "peak_GB": torch.cuda.max_memory_allocated() / 1e9,
        "forces": atoms.get_forces(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--repeats", default="2,3", help="boxes of k x k x k (or AxBxC) times the 17,280-atom box")
    parser.add_argument("--compare", default=None, help="a repeat such as 2x2x1 evaluated whole and in pieces")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/pieces_<gpu>.json)")
    args = parser.parse_args()
    base = water_box(5760, seed=0)
    calc = calculator(args.model, args.precision)
    whole = step_time(calc, base.copy(), max(args.steps, 5))
    per_atom = whole["s"] / len(base)
    rows = [{"model": f"random-{args.model}", "precision": calc.precision, "atoms": len(base), "mode": "whole"}]
    rows[0].update(s=whole["s"], peak_GB=whole["peak_GB"], per_atom_ratio=1.0, us_per_atom=1e6 * per_atom)
    print(rows[0], flush=True)
    del calc

    def write():
        env = _results.environment("cuda")
        _results.write("pieces", rows, ("model", "precision", "atoms", "mode"), env=env, out=args.out)

    write()
    if args.compare:
        repeat = tuple(int(k) for k in args.compare.split("x"))
        atoms = base.repeat(repeat)
        atoms.rattle(0.01, seed=2)
        results = {}
        for mode, piece_atoms in (("whole", 0), ("compared in pieces", None)):
            calc = calculator(args.model, args.precision, piece_atoms=piece_atoms)
            if piece_atoms is None:  # the automatic piece size, forced for a system that fits whole
                pieces = calc._engine.pieces
                calc = calculator(args.model, args.precision, piece_atoms=pieces.atoms)
            results[mode] = step_time(calc, atoms.copy(), args.steps)
            del calc
            torch.cuda.empty_cache()
        difference = np.abs(results["whole"]["forces"] - results["compared in pieces"]["forces"]).max()
        row = {"model": f"random-{args.model}", "precision": rows[0]["precision"], "atoms": len(atoms)}
        row.update(mode="compared", s=results["compared in pieces"]["s"], whole_s=results["whole"]["s"])
        row.update(outputs_kept=len(atoms) <= pieces.keep)
        row.update(time_ratio=row["s"] / row["whole_s"], max_force_difference=float(difference))
        row.update(force_scale=float(np.abs(results["whole"]["forces"]).max()))
        rows.append(row)
        print(row, flush=True)
        write()
    for repeat in args.repeats.split(","):
        atoms = base.repeat(tuple(int(k) for k in repeat.split("x")) if "x" in repeat else (int(repeat),) * 3)
        atoms.rattle(0.01, seed=2)
        calc = calculator(args.model, args.precision)
        try:
            measured = step_time(calc, atoms, args.steps)
        except torch.OutOfMemoryError as error:
            print(f"{len(atoms)} atoms: {error}", flush=True)
            break
        pieces = calc._engine.pieces
        row = {"model": f"random-{args.model}", "precision": rows[0]["precision"], "atoms": len(atoms)}
        row.update(mode="pieces" if len(atoms) > pieces.above else "whole", piece_atoms=pieces.atoms)
        row.update(outputs_kept=len(atoms) <= pieces.keep)
        row.update(s=measured["s"], first_s=measured["first_s"], peak_GB=measured["peak_GB"])
        row.update(us_per_atom=1e6 * measured["s"] / len(atoms))
        row.update(per_atom_ratio=measured["s"] / len(atoms) / per_atom)
        rows.append(row)
        print(row, flush=True)
        write()
        del calc, atoms
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
