"""Rotational averaging: the cost of each rotation against one plain evaluation.

    python benchmarks/rotations.py [--model random-s] [--molecules 64] [--orders 3,5]
                                   [--batch-sizes auto] [--property forces] [--repeats 10] [--out FILE.json]

For each water box (3 atoms per molecule) and each ``rotational_average_order`` L, times
one evaluation (``--property``: ``energy``, ``forces`` with the energy, or ``stress`` with
both) of a plain ``TCPETCalculator`` and of one with
``rotational_average_order=L`` (every rotated copy of the quadrature, 308 at L = 5, in
batched evaluations of ``rotational_average_batch_size`` copies; ``auto``: the
calculator's default), in the same process and interleaved. Prints the median ms of each,
the number of rotations and the averaged evaluation's ms per rotation over the plain
evaluation's ms (the issue's target at 192 atoms on the H200: at most 1/3). Writes its rows
into ``benchmarks/results/rotations_<gpu>.json`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse

import _results
import numpy as np
from _timing import timed

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32._rotations import quadrature
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box

KEY = ("model", "atoms", "order", "batch_size", "precision", "property")
"""What identifies a row of the results file."""


def evaluation_ms(calcs: dict, atoms, prop: str, repeats: int) -> dict:
    """Median ms of an evaluation of the property ``prop`` by each calculator of ``calcs``
    (name -> calculator), interleaved; each call sees new positions (a 1e-4 Å nudge), so
    nothing is served from a previous result."""
    times = {name: [] for name in calcs}
    rng = np.random.default_rng(0)
    for _ in range(2 + repeats):  # the first two rounds discarded (warm-up, graph recording)
        for name, calc in calcs.items():
            atoms.positions += 1e-4 * rng.standard_normal(atoms.positions.shape)
            times[name].append(timed(lambda calc=calc: calc.get_property(prop, atoms)))
    return {name: 1000 * float(np.median(t[2:])) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-s", help="random-s, random-m, a uPET name or a checkpoint")
    parser.add_argument("--molecules", default="64", help="water molecules per box (3 atoms each)")
    parser.add_argument("--orders", default="3,5", help="rotational_average_order values")
    parser.add_argument("--batch-sizes", default="auto", help="rotational_average_batch_size values (auto: default)")
    parser.add_argument("--property", default="forces", choices=["energy", "forces", "stress"])
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/rotations_<gpu>.json)")
    args = parser.parse_args()
    model = random_checkpoint(args.model.removeprefix("random-")) if args.model.startswith("random-") else args.model
    plain = TCPETCalculator(model, precision=args.precision, uncertainty_threshold=None)
    rows = []
    print(
        f"{'atoms':>6} {'order':>5} {'batch':>6} {'rotations':>9} {'plain ms':>9} {'averaged ms':>11} {'per rotation':>12}"
    )
    for n_mol in map(int, args.molecules.split(",")):
        atoms = water_box(n_mol)
        for order in map(int, args.orders.split(",")):
            for batch in args.batch_sizes.split(","):
                batch_size = None if batch == "auto" else int(batch)
                averaged = TCPETCalculator(
                    model,
                    precision=args.precision,
                    uncertainty_threshold=None,
                    rotational_average_order=order,
                    rotational_average_batch_size=batch_size,
                )
                ms = evaluation_ms({"plain": plain, "averaged": averaged}, atoms, args.property, args.repeats)
                rotations = len(quadrature(order)[1])
                row = {
                    "model": args.model,
                    "atoms": len(atoms),
                    "order": order,
                    "batch_size": batch,
                    "precision": plain.precision,
                    "property": args.property,
                    "engine": plain.engine_used,
                    "rotations": rotations,
                    "plain_ms": ms["plain"],
                    "averaged_ms": ms["averaged"],
                    "per_rotation": ms["averaged"] / rotations / ms["plain"],
                }
                rows.append(row)
                print(
                    f"{len(atoms):>6} {order:>5} {batch:>6} {rotations:>9} {ms['plain']:>9.2f} "
                    f"{ms['averaged']:>11.2f} {row['per_rotation']:>12.3f}"
                )
                _results.write("rotations", rows, KEY, env=_results.environment(str(plain.device)), out=args.out)


if __name__ == "__main__":
    main()
