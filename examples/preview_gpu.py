"""Preview on a CPU what different GPUs' tensor cores compute for a PET model.

    python examples/preview_gpu.py [--model my.ckpt]

Energies and forces of a 24-atom water box with TF32x3 and BF16x9 as the A100, H100 and
B200 tensor cores would compute them (bit-accurate model), compared with FP32 and with the
same model evaluated in FP64. Without --model, the bundled demo PET.
"""

import argparse
import warnings

import numpy as np
import torch

from ase_tcfp32 import TCPETCalculator, load_pet
from ase_tcfp32.validation import water_box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="pet-demo-chgnet", help="model name or checkpoint path (default: the bundled demo PET)"
    )
    args = parser.parse_args()
    model = args.model
    # uncertainty_threshold: warn when an atom's energy uncertainty exceeds it. The demo model's
    # per-atom uncertainty is ~0.3 eV in distribution (up to ~0.6 eV on water's oxygens,
    # docs/demo_model.md), above upet's 0.1 eV default that suits PET-MAD: 0.7 eV for it.
    threshold = 0.7 if model == "pet-demo-chgnet" else 0.1

    atoms = water_box(8, seed=1)
    atoms.calc = TCPETCalculator(load_pet(model).to(torch.float64), precision="fp32", device="cpu")
    e64, f64 = atoms.get_potential_energy(), atoms.get_forces()

    print(f"{'arithmetic':24} {'|E - E_fp64| (eV/atom)':>24} {'max |F - F_fp64| (eV/Å)':>25}")
    runs = [("fp32 (CPU)", dict(precision="fp32"))]
    runs += [
        (f"{p} on {gpu}", dict(precision=p, emulate=gpu))
        for p in ("tf32", "tf32x3", "bf16x9")
        for gpu in ("A100", "H100", "B200")
    ]
    for label, kwargs in runs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            atoms.calc = TCPETCalculator(model, device="cpu", uncertainty_threshold=threshold, **kwargs)
        de = abs(atoms.get_potential_energy() - e64) / len(atoms)
        df = np.abs(atoms.get_forces() - f64).max()
        print(f"{label:24} {de:24.2e} {df:25.2e}")


if __name__ == "__main__":
    main()
