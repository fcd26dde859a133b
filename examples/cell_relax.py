"""Relax positions and cell of a crystal together (FrechetCellFilter + FIRE).

    python examples/cell_relax.py [--model my.ckpt] [--structure POSCAR] [--precision tf32x3]

Without --structure, a rattled 2x2x2 fcc Pt supercell at a strained lattice constant.
"""

import argparse
import warnings

import ase.io
from ase.build import bulk
from ase.filters import FrechetCellFilter
from ase.optimize import FIRE

from ase_tcfp32 import TCPETCalculator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="pet-demo-chgnet", help="uPET name or checkpoint path (default: the bundled demo PET)"
    )
    parser.add_argument("--structure", help="any file ase.io.read understands (3D periodic)")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--fmax", type=float, default=0.01, help="eV/Å")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    # uncertainty_threshold: warn when an atom's energy uncertainty exceeds it. The demo model's
    # per-atom uncertainty is ~0.3 eV in distribution (up to ~0.6 eV on water's oxygens,
    # docs/demo_model.md), above upet's 0.1 eV default that suits PET-MAD: 0.7 eV for it.
    threshold = 0.7 if args.model == "pet-demo-chgnet" else 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        calc = TCPETCalculator(
            args.model, precision=args.precision, device=args.device, uncertainty_threshold=threshold
        )

    if args.structure:
        atoms = ase.io.read(args.structure)
    else:
        atoms = bulk("Pt", "fcc", a=4.0, cubic=True) * (2, 2, 2)
        atoms.rattle(0.03, seed=0)
    atoms.calc = calc
    print(calc)
    print(f"start: volume {atoms.get_volume():.3f} Å³, stress {atoms.get_stress()[:3].round(5)} eV/Å³")
    FIRE(FrechetCellFilter(atoms), logfile="-").run(fmax=args.fmax, steps=args.steps)
    print(f"end:   volume {atoms.get_volume():.3f} Å³, stress {atoms.get_stress()[:3].round(5)} eV/Å³")
    print("cell lengths (Å):", atoms.cell.lengths().round(4), "angles:", atoms.cell.angles().round(2))


if __name__ == "__main__":
    main()
