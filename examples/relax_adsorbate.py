"""FIRE relaxation of CO on a Pt(111) slab with the bottom two layers fixed.

python examples/relax_adsorbate.py [--model my.ckpt] [--precision tf32x3] [--steps 200]
"""

import argparse
import warnings

from ase.constraints import FixAtoms
from ase.optimize import FIRE

from ase_tcfp32 import TCPETCalculator
from ase_tcfp32.validation import co_on_pt111


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="pet-demo-chgnet", help="uPET name or checkpoint path (default: the bundled demo PET)"
    )
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--fmax", type=float, default=0.05, help="eV/Å")
    parser.add_argument("--steps", type=int, default=200)
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

    atoms = co_on_pt111(height=1.9, size=(3, 3, 4))
    z = atoms.positions[:, 2]
    bottom = [
        i for i, s in enumerate(atoms.get_chemical_symbols()) if s == "Pt" and z[i] < z[atoms.numbers == 78].min() + 2.5
    ]
    atoms.set_constraint(FixAtoms(indices=bottom))
    atoms.calc = calc
    print(calc, f"\n{len(atoms)} atoms, {len(bottom)} fixed")
    converged = FIRE(atoms, logfile="-").run(fmax=args.fmax, steps=args.steps)
    carbon = len(atoms) - 2
    top = z[atoms.numbers == 78].max()
    print(
        f"converged: {converged}; E = {atoms.get_potential_energy():.6f} eV; "
        f"C height {atoms.positions[carbon, 2] - top:.3f} Å, C-O {atoms.get_distance(carbon, carbon + 1):.3f} Å"
    )


if __name__ == "__main__":
    main()
