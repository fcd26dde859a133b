"""Compare every precision on your own structure: energy, forces, stress, time.

    python examples/compare_precisions.py --model pet-mad-s --structure my.xyz
    python examples/compare_precisions.py                 # a water box and the bundled demo PET

Differences are against FP32 and against the same model evaluated in FP64.
"""

import argparse
import time
import warnings

import ase.io
import numpy as np
import torch

from ase_tcfp32 import PRECISIONS, TCPETCalculator, available_precisions, load_pet
from ase_tcfp32.validation import water_box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="pet-demo-chgnet", help="uPET name or checkpoint path (default: the bundled demo PET)"
    )
    parser.add_argument("--structure", help="any file ase.io.read understands (default: 192-atom water box)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    model = args.model
    # uncertainty_threshold: warn when an atom's energy uncertainty exceeds it. The demo model's
    # per-atom uncertainty is ~0.3 eV in distribution (up to ~0.6 eV on water's oxygens,
    # docs/demo_model.md), above upet's 0.1 eV default that suits PET-MAD: 0.7 eV for it.
    threshold = 0.7 if model == "pet-demo-chgnet" else 0.1
    atoms = ase.io.read(args.structure) if args.structure else water_box(64)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    reference = atoms.copy()
    reference.calc = TCPETCalculator(load_pet(model).to(torch.float64), precision="fp32", device=device)
    e64, f64 = reference.get_potential_energy(), reference.get_forces()
    results = {}
    for row in available_precisions(device):
        if not row.available:
            print(f"{row.precision}: not available on {device} ({row.note})")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            calc = TCPETCalculator(model, precision=row.precision, device=device, uncertainty_threshold=threshold)
        test = atoms.copy()
        test.calc = calc
        start = time.perf_counter()
        energy, forces = test.get_potential_energy(), test.get_forces()
        results[row.precision] = (energy, forces, time.perf_counter() - start, row.backend)

    e32, f32 = results["fp32"][0], results["fp32"][1]
    print(f"{len(atoms)} atoms ({atoms.get_chemical_formula()}), device {device}")
    print(
        f"{'precision':9} {'backend':14} {'E (eV)':>16} {'dE/atom vs fp32':>16} {'dE/atom vs fp64':>16} "
        f"{'max dF vs fp32':>15} {'max dF vs fp64':>15} {'time (s)':>9}"
    )
    for name in PRECISIONS:
        if name in results:
            e, f, t, backend = results[name]
            print(
                f"{name:9} {backend:14} {e:16.6f} {abs(e - e32) / len(atoms):16.2e} {abs(e - e64) / len(atoms):16.2e} "
                f"{np.abs(f - f32).max():15.2e} {np.abs(f - f64).max():15.2e} {t:9.3f}"
            )
    print("(first calls include start-up; see `ase-tcfp32 validate speed` for timings)")


if __name__ == "__main__":
    main()
