"""The work LAMMPS hands one GPU: a cubic domain of water and its halo, per MD step.

    python benchmarks/domains.py [--model s] [--sides 20,40,60] [--steps 2] [--out FILE.json]

For each domain side L (Å) of ``--sides``: a cube of side L + 2 h is cut out of the
17,280-atom water box (``water_box(5760)``) repeated as often as needed, h being the halo
that ``ase_tcfp32.lammps`` asks LAMMPS for (R_eff + its neighbor skin); the atoms of the
inner cube of side L are the domain's own. The cluster is evaluated as the ``fix external``
callback evaluates a rank's atoms (``LAMMPSForces``: non-periodic, the engine's energy
weighted 1 on owned atoms and 0 on ghosts, forces on every atom) by the default calculator
(whole, or in pieces past what fits). Per side: the atoms owned and computed, the mean
time of an evaluation after moving every atom by ~0.005 Å (after one warm-up), and the
time per owned atom.
"""

from __future__ import annotations

import argparse
import warnings

import _results
import numpy as np
from _timing import timed
from ase import Atoms

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.lammps import SKIN, domain_forces, receptive_field
from ase_tcfp32.testing import random_checkpoint
from ase_tcfp32.validation import water_box


def domain(base: Atoms, side: float, halo: float) -> tuple[Atoms, int]:
    """A non-periodic cube of side ``side`` + 2 ``halo`` (Å) of ``base`` repeated, its owned
    atoms (those of the inner cube of side ``side``) first, and how many they are."""
    extent = side + 2 * halo
    repeats = int(np.ceil(extent / base.cell.lengths().min()))
    big = base.repeat((repeats,) * 3)
    positions = big.positions
    inside = (positions < extent).all(1)
    owned = ((positions >= halo) & (positions < halo + side)).all(1)
    order = np.concatenate([np.flatnonzero(inside & owned), np.flatnonzero(inside & ~owned)])
    cluster = Atoms(numbers=big.numbers[order], positions=positions[order], pbc=False)
    return cluster, int((inside & owned).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="s")
    parser.add_argument("--sides", default="20,40,60", help="domain sides (Å)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/domains_<gpu>.json)")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = TCPETCalculator(random_checkpoint(args.model), progress=False)
    halo = receptive_field(calc.pet) + SKIN
    base = water_box(5760, seed=0)
    rng = np.random.default_rng(1)
    rows = []
    for side in (float(s) for s in args.sides.split(",")):
        cluster, owned = domain(base, side, halo)
        times = []
        for _ in range(args.steps + 1):  # the first, a warm-up, not counted
            cluster.positions += rng.normal(scale=0.005, size=cluster.positions.shape)
            times.append(timed(lambda: domain_forces(calc, cluster, owned)))
        pieces = calc._engine.pieces
        row = {"model": f"random-{args.model}", "precision": calc.precision, "side_A": side, "halo_A": halo}
        row.update(owned=owned, computed=len(cluster), halo_factor=len(cluster) / owned)
        row.update(in_pieces=pieces is not None and len(cluster) > pieces.above, s=float(np.mean(times[1:])))
        row.update(us_per_owned_atom=1e6 * row["s"] / owned, us_per_computed_atom=1e6 * row["s"] / len(cluster))
        rows.append(row)
        print(row, flush=True)
        env = _results.environment("cuda")
        _results.write("domains", rows, ("model", "precision", "side_A"), env=env, out=args.out)


if __name__ == "__main__":
    main()
